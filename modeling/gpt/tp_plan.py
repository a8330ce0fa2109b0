"""GPT's TP plan: every parameter's single-card shape, split axis and pipeline place, in one table.

A column-parallel linear splits its weight's axis 1 and its bias; a row-parallel one splits weight
axis 0 and keeps its bias whole. The word embedding is also the output head: it splits its
vocabulary rows, and the pipeline holds it on the first and the last stage.
"""

from __future__ import annotations

from modeling.gpt.config import GPTConfig
from modeling.tp_plan import (
    COLUMN, FIRST, FIRST_AND_LAST, LAST, REPLICATED, ROW, VECTOR_SPLIT, VOCAB_ROWS, TensorPlan,
    check_divisible,
)

WORD_EMBEDDING = "gpt.embeddings.word_embeddings.weight"


def tensor_plan(config: GPTConfig) -> dict[str, TensorPlan]:
    """Single-card name -> TensorPlan, for every parameter of the model (the head is the embedding)."""
    h, i = config.hidden_size, config.intermediate_size
    layer = {}  # name -> (shape, axis, linear)
    for linear, (rows, cols), axis in (("self_attn.q_proj", (h, h), COLUMN), ("self_attn.k_proj", (h, h), COLUMN),
                                       ("self_attn.v_proj", (h, h), COLUMN), ("self_attn.out_proj", (h, h), ROW),
                                       ("linear1", (h, i), COLUMN), ("linear2", (i, h), ROW)):
        layer[f"{linear}.weight"] = ((rows, cols), axis, True)
        layer[f"{linear}.bias"] = ((cols,), VECTOR_SPLIT if axis == COLUMN else REPLICATED, False)
    layer |= {f"{norm}.{p}": ((h,), REPLICATED, False) for norm in ("norm1", "norm2") for p in ("weight", "bias")}
    plan = {WORD_EMBEDDING: TensorPlan((config.vocab_size, h), VOCAB_ROWS, FIRST_AND_LAST),
            "gpt.embeddings.position_embeddings.weight": TensorPlan((config.max_position_embeddings, h), REPLICATED,
                                                                    FIRST)}
    for n in range(config.num_hidden_layers):
        plan |= {f"gpt.decoder.layers.{n}.{name}": TensorPlan(shape, axis, n, linear)
                 for name, (shape, axis, linear) in layer.items()}
    plan |= {f"gpt.decoder.norm.{p}": TensorPlan((h,), REPLICATED, LAST) for p in ("weight", "bias")}
    return plan


def check_tensor_parallel(config, tp: int) -> None:
    """Fail before any weight is built when heads, vocabulary or MLP width do not split over `tp`."""
    check_divisible("GPT", config, ("num_attention_heads", "vocab_size", "intermediate_size"), tp)


def tied_groups(config: GPTConfig) -> list[list[str]]:
    """The head is the word embedding; PaddleNLP's GPTForCausalLM also names it lm_head.weight."""
    return [[WORD_EMBEDDING, "lm_head.weight"]]
