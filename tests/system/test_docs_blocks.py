"""Every Python block of the docs (docs/**/*.md) and the README runs as written, or says why it cannot here.

A block marked ``<!-- snippet: NAME -->`` (or ``NAME continues PREV``) is a program: each one found is a test
case below (tests/docs_snippet.py writes it to a file, imports it and runs its ``main()`` in this process; its
ranks run on the session's worker pool), so a block marked later is tested without an edit here. A block that
needs a GPU or a cluster is marked ``<!-- not run: REASON -->``; ``test_every_python_block_is_marked`` fails on a
block with neither marker and prints the counts per page.
"""
from __future__ import annotations

import docs_snippet
import pytest

pytestmark = [pytest.mark.timeout(300)]

# Marked programs that a test elsewhere runs, with checks of what they print or write.
TESTED_ELSEWHERE = {
    ("practical.md", "precision"),      # tests/fit/test_bf16_true.py
    ("practical.md", "param-groups"),   # tests/optim/test_param_groups.py
    ("loop.md", "loop"),                # tests/loop/test_loop_device.py
    ("how-to/fault-tolerance.md", "fault-tolerance"),  # tests/ft/test_ft_survive.py, with its ledger
    ("index.md", "home"),               # tests/system/test_docs_site.py (the site's pages)
    *(("getting-started/tutorial.md", n)  # tests/system/test_docs_site.py, with their steps shortened
      for n in ("first-model", "two-processes", "three-strategies", "verify", "huggingface")),
}
MARKED = [(page, name) for page in docs_snippet.pages() for name in docs_snippet.snippets(page)]


@pytest.mark.parametrize("page,name", [c for c in MARKED if c not in TESTED_ELSEWHERE],
                         ids=[f"{p}:{n}" for p, n in MARKED if (p, n) not in TESTED_ELSEWHERE])
def test_the_block_runs_as_written(page, name, tmp_path, monkeypatch):
    docs_snippet.run(page, name, tmp_path, monkeypatch)


def test_every_python_block_is_marked():
    """Each ```python block is a program (snippet) or marked not run, with its reason; the counts are printed
    (``pytest -s``) and the tested-elsewhere set names only marked blocks."""
    unmarked, counts = [], {}
    for page in docs_snippet.pages():
        blocks = docs_snippet.python_blocks(page)
        ran, skipped = len(docs_snippet.snippets(page)), len(docs_snippet.not_run(page))
        unmarked += [f"{docs_snippet.path(page).relative_to(docs_snippet.ROOT)}:{line}" for line, before, _ in blocks
                     if not (before.startswith("<!-- snippet: ") or before.startswith("<!-- not run: "))]
        if blocks:
            counts[page] = (ran, skipped)
    for page, (ran, skipped) in counts.items():
        print(f"{page}: {ran} run, {skipped} not run" + "".join(f"\n  not run: {r}"
                                                                for r in docs_snippet.not_run(page)))
    print(f"total: {sum(r for r, _ in counts.values())} run, {sum(s for _, s in counts.values())} not run")
    assert not unmarked, "Python blocks with neither <!-- snippet: NAME --> nor <!-- not run: REASON --> " \
                         "on the line before the fence: " + ", ".join(unmarked)
    assert all(case in MARKED for case in TESTED_ELSEWHERE if docs_snippet.path(case[0]).exists())
    assert ("README.md", "quickstart") in MARKED


def test_a_continued_block_is_its_predecessors_program_then_its_own(tmp_path, monkeypatch):
    """``continues PREV``: PREV's program loses its closing main guard, so running the file runs only the
    last main(); the guard of the continued block stays."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "<!-- snippet: a -->\n```python\nX = 1\n\ndef main():\n    return X\n\nif __name__ == \"__main__\":\n"
        "    main()\n```\n\ntext\n<!-- snippet: b continues a -->\n```python\ndef main():\n    return X + 1\n\n"
        "if __name__ == \"__main__\":\n    main()\n```\n")
    monkeypatch.setattr(docs_snippet, "ROOT", tmp_path)
    program = docs_snippet.block("page.md", "b")
    assert program.count("if __name__") == 1 and program.index("X = 1") < program.index("return X + 1")
    assert docs_snippet.run("page.md", "b", tmp_path, monkeypatch) == 2
