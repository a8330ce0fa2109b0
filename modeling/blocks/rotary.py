"""Rotary position embedding: the frequency tables with their scalings, and the rotation op.

Scalings are transformers' `rope_type`s: "default", "linear" (positions divided by `factor`) and
"llama3" (Llama 3.1+: long wavelengths divided by `factor`, short ones kept, a smooth blend between;
transformers' `_compute_llama3_parameters`). Any other type is refused by name before a model is
built (`rope_scaling_error`), since silently ignoring it trains another model.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import paddle
from paddle.autograd import PyLayer

from modeling.autocast import full_precision
from modeling.context_parallel import local_positions

ROPE_TYPES = ("default", "linear", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


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
    needed = {"linear": ("factor",), "llama3": LLAMA3_KEYS}.get(kind, ())
    missing = [key for key in needed if key not in scaling]
    if missing:
        return f"rope_type {kind!r} needs {', '.join(missing)}"
    unknown = sorted(set(scaling or {}) - set(needed) - {"rope_type", "type"})
    return f"{', '.join(unknown)} not modelled for rope_type {kind!r}" if unknown else None


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """1 / theta^(2i / head_dim) for each rotated pair, scaled as `scaling` says (float32)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    kind = rope_type(scaling)
    if kind == "linear":
        return (inv_freq / scaling["factor"]).astype(np.float32)
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        original = scaling["original_max_position_embeddings"]
        wavelength = 2 * math.pi / inv_freq
        scaled = np.where(wavelength > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelength - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelength >= original / high) & (wavelength <= original / low)
        return np.where(medium, blended, scaled).astype(np.float32)
    return inv_freq.astype(np.float32)


@functools.lru_cache(maxsize=8)
def _tables(head_dim: int, theta: float, scaling: tuple | None, seq_len: int, seq_first: bool,
            cp: tuple[int, int]) -> tuple[paddle.Tensor, paddle.Tensor]:
    inv_freq = paddle.to_tensor(inverse_frequencies(head_dim, theta, dict(scaling) if scaling else None))
    degree, rank = cp
    positions = local_positions(seq_len * degree, degree, rank) if degree > 1 else np.arange(seq_len)
    with full_precision():  # O2 white-lists einsum: positions past 256 would round in bf16
        freqs = paddle.einsum("i,j->ij", paddle.to_tensor(positions.astype(np.float32)), inv_freq)
        emb = paddle.concat([freqs, freqs], axis=-1)
        shape = [seq_len, 1, 1, head_dim] if seq_first else [1, seq_len, 1, head_dim]
        return emb.cos().reshape(shape), emb.sin().reshape(shape)


def rotary_tables(config, seq_len: int, seq_first: bool = False,
                  cp: tuple[int, int] = (1, 0)) -> tuple[paddle.Tensor, paddle.Tensor]:
    """cos and sin tables [1, seq, 1, head_dim] (or [seq, 1, 1, head_dim] for sequence-first
    activations) in the half-rotation layout PaddleNLP and transformers use, built once per length
    (they are constants), for the positions of `seq_len` tokens: 0.. without context parallelism,
    the ones cp rank `cp[1]` of `cp[0]` holds with it."""
    scaling = tuple(sorted(config.rope_scaling.items())) if config.rope_scaling else None
    return _tables(config.head_dim, float(config.rope_theta), scaling, seq_len, seq_first, tuple(cp))


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
        ctx.save_for_backward(cos, sin)
        # expanded first: a product broadcasting over inner axes is 10x slower on CPU
        return x * cos.expand(x.shape) + rotate_half(x) * sin.expand(x.shape)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensor()
        first, second = paddle.split(dy * sin.expand(dy.shape), 2, axis=-1)
        return dy * cos.expand(dy.shape) + paddle.concat([second, -first], axis=-1), None, None


def rotate(q, k, config, seq_len: int, seq_first: bool, fused: bool, cp: tuple[int, int] = (1, 0)):
    """q and k rotated by position, the tables rounded once to their dtype. `fused` (a GPU run's
    --use_fused_rope) calls Paddle's `fused_rotary_position_embedding` as PaddleNLP's LLaMA does (the
    half-rotation layout: use_neox_rotary_style=False) with the same tables; it has no CPU kernel
    (untested here)."""
    cos, sin = (table.astype(q.dtype) for table in rotary_tables(config, seq_len, seq_first, cp))
    if fused:
        from paddle.incubate.nn.functional import fused_rotary_position_embedding

        flat = [table.reshape([seq_len, config.head_dim]) for table in (sin, cos)]
        q, k, _ = fused_rotary_position_embedding(q, k, None, sin=flat[0], cos=flat[1],
                                                  use_neox_rotary_style=False, time_major=seq_first)
        return q, k
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x, cos, sin):
    """Rotate [batch, seq, heads, head_dim] (or sequence first) by position; cos and sin are the
    broadcastable tables of `rotary_tables`, computed in fp32 and rounded to x's dtype (as
    transformers does): an fp32 table would promote bf16 q and k to fp32, and the attention would
    then multiply fp32 probabilities by bf16 values, which Paddle refuses."""
    if cos.dtype != x.dtype:
        cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    return _Rotary.apply(x, cos, sin)
