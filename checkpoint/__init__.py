"""Unified checkpoint: single-card safetensors written from any layout, read back under any other.

`format.py` names every file and index field (specified in docs/checkpoint-format.md); `save.py`
writes (each tensor by exactly one rank, streamed; `save_plan.py` and `writers.py` say what goes
where and who writes it, shared with the planner), `shards.py` streams safetensors shards and their
checksums, `durable.py` and `commit.py` make a save durable and atomic, `load.py` reads this rank's
slices, `verify.py` checks a folder offline. `replicas.py` compares the copies that must be equal
before a save; `optimizer_state.py` files optimizer states by parameter; `stage3.py` turns stage3's
flat slices into single-card tensors. Offline: `unified_io.py` (streaming reader/writer, rechunk,
weights-only export), `split.py` (per-rank pre-split copies). `single_card_state.py` moves
in-memory single-card weights into a layout and back. Fleet's per-rank files and other frameworks'
folders are read and written by `paddle_pp/interop`.

This layer knows models only as plans (`modeling.placement`: every tensor's shape, split and stage),
never a family.
"""

import paddle_pp  # noqa: E402,F401  (its start-up: Paddle imported quietly)
