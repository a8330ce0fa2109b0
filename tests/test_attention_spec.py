"""Attention as each layer declares it (`CoreSpec` and sinks), on one process in fp32: the blockwise
core (and the ring's kernel around one rank) against the dense reference for sliding windows of
several widths (lengths that do not divide the block size, a window wider than the sequence, a
window of one), soft-caps, sinks, a scale of its own, ALiBi, a v head size unlike q/k's and GQA
(forward rtol 1e-6; q, k, v and sink gradients 1e-5); the dense reference against transformers' own
eager attention of Gemma 2 (scale, soft-cap, window) and GPT-OSS (sinks, window); and that a
windowed layer's blockwise forward visits O(seq x window) key blocks. The flash core's per-layer
choices are tested with the device set to "gpu" (no GPU is reachable here)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from modeling.attention_core import CORES, BlockwiseCore, Heads
from modeling.attention_core.blockwise import Blocks
from modeling.attention_core.spec import PLAIN, CoreSpec, alibi_slopes

FORWARD_RTOL, GRAD_RTOL = 1e-6, 1e-5
# name -> (batch, seq, heads, kv_heads, qk_dim, v_dim, block, spec, sinks)
CASES = {
    "window5_gqa": (2, 37, 4, 2, 8, 8, 8, CoreSpec(window=5), False),
    "window_block_edge": (1, 33, 4, 1, 8, 8, 8, CoreSpec(window=8), False),
    "window17_block6": (2, 40, 6, 2, 8, 8, 6, CoreSpec(window=17), False),
    "window_wider_than_sequence": (1, 20, 2, 2, 8, 8, 8, CoreSpec(window=64), False),
    "window_of_one": (1, 19, 2, 1, 8, 8, 8, CoreSpec(window=1), False),
    "softcap": (2, 29, 4, 2, 16, 16, 8, CoreSpec(softcap=2.0), False),
    "sinks_gqa": (2, 31, 4, 2, 8, 8, 8, PLAIN, True),
    "scale": (1, 25, 4, 4, 8, 8, 8, CoreSpec(scale=0.3), False),
    "v_head_size": (2, 23, 4, 2, 12, 8, 8, CoreSpec(scale=0.2), False),
    "alibi": (2, 30, 4, 2, 8, 8, 8, CoreSpec(alibi=alibi_slopes(4)), False),
    "alibi_window": (1, 35, 6, 3, 8, 8, 8, CoreSpec(window=9, alibi=alibi_slopes(6)), False),
    "gemma2_like": (2, 41, 4, 2, 16, 16, 8, CoreSpec(scale=0.2, window=11, softcap=3.0), False),
    "gpt_oss_like": (2, 37, 4, 2, 8, 8, 8, CoreSpec(window=7), True),
    "everything": (1, 34, 4, 2, 12, 10, 8, CoreSpec(scale=0.25, window=13, softcap=2.5, alibi=alibi_slopes(4)), True),
}


def _inputs(batch, seq, heads, kv_heads, qk_dim, v_dim, seq_first, sinks, seed=0):
    rng = np.random.default_rng(seed)
    lead = [seq, batch] if seq_first else [batch, seq]
    shapes = [lead + [heads, qk_dim], lead + [kv_heads, qk_dim], lead + [kv_heads, v_dim]]
    tensors = [paddle.to_tensor(rng.standard_normal(shape).astype("float32")) for shape in shapes]
    if sinks:
        tensors.append(paddle.to_tensor(rng.standard_normal([heads]).astype("float32")))
    for tensor in tensors:
        tensor.stop_gradient = False
    upstream = paddle.to_tensor(rng.standard_normal(lead + [heads * v_dim]).astype("float32"))
    return tensors, upstream


def _run(core, tensors, upstream, seq_first, spec):
    q, k, v, *sinks = tensors
    out = core(q, k, v, seq_first, spec, sinks[0] if sinks else None)
    return out.numpy(), [g.numpy() for g in paddle.grad((out * upstream).sum(), tensors)]


def _close(got, expected, rtol, what):
    """Within `rtol` of the reference's largest entry (at least 1, the inputs' scale: a window of one
    makes dq exactly zero, and fp32 noise around zero is not an error)."""
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=rtol * max(np.abs(expected).max(), 1.0), err_msg=what)


@pytest.mark.parametrize("seq_first", [False, True], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("case", list(CASES))
def test_blockwise_honours_the_spec_as_the_dense_reference_does(case, seq_first):
    batch, seq, heads, kv_heads, qk_dim, v_dim, block, spec, sinks = CASES[case]
    tensors, upstream = _inputs(batch, seq, heads, kv_heads, qk_dim, v_dim, seq_first, sinks)
    expected, expected_grads = _run(CORES["dense"], tensors, upstream, seq_first, spec)
    got, grads = _run(BlockwiseCore(block), tensors, upstream, seq_first, spec)
    _close(got, expected, FORWARD_RTOL, "forward")
    for name, value, reference in zip("qkvs", grads, expected_grads):
        _close(value, reference, GRAD_RTOL, f"d{name}")


@pytest.mark.parametrize("case", ["softcap", "sinks_gqa", "v_head_size", "scale"])
def test_the_ring_kernel_on_one_rank_honours_the_spec(case):
    """The ring (cp 1: one rank, no shift) with the blockwise kernel: a layer's scale, soft-cap, sinks
    and v head size hold around it (its multi-rank merge is tests/test_context_parallel.py's)."""
    from modeling.attention_core.ring import RingCore

    class Alone:
        degree, rank = 1, 0

    batch, seq, heads, kv_heads, qk_dim, v_dim, block, spec, sinks = CASES[case]
    tensors, upstream = _inputs(batch, seq, heads, kv_heads, qk_dim, v_dim, False, sinks)
    expected, expected_grads = _run(CORES["dense"], tensors, upstream, False, spec)
    got, grads = _run(RingCore(Alone(), BlockwiseCore(block)), tensors, upstream, False, spec)
    _close(got, expected, FORWARD_RTOL, "forward")
    for name, value, reference in zip("qkvs", grads, expected_grads):
        _close(value, reference, GRAD_RTOL, f"d{name}")


def _hf_mask(seq: int, window: int | None):
    import torch

    rows, keys = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    visible = keys <= rows
    if window is not None:
        visible &= keys > rows - window
    return torch.where(visible, 0.0, float("-inf"))[None, None]


def _ours(q, k, v, spec, sinks=None):
    """Our dense core on transformers' [batch, heads, seq, dim] tensors."""
    to = lambda t: paddle.to_tensor(t.transpose(1, 2).numpy())  # noqa: E731
    return CORES["dense"](to(q), to(k), to(v), False, spec,
                          None if sinks is None else paddle.to_tensor(sinks.detach().numpy())).numpy()


def test_the_dense_reference_is_transformers_eager_attention_for_gemma2_and_gpt_oss():
    """transformers' (4.x, this venv's) Gemma 2 and GPT-OSS attention modules made here, their eager
    attention functions called on random q, k, v with the causal window mask transformers builds
    for a sliding layer; ours gives the same output (1e-6)."""
    import torch
    from transformers import Gemma2Config, GptOssConfig
    from transformers.models.gemma2 import modeling_gemma2
    from transformers.models.gpt_oss import modeling_gpt_oss

    torch.manual_seed(0)
    batch, seq, heads, kv_heads, head_dim, window = 2, 23, 4, 2, 16, 7
    q, k, v = (torch.randn(batch, n, seq, head_dim) for n in (heads, kv_heads, kv_heads))
    gemma = Gemma2Config(hidden_size=64, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         query_pre_attn_scalar=24, attn_logit_softcapping=2.5, sliding_window=window,
                         num_hidden_layers=2)
    layer = modeling_gemma2.Gemma2Attention(gemma, layer_idx=0).eval()
    assert layer.sliding_window == window  # layer 0 is a sliding layer
    theirs, _ = modeling_gemma2.eager_attention_forward(layer, q, k, v, _hf_mask(seq, window), scaling=layer.scaling,
                                                        softcap=layer.attn_logit_softcapping)
    ours = _ours(q, k, v, CoreSpec(scale=24 ** -0.5, window=window, softcap=2.5))
    np.testing.assert_allclose(ours, theirs.reshape(batch, seq, -1).numpy(), rtol=FORWARD_RTOL, atol=FORWARD_RTOL)

    oss = GptOssConfig(hidden_size=64, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                       sliding_window=window, num_hidden_layers=2, num_local_experts=4)
    layer = modeling_gpt_oss.GptOssAttention(oss, layer_idx=0).eval()
    with torch.no_grad():
        layer.sinks.copy_(torch.randn(heads))
    theirs, _ = modeling_gpt_oss.eager_attention_forward(layer, q, k, v, _hf_mask(seq, window), scaling=layer.scaling)
    ours = _ours(q, k, v, CoreSpec(window=window), layer.sinks)
    np.testing.assert_allclose(ours, theirs.reshape(batch, seq, -1).detach().numpy(), rtol=FORWARD_RTOL,
                               atol=FORWARD_RTOL)


def test_a_windowed_layer_visits_key_blocks_linear_in_the_length():
    """Blocks of 64, window 128: each query block meets 3 key blocks (ceil((W + B - 1) / B) + 1 = 4 at
    most for unaligned blocks), whatever the length, so the work grows as seq x window; full causal
    meets them all."""
    for seq in (1024, 4096):
        windowed = Blocks(seq, seq, 1, True, 64, CoreSpec(window=128))
        full = Blocks(seq, seq, 1, True, 64, PLAIN)
        met = [len(windowed.keys_for(i0, i1)) for i0, i1 in windowed.queries()]
        assert max(met) == 3 and sum(met) == 3 * (seq // 64) - 3  # the first two query blocks meet 1 and 2
        assert sum(len(full.keys_for(i0, i1)) for i0, i1 in full.queries()) == (seq // 64) * (seq // 64 + 1) // 2


# (spec, sinks, qk_dim, v_dim) -> whether Paddle's flash kernel computes the layer
FLASH_LAYERS = [
    ((CoreSpec(window=4096), False, 128, 128), True),
    ((CoreSpec(scale=0.0625), False, 128, 128), True),
    ((CoreSpec(softcap=50.0), False, 128, 128), False),
    ((CoreSpec(alibi=alibi_slopes(8)), False, 128, 128), False),
    ((PLAIN, True, 64, 64), False),
    ((PLAIN, False, 192, 128), False),
]


@pytest.mark.parametrize("layer, flash", FLASH_LAYERS, ids=lambda v: str(v))
def test_a_layer_the_flash_kernel_cannot_compute_takes_the_blockwise_core(layer, flash):
    spec, sinks, qk_dim, v_dim = layer
    served = CORES["flash"].serving(spec, sinks, Heads(8, 8, qk_dim, v_dim))
    assert served.name == ("flash" if flash else "blockwise")
    assert (CORES["flash"].refusal(spec, sinks, Heads(8, 8, qk_dim, v_dim)) is None) == flash
    assert CORES["blockwise"].serving(spec, sinks, Heads(8, 8, qk_dim, v_dim)).name == "blockwise"


def test_the_flash_core_prescales_q_for_a_scale_of_its_own():
    """Paddle's FA-2 takes no softmax scale: the core multiplies q by scale x sqrt(head_dim). On CPU
    its call (`scaled_dot_product_attention`) runs Paddle's math path, so the layout and scale
    handling are checked against the dense core."""
    tensors, upstream = _inputs(2, 19, 4, 2, 8, 8, False, False)
    spec = CoreSpec(scale=0.17)
    expected, expected_grads = _run(CORES["dense"], tensors, upstream, False, spec)
    got, grads = _run(CORES["flash"], tensors, upstream, False, spec)
    _close(got, expected, FORWARD_RTOL, "forward")
    for name, value, reference in zip("qkv", grads, expected_grads):
        _close(value, reference, GRAD_RTOL, f"d{name}")
