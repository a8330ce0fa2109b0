"""Rotary position embedding as a layer declares it (`Rotary`): which channels of a head rotate (the
first `dim`: partial rotary), in which pairing (halves, as LLaMA; or interleaved pairs, as ERNIE 4.5
and DeepSeek), with which frequencies (theta and a scaling), and the rotation op.

Scalings are transformers' `rope_type`s: "default", "linear" (positions divided by `factor`),
"llama3" (Llama 3.1+: long wavelengths divided by `factor`, short ones kept, a smooth blend between),
"yarn" (NTK-by-parts interpolation between `beta_fast` and `beta_slow` rotations, with an attention
factor on cos and sin from `mscale`/`mscale_all_dim`), "longrope" (Phi-3/4: per-frequency `long_factor`
past `original_max_position_embeddings` tokens, `short_factor` within, and its attention factor),
"proportional" (Gemma 4's full layers: the first `partial_rotary_factor` of the pairs turn at the frequencies
of the whole head's dimension, the others not at all, over the whole head; positions divided by `factor`);
transformers' `_compute_*_parameters` are the reference (tests compare tables). Any other type is
refused by name before a model is built (`rope_scaling_error`), since silently ignoring it trains
another model. Interleaved pairs are rotated as halves after a fixed channel permutation (evens, then
odds) of q and k alike: q.k is unchanged by a permutation applied to both, and the permutation is a
transpose that keeps nothing for backward.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle
from paddle.autograd import PyLayer

from modeling.autocast import full_precision
from modeling.context_parallel import local_positions
from modeling.saved_tensors import kept

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")
NEEDED = {"linear": ("factor",),
          "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
          "yarn": ("factor",), "longrope": ("long_factor", "short_factor")}
OPTIONAL = {"yarn": ("original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                     "attention_factor", "truncate"),
            "longrope": ("factor", "attention_factor", "original_max_position_embeddings"),
            "proportional": ("factor", "partial_rotary_factor")}


def rope_type(scaling: dict | None) -> str:
    """The scaling's type; transformers' older configs name it "type"."""
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


def rope_scaling_error(scaling: dict | None) -> str | None:
    """Why `scaling` (a config's rope_scaling) cannot be modelled, or None when it can."""
    kind = rope_type(scaling)
    if kind not in ROPE_TYPES:
        return f"rope_type {kind!r} is not modelled (only {', '.join(ROPE_TYPES)}); it changes the positions"
    needed = NEEDED.get(kind, ())
    missing = [key for key in needed if key not in scaling]
    if missing:
        return f"rope_type {kind!r} needs {', '.join(missing)}"
    unknown = sorted(set(scaling or {}) - set(needed) - set(OPTIONAL.get(kind, ())) - {"rope_type", "type"})
    return f"{', '.join(unknown)} not modelled for rope_type {kind!r}" if unknown else None


def frozen(value: Any) -> Any:
    """A config value made hashable (lists as tuples, dicts as sorted item tuples)."""
    if isinstance(value, dict):
        return tuple(sorted((key, frozen(item)) for key, item in value.items()))
    if isinstance(value, list):
        return tuple(frozen(item) for item in value)
    return value


@dataclass(frozen=True)
class Rotary:
    """A layer's rotary embedding: the first `dim` channels of each q and k head rotate (partial
    rotary keeps the rest), by halves or `interleaved` pairs, at frequencies from `theta` and
    `scaling` (a frozen rope_scaling: `frozen(dict)`); `max_positions` is the config's
    max_position_embeddings (yarn's and longrope's defaults read it)."""

    dim: int
    theta: float
    scaling: tuple = ()
    interleaved: bool = False
    max_positions: int = 0

    @property
    def kind(self) -> str:
        return rope_type(dict(self.scaling))

    def frequencies(self, seq_len: int) -> tuple[np.ndarray, float]:
        """(inverse frequencies per rotated pair (float32), the attention factor cos and sin are
        multiplied by) for a sequence of `seq_len` positions (longrope's choice depends on it)."""
        scaling, dim = dict(self.scaling), self.dim
        exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
        inv_freq = (1.0 / (self.theta ** exponents)).astype(np.float32)
        kind = self.kind
        if kind == "linear":
            return (inv_freq / scaling["factor"]).astype(np.float32), 1.0
        if kind == "llama3":
            return _llama3(inv_freq, scaling), 1.0
        if kind == "yarn":
            return _yarn(inv_freq, exponents, self.theta, dim, scaling, self.max_positions)
        if kind == "longrope":
            return _longrope(exponents, self.theta, scaling, self.max_positions, seq_len)
        if kind == "proportional":
            turning = int(scaling.get("partial_rotary_factor", 1.0) * dim // 2)
            inv_freq = np.concatenate([inv_freq[:turning], np.zeros(dim // 2 - turning, np.float32)])
            return (inv_freq / scaling.get("factor", 1.0)).astype(np.float32), 1.0
        return inv_freq, 1.0

    def tables(self, seq_len: int, seq_first: bool, cp: tuple[int, int]) -> tuple[paddle.Tensor, paddle.Tensor]:
        """cos and sin [1, seq, 1, dim] (or [seq, 1, 1, dim] for sequence-first activations) in the
        half-rotation layout, for the positions of `seq_len` tokens: 0.. without context parallelism,
        the ones cp rank `cp[1]` of `cp[0]` holds with it (the whole sequence's length chooses
        longrope's factors)."""
        return _tables(self, seq_len, seq_first, tuple(cp))

    def rotate(self, q, k, seq_first: bool, fused: bool, cp: tuple[int, int] = (1, 0),
               positions: paddle.Tensor | None = None):
        """q and k rotated by position, the tables rounded once to their dtype. `positions` [batch, seq]
        (per-document attention: positions restart at each document) picks each token's row of the
        tables; None rotates token i by position i. `fused` (a GPU run's --use_fused_rope) calls
        Paddle's `fused_rotary_position_embedding` as PaddleNLP's LLaMA does (use_neox_rotary_style=
        False, its `position_ids`) where the rotary is the plain whole-head one; it has no CPU kernel
        (untested here). `k` None (a layer reusing another's keys): the queries alone, and None."""
        seq_len = q.shape[0 if seq_first else 1]
        if positions is None:
            tables = self.tables(seq_len, seq_first, cp)
        else:  # rows picked by position: the table of the whole sequence (under cp, of every rank's tokens)
            tables = self.tables(seq_len * cp[0], False, (1, 0))
        head_dim = q.shape[-1]
        if fused and self.dim == head_dim and not self.interleaved:
            from paddle.incubate.nn.functional import fused_rotary_position_embedding

            flat = [table.astype(q.dtype).reshape([-1, self.dim]) for table in reversed(tables)]
            q, k, _ = fused_rotary_position_embedding(q, k, None, sin=flat[0], cos=flat[1], position_ids=positions,
                                                      use_neox_rotary_style=False, time_major=seq_first)
            return q, k
        if positions is not None:
            tables = (_by_position(table, positions, seq_first) for table in tables)
        cos, sin = (table.astype(q.dtype) for table in tables)
        return self._rotated(q, cos, sin, head_dim), None if k is None else self._rotated(k, cos, sin, head_dim)

    def kept_bytes(self, batch: int, seq_len: int, dtype_bytes: int, documents: bool) -> int:
        """The tables one layer keeps for backward: none in fp32 (every layer shares the constant
        ones), a rounded copy of cos and sin in a narrower dtype, and one row per token when
        positions restart per document (gathered for each batch row)."""
        if not documents and dtype_bytes >= 4:
            return 0
        return 2 * (batch if documents else 1) * seq_len * self.dim * dtype_bytes

    def _rotated(self, x, cos, sin, head_dim: int):
        rotated, kept = (x, None) if self.dim == head_dim else paddle.split(x, [self.dim, head_dim - self.dim], -1)
        if self.interleaved:
            rotated = deinterleave(rotated)
        rotated = apply_rotary(rotated, cos, sin)
        return rotated if kept is None else paddle.concat([rotated, kept], axis=-1)


def deinterleave(x):
    """Channels (0, 1, 2, 3, ...) as (0, 2, 4, ..., 1, 3, 5, ...): interleaved pairs become halves."""
    shape = x.shape
    return x.reshape(shape[:-1] + [shape[-1] // 2, 2]).transpose(list(range(len(shape) - 1)) + [len(shape), len(shape) - 1]) \
        .reshape(shape)


def _llama3(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    scaled = np.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return np.where(medium, blended, scaled).astype(np.float32)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(inv_freq: np.ndarray, exponents: np.ndarray, theta: float, dim: int, scaling: dict,
          max_positions: int) -> tuple[np.ndarray, float]:
    """transformers 5's `_compute_yarn_parameters`: `factor` as given (transformers 4.55 replaced it by
    max_position_embeddings / original when the latter is in rope_scaling: the two agree on released
    configs, and this reads the folder as transformers 5 does)."""
    factor = scaling["factor"]
    original = scaling.get("original_max_position_embeddings") or max_positions
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim) if mscale and mscale_all_dim \
            else _mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction(beta_fast), correction(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = (1 - ramp).astype(np.float32)
    positions = (theta ** exponents).astype(np.float32)
    interpolated = (1.0 / (factor * positions)).astype(np.float32)
    return (interpolated * (1 - extrapolation) + inv_freq * extrapolation).astype(np.float32), float(attention)


def _longrope(exponents: np.ndarray, theta: float, scaling: dict, max_positions: int,
              seq_len: int) -> tuple[np.ndarray, float]:
    """transformers' `_compute_longrope_parameters` with its dynamic update: the long factors once the
    sequence is longer than `original_max_position_embeddings`, else the short ones."""
    original = scaling.get("original_max_position_embeddings") or max_positions
    factor = scaling.get("factor") or max_positions / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    chosen = np.asarray(scaling["long_factor" if seq_len > original else "short_factor"], np.float32)
    return (1.0 / (chosen * (theta ** exponents).astype(np.float32))).astype(np.float32), float(attention)


@functools.lru_cache(maxsize=32)
def _tables(rotary: Rotary, seq_len: int, seq_first: bool, cp: tuple[int, int]) -> tuple[paddle.Tensor, paddle.Tensor]:
    degree, rank = cp
    inv_freq, attention = rotary.frequencies(seq_len * degree)
    positions = local_positions(seq_len * degree, degree, rank) if degree > 1 else np.arange(seq_len)
    with full_precision():  # O2 white-lists einsum: positions past 256 would round in bf16
        freqs = paddle.einsum("i,j->ij", paddle.to_tensor(positions.astype(np.float32)), paddle.to_tensor(inv_freq))
        emb = paddle.concat([freqs, freqs], axis=-1)
        shape = [seq_len, 1, 1, rotary.dim] if seq_first else [1, seq_len, 1, rotary.dim]
        cos, sin = emb.cos(), emb.sin()
        if attention != 1.0:
            cos, sin = cos * attention, sin * attention
        return cos.reshape(shape), sin.reshape(shape)


def _by_position(table: paddle.Tensor, positions: paddle.Tensor, seq_first: bool) -> paddle.Tensor:
    """A [1, seq, 1, dim] table's rows at `positions` [batch, seq]: [batch, seq, 1, dim] (or sequence first)."""
    dim = table.shape[-1]
    rows = paddle.gather(table.reshape([-1, dim]), positions.reshape([-1])).reshape(positions.shape + [1, dim])
    return rows.transpose([1, 0, 2, 3]) if seq_first else rows


def rotate_half(x):
    # split's backward is a concat; slicing's builds zero-filled gradients (5x slower on CPU)
    first, second = paddle.split(x, 2, axis=-1)
    return paddle.concat([-second, first], axis=-1)


class _Rotary(PyLayer):
    """x * cos + rotate_half(x) * sin with a backward that keeps only the (constant) tables.
    Autograd would keep four activation-sized tensors per call (x, the expanded cos, rotate_half(x),
    the expanded sin); the gradient needs none of them:
    dx = dy * cos + rotate_half^T(dy * sin), where rotate_half^T([g1, g2]) = [g2, -g1]."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(*kept(cos, sin))
        # expanded first: a product broadcasting over inner axes is 10x slower on CPU
        return x * cos.expand(x.shape) + rotate_half(x) * sin.expand(x.shape)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensor()
        first, second = paddle.split(dy * sin.expand(dy.shape), 2, axis=-1)
        return dy * cos.expand(dy.shape) + paddle.concat([second, -first], axis=-1), None, None


def apply_rotary(x, cos, sin):
    """Rotate [batch, seq, heads, dim] (or sequence first) by position; cos and sin are the
    broadcastable tables of `Rotary.tables`, computed in fp32 and rounded to x's dtype (as
    transformers does): an fp32 table would promote bf16 q and k to fp32, and the attention would
    then multiply fp32 probabilities by bf16 values, which Paddle refuses."""
    if cos.dtype != x.dtype:
        cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    return _Rotary.apply(x, cos, sin)
