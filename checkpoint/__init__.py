"""Unified checkpoint: single-card safetensors written from any layout, read back under any other.

`format.py` names every file and index field (specified in docs/checkpoint-format.md); `save.py`
writes (each tensor by exactly one rank, streamed), `durable.py` and `commit.py` make a save
durable and atomic, `load.py` reads this rank's slices, `verify.py` checks a folder offline.
Offline tools: `plan.py` (what a layout holds), `unified_io.py` (streaming reader/writer, rechunk),
`split.py` (per-rank pre-split copies), `fleet.py` (merge fleet per-rank files), `hf.py`
(transformers). `single_card_state.py` moves in-memory single-card weights into a layout and back.
This layer knows models only through `modeling.registry`.
"""
