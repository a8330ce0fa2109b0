"""GPT cut into pipeline stages, with the tied embedding spanning the first and last stage.

The embedding (prefix "gpt.embeddings") and the head (prefix "gpt.embeddings.word_embeddings")
are two `SharedLayerDesc`s under one key: fleet builds each on its own stage, broadcasts the
first stage's weight at start and all-reduces the two gradients after every batch, so both copies
stay identical and both map to the single-card name `gpt.embeddings.word_embeddings.weight`.
"""

from __future__ import annotations

from paddle import nn
from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer, SharedLayerDesc
from paddlenlp.transformers.model_utils import PipelinePretrainedModel

from modeling.gpt import tp_plan
from modeling.gpt.config import GPTConfig
from modeling.gpt.modeling import GPTDecoderLayer, GPTEmbeddings, GPTPretrainedModel
from modeling.loss import CausalLMCriterion
from modeling.pipeline import bind_tensor_parallel, build_stages
from modeling.sequence_parallel import gather_sequence, mark_norm
from modeling.tp_layers import tp_degree, vocab_logits

TIED_KEY = "gpt_tied_embedding"


class GPTEmbeddingPipe(GPTEmbeddings):
    @property
    def embedding_weight(self):
        return self.word_embeddings.weight


class GPTLayerNormPipe(nn.LayerNorm):
    def __init__(self, config: GPTConfig):
        super().__init__(config.hidden_size, epsilon=config.layer_norm_eps)
        mark_norm(self, config)


class GPTLMHeadPipe(nn.Layer):
    """The last stage's copy of the word embedding [vocab/tp, hidden], used as the output head."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tp = tp_degree(config)
        self.weight = self.create_parameter(shape=[config.vocab_size // self.tp, config.hidden_size])
        if self.tp > 1:
            self.weight.is_distributed = True
            self.weight.split_axis = 0

    @property
    def embedding_weight(self):
        return self.weight

    def forward(self, hidden):
        return vocab_logits(gather_sequence(hidden, self.config), self.weight, self.tp, transpose_y=True)


class GPTForCausalLMPipe(PipelinePretrainedModel, PipelineLayer):
    config_class = GPTConfig
    base_model_prefix = "gpt"
    _get_tensor_parallel_mappings = GPTPretrainedModel._get_tensor_parallel_mappings
    _init_weights = GPTPretrainedModel._init_weights

    def __init__(self, config: GPTConfig):
        self.config = config
        bind_tensor_parallel(config)
        tp_plan.check_tensor_parallel(config, config.tensor_parallel_degree)

        self.add_sequential_layer(
            SharedLayerDesc(TIED_KEY, GPTEmbeddingPipe, shared_weight_attr="embedding_weight", config=config),
            "gpt.embeddings")
        for i in range(config.num_hidden_layers):
            self.add_sequential_layer(LayerDesc(GPTDecoderLayer, config=config), f"gpt.decoder.layers.{i}")
        self.add_sequential_layer(LayerDesc(GPTLayerNormPipe, config=config), "gpt.decoder.norm")
        self.add_sequential_layer(
            SharedLayerDesc(TIED_KEY, GPTLMHeadPipe, shared_weight_attr="embedding_weight", config=config),
            "gpt.embeddings.word_embeddings")
        build_stages(self, config, CausalLMCriterion(config), "GPTDecoderLayer")
