"""Measures what one decoder layer keeps for backward on each tp rank (training.activations), for
each attention core and recompute granularity, for several models in one launch (the launch's tp
degree for all; sequence parallelism is the model's choice, not the process groups').

argv: tp batch seq_len hidden intermediate heads kv_heads CASE... with CASE `model_type:sequence_parallel(0/1)`
Result: per case, per core, the layer's saved bytes by sublayer with nothing recomputed (saved-tensor
hooks) and, per granularity ("none" included), the bytes one layer's training forward leaves
allocated beyond its input and output (Paddle's CPU allocator).
"""

from __future__ import annotations

import sys

CORES = ("dense", "blockwise")
GRANULARITIES = ("none", "full", "full_attn", "core_attn")


def run(topo, model_type: str, sequence_parallel: bool, batch: int, seq_len: int, hidden: int,
        intermediate: int, heads: int, kv_heads: int) -> dict:
    import dataclasses

    import paddle

    from modeling.attention_core import CORES as BY_NAME
    from modeling.execution import Execution, Recompute
    from modeling.registry import build_causal_lm, config_from_dict
    from paddle_pp.training.activations import decoder_layer_activations, held_bytes

    tp = topo.layout.tp
    topo = dataclasses.replace(topo, layout=dataclasses.replace(topo.layout, sequence_parallel=sequence_parallel))
    config = config_from_dict(dict(model_type=model_type, vocab_size=512, hidden_size=hidden,
                                   intermediate_size=intermediate, num_hidden_layers=2, num_attention_heads=heads,
                                   max_position_embeddings=seq_len)
                             | ({"num_key_value_heads": kv_heads} if model_type == "llama" else {}))
    shape = [seq_len // tp, batch, hidden] if sequence_parallel else [batch, seq_len, hidden]
    saved, held = {}, {}
    for core in CORES:
        by_granularity = {}
        for granularity in GRANULARITIES:
            choices = Execution(attention=BY_NAME[core],
                                recompute=Recompute(None if granularity == "none" else granularity))
            model = build_causal_lm(config, topo, choices)
            model.train()
            if granularity == "none":
                saved[core] = decoder_layer_activations(model, config.vocab_size, batch, seq_len)
            layer = next(sub for name, sub in model.named_sublayers() if name.endswith("layers.0"))
            paddle.seed(1)
            x = paddle.randn(shape)
            x.stop_gradient = False
            layer(x)  # builds the constants first used here (rotary tables, masks)
            by_granularity[granularity] = held_bytes(lambda: layer(x))
        held[core] = by_granularity
    return {"tp_rank": topo.tp_rank, "bytes": saved, "held": held}


if __name__ == "__main__":
    from paddle_pp.runtime.launch import write_result
    from paddle_pp.runtime.layout import Layout
    from paddle_pp.runtime.topology import end_job, init_distributed

    tp, batch, seq_len, hidden, intermediate, heads, kv_heads = map(int, sys.argv[1:8])
    topo = init_distributed(Layout(world_size=tp, tensor_parallel_degree=tp))
    cases = [case.split(":") for case in sys.argv[8:]]
    write_result({case: run(topo, model_type, bool(int(sp)), batch, seq_len, hidden, intermediate, heads, kv_heads)
                  for case, (model_type, sp) in zip(sys.argv[8:], cases)})
    end_job(topo)
