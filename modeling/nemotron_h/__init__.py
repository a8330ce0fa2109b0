"""Nemotron-H (`nemotron_h`: Nemotron-H 8B-56B, Nemotron 3 Nano / Super / Ultra): layers that each hold
one part after one pre-norm, as `layers_block_type` (or the released `hybrid_override_pattern`: M, *, -,
E) says: Mamba-2 (`linear_attention`, `blocks/mamba2.Mamba2`), attention without rotary (`full_attention`:
GQA, no biases), a ReLU^2 MLP (`mlp`: up, down) or a mixture of experts (`moe`: ReLU^2 experts,
DeepSeek-V3's sigmoid routing with a correction bias and groups, one shared expert, and with
`moe_latent_size` the routed tokens projected down before the experts and back after). Every part sits
under `mixer`, the norm before it is `norm`.

Its folders name the body `backbone.` (the embedding `embeddings`, the final norm `norm_f`), and store
a Mamba-2 layer's five projections fused (`in_proj`: z | x | B | C | dt) and its three convs likewise
(`conv1d`: x | B | C, weight and bias); ours are separate (tp cuts each by heads or groups).

As transformers 5 builds it: the attention's and Mamba's `attention_bias` and `mamba_proj_bias` are
read past (transformers builds neither bias; the Mamba projections' is `use_bias`), dt is clamped below
at `time_step_min`, the config's `time_step_limit`, the init ranges and `expand` are read past, and the
multi-token prediction layers released folders carry (`mtp.*`, `num_nextn_predict_layers`) are left
unread with a note. The routed experts' balance is DeepSeek-V3's (the correction bias moved after each
step, the sequence-wise loss at `aux_loss_alpha`, 1e-4 when the config is silent: transformers has no
balance loss; NVIDIA trained with one)."""

from __future__ import annotations

import math
from dataclasses import replace

from modeling.blocks.decoder import Decoder, NormPlacement
from modeling.blocks.mamba2 import Mamba2, fused_mamba2
from modeling.blocks.mlp import PlainMLP
from modeling.blocks.moe import Experts, MoE
from modeling.config import FULL, ModelConfigError, check_layer_kinds, remapped_layer_types
from modeling.config_fields import MOE_ACCEPTED, any_value
from modeling.decoder_family import decoder_family
from modeling.moe_config import MoEConfig, check_v3_groups, v3_routing
from modeling.qwen3_5 import LINEAR, MTP_UNREAD
from modeling.transformers_adapter import Stored

MLP, EXPERTS = "mlp", "moe"
KINDS = (LINEAR, FULL, MLP, EXPERTS)
PATTERN = {"M": LINEAR, "*": FULL, "-": MLP, "E": EXPERTS}  # hybrid_override_pattern's letters
MIXER = "mixer"  # every layer's one part
DEFAULT_CYCLE = (LINEAR, EXPERTS, FULL, MLP)
BEFORE_MIXER = NormPlacement("norm", None, None, None)
BEFORE_FEED_FORWARD = NormPlacement(None, None, "norm", None)
_BODY = {"model.embed_tokens.": "backbone.embeddings.", "model.norm.": "backbone.norm_f."}
# read as transformers 5 reads them: they shape a fresh model's draw, a kernel, a cache, or nothing
_READ_PAST = ("time_step_max", "time_step_floor", "time_step_limit", "expand", "chunk_size", "mamba_ssm_cache_dtype",
              "use_mamba_kernels", "num_logits_to_keep", "rescale_prenorm_residual", "residual_in_fp32",
              "moe_shared_expert_overlap", "n_shared_experts", "mtp_layers_block_type", "num_nextn_predict_layers",
              "attention_bias", "mamba_proj_bias", "mamba_expand", "mamba_dt_max", "mamba_dt_limit",
              "mamba_dt_init_floor", "mamba_chunk_size")
_ALIASES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_dt_min": "time_step_min",
            "mamba_conv_bias": "use_conv_bias"}


class NemotronHConfig(MoEConfig):
    model_type = "nemotron_h"
    # rotary fields it has none of, the pattern written back as layers_block_type, ours of the balance loss
    derived_fields = ("num_hidden_layers", "hybrid_override_pattern", "rope_theta", "rope_scaling",
                      "router_aux_loss_coef")

    def __init__(self, vocab_size: int = 131072, hidden_size: int = 4096, intermediate_size: int = 21504,
                 layers_block_type: list[str] | None = None, hybrid_override_pattern: str | None = None,
                 num_attention_heads: int = 32, num_key_value_heads: int | None = 8, head_dim: int | None = 128,
                 max_position_embeddings: int = 4096, hidden_act: str = "relu2", mlp_bias: bool = False,
                 ssm_state_size: int = 128, mamba_num_heads: int = 128, mamba_head_dim: int = 64,
                 mamba_hidden_act: str = "silu", n_groups: int = 8, conv_kernel: int = 4, time_step_min: float = 0.001,
                 use_conv_bias: bool = True, use_bias: bool = False, num_experts: int = 8,
                 num_experts_per_tok: int = 2, moe_intermediate_size: int = 7688,
                 moe_shared_expert_intermediate_size: int = 7688, moe_latent_size: int | None = None,
                 routed_scaling_factor: float = 1.0, n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
                 aux_loss_alpha: float | None = None, rms_norm_eps: float = 1e-5, tie_word_embeddings: bool = False,
                 pad_token_id: int | None = 0, bos_token_id: int | None = 1, eos_token_id: int | None = 2, **kwargs):
        if kwargs.setdefault("router_aux_loss_coef", 0.0):  # our own saves write the field, as 0.0
            raise ModelConfigError(f"router_aux_loss_coef={kwargs['router_aux_loss_coef']}: Nemotron-H's balance loss "
                                   "weight is aux_loss_alpha; set router_aux_loss_coef to 0 or remove it")
        count = kwargs.pop("num_hidden_layers", None)  # transformers 5 derives it from the layer list, as here
        if layers_block_type is None and hybrid_override_pattern:
            layers_block_type = [PATTERN.get(letter, letter) for letter in hybrid_override_pattern]
        layers_block_type = remapped_layer_types(layers_block_type)
        # transformers' default list, or (a run from flags) its cycle over the layers asked for
        self.layers_block_type = list(layers_block_type or [DEFAULT_CYCLE[i % 4] for i in range(count or 4)])
        self.ssm_state_size, self.mamba_num_heads, self.mamba_head_dim = ssm_state_size, mamba_num_heads, mamba_head_dim
        self.mamba_hidden_act, self.n_groups, self.conv_kernel = mamba_hidden_act, n_groups, conv_kernel
        self.time_step_min, self.use_conv_bias, self.use_bias = time_step_min, use_conv_bias, use_bias
        self.moe_intermediate_size = moe_intermediate_size
        self.moe_shared_expert_intermediate_size = moe_shared_expert_intermediate_size
        self.moe_latent_size, self.routed_scaling_factor = moe_latent_size, routed_scaling_factor
        self.n_group, self.topk_group, self.norm_topk_prob = n_group, topk_group, norm_topk_prob
        self.aux_loss_alpha, self.mlp_bias = aux_loss_alpha, mlp_bias
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=len(self.layers_block_type), num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, head_dim=head_dim, hidden_act=hidden_act,
                         max_position_embeddings=max_position_embeddings, rms_norm_eps=rms_norm_eps,
                         num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                         tie_word_embeddings=tie_word_embeddings, pad_token_id=pad_token_id,
                         bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)

    def rope(self, index: int) -> None:
        return None  # its attention has no positions: the Mamba-2 layers order the tokens

    def mixer(self, index: int) -> Mamba2:
        return Mamba2(self.hidden_size, self.mamba_num_heads, self.mamba_head_dim, self.n_groups, self.ssm_state_size,
                      self.conv_kernel, self.rms_norm_eps, (self.time_step_min, math.inf), self.use_conv_bias,
                      self.use_bias)

    def routing(self):
        return v3_routing(self, self.aux_loss_alpha)

    def feed_forward(self, index: int) -> tuple[str, PlainMLP | MoE]:
        if self.layers_block_type[index] == MLP:
            return MIXER, PlainMLP(self.hidden_size, self.intermediate_size, self.hidden_act, self.mlp_bias)
        width = self.moe_latent_size or self.hidden_size
        expert = PlainMLP(width, self.moe_intermediate_size, self.hidden_act, self.mlp_bias,
                          unit="moe_intermediate_size")
        shared = PlainMLP(self.hidden_size, self.moe_shared_expert_intermediate_size, self.hidden_act, self.mlp_bias,
                          unit="moe_shared_expert_intermediate_size")
        return MIXER, MoE(index, self.hidden_size, Experts(self.num_experts, expert), self.routing(), shared,
                          shared_gate=False, names=("gate", "shared_experts"), latent=self.moe_latent_size)

    def decoder_layer(self, index: int) -> Decoder:
        kind, norm = self.layers_block_type[index], self.hidden_norm()
        if kind in (MLP, EXPERTS):
            return Decoder(index, None, self.feed_forward(index)[1], norm, feed_forward_name=MIXER,
                           norms=BEFORE_FEED_FORWARD)
        mixer = self.mixer(index) if kind == LINEAR else self.attention(index)
        return Decoder(index, mixer, None, norm, attention_name=MIXER, norms=BEFORE_MIXER)

    def validate(self) -> None:
        check_layer_kinds("layers_block_type (or hybrid_override_pattern: M, *, -, E)", self.layers_block_type, KINDS,
                          self.num_hidden_layers)
        if self.mamba_hidden_act != "silu":
            raise ModelConfigError(f"mamba_hidden_act={self.mamba_hidden_act!r} is not modelled (Mamba-2's conv "
                                   "activation is silu)")
        if self.mamba_num_heads % self.n_groups:
            raise ModelConfigError(f"mamba_num_heads={self.mamba_num_heads} is not divisible by n_groups={self.n_groups}")
        check_v3_groups(self)
        super().validate()


def stored_names(stored: Stored, config: NemotronHConfig) -> Stored:
    """Its folders' names: the body under `backbone.` (`_BODY`), a Mamba-2 layer's projections and
    convs as slices of the fused `in_proj` and `conv1d` (`fused_mamba2`; every Mamba-2 layer is alike)."""
    name = stored.name
    for ours, theirs in _BODY.items():
        if name.startswith(ours):
            return replace(stored, name=theirs + name.removeprefix(ours))
    stored = replace(stored, name=name.replace("model.", "backbone.", 1))
    return fused_mamba2(stored, config.mixer(0), MIXER)


NEMOTRON_H = decoder_family(
    NemotronHConfig, "NemotronHForCausalLM", "nemotron_h", paddlenlp=False,
    renamed={"n_routed_experts": "num_experts", "layer_norm_epsilon": "rms_norm_eps", "mlp_hidden_act": "hidden_act"},
    aliases=_ALIASES, fixed={"sliding_window": None, "hidden_dropout": 0.0},
    accepted={**MOE_ACCEPTED, **dict.fromkeys(_READ_PAST, any_value)}, fuse=stored_names, unread=MTP_UNREAD)
NemotronHForCausalLM, NemotronHForCausalLMPipe = NEMOTRON_H.causal_lm, NEMOTRON_H.pipe
