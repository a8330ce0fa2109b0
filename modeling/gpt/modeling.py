"""GPT for causal LM: one definition for one card and for tensor parallelism.

Parameter names and shapes equal `paddlenlp.transformers.GPTForCausalLM`'s (without fused qkv).
The output head is the word embedding itself, so the state dict holds the tied weight once, under
`gpt.embeddings.word_embeddings.weight`; under TP both split by vocabulary rows together.
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn

from modeling.attention import causal_attention
from modeling.base import CausalLMPretrainedModel
from modeling.gpt import tp_plan
from modeling.gpt.config import GPTConfig
from modeling.loss import CausalLMCriterion
from modeling.recompute import maybe_recompute
from modeling.sequence_parallel import (  # under SP activations are sequence-first: [seq, batch, hidden]
    enabled as sequence_first, gather_sequence, gather_tokens, mark_norm, scatter_sequence,
)
from modeling.tp_layers import column_linear, row_linear, tp_degree, vocab_embedding, vocab_logits


class GPTAttention(nn.Layer):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.head_dim = config.head_dim
        self.local_heads = config.num_attention_heads // tp_degree(config)
        width = config.hidden_size
        self.q_proj = column_linear(config, width, width, bias=True)
        self.k_proj = column_linear(config, width, width, bias=True)
        self.v_proj = column_linear(config, width, width, bias=True)
        self.out_proj = row_linear(config, width, width, bias=True)

    def forward(self, hidden):
        hidden = gather_tokens(hidden, self.config)
        shape = hidden.shape[:2] + [self.local_heads, self.head_dim]  # [seq, batch, ...] under sequence parallelism
        q, k, v = (proj(hidden).reshape(shape) for proj in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(causal_attention(q, k, v, sequence_first(self.config)))


class GPTDecoderLayer(nn.Layer):
    """Pre-LayerNorm block: x + attn(norm1(x)), then x + linear2(gelu(linear1(norm2(x))))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.self_attn = GPTAttention(config)
        self.linear1 = column_linear(config, config.hidden_size, config.intermediate_size, bias=True)
        self.linear2 = row_linear(config, config.intermediate_size, config.hidden_size, bias=True)
        self.norm1 = mark_norm(nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps), config)
        self.norm2 = mark_norm(nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps), config)

    def _block(self, hidden):
        hidden = hidden + self.self_attn(self.norm1(hidden))
        mlp_input = gather_tokens(self.norm2(hidden), self.config)
        return hidden + self.linear2(F.gelu(self.linear1(mlp_input), approximate=True))

    def forward(self, hidden):
        return maybe_recompute(self._block, hidden, self.config.recompute, self.training)


class GPTEmbeddings(nn.Layer):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.word_embeddings = vocab_embedding(config)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)

    def forward(self, input_ids):
        positions = paddle.arange(input_ids.shape[-1], dtype="int64").unsqueeze(0)
        return scatter_sequence(self.word_embeddings(input_ids) + self.position_embeddings(positions), self.config)


class GPTDecoder(nn.Layer):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.layers = nn.LayerList([GPTDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = mark_norm(nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps), config)

    def forward(self, hidden):
        for layer in self.layers:
            hidden = layer(hidden)
        return self.norm(hidden)


class GPTPretrainedModel(CausalLMPretrainedModel):
    config_class = GPTConfig
    base_model_prefix = "gpt"
    tp_plan = tp_plan


class GPTModel(GPTPretrainedModel):
    def __init__(self, config: GPTConfig):
        super().__init__(config)
        tp_plan.check_tensor_parallel(config, tp_degree(config))
        self.embeddings = GPTEmbeddings(config)
        self.decoder = GPTDecoder(config)

    def forward(self, input_ids):
        return self.decoder(self.embeddings(input_ids))


class GPTForCausalLM(GPTPretrainedModel):
    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.gpt = GPTModel(config)
        self.criterion = CausalLMCriterion(config)
        self.apply(self._init_weights)

    def forward(self, input_ids, labels=None):
        hidden = gather_sequence(self.gpt(input_ids), self.config)
        logits = vocab_logits(hidden, self.gpt.embeddings.word_embeddings.weight, tp_degree(self.config),
                              transpose_y=True)
        if labels is None:
            return logits
        return self.criterion(logits, labels), logits
