"""Rotary embeddings as a layer declares them (`blocks.rotary.Rotary`), against transformers' own
functions (4.x, this venv's): the inverse frequencies and attention factor of every modelled
`rope_type` (linear, llama3, yarn with and without truncation and with mscale / mscale_all_dim,
longrope's short and long factors chosen by the sequence length, partial rotary), and the rotation
itself for partial rotary (Phi) and interleaved pairs (ERNIE 4.5) against transformers'
`apply_rotary_pos_emb` of those families."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from modeling.blocks.rotary import Rotary, frozen

RTOL = 1e-6
HEAD_DIM, THETA, MAX_POSITIONS = 32, 10000.0, 256
LONG = [1.0 + 0.1 * i for i in range(12)]  # longrope factors for a 24-channel (partial 0.75) rotary
SHORT = [1.0 + 0.01 * i for i in range(12)]
# name -> (rope_scaling, partial_rotary_factor, sequence length)
SCALINGS = {
    "default": (None, 1.0, 64),
    "linear": ({"rope_type": "linear", "factor": 4.0}, 1.0, 64),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}, 1.0, 64),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 1.0, 64),
    "yarn_mscale": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707,
                     "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2}, 1.0, 64),
    "yarn_untruncated": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                          "truncate": False}, 1.0, 64),
    "longrope_short": ({"rope_type": "longrope", "long_factor": LONG, "short_factor": SHORT}, 0.75, 48),
    "longrope_long": ({"rope_type": "longrope", "long_factor": LONG, "short_factor": SHORT}, 0.75, 96),
    "partial": (None, 0.5, 64),
}


def _transformers(scaling, partial: float, seq_len: int):
    """(inverse frequencies, attention factor) from transformers' ROPE_INIT_FUNCTIONS for a config of
    the shape (longrope's `original_max_position_embeddings` is top-level there, as in Phi-3's)."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.PretrainedConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, rope_theta=THETA,
                                           max_position_embeddings=MAX_POSITIONS, partial_rotary_factor=partial,
                                           rope_scaling=scaling)
    if scaling and scaling["rope_type"] == "longrope":
        config.original_max_position_embeddings = 64
    kind = scaling["rope_type"] if scaling else "default"
    inv_freq, attention = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=seq_len)
    return inv_freq.numpy(), attention


@pytest.mark.parametrize("name", list(SCALINGS))
def test_frequencies_are_transformers(name):
    scaling, partial, seq_len = SCALINGS[name]
    if scaling and scaling["rope_type"] == "longrope":
        scaling = {**scaling, "original_max_position_embeddings": 64}  # where our Phi-3 config puts it
    rotary = Rotary(int(HEAD_DIM * partial), THETA, frozen(scaling or {}), max_positions=MAX_POSITIONS)
    inv_freq, attention = rotary.frequencies(seq_len)
    expected, expected_attention = _transformers(SCALINGS[name][0], partial, seq_len)
    np.testing.assert_allclose(inv_freq, expected, rtol=RTOL)
    assert attention == pytest.approx(expected_attention, rel=1e-12)


def _rotated(rotary: Rotary, x: np.ndarray) -> np.ndarray:
    q = paddle.to_tensor(x)
    return rotary.rotate(q, q, False, False)[0].numpy()


def test_partial_rotary_is_phi3s():
    """Phi-3's apply_rotary_pos_emb: the first dim x partial channels rotate by halves, the rest pass."""
    import torch
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    rotary = Rotary(24, THETA, max_positions=MAX_POSITIONS)
    x = np.random.default_rng(0).standard_normal([2, 10, 3, HEAD_DIM]).astype(np.float32)
    cos, sin = (t.numpy()[0, :, 0] for t in rotary.tables(10, False, (1, 0)))  # [seq, 24]
    theirs, _ = apply_rotary_pos_emb(torch.tensor(x).transpose(1, 2), torch.tensor(x).transpose(1, 2),
                                     torch.tensor(cos)[None], torch.tensor(sin)[None])
    np.testing.assert_allclose(_rotated(rotary, x), theirs.transpose(1, 2).numpy(), rtol=RTOL, atol=RTOL)


def test_interleaved_rotary_gives_ernies_scores():
    """ERNIE 4.5 rotates interleaved pairs; ours rotates the same pairs after a fixed permutation of
    the channels (evens, then odds), applied to q and k alike, so every q.k is ERNIE's."""
    import torch
    from transformers.models.ernie4_5.modeling_ernie4_5 import apply_rotary_pos_emb

    rotary = Rotary(HEAD_DIM, 500000.0, interleaved=True, max_positions=MAX_POSITIONS)
    rng = np.random.default_rng(1)
    q, k = (rng.standard_normal([1, 12, 2, HEAD_DIM]).astype(np.float32) for _ in range(2))
    cos, sin = (t.numpy()[0, :, 0] for t in rotary.tables(12, False, (1, 0)))
    theirs = apply_rotary_pos_emb(torch.tensor(q).transpose(1, 2), torch.tensor(k).transpose(1, 2),
                                  torch.tensor(cos)[None], torch.tensor(sin)[None])
    their_scores = torch.einsum("bhsd,bhtd->bhst", *theirs).numpy()
    ours_q, ours_k = rotary.rotate(paddle.to_tensor(q), paddle.to_tensor(k), False, False)
    our_scores = np.einsum("bshd,bthd->bhst", ours_q.numpy(), ours_k.numpy())
    np.testing.assert_allclose(our_scores, their_scores, rtol=1e-5, atol=1e-5)
