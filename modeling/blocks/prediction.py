"""Multi-token prediction (DeepSeek-V3's paper, section 2.2; its released layer 61, GLM-4.5's last):
after the decoder, depth k = 1..D predicts token i + k + 1 at position i from the embedding of token
i + k and the previous depth's hidden states (the main model's after its final norm at depth 1, as
transformers 5.23's `MtpModel` and vLLM take them), each RMS-normed (`enorm`, `hnorm`), concatenated
in that order (the released weights' order; PaddleNLP 3.0.0b4 reverses it and gives `eh_proj` a
bias), projected back to the hidden size (`eh_proj`), through one decoder layer of the model's kind
(experts in DeepSeek-V3's and GLM-4.5's, as transformers builds it) and a final norm
(`shared_head.norm`); the model's own head gives its logits, and its own token embedding the
embeddings (the released folders store copies of both: `TransformersAdapter.copies`).

The next tokens' embeddings are looked up where the token embedding is (the first pipeline stage)
and travel beside the hidden states (`documents.state`, carried), as PaddleNLP's pipeline carries
them: the last stage needs no copy of the embedding, and the embeddings' gradient flows back with
the hidden states'. The last k positions of a sample have no token i + k + 1: their embedding is of
token 0 and their prediction is not counted (`loss.CausalLMCriterion`), Megatron's and transformers'
way, instead of lengthening every sample by D tokens as PaddleNLP's data does. Rotary positions are
the main model's (transformers gives the prediction layer positions one further: rotary attention
depends only on their differences). With positions restarting per document the prediction layers
attend as the decoder layers do, and a prediction counts only where its embedded token is in the
position's own document (token i + k after token i without a document start between): the target
may then be the next document's first token, as the next-token loss's at a document's end, and a
packed sample trains as its documents one at a time. The positions reach the loss beside the
logits (`embedding.head_logits`).

In evaluation the prediction layers are skipped: evaluation reports the next-token loss alone.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import paddle

from modeling.blocks.decoder import Decoder, DecoderLayer
from modeling.blocks.norms import rms_norm_saved_bytes
from modeling.blocks.parts import Block, Declared, Norm, Part, WholeLinear
from modeling.documents import state, unpack
from modeling.execution import Execution
from modeling.sequence_parallel import sequence_shards


@dataclass(frozen=True)
class SharedHead(Declared):
    """The prediction layer's final norm under the name the released weights give it
    (`shared_head.norm`; their `shared_head.head` is a copy of the model's head)."""

    norm: Norm

    def parts(self) -> dict[str, Part]:
        return {"norm": self.norm}


class SharedHeadLayer(Block):
    def forward(self, hidden):
        return self.norm(hidden)


SharedHead.layer = SharedHeadLayer


@dataclass(frozen=True)
class Prediction(Decoder):
    """Depth `depth`'s prediction layer: a decoder layer (the `Decoder` fields: its attention, its
    feed-forward part, its norms) with the projection in and the norm out, all under one prefix."""

    depth: int = 1

    @classmethod
    def around(cls, decoder: Decoder, depth: int) -> Prediction:
        """The prediction layer of depth `depth` around the decoder layer `decoder` declares."""
        return cls(**{f.name: getattr(decoder, f.name) for f in fields(decoder)}, depth=depth)

    def parts(self) -> dict[str, Part]:
        width = self.norm.dim
        return {"enorm": self.norm, "hnorm": self.norm, "eh_proj": WholeLinear(2 * width, width),
                **super().parts(), "shared_head": SharedHead(self.norm)}

    def saved_bytes(self, run: Execution, batch: int, seq_len: int, dtype_bytes: int) -> dict[str, int]:
        """The decoder layer's, plus what its three norms and the projection's input (both normed
        halves) keep, on a rank's positions (the planner's model; measured equal for a dense one)."""
        tokens = batch * seq_len // sequence_shards(run.tp, run.sequence_parallel)
        norm = rms_norm_saved_bytes(tokens, self.norm.dim, dtype_bytes, self.norm.offset,
                                    fused=run.kernels.fused_rms_norm)
        return {**super().saved_bytes(run, batch, seq_len, dtype_bytes), "enorm": norm, "hnorm": norm,
                "eh_proj": tokens * 2 * self.norm.dim * dtype_bytes, "shared_head.norm": norm}


class PredictionLayer(DecoderLayer):
    """Built from a `Prediction` declaration. Its class name must not contain "DecoderLayer": fleet's
    pipeline spreads the layers whose names do over the stages, and the prediction layers follow
    the last one on the last stage."""

    def forward(self, layer_state):
        """`layer_state`: (the main hidden states, carried: this depth's next-token embeddings, those of
        the deeper depths, then the outputs of the shallower ones); given back with this depth's
        embeddings taken and its output appended. Passed on untouched in evaluation."""
        if not self.training:
            return layer_state
        hidden, positions, carried = unpack(layer_state)
        embeddings, rest = carried[0], carried[1:]
        previous = hidden if self.declared.depth == 1 else rest[-1]
        mixed = self.eh_proj(paddle.concat([self.enorm(embeddings), self.hnorm(previous)], axis=-1))
        out = self.run.recompute("full", lambda x: self._block(x, positions), mixed, training=self.training)
        return state(hidden, positions, rest + (self.shared_head(out),))


Prediction.layer = PredictionLayer
