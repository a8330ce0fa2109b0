"""Model configs under transformers' and PaddleNLP's field names, so config.json files move between
the three unchanged: the fields every causal LM has, and the LLaMA-like decoder's.

A family's config subclass sets its defaults and its fixed architecture (`qk_norm`, `norm_offset`,
`norms`, which projections have biases, its rotary pairing); the decoder's declaration of each layer
(`decoder_layer(index)`: attention with its window, scale, soft-cap and rotary; the feed-forward
part; the norms around them) is read off those switches and the fields, so a family that differs
from LLaMA only in them is a config class and one registry entry, and a layer that differs by its
place (Gemma's sliding layers, SmolLM3's layers without rotary) differs in its declaration only.
"""

from __future__ import annotations

import math

from paddlenlp.transformers.configuration_utils import PretrainedConfig

from modeling.attention_core.spec import CoreSpec
from modeling.blocks.attention import Attention
from modeling.blocks.decoder import PRE_NORMS, Decoder, NormPlacement
from modeling.blocks.mlp import ACTIVATIONS, GatedMLP
from modeling.blocks.parts import Norm, Part
from modeling.blocks.rotary import Rotary, frozen, rope_scaling_error
from paddle_pp.runtime.errors import UserError

FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer types


class ModelConfigError(UserError, ValueError):
    """A model config whose shapes do not fit together, or that asks for what the model does not do."""


# transformers 5's remap of older layer-type names (`remap_legacy_layer_types`: Granite 4.0-H's, Bamba's)
LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": FULL}


def remapped_layer_types(kinds: list | None) -> list | None:
    """A per-layer list of layer types with the older names read as transformers 5 reads them."""
    return None if kinds is None else [LEGACY_LAYER_TYPES.get(kind, kind) for kind in kinds]


def check_layer_kinds(field: str, kinds: list, allowed: tuple[str, ...], num_layers: int) -> None:
    """A per-layer list of the config (`layer_types`, Kimi Linear's `mlp_layer_types`) names each of the
    `num_layers` layers by one of `allowed`."""
    unknown = sorted({str(kind) for kind in kinds} - set(allowed))
    if unknown or len(kinds) != num_layers:
        raise ModelConfigError(f"{field} must name {num_layers} layers, each " + " or ".join(map(repr, allowed))
                               + (f" ({', '.join(unknown)} not modelled)" if unknown else ""))


class CausalLMConfig(PretrainedConfig):
    """Fields common to every family, under PaddleNLP's names; families add their own."""

    attention_output = "o_proj"  # the attention's output projection's name (GPT: out_proj)
    has_dropout = False  # PaddleNLP's model of the family has dropout (GPT), which is not modelled here
    embedding_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden), Granite: a field)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    logits_divisor: float | None = None  # logits divided by this (Granite's logits_scaling)
    derived_fields: tuple[str, ...] = ()  # computed from other fields here and in transformers: not exported
    mtp_depth = 0  # multi-token prediction layers after the decoder (a family with them reads its field)
    mtp_loss_weight = 0.0  # each prediction depth's loss in the objective

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

    def transformers_spelling(self, values: dict) -> dict:
        """`values` (this config's fields, transformers 4.x spelling) as its transformers config.json spells
        them: 4.x's, which 5 reads too, unless a family's transformers 5 class reads a field only in its own
        spelling."""
        return values

    def decoder_layer(self, index: int) -> Part:
        """Decoder layer `index`'s declaration."""
        raise NotImplementedError

    def prediction_layer(self, depth: int) -> Part:
        """The multi-token prediction layer of depth `depth` (1..mtp_depth)'s declaration."""
        raise NotImplementedError

    def unused_stored(self) -> tuple[str, ...]:
        """Name prefixes (a text folder's spelling, "model.") of tensors some of the family's folders store
        for this config that its model does not use: left unread, noted, as transformers leaves them."""
        return ()

    def per_layer_embeddings(self):
        """The first stage's per-layer embeddings (`blocks.carried.PerLayerEmbeddings`), or None."""
        return None

    def prediction_layers(self) -> list[tuple[int, Part]]:
        """(layer index, declaration) of each multi-token prediction layer, by depth: numbered after
        the decoder layers, as the released checkpoints name them (DeepSeek-V3's layer 61), and placed
        on the last pipeline stage after the final norm."""
        return [(self.num_hidden_layers + depth - 1, self.prediction_layer(depth))
                for depth in range(1, self.mtp_depth + 1)]

    def validate(self) -> None:
        """Shapes that must fit together, checked before any weight exists."""

    def check_sequence_length(self, seq_len: int) -> None:
        """Fail when training on `seq_len` tokens would need what the model does not do."""
        if seq_len > self.max_position_embeddings:
            raise ModelConfigError(f"--max_seq_length {seq_len} exceeds the model's max_position_embeddings "
                                   f"{self.max_position_embeddings}; use at most that")


class DecoderConfig(CausalLMConfig):
    """The LLaMA-like decoder: rotary GQA attention and a gated MLP in residual blocks with RMSNorms
    (before each branch unless `norms` says otherwise). `head_dim` None means hidden_size /
    num_attention_heads."""

    model_type = "llama"
    qk_norm: str | None = None  # "head" (Qwen3): RMSNorm over each q and k head; "projection" (OLMoE): over q and k
    qk_norm_names = ("q_norm", "k_norm")  # their names in the layer's attention
    learned_activations: tuple[str, ...] = ()  # activations with weights of their own the family's MLP declares
    qk_norm_after_rotary = False  # per-head norms of the rotated q and k (Hunyuan), not before the rotary
    norm_offset = False  # Gemma: norms scale by 1 + weight
    scales_embeddings = False  # Gemma: embeddings times sqrt(hidden_size)
    norms: NormPlacement = PRE_NORMS
    interleaved_rotary = False  # rotary on interleaved pairs (ERNIE 4.5) instead of halves
    attention_bias = False  # a config field of the families that have it (biases on q, k, v and o)
    mlp_bias = False
    sliding_window: int | None = None  # a config field of the families that have windows
    partial_rotary_factor = 1.0  # a config field of the families that rotate part of each head (Phi-3/4)

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
    def embedding_scale(self) -> float | None:
        return math.sqrt(self.hidden_size) if self.scales_embeddings else None

    def hidden_norm(self) -> Norm:
        """The norm over the hidden size, in every layer and at the end."""
        return Norm(self.hidden_size, self.rms_norm_eps, offset=self.norm_offset)

    def attention_types(self) -> list[str]:
        """Each layer's attention, by transformers' names (FULL, SLIDING): full unless a family says."""
        return [FULL] * self.num_hidden_layers

    def window(self, index: int) -> int | None:
        """Layer `index`'s sliding window (transformers' W: a query sees W keys, itself included), or None."""
        return self.sliding_window if self.attention_types()[index] == SLIDING else None

    def attention_scale(self) -> float | None:
        """The softmax scale (None: head_dim^-1/2)."""
        return None

    def attention_softcap(self) -> float | None:
        return None

    def rope(self, index: int) -> tuple[float, dict | None] | None:
        """Layer `index`'s (theta, rope_scaling), or None for a layer without rotary."""
        return self.rope_theta, self.rope_scaling

    def rotary(self, index: int) -> Rotary | None:
        rope = self.rope(index)
        if rope is None:
            return None
        theta, scaling = rope
        return Rotary(int(self.head_dim * self.partial_rotary_factor), float(theta), frozen(scaling or {}),
                      self.interleaved_rotary, self.max_position_embeddings)

    def attention(self, index: int) -> Attention:
        return Attention(self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim,
                         qkv_bias=self.qkv_bias, o_bias=self.o_bias, output=self.attention_output,
                         qk_norm=self.qk_norm, norm=Norm(self.head_dim, self.rms_norm_eps, self.norm_offset),
                         spec=CoreSpec(self.attention_scale(), self.window(index), self.attention_softcap()),
                         rotary=self.rotary(index), qk_norm_names=self.qk_norm_names,
                         qk_norm_after_rotary=self.qk_norm_after_rotary)

    def feed_forward(self, index: int) -> tuple[str, Part]:
        """Layer `index`'s feed-forward part, under its name."""
        return "mlp", GatedMLP(self.hidden_size, self.intermediate_size, self.hidden_act, self.mlp_bias)

    def token_mixer(self, index: int) -> tuple[str, Part]:
        """Layer `index`'s token mixer, under its name in the layer: attention, unless a hybrid family
        gives the layer a recurrent mixer."""
        return "self_attn", self.attention(index)

    def layer_norms(self, index: int) -> NormPlacement:
        """Where layer `index`'s norms sit (one place for every layer, unless a family says)."""
        return self.norms

    def decoder_layer(self, index: int) -> Decoder:
        name, part = self.feed_forward(index)
        mixer_name, mixer = self.token_mixer(index)
        return Decoder(index, mixer, part, self.hidden_norm(), feed_forward_name=name, attention_name=mixer_name,
                       norms=self.layer_norms(index), residual_multiplier=getattr(self, "residual_multiplier", 1.0))

    def validate(self) -> None:
        super().validate()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                                   f"num_key_value_heads={self.num_key_value_heads} (GQA groups must be equal)")
        if self.hidden_act not in ACTIVATIONS and self.hidden_act not in self.learned_activations:
            raise ModelConfigError(f"hidden_act={self.hidden_act!r} is not modelled; use one of {sorted(ACTIVATIONS)}")
        check_layer_kinds("layer_types", self.attention_types(), (FULL, SLIDING), self.num_hidden_layers)
        for index in range(self.num_hidden_layers):
            rope = self.rope(index)
            problem = rope_scaling_error(rope[1]) if rope else None
            if problem:
                raise ModelConfigError(f"rope_scaling={rope[1]!r}: {problem}")
