"""The attention cores compute the same function (fp32, one process): the blockwise core and the
flash core's call path against the dense reference, with grouped-query heads, a head_dim other than
hidden / heads, lengths that do not divide the block size, batch-first and sequence-first; what the
blockwise core keeps grows linearly with the length; and each run picks its core and fused kernels
by Paddle's own rules (the GPU rows with the device set to "gpu", as no GPU is reachable here)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from modeling.attention_core import CORES, BlockwiseCore, Heads, choose_core
from modeling.attention_core.blockwise import attend, to_heads, to_rows
from modeling.attention_core.spec import PLAIN, CoreSpec, alibi_slopes
from modeling.documents import Documents, document_positions
from modeling.execution import Kernels, choose_execution

FORWARD_RTOL, GRAD_RTOL = 1e-6, 1e-5
# (batch, seq, heads, kv_heads, head_dim, block): GQA 2:1 and 3:1, MQA, MHA; lengths not a multiple of the block
SHAPES = [(2, 37, 4, 2, 8, 8), (1, 64, 6, 2, 24, 16), (2, 33, 4, 1, 16, 7), (3, 10, 4, 4, 8, 512)]


def _inputs(batch, seq, heads, kv_heads, head_dim, seq_first, seed=0):
    rng = np.random.default_rng(seed)
    lead = [seq, batch] if seq_first else [batch, seq]
    tensors = [paddle.to_tensor(rng.standard_normal(lead + [n, head_dim]).astype("float32"))
               for n in (heads, kv_heads, kv_heads)]
    for tensor in tensors:
        tensor.stop_gradient = False
    upstream = paddle.to_tensor(rng.standard_normal(lead + [heads * head_dim]).astype("float32"))
    return tensors, upstream


def _forward_backward(core, tensors, upstream, seq_first):
    out = core(*tensors, seq_first)
    return out.numpy(), [g.numpy() for g in paddle.grad((out * upstream).sum(), tensors)]


@pytest.mark.parametrize("seq_first", [False, True], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_s{}_h{}_kv{}_d{}_block{}".format(*s))
@pytest.mark.parametrize("core", ["blockwise", "flash"])
def test_core_equals_the_dense_reference(core, shape, seq_first):
    """Forward within rtol 1e-6, the gradients of q, k and v within 1e-5 (relative to each tensor's
    largest entry). The flash core's call (`F.scaled_dot_product_attention`, is_causal, kv heads not
    repeated) runs Paddle's math path on CPU: its layout handling is what is checked here."""
    *dims, block = shape
    tensors, upstream = _inputs(*dims, seq_first)
    expected, expected_grads = _forward_backward(CORES["dense"], tensors, upstream, seq_first)
    tested = BlockwiseCore(block) if core == "blockwise" else CORES["flash"]
    got, grads = _forward_backward(tested, tensors, upstream, seq_first)
    np.testing.assert_allclose(got, expected, rtol=FORWARD_RTOL, atol=FORWARD_RTOL * np.abs(expected).max())
    for name, value, reference in zip("qkv", grads, expected_grads):
        np.testing.assert_allclose(value, reference, rtol=GRAD_RTOL, atol=GRAD_RTOL * np.abs(reference).max(),
                                   err_msg=f"d{name}")


def test_blockwise_log_sum_exp_is_the_softmax_normaliser():
    """`attend` returns, per query row, log sum_j exp(score_j) over the keys it may see: what context
    parallelism merges partial results by."""
    batch, seq, heads, kv_heads, head_dim = 1, 20, 4, 2, 8
    (q, k, v), _ = _inputs(batch, seq, heads, kv_heads, head_dim, False)
    rows = to_rows(q, kv_heads, False) / np.sqrt(head_dim)
    _, lse = attend(rows, to_heads(k, False), to_heads(v, False), heads // kv_heads, causal=True, block=6)
    scores = np.einsum("brd,bsd->brs", rows.numpy()[0].astype(np.float64), to_heads(k, False).numpy()[0])
    positions = np.arange(seq * heads // kv_heads) // (heads // kv_heads)
    scores = np.where(positions[None, :, None] >= np.arange(seq)[None, None, :], scores, -np.inf)
    expected = np.log(np.exp(scores).sum(-1))
    np.testing.assert_allclose(lse.numpy()[0, :, :, 0], expected, rtol=FORWARD_RTOL,
                               atol=FORWARD_RTOL * np.abs(expected).max())


def _kept(core, seq, spec=PLAIN, sinks=False):
    """Bytes one call keeps for backward, measured by the saved-tensor hooks (the sink logits are
    a parameter in a model, so not an activation, and not counted). The hook holds each saved tensor
    alive, so a freed one's address reused by the next cannot merge two tensors into one entry."""
    tensors, _ = _inputs(1, seq, 4, 2, 16, False)
    logits = paddle.zeros([4]) if sinks else None
    ids = paddle.to_tensor(np.random.default_rng(3).integers(0, 8, size=(1, seq)))
    documents = Documents.of(document_positions(ids, (0,))) if spec.documents else None
    saved = {}

    def keep(tensor):
        saved.setdefault(tensor.data_ptr(), tensor)
        return tensor

    with paddle.autograd.saved_tensors_hooks(keep, lambda tensor: tensor):
        core(*tensors, False, spec, logits, documents)
    return sum(int(t.numel()) * t.element_size() for pointer, t in saved.items()
               if logits is None or pointer != logits.data_ptr())


def test_blockwise_keeps_memory_linear_in_the_length():
    """What one call keeps for backward, measured by the saved-tensor hooks, equals the core's own
    model at 256, 512 and 1024 positions and doubles with the length; the dense core's grows 4x."""
    lengths = (256, 512, 1024)
    blockwise = [_kept(BlockwiseCore(128), seq) for seq in lengths]
    dense = [_kept(CORES["dense"], seq) for seq in lengths]
    heads = Heads(4, 2, 16, 16)
    assert blockwise == [BlockwiseCore(128).saved_bytes(1, seq, heads, 4, False) for seq in lengths]
    assert dense == [CORES["dense"].saved_bytes(1, seq, heads, 4, False) for seq in lengths]
    assert blockwise[2] == 2 * blockwise[1] == 4 * blockwise[0]
    assert dense[2] > 3.8 * dense[1] > 3.8 * 3.8 * dense[0]


@pytest.mark.parametrize("spec, sinks", [(CoreSpec(window=40), False), (CoreSpec(softcap=2.0), False),
                                         (CoreSpec(alibi=alibi_slopes(4)), False), (CoreSpec(scale=0.3), True),
                                         (CoreSpec(window=40, documents=True), False)],
                         ids=["window", "softcap", "alibi", "scale_sinks", "window_documents"])
def test_each_cores_memory_model_holds_for_each_spec(spec, sinks):
    """The planner's model of each core under a layer's spec equals the measurement: the dense core
    keeps a soft-cap's tanh and one more probability column with sinks; the blockwise core keeps the
    same whatever the spec (a window shortens its work only)."""
    for core in (CORES["dense"], BlockwiseCore(32)):
        assert _kept(core, 96, spec, sinks) == core.saved_bytes(1, 96, Heads(4, 2, 16, 16), 4, False, spec, sinks)


# (device, dtype, head_dim, compute capability) -> the core --use_flash_attention takes
SELECTION = [
    (("gpu", "bfloat16", 128, (8, 0)), "flash"),
    (("gpu", "float16", 64, (9, 0)), "flash"),
    (("gpu", "bfloat16", 256, (12, 1)), "flash"),
    (("gpu", None, 128, (8, 0)), "blockwise"),  # fp32: Paddle's flash has no fp32 kernel
    (("gpu", "bfloat16", 320, (8, 0)), "blockwise"),  # head_dim over 256 (flash_attention() would drop causal)
    (("gpu", "bfloat16", 36, (8, 0)), "blockwise"),  # not a multiple of 8
    (("gpu", "bfloat16", 128, (7, 5)), "blockwise"),  # Turing: below SM 8.0
    (("cpu", None, 64, None), "blockwise"),
]


@pytest.mark.parametrize("request_, expected", SELECTION, ids=lambda v: str(v))
def test_flash_is_taken_exactly_where_paddles_kernel_applies(request_, expected):
    device, dtype, head_dim, sm = request_
    core, refusal = choose_core(True, device, dtype, head_dim, sm)
    assert core.name == expected
    assert (refusal is None) == (expected == "flash")
    assert choose_core(False, device, dtype, head_dim, sm)[0].name == "dense"


def test_fused_kernels_are_chosen_on_gpu_only():
    """Fused rope and RMSNorm as asked on a GPU, SwiGLU always there (as PaddleNLP's LLaMA); on CPU
    none, with a note for each one asked for (Paddle's fused RMSNorm would kill an AVX2 CPU with
    SIGILL, fused rope has no CPU kernel)."""
    gpu, notes = choose_execution(fused_rope=True, fused_rms_norm=True, device="gpu", dtype="bfloat16", head_dim=128,
                                  sm=(9, 0))
    assert gpu.kernels == Kernels(fused_rope=True, fused_rms_norm=True, swiglu=True) and notes == []
    assert gpu.attention.name == "flash"
    cpu, notes = choose_execution(fused_rope=True, fused_rms_norm=True, device="cpu", head_dim=128)
    assert cpu.kernels == Kernels()
    assert [note.split()[0] for note in notes] == ["attention:", "--use_fused_rope", "--use_fused_rms_norm"]
    plain, _ = choose_execution(device="gpu", dtype="bfloat16", head_dim=128, sm=(9, 0))
    assert plain.kernels == Kernels(swiglu=True)


def test_recompute_granularity_counts_only_with_recompute():
    assert choose_execution(recompute=False, granularity="full_attn")[0].recompute.granularity is None
    assert choose_execution(recompute=True, granularity="core_attn")[0].recompute.granularity == "core_attn"


def test_fused_swiglu_equals_the_reference_mlp():
    """Paddle's swiglu (it has a CPU kernel) against silu(gate) * up, forward and backward."""
    from paddle.nn.functional import swiglu

    rng = np.random.default_rng(3)
    gate, up = (paddle.to_tensor(rng.standard_normal([4, 6, 40]).astype("float32")) for _ in range(2))
    for tensor in (gate, up):
        tensor.stop_gradient = False
    reference = paddle.nn.functional.silu(gate) * up
    fused = swiglu(gate, up)
    np.testing.assert_allclose(fused.numpy(), reference.numpy(), rtol=FORWARD_RTOL, atol=1e-7)
    for got, expected in zip(paddle.grad(fused.sum(), [gate, up]), paddle.grad(reference.sum(), [gate, up])):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=GRAD_RTOL, atol=1e-7)


def test_recomputing_the_core_on_strided_sequence_first_views_keeps_its_gradients():
    """Under sequence parallelism the core's q, k and v are [seq, batch, ...] views of [batch, seq, ...]
    buffers; Paddle 3.3.1's non-reentrant recompute reads such a view a PyLayer saved as if it were
    contiguous (`modeling/saved_tensors.py`), which trained tp2 + SP + recompute with micro-batches of
    two wrongly. Recomputed (as `--recompute_granularity core_attn` does) the core's gradients are the
    ones it gives without recompute (rtol 1e-6; the same ops run)."""
    from modeling.execution import Recompute

    batch, seq, heads, kv_heads, head_dim = 2, 12, 4, 2, 8
    rng = np.random.default_rng(5)
    x = paddle.to_tensor(rng.standard_normal([batch, seq, 32]).astype("float32"))
    weights = [paddle.to_tensor(rng.standard_normal([32, n * head_dim]).astype("float32"))
               for n in (heads, kv_heads, kv_heads)]
    for tensor in (x, *weights):
        tensor.stop_gradient = False

    def gradients(recompute: Recompute) -> list[np.ndarray]:
        views = [paddle.matmul(x, w).reshape([batch, seq, -1, head_dim]).transpose([1, 0, 2, 3]) for w in weights]
        assert not any(view.is_contiguous() for view in views)  # the case that went wrong
        out = recompute("core_attn", lambda q, k, v: BlockwiseCore(block=5)(q, k, v, True), *views)
        return [g.numpy() for g in paddle.grad((out * out).sum(), [x, *weights])]

    for plain, recomputed in zip(gradients(Recompute()), gradients(Recompute("core_attn"))):
        np.testing.assert_allclose(recomputed, plain, rtol=FORWARD_RTOL, atol=1e-6)
