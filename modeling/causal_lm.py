"""The single-card (and tensor-parallel) causal LM every family builds from its declaration.

A family's `Skeleton` names where its pieces sit (PaddleNLP's names: "llama.embed_tokens",
"llama.layers", "llama.norm", "lm_head"; GPT's "gpt.embeddings.word_embeddings", ...). The model
creates those paths, so its `state_dict()` speaks the family's single-card names, and runs them in
order: embeddings, decoder layers, final norm, head (the token embedding itself when tied). Under a
run's tensor parallelism (`Execution.tp > 1`) the parts are fleet's parallel layers; the code is the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import paddle
from paddle import nn
from paddlenlp.transformers.model_utils import PretrainedModel

from modeling.blocks.embedding import LMHead, embed, head_logits
from modeling.blocks.parts import Embedding, Part, VocabEmbedding
from modeling.documents import state, unpack
from modeling.execution import Execution
from modeling.lora import LoRA, attach_adapters
from modeling.loss import CausalLMCriterion
from modeling.placement import FIRST, FIRST_AND_LAST, LAST, TensorPlan, tensor_parallel_mappings


@dataclass(frozen=True)
class Skeleton:
    """Where a causal LM's pieces sit, as single-card names; its decoder layers are what the
    config declares (`decoder_layer(index)`), and its multi-token prediction layers after them
    (`config.prediction_layers()`, numbered on from the last decoder layer as released folders do)."""

    tokens: str  # the token embedding (also the head when the config ties them)
    layers: str  # decoder layer i is f"{layers}.{i}"
    norm: str  # the final norm
    head: str = "lm_head"  # the untied head
    positions: str | None = None  # learned position embeddings

    def parts(self, config) -> list[tuple[str, Part, int | str]]:
        """(path, part, pipeline place) of every piece, in model order."""
        tied = config.tie_word_embeddings
        parts = [(self.tokens, VocabEmbedding(config.vocab_size, config.hidden_size), FIRST_AND_LAST if tied else FIRST)]
        if self.positions:
            parts.append((self.positions, Embedding(config.max_position_embeddings, config.hidden_size), FIRST))
        per_layer = config.per_layer_embeddings()
        parts += [(f"{self.base_prefix}.{name}", part, FIRST) for name, part in (per_layer.parts().items()
                                                                                  if per_layer else ())]
        parts += [(f"{self.layers}.{i}", config.decoder_layer(i), i) for i in range(config.num_hidden_layers)]
        parts.append((self.norm, config.hidden_norm(), LAST))
        parts += [(f"{self.layers}.{index}", layer, LAST) for index, layer in config.prediction_layers()]
        if not tied:
            parts.append((self.head, LMHead(config.hidden_size, config.vocab_size), LAST))
        return parts

    def tensors(self, config) -> dict[str, TensorPlan]:
        """Every parameter's placement, by single-card name, in model order."""
        return {f"{path}.{key}": row.placed(stage=place)
                for path, part, place in self.parts(config) for key, row in part.tensors().items()}

    def tied_names(self, config) -> tuple[tuple[str, ...], ...]:
        """Names that denote one tensor, the stored one first: a tied head is the token embedding
        (PaddleNLP's and transformers' tied models also name it lm_head.weight)."""
        return ((f"{self.tokens}.weight", f"{self.head}.weight"),) if config.tie_word_embeddings else ()

    @property
    def base_prefix(self) -> str:
        return self.tokens.split(".")[0]


def find(root: nn.Layer, path: str) -> nn.Layer:
    for name in path.split("."):
        root = getattr(root, name)
    return root


def attach(root: nn.Layer, path: str, layer: nn.Layer) -> None:
    """Put `layer` at `path` under `root`, creating plain containers for the names on the way."""
    names = path.split(".")
    for parent, child in zip(names, names[1:]):
        if parent not in root._sub_layers:  # decoder layers sit in a list, as in PaddleNLP's models
            root.add_sublayer(parent, nn.LayerList() if child.isdigit() else nn.Layer())
        root = root._sub_layers[parent]
    root.add_sublayer(names[-1], layer)


class CausalLMPretrainedModel(PretrainedModel):
    """PaddleNLP's hooks, answered from the family's declaration."""

    family: ClassVar  # the `ModelFamily` this class was generated for

    @classmethod
    def _get_tensor_parallel_mappings(cls, config, is_split: bool = True) -> dict:
        return tensor_parallel_mappings(cls.family.tensor_plan(config).tp_axes(config.tensor_parallel_degree), is_split,
                                        config.tensor_parallel_degree, config.tensor_parallel_rank)

    def _init_weights(self, layer):
        """Matrices (linears, embeddings, heads) from N(0, initializer_range); vectors keep the
        values their layers start with (norm scales one, or zero for `1 + weight` norms; biases zero)."""
        weight = getattr(layer, "weight", None)
        if isinstance(weight, paddle.Tensor) and len(weight.shape) >= 2:
            weight.set_value(paddle.normal(0.0, self.config.initializer_range, weight.shape).astype(weight.dtype))


class CausalLM(CausalLMPretrainedModel):
    """Single card, or TP with fleet's parallel layers under a run's `Execution` with tp > 1."""

    def __init__(self, config, run: Execution | None = None):
        super().__init__(config)
        self.run = run = run or Execution()
        self.family.check_tensor_parallel(config, run.tp)
        for path, part, _ in self.family.skeleton.parts(config):
            attach(self, path, part.build(config, run))
        lora = LoRA.of(config)
        if lora is not None:
            attach_adapters(self, lora, run, self.family.tensor_plan(config))
        self.criterion = CausalLMCriterion(run, config.mtp_loss_weight)
        self.apply(self._init_weights)

    def forward(self, input_ids, labels=None):
        """The logits; in training with multi-token prediction a tuple (the next token's, then each
        depth's), what the criterion takes, as the pipeline's head gives them. With `labels`: (the
        loss, the next token's logits)."""
        skeleton, config, run = self.family.skeleton, self.config, self.run
        tokens = find(self, skeleton.tokens)
        per_layer = config.per_layer_embeddings()
        layer_inputs = {name: find(self, f"{skeleton.base_prefix}.{name}") for name in per_layer.parts()} \
            if per_layer else None
        layer_state = embed(config, run, tokens, find(self, skeleton.positions) if skeleton.positions else None,
                            input_ids, layer_inputs)
        layers = find(self, skeleton.layers)
        for index in range(config.num_hidden_layers):
            layer_state = layers[index](layer_state)
        hidden, positions, carried = unpack(layer_state)
        layer_state = state(find(self, skeleton.norm)(hidden), positions, carried)
        for depth in range(config.mtp_depth):
            layer_state = layers[config.num_hidden_layers + depth](layer_state)
        if config.tie_word_embeddings:
            out = head_logits(config, run, layer_state, tokens.weight, True, self.training)
        else:  # called, not read: stage3 gathers a layer's weights in its forward hook
            out = find(self, skeleton.head)(layer_state)
        if labels is None:
            return out
        return self.criterion(out, labels), out[0] if isinstance(out, tuple) else out

