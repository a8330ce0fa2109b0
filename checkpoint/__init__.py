"""Unified checkpoint: single-card safetensors written from any layout, read back under any other.

`save.py` writes (each tensor by exactly one rank, streamed), `commit.py` makes a save durable and
atomic, `load.py` reads this rank's slices, `verify.py` checks a folder, `format.py` names every
file and index field (specified in docs/checkpoint-format.md).
"""
