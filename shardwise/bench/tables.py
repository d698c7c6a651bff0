"""The tables ``shardwise bench`` prints: at most :data:`WIDTH` characters wide, the details behind ``--wide``.

A pair lists every column it can fill (:class:`Column`), marks the ones a first reading does without as
``detail``, and hands each row in full to :func:`table`, which keeps the default columns unless the run asked
for ``--wide``. So a pair's rows are written once, whichever columns are shown.
"""
from __future__ import annotations

import argparse
import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

WIDTH = 120  # a terminal of 120 columns shows every default table whole (tests/bench/test_table_widths.py)


@dataclass(frozen=True)
class Column:
    """One column: its header; ``detail``: shown only under ``--wide``; ``left``: a name, not a figure."""

    header: str
    detail: bool = False
    left: bool = False


def table(title: str, columns: Sequence[Column], rows: Iterable[Sequence[str]], wide: bool = False,
          caption: str | None = None) -> Table:
    """A rich table of ``rows`` (each one cell per column of ``columns``), without the detail columns unless
    ``wide``. The title and caption wrap to the table's width."""
    keep = [i for i, c in enumerate(columns) if wide or not c.detail]
    t = Table(title=title, caption=caption)
    for i in keep:
        t.add_column(columns[i].header, justify="left" if columns[i].left else "right")
    for row in rows:
        t.add_row(*(row[i] for i in keep))
    return t


def wide(a: argparse.Namespace) -> bool:
    """Whether the run asked for every column (``--wide``; False where the namespace has no such field)."""
    return bool(getattr(a, "wide", False))


def rendered_width(t: Table) -> int:
    """The characters of the longest line ``t`` prints in a terminal wide enough not to squeeze it."""
    console = Console(width=1000, file=io.StringIO(), record=True)
    console.print(t)
    return max(len(line.rstrip()) for line in console.export_text().splitlines())


__all__ = ["WIDTH", "Column", "rendered_width", "table", "wide"]
