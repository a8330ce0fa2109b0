"""LLaMA's TP plan: every parameter's single-card shape, split axis and pipeline place, in one table.

Save, load, the planner, the pre-split tools and the transformers mapping all read this table;
`modeling.registry.check_model_against_plan` proves the built model agrees with it on every rank.
"""

from __future__ import annotations

from modeling.llama.config import LlamaConfig
from modeling.tp_plan import COLUMN, FIRST, LAST, REPLICATED, ROW, VOCAB_ROWS, TensorPlan, check_divisible


def tensor_plan(config: LlamaConfig) -> dict[str, TensorPlan]:
    """Single-card name -> TensorPlan, for every parameter of the model."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * config.head_dim
    layer = {  # name -> (shape, axis, linear)
        "self_attn.q_proj.weight": ((h, h), COLUMN, True),
        "self_attn.k_proj.weight": ((h, kv), COLUMN, True),
        "self_attn.v_proj.weight": ((h, kv), COLUMN, True),
        "self_attn.o_proj.weight": ((h, h), ROW, True),
        "mlp.gate_proj.weight": ((h, i), COLUMN, True),
        "mlp.up_proj.weight": ((h, i), COLUMN, True),
        "mlp.down_proj.weight": ((i, h), ROW, True),
        "input_layernorm.weight": ((h,), REPLICATED, False),
        "post_attention_layernorm.weight": ((h,), REPLICATED, False),
    }
    plan = {"llama.embed_tokens.weight": TensorPlan((v, h), VOCAB_ROWS, FIRST)}
    for n in range(config.num_hidden_layers):
        plan |= {f"llama.layers.{n}.{name}": TensorPlan(shape, axis, n, linear)
                 for name, (shape, axis, linear) in layer.items()}
    plan["llama.norm.weight"] = TensorPlan((h,), REPLICATED, LAST)
    plan["lm_head.weight"] = TensorPlan((h, v), COLUMN, LAST, linear=True)
    return plan


def check_tensor_parallel(config, tp: int) -> None:
    """Fail before any weight is built when heads, kv heads or vocabulary do not split over `tp`."""
    check_divisible("LLaMA", config, ("num_attention_heads", "num_key_value_heads", "vocab_size", "intermediate_size"), tp)


def tied_groups(config: LlamaConfig) -> list[list[str]]:
    """LLaMA keeps its head separate (tied LLaMA is refused by the models)."""
    return []
