"""File names, index layout and version policy of the unified checkpoint (docs/checkpoint-format.md)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

from paddle_pp.runtime.errors import UserError

FORMAT_VERSION = 2  # 2: files carry CRC-32 instead of SHA-256 (version 1 files still verify)
MODEL, OPTIMIZER, GRADIENTS = "model", "optimizer", "gradients"
CONFIG_FILE = "config.json"
TRAINER_STATE_FILE = "trainer_state.json"
TRAINER_STATE_PICKLE = "trainer_state.bin"  # PaddleFormers' (a pickled TrainerState)
TOKENIZER_FILE = "tokenizer.model"  # a SentencePiece model (the shipped tokenizer, and LLaMA folders')
# Files a tokenizer folder may hold: checkpoints, exports and conversions carry them all.
# the tokenizer and what renders its chats (transformers saves a folder's chat template as chat_template.jinja)
TOKENIZER_FILE_PATTERNS = ("tokenizer*", "vocab*", "merges.txt", "special_tokens_map.json", "added_tokens.json",
                           "spiece.model", "sentencepiece*.model", "chat_template.jinja")
LATEST_FILE = "latest"
CHECKPOINT_PREFIX = "checkpoint-"
STATE_SEPARATOR = "/"  # optimizer keys are "<parameter name>/<state name>"
# The model index's record of how its weights are stored: absent for ours (PaddleNLP's names, Paddle's
# [in, out] linears, what PaddleNLP 3 loads); TRANSFORMERS_LAYOUT for transformers' names and layout
# (`--save_to_hf`, PaddleFormers' name: the folder loads in transformers as it is).
WEIGHTS_LAYOUT, TRANSFORMERS_LAYOUT = "weights_layout", "transformers"
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)  # importing ml_dtypes also makes np.dtype("bfloat16") parse index dtypes


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted, or does not fit the model."""


def tokenizer_files(folder: Path) -> list[Path]:
    found = {path for pattern in TOKENIZER_FILE_PATTERNS for path in Path(folder).glob(pattern) if path.is_file()}
    return sorted(found)


def copy_tokenizer_files(source: Path, target: Path) -> None:
    for path in tokenizer_files(source):
        shutil.copyfile(path, Path(target) / path.name)


def tensor_nbytes(meta: dict) -> int:
    """Bytes of a tensor described by index metadata ({"dtype": ..., "shape": [...]})."""
    return int(np.prod(meta["shape"], dtype=np.int64)) * np.dtype(meta["dtype"]).itemsize


def index_name(kind: str) -> str:
    return f"{kind}.safetensors.index.json"


def shard_name(kind: str, number: int, total: int) -> str:
    """Hugging Face shard names: model-00001-of-00004.safetensors."""
    return f"{kind}-{number:05d}-of-{total:05d}.safetensors"


def checkpoint_dir_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step}"


# Checkpoints other trainers write, told apart by their files, and the tool that turns each into ours.
FOREIGN_CHECKPOINTS = (
    ("a PaddleFormers flex checkpoint", lambda folder: any(Path(folder).glob("model_state/*.metadata")),
     "tools/reshard.py paddleformers {folder} <new folder> --model <the folder the run started from>"),
    ("a PaddleFormers unified checkpoint", lambda folder: (Path(folder) / TRAINER_STATE_PICKLE).is_file()
     and (Path(folder) / index_name(MODEL)).is_file(), "tools/reshard.py paddleformers {folder} <new folder>"),
    ("PaddleNLP's or fleet's per-rank files", lambda folder: any(Path(folder).glob("model_state.tp*.pdparams")),
     "tools/reshard.py merge {folder} <new folder>"),
)


def foreign_checkpoint(folder: Path) -> str | None:
    """What another trainer's checkpoint `folder` is and the command that imports it; None otherwise."""
    for what, recognised, command in FOREIGN_CHECKPOINTS:
        if recognised(folder):
            return f"{folder} is {what}: import it first with `{command.format(folder=folder)}` and use that folder"
    return None


def read_index(folder: Path, kind: str) -> dict:
    """The index of `kind` in `folder`."""
    path = Path(folder) / index_name(kind)
    foreign = foreign_checkpoint(folder) if kind == MODEL else None
    if foreign:
        raise CheckpointError(foreign)
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: {folder} is not a complete unified checkpoint")
    return read_versioned_json(path)


def read_versioned_json(path: Path) -> dict:
    """An index file, refusing versions this reader does not know.

    Version policy: a reader accepts every version up to its own (older ones are upgraded on read
    when the format changes) and refuses a newer one, naming both, rather than guess."""
    try:
        index = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}); the checkpoint is corrupted") from err
    version = index.get("metadata", {}).get("format_version")
    if not isinstance(version, int):
        raise CheckpointError(f"{path} has no metadata.format_version: not written by paddle-pp")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {version}, newer than this reader's {FORMAT_VERSION}; "
                              "upgrade paddle-pp to read it")
    return index


def weights_layout(folder: Path) -> str | None:
    """How a checkpoint folder stores its weights (`WEIGHTS_LAYOUT`); None for ours, and for a folder
    with no model index of ours (a pre-split copy, a model folder of another library)."""
    path = Path(folder) / index_name(MODEL)
    return json.loads(path.read_text()).get("metadata", {}).get(WEIGHTS_LAYOUT) if path.is_file() else None


def require_our_layout(index: dict, folder: Path) -> None:
    """Refuse a model index in transformers' layout where our names are read by name."""
    if index["metadata"].get(WEIGHTS_LAYOUT) is not None:
        raise CheckpointError(f"{folder} keeps its weights in {index['metadata'][WEIGHTS_LAYOUT]}' names and layout "
                              "(saved with --save_to_hf): it loads in transformers as it is, resumes a run under any "
                              "layout and starts one as --model_name_or_path, but this reader takes paddle-pp's own "
                              "layout (tools/convert_hf.py import makes a weights-only copy in it)")
