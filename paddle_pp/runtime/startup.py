"""What a paddle-pp process does before Paddle and PaddleNLP are imported, so that a run or a tool
prints its own output only and starts about 3 s sooner on every rank.

`quiet_known_notes` (from `paddle_pp/__init__.py`, so before any of our modules imports Paddle)
ignores two notes, each by its exact message, that importing Paddle 3.3.1 and PaddleNLP 3.0.0b4
prints before anything of ours and that say nothing about the run: Paddle's "No ccache found" (its
C++-extension helper runs `which ccache` on import, for compiling custom operators, which paddle-pp
never does) and setuptools' "Setuptools is replacing distutils" (PaddleNLP's `utils/import_utils.py`
imports pip after Paddle imported setuptools' distutils). Every other warning still shows.

`lean_paddlenlp` (from `modeling/__init__.py`) imports PaddleNLP's model, config and data modules
without running `paddlenlp/__init__.py`, which imports every subsystem (taskflow, dataaug, server,
metrics) and with them Hugging Face `datasets`, pandas, scikit-learn, SciPy's stats and FastAPI: 3 s
of CPU in every process, paid by each rank of every launch, and datasets' "PyTorch version ...
available" line. paddle-pp uses `paddlenlp.transformers` (the base classes) and `paddlenlp.data` (the
pretraining datasets), which import fine without the package init once `paddlenlp.data` is imported
first, in the order the init itself uses (`paddlenlp.transformers` imports back into it). It
registers the package object with its real search path, so every submodule is the installed file,
imported on demand; it does nothing if PaddleNLP is already imported.

`complete_paddlenlp` runs the skipped init into that package object, for the code that uses
PaddleNLP's `Trainer` or its unified checkpoint (the benches that compare with them): those modules
import each other (trainer, peft, prompt) and resolve only in the init's order.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import warnings

KNOWN_NOTES = ("No ccache found", "Setuptools is replacing distutils")


def quiet_known_notes() -> None:
    """Ignore the start-up notes of `KNOWN_NOTES` (messages' beginnings), nothing else."""
    for note in KNOWN_NOTES:
        warnings.filterwarnings("ignore", message=note, category=UserWarning)


def lean_paddlenlp() -> None:
    """Make `paddlenlp` importable without its package init (idempotent)."""
    if "paddlenlp" in sys.modules:
        return
    spec = importlib.util.find_spec("paddlenlp")
    if spec is None or spec.submodule_search_locations is None:
        return  # not installed: the importer's own ImportError names it
    package = types.ModuleType("paddlenlp")
    package.__file__ = spec.origin
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    package.__package__ = "paddlenlp"
    package.__version__ = _installed_version()
    sys.modules["paddlenlp"] = package
    import paddle

    paddle.disable_signal_handler()  # as the skipped init does: Python's handlers, not Paddle's
    importlib.import_module("paddlenlp.data")


def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("paddlenlp")
    except PackageNotFoundError:
        return "unknown"


def complete_paddlenlp() -> None:
    """Run `paddlenlp/__init__.py` into the package `lean_paddlenlp` registered (idempotent)."""
    package = sys.modules.get("paddlenlp")
    if package is None:
        importlib.import_module("paddlenlp")
        return
    if hasattr(package, "Taskflow"):  # the init ran (its last import)
        return
    with open(package.__file__) as handle:
        exec(compile(handle.read(), package.__file__, "exec"), package.__dict__)  # noqa: S102 - the installed init
