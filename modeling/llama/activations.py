"""What one LLaMA decoder layer keeps for backward on a rank, by sublayer: the planner's activation
model, equal byte for byte to what `paddle_pp.training.activations` measures in fp32 (tested).

T = batch x seq tokens, h hidden, f intermediate, t tp ranks; n = t under sequence parallelism,
else 1 (the norms are the only activations TP leaves whole and SP splits). Each projection group
keeps its input once (q, k and v share one; gate and up share one), full-size with or without SP.
"""

from __future__ import annotations

from modeling.attention import FP32_BYTES, causal_attention_saved_bytes
from modeling.sequence_parallel import sequence_shards


def layer_activation_bytes(config, batch: int, seq_len: int, tp: int, sequence_parallel: bool,
                           dtype_bytes: int = 4) -> dict[str, int]:
    tokens, h, f, c = batch * seq_len, config.hidden_size, config.intermediate_size, dtype_bytes
    n = sequence_shards(tp, sequence_parallel)
    norm = (2 * tokens * h * c + tokens * FP32_BYTES) // n  # its input, the normalised input, 1/rms
    rotary_tables = 2 * seq_len * config.head_dim * FP32_BYTES  # cos and sin, shared by q and k (and every layer)
    # k and v reach the attention core repeated to every head
    attention = rotary_tables + causal_attention_saved_bytes(batch, seq_len, config.num_attention_heads // tp,
                                                             config.head_dim, c)
    return {
        "input_layernorm": norm,
        "self_attn.q_proj": tokens * h * c,
        "self_attn": attention,
        "self_attn.o_proj": tokens * h // tp * c,
        "post_attention_layernorm": norm,
        "mlp.gate_proj": tokens * h * c,
        "mlp": 3 * tokens * f // tp * c,  # gate and up outputs, silu(gate)
        "mlp.down_proj": tokens * f // tp * c,
    }
