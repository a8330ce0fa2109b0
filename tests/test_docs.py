"""Docs that cannot drift: docs/flags.md is the argument groups' own table, and the file map of
docs/architecture.md names every module, bench script, tool and tool subcommand there is."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from paddle_pp.training.arguments import flags_document

from runs import REPO

ARCHITECTURE = REPO / "docs" / "architecture.md"
SOURCES = ("paddle_pp", "modeling", "checkpoint", "tools", "bench")


def _file_map() -> list[str]:
    """The entries of the file map (a line that starts in column 0, with its indented continuation)."""
    text = ARCHITECTURE.read_text()
    block = text[text.index("```\npaddle_pp/"):]
    block = block[4:block.index("\n```", 4)]
    entries: list[str] = []
    for line in block.splitlines():
        if line.startswith(" ") and entries:
            entries[-1] += " " + line.strip()
        else:
            entries.append(line)
    return entries


def _named(path: Path, entries: list[str]) -> bool:
    """Whether an entry names the file: its path, or its name in an entry of its own folder (a
    package's `__init__.py` by the package's name in an entry of the folder above)."""
    folder, name = (path.parent.parent, path.parent.name) if path.name == "__init__.py" else (path.parent, path.stem)
    if folder == Path("."):  # a top-level package: its folder has entries
        return any(entry.startswith(f"{name}/") for entry in entries)
    prefix = f"{folder.as_posix()}/"
    word = re.compile(rf"(?<![\w/]){re.escape(name)}(?![\w])")
    return any(f"{folder.as_posix()}/{name}" in entry or (entry.startswith(prefix) and word.search(entry))
               for entry in entries)


def test_the_flags_doc_is_the_argument_groups_table():
    assert (REPO / "docs" / "flags.md").read_text() == flags_document(), "run tools/flags_table.py"


def test_the_file_map_names_every_module_bench_script_and_tool():
    entries = _file_map()
    files = [path.relative_to(REPO) for root in SOURCES for path in sorted((REPO / root).rglob("*.py"))
             if "results" not in path.parts and not (path.name == "__init__.py" and root in ("tools", "bench"))]
    missing = [str(path) for path in files if not _named(path, entries)]
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_the_file_map_names_every_tool_subcommand():
    sys.path.insert(0, str(REPO / "tools"))
    import reshard  # noqa: E402

    subcommands = reshard.build_parser()._subparsers._group_actions[0].choices
    tools_entry = next(entry for entry in _file_map() if entry.startswith("tools/"))
    missing = [name for name in subcommands if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", tools_entry)]
    assert not missing, f"the tools/ entry of docs/architecture.md does not name reshard.py's {missing}"
