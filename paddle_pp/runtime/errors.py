"""The one base of every error a user can cause and fix (flags, degrees, configs, files)."""

from __future__ import annotations


class UserError(Exception):
    """A request that cannot run as given. The message names the problem and the fix; entry points
    print it and exit with code 2 instead of a traceback. Subclasses keep a builtin base too
    (ValueError, FileNotFoundError, ...), so callers that caught those still do."""
