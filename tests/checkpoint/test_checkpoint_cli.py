"""`shardwise checkpoint ls` and `shardwise checkpoint export` (shardwise/checkpoint/tools.py, shardwise/cli.py).

Small runs save checkpoints under tp, pp (1F1B) and the 3-D layout
(dp2 x tp2 x pp2, ZeRO-1, 8 ranks) on the project's GPT with tied embeddings,
and under tp on a tiny Hugging Face GPT-2 (fused q|k|v split by tp). ``ls``
must list each with its layout, size and integrity; ``export`` must give back
exactly the weights the run ended with, as a plain state dict a strict
``load_state_dict`` takes, or for GPT-2 as a directory ``from_pretrained``
loads.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import once_per_run
from tiny_hf import gpt2, logits_loss
from torch import nn

import shardwise as sw
from shardwise.checkpoint import tools
from shardwise.cli import main as cli
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.strategies.parallel import Parallel
from shardwise.strategies.pp import PP
from shardwise.workloads import CharText, stdlib_text

pytestmark = pytest.mark.timeout(600)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, EVERY = 4, 2  # checkpoints at steps 2 and 4


def tied_gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32, tie_weights=True))


MODELS = {"gpt": (tied_gpt, lm_loss, functools.partial(torch.optim.AdamW, lr=1e-3)),
          "gpt2": (gpt2, logits_loss, functools.partial(torch.optim.AdamW, lr=1e-4)),
          "moe": (lambda: GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32, n_experts=4)),
                  lm_loss, functools.partial(torch.optim.AdamW, lr=1e-3))}
LAYOUTS = {  # name -> (strategy factory, devices, manifest strategy, {dp, tp, pp})
    "tp": (lambda: "tp", 2, "tp", {"dp": 1, "tp": 2, "pp": 1}),
    "pp": (lambda: PP(schedule="1f1b"), 2, "pp", {"dp": 1, "tp": 1, "pp": 2}),
    "3d": (lambda: Parallel(dp=2, tp=2, pp=2, zero=1), 8, "parallel", {"dp": 2, "tp": 2, "pp": 2}),
    "cp": (lambda: Parallel(dp=2, cp=2, zero=3), 4, "parallel", {"dp": 2, "cp": 2, "tp": 1, "pp": 1}),
    "ep": (lambda: Parallel(ep=2), 2, "parallel", {"dp": 2, "ep": 2}),
}
_runs: dict[tuple[str, str], tuple[sw.FitResult, str]] = {}


def trained(model: str, layout: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[sw.FitResult, str]:
    """(the run's result, its checkpoint directory), trained once per pytest run (whichever xdist worker asks
    first); tests copy before damaging it."""
    if (model, layout) not in _runs:
        _runs[model, layout] = once_per_run(f"checkpoint-cli-{model}-{layout}", tmp_path_factory,
                                            lambda: _train(model, layout, tmp_path_factory))
    return _runs[model, layout]


def _train(model: str, layout: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[sw.FitResult, str]:
    make, loss, opt = MODELS[model]
    strategy, devices, _, _ = LAYOUTS[layout]
    ckpt = str(tmp_path_factory.mktemp(f"{model}-{layout}"))
    with warnings.catch_warnings():  # 8 ranks on a 2-core machine: slower, meant
        warnings.filterwarnings("ignore", message=r"devices=\d+ starts \d+ processes")
        result = sw.Trainer(strategy(), devices, accelerator="cpu", progress=False, checkpoint_dir=ckpt,
                            checkpoint_every=EVERY).fit(
            make(), CharText(stdlib_text(20_000), 16), loss, opt, batch_size=8, max_steps=STEPS)
    return result, ckpt


def files_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def test_ls_lists_every_checkpoint_with_its_layout_size_and_integrity(tmp_path_factory):
    _, ckpt = trained("gpt", "tp", tmp_path_factory)
    entries = tools.listing(ckpt)
    assert [(e.step, e.complete, e.strategy, e.world_size, e.sizes, e.problem, e.ok) for e in entries] == [
        (2, True, "tp", 2, {"dp": 1, "cp": 1, "tp": 2, "pp": 1, "ep": 1}, None, True),
        (4, True, "tp", 2, {"dp": 1, "cp": 1, "tp": 2, "pp": 1, "ep": 1}, None, True)]
    assert [e.bytes for e in entries] == [files_bytes(e.path) for e in entries]
    assert tools.exit_code(entries) == 0

    # The command itself, as a user runs it.
    proc = subprocess.run([sys.executable, "-m", "shardwise", "checkpoint", "ls", ckpt], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"checkpoints in {ckpt} (oldest first)"
    assert lines[1].split() == ["STEP", "STRATEGY", "RANKS", "DP", "CP", "TP", "PP", "EP", "BYTES", "SIZE",
                                 "INTEGRITY"]
    for line, e in zip(lines[2:4], entries):
        assert line.split() == [str(e.step), "tp", "2", "1", "1", "2", "1", "1", str(e.bytes),
                                *tools.human_bytes(e.bytes).split(), "ok"]
    assert lines[4:] == ["newest checkpoint: step 4, intact"]


@pytest.mark.parametrize("layout", ["pp", "3d", "cp", "ep"])
def test_ls_names_the_layout_that_wrote_each_checkpoint(layout, tmp_path_factory, capsys):
    _, ckpt = trained("moe" if layout == "ep" else "gpt", layout, tmp_path_factory)
    _, devices, strategy, sizes = LAYOUTS[layout]
    assert cli(["checkpoint", "ls", ckpt]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:4]]
    assert [r[:8] for r in rows] == [[str(s), strategy, str(devices),
                                      *(str(sizes.get(d, 1)) for d in ("dp", "cp", "tp", "pp", "ep"))] for s in (2, 4)]
    assert [r[-1] for r in rows] == ["ok", "ok"]


def test_a_truncated_file_shows_as_corrupted_and_ls_exits_1(tmp_path, tmp_path_factory, capsys):
    _, source = trained("gpt", "tp", tmp_path_factory)
    ckpt = str(tmp_path / "ck")
    shutil.copytree(source, ckpt)
    newest = os.path.join(ckpt, "step_00000004")
    with open(os.path.join(newest, "__0_0.distcp"), "r+b") as f:
        f.truncate(10)
    # A save that died half-way leaves a .tmp directory: listed, marked incomplete, not counted.
    os.makedirs(os.path.join(ckpt, "step_00000006.tmp"))
    with open(os.path.join(ckpt, "step_00000006.tmp", "__0_0.distcp"), "wb") as f:
        f.write(b"partial")

    entries = tools.listing(ckpt)
    assert [(e.step, e.complete, e.integrity) for e in entries] == [
        (2, True, "ok"),
        (4, True, "corrupted: __0_0.distcp checksum mismatch"),
        (6, False, "incomplete: a save that did not finish (.tmp, never renamed); a resume ignores it")]
    assert entries[1].bytes == files_bytes(newest) and entries[2].bytes == len(b"partial")
    assert tools.exit_code(entries) == 1

    assert cli(["checkpoint", "ls", ckpt]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[3].split()[:7] == ["4", "tp", "2", "1", "1", "2", "1"]
    assert out[3].endswith("corrupted: __0_0.distcp checksum mismatch")
    assert out[4].split()[:9] == ["6", "?", "?", "?", "?", "?", "?", "?", str(len(b"partial"))]
    assert "incomplete" in out[4]
    assert out[5] == ("newest checkpoint step 4 is not intact (corrupted: __0_0.distcp checksum mismatch); "
                      "a resume falls back to step 2")

    # export refuses the damaged step, and from the directory takes the newest intact one.
    with pytest.raises(ValueError, match="corrupted: __0_0.distcp checksum mismatch"):
        tools.export(newest, str(tmp_path / "m.pt"))
    assert cli(["checkpoint", "export", newest, str(tmp_path / "m.pt")]) == 1
    assert "checksum mismatch" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "m.pt")
    done = tools.export(ckpt, str(tmp_path / "m.pt"))
    assert (done.step, done.source) == (2, os.path.join(ckpt, "step_00000002"))
    assert done.skipped == [(newest, "corrupted: __0_0.distcp checksum mismatch")]

    # Only an older checkpoint damaged: the newest is intact, exit 0.
    shutil.rmtree(ckpt)
    shutil.copytree(source, ckpt)
    with open(os.path.join(ckpt, "step_00000002", ".metadata"), "r+b") as f:
        f.truncate(5)
    assert cli(["checkpoint", "ls", ckpt]) == 0
    assert "corrupted: .metadata checksum mismatch" in capsys.readouterr().out


def test_a_missing_or_empty_directory_is_a_clear_error(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert cli(["checkpoint", "ls", missing]) == 2
    assert capsys.readouterr().err.strip() == f"shardwise checkpoint ls: {missing} does not exist"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a checkpoint")
    assert cli(["checkpoint", "ls", str(empty)]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err
    assert cli(["checkpoint", "export", str(empty), str(tmp_path / "m.pt")]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err
    with pytest.raises(tools.NoCheckpoint, match="does not exist"):
        tools.listing(missing)
    # Only a leftover of a crashed save: listed, but nothing is intact and nothing can be exported.
    (empty / "step_00000002.tmp").mkdir()
    assert cli(["checkpoint", "ls", str(empty)]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "no complete checkpoint: a resume starts from step 0"
    with pytest.raises(tools.NoCheckpoint, match="no complete checkpoint"):
        tools.export(str(empty), str(tmp_path / "m.pt"))


@pytest.mark.parametrize("layout", ["tp", "pp", "3d"])
def test_export_gives_the_runs_final_weights_to_a_strict_load(layout, tmp_path, tmp_path_factory, capsys):
    result, ckpt = trained("gpt", layout, tmp_path_factory)
    out = str(tmp_path / "model.pt")
    if layout == "3d":  # through the command line; the others through the function
        assert cli(["checkpoint", "export", ckpt, out]) == 0
        assert capsys.readouterr().out.startswith(f"exported step {STEPS} of {os.path.join(ckpt, 'step_00000004')}")
    else:
        done = tools.export(ckpt, out)
        assert (done.format, done.step, done.out, done.skipped) == ("pt", STEPS, out, [])
        assert done.model_class == "shardwise.models.GPT"
    sd = torch.load(out, weights_only=True)
    model = tied_gpt()
    assert set(sd) == set(model.state_dict()) == set(result.state_dict)  # head.weight, the tied alias, included
    model.load_state_dict(sd, strict=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, result.state_dict[k]), k
    assert model.head.weight is model.tok_emb.weight


def test_a_gpt2_export_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path, tmp_path_factory):
    from transformers import GPT2LMHeadModel

    result, ckpt = trained("gpt2", "tp", tmp_path_factory)
    out = str(tmp_path / "hf")
    done = tools.export(ckpt, out)
    assert (done.format, done.step) == ("hf", STEPS)
    assert done.model_class == "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel"
    loaded = GPT2LMHeadModel.from_pretrained(out).eval()
    bare = gpt2()
    bare.load_state_dict(result.state_dict, strict=True)
    bare.eval()
    x = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, bare(x).logits)
    for k, v in bare.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k

    # --format pt: the plain state dict of the same model.
    done = tools.export(ckpt, str(tmp_path / "gpt2.pt"), format="pt")
    assert done.format == "pt"
    plain = gpt2()
    plain.load_state_dict(torch.load(tmp_path / "gpt2.pt", weights_only=True), strict=True)
    assert all(torch.equal(v, result.state_dict[k]) for k, v in plain.state_dict().items())


def test_a_plain_model_is_not_exported_as_hugging_face(tmp_path, tmp_path_factory, capsys):
    _, ckpt = trained("gpt", "tp", tmp_path_factory)
    assert cli(["checkpoint", "export", ckpt, str(tmp_path / "hf"), "--format", "hf"]) == 1
    assert "not a Hugging Face model" in capsys.readouterr().err
    (tmp_path / "a_dir").mkdir()
    with pytest.raises(ValueError, match="is a directory"):
        tools.export(ckpt, str(tmp_path / "a_dir"))


def test_help_imports_nothing_heavy():
    code = ("import sys\nfrom shardwise.cli import main\n"
            "for argv in (['checkpoint', '--help'], ['checkpoint', 'ls', '--help'],\n"
            "             ['checkpoint', 'export', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in ('transformers', 'shardwise.checkpoint.tools') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--format {pt,hf}" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "[]"
