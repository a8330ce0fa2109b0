"""What every model family shares: the common config fields and the PretrainedModel hooks."""

from __future__ import annotations

from types import ModuleType

import paddle
from paddlenlp.transformers.configuration_utils import PretrainedConfig
from paddlenlp.transformers.model_utils import PretrainedModel

from modeling.tp_plan import split_axes, tensor_parallel_mappings
from paddle_pp.runtime.errors import UserError


class ModelConfigError(UserError, ValueError):
    """A model config whose shapes do not fit together."""


class CausalLMConfig(PretrainedConfig):
    """Fields common to LLaMA and GPT, under PaddleNLP's names; families add their own."""

    def __init__(self, vocab_size: int, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
                 num_attention_heads: int, max_position_embeddings: int, initializer_range: float = 0.02,
                 recompute: bool = False, virtual_pp_degree: int = 1, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.recompute = recompute
        self.virtual_pp_degree = virtual_pp_degree
        super().__init__(**kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        """Shapes that must divide, checked before any weight exists."""
        if self.hidden_size % self.num_attention_heads:
            raise ModelConfigError(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                                   f"{self.num_attention_heads}; pick a head count that divides it")


class CausalLMPretrainedModel(PretrainedModel):
    """PaddleNLP hooks answered from the family's TP plan module (`tp_plan.tensor_plan`)."""

    tp_plan: ModuleType

    @classmethod
    def _get_tensor_parallel_mappings(cls, config, is_split: bool = True) -> dict:
        return tensor_parallel_mappings(
            split_axes(cls.tp_plan.tensor_plan(config)), is_split, config.tensor_parallel_degree, config.tensor_parallel_rank)

    def _init_weights(self, layer):
        """Matrices (linears, embeddings, heads) from N(0, initializer_range); vectors keep their
        defaults (norm scales one, biases zero)."""
        weight = getattr(layer, "weight", None)
        if isinstance(weight, paddle.Tensor) and len(weight.shape) >= 2:
            weight.set_value(paddle.normal(0.0, self.config.initializer_range, weight.shape).astype(weight.dtype))
