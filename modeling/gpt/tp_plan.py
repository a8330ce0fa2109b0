"""How each GPT weight splits under tensor parallelism: the one source save, load and tools read.

Paddle linears store weights as [in, out]: a column-parallel linear splits weight axis 1 and its
bias; a row-parallel one splits weight axis 0 and keeps its bias whole. The tied word embedding
splits its vocabulary rows, which is also the head's split. `None` means replicated.
"""

from __future__ import annotations

from modeling.gpt.config import GPTConfig
from modeling.tp_utils import TPPlanError

COLUMN, ROW, REPLICATED = 1, 0, None
VECTOR_SPLIT = 0

WORD_EMBEDDING = "gpt.embeddings.word_embeddings.weight"

_LAYER_AXES = {
    "self_attn.q_proj.weight": COLUMN,
    "self_attn.q_proj.bias": VECTOR_SPLIT,
    "self_attn.k_proj.weight": COLUMN,
    "self_attn.k_proj.bias": VECTOR_SPLIT,
    "self_attn.v_proj.weight": COLUMN,
    "self_attn.v_proj.bias": VECTOR_SPLIT,
    "self_attn.out_proj.weight": ROW,
    "self_attn.out_proj.bias": REPLICATED,
    "linear1.weight": COLUMN,
    "linear1.bias": VECTOR_SPLIT,
    "linear2.weight": ROW,
    "linear2.bias": REPLICATED,
    "norm1.weight": REPLICATED,
    "norm1.bias": REPLICATED,
    "norm2.weight": REPLICATED,
    "norm2.bias": REPLICATED,
}


def check_tensor_parallel(config: GPTConfig, tp: int) -> None:
    """Fail before any weight is built when heads, vocabulary or MLP width do not split over `tp`."""
    for field in ("num_attention_heads", "vocab_size", "intermediate_size"):
        value = getattr(config, field)
        if value % tp:
            raise TPPlanError(
                f"GPT {field}={value} is not divisible by --tensor_parallel_degree {tp}; "
                f"choose a degree that divides it{' (or pad the vocabulary)' if field == 'vocab_size' else ''}."
            )


def split_axes(config: GPTConfig) -> dict[str, int | None]:
    """Single-card parameter name -> tensor-parallel split axis, for every parameter of the model."""
    axes: dict[str, int | None] = {
        WORD_EMBEDDING: ROW,
        "gpt.embeddings.position_embeddings.weight": REPLICATED,
        "gpt.decoder.norm.weight": REPLICATED,
        "gpt.decoder.norm.bias": REPLICATED,
    }
    for i in range(config.num_hidden_layers):
        axes |= {f"gpt.decoder.layers.{i}.{name}": axis for name, axis in _LAYER_AXES.items()}
    return axes


def tied_groups(config: GPTConfig) -> list[list[str]]:
    """The head is the word embedding; PaddleNLP's GPTForCausalLM also names it lm_head.weight."""
    return [[WORD_EMBEDDING, "lm_head.weight"]]


def single_card_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's single-card shape, computed from the config (no model is built)."""
    h, i = config.hidden_size, config.intermediate_size
    layer = {"self_attn.q_proj.weight": (h, h), "self_attn.k_proj.weight": (h, h), "self_attn.v_proj.weight": (h, h),
             "self_attn.out_proj.weight": (h, h), "linear1.weight": (h, i), "linear2.weight": (i, h)}
    layer |= {name.replace("weight", "bias"): (shape[1],) for name, shape in layer.items()}
    layer |= {f"{norm}.{p}": (h,) for norm in ("norm1", "norm2") for p in ("weight", "bias")}
    shapes = {WORD_EMBEDDING: (config.vocab_size, h), "gpt.embeddings.position_embeddings.weight":
              (config.max_position_embeddings, h), "gpt.decoder.norm.weight": (h,), "gpt.decoder.norm.bias": (h,)}
    for n in range(config.num_hidden_layers):
        shapes |= {f"gpt.decoder.layers.{n}.{name}": shape for name, shape in layer.items()}
    return shapes
