"""Command-line flags declared once, as typed dataclass fields: each argument group is a dataclass
whose fields are its flags (PaddleNLP's names), registered on a parser and read back typed.

A boolean flag takes every form PaddleNLP's command lines use: `--recompute`, `--recompute 1`,
`--recompute true`, `--recompute false`, and `--no-recompute`.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
_TYPES = {"int": int, "float": float, "str": str, "Path": Path}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_bool(text: str) -> bool:
    """A boolean flag's value as PaddleNLP's parser reads it (1/0, true/false, yes/no, on/off)."""
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean; use true or false (or 1 or 0)")


def flag(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field that is also a flag: its default, its help text, argparse extras (choices)."""
    return dataclasses.field(default=default, metadata={"help": help, **extra})


def add_flags(parser: argparse.ArgumentParser, group: type, title: str) -> argparse.ArgumentParser:
    """Register every field of the dataclass `group` as `--<field>` under one help heading."""
    section = parser.add_argument_group(title)
    for spec in dataclasses.fields(group):
        if spec.type == "bool":
            section.add_argument(f"--{spec.name}", nargs="?", const=True, type=parse_bool, default=spec.default,
                                 metavar="BOOL", **spec.metadata)
            section.add_argument(f"--no-{spec.name}", dest=spec.name, action="store_false", help=argparse.SUPPRESS)
        else:
            section.add_argument(f"--{spec.name}", type=_TYPES[spec.type], default=spec.default, **spec.metadata)
    return parser


def boolean_flags(parser: argparse.ArgumentParser) -> set[str]:
    """The destinations of the boolean flags `add_flags` registered."""
    return {action.dest for action in parser._actions if action.type is parse_bool}


def read_flags(group: type[T], namespace: argparse.Namespace) -> T:
    """The dataclass `group` filled from a parsed namespace (fields of other groups are ignored)."""
    return group(**{spec.name: getattr(namespace, spec.name) for spec in dataclasses.fields(group)})


def flags_table(groups: dict[str, type]) -> str:
    """A Markdown table of every flag of `groups` (title -> dataclass): name, default, help, by group,
    in declaration order (docs/flags.md is this text; a test keeps it equal)."""
    lines = []
    for title, group in groups.items():
        lines += [f"## {title}", "", "| flag | default | what it does |", "| --- | --- | --- |"]
        for spec in dataclasses.fields(group):
            default = spec.default if spec.default != "" else '""'
            choices = f" (one of: {', '.join(map(str, spec.metadata['choices']))})" if "choices" in spec.metadata else ""
            text = f"{spec.metadata['help']}{choices}".replace("|", "\\|")
            lines.append(f"| `--{spec.name}` | `{default}` | {text} |")
        lines.append("")
    return "\n".join(lines)
