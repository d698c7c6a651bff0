"""The site's runnable pages (docs/index.md, docs/getting-started/tutorial.md) and the migration guides' scripts
(examples/migrate/), run as written with tiny sizes; the API reference names every public name.

`make docs` builds the site (its warnings are errors) and `make docs-check` looks at it in a browser; this file
runs what the pages tell a reader to run. Each program's main() takes the size of its run (steps or epochs),
so the test runs the reader's program with 2-3 steps instead of the page's hundreds.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import re
import sys

import docs_snippet
import pytest
import torch

import shardwise
from shardwise import launch
from shardwise.strategies.registry import CLASSES

pytestmark = pytest.mark.timeout(120)

ROOT = pathlib.Path(__file__).resolve().parents[2]
MIGRATE = ROOT / "examples" / "migrate"


def run_block(page: str, name: str, tmp_path, monkeypatch, **size):
    """docs/PAGE's block NAME written to a file in ``tmp_path`` (the working directory), imported by name (so
    the ranks on the worker pool import it as spawned ranks would) and its ``main(**size)`` called."""
    module = f"site_{name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(docs_snippet.block(page, name))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    loaded = importlib.import_module(module)
    assert pathlib.Path(loaded.__file__).parent == tmp_path
    try:
        return loaded.main(**size)
    finally:
        sys.modules.pop(module, None)


def test_the_home_page_program_trains_under_fsdp(tmp_path, monkeypatch):
    result = run_block("index.md", "home", tmp_path, monkeypatch, max_steps=2)
    assert len(result.losses) == 2 and len(result.stats) == 2


def test_the_tutorial_first_model_trains_on_one_process(tmp_path, monkeypatch):
    result = run_block("getting-started/tutorial.md", "first-model", tmp_path, monkeypatch, max_steps=3)
    assert len(result.losses) == 3 and len(result.stats) == 1
    assert all(torch.isfinite(torch.tensor(result.losses)))


def test_the_tutorial_two_processes(tmp_path, monkeypatch):
    result = run_block("getting-started/tutorial.md", "two-processes", tmp_path, monkeypatch, max_steps=2)
    assert len(result.stats) == 2 and result.stats[0]["comm_bytes_per_step"] > 0


def test_the_tutorial_three_strategies_print_the_single_device_losses(tmp_path, monkeypatch, capsys):
    run_block("getting-started/tutorial.md", "three-strategies", tmp_path, monkeypatch, max_steps=2)
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == {"ddp", "zero3", "tp"}
    for strategy, row in rows.items():
        assert float(row[2]) < 1e-4, f"{strategy}: largest relative loss difference {row[2]} to one process"


def test_the_tutorial_verify_program_finds_zero3_equal(tmp_path, monkeypatch):
    verdict = run_block("getting-started/tutorial.md", "verify", tmp_path, monkeypatch, steps=2)
    assert verdict.equal, verdict


def test_the_tutorial_huggingface_llama_trains_and_saves(tmp_path, monkeypatch):
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    result = run_block("getting-started/tutorial.md", "huggingface", tmp_path, monkeypatch, max_steps=2)
    assert len(result.losses) == 2
    assert (tmp_path / "tiny-llama" / "config.json").exists()


def _import_example(name: str, monkeypatch):
    monkeypatch.syspath_prepend(str(MIGRATE))
    sys.modules.pop(name, None)
    return importlib.import_module(name)


def test_the_lightning_guide_converted_script_trains(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = _import_example("lightning_converted", monkeypatch).main(max_epochs=1)
    assert len(result.losses) == 1437 // 64  # one epoch of whole global batches
    assert result.val_metrics and {"val_loss", "val_acc"} <= set(result.val_metrics[-1])
    assert (tmp_path / "ckpt" / "best").exists()


def _accelerate_rank(rank, device, out):
    correct, total = importlib.import_module("accelerate_converted").main(epochs=1)
    if rank == 0:
        pathlib.Path(out).write_text(f"{correct} {total}")


def test_the_accelerate_guide_converted_loop_trains_on_two_processes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _import_example("accelerate_converted", monkeypatch)
    launch.spawn(_accelerate_rank, 2, args=(str(tmp_path / "accuracy"),))
    correct, total = map(int, (tmp_path / "accuracy").read_text().split())
    assert total == 360 and 0 <= correct <= total  # every validation sample counted once, the short batch too
    assert (tmp_path / "model.pt").exists() and any((tmp_path / "ckpt").glob("step_*"))


@pytest.mark.parametrize("package, script", [("lightning", "lightning_original"),
                                             ("accelerate", "accelerate_original")])
def test_the_original_scripts_run_where_their_library_is_installed(package, script, tmp_path, monkeypatch):
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (not a dependency of shardwise): "
                    f"examples/migrate/{script}.py is shown, not run")
    monkeypatch.chdir(tmp_path)
    module = _import_example(script, monkeypatch)
    if package == "lightning":
        module.main(max_epochs=1)
    else:  # one process: Accelerate's launcher is what starts several
        module.main(epochs=1)


def test_the_api_reference_documents_every_public_name():
    documented = set()
    for page in (ROOT / "docs" / "api").glob("*.md"):
        documented |= set(re.findall(r"^\.\. (?:auto\w+|py:\w+):: shardwise\.(\w+)", page.read_text(), re.M))
    public = set(shardwise._PUBLIC) | set(CLASSES)
    assert public - documented == set(), "public names missing from docs/api/"
    assert documented - public == set(), "docs/api/ documents names that are not public"


def test_every_docs_page_is_in_a_table_of_contents():
    """Sphinx fails the build on a page no toctree lists; this says which page before the build does."""
    pages = {p.relative_to(ROOT / "docs").with_suffix("").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    listed = {"index"}
    for page in (ROOT / "docs").rglob("*.md"):
        for block in re.findall(r"```\{toctree\}\n(.*?)```", page.read_text(), re.S):
            for entry in block.splitlines():
                if entry.strip() and not entry.startswith(":"):
                    listed.add(os.path.normpath(page.parent.relative_to(ROOT / "docs") / entry.strip()))
    assert pages - listed == set()
