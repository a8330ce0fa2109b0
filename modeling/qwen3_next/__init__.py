"""Qwen3-Next (`qwen3_next`: Qwen3-Next-80B-A3B): Qwen3.5's layers (Gated DeltaNet where `layer_types`
says `linear_attention`, gated attention elsewhere; `1 + weight` norms; partial rotary 0.25) with
Qwen2-MoE's mixture of experts (a sigmoid-gated shared expert; dense MLPs in `mlp_only_layers` and off
`decoder_sparse_step`; `norm_topk_prob`).

Its folders fuse the Gated DeltaNet's input projections per key head: `in_proj_qkvz` holds, for each
key head in turn, its q rows, its k rows, then the v rows and the z rows of the value heads it serves;
`in_proj_ba` likewise each key head's b rows then a rows (transformers' `fix_query_key_value_ordering`).
Ours are Qwen3.5's separate projections: each is every group's entries at one offset, which a tp
rank reads for its own groups (key heads) and the export interleaves again; the conv is Qwen3.5's
(channels q | k | v).
"""

from __future__ import annotations

from dataclasses import replace

from modeling.config_fields import MOE_ACCEPTED
from modeling.decoder_family import decoder_family
from modeling.moe_config import QwenMoEFields
from modeling.qwen3_5 import MTP_FIELDS, MTP_UNREAD, RELEASED_FIELDS, Qwen3_5TextConfig, fused_linear_inputs
from modeling.transformers_adapter import Stored

_GROUPED = {"in_proj_q": "in_proj_qkvz", "in_proj_k": "in_proj_qkvz", "in_proj_v": "in_proj_qkvz",
            "in_proj_z": "in_proj_qkvz", "in_proj_b": "in_proj_ba", "in_proj_a": "in_proj_ba"}


class Qwen3NextConfig(QwenMoEFields, Qwen3_5TextConfig):
    model_type = "qwen3_next"

    def __init__(self, vocab_size: int = 151936, hidden_size: int = 2048, intermediate_size: int = 5632,
                 num_hidden_layers: int = 48, num_key_value_heads: int | None = 2, num_experts: int = 512,
                 num_experts_per_tok: int = 10, moe_intermediate_size: int = 512, norm_topk_prob: bool = True,
                 shared_expert_intermediate_size: int = 512, **kwargs):
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_key_value_heads=num_key_value_heads,
                         num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                         moe_intermediate_size=moe_intermediate_size, norm_topk_prob=norm_topk_prob, **kwargs)


def grouped_linear_inputs(stored: Stored, config: Qwen3NextConfig) -> Stored:
    """Where Qwen3-Next stores our separate Gated DeltaNet projections: one offset of every key
    head's group of `in_proj_qkvz` (q, k, v, z) or `in_proj_ba` (b, a)."""
    module, _, param = stored.name.rpartition(".")
    prefix, _, part = module.rpartition(".")
    if part not in _GROUPED:
        return fused_linear_inputs(stored, config)
    served = config.linear_num_value_heads // config.linear_num_key_heads  # value heads per key head
    key, value = config.linear_key_head_dim, served * config.linear_value_head_dim
    widths = {"in_proj_q": key, "in_proj_k": key, "in_proj_v": value, "in_proj_z": value,
              "in_proj_b": served, "in_proj_a": served}
    members = [name for name, fused in _GROUPED.items() if fused == _GROUPED[part]]
    offset = sum(widths[name] for name in members[:members.index(part)])
    group = sum(widths[name] for name in members)
    return replace(stored, name=f"{prefix}.{_GROUPED[part]}.{param}", axis=0, interleave=(group, offset, widths[part]))


QWEN3_NEXT = decoder_family(Qwen3NextConfig, "Qwen3NextForCausalLM", "qwen3_next", paddlenlp=False,
                            fuse=grouped_linear_inputs, accepted={**MOE_ACCEPTED, **MTP_FIELDS, **RELEASED_FIELDS},
                            unread=MTP_UNREAD)
Qwen3NextForCausalLM, Qwen3NextForCausalLMPipe = QWEN3_NEXT.causal_lm, QWEN3_NEXT.pipe
