"""Model configs under transformers' and PaddleNLP's field names, so config.json files move between
the three unchanged: the fields every causal LM has, and the LLaMA-like decoder's.

A family's config subclass sets its defaults and its fixed architecture (`qk_norm`, `norm_offset`,
`embedding_multiplier`, which projections have biases); blocks read those switches, so a family
that differs from LLaMA only in them is a config class and one registry entry.
"""

from __future__ import annotations

import math

from paddlenlp.transformers.configuration_utils import PretrainedConfig

from modeling.blocks.mlp import ACTIVATIONS
from modeling.blocks.parts import Norm
from modeling.blocks.rotary import rope_scaling_error
from paddle_pp.runtime.errors import UserError


class ModelConfigError(UserError, ValueError):
    """A model config whose shapes do not fit together, or that asks for what the model does not do."""


class CausalLMConfig(PretrainedConfig):
    """Fields common to every family, under PaddleNLP's names; families add their own."""

    attention_output = "o_proj"  # the attention's output projection's name (GPT: out_proj)
    has_dropout = False  # PaddleNLP's model of the family has dropout (GPT), which is not modelled here

    def __init__(self, vocab_size: int, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
                 num_attention_heads: int, max_position_embeddings: int, initializer_range: float = 0.02, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        super().__init__(**kwargs)

    def validate(self) -> None:
        """Shapes that must fit together, checked before any weight exists."""

    def check_sequence_length(self, seq_len: int) -> None:
        """Fail when training on `seq_len` tokens would need what the model does not do."""
        if seq_len > self.max_position_embeddings:
            raise ModelConfigError(f"--max_seq_length {seq_len} exceeds the model's max_position_embeddings "
                                   f"{self.max_position_embeddings}; use at most that")


class DecoderConfig(CausalLMConfig):
    """The LLaMA-like decoder: pre-norm blocks of rotary GQA attention and a gated MLP, RMSNorm.
    `head_dim` None means hidden_size / num_attention_heads."""

    model_type = "llama"
    qk_norm: str | None = None  # "head" (Qwen3): RMSNorm over each q and k head; "projection" (OLMoE): over q and k
    norm_offset = False  # Gemma: norms scale by 1 + weight
    scales_embeddings = False  # Gemma: embeddings times sqrt(hidden_size)
    rotary = True
    attention_bias = False  # a config field of the families that have it (biases on q, k, v and o)
    mlp_bias = False

    def __init__(self, vocab_size: int = 32000, hidden_size: int = 4096, intermediate_size: int = 11008,
                 num_hidden_layers: int = 32, num_attention_heads: int = 32, num_key_value_heads: int | None = None,
                 head_dim: int | None = None, hidden_act: str = "silu", max_position_embeddings: int = 2048,
                 rms_norm_eps: float = 1e-6, rope_theta: float = 10000.0, rope_scaling: dict | None = None,
                 tie_word_embeddings: bool = False, initializer_range: float = 0.02, pad_token_id: int | None = 0,
                 bos_token_id: int | None = 1, eos_token_id: int | None = 2, **kwargs):
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        # transformers' rule: hidden_size // num_attention_heads unless given (Qwen3 and Gemma give another)
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.rope_scaling = dict(rope_scaling) if rope_scaling else None
        super().__init__(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
            max_position_embeddings=max_position_embeddings, initializer_range=initializer_range,
            pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def qkv_bias(self) -> bool:
        return bool(getattr(self, "attention_bias", False))

    @property
    def o_bias(self) -> bool:
        return bool(getattr(self, "attention_bias", False))

    @property
    def embedding_multiplier(self) -> float | None:
        return math.sqrt(self.hidden_size) if self.scales_embeddings else None

    def hidden_norm(self) -> Norm:
        """The norm over the hidden size, in every layer and at the end."""
        return Norm(self.hidden_size, self.rms_norm_eps, offset=self.norm_offset)

    def sliding_windows(self) -> dict[str, int]:
        """Attention windows shorter than the whole sequence, by the field that sets them (none here)."""
        return {}

    def validate(self) -> None:
        super().validate()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                                   f"num_key_value_heads={self.num_key_value_heads} (GQA groups must be equal)")
        if self.hidden_act not in ACTIVATIONS:
            raise ModelConfigError(f"hidden_act={self.hidden_act!r} is not modelled; use one of {sorted(ACTIVATIONS)}")
        problem = rope_scaling_error(self.rope_scaling)
        if problem:
            raise ModelConfigError(f"rope_scaling={self.rope_scaling!r}: {problem}")

    def check_sequence_length(self, seq_len: int) -> None:
        super().check_sequence_length(seq_len)
        for name, window in self.sliding_windows().items():
            if window < seq_len:
                raise ModelConfigError(
                    f"{name}={window} is shorter than --max_seq_length {seq_len}: sliding-window attention is not "
                    f"modelled (it changes which tokens attend to which); train on at most {window} tokens")
