"""GPT-2 style: learned positions, pre-LayerNorm blocks with biases everywhere, tanh-GeLU MLP, output
head tied to the word embedding. Names are PaddleNLP's GPTForCausalLM's (without fused qkv);
transformers' GPT-2 (`gpt2`, Conv1D weights stored [in, out], q/k/v fused in `c_attn`) maps in and out."""

from __future__ import annotations

from dataclasses import dataclass

import paddle.nn.functional as F

from modeling.blocks.attention import Attention
from modeling.blocks.decoder import LayerActivations, layer_activations, prefixed
from modeling.blocks.norms import layer_norm_saved_bytes
from modeling.blocks.parts import Block, ColumnLinear, Declared, Norm, Part, RowLinear
from modeling.causal_lm import Skeleton
from modeling.config import CausalLMConfig, ModelConfigError
from modeling.config_fields import any_value, zero
from modeling.documents import handed_across, unpack, with_hidden
from modeling.execution import Execution
from modeling.family import ModelFamily
from modeling.paddlenlp_fused import QKV
from modeling.placement import TensorPlan
from modeling.sequence_parallel import gather_tokens, sequence_shards
from modeling.transformers_adapter import Stored, TransformersAdapter


class GPTConfig(CausalLMConfig):
    """Dropout is not modelled: LLM pretraining runs without it and parity needs none."""

    model_type = "gpt"
    attention_output = "out_proj"
    has_dropout = True

    def __init__(self, vocab_size: int = 50304, hidden_size: int = 768, num_hidden_layers: int = 12,
                 num_attention_heads: int = 12, intermediate_size: int | None = None,
                 max_position_embeddings: int = 1024, initializer_range: float = 0.02, layer_norm_eps: float = 1e-5,
                 tie_word_embeddings: bool = True, pad_token_id: int | None = 0, bos_token_id: int | None = 0,
                 eos_token_id: int | None = 7, **kwargs):
        if not tie_word_embeddings:
            raise ModelConfigError("GPT here always ties the output head to the word embedding; set "
                                   "tie_word_embeddings=true, or use LLaMA for an untied head")
        self.layer_norm_eps = layer_norm_eps
        super().__init__(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size or 4 * hidden_size,
            num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
            max_position_embeddings=max_position_embeddings, initializer_range=initializer_range,
            pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def num_key_value_heads(self) -> int:
        return self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def hidden_norm(self) -> Norm:
        return Norm(self.hidden_size, self.layer_norm_eps, layer_norm=True)

    def decoder_layer(self, index: int) -> GPTDecoder:
        attention = Attention(self.hidden_size, self.num_attention_heads, self.num_attention_heads, self.head_dim,
                              qkv_bias=True, o_bias=True, output=self.attention_output)
        return GPTDecoder(index, attention, self.hidden_size, self.intermediate_size, self.hidden_norm())

    def validate(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ModelConfigError(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                                   f"{self.num_attention_heads}; pick a head count that divides it")


@dataclass(frozen=True)
class GPTDecoder(Declared):
    """Decoder layer `index`: x + attn(norm1(x)), then x + linear2(gelu(linear1(norm2(x))))."""

    index: int
    attention: Attention
    hidden: int
    width: int
    norm: Norm
    attention_name = "self_attn"

    def parts(self) -> dict[str, Part]:
        return {self.attention_name: self.attention, "linear1": ColumnLinear(self.hidden, self.width, bias=True),
                "linear2": RowLinear(self.width, self.hidden, bias=True), "norm1": self.norm, "norm2": self.norm}

    def own_tp_units(self) -> dict[str, int]:
        return {"intermediate_size": self.width}

    def saved_bytes(self, run: Execution, batch: int, seq_len: int, dtype_bytes: int) -> dict[str, int]:
        """As `Decoder.saved_bytes`; the MLP's glue ("") keeps the GeLU's input."""
        tokens = batch * seq_len
        norm = layer_norm_saved_bytes(tokens // sequence_shards(run.tp, run.sequence_parallel), self.hidden,
                                      dtype_bytes)
        width = self.width // run.tp * dtype_bytes
        return {"norm1": norm, "norm2": norm,
                **prefixed("self_attn", self.attention.saved_bytes(run, batch, seq_len, dtype_bytes)),
                "linear1": tokens * self.hidden * dtype_bytes, "": tokens * width, "linear2": tokens * width}

    def activations(self, run: Execution, batch: int, seq_len: int, dtype_bytes: int) -> LayerActivations:
        return layer_activations(self, run, batch, seq_len, dtype_bytes)


class GPTDecoderLayer(Block):
    ends_stage = False  # as `DecoderLayer.ends_stage`

    def _block(self, hidden, positions=None):
        attended = self.run.recompute("full_attn", lambda normed: self.self_attn(normed, positions), self.norm1(hidden),
                                      training=self.training)
        hidden = hidden + attended
        mlp_input = gather_tokens(self.norm2(hidden), self.run)
        return hidden + self.linear2(F.gelu(self.linear1(mlp_input), approximate=True))

    def forward(self, layer_state):
        """As `DecoderLayer.forward`: the hidden states, with the document positions when per document."""
        hidden, positions, _ = unpack(layer_state)
        hidden = self.run.recompute("full", lambda x: self._block(x, positions), hidden, training=self.training)
        out = with_hidden(layer_state, hidden)
        return handed_across(out) if self.ends_stage else out


GPTDecoder.layer = GPTDecoderLayer


_GPT2_LAYER = {"self_attn.out_proj": "attn.c_proj", "linear1": "mlp.c_fc", "linear2": "mlp.c_proj", "norm1": "ln_1",
               "norm2": "ln_2"}
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def _gpt2_stored(name: str, row: TensorPlan) -> Stored:
    """transformers' GPT-2 names; its Conv1D weights are [in, out] like Paddle's, and q, k and v
    are the thirds of one c_attn (weight columns, bias entries)."""
    if name.startswith("gpt.embeddings."):
        return Stored({"word_embeddings": "transformer.wte", "position_embeddings": "transformer.wpe"}[
            name.split(".")[2]] + ".weight")
    if name.startswith("gpt.decoder.norm."):
        return Stored("transformer.ln_f." + name.rsplit(".", 1)[1])
    layer, rest = name.removeprefix("gpt.decoder.layers.").split(".", 1)
    module, param = rest.rsplit(".", 1)
    if module in _QKV:
        return Stored(f"transformer.h.{layer}.attn.c_attn.{param}", axis=len(row.shape) - 1,
                      part=_QKV.index(module), parts=3)
    return Stored(f"transformer.h.{layer}.{_GPT2_LAYER[module]}.{param}")


GPT = ModelFamily(
    GPTConfig, "GPTForCausalLM",
    Skeleton(tokens="gpt.embeddings.word_embeddings", positions="gpt.embeddings.position_embeddings",
             layers="gpt.decoder.layers", norm="gpt.decoder.norm"),
    TransformersAdapter(
        model_type="gpt2", architecture="GPT2LMHeadModel", locate=_gpt2_stored,
        renamed={"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
                 "n_positions": "max_position_embeddings", "n_inner": "intermediate_size",
                 "layer_norm_epsilon": "layer_norm_eps"},
        fixed={"activation_function": "gelu_new", "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
               "reorder_and_upcast_attn": False, "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0},
        accepted={"n_ctx": any_value, "summary_type": any_value, "summary_use_proj": any_value,
                  "summary_activation": any_value, "summary_proj_to_labels": any_value,
                  "summary_first_dropout": any_value, "hidden_dropout_prob": zero,
                  "attention_probs_dropout_prob": zero,
                  # PaddleNLP's GPT config.json: its "gelu" is the tanh form (it calls F.gelu(approximate=True)),
                  # pre-norm blocks, unscaled q.k; the rest are generation, loss, kernel and legacy settings
                  "hidden_activation": lambda value, _: value in ("gelu", "gelu_new"),
                  "normalize_before": lambda value, _: bool(value), "scale_qk_coeff": lambda value, _: value == 1.0,
                  "fused_softmax_with_triangular": any_value, "num_partitions": any_value,
                  "type_vocab_size": any_value, "eol_token_id": any_value, "ignore_index": any_value,
                  "use_dualpipev": any_value},
        buffers=("attn.bias", "attn.masked_bias")),
    paddlenlp=True, paddlenlp_fused=frozenset({QKV}))
GPTForCausalLM, GPTForCausalLMPipe = GPT.causal_lm, GPT.pipe
