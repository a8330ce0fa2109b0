"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): attention with biases, per-head sink logits (`self_attn.sinks`)
and a 128-key sliding window on every other layer (`layer_types`), yarn rotary by halves; every
layer a mixture of experts whose router has a bias and runs in the activations' dtype (the top-k
logits, softmax over them), whose experts carry biases on both projections and gate with GPT-OSS's
clamped SwiGLU (gate clamped above at `swiglu_limit`, up to +-limit, (up + 1) x gate x
sigmoid(`swiglu_alpha` x gate)). On disk the experts are stacked: `mlp.experts.gate_up_proj` [E, H, 2I]
(x @ W layout, gate and up interleaved column by column), `gate_up_proj_bias` [E, 2I], `down_proj`
[E, I, H], `down_proj_bias` [E, H]; each rank reads its experts' entries and its tp piece (whole
(gate, up) pairs) in place. The released folders store the experts in MXFP4 (`quantization_config`
quant_method mxfp4): they are dequantized as they are read (`paddle_pp/interop/quantized.py`), exactly,
and trained and saved unquantized (`config_fields.dequantized_on_read`).
"""

from __future__ import annotations

from dataclasses import replace

from modeling.blocks.mlp import GatedMLP
from modeling.blocks.moe import Experts, MoE
from modeling.blocks.parts import Part
from modeling.blocks.router import SOFTMAX_OF_TOP_K, Routing
from modeling.config import FULL, SLIDING
from modeling.config_fields import MOE_ACCEPTED, any_value
from modeling.decoder_family import decoder_family
from modeling.moe_config import MoEConfig
from modeling.transformers_adapter import Stored


class GptOssConfig(MoEConfig):
    model_type = "gpt_oss"
    expert_width = "intermediate_size"
    experts_stacked = True

    def __init__(self, vocab_size: int = 201088, hidden_size: int = 2880, intermediate_size: int = 2880,
                 num_hidden_layers: int = 36, num_attention_heads: int = 64, num_key_value_heads: int | None = 8,
                 head_dim: int | None = 64, num_experts: int = 128, num_experts_per_tok: int = 4,
                 sliding_window: int | None = 128, layer_types: list[str] | None = None, rope_theta: float = 150000.0,
                 max_position_embeddings: int = 131072, rms_norm_eps: float = 1e-5, attention_bias: bool = True,
                 swiglu_limit: float = 7.0, swiglu_alpha: float = 1.702, router_aux_loss_coef: float = 0.001,
                 pad_token_id: int | None = None, bos_token_id: int | None = None, eos_token_id: int | None = None,
                 **kwargs):
        self.sliding_window, self.layer_types, self.attention_bias = sliding_window, layer_types, attention_bias
        self.swiglu_limit, self.swiglu_alpha = swiglu_limit, swiglu_alpha
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, head_dim=head_dim, num_experts=num_experts,
                         num_experts_per_tok=num_experts_per_tok, rope_theta=rope_theta,
                         max_position_embeddings=max_position_embeddings, rms_norm_eps=rms_norm_eps,
                         router_aux_loss_coef=router_aux_loss_coef, pad_token_id=pad_token_id,
                         bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)

    def attention_types(self) -> list[str]:
        return list(self.layer_types or [SLIDING if (i + 1) % 2 else FULL for i in range(self.num_hidden_layers)])

    def attention(self, index: int):
        return replace(super().attention(index), sinks=True)

    def routing(self) -> Routing:
        return Routing(self.num_experts_per_tok, SOFTMAX_OF_TOP_K, linear_bias=True, fp32=False,
                       aux_coef=self.router_aux_loss_coef)

    def feed_forward(self, index: int) -> tuple[str, Part]:
        expert = GatedMLP(self.hidden_size, self.intermediate_size, self.hidden_act, bias=True,
                          limit=self.swiglu_limit, alpha=self.swiglu_alpha)
        return "mlp", MoE(index, self.hidden_size, Experts(self.num_experts, expert), self.routing(),
                          names=("router", "shared_expert"))


def stacked_experts(stored: Stored, config: GptOssConfig) -> Stored:
    """Where GPT-OSS stacks our per-expert tensors (`...mlp.experts.{e}.{gate,up,down}_proj.{weight,bias}`
    as the per-expert locator names them) and its router's."""
    name = stored.name
    if ".mlp.experts." not in name:
        return stored
    prefix, rest = name.split(".mlp.experts.")
    index, projection, param = rest.split(".")
    stack = (int(index), config.num_experts)
    suffix = "" if param == "weight" else "_bias"
    axis = 1 if param == "weight" else 0  # the 2I axis of an entry ([H, 2I], or [2I] for the bias)
    if projection == "down_proj":
        return Stored(f"{prefix}.mlp.experts.down_proj{suffix}", stack=stack)
    return Stored(f"{prefix}.mlp.experts.gate_up_proj{suffix}", axis=axis, stack=stack,
                  interleave=(2, ("gate_proj", "up_proj").index(projection), 1))


GPT_OSS = decoder_family(
    GptOssConfig, "GptOssForCausalLM", "gpt_oss", paddlenlp=False, fuse=stacked_experts,
    renamed={"num_local_experts": "num_experts"},
    accepted={**MOE_ACCEPTED, "experts_per_token": any_value, "initial_context_length": any_value})
GptOssForCausalLM, GptOssForCausalLMPipe = GPT_OSS.causal_lm, GPT_OSS.pipe
