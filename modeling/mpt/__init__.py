"""MPT (MosaicML's MPT-7B/30B, the second model of the Panda pipeline-parallel example this project
grew from): ALiBi position biases instead of rotary (each head's slope x the key's distance; the
slopes of `attention_core.spec.alibi_slopes`, bias maximum 8), q, k and v fused in one `Wqkv` (thirds),
LayerNorms without biases, an exact-GeLU MLP four times as wide as the model, no biases anywhere,
optional clipping of q, k and v (`attn_config.clip_qkv`) and a softmax scale of its own
(`attn_config.softmax_scale`), tied embeddings by default.

What transformers' MPT does not compute is refused unless at the value it assumes: `expansion_ratio`
4, `no_bias`, `embedding_fraction` 1, no `logit_scale`, and in `attn_config` multi-head attention
with ALiBi of maximum 8, no q/k LayerNorm, no prefix LM, no sequence ids, no dropout.
"""

from __future__ import annotations

from modeling.attention_core.spec import CoreSpec, alibi_slopes
from modeling.blocks.attention import Attention
from modeling.blocks.mlp import PlainMLP
from modeling.blocks.parts import Norm, Part
from modeling.causal_lm import Skeleton
from modeling.config import DecoderConfig, ModelConfigError
from modeling.config_fields import any_value
from modeling.family import ModelFamily
from modeling.placement import TensorPlan
from modeling.transformers_adapter import Stored, TransformersAdapter

# attn_config keys and the only value transformers' MPT computes (the others are modelled or harmless)
ATTENTION_FIXED = {"attn_type": "multihead_attention", "attn_pdrop": 0, "prefix_lm": False, "qk_ln": False,
                   "attn_uses_sequence_id": False, "alibi": True, "alibi_bias_max": 8}
ATTENTION_MODELLED = ("clip_qkv", "softmax_scale")
ATTENTION_HARMLESS = ("attn_impl", "architectures", "output_hidden_states", "return_dict", "dtype", "torch_dtype",
                      "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
                      "_name_or_path", "model_type", "output_attentions", "transformers_version")


class MptConfig(DecoderConfig):
    model_type = "mpt"
    attention_output = "out_proj"

    def __init__(self, vocab_size: int = 50368, hidden_size: int = 2048, num_hidden_layers: int = 24,
                 num_attention_heads: int = 16, max_position_embeddings: int = 2048, layer_norm_epsilon: float = 1e-5,
                 attn_config: dict | None = None, tie_word_embeddings: bool = True, pad_token_id: int | None = None,
                 bos_token_id: int | None = None, eos_token_id: int | None = None, intermediate_size: int | None = None,
                 hidden_act: str = "gelu", **kwargs):
        self.layer_norm_epsilon = layer_norm_epsilon
        self.attn_config = dict(attn_config or {})
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         hidden_act=hidden_act, max_position_embeddings=max_position_embeddings,
                         tie_word_embeddings=tie_word_embeddings, pad_token_id=pad_token_id,
                         bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)

    def hidden_norm(self) -> Norm:
        return Norm(self.hidden_size, self.layer_norm_epsilon, layer_norm=True, bias=False)

    def attention(self, index: int) -> Attention:
        return Attention(self.hidden_size, self.num_attention_heads, self.num_attention_heads, self.head_dim,
                         output=self.attention_output, clip_qkv=self.attn_config.get("clip_qkv"),
                         spec=CoreSpec(self.attn_config.get("softmax_scale"),
                                       alibi=alibi_slopes(self.num_attention_heads, 8.0)))

    def feed_forward(self, index: int) -> tuple[str, Part]:
        return "mlp", PlainMLP(self.hidden_size, self.intermediate_size, "gelu", bias=False)

    def validate(self) -> None:
        super().validate()
        if self.hidden_act != "gelu":
            raise ModelConfigError(f"hidden_act={self.hidden_act!r}: MPT's MLP is exact GeLU")
        for key, value in self.attn_config.items():
            if key in ATTENTION_FIXED and value != ATTENTION_FIXED[key]:
                raise ModelConfigError(f"attn_config.{key}={value!r}: only {ATTENTION_FIXED[key]!r} is modelled "
                                       "(transformers' MPT computes no other)")
            if key not in ATTENTION_FIXED and key not in ATTENTION_MODELLED and key not in ATTENTION_HARMLESS:
                raise ModelConfigError(f"attn_config.{key}={value!r}: a field paddle-pp does not know (it may change "
                                       "the model)")


_BLOCK = {"self_attn.out_proj": "attn.out_proj", "mlp.up_proj": "ffn.up_proj", "mlp.down_proj": "ffn.down_proj",
          "input_layernorm": "norm_1", "post_attention_layernorm": "norm_2"}
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def _mpt_stored(name: str, row: TensorPlan) -> Stored:
    """transformers' MPT names ("transformer.blocks.i.attn.Wqkv": q, k and v as thirds of its rows),
    linear weights stored [out, in]."""
    if name == "lm_head.weight":
        return Stored(name, transposed=True)
    if name.startswith("mpt.embed_tokens."):
        return Stored("transformer.wte.weight")
    if name.startswith("mpt.norm."):
        return Stored("transformer.norm_f.weight")
    layer, rest = name.removeprefix("mpt.layers.").split(".", 1)
    module, param = rest.rsplit(".", 1)
    if module in _QKV:
        return Stored(f"transformer.blocks.{layer}.attn.Wqkv.{param}", transposed=True, axis=0,
                      part=_QKV.index(module), parts=3)
    return Stored(f"transformer.blocks.{layer}.{_BLOCK[module]}.{param}", transposed=row.linear)


def _four(value, _values) -> bool:
    return value == 4


MPT = ModelFamily(
    MptConfig, "MptForCausalLM",
    Skeleton(tokens="mpt.embed_tokens", layers="mpt.layers", norm="mpt.norm"),
    TransformersAdapter(
        model_type="mpt", architecture="MptForCausalLM", locate=_mpt_stored,
        renamed={"d_model": "hidden_size", "n_heads": "num_attention_heads", "n_layers": "num_hidden_layers",
                 "max_seq_len": "max_position_embeddings"},
        fixed={"resid_pdrop": 0.0, "emb_pdrop": 0.0, "no_bias": True, "embedding_fraction": 1.0,
               "logit_scale": None},
        accepted={"expansion_ratio": _four, "learned_pos_emb": any_value, "init_device": any_value,
                  "norm_type": lambda value, _: "layernorm" in str(value), "verbose": any_value}),
    paddlenlp=False)
MptForCausalLM, MptForCausalLMPipe = MPT.causal_lm, MPT.pipe
