"""Measures what one decoder layer keeps for backward on each tp rank (training.activations).

argv: model_type tp sequence_parallel(0/1) batch seq_len hidden intermediate heads kv_heads
"""

from __future__ import annotations

import sys


def run(model_type: str, tp: int, sequence_parallel: bool, batch: int, seq_len: int, hidden: int,
        intermediate: int, heads: int, kv_heads: int) -> dict:
    from modeling.registry import build_causal_lm, config_from_dict
    from paddle_pp.runtime.layout import Layout
    from paddle_pp.runtime.topology import init_distributed
    from paddle_pp.training.activations import decoder_layer_activations

    topo = init_distributed(Layout(world_size=tp, tensor_parallel_degree=tp, sequence_parallel=sequence_parallel))
    config = config_from_dict(dict(model_type=model_type, vocab_size=512, hidden_size=hidden,
                                   intermediate_size=intermediate, num_hidden_layers=2, num_attention_heads=heads,
                                   max_position_embeddings=seq_len)
                             | ({"num_key_value_heads": kv_heads} if model_type == "llama" else {}))
    model = build_causal_lm(config, topo)
    return {"tp_rank": topo.tp_rank, "bytes": decoder_layer_activations(model, config.vocab_size, batch, seq_len)}


if __name__ == "__main__":
    from paddle_pp.runtime.launch import write_result

    model_type, *numbers = sys.argv[1:]
    tp, sp, batch, seq_len, hidden, intermediate, heads, kv_heads = map(int, numbers)
    write_result(run(model_type, tp, bool(sp), batch, seq_len, hidden, intermediate, heads, kv_heads))
