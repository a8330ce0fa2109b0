"""Paddle's pickled files (`.pdparams`, `.pdopt`, a scheduler's `.pdparams`) read as data: an
unpickler that admits only what `paddle.save` writes for state dicts and refuses any other global
before it is called, so a model folder someone hands a user cannot run code on every rank.

`paddle.load` is `pickle.load` on the file, which calls whatever the file names (`os.system`
included). `paddle.save` of a state dict needs only: numpy's array reconstruction (`ndarray`,
`dtype`, `_reconstruct`, `scalar`), `_codecs.encode` (protocol 2 stores bytes that way), containers
(`tuple` for Paddle's `(name, array)` tensors, `collections.OrderedDict`). Static-graph DenseTensors,
which Paddle reduces to `eval('data', {...})`, are refused like any other call (dygraph state dicts,
PaddleNLP's included, never hold one). The result is put together by Paddle's own helpers
(`_pack_loaded_dict`, `_parse_load_result`), so it equals what `paddle.load(..., return_numpy=True)`
returns. `allow_unsafe_pickle` (`--allow_unsafe_pickle`) hands the file to `paddle.load` itself,
for a folder the user trusts.
"""

from __future__ import annotations

import _compat_pickle
import pickle
from pathlib import Path

from paddle_pp.runtime.errors import UserError

NAME_TABLE = "StructuredToParameterName@@"
ALLOW_UNSAFE_PICKLE_HELP = ("read pickled .pdparams/.pdopt files with paddle.load, which runs any code they carry: only "
                            "for files you trust (default: data only; see docs/known-problems.md, Security)")


class UnsafePickleError(UserError, pickle.UnpicklingError):
    """A pickled file that asks to call something a saved state dict never needs."""


def state_dict_globals() -> dict[tuple[str, str], object]:
    import builtins
    import codecs
    import collections

    import numpy as np

    multiarray = np.core.multiarray if hasattr(np, "core") else np._core.multiarray
    admitted = {("builtins", name): getattr(builtins, name)
                for name in ("tuple", "list", "dict", "set", "frozenset", "complex", "bytearray", "slice")}
    admitted |= {("_codecs", "encode"): codecs.encode,
                 ("collections", "OrderedDict"): collections.OrderedDict,
                 ("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):  # numpy 1.x and 2.x files spell it apart
        admitted |= {(module, "_reconstruct"): multiarray._reconstruct, (module, "scalar"): multiarray.scalar}
    return admitted


class _DataOnlyUnpickler(pickle.Unpickler):
    def __init__(self, handle, path: Path):
        super().__init__(handle, encoding="latin1")  # as paddle.load: protocol-2 numpy payloads are latin-1 bytes
        self.path, self.admitted = path, state_dict_globals()

    def find_class(self, module: str, name: str):
        # protocol 2 spells Python 2's names ("__builtin__"), mapped as pickle itself maps them
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        found = self.admitted.get((module, name))
        if found is None:
            raise UnsafePickleError(
                f"{self.path} asks to load the Python global {module}.{name}, which a Paddle state dict never "
                "holds; a pickled file can run code when it is loaded, so it is refused. If you trust whoever "
                "wrote it, convert it once to safetensors (a model folder: tools/convert_hf.py import FOLDER OUT "
                "--allow_unsafe_pickle; fleet per-rank files: tools/reshard.py merge FOLDER OUT "
                "--allow_unsafe_pickle) and use the copy, or pass --allow_unsafe_pickle to this command")
        return found


def load_pickled_record(path: Path, records: dict[tuple[str, str], type]):
    """A pickled object other than a state dict (a trainer state, a checkpoint's metadata) read as data:
    `records` maps the (module, class) it may name to plain stand-ins, rebuilt from their pickled
    fields without importing or calling what the file names."""
    path = Path(path)
    with open(path, "rb") as handle:
        unpickler = _DataOnlyUnpickler(handle, path)
        unpickler.admitted |= records
        return unpickler.load()


def load_pickled(path: Path, allow_unsafe_pickle: bool = False, keep_name_table: bool = False):
    """The numpy state a Paddle pickled file holds, as `paddle.load(path, return_numpy=True)` gives it."""
    import paddle
    from paddle.framework import io as paddle_io

    path = Path(path)
    if allow_unsafe_pickle:
        return paddle.load(str(path), return_numpy=True, keep_name_table=keep_name_table)
    with open(path, "rb") as handle:
        loaded = _DataOnlyUnpickler(handle, path).load()
    if not isinstance(loaded, dict):
        return paddle_io._parse_load_result(loaded, True)
    loaded = paddle_io._pack_loaded_dict(loaded)
    if NAME_TABLE not in loaded:
        return paddle_io._parse_load_result(loaded, True)
    if not keep_name_table:
        del loaded[NAME_TABLE]
    return loaded
