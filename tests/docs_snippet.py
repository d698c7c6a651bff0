"""Run a docs page's marked Python block as written (``<!-- snippet: NAME -->`` before the block).

Each block is a complete program with a ``main()`` under ``if __name__ == "__main__":``, as a script run with
``python`` must be (its ranks re-import it). The test writes it to a file, imports it as a module (so its
functions pickle by reference) and calls ``main()`` in the test process; the ranks run on the worker pool, which
imports the module from the caller's ``sys.path`` as spawned ranks would.

Two other markers:

* ``<!-- snippet: NAME continues PREV -->``: the block builds on the page's block PREV. Its program is PREV's
  program without PREV's closing ``if __name__ == "__main__":`` lines, then this block, which ends with its own
  (so it may use PREV's imports, classes and functions, and its ``main()`` is the one that runs).
* ``<!-- not run: REASON -->``: a block that cannot run on this machine (a GPU, a cluster, a scheduler);
  the reason is reported by tests/system/test_docs_blocks.py.

A Python block with neither marker fails tests/system/test_docs_blocks.py. Pages: ``docs/*.md`` by name
(``"practical.md"``) and ``README.md``.
"""
from __future__ import annotations

import importlib
import os
import pathlib
import re
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
# A fenced Python block and the line before it (which holds the marker, if any).
_BLOCK = re.compile(r"^(?P<before>[^\n]*)\n```python\n(?P<code>.*?)^```", re.M | re.S)
_SNIPPET = re.compile(r"^<!-- snippet: (?P<name>[\w-]+)(?: continues (?P<prev>[\w-]+))? -->$")
_NOT_RUN = re.compile(r"^<!-- not run: (?P<reason>.+) -->$")
_GUARD = re.compile(r'\nif __name__ == "__main__":.*\Z', re.S)


def pages() -> list[str]:
    """Every page whose Python blocks are checked: docs/**/*.md (paths relative to docs/), then README.md."""
    return sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")) + ["README.md"]


def path(page: str) -> pathlib.Path:
    return ROOT / page if page == "README.md" else ROOT / "docs" / page


def python_blocks(page: str) -> list[tuple[int, str, str]]:
    """Every ```python block of ``page``: (line of its fence, the line before the fence, its code)."""
    text = path(page).read_text()
    return [(text.count("\n", 0, m.start("code")), m.group("before").rsplit("\n", 1)[-1], m.group("code"))
            for m in _BLOCK.finditer(text)]


def snippets(page: str) -> dict[str, tuple[str | None, str]]:
    """The page's marked blocks: name -> (the block it continues or None, its code)."""
    out = {}
    for _, before, code in python_blocks(page):
        m = _SNIPPET.match(before)
        if m:
            out[m.group("name")] = (m.group("prev"), code)
    return out


def not_run(page: str) -> list[str]:
    """The reasons of the page's blocks marked ``not run``, in page order."""
    return [m.group("reason") for _, before, _ in python_blocks(page) if (m := _NOT_RUN.match(before))]


def block(page: str, name: str) -> str:
    """The program of ``page``'s block ``name``: the block, after the programs it continues."""
    marked = snippets(page)
    if name not in marked:
        raise AssertionError(f"{path(page).relative_to(ROOT)} has no block marked {name!r}")
    prev, code = marked[name]
    if prev is None:
        return code
    return _GUARD.sub("\n", block(page, prev)) + "\n\n" + code


def run(page: str, name: str, tmp_path: pathlib.Path, monkeypatch: Any) -> Any:
    """Import docs/PAGE's block NAME as a module from ``tmp_path`` (the working directory) and run its main()."""
    module = "docs_" + "_".join(part.lower() for part in re.split(r"[^0-9A-Za-z]+", f"{page[:-3]}_{name}") if part)
    (tmp_path / f"{module}.py").write_text(block(page, name))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    loaded = importlib.import_module(module)
    assert os.path.dirname(loaded.__file__) == str(tmp_path)
    return loaded.main()
