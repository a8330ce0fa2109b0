"""Token (and learned position) embeddings in, vocabulary logits out: the untied head, and the
pipeline's copy of a tied embedding used as the head."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import paddle
from paddle import nn

from modeling.blocks.parts import Leaf
from modeling.context_parallel import ahead_in_sequence
from modeling.documents import document_positions, state, unpack
from modeling.execution import Execution
from modeling.placement import COLUMN, Placement, TensorPlan
from modeling.sequence_parallel import gather_sequence, scatter_sequence
from modeling.tp_layers import vocab_logits

_NUMPY_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def embed(config, run: Execution, tokens: nn.Layer, positions: nn.Layer | None, input_ids,
          layer_inputs: dict[str, nn.Layer] | None = None):
    """The first decoder layer's input (`modeling.documents.state`): token embeddings, times
    `config.embedding_scale` (Gemma's sqrt(hidden), Granite's multiplier; rounded to the compute
    dtype as transformers does) and plus learned positions when the model has them (of this rank's
    tokens under context parallelism; restarting per document under per-document attention);
    scattered along the sequence under sequence parallelism. Under per-document attention the
    document positions go beside the hidden states; with multi-token prediction, in training, the
    embeddings of the tokens 1..D further (`blocks/prediction.py`) are carried beside them; with
    per-layer embeddings (`config.per_layer_embeddings`, built as `layer_inputs`) each layer's input
    (`blocks/carried.py`). `input_ids` may come with the positions inside their samples, (ids,
    positions): packed fine-tuning rows, whose samples the data knows (`paddle_pp.data.sft`)."""
    input_ids, given = input_ids if isinstance(input_ids, (tuple, list)) else (input_ids, None)
    hidden = scaled(tokens(input_ids), config.embedding_scale)
    # sent between pipeline stages as they are (the scatter gives a view), where p2p takes contiguous tensors
    ahead = tuple(scatter_sequence(scaled(tokens(ahead_in_sequence(input_ids, depth, 0, run.ring)),
                                          config.embedding_scale), run)
                  .contiguous() for depth in range(1, config.mtp_depth + 1)) if tokens.training else ()
    in_documents = given if given is not None else \
        document_positions(input_ids, run.documents, run.ring) if run.documents is not None else None
    if positions is not None:
        held = run.positions(input_ids.shape[-1])  # the positions of this rank's tokens under context parallelism
        ids = paddle.arange(input_ids.shape[-1], dtype="int64") if held is None else paddle.to_tensor(held)
        hidden = hidden + positions(ids.unsqueeze(0) if in_documents is None else in_documents)
    hidden = scatter_sequence(hidden, run)
    per_layer = config.per_layer_embeddings()
    inputs = per_layer.inputs(run, layer_inputs, input_ids, hidden) if per_layer else ()
    return state(hidden, in_documents, ahead + inputs)


def scaled(embeddings: paddle.Tensor, multiplier: float | None) -> paddle.Tensor:
    """Embeddings times `multiplier` rounded to their dtype, as transformers' scaled embeddings do."""
    if not multiplier:
        return embeddings
    # a scale op keeps nothing for backward; a product with a tensor would keep the embeddings
    dtype = str(embeddings.dtype).removeprefix("paddle.")
    return paddle.scale(embeddings, float(np.asarray(multiplier, _NUMPY_DTYPES[dtype]).astype(np.float32)))


def logits(config, run: Execution, hidden: paddle.Tensor, weight: paddle.Tensor, tied: bool) -> paddle.Tensor:
    """Logits over this rank's vocabulary slice, from the head's [hidden, vocab] weight or a tied
    embedding's [vocab, hidden]; the sequence is gathered back first under sequence parallelism.
    Granite divides them by `logits_divisor`; Gemma 2 soft-caps them (cap x tanh(logits / cap)),
    elementwise, so each rank's slice alone."""
    out = vocab_logits(gather_sequence(hidden, run), weight, run, transpose_y=tied)
    if config.logits_divisor is not None:
        out = out / config.logits_divisor
    if config.final_logit_softcap is not None:
        out = paddle.tanh(out / config.final_logit_softcap) * config.final_logit_softcap
    return out


def head_logits(config, run: Execution, layer_state, weight: paddle.Tensor, tied: bool, training: bool):
    """The next token's logits from the final hidden states of `layer_state`; in training with
    multi-token prediction a tuple: then each depth's, from the outputs carried beside them, and the
    document positions when they restart (which predictions count, `loss.CausalLMCriterion`)."""
    hidden, positions, carried = unpack(layer_state)
    if not (training and carried):
        return logits(config, run, hidden, weight, tied)
    out = tuple(logits(config, run, each, weight, tied) for each in (hidden, *carried))
    return out if positions is None else (*out, positions)


class HeadLayer(nn.Layer):
    """The untied head [hidden, vocab]; under TP each rank holds a vocabulary slice."""

    def __init__(self, config, run: Execution, hidden_size: int, vocab_size: int):
        super().__init__()
        self.config, self.run = config, run
        self.weight = self.create_parameter(shape=[hidden_size, vocab_size // run.tp])
        if run.tp > 1:
            self.weight.is_distributed = True
            self.weight.split_axis = 1

    def forward(self, layer_state):
        return head_logits(self.config, self.run, layer_state, self.weight, False, self.training)


@dataclass(frozen=True)
class LMHead(Leaf):
    """The untied head's part: its weight is a column-parallel linear's."""

    hidden_size: int
    vocab_size: int

    def tensors(self) -> dict[str, TensorPlan]:
        return {"weight": TensorPlan((self.hidden_size, self.vocab_size), Placement(COLUMN), linear=True)}

    def build(self, config, run: Execution) -> nn.Layer:
        return HeadLayer(config, run, self.hidden_size, self.vocab_size)


class TiedHeadLayer(nn.Layer):
    """The last pipeline stage's copy of a tied embedding [vocab / tp, hidden], used as the head;
    fleet keeps it equal to the first stage's (`SharedLayerDesc`, `embedding_weight`)."""

    def __init__(self, config, run: Execution):
        super().__init__()
        self.config, self.run = config, run
        self.weight = self.create_parameter(shape=[config.vocab_size // run.tp, config.hidden_size])
        if run.tp > 1:
            self.weight.is_distributed = True
            self.weight.split_axis = 0

    @property
    def embedding_weight(self):
        return self.weight

    def forward(self, layer_state):
        return head_logits(self.config, self.run, layer_state, self.weight, True, self.training)
