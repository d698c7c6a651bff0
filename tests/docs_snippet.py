"""Run a docs page's marked Python block as written (``<!-- snippet: NAME -->`` before the block).

Each block is a complete program with a ``main()`` under ``if __name__ == "__main__":``, as a script run with
``python`` must be (its ranks re-import it). The test writes it to a file, imports it as a module (so its
functions pickle by reference) and calls ``main()`` in the test process; the ranks run on the worker pool, which
imports the module from the caller's ``sys.path`` as spawned ranks would.
"""
from __future__ import annotations

import importlib
import os
import pathlib
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent


def block(page: str, name: str) -> str:
    text = (ROOT / "docs" / page).read_text()
    marker = f"<!-- snippet: {name} -->\n```python\n"
    if marker not in text:
        raise AssertionError(f"docs/{page} has no block marked {name!r}")
    return text.split(marker, 1)[1].split("```", 1)[0]


def run(page: str, name: str, tmp_path: pathlib.Path, monkeypatch: Any) -> Any:
    """Import docs/PAGE's block NAME as a module from ``tmp_path`` (the working directory) and run its main()."""
    module = f"docs_{name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(block(page, name))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    loaded = importlib.import_module(module)
    assert os.path.dirname(loaded.__file__) == str(tmp_path)
    return loaded.main()
