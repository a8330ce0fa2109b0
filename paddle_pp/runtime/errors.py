"""The one base of every error a user can cause and fix (flags, degrees, configs, files)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable


class UserError(Exception):
    """A request that cannot run as given. The message names the problem and the fix; entry points
    print it and exit with code 2 instead of a traceback. Subclasses keep a builtin base too
    (ValueError, FileNotFoundError, ...), so callers that caught those still do."""


def report_written(tool: str, write: Callable[[], Path]) -> int:
    """A tool's exit code for writing a folder: 0 with the folder named, or 1 with the user error's
    message (a missing file too) instead of a traceback."""
    try:
        out = write()
    except (UserError, FileNotFoundError) as err:
        print(f"{tool}: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
