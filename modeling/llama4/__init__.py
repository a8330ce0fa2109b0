"""Llama 4's text model (`llama4_text`: Scout 17B-16E, Maverick 17B-128E), as transformers 5 builds it.

- Attention per layer (`no_rope_layers`: 1 rotates; every `no_rope_layer_interval`-th layer does not):
  rotary layers rotate interleaved pairs (Llama 4's complex rotary; `llama3` scaling in the releases),
  normalise the rotated q and k heads by their root mean square with no weight (`use_qk_norm`), and
  attend within chunks of `attention_chunk_size` positions (`layer_types` "chunked_attention": a query
  sees the keys of its own chunk, `CoreSpec.chunk`); the other layers attend to every earlier key
  without positions and scale their queries by 1 + `attn_scale` x log(1 + floor((p + 1) / `floor_scale`))
  (`attn_temperature_tuning`).
- Feed-forward per layer (`moe_layers`, every `interleave_moe_layer_step`-th by default): a dense MLP
  `intermediate_size_mlp` wide, or experts `intermediate_size` wide beside an always-on shared expert
  as wide, routed top-`num_experts_per_tok` by their logits, each chosen expert's input scaled by the
  sigmoid of its logit (not its output); its balance by the Switch loss at `router_aux_loss_coef`
  (transformers computes none: training adds it, logged apart from the loss).
- On disk the experts are stacked: `feed_forward.experts.gate_up_proj` [E, hidden, 2 x I] (x @ W
  layout, gate then up) and `down_proj` [E, I, hidden].
"""

from __future__ import annotations

from modeling.attention_core.spec import CoreSpec
from modeling.blocks.attention import L2_NORM, Attention, QueryTemperature
from modeling.blocks.mlp import GatedMLP
from modeling.blocks.moe import Experts, MoE
from modeling.blocks.parts import Part
from modeling.blocks.router import SIGMOID_OF_TOP_K, Routing
from modeling.config import ModelConfigError, check_layer_kinds
from modeling.config_fields import MOE_ACCEPTED, zero
from modeling.decoder_family import decoder_family
from modeling.moe_config import MoEConfig
from modeling.transformers_adapter import Stored

CHUNKED, FULL_ATTENTION = "chunked_attention", "full_attention"
BLOCK = "feed_forward"


class Llama4TextConfig(MoEConfig):
    model_type = "llama4_text"
    moe_block = BLOCK
    interleaved_rotary = True
    experts_stacked = True

    def __init__(self, vocab_size: int = 202048, hidden_size: int = 5120, intermediate_size: int = 8192,
                 intermediate_size_mlp: int = 16384, num_hidden_layers: int = 48, num_attention_heads: int = 40,
                 num_key_value_heads: int | None = 8, head_dim: int | None = 128,
                 max_position_embeddings: int = 131072, rms_norm_eps: float = 1e-5, rope_theta: float = 500000.0,
                 num_experts: int = 16, num_experts_per_tok: int = 1, moe_layers: list[int] | None = None,
                 interleave_moe_layer_step: int = 1, use_qk_norm: bool = True, no_rope_layers: list[int] | None = None,
                 no_rope_layer_interval: int = 4, attention_chunk_size: int | None = 8192,
                 layer_types: list[str] | None = None, attn_temperature_tuning: bool = True, floor_scale: float = 8192,
                 attn_scale: float = 0.1, attention_bias: bool = False, pad_token_id: int | None = None,
                 bos_token_id: int | None = 1, eos_token_id: int | None = 2, **kwargs):
        self.intermediate_size_mlp, self.use_qk_norm = intermediate_size_mlp, use_qk_norm
        self.interleave_moe_layer_step = interleave_moe_layer_step
        self.moe_layers = list(moe_layers if moe_layers is not None else
                               range(interleave_moe_layer_step - 1, num_hidden_layers, interleave_moe_layer_step))
        self.no_rope_layer_interval = no_rope_layer_interval
        self.no_rope_layers = list(no_rope_layers or [int((i + 1) % no_rope_layer_interval != 0)
                                                      for i in range(num_hidden_layers)])
        self.layer_types = list(layer_types or [CHUNKED if rope else FULL_ATTENTION for rope in self.no_rope_layers])
        self.attention_chunk_size, self.attn_temperature_tuning = attention_chunk_size, attn_temperature_tuning
        self.floor_scale, self.attn_scale, self.attention_bias = floor_scale, attn_scale, attention_bias
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, head_dim=head_dim,
                         max_position_embeddings=max_position_embeddings, rms_norm_eps=rms_norm_eps,
                         rope_theta=rope_theta, num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                         pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)

    def rope(self, index: int) -> tuple[float, dict | None] | None:
        return super().rope(index) if self.no_rope_layers[index] else None

    def attention(self, index: int) -> Attention:
        """Rotary layers: L2 q/k norms after the rotary and chunks where `layer_types` says; the others:
        the temperature-tuned queries."""
        rotates = bool(self.no_rope_layers[index])
        chunk = self.attention_chunk_size if self.layer_types[index] == CHUNKED else None
        tuned = self.attn_temperature_tuning and not rotates
        return Attention(self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim,
                         qkv_bias=self.attention_bias, o_bias=self.attention_bias,
                         qk_norm=L2_NORM if self.use_qk_norm and rotates else None, norm=self.hidden_norm(),
                         spec=CoreSpec(chunk=chunk), rotary=self.rotary(index),
                         temperature=QueryTemperature(self.attn_scale, self.floor_scale, 1) if tuned else None)

    def routing(self) -> Routing:
        return Routing(self.num_experts_per_tok, SIGMOID_OF_TOP_K, on_input=True, aux_coef=self.router_aux_loss_coef)

    def feed_forward(self, index: int) -> tuple[str, Part]:
        if index not in self.moe_layers:
            return BLOCK, GatedMLP(self.hidden_size, self.intermediate_size_mlp, self.hidden_act,
                                   unit="intermediate_size_mlp")
        expert = GatedMLP(self.hidden_size, self.intermediate_size, self.hidden_act)
        shared = GatedMLP(self.hidden_size, self.intermediate_size, self.hidden_act)
        return BLOCK, MoE(index, self.hidden_size, Experts(self.num_experts, expert), self.routing(), shared,
                          shared_gate=False, names=("router", "shared_expert"))

    def validate(self) -> None:
        super().validate()
        check_layer_kinds("layer_types", self.layer_types, (CHUNKED, FULL_ATTENTION), self.num_hidden_layers)
        if len(self.no_rope_layers) != self.num_hidden_layers or set(self.no_rope_layers) - {0, 1}:
            raise ModelConfigError(f"no_rope_layers must hold {self.num_hidden_layers} entries of 0 or 1, "
                                   f"not {self.no_rope_layers}")
        if set(self.moe_layers) - set(range(self.num_hidden_layers)):
            raise ModelConfigError(f"moe_layers={self.moe_layers} names layers past the last of {self.num_hidden_layers}")
        if self.attention_chunk_size is None and CHUNKED in self.layer_types:
            raise ModelConfigError("layer_types has chunked_attention layers but attention_chunk_size is null")


def stacked_experts(stored: Stored, config: Llama4TextConfig) -> Stored:
    """Where Llama 4 stacks our per-expert tensors (`...feed_forward.experts.{e}.{gate,up,down}_proj.weight`)."""
    name = stored.name
    marker = f".{BLOCK}.experts."
    if marker not in name:
        return stored
    prefix, rest = name.split(marker)
    index, projection, _ = rest.split(".")
    stack = (int(index), config.num_experts)
    if projection == "down_proj":
        return Stored(f"{prefix}{marker}down_proj", stack=stack)
    return Stored(f"{prefix}{marker}gate_up_proj", axis=1, stack=stack, part=("gate_proj", "up_proj").index(projection),
                  parts=2)


LLAMA4_TEXT = decoder_family(Llama4TextConfig, "Llama4ForCausalLM", "llama4", paddlenlp=False, fuse=stacked_experts,
                             renamed={"num_local_experts": "num_experts"},
                             accepted={**MOE_ACCEPTED, "router_jitter_noise": zero})
Llama4ForCausalLM, Llama4ForCausalLMPipe = LLAMA4_TEXT.causal_lm, LLAMA4_TEXT.pipe
