"""LLaMA for causal LM: one definition for one card and for tensor parallelism.

Parameter names and shapes equal `paddlenlp.transformers.LlamaForCausalLM`'s, so weights move
between the two with no renaming. With `config.tensor_parallel_degree > 1` the projections become
fleet's Column/Row parallel linears and the embedding a vocab-parallel one; the math is unchanged.
"""

from __future__ import annotations

import functools

import paddle
import paddle.nn.functional as F
from paddle import nn
from paddle.autograd import PyLayer

from modeling.attention import causal_attention
from modeling.base import CausalLMPretrainedModel
from modeling.llama import tp_plan
from modeling.llama.config import LlamaConfig
from modeling.loss import CausalLMCriterion
from modeling.tp_layers import column_linear, row_linear, tp_degree, vocab_embedding, vocab_logits
from modeling.recompute import maybe_recompute
from modeling.sequence_parallel import (  # under SP activations are sequence-first: [seq, batch, hidden]
    enabled as sequence_first, gather_sequence, gather_tokens, mark_norm, scatter_sequence,
)


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
        # square, not pow(2), and the big operand first in the broadcast product: 7x faster with
        # backward on CPU, and square is the exactly rounded one.
        variance = paddle.square(hidden.astype("float32")).mean(-1, keepdim=True)
        return (hidden * paddle.rsqrt(variance + self.eps)).astype(self.weight.dtype) * self.weight


@functools.lru_cache(maxsize=8)
def _rotary_cos_sin(head_dim: int, theta: float, seq_len: int, seq_first: bool) -> tuple[paddle.Tensor, paddle.Tensor]:
    inv_freq = 1.0 / (theta ** (paddle.arange(0, head_dim, 2).astype("float32") / head_dim))
    freqs = paddle.einsum("i,j->ij", paddle.arange(seq_len, dtype="float32"), inv_freq)
    emb = paddle.concat([freqs, freqs], axis=-1)
    shape = [seq_len, 1, 1, head_dim] if seq_first else [1, seq_len, 1, head_dim]
    return emb.cos().reshape(shape), emb.sin().reshape(shape)


def rotary_tables(config: LlamaConfig, seq_len: int, seq_first: bool = False) -> tuple[paddle.Tensor, paddle.Tensor]:
    """cos and sin tables [1, seq, 1, head_dim] (or [seq, 1, 1, head_dim] for sequence-first
    activations) in the half-rotation layout PaddleNLP and HF use, built once per length (they are constants)."""
    return _rotary_cos_sin(config.head_dim, float(config.rope_theta), seq_len, seq_first)


def rotate_half(x):
    # split's backward is a concat; slicing's builds zero-filled gradients (5x slower on CPU)
    first, second = paddle.split(x, 2, axis=-1)
    return paddle.concat([-second, first], axis=-1)


class _Rotary(PyLayer):
    """x * cos + rotate_half(x) * sin with a backward that keeps only the (constant) tables.
    Autograd keeps four activation-sized tensors per call (x, the expanded cos, rotate_half(x), the
    expanded sin: 8 of a tp2 layer's 45 MB in docs/benchmarks.md); the gradient needs none of them:
    dx = dy * cos + rotate_half^T(dy * sin), where rotate_half^T([g1, g2]) = [g2, -g1]."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        # expanded first: a product broadcasting over inner axes is 10x slower on CPU
        return x * cos.expand(x.shape) + rotate_half(x) * sin.expand(x.shape)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensor()
        first, second = paddle.split(dy * sin.expand(dy.shape), 2, axis=-1)
        return dy * cos.expand(dy.shape) + paddle.concat([second, -first], axis=-1), None, None


def apply_rotary(x, cos, sin):
    """Rotate [batch, seq, heads, head_dim] (or sequence first) by position; cos and sin are the
    broadcastable tables of `rotary_tables`."""
    return _Rotary.apply(x, cos, sin)


class LlamaAttention(nn.Layer):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        tp = tp_degree(config)
        self.head_dim = config.head_dim
        self.local_heads = config.num_attention_heads // tp
        self.local_kv_heads = config.num_key_value_heads // tp
        kv_width = config.num_key_value_heads * self.head_dim
        self.q_proj = column_linear(config, config.hidden_size, config.hidden_size)
        self.k_proj = column_linear(config, config.hidden_size, kv_width)
        self.v_proj = column_linear(config, config.hidden_size, kv_width)
        self.o_proj = row_linear(config, config.hidden_size, config.hidden_size)

    def forward(self, hidden):
        hidden = gather_tokens(hidden, self.config)
        seq_first = sequence_first(self.config)
        lead = hidden.shape[:2]  # [batch, seq], or [seq, batch] under sequence parallelism
        q = self.q_proj(hidden).reshape(lead + [self.local_heads, self.head_dim])
        k = self.k_proj(hidden).reshape(lead + [self.local_kv_heads, self.head_dim])
        v = self.v_proj(hidden).reshape(lead + [self.local_kv_heads, self.head_dim])
        cos, sin = rotary_tables(self.config, lead[0] if seq_first else lead[1], seq_first)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        groups = self.local_heads // self.local_kv_heads
        if groups > 1:
            k = k.unsqueeze(-2).tile([1, 1, 1, groups, 1]).reshape(lead + [self.local_heads, self.head_dim])
            v = v.unsqueeze(-2).tile([1, 1, 1, groups, 1]).reshape(lead + [self.local_heads, self.head_dim])
        return self.o_proj(causal_attention(q, k, v, seq_first))


class LlamaMLP(nn.Layer):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.gate_proj = column_linear(config, config.hidden_size, config.intermediate_size)
        self.up_proj = column_linear(config, config.hidden_size, config.intermediate_size)
        self.down_proj = row_linear(config, config.intermediate_size, config.hidden_size)

    def forward(self, x):
        x = gather_tokens(x, self.config)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Layer):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = mark_norm(LlamaRMSNorm(config), config)
        self.post_attention_layernorm = mark_norm(LlamaRMSNorm(config), config)

    def _block(self, hidden):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward(self, hidden):
        return maybe_recompute(self._block, hidden, self.config.recompute, self.training)


class LlamaLMHead(nn.Layer):
    """Output projection [hidden, vocab]; under TP each rank holds a vocab slice and returns local logits."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tp = tp_degree(config)
        self.weight = self.create_parameter(shape=[config.hidden_size, config.vocab_size // self.tp])
        if self.tp > 1:
            self.weight.is_distributed = True
            self.weight.split_axis = 1

    def forward(self, hidden):
        return vocab_logits(gather_sequence(hidden, self.config), self.weight, self.tp, transpose_y=False)


class LlamaPretrainedModel(CausalLMPretrainedModel):
    config_class = LlamaConfig
    base_model_prefix = "llama"
    tp_plan = tp_plan


class LlamaModel(LlamaPretrainedModel):
    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        tp_plan.check_tensor_parallel(config, tp_degree(config))
        self.embed_tokens = vocab_embedding(config)
        self.layers = nn.LayerList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = mark_norm(LlamaRMSNorm(config), config)

    def forward(self, input_ids):
        hidden = scatter_sequence(self.embed_tokens(input_ids), self.config)
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
        self.criterion = CausalLMCriterion(config)
        self.apply(self._init_weights)

    def forward(self, input_ids, labels=None):
        logits = self.lm_head(self.llama(input_ids))
        if labels is None:
            return logits
        return self.criterion(logits, labels), logits
