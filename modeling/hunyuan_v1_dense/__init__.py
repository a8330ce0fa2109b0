"""Hunyuan dense (Tencent Hunyuan-0.5B..7B, `hunyuan_v1_dense`): LLaMA's layers with per-head q/k
RMSNorms applied to the rotated q and k (`query_layernorm`, `key_layernorm`), and its releases'
"dynamic" rotary with a fixed `alpha`: NTK scaling that only stretches the base, theta x
alpha^(d / (d - 2)) over the head size d, the same at every length (transformers 5's `ntk_alpha`)."""

from __future__ import annotations

from modeling.config import DecoderConfig, ModelConfigError
from modeling.config_fields import any_value
from modeling.decoder_family import decoder_family


class HunYuanDenseV1Config(DecoderConfig):
    model_type = "hunyuan_v1_dense"
    qk_norm = "head"
    qk_norm_names = ("query_layernorm", "key_layernorm")
    qk_norm_after_rotary = True

    def __init__(self, vocab_size: int = 290943, rms_norm_eps: float = 1e-5, attention_bias: bool = False,
                 **kwargs):
        self.attention_bias = attention_bias
        super().__init__(vocab_size=vocab_size, rms_norm_eps=rms_norm_eps, **kwargs)

    def rope(self, index: int) -> tuple[float, dict | None]:
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) == "dynamic" and scaling.get("alpha"):
            extra = set(scaling) - {"rope_type", "type", "alpha", "factor", "beta_fast", "beta_slow", "mscale",
                                    "mscale_all_dim"}
            if extra:
                raise ModelConfigError(f"rope_scaling={scaling!r}: {', '.join(sorted(extra))} not modelled with "
                                       "Hunyuan's fixed alpha")
            dim = self.head_dim
            return self.rope_theta * scaling["alpha"] ** (dim / (dim - 2)), None
        return self.rope_theta, self.rope_scaling


HUNYUAN_V1_DENSE = decoder_family(HunYuanDenseV1Config, "HunYuanDenseV1ForCausalLM", "hunyuan", paddlenlp=False,
                                  accepted={"eod_token_id": any_value})
HunYuanDenseV1ForCausalLM, HunYuanDenseV1ForCausalLMPipe = HUNYUAN_V1_DENSE.causal_lm, HUNYUAN_V1_DENSE.pipe
