"""How each LLaMA weight splits under tensor parallelism: the one source save, load and tools read.

Paddle linears store weights as [in, out]: a column-parallel linear splits axis 1, a row-parallel
one axis 0; the embedding splits its vocabulary rows. `None` means replicated on every tp rank.
"""

from __future__ import annotations

from modeling.llama.config import LlamaConfig
from modeling.tp_utils import TPPlanError

COLUMN, ROW, REPLICATED = 1, 0, None

_LAYER_AXES = {
    "self_attn.q_proj.weight": COLUMN,
    "self_attn.k_proj.weight": COLUMN,
    "self_attn.v_proj.weight": COLUMN,
    "self_attn.o_proj.weight": ROW,
    "mlp.gate_proj.weight": COLUMN,
    "mlp.up_proj.weight": COLUMN,
    "mlp.down_proj.weight": ROW,
    "input_layernorm.weight": REPLICATED,
    "post_attention_layernorm.weight": REPLICATED,
}


def check_tensor_parallel(config: LlamaConfig, tp: int) -> None:
    """Fail before any weight is built when heads, kv heads or vocabulary do not split over `tp`."""
    checks = [
        ("num_attention_heads", config.num_attention_heads),
        ("num_key_value_heads", config.num_key_value_heads),
        ("vocab_size", config.vocab_size),
        ("intermediate_size", config.intermediate_size),
    ]
    for field, value in checks:
        if value % tp:
            raise TPPlanError(
                f"LLaMA {field}={value} is not divisible by --tensor_parallel_degree {tp}; "
                f"choose a degree that divides it{' (or pad the vocabulary)' if field == 'vocab_size' else ''}."
            )


def split_axes(config: LlamaConfig) -> dict[str, int | None]:
    """Single-card parameter name -> tensor-parallel split axis, for every parameter of the model."""
    axes: dict[str, int | None] = {"llama.embed_tokens.weight": ROW, "llama.norm.weight": REPLICATED}
    for i in range(config.num_hidden_layers):
        axes |= {f"llama.layers.{i}.{name}": axis for name, axis in _LAYER_AXES.items()}
    axes["lm_head.weight"] = COLUMN
    return axes


def tied_groups(config: LlamaConfig) -> list[list[str]]:
    """LLaMA keeps its head separate (tied LLaMA is refused by the models)."""
    return []


def single_card_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's single-card shape, computed from the config (no model is built)."""
    h, i, v, kv = config.hidden_size, config.intermediate_size, config.vocab_size, \
        config.num_key_value_heads * config.head_dim
    layer = {"self_attn.q_proj.weight": (h, h), "self_attn.k_proj.weight": (h, kv), "self_attn.v_proj.weight": (h, kv),
             "self_attn.o_proj.weight": (h, h), "mlp.gate_proj.weight": (h, i), "mlp.up_proj.weight": (h, i),
             "mlp.down_proj.weight": (i, h), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    shapes = {"llama.embed_tokens.weight": (v, h), "llama.norm.weight": (h,), "lm_head.weight": (h, v)}
    for n in range(config.num_hidden_layers):
        shapes |= {f"llama.layers.{n}.{name}": shape for name, shape in layer.items()}
    return shapes
