"""Command-line flags declared once, as typed dataclass fields: each argument group is a dataclass
whose fields are its flags (PaddleNLP's names), registered on a parser and read back typed."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
_TYPES = {"int": int, "float": float, "str": str, "Path": Path}


def flag(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field that is also a flag: its default, its help text, argparse extras (choices)."""
    return dataclasses.field(default=default, metadata={"help": help, **extra})


def add_flags(parser: argparse.ArgumentParser, group: type, title: str) -> argparse.ArgumentParser:
    """Register every field of the dataclass `group` as `--<field>` under one help heading."""
    section = parser.add_argument_group(title)
    for spec in dataclasses.fields(group):
        if spec.type == "bool":
            section.add_argument(f"--{spec.name}", action=argparse.BooleanOptionalAction, default=spec.default,
                                 **spec.metadata)
        else:
            section.add_argument(f"--{spec.name}", type=_TYPES[spec.type], default=spec.default, **spec.metadata)
    return parser


def read_flags(group: type[T], namespace: argparse.Namespace) -> T:
    """The dataclass `group` filled from a parsed namespace (fields of other groups are ignored)."""
    return group(**{spec.name: getattr(namespace, spec.name) for spec in dataclasses.fields(group)})
