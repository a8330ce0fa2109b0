"""Granite 4.0-H (`granitemoehybrid`: granite-4.0-h-micro, -tiny, -small): Granite's layers and
multipliers (`granite`: embeddings, residual branches, softmax scale, logits) with Mamba-2 token mixers
(`linear_attention` in `layer_types`, as Bamba builds them: `blocks/mamba2.Mamba2`, dt clamped to the
config's `time_step_limit`) beside attention layers, rotary only when `position_embedding_type` is
"rope" (the released models are NoPE), and a feed-forward part of a gated shared MLP (`shared_mlp`)
plus, with `num_local_experts` > 0, GraniteMoE's experts (`block_sparse_moe`: the top-k router logits
softmaxed over the k, as GPT-OSS routes, experts as wide as `intermediate_size`).

On disk: the shared MLP's gate and up rows fused (`shared_mlp.input_linear`: gate | up, then
`output_linear`), the experts stacked (`block_sparse_moe.input_linear` [E, 2I, H], gate | up per
expert; `output_linear` [E, H, I]), the router under `block_sparse_moe.router.layer`, and a Mamba-2
layer's projections and convs fused as Nemotron-H's (`mamba.in_proj`, `mamba.conv1d`).
Legacy layer names (`mamba`, `attention`) are read as transformers 5 remaps them."""

from __future__ import annotations

from dataclasses import replace

from modeling.blocks.attention import Attention
from modeling.blocks.mamba2 import Mamba2, fused_mamba2
from modeling.blocks.mlp import GatedMLP
from modeling.blocks.moe import Experts, MoE
from modeling.blocks.router import SOFTMAX_OF_TOP_K, Routing
from modeling.config import FULL, ModelConfigError, check_layer_kinds, remapped_layer_types
from modeling.config_fields import MOE_ACCEPTED, any_value
from modeling.decoder_family import decoder_family
from modeling.granite import GraniteConfig
from modeling.moe_config import MoEConfig
from modeling.qwen3_5 import LINEAR
from modeling.transformers_adapter import Stored

ROPE = "rope"  # the position_embedding_type that rotates; any other (the released "nope", None) does not
_SHARED = ("gate_proj", "up_proj")  # a gated MLP's input projections, in the order its fused input_linear holds them
_READ_PAST = ("mamba_chunk_size",)


class GraniteMoeHybridConfig(MoEConfig, GraniteConfig):
    model_type = "granitemoehybrid"
    expert_width = "intermediate_size"
    derived_fields = ("mlp_bias",)  # transformers builds no MLP bias here and has no field for one

    def __init__(self, vocab_size: int = 100352, hidden_size: int = 4096, intermediate_size: int = 1024,
                 num_hidden_layers: int = 40, num_attention_heads: int = 32, num_key_value_heads: int | None = 8,
                 max_position_embeddings: int = 131072, rms_norm_eps: float = 1e-5, num_experts: int = 0,
                 num_experts_per_tok: int = 0, router_aux_loss_coef: float = 0.0, shared_intermediate_size: int = 8192,
                 position_embedding_type: str | None = None, layer_types: list[str] | None = None,
                 mamba_n_heads: int = 128, mamba_n_groups: int = 1, mamba_d_state: int = 256,
                 mamba_d_head: int | str = "auto", mamba_d_conv: int = 4, mamba_expand: int = 2,
                 mamba_conv_bias: bool = True, mamba_proj_bias: bool = False,
                 time_step_limit: list[float] | tuple[float, float] | None = (0.0, float("inf")),
                 pad_token_id: int | None = 100256, bos_token_id: int | None = 100257,
                 eos_token_id: int | None = 100257, **kwargs):
        self.shared_intermediate_size, self.position_embedding_type = shared_intermediate_size, position_embedding_type
        self.layer_types = remapped_layer_types(layer_types) or [LINEAR] * num_hidden_layers
        self.mamba_n_heads, self.mamba_n_groups, self.mamba_d_state = mamba_n_heads, mamba_n_groups, mamba_d_state
        self.mamba_expand, self.mamba_d_conv = mamba_expand, mamba_d_conv
        self.mamba_d_head = mamba_expand * hidden_size // mamba_n_heads if mamba_d_head == "auto" else mamba_d_head
        self.mamba_conv_bias, self.mamba_proj_bias = mamba_conv_bias, mamba_proj_bias
        self.time_step_limit = None if time_step_limit is None else list(time_step_limit)
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
                         rms_norm_eps=rms_norm_eps, num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                         router_aux_loss_coef=router_aux_loss_coef, pad_token_id=pad_token_id,
                         bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)

    def rope(self, index: int) -> tuple[float, dict | None] | None:
        return super().rope(index) if self.position_embedding_type == ROPE else None

    def mixer(self, index: int) -> Mamba2:
        limit = tuple(self.time_step_limit) if self.time_step_limit is not None else (0.0, float("inf"))
        return Mamba2(self.hidden_size, self.mamba_n_heads, self.mamba_d_head, self.mamba_n_groups, self.mamba_d_state,
                      self.mamba_d_conv, self.rms_norm_eps, limit, self.mamba_conv_bias, self.mamba_proj_bias)

    def routing(self) -> Routing:
        return Routing(self.num_experts_per_tok, SOFTMAX_OF_TOP_K, fp32=False, aux_coef=self.router_aux_loss_coef)

    def feed_forward(self, index: int) -> tuple[str, GatedMLP | MoE]:
        shared = GatedMLP(self.hidden_size, self.shared_intermediate_size, self.hidden_act,
                          unit="shared_intermediate_size")
        if not self.num_experts:
            return "shared_mlp", shared
        expert = GatedMLP(self.hidden_size, self.intermediate_size, self.hidden_act)
        return "block_sparse_moe", MoE(index, self.hidden_size, Experts(self.num_experts, expert), self.routing(),
                                       shared, shared_gate=False, names=("router", "shared_mlp"))

    def token_mixer(self, index: int) -> tuple[str, Mamba2 | Attention]:
        return ("mamba", self.mixer(index)) if self.layer_types[index] == LINEAR else super().token_mixer(index)

    def validate(self) -> None:
        check_layer_kinds("layer_types", self.layer_types, (LINEAR, FULL), self.num_hidden_layers)
        if self.mamba_n_heads % self.mamba_n_groups:
            raise ModelConfigError(f"mamba_n_heads={self.mamba_n_heads} is not divisible by "
                                   f"mamba_n_groups={self.mamba_n_groups}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                                   f"num_local_experts={self.num_experts}")
        GraniteConfig.validate(self)


def stored_names(stored: Stored, config: GraniteMoeHybridConfig) -> Stored:
    """Its folders' names: the shared MLP's fused input projection (under the layer, beside the experts'
    block), the experts stacked with gate and up fused, the router's `layer`, and the Mamba-2 layers'
    fused tensors (`fused_mamba2`)."""
    name = stored.name
    module, _, param = name.rpartition(".")
    prefix, _, part = module.rpartition(".")
    if ".block_sparse_moe.experts." in name:
        layer, rest = name.split(".block_sparse_moe.experts.")
        expert, projection, _ = rest.split(".")
        stack = (int(expert), config.num_experts)
        if projection == "down_proj":
            return replace(stored, name=f"{layer}.block_sparse_moe.output_linear.weight", stack=stack)
        return replace(stored, name=f"{layer}.block_sparse_moe.input_linear.weight", stack=stack, axis=0,
                       part=_SHARED.index(projection), parts=2)
    if part == "router":
        return replace(stored, name=f"{module}.layer.{param}")
    if ".shared_mlp." in name:
        layer = name.split(".shared_mlp.")[0].removesuffix(".block_sparse_moe")
        if part == "down_proj":
            return replace(stored, name=f"{layer}.shared_mlp.output_linear.{param}")
        return replace(stored, name=f"{layer}.shared_mlp.input_linear.{param}", axis=0, part=_SHARED.index(part),
                       parts=2)
    return fused_mamba2(stored, config.mixer(0), "mamba")  # every Mamba-2 layer is alike


GRANITEMOEHYBRID = decoder_family(
    GraniteMoeHybridConfig, "GraniteMoeHybridForCausalLM", "granitemoehybrid", paddlenlp=False,
    renamed={"num_local_experts": "num_experts"}, aliases={"layers_block_type": "layer_types"},
    accepted={**MOE_ACCEPTED, **dict.fromkeys(_READ_PAST, any_value)}, fuse=stored_names)
GraniteMoeHybridForCausalLM, GraniteMoeHybridForCausalLMPipe = GRANITEMOEHYBRID.causal_lm, GRANITEMOEHYBRID.pipe
