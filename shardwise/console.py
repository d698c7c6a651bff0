"""The rich console every command prints through: as wide as the terminal, and wide enough in a pipe.

Without a terminal (``| cat``, ``> log``, CI) rich assumes 80 columns and cuts
table cells to "…"; a log or a pipe has no width to respect, so there the
console takes ``COLUMNS`` when set, else :data:`PIPE_WIDTH`.
"""
from __future__ import annotations

import os
import sys
from typing import Any

from rich.console import Console

PIPE_WIDTH = 220


def make_console(width: int | None = None, min_width: int = 0, **kwargs: Any) -> Console:
    """A rich Console ``width`` columns wide (default: the terminal's, or ``COLUMNS``, or
    :data:`PIPE_WIDTH` in a pipe), at least ``min_width``."""
    if width is None:
        columns = os.environ.get("COLUMNS", "")
        if columns.isdigit():
            width = int(columns)
        elif not sys.stdout.isatty():
            width = PIPE_WIDTH
        else:
            width = Console().width
    return Console(width=max(width, min_width), **kwargs)


__all__ = ["PIPE_WIDTH", "make_console"]
