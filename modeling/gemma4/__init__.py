"""Gemma 4's text model (`gemma4_text`: E2B, E4B, 31B, 26B-A4B), as transformers 5 builds it.

- Gemma's tied, scaled embeddings and sandwich norms, but norms that scale by their weight (not
  1 + weight), GeGLU, the final soft-cap where `final_logit_softcapping` says, softmax scale 1 (the
  per-head q/k norms set the scale).
- Attention per layer type (`layer_types`, sliding windows of `sliding_window` keys, the last layer
  always full): sliding layers `head_dim` wide with `num_key_value_heads` and theta
  `rope_local_base_freq` (transformers 5's `rope_parameters.sliding_attention`); full layers
  `global_head_dim` wide, with `num_global_key_value_heads` when `attention_k_eq_v` (their values are
  then their key projection's output: no v_proj), and Gemma 4's proportional rotary (the first
  `partial_rotary_factor` of the pairs turn, at the whole head's frequencies). Every value head is
  normalised without a weight (v_norm). transformers saves the full layers' geometry as
  `per_layer_config`, Google's folders as `global_head_dim` / `num_global_key_value_heads`: both read.
- Per-layer embeddings (`hidden_size_per_layer_input` > 0) and the last `num_kv_shared_layers` layers
  attending with the keys and values of the last earlier layer of their type (twice as wide an MLP
  there with `use_double_wide_mlp`): `blocks/carried.py`. Every layer's output times its stored
  `layer_scalar`.
- 26B-A4B (`enable_moe_block`): experts beside every layer's dense MLP (`experts`).

Refused by name: `use_bidirectional_attention: "all"` (an encoder), rotary types other than Gemma 4's, and per-layer
overrides other than the full layers' head size and key/value heads. `use_bidirectional_attention:
"vision"` changes only image tokens' attention, which text training has none of.
"""

from __future__ import annotations

from dataclasses import replace

from modeling.attention_core.spec import CoreSpec
from modeling.blocks.attention import HEAD_NORM, REUSE_KV, STORE_KV, Attention
from modeling.blocks.carried import CarryingDecoder, PerLayerEmbeddings, per_layer_input, shared_kv
from modeling.blocks.decoder import SANDWICH_NORMS
from modeling.blocks.mlp import GATED_NAMES, GatedMLP
from modeling.blocks.moe import Experts, MoE
from modeling.blocks.parts import Norm, Part
from modeling.blocks.rotary import Rotary, frozen, rope_type
from modeling.blocks.router import Routing, ScaledRouter
from modeling.config import FULL, SLIDING, DecoderConfig, ModelConfigError
from modeling.decoder_family import decoder_family
from modeling.fused_experts import stacked_expert
from modeling.transformers_adapter import Stored

PROPORTIONAL = "proportional"
FULL_ROTARY = {"rope_type": PROPORTIONAL}  # transformers' default for full layers (None: the plain rotary)
OVERRIDES = ("head_dim", "num_key_value_heads")  # what transformers' per_layer_config may change on full layers


class Gemma4TextConfig(DecoderConfig):
    model_type = "gemma4_text"
    scales_embeddings = True
    norms = SANDWICH_NORMS
    qk_norm = HEAD_NORM
    pattern = 6  # transformers' default layer types: every sixth layer full, the others sliding
    derived_fields = ("per_layer_config",)
    experts_stacked = True  # its folders stack the experts (no per-expert layout)
    expert_names = GATED_NAMES

    def __init__(self, vocab_size: int = 262144, hidden_size: int = 2304, intermediate_size: int = 9216,
                 num_hidden_layers: int = 30, num_attention_heads: int = 8, num_key_value_heads: int | None = 4,
                 head_dim: int | None = 256, hidden_act: str = "gelu_pytorch_tanh",
                 max_position_embeddings: int = 131072, rope_theta: float = 1e6, rope_local_base_freq: float = 1e4,
                 rope_scaling: dict | None = FULL_ROTARY, partial_rotary_factor: float | None = None,
                 sliding_window: int | None = 512, layer_types: list[str] | None = None,
                 final_logit_softcapping: float | None = None, attention_bias: bool = False,
                 global_head_dim: int = 512, num_global_key_value_heads: int | None = None,
                 attention_k_eq_v: bool = False, per_layer_config: dict | None = None,
                 vocab_size_per_layer_input: int | None = None, hidden_size_per_layer_input: int = 256,
                 num_kv_shared_layers: int = 0, use_double_wide_mlp: bool = False, enable_moe_block: bool = False,
                 num_experts: int | None = None, top_k_experts: int | None = None,
                 moe_intermediate_size: int | None = None, tie_word_embeddings: bool = True,
                 pad_token_id: int | None = 0, bos_token_id: int | None = 2, eos_token_id: int | None = 1, **kwargs):
        self.rope_local_base_freq = rope_local_base_freq
        # transformers' default full-layer rotary turns a quarter of the pairs; a full-layer rotary given without
        # the factor turns them all (its `partial_rotary_factor` defaults to 1 there)
        self.partial_rotary_factor = partial_rotary_factor if partial_rotary_factor is not None else \
            0.25 if rope_scaling is FULL_ROTARY else 1.0
        self.sliding_window, self.final_logit_softcapping = sliding_window, final_logit_softcapping
        self.attention_bias, self.attention_k_eq_v = attention_bias, attention_k_eq_v
        types = list(layer_types or [SLIDING if (i + 1) % self.pattern else FULL for i in range(num_hidden_layers)])
        self.layer_types = types[:-1] + [FULL] if types else types  # transformers makes the last layer full
        self.global_head_dim, self.num_global_key_value_heads = _full_geometry(
            per_layer_config, self.layer_types, global_head_dim, num_global_key_value_heads)
        self.per_layer_config = None
        self.vocab_size_per_layer_input = vocab_size_per_layer_input or vocab_size  # transformers' resize sets both
        self.hidden_size_per_layer_input = hidden_size_per_layer_input
        self.num_kv_shared_layers, self.use_double_wide_mlp = num_kv_shared_layers, use_double_wide_mlp
        self.enable_moe_block, self.top_k_experts = enable_moe_block, top_k_experts
        # transformers reads the experts' fields only with the block on: a dense config holds none
        self.num_experts = num_experts if enable_moe_block else None
        self.moe_intermediate_size = moe_intermediate_size
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, head_dim=head_dim, hidden_act=hidden_act,
                         max_position_embeddings=max_position_embeddings, rope_theta=rope_theta,
                         rope_scaling=rope_scaling,
                         tie_word_embeddings=tie_word_embeddings, pad_token_id=pad_token_id,
                         bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)

    def transformers_spelling(self, values: dict) -> dict:
        """transformers 5's `rope_parameters` per layer type (it has no other spelling of the sliding
        layers' theta)."""
        values = dict(values)
        full = {**(values.pop("rope_scaling") or {"rope_type": "default"}), "rope_theta": values.pop("rope_theta"),
                "partial_rotary_factor": values.pop("partial_rotary_factor")}
        local = {"rope_type": "default", "rope_theta": values.pop("rope_local_base_freq")}
        return {**values, "rope_parameters": {FULL: full, SLIDING: local}}

    @property
    def final_logit_softcap(self) -> float | None:
        return self.final_logit_softcapping

    def attention_types(self) -> list[str]:
        return list(self.layer_types)

    def attention_scale(self) -> float:
        return 1.0

    def full(self, index: int) -> bool:
        return self.layer_types[index] == FULL

    def kv_heads(self, index: int) -> int:
        """Full layers with keys as values have `num_global_key_value_heads` (when given)."""
        if self.full(index) and self.attention_k_eq_v and self.num_global_key_value_heads is not None:
            return self.num_global_key_value_heads
        return self.num_key_value_heads

    def rope(self, index: int) -> tuple[float, dict | None]:
        """Sliding layers: their own theta, unscaled; full layers: Gemma 4's proportional rotary (or the
        plain one over the whole head, `default`, which leaves `partial_rotary_factor` unused)."""
        if not self.full(index):
            return self.rope_local_base_freq, None
        scaling = dict(self.rope_scaling or {})
        if rope_type(scaling) == PROPORTIONAL:
            scaling["partial_rotary_factor"] = self.partial_rotary_factor
        return self.rope_theta, scaling

    def rotary(self, index: int) -> Rotary:
        theta, scaling = self.rope(index)
        scaling = None if rope_type(scaling) == "default" else scaling
        return Rotary(self.global_head_dim if self.full(index) else self.head_dim, float(theta),
                      frozen(scaling or {}), False, self.max_position_embeddings)

    def kv_sharing(self) -> list[str | None]:
        """Each layer's part in sharing keys and values (transformers' `kv_sharing_modes`, a storing layer
        marked only where a later layer reads it): the last `num_kv_shared_layers` reuse, the last layer
        of each of their types before them stores."""
        first = self.num_hidden_layers - self.num_kv_shared_layers
        modes: list[str | None] = [None] * first + [REUSE_KV] * self.num_kv_shared_layers
        for kind in {self.layer_types[index] for index in range(first, self.num_hidden_layers)}:
            producers = [index for index in range(first) if self.layer_types[index] == kind]
            if producers:
                modes[producers[-1]] = STORE_KV
        return modes

    def carried(self, index: int) -> tuple[str, ...]:
        """What travels beside the hidden states into layer `index` (the final norm for the last + 1):
        the per-layer inputs of it and the layers after, and each layer type's shared keys and values
        from their storing layer on to their last reader."""
        names = [per_layer_input(later) for later in range(index, self.num_hidden_layers)] \
            if self.hidden_size_per_layer_input else []
        modes = self.kv_sharing()
        for stored in (layer for layer, mode in enumerate(modes) if mode == STORE_KV):
            kind = self.layer_types[stored]
            last = max(layer for layer, mode in enumerate(modes) if mode == REUSE_KV and self.layer_types[layer] == kind)
            if stored < index <= last:
                names += shared_kv(kind)
        return tuple(names)

    def attention(self, index: int) -> Attention:
        full, head_dim = self.full(index), self.global_head_dim if self.full(index) else self.head_dim
        global_kv = full and self.kv_heads(index) != self.num_key_value_heads
        return Attention(self.hidden_size, self.num_attention_heads, self.kv_heads(index), head_dim,
                         qkv_bias=self.attention_bias, o_bias=self.attention_bias, qk_norm=HEAD_NORM,
                         norm=Norm(head_dim, self.rms_norm_eps), spec=CoreSpec(1.0, self.window(index)),
                         rotary=self.rotary(index), values_from_keys=full and self.attention_k_eq_v, value_norm=True,
                         kv_sharing=self.kv_sharing()[index],
                         kv_unit="num_global_key_value_heads" if global_kv else "num_key_value_heads")

    def feed_forward(self, index: int) -> tuple[str, Part]:
        wide = 2 if self.use_double_wide_mlp and self.kv_sharing()[index] == REUSE_KV else 1
        return "mlp", GatedMLP(self.hidden_size, self.intermediate_size * wide, self.hidden_act)

    def unused_stored(self) -> tuple[str, ...]:
        """The key and value projections and norms of the layers that reuse others' (transformers' ignore
        list: some folders keep them)."""
        return tuple(f"model.layers.{index}.self_attn.{name}." for index, mode in enumerate(self.kv_sharing())
                     if mode == REUSE_KV for name in ("k_proj", "v_proj", "k_norm", "v_norm"))

    def per_layer_embeddings(self) -> PerLayerEmbeddings | None:
        if not self.hidden_size_per_layer_input:
            return None
        return PerLayerEmbeddings(self.vocab_size_per_layer_input, self.hidden_size, self.num_hidden_layers,
                                  self.hidden_size_per_layer_input, self.rms_norm_eps)

    @property
    def num_experts_per_tok(self) -> int | None:
        return self.top_k_experts

    def experts(self, index: int) -> MoE | None:
        """26B-A4B's experts beside the dense MLP of every layer (`enable_moe_block`): `ScaledRouter`'s
        softmax top-`top_k_experts`, renormalised, times each chosen expert's scale; GeGLU experts
        `moe_intermediate_size` wide on the normalised hidden states; no balance loss (transformers
        computes none)."""
        if not self.enable_moe_block:
            return None
        expert = GatedMLP(self.hidden_size, self.moe_intermediate_size, self.hidden_act, unit="moe_intermediate_size")
        return MoE(index, self.hidden_size, Experts(self.num_experts, expert),
                   Routing(self.top_k_experts, renormalize=True, fp32=False), names=("router", "shared_expert"),
                   norms=self.hidden_norm(), router=ScaledRouter(self.hidden_size, self.num_experts, self.rms_norm_eps))

    def decoder_layer(self, index: int) -> CarryingDecoder:
        name, part = self.feed_forward(index)
        mode = self.kv_sharing()[index]
        return CarryingDecoder(index, self.attention(index), part, self.hidden_norm(), feed_forward_name=name,
                               norms=self.norms, per_layer_dim=self.hidden_size_per_layer_input or None,
                               per_layer_activation=self.hidden_act, scalar=True, carried_in=self.carried(index),
                               carried_out=self.carried(index + 1),
                               mixer_takes=shared_kv(self.layer_types[index]) if mode == REUSE_KV else (),
                               mixer_gives=shared_kv(self.layer_types[index]) if mode == STORE_KV else (),
                               moe=self.experts(index))

    def validate(self) -> None:
        super().validate()
        kind = rope_type(self.rope_scaling)
        if kind not in ("default", PROPORTIONAL):
            raise ModelConfigError(f"rope_parameters.full_attention rope_type {kind!r}: Gemma 4's full layers are "
                                   f"modelled with its {PROPORTIONAL!r} rotary (or 'default') only")
        for index in range(self.num_hidden_layers):
            if self.num_attention_heads % self.kv_heads(index):
                raise ModelConfigError(f"num_attention_heads={self.num_attention_heads} is not divisible by layer "
                                       f"{index}'s {self.kv_heads(index)} key/value heads")
        first = self.num_hidden_layers - self.num_kv_shared_layers
        if not 0 <= self.num_kv_shared_layers < self.num_hidden_layers:
            raise ModelConfigError(f"num_kv_shared_layers={self.num_kv_shared_layers} must leave at least one of the "
                                   f"{self.num_hidden_layers} layers computing its own keys and values")
        if self.enable_moe_block and not (self.num_experts and self.moe_intermediate_size and
                                          0 < (self.top_k_experts or 0) <= self.num_experts):
            raise ModelConfigError(f"enable_moe_block needs num_experts, moe_intermediate_size and top_k_experts "
                                   f"between 1 and num_experts (given {self.num_experts}, {self.moe_intermediate_size}, "
                                   f"{self.top_k_experts})")
        orphans = sorted(set(self.layer_types[first:]) - set(self.layer_types[:first]))
        if orphans:
            raise ModelConfigError(f"num_kv_shared_layers={self.num_kv_shared_layers}: no layer before the shared ones "
                                   f"is of type {', '.join(orphans)}, whose keys and values they would reuse")


def _full_geometry(per_layer_config: dict | None, layer_types: list[str], global_head_dim: int,
                   num_global_key_value_heads: int | None) -> tuple[int, int | None]:
    """(global_head_dim, num_global_key_value_heads) from the fields, or from transformers'
    `per_layer_config` (layer index -> overrides) when a folder saved by transformers gives it: the
    same overrides on every full layer and none elsewhere is what it can say of Gemma 4."""
    if not per_layer_config:
        return global_head_dim, num_global_key_value_heads
    full = {str(index) for index, kind in enumerate(layer_types) if kind == FULL}
    overrides = {str(index): dict(values) for index, values in per_layer_config.items()}
    if set(overrides) != full or any(set(values) - set(OVERRIDES) for values in overrides.values()) \
            or len({tuple(sorted(values.items())) for values in overrides.values()}) != 1:
        raise ModelConfigError(f"per_layer_config={per_layer_config!r}: only the same {' and '.join(OVERRIDES)} on every "
                               "full_attention layer are modelled (Gemma 4's global_head_dim and "
                               "num_global_key_value_heads)")
    values = next(iter(overrides.values()))
    return values.get("head_dim", global_head_dim), values.get("num_key_value_heads", num_global_key_value_heads)


def on_disk(stored: Stored, config: Gemma4TextConfig) -> Stored:
    """Where Gemma 4's folders keep our tensor: the experts' block's parts (router, experts, their norms)
    sit in the layer itself, the experts stacked (`experts.gate_up_proj` [E, 2I, H], `down_proj`)."""
    return stacked_expert(replace(stored, name=stored.name.replace(".moe.", ".")), config)


GEMMA4_TEXT = decoder_family(Gemma4TextConfig, "Gemma4ForCausalLM", "gemma4", paddlenlp=False,
                             renamed={"hidden_activation": "hidden_act"}, fuse=on_disk,
                             accepted={"use_bidirectional_attention": lambda value, _: value in (None, False, "vision")})
Gemma4ForCausalLM, Gemma4ForCausalLMPipe = GEMMA4_TEXT.causal_lm, GEMMA4_TEXT.pipe
