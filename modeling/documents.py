"""Per-document attention (PaddleFormers' pretraining default, `use_global_causal_attn: false`;
Megatron's `reset_attention_mask` with `reset_position_ids`): inside a packed sample a token attends
only to the tokens of its own document, and positions restart at every document.

A document ends at an end-of-document token (`Execution.documents`: the trainer passes the
tokenizer's end-of-sequence token, the one preprocessing writes after every document): the token
after one starts the next document. The first stage derives every token's
position from the input ids (`document_positions`); the positions travel beside the hidden states
through the decoder layers, and between pipeline stages as PaddleNLP's pipes pass their position
ids (`state` / `unpack`). Each layer reads from them what its rotary needs and where each query's
document starts (`Documents`): query i sees keys j with start(i) <= j <= i, a causal mask with a
lower bound per row, which every core applies (dense masks, blockwise also skips the key blocks
every query of a block has left behind, flash hands Paddle's flashmask the row each key stops being
seen at). Under context parallelism a rank holds two chunks of each sequence: the ends are summed
over the ring before positions are found, starts are sequence positions, and each call of the ring
gives its kernel the positions of the keys it sees (`Documents.for_keys`).

With `Execution.within_documents` False only the positions restart and attention spans the packed
sample: PaddleFormers' `use_global_causal_attn: true` (its collator restarts positions either way),
Megatron's `reset_position_ids` without `reset_attention_mask`.

PaddleFormers cuts documents where its index's documents end, we where their end-of-document token
is; the two agree on data prepared with an end-of-document token after every document, which is
what `paddle_pp.data.preprocess` and PaddleNLP's `create_pretraining_data.py` write.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle

from modeling.context_parallel import local_positions, whole_sequence


def document_positions(input_ids: paddle.Tensor, end_ids: tuple[int, ...], ring=None) -> paddle.Tensor:
    """int64 [batch, seq]: each token's position inside its document (0 at a sample's first token
    and after every end-of-document token), without leaving the device. Under context parallelism
    (`ring`: `input_ids` are this rank's two chunks of each sequence) a document may begin on another
    rank: where documents end is summed over the ring into the whole sequence first (one small
    all-reduce), the positions found there, and this rank's kept."""
    ended = paddle.zeros(input_ids.shape, "bool")
    for end in end_ids:
        ended = paddle.logical_or(ended, input_ids == end)
    if ring is None or ring.degree == 1:
        return _positions_after(ended)
    batch, local = input_ids.shape
    held = paddle.to_tensor(local_positions(local * ring.degree, ring.degree, ring.rank)).expand([batch, local])
    return paddle.take_along_axis(_positions_after(whole_sequence(ended.astype("int64"), ring) > 0), held, axis=1)


def _positions_after(ended: paddle.Tensor) -> paddle.Tensor:
    """Positions inside documents of a whole sequence whose end-of-document tokens are `ended`."""
    batch, seq = ended.shape
    begins = paddle.concat([paddle.ones([batch, 1], "bool"), ended[:, :-1]], axis=1)
    index = paddle.arange(seq, dtype="int64").unsqueeze(0).expand([batch, seq])
    starts = paddle.cummax(paddle.where(begins, index, paddle.zeros_like(index)), axis=1)[0]
    positions = index - starts
    positions.stop_gradient = True
    return positions


def state(hidden: paddle.Tensor, positions: paddle.Tensor | None = None, carried: tuple[paddle.Tensor, ...] = ()):
    """What a decoder layer takes and gives: the hidden states alone (one causal stream), or a tuple
    (which fleet's pipeline passes between stages) with the document positions beside them (the one
    integer tensor) and what the layers after the decoder need from the first stage (`carried`: the
    next tokens' embeddings of multi-token prediction, `blocks/prediction.py`)."""
    extra = ((positions,) if positions is not None else ()) + tuple(carried)
    return (hidden, *extra) if extra else hidden


def positions_among(tensors) -> tuple[paddle.Tensor | None, tuple[paddle.Tensor, ...]]:
    """(the document positions, the other tensors) of what travels beside the hidden states or the
    logits: the positions are the one integer tensor there (None: attention spans the sample)."""
    positions = [tensor for tensor in tensors if not tensor.is_floating_point()]
    return (positions[0] if positions else None), tuple(tensor for tensor in tensors if tensor.is_floating_point())


def as_state(value):
    """A `state` from what a pipeline schedule hands a chunk: DualPipeV's passes a list always (one
    tensor or several), 1F1B's a tensor or a tuple."""
    if isinstance(value, list):
        return value[0] if len(value) == 1 else tuple(value)
    return value


def unpack(value) -> tuple[paddle.Tensor, paddle.Tensor | None, tuple[paddle.Tensor, ...]]:
    """(hidden states, document positions or None, carried tensors) of a `state` (or of a schedule's list)."""
    value = as_state(value)
    if not isinstance(value, tuple):
        return value, None, ()
    hidden, *rest = value
    return (hidden, *positions_among(rest))


def handed_across(value):
    """The `state` `value` as a pipeline stage's last layer hands it on: every tensor beside the hidden
    states a copy. Fleet frees a stage's outputs once it has sent them (their memory is the next
    stage's), and the stage's backward may still read them: the document positions a recomputed layer
    reruns with, keys a later layer of the stage reused."""
    hidden, positions, carried = unpack(value)
    return state(hidden, None if positions is None else positions.clone(), tuple(each.clone() for each in carried))


def with_hidden(value, hidden: paddle.Tensor):
    """The `state` `value` with other hidden states (what a decoder layer gives back)."""
    _, positions, carried = unpack(value)
    return state(hidden, positions, carried)


@dataclass(frozen=True)
class Documents:
    """Where each query's document starts, per batch row, as a sequence position (host values: the
    blockwise core picks the blocks it computes from them), and the sequence positions of the keys
    a call sees (None: key j is position j, a whole sequence's call). Queries and keys are in
    increasing positions, so starts only grow along a row; under context parallelism a rank's
    queries are its two chunks and each call of the ring sees another rank's (`for_keys`)."""

    starts: np.ndarray  # int64 [batch, queries]
    keys: np.ndarray | None = None  # int64 [keys]

    @classmethod
    def of(cls, positions: paddle.Tensor, held: np.ndarray | None = None) -> Documents:
        """From the document positions of the queries at sequence positions `held` (None: 0..seq-1)."""
        inside = positions.numpy()
        return cls((np.arange(inside.shape[1]) if held is None else held)[None, :] - inside)

    @classmethod
    def in_chunks(cls, chunk: int, held: np.ndarray, documents: Documents | None, batch: int) -> Documents:
        """Each query's start under chunked attention (Llama 4: chunks of `chunk` sequence positions),
        inside its document when `documents` are given; `held` the queries' sequence positions."""
        starts = np.broadcast_to((held // chunk * chunk)[None, :], (batch, held.shape[0]))
        return cls(starts.copy() if documents is None else np.maximum(starts, documents.starts))

    def for_keys(self, keys: np.ndarray, rows: slice = slice(None)) -> Documents:
        """The documents of a call of the queries `rows` on the keys at positions `keys`."""
        return Documents(self.starts[:, rows], keys)

    def _key(self, j: int) -> int:
        return j if self.keys is None else int(self.keys[j])

    def oldest_key(self, i0: int) -> int:
        """The first key (index) any query from query i0 on still sees."""
        oldest = int(self.starts[:, i0].min())
        return oldest if self.keys is None else int(np.searchsorted(self.keys, oldest))

    def cuts(self, i0: int, i1: int, j0: int) -> bool:
        """Whether some query in [i0, i1) has its document start after key j0 (the block needs the mask)."""
        return bool(self.starts[:, i1 - 1].max() > self._key(j0))

    def mask(self, i0: int, i1: int, j0: int, j1: int, groups: int) -> paddle.Tensor:
        """fp32 [batch, 1, (i1 - i0) x groups, j1 - j0]: 0 where a query row's document holds the key,
        -inf where it does not (rows laid out as the blockwise core's: position r // groups)."""
        rows = np.repeat(self.starts[:, i0:i1], groups, axis=1)[:, None, :, None]
        keys = (np.arange(j0, j1) if self.keys is None else self.keys[j0:j1])[None, None, None, :]
        return paddle.to_tensor(np.where(keys >= rows, 0.0, -np.inf).astype(np.float32))

    def visible(self, groups: int) -> paddle.Tensor:
        """bool [batch, 1, seq x groups, seq]: True where a key is not before its query row's document
        (the causal and window bounds are the core's own mask)."""
        seq = self.starts.shape[1]
        starts = np.repeat(self.starts, groups, axis=1)[:, None, :, None]
        return paddle.to_tensor(np.arange(seq)[None, None, None, :] >= starts)

    def key_ends(self, window: int | None) -> paddle.Tensor:
        """int32 [batch, 1, seq, 1]: the first query row that no longer sees each key (its document's
        end, or key + window when sooner): flashmask's lower-triangle start rows."""
        batch, seq = self.starts.shape
        ends = np.empty((batch, seq), np.int64)
        for row in range(batch):
            begins = np.flatnonzero(np.diff(self.starts[row], prepend=-1))
            lengths = np.diff(np.append(begins, seq))
            ends[row] = np.repeat(begins + lengths, lengths)
        if window is not None:
            ends = np.minimum(ends, np.arange(seq)[None, :] + window)
        return paddle.to_tensor(ends.astype(np.int32)[:, None, :, None])
