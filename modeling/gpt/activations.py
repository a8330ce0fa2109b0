"""What one GPT decoder layer keeps for backward on a rank, by sublayer: the planner's activation
model, equal byte for byte to what `paddle_pp.training.activations` measures in fp32 (tested).

T = batch x seq tokens, h hidden, f intermediate, t tp ranks; n = t under sequence parallelism,
else 1 (the norms are the only activations TP leaves whole and SP splits). q, k and v share one
saved input, full-size with or without SP.
"""

from __future__ import annotations

from modeling.attention import FP32_BYTES, causal_attention_saved_bytes
from modeling.sequence_parallel import sequence_shards


def layer_activation_bytes(config, batch: int, seq_len: int, tp: int, sequence_parallel: bool,
                           dtype_bytes: int = 4) -> dict[str, int]:
    tokens, h, f, c = batch * seq_len, config.hidden_size, config.intermediate_size, dtype_bytes
    n = sequence_shards(tp, sequence_parallel)
    norm = (tokens * h * c + 2 * tokens * FP32_BYTES) // n  # its input, mean and variance
    return {
        "norm1": norm,
        "self_attn.q_proj": tokens * h * c,
        "self_attn": causal_attention_saved_bytes(batch, seq_len, config.num_attention_heads // tp, config.head_dim, c),
        "self_attn.out_proj": tokens * h // tp * c,
        "norm2": norm,
        "linear1": tokens * h * c,
        "": tokens * f // tp * c,  # the gelu's input
        "linear2": tokens * f // tp * c,
    }
