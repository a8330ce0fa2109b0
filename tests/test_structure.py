"""The code base's layers run one way, read from the source: a module imports only its own layer
and the layers below; models use the topology only for type hints; the checkpoint knows models only
through their plans (it imports no family); no two modules import each other, directly or in a
ring. The checker is shown to fail on a tree that breaks each rule."""

from __future__ import annotations

import ast
from pathlib import Path

from runs import REPO

LAYERS = [  # bottom first: (name, packages or modules)
    ("parallel runtime", ("paddle_pp.runtime",)),
    ("models", ("modeling",)),
    ("checkpoint", ("checkpoint",)),
    ("interop and planning", ("paddle_pp.interop", "paddle_pp.planning")),
    ("training loop", ("paddle_pp.training", "paddle_pp.data")),
    ("entry points and tools", ("run_pretrain", "tools")),
]
TYPE_HINTS_ONLY = {"modeling": ("paddle_pp.runtime.topology", "paddle_pp.runtime.layout")}
MODELS_SEEN_AS_PLANS = {"checkpoint": ("modeling.placement",)}  # the only model modules these packages import
SOURCES = ("paddle_pp", "modeling", "checkpoint", "tools", "run_pretrain.py")


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int | None:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return None


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(tree: ast.AST, known: set[str]) -> list[tuple[str, bool]]:
    """(imported module, only for type hints) for every import anywhere in the file, resolving
    `from package import module` to the module."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, hints: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, hints)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, hints) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.append((candidate if candidate in known else node.module, hints))
        for child in ast.iter_child_nodes(node):
            visit(child, hints)

    visit(tree, False)
    return found


def _source_files(root: Path) -> dict[str, Path]:
    files = [p for source in SOURCES for p in ([root / source] if source.endswith(".py") else
                                                sorted((root / source).rglob("*.py"))) if p.is_file()]
    return {_module_name(root, path): path for path in files}


def import_graph(root: Path) -> dict[str, list[tuple[str, bool]]]:
    """Our module -> the modules of ours it imports (and whether only for type hints)."""
    names = _source_files(root)
    graph = {}
    for module, path in names.items():
        imported = _imports(ast.parse(path.read_text(), str(path)), set(names))
        graph[module] = [(target, hints) for target, hints in imported
                         if _layer(target) is not None and target != module]
    return graph


def backward_imports(graph: dict[str, list[tuple[str, bool]]]) -> list[str]:
    problems = []
    for module, targets in graph.items():
        own = _layer(module)
        for target, hints in targets:
            if own is not None and _layer(target) > own:
                problems.append(f"{module} ({LAYERS[own][0]}) imports {target} ({LAYERS[_layer(target)][0]})")
            for prefix, hinted in TYPE_HINTS_ONLY.items():
                if module.startswith(prefix) and target in hinted and not hints:
                    problems.append(f"{module} imports {target} outside `if TYPE_CHECKING:`")
            for prefix, allowed in MODELS_SEEN_AS_PLANS.items():
                if module.startswith(prefix) and _layer(target) == 1 and target not in allowed:
                    problems.append(f"{module} imports {target}: {prefix} sees models only as plans ({allowed[0]})")
    return problems


def import_cycles(graph: dict[str, list[tuple[str, bool]]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target, _ in graph.get(node, []):
            if target not in graph:
                continue
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in graph:
        if node not in index:
            connect(node)
    return cycles


def test_layers_import_only_downwards():
    graph = import_graph(REPO)
    assert len(graph) > 40, "the checker must see the whole code base"
    assert backward_imports(graph) == []


def test_no_module_imports_itself_through_others():
    assert import_cycles(import_graph(REPO)) == []


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_checker_catches_a_backward_import_a_runtime_import_in_a_model_and_a_cycle(tmp_path):
    files = {
        "paddle_pp/runtime/topology.py": "",
        "modeling/model.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                             "    from paddle_pp.runtime.topology import Topology\n",
        "modeling/leaky.py": "from paddle_pp.runtime.topology import Topology\n",
        "modeling/upward.py": "def load():\n    from checkpoint import save\n",
        "checkpoint/save.py": "from checkpoint.index import x\nfrom modeling.registry import plan_of\n",
        "checkpoint/index.py": "import checkpoint.save\n",
    }
    _write_tree(tmp_path, files)
    graph = import_graph(tmp_path)
    assert sorted(backward_imports(graph)) == [
        "checkpoint.save imports modeling.registry: checkpoint sees models only as plans (modeling.placement)",
        "modeling.leaky imports paddle_pp.runtime.topology outside `if TYPE_CHECKING:`",
        "modeling.upward (models) imports checkpoint.save (checkpoint)",
    ]
    assert import_cycles(graph) == [["checkpoint.index", "checkpoint.save"]]


PICKLE_LOADER = "paddle_pp.interop.pickled"  # the one module allowed to unpickle (issue 30)
UNPICKLING_CALLS = {("paddle", "load"), ("pickle", "load"), ("pickle", "loads"), ("_pickle", "load"),
                    ("_pickle", "loads"), ("dill", "load"), ("dill", "loads")}


def unpickling_sites(root: Path) -> list[str]:
    """Every place outside the restricted loader that could run a pickle's code: `paddle.load`,
    `pickle.load(s)`, any `Unpickler`, and `allow_pickle=True`."""
    found = []
    for module, path in _source_files(root).items():
        if module == PICKLE_LOADER:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{module}:{getattr(node, 'lineno', 0)}"
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and (node.value.id, node.attr) in UNPICKLING_CALLS):
                found.append(f"{where} {node.value.id}.{node.attr}")
            elif (isinstance(node, (ast.Attribute, ast.Name, ast.alias))
                  and "Unpickler" in (getattr(node, "attr", None) or getattr(node, "id", None)
                                      or getattr(node, "name", ""))):
                found.append(f"{where} Unpickler")
            elif (isinstance(node, ast.keyword) and node.arg == "allow_pickle"
                  and isinstance(node.value, ast.Constant) and node.value.value is True):
                found.append(f"{where} allow_pickle=True")
    return found


def test_only_the_restricted_loader_unpickles():
    assert unpickling_sites(REPO) == []


def test_unpickling_checker_finds_each_way_in(tmp_path):
    files = {
        "paddle_pp/interop/pickled.py": "import pickle\nclass _Safe(pickle.Unpickler): pass\n",
        "checkpoint/a.py": "import paddle\nstate = paddle.load(path)\n",
        "tools/b.py": "import pickle\nx = pickle.loads(blob)\n",
        "modeling/c.py": "from pickle import Unpickler\n",
        "paddle_pp/d.py": "import numpy as np\nnp.load(p, allow_pickle=True)\n",
        "paddle_pp/e.py": "import numpy as np\nnp.load(p)\nimport json\njson.loads(s)\n",
    }
    _write_tree(tmp_path, files)
    assert sorted(unpickling_sites(tmp_path)) == [
        "checkpoint.a:2 paddle.load", "modeling.c:1 Unpickler",
        "paddle_pp.d:2 allow_pickle=True", "tools.b:2 pickle.loads"]
