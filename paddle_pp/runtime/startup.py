"""What a paddle-pp process does before Paddle and PaddleNLP are imported, so that a run or a tool
prints its own output only and starts about 3 s sooner on every rank.

`quiet_known_notes` (from `paddle_pp/__init__.py`, so before any of our modules imports Paddle)
ignores two notes, each by its exact message, that importing Paddle 3.3.1 and PaddleNLP 3.0.0b4
prints before anything of ours and that say nothing about the run: Paddle's "No ccache found" (its
C++-extension helper runs `which ccache` on import, for compiling custom operators, which paddle-pp
never does) and setuptools' "Setuptools is replacing distutils" (PaddleNLP's `utils/import_utils.py`
imports pip after Paddle imported setuptools' distutils). Every other warning still shows.

`quiet_one_process_fleet` (around `fleet.init` of a one-process job) keeps Paddle's notes about
distributed start-up off the terminal of a one-card run.

`lean_paddlenlp` (from `modeling/__init__.py`) registers `paddlenlp`, `paddlenlp.data` and
`paddlenlp.transformers` as packages whose `__init__.py` has not run, so that importing one of their
modules (`paddlenlp.transformers.model_utils`, `paddlenlp.data.causal_dataset`: the base classes and the
pretraining datasets paddle-pp uses) imports that module and what it needs, 0.3 s, instead of the
three inits' 4 s: `paddlenlp/__init__.py` imports every subsystem (taskflow, dataaug, server, metrics)
and with them Hugging Face `datasets`, pandas, scikit-learn, SciPy and FastAPI (3 s, and datasets'
"PyTorch version ... available" line); `paddlenlp.transformers`' imports every model and tokenizer of
its zoo and its auto classes (0.85 s); `paddlenlp.data`'s imports its collators, which import the
transformers init. Paid by every rank of every launch and by every tool.

A name such a package does not hold yet (`from paddlenlp.transformers import AutoTokenizer`, a
PaddleNLP model a test builds) runs the skipped inits on demand (module `__getattr__`, PEP 562): data's
first, as the full package init orders them (data's collators import the transformers init, which
imports back into data), then the one asked. The package objects carry their real search paths, so
every submodule is the installed file. Nothing is done if PaddleNLP is already imported.

`GIVEN_MATH_THREADS` keeps OMP_NUM_THREADS as it was before Paddle's import, which sets it to 1
when unset (`backends/cpu.py::set_math_threads` then uses the cores instead).

`complete_paddlenlp` runs all three skipped inits, for the code that uses PaddleNLP's `Trainer` or its
unified checkpoint (the benches that compare with them): those modules import each other (trainer,
peft, prompt) and resolve only in the top init's order.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
import warnings
from collections.abc import Iterator

KNOWN_NOTES = ("No ccache found", "Setuptools is replacing distutils")
# OMP_NUM_THREADS as the user (or a launcher) set it, read before Paddle's import sets it to 1 when unset
GIVEN_MATH_THREADS = os.environ.get("OMP_NUM_THREADS")


def quiet_known_notes() -> None:
    """Ignore the start-up notes of `KNOWN_NOTES` (messages' beginnings), nothing else."""
    for note in KNOWN_NOTES:
        warnings.filterwarnings("ignore", message=note, category=UserWarning)


ONE_PROCESS_NOTES = ("Currently not a parallel execution environment", "Current global rank 0 is not in group")


@contextlib.contextmanager
def quiet_one_process_fleet() -> Iterator[None]:
    """`fleet.init` in a one-process job (one card, started as `python script`, no launcher) without two
    things it prints there that say nothing about the run, on the terminal the user reads: the banner
    listing the flags Paddle itself changed on import (`FLAGS_enable_pir_in_executor`: PIR is its
    executor) and `ONE_PROCESS_NOTES`' two warnings that one process is not parallel (its INFO lines: `init_distributed` sets
    fleet's log level). A launched job keeps all of it, in each
    rank's log, as Paddle prints it."""
    from paddle.distributed import parallel

    banner = parallel._print_modified_flags
    parallel._print_modified_flags = lambda flags: None  # upstream: init_parallel_env's flags banner
    try:
        with warnings.catch_warnings():
            for note in ONE_PROCESS_NOTES:
                warnings.filterwarnings("ignore", message=note, category=UserWarning)
            yield
    finally:
        parallel._print_modified_flags = banner


LEAN_PACKAGES = ("paddlenlp", "paddlenlp.data", "paddlenlp.transformers")  # parents first
INIT_ORDER = ("paddlenlp.data", "paddlenlp.transformers", "paddlenlp")  # as the full package init runs them
_registered: set[str] = set()  # the packages lean_paddlenlp made (never re-run a real init)
_completed: set[str] = set()


def lean_paddlenlp() -> None:
    """Make PaddleNLP's packages importable without their inits (idempotent)."""
    if "paddlenlp" in sys.modules:
        return
    if importlib.util.find_spec("paddlenlp") is None:
        return  # not installed: the importer's own ImportError names it
    import paddle

    paddle.disable_signal_handler()  # as the skipped init does: Python's handlers, not Paddle's
    for name in LEAN_PACKAGES:
        _register_uninitialised(name)
    sys.modules["paddlenlp"].__version__ = _installed_version()


def _register_uninitialised(name: str) -> None:
    parent, _, leaf = name.rpartition(".")
    spec = (importlib.machinery.PathFinder.find_spec(name, sys.modules[parent].__path__) if parent
            else importlib.util.find_spec(name))
    package = types.ModuleType(name)
    package.__file__ = spec.origin
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    package.__package__ = name
    package.__getattr__ = _on_demand(package)
    sys.modules[name] = package
    _registered.add(name)
    if parent:
        setattr(sys.modules[parent], leaf, package)


def _on_demand(package: types.ModuleType):
    """The package's PEP 562 `__getattr__`: a submodule is imported, any other name completes the inits."""
    def __getattr__(attribute: str):
        if attribute.startswith("__") and attribute != "__all__":
            raise AttributeError(attribute)
        name = package.__name__
        if attribute != "__all__" and importlib.machinery.PathFinder.find_spec(f"{name}.{attribute}", package.__path__):
            return importlib.import_module(f"{name}.{attribute}")
        _complete_up_to(name)
        try:
            return package.__dict__[attribute]
        except KeyError:
            raise AttributeError(f"module {name!r} has no attribute {attribute!r}") from None
    return __getattr__


def _complete_up_to(name: str) -> None:
    """Run the skipped inits in the full init's order, through `name`'s."""
    for package in INIT_ORDER[:INIT_ORDER.index(name) + 1]:
        _run_init(sys.modules[package])


def _run_init(package: types.ModuleType) -> None:
    """Run a lean package's installed `__init__.py` into it, once (marked first: the inits import each other)."""
    if package.__name__ not in _registered or package.__name__ in _completed:
        return
    _completed.add(package.__name__)
    with open(package.__file__) as handle:
        exec(compile(handle.read(), package.__file__, "exec"), package.__dict__)  # noqa: S102 - the installed init


def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("paddlenlp")
    except PackageNotFoundError:
        return "unknown"


def complete_paddlenlp() -> None:
    """Run the inits `lean_paddlenlp` skipped, data's and transformers' first (idempotent)."""
    if "paddlenlp" not in sys.modules:
        importlib.import_module("paddlenlp")
        return
    _complete_up_to("paddlenlp")
