"""LLaMA for causal LM: one definition for one card and for tensor parallelism.

Parameter names and shapes equal `paddlenlp.transformers.LlamaForCausalLM`'s, so weights move
between the two with no renaming. With `config.tensor_parallel_degree > 1` the projections become
fleet's Column/Row parallel linears and the embedding a vocab-parallel one; the math is unchanged.
"""

from __future__ import annotations

import math

import paddle
import paddle.nn.functional as F
from paddle import nn
from paddle.distributed import fleet
from paddle.distributed.fleet.layers.mpu import mp_layers
from paddle.distributed.fleet.utils import recompute
from paddlenlp.transformers.model_utils import PretrainedModel

from modeling.llama import tp_plan
from modeling.llama.config import LlamaConfig
from modeling.tp_utils import tensor_parallel_mappings

IGNORE_INDEX = -100


def _tp(config: LlamaConfig) -> int:
    return max(config.tensor_parallel_degree, 1)


def column_linear(config: LlamaConfig, in_features: int, out_features: int) -> nn.Layer:
    if _tp(config) > 1:
        return mp_layers.ColumnParallelLinear(in_features, out_features, has_bias=False, gather_output=False)
    return nn.Linear(in_features, out_features, bias_attr=False)


def row_linear(config: LlamaConfig, in_features: int, out_features: int) -> nn.Layer:
    if _tp(config) > 1:
        return mp_layers.RowParallelLinear(in_features, out_features, has_bias=False, input_is_parallel=True)
    return nn.Linear(in_features, out_features, bias_attr=False)


def vocab_embedding(config: LlamaConfig) -> nn.Layer:
    if _tp(config) > 1:
        return mp_layers.VocabParallelEmbedding(config.vocab_size, config.hidden_size)
    return nn.Embedding(config.vocab_size, config.hidden_size)


def reject_tied_embeddings(config: LlamaConfig) -> None:
    if config.tie_word_embeddings:
        raise NotImplementedError(
            "LLaMA with tie_word_embeddings=True is not supported yet; set it to false "
            "(GPT models tie their embeddings and are supported)."
        )


class LlamaRMSNorm(nn.Layer):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.weight = self.create_parameter(
            shape=[config.hidden_size], default_initializer=nn.initializer.Constant(1.0))
        self.eps = config.rms_norm_eps

    def forward(self, hidden):
        variance = hidden.astype("float32").pow(2).mean(-1, keepdim=True)
        return (paddle.rsqrt(variance + self.eps) * hidden).astype(self.weight.dtype) * self.weight


def rotary_tables(config: LlamaConfig, seq_len: int) -> tuple[paddle.Tensor, paddle.Tensor]:
    """cos and sin tables [1, seq, 1, head_dim] in the half-rotation layout PaddleNLP and HF use."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (paddle.arange(0, dim, 2).astype("float32") / dim))
    freqs = paddle.einsum("i,j->ij", paddle.arange(seq_len, dtype="float32"), inv_freq)
    emb = paddle.concat([freqs, freqs], axis=-1)
    return emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]


def rotate_half(x):
    half = x.shape[-1] // 2
    return paddle.concat([-x[..., half:], x[..., :half]], axis=-1)


def causal_mask(seq_len: int, dtype) -> paddle.Tensor:
    """Additive mask [1, 1, seq, seq]: 0 where a query may attend, the dtype's minimum elsewhere."""
    allowed = paddle.tril(paddle.ones([seq_len, seq_len], dtype="bool"))
    return paddle.where(allowed, paddle.zeros([], "float32"), paddle.full([], paddle.finfo(dtype).min, "float32")
                        ).astype(dtype)[None, None]


class LlamaAttention(nn.Layer):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        tp = _tp(config)
        self.head_dim = config.head_dim
        self.local_heads = config.num_attention_heads // tp
        self.local_kv_heads = config.num_key_value_heads // tp
        kv_width = config.num_key_value_heads * self.head_dim
        self.q_proj = column_linear(config, config.hidden_size, config.hidden_size)
        self.k_proj = column_linear(config, config.hidden_size, kv_width)
        self.v_proj = column_linear(config, config.hidden_size, kv_width)
        self.o_proj = row_linear(config, config.hidden_size, config.hidden_size)

    def forward(self, hidden):
        batch, seq = hidden.shape[0], hidden.shape[1]
        q = self.q_proj(hidden).reshape([batch, seq, self.local_heads, self.head_dim])
        k = self.k_proj(hidden).reshape([batch, seq, self.local_kv_heads, self.head_dim])
        v = self.v_proj(hidden).reshape([batch, seq, self.local_kv_heads, self.head_dim])
        cos, sin = rotary_tables(self.config, seq)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        groups = self.local_heads // self.local_kv_heads
        if groups > 1:
            k = k.unsqueeze(-2).tile([1, 1, 1, groups, 1]).reshape([batch, seq, self.local_heads, self.head_dim])
            v = v.unsqueeze(-2).tile([1, 1, 1, groups, 1]).reshape([batch, seq, self.local_heads, self.head_dim])
        q, k, v = (t.transpose([0, 2, 1, 3]) for t in (q, k, v))
        scores = paddle.matmul(q * (1 / math.sqrt(self.head_dim)), k.transpose([0, 1, 3, 2]))
        scores = scores + causal_mask(seq, scores.dtype)
        probs = F.softmax(scores.astype("float32"), axis=-1).astype(q.dtype)
        out = paddle.matmul(probs, v).transpose([0, 2, 1, 3])
        return self.o_proj(out.reshape([batch, seq, self.local_heads * self.head_dim]))


class LlamaMLP(nn.Layer):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = column_linear(config, config.hidden_size, config.intermediate_size)
        self.up_proj = column_linear(config, config.hidden_size, config.intermediate_size)
        self.down_proj = row_linear(config, config.intermediate_size, config.hidden_size)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Layer):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config)
        self.post_attention_layernorm = LlamaRMSNorm(config)

    def _block(self, hidden):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward(self, hidden):
        # Non-reentrant recompute, and only when the input carries a gradient (PaddleNLP#7235 hang).
        if self.config.recompute and self.training and not hidden.stop_gradient:
            return recompute(self._block, hidden, use_reentrant=False)
        return self._block(hidden)


class LlamaLMHead(nn.Layer):
    """Output projection [hidden, vocab]; under TP each rank holds a vocab slice and returns local logits."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.tp = _tp(config)
        self.weight = self.create_parameter(shape=[config.hidden_size, config.vocab_size // self.tp])
        if self.tp > 1:
            self.weight.is_distributed = True
            self.weight.split_axis = 1

    def forward(self, hidden):
        if self.tp > 1:
            hidden = paddle.distributed.collective._c_identity(
                hidden, group=fleet.get_hybrid_communicate_group().get_model_parallel_group())
        return paddle.matmul(hidden, self.weight)


class LlamaPretrainingCriterion(nn.Layer):
    """Mean next-token cross-entropy over labels that are not IGNORE_INDEX; vocab-parallel under TP."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.parallel = mp_layers.ParallelCrossEntropy(ignore_index=IGNORE_INDEX) if _tp(config) > 1 else None

    def forward(self, logits, labels):
        logits = logits.astype("float32")
        if self.parallel is not None:
            token_loss = self.parallel(logits, labels.unsqueeze(-1))
        else:
            token_loss = F.cross_entropy(logits, labels.unsqueeze(-1), reduction="none", ignore_index=IGNORE_INDEX)
        counted = (labels != IGNORE_INDEX).astype("float32").unsqueeze(-1)
        return (token_loss * counted).sum() / counted.sum().clip(min=1.0)


class LlamaPretrainedModel(PretrainedModel):
    config_class = LlamaConfig
    base_model_prefix = "llama"

    @classmethod
    def _get_tensor_parallel_mappings(cls, config: LlamaConfig, is_split: bool = True) -> dict:
        return tensor_parallel_mappings(
            tp_plan.split_axes(config), is_split, config.tensor_parallel_degree, config.tensor_parallel_rank)

    def _init_weights(self, layer):
        if isinstance(layer, (nn.Linear, nn.Embedding, mp_layers.ColumnParallelLinear,
                              mp_layers.RowParallelLinear, mp_layers.VocabParallelEmbedding, LlamaLMHead)):
            layer.weight.set_value(
                paddle.normal(0.0, self.config.initializer_range, layer.weight.shape).astype(layer.weight.dtype))


class LlamaModel(LlamaPretrainedModel):
    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        tp_plan.check_tensor_parallel(config, _tp(config))
        self.embed_tokens = vocab_embedding(config)
        self.layers = nn.LayerList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config)

    def forward(self, input_ids):
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.norm(hidden)


class LlamaForCausalLM(LlamaPretrainedModel):
    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        reject_tied_embeddings(config)
        self.llama = LlamaModel(config)
        self.lm_head = LlamaLMHead(config)
        self.criterion = LlamaPretrainingCriterion(config)
        self.apply(self._init_weights)

    def forward(self, input_ids, labels=None):
        logits = self.lm_head(self.llama(input_ids))
        if labels is None:
            return logits
        return self.criterion(logits, labels), logits
