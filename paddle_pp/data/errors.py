"""The data layer's user error."""

from __future__ import annotations

from paddle_pp.runtime.errors import UserError


class DataError(UserError, ValueError):
    """Input or prepared data that cannot be used as given; the message names the file and the fix."""
