"""Ring attention and the context-parallel loss on real cp ranks against one process's computation of
the whole sequence, which every rank also runs (same seed).

For each case (batch-first and sequence-first, GQA, blocks that split the chunks unevenly; a layer
of its own scale, and one with a scale, a soft-cap and sinks; per-document attention, an
end-of-document token at about one position in five; sliding windows shorter than a rank's part and
longer, the latter with a soft-cap, sinks and documents; chunks within documents): the blockwise core on the whole sequence,
and `ring_attention` on this rank's two chunks; this rank's rows of the output and of dq, dk, dv
(and of the sinks' gradient) are compared; per document, also this rank's positions inside their
documents found from its own tokens (`document_positions` over the ring) against the whole
sequence's. Each case runs the ring twice: with the blockwise
kernel, and (where the layer is one Paddle's flash kernel computes) with the flash kernel's calls and bookkeeping (argument order, layouts, log-sum-exp
transposes and padding) around `FlashOps`, a CPU stand-in for `paddle._C_ops.flash_attn` and
`flash_attn_grad` with their signatures and returns (their GPU kernels cannot run here). The loss: logits and labels whose ignored labels all sit
in one rank's chunk; the cp ranks' losses summed and this rank's logit gradients against the
single-card criterion's.

With `measure_len`: what one decoder layer of a tiny LLaMA keeps for backward at that many tokens per
sequence, on the whole sequence (cp1, the blockwise core) and on this rank's part under the ring,
by sublayer (saved-tensor hooks), with the planner's model of the latter.

argv: cp [measure_len]. Result: the largest relative errors per case, the bytes this rank sent around
the ring per case with `ring_traffic_bytes`'s count; the measured activation bytes.
"""

from __future__ import annotations

import sys


def _relative(got, expected) -> float:
    import numpy as np

    return float(np.abs(got - expected).max() / max(np.abs(expected).max(), 1e-30))


class FlashOps:
    """`paddle._C_ops.flash_attn` and `flash_attn_grad` as Paddle 3.3.1 declares them, computed densely
    in fp32 on CPU. Query head h reads kv head h // groups; the log-sum-exp is [batch, heads, seq
    rounded up to 128 rows], the padding rows zero, as FA2 returns it."""

    @staticmethod
    def flash_attn(q, k, v, fixed_seed_offset, attn_mask, dropout, causal, return_softmax, is_test, rng_name):
        import paddle

        assert fixed_seed_offset is None and attn_mask is None and dropout == 0.0 and not return_softmax
        probs, lse = _probabilities(q, k, causal)
        groups = q.shape[2] // k.shape[2]
        out = paddle.einsum("bhst,bthd->bshd", probs, paddle.repeat_interleave(v, groups, axis=2))
        padded = -(-q.shape[1] // 128) * 128
        lse = paddle.concat([lse, paddle.zeros(lse.shape[:2] + [padded - q.shape[1]])], axis=2)
        return out.astype(q.dtype), None, lse, paddle.zeros([2], "int64")

    @staticmethod
    def flash_attn_grad(q, k, v, out, lse, seed_offset, attn_mask, dout, dropout, causal):
        assert attn_mask is None and dropout == 0.0 and seed_offset.shape == [2]
        return _flash_grads(q, k, v, out, lse, dout, causal)


def _probabilities(q, k, causal: bool, lse=None):
    """softmax(q k^T / sqrt(head_dim)) [batch, heads, seq_q, seq_k] (over `lse` when given) and the lse."""
    import math

    import paddle

    keys = paddle.repeat_interleave(k, q.shape[2] // k.shape[2], axis=2)
    scores = paddle.einsum("bshd,bthd->bhst", q, keys) / math.sqrt(q.shape[3])
    if causal:
        scores = scores + paddle.triu(paddle.full(scores.shape[-2:], float("-inf")), diagonal=1)
    lse = paddle.logsumexp(scores, axis=-1) if lse is None else lse
    return paddle.exp(scores - lse.unsqueeze(-1)), lse


def _flash_grads(q, k, v, out, lse, dout, causal: bool):
    """dq, dk, dv given the (merged) output and log-sum-exp [batch, heads, seq], dk and dv summed over
    each kv head's query heads."""
    import math

    import paddle

    groups, scale = q.shape[2] // k.shape[2], 1 / math.sqrt(q.shape[3])
    probs, _ = _probabilities(q, k, causal, lse)
    values = paddle.repeat_interleave(v, groups, axis=2)
    dv = paddle.einsum("bhst,bshd->bthd", probs, dout)
    delta = (dout * out).sum(-1).transpose([0, 2, 1]).unsqueeze(-1)
    dscores = probs * (paddle.einsum("bshd,bthd->bhst", dout, values) - delta)
    dq = paddle.einsum("bhst,bthd->bshd", dscores, paddle.repeat_interleave(k, groups, axis=2)) * scale
    dk = paddle.einsum("bhst,bshd->bthd", dscores, q) * scale
    per_kv_head = lambda t: t.reshape(t.shape[:2] + [k.shape[2], groups, t.shape[3]]).sum(3)  # noqa: E731
    return dq, per_kv_head(dk), per_kv_head(dv)


def measure(cp: int, ring, topo, seq_len: int) -> dict:
    import paddle

    from modeling.attention_core import CORES
    from modeling.execution import Execution
    from modeling.registry import config_from_dict, execution_for, family_of
    from paddle_pp.training.activations import rotary_constants, saved_activation_bytes

    config = config_from_dict(dict(model_type="llama", vocab_size=4096, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=seq_len))
    choices = Execution(attention=CORES["blockwise"])
    result = {}
    for name, run, tokens in (("cp1", choices, seq_len),
                              ("cp", execution_for(topo.layout, 0, choices, ring), seq_len // cp)):
        layer = family_of(config).causal_lm(config, run).llama.layers[0]
        layer.train()
        hidden = paddle.randn([1, tokens, config.hidden_size])
        hidden.stop_gradient = False
        result[name] = saved_activation_bytes(layer, lambda: layer(hidden), rotary_constants(layer, tokens, False, run.cp))
        result[f"{name}_planned"] = family_of(config).layer_saved_bytes(config, run, 1, tokens)
    return result


class CountingRing:
    """The ring, counting the bytes this rank sends through it."""

    def __init__(self, ring):
        self.ring, self.degree, self.rank, self.sent = ring, ring.degree, ring.rank, 0

    def start_shift(self, tensors, stream="kv"):
        self.sent += sum(int(t.numel()) * t.element_size() for t in tensors)
        return self.ring.start_shift(tensors, stream)

    def all_reduce(self, tensor):
        return self.ring.all_reduce(tensor)


def main(cp: int, measure_len: int = 0):
    import numpy as np
    import paddle

    import modeling.attention_core.flash as flash
    from modeling.attention_core import CORES, BlockwiseCore
    from modeling.attention_core.ring import ring_attention, ring_traffic_bytes
    from modeling.attention_core.spec import PLAIN, CoreSpec
    from modeling.context_parallel import local_positions, split_sequence
    from modeling.documents import Documents, document_positions
    from modeling.execution import Execution
    from modeling.loss import IGNORE_INDEX, CausalLMCriterion
    from paddle_pp.runtime.layout import Layout
    from paddle_pp.runtime.topology import init_distributed

    topo = init_distributed(Layout(world_size=cp, context_parallel_degree=cp))
    flash._C_ops = FlashOps
    ring = topo.ring
    errors, ring_bytes = {}, {}
    # (batch, chunk length, heads, kv heads, head_dim, block, sequence first, spec, sinks, per document)
    for batch, chunk, heads, kv_heads, head_dim, block, seq_first, spec, sinks, per_document in [
            (2, 10, 4, 2, 8, 4, False, PLAIN, False, False), (1, 12, 6, 2, 16, 5, True, PLAIN, False, False),
            (2, 7, 4, 1, 8, 512, False, CoreSpec(scale=0.21), False, False),
            (2, 9, 4, 2, 8, 4, True, CoreSpec(scale=0.3, softcap=2.0), True, False),
            (2, 6, 4, 2, 8, 5, False, PLAIN, False, True), (1, 5, 4, 1, 8, 3, True, CoreSpec(softcap=2.0), True, True),
            # sliding windows: shorter than a part (reaching into the one before), and longer (across parts),
            # with a soft-cap, sinks and documents
            (2, 8, 4, 2, 8, 3, False, CoreSpec(window=5), False, False),
            (1, 6, 4, 1, 8, 4, True, CoreSpec(window=9, softcap=2.0), True, True),
            # Llama 4's chunks (of 6 positions: some inside a part, some across two) within documents
            (2, 8, 4, 2, 8, 3, False, CoreSpec(chunk=6), False, True)]:
        seq = 2 * cp * chunk
        whole_documents = local_documents = None
        positions_differ = 0.0
        if per_document:  # token 0 ends a document
            ids = np.random.default_rng(11).integers(1, 50, [batch, seq])
            ids[np.random.default_rng(12).random(ids.shape) < 1 / 5] = 0
            in_documents = document_positions(paddle.to_tensor(ids), (0,))
            whole_documents = Documents.of(in_documents)
            mine_in_documents = document_positions(paddle.to_tensor(split_sequence(ids, cp, ring.rank)), (0,), ring)
            positions_differ = float(np.abs(mine_in_documents.numpy()
                                            - split_sequence(in_documents.numpy(), cp, ring.rank)).max())
            local_documents = Documents.of(mine_in_documents, local_positions(seq, cp, ring.rank))
        if spec.chunk is not None:  # each query's start at its chunk too (`Execution.documents_at`)
            whole_documents = Documents.in_chunks(spec.chunk, np.arange(seq), whole_documents, batch)
            local_documents = Documents.in_chunks(spec.chunk, local_positions(seq, cp, ring.rank), local_documents,
                                                  batch)
        rng = np.random.default_rng(7)
        lead = [seq, batch] if seq_first else [batch, seq]
        whole = [rng.standard_normal(lead + [n, head_dim]).astype("float32") for n in (heads, kv_heads, kv_heads)]
        logits = [rng.standard_normal([heads]).astype("float32")] if sinks else []
        upstream = rng.standard_normal(lead + [heads * head_dim]).astype("float32")
        axis = 0 if seq_first else 1

        def run(arrays, attention, dout):
            tensors = [paddle.to_tensor(a, stop_gradient=False) for a in arrays]
            out = attention(*tensors)
            grads = paddle.grad((out * paddle.to_tensor(dout)).sum(), tensors)
            return out.numpy(), [g.numpy() for g in grads]

        expected, expected_grads = run(whole + logits, lambda q, k, v, *s: BlockwiseCore(block)(
            q, k, v, seq_first, spec, s[0] if s else None, whole_documents), upstream)
        mine = lambda a: split_sequence(a, cp, ring.rank, axis)  # noqa: E731
        inners = {"blockwise": BlockwiseCore(block), "flash": CORES["flash"]}
        for kernel, inner in inners.items():
            if (sinks or per_document) and kernel == "flash":
                continue  # such a layer's ring takes the blockwise kernel (RingCore.serving, ring_attention)
            counting = CountingRing(ring)
            got, grads = run([mine(a) for a in whole] + logits, lambda q, k, v, *s: ring_attention(
                q, k, v, counting, seq_first, inner, spec, s[0] if s else None, local_documents), mine(upstream))
            case = f"{kernel}_b{batch}_chunk{chunk}_h{heads}_kv{kv_heads}_block{block}{'_seq_first' * seq_first}" \
                   f"{'_spec' * (spec != PLAIN)}{'_sinks' * sinks}{'_documents' * per_document}"
            errors[case] = {"out": _relative(got, mine(expected)),
                            **{f"d{name}": _relative(g, mine(e)) for name, g, e in zip("qkv", grads, expected_grads)}}
            if per_document:
                errors[case]["positions"] = positions_differ
            if sinks:  # each rank's sink gradient is its tokens' part: the parts sum to the whole
                errors[case]["dsinks"] = _relative(ring.all_reduce(paddle.to_tensor(grads[3])).numpy(),
                                                   expected_grads[3])
            ring_bytes[case] = [counting.sent, ring_traffic_bytes(batch, 2 * chunk, kv_heads, head_dim, cp, 4)]

    seq, vocab = 2 * cp * 6, 11
    rng = np.random.default_rng(3)
    logits = rng.standard_normal([2, seq, vocab]).astype("float32")
    labels = rng.integers(0, vocab, [2, seq])
    labels[:, :5] = IGNORE_INDEX  # all in rank 0's first chunk: the ranks count different numbers of labels

    def loss_and_grad(logit_array, label_array, criterion):
        tensor = paddle.to_tensor(logit_array, stop_gradient=False)
        loss = criterion(tensor, paddle.to_tensor(label_array))
        return loss, paddle.grad(loss, tensor)[0].numpy()

    whole_loss, whole_grad = loss_and_grad(logits, labels, CausalLMCriterion(Execution()))
    part_loss, part_grad = loss_and_grad(split_sequence(logits, cp, ring.rank), split_sequence(labels, cp, ring.rank),
                                         CausalLMCriterion(Execution(ring=ring)))
    errors["loss"] = {"sum over cp": abs(float(ring.all_reduce(part_loss)) - float(whole_loss)) / float(whole_loss),
                      "dlogits": _relative(part_grad, split_sequence(whole_grad, cp, ring.rank))}
    result = {"cp_rank": ring.rank, "errors": errors, "ring_bytes": ring_bytes}
    return result | ({"bytes": measure(cp, ring, topo, measure_len)} if measure_len else {}), topo


if __name__ == "__main__":
    from paddle_pp.runtime.launch import write_result
    from paddle_pp.runtime.topology import end_job

    result, topo = main(*map(int, sys.argv[1:]))
    write_result(result)
    end_job(topo)
