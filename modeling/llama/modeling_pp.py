"""LLaMA cut into pipeline stages: the single-card layers registered under their single-card prefixes.

Only hidden states flow between stages (rotary tables and the causal mask are rebuilt per layer),
so nothing but the activation crosses a stage boundary and `state_dict()` speaks single-card names
through `PipelinePretrainedModel`'s prefix mapping.
"""

from __future__ import annotations

from paddle import nn
from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer
from paddlenlp.transformers.model_utils import PipelinePretrainedModel

from modeling.llama import tp_plan
from modeling.llama.config import LlamaConfig
from modeling.llama.modeling import (
    LlamaDecoderLayer,
    LlamaLMHead,
    LlamaPretrainedModel,
    LlamaRMSNorm,
    reject_tied_embeddings,
)
from modeling.loss import CausalLMCriterion
from modeling.pipeline import bind_tensor_parallel, build_stages
from modeling.sequence_parallel import mark_norm, scatter_sequence
from modeling.tp_layers import vocab_embedding


class LlamaEmbeddingPipe(nn.Layer):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = vocab_embedding(config)

    def forward(self, input_ids):
        return scatter_sequence(self.embed_tokens(input_ids), self.config)


class LlamaRMSNormPipe(nn.Layer):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.norm = mark_norm(LlamaRMSNorm(config), config)

    def forward(self, hidden):
        return self.norm(hidden)


class LlamaForCausalLMPipe(PipelinePretrainedModel, PipelineLayer):
    config_class = LlamaConfig
    base_model_prefix = "llama"
    _get_tensor_parallel_mappings = LlamaPretrainedModel._get_tensor_parallel_mappings
    _init_weights = LlamaPretrainedModel._init_weights

    def __init__(self, config: LlamaConfig):
        self.config = config
        bind_tensor_parallel(config)
        reject_tied_embeddings(config)
        tp_plan.check_tensor_parallel(config, config.tensor_parallel_degree)

        self.add_sequential_layer(LayerDesc(LlamaEmbeddingPipe, config=config), "llama")
        for i in range(config.num_hidden_layers):
            self.add_sequential_layer(LayerDesc(LlamaDecoderLayer, config=config), f"llama.layers.{i}")
        self.add_sequential_layer(LayerDesc(LlamaRMSNormPipe, config=config), "llama")
        self.add_sequential_layer(LayerDesc(LlamaLMHead, config=config), "lm_head")
        build_stages(self, config, CausalLMCriterion(config), "LlamaDecoderLayer")
