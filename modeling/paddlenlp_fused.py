"""PaddleNLP's fused projections (`fuse_attention_qkv`, `fuse_attention_ffn`): where our separate
q/k/v and gate/up tensors sit inside its `qkv_proj` and `gate_up_fused_proj`.

PaddleNLP's `qkv_proj` ([hidden, kv_heads x (groups + 2) x head_dim], Paddle's [in, out]) holds, for
each kv head in turn, that head's group of query heads, then its key, then its value (its LLaMA and
Qwen2 reshape the output to [.., kv_heads, (groups + 2) x head_dim] and split; GPT is the case of
one query head per group); its biases follow the same order. A tensor-parallel rank's column slice
of it is then its own kv heads' block, which is why PaddleNLP splits and merges it as a plain column
tensor. `gate_up_fused_proj` ([hidden, 2 x intermediate]) is all gate columns, then all up columns
(merged across tp ranks gate by gate, up by up: PaddleNLP's `is_naive_2fuse`).
"""

from __future__ import annotations

from modeling.placement import TensorPlan
from modeling.transformers_adapter import Stored

QKV, FFN = "fuse_attention_qkv", "fuse_attention_ffn"
_ATTENTION = ("q_proj", "k_proj", "v_proj")
_MLP = ("gate_proj", "up_proj")


def fused_stored(name: str, row: TensorPlan, config, fused: frozenset[str]) -> Stored:
    """Where PaddleNLP's model with the `fused` flags stores our tensor `name` (ours when not fused)."""
    module, _, param = name.rpartition(".")
    prefix, _, projection = module.rpartition(".")
    if QKV in fused and projection in _ATTENTION:
        groups, head_dim = config.num_attention_heads // config.num_key_value_heads, config.head_dim
        offset, width = {"q_proj": (0, groups), "k_proj": (groups, 1), "v_proj": (groups + 1, 1)}[projection]
        return Stored(f"{prefix}.qkv_proj.{param}", axis=len(row.shape) - 1,
                      interleave=((groups + 2) * head_dim, offset * head_dim, width * head_dim))
    if FFN in fused and projection in _MLP:
        return Stored(f"{prefix}.gate_up_fused_proj.{param}", axis=len(row.shape) - 1,
                      part=_MLP.index(projection), parts=2)
    return Stored(name)
