"""`loss.svg`: the training loss per step and the evaluation loss where measured, drawn as SVG text.

Written directly rather than with matplotlib: importing pyplot and drawing one figure took 1.2-1.8 s
at the end of every run (measured on rank 0 of a 4-rank CPU job, while the other ranks wait), longer
than many of the test runs' steps together; a line chart with axes, ticks, grid and a legend is a
few dozen SVG elements, which a browser, an IDE or GitHub shows as they show a PNG.
"""

from __future__ import annotations

import math
from pathlib import Path
from xml.sax.saxutils import escape

WIDTH, HEIGHT = 720, 420
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 20, 50  # margins around the plotting area
SERIES_STYLE = {"train loss": ("#1f77b4", False), "eval loss": ("#ff7f0e", True)}  # colour, markers


def nice_ticks(low: float, high: float, count: int = 6, whole: bool = False) -> list[float]:
    """About `count` round values (1, 2, 2.5 or 5 times a power of ten apart; whole numbers with
    `whole`, as steps are) covering [low, high]."""
    if high <= low:
        high = low + (abs(low) or 1.0) * 1e-3
    raw = (high - low) / max(count - 1, 1)
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    if whole:
        step = max(round(step), 1)
    first = math.floor(low / step) * step
    return [first + i * step for i in range(int(math.ceil((high - first) / step - 1e-9)) + 1)]


def _label(value: float) -> str:
    return f"{value:.6g}"


def loss_svg(series: dict[str, list[tuple[float, float]]]) -> str:
    """The SVG document of `series` (name -> [(step, loss)], each name one of `SERIES_STYLE`)."""
    points = [point for values in series.values() for point in values]
    steps, losses = [p[0] for p in points] or [0.0, 1.0], [p[1] for p in points] or [0.0, 1.0]
    x_ticks, y_ticks = nice_ticks(min(steps), max(steps), whole=True), nice_ticks(min(losses), max(losses))
    (x0, x1), (y0, y1) = (x_ticks[0], x_ticks[-1]), (y_ticks[0], y_ticks[-1])
    span_x, span_y = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def at(step: float, loss: float) -> tuple[float, float]:
        return (LEFT + (step - x0) / ((x1 - x0) or 1.0) * span_x, TOP + (y1 - loss) / ((y1 - y0) or 1.0) * span_y)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>']
    for tick in x_ticks:
        x, _ = at(tick, y0)
        out.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{TOP + span_y}" stroke="#ddd"/>')
        out.append(f'<text x="{x:.1f}" y="{TOP + span_y + 16}" text-anchor="middle">{_label(tick)}</text>')
    for tick in y_ticks:
        _, y = at(x0, tick)
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + span_x}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_label(tick)}</text>')
    out.append(f'<rect x="{LEFT}" y="{TOP}" width="{span_x}" height="{span_y}" fill="none" stroke="#333"/>')
    out.append(f'<text x="{LEFT + span_x / 2:.1f}" y="{HEIGHT - 10}" text-anchor="middle">step</text>')
    out.append(f'<text transform="translate(16 {TOP + span_y / 2:.1f}) rotate(-90)" text-anchor="middle">loss</text>')
    for row, (name, values) in enumerate((name, values) for name, values in series.items() if values):
        colour, markers = SERIES_STYLE[name]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in (at(*point) for point in values))
        out.append(f'<polyline class="{escape(name)}" points="{path}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        if markers:
            out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>' for x, y in (at(*p) for p in values)]
        legend_y = TOP + 16 + 18 * row
        out.append(f'<line x1="{LEFT + span_x - 110}" y1="{legend_y - 4}" x2="{LEFT + span_x - 86}" y2="{legend_y - 4}" '
                   f'stroke="{colour}" stroke-width="2"/>')
        out.append(f'<text x="{LEFT + span_x - 80}" y="{legend_y}">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def plot_loss(records: list[dict], svg_path: Path) -> Path:
    """Write `loss.svg` from metrics records (`loss` per step, `eval_loss` where measured). A loss
    that is not finite (a diverged step) has no place on the axis: it is left out, as a gap would be."""
    series = {name: [(r["step"], r[key]) for r in records if key in r and math.isfinite(r[key])]
              for name, key in (("train loss", "loss"), ("eval loss", "eval_loss"))}
    Path(svg_path).write_text(loss_svg(series))
    return Path(svg_path)
