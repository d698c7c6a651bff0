"""A run from a YAML file and flags (shardwise.fit.config): the same run as written in Python, under ddp and
sw.Parallel(dp=2, tp=2); flags win over the file; --print_config fed back is the same run; the configuration is
kept beside the checkpoints, logged, and compared on resume; bad keys, types and paths named with their line."""
from __future__ import annotations

import contextlib
import functools
import io
import json

import pytest
import torch
import yaml

import shardwise as sw
from shardwise.cli import main as cli_main
from shardwise.fit import config
from shardwise.models import MLP
from shardwise.workloads import RandomClasses

pytestmark = [pytest.mark.timeout(180), pytest.mark.float64]

RUN = """\
trainer:
  strategy: single
  accelerator: cpu
  seed: 3
  progress: false
model:
  class_path: shardwise.models.MLP
  init_args: {in_features: 8, width: 16, depth: 1, classes: 4}
dataset:
  class_path: shardwise.workloads.RandomClasses
  init_args: {samples: 32, classes: 4}
loss_fn: torch.nn.functional.cross_entropy
optimizer:
  class_path: torch.optim.SGD
  init_args: {lr: 0.1, momentum: 0.9}
fit:
  batch_size: 8
  max_steps: 4
"""


def written(tmp_path, text: str = RUN, name: str = "run.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def python_run() -> sw.FitResult:
    """The configured run, written in Python."""
    torch.manual_seed(3)
    model = MLP(in_features=8, width=16, depth=1, classes=4)
    trainer = sw.Trainer("single", accelerator="cpu", seed=3, progress=False)
    return trainer.fit(model, RandomClasses(samples=32, classes=4), torch.nn.functional.cross_entropy,
                       functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9), batch_size=8, max_steps=4)


def printed(args: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        config.parse([*args, "--print_config"])
    return out.getvalue()


def test_a_yaml_run_is_the_python_run_under_ddp_and_parallel_flags_win_print_config_round_trips(tmp_path, same_run):
    ref = python_run()
    # ddp by a flag over the file's "single"; checkpoints beside which the configuration is kept
    ckpt = tmp_path / "ckpt"
    args = ["--config", written(tmp_path), "--trainer.strategy", "ddp", "--trainer.devices", "2",
            f"--trainer.checkpoint_dir={ckpt}", "--trainer.logger", "csv"]
    ddp = config.build(config.parse(args))
    assert ddp.trainer.options.strategy.name == "ddp" and ddp.trainer.devices == 2
    same_run(ref, ddp.fit())
    saved = yaml.safe_load((ckpt / "config.yaml").read_text())
    assert saved["trainer"]["strategy"] == "ddp" and saved["optimizer"]["init_args"]["momentum"] == 0.9
    logged = [json.loads(p.read_text()) for p in (ckpt / "logs").rglob("hparams.json")]
    assert [h["config"] for h in logged] == [saved]  # the tracker's hyperparameters hold the whole configuration
    # a strategy object in YAML, printed resolved and fed back
    parallel = RUN.replace("strategy: single", "strategy:\n    class_path: shardwise.Parallel\n"
                                               "    init_args: {dp: 2, tp: 2}")
    resolved = printed(["--config", written(tmp_path, parallel, "parallel.yaml")])
    again = config.build(config.parse(["--config", written(tmp_path, resolved, "printed.yaml")]))
    assert again.trainer.options.sizes == {"pp": 1, "dp": 2, "tp": 2}
    assert yaml.safe_load(printed(["--config", str(tmp_path / "printed.yaml")])) == yaml.safe_load(resolved)
    same_run(ref, again.fit())


def test_flags_win_over_the_file_and_a_resume_of_other_maths_is_refused(tmp_path):
    path = written(tmp_path)
    cfg = config.parse(["--config", path, "--trainer.seed", "7", "--optimizer.init_args.lr", "0.5"])
    assert cfg.trainer.seed == 7 and cfg.optimizer.init_args.lr == 0.5 and cfg.fit.max_steps == 4
    run = config.build(cfg)
    config.keep(run.trainer, run.config)  # no checkpoint_dir: logged only
    assert run.trainer.options.config["trainer"]["seed"] == 7
    got = {}

    def script(trainer: sw.Trainer, model, report: bool = False) -> str:
        got.update(seed=trainer.options.seed, model=type(model).__name__, report=report)
        return "done"

    assert sw.configured(script, ["--config", path, "--report", "true", "--trainer.seed", "5"]) == "done"
    assert got == {"seed": 5, "model": "MLP", "report": True}
    ckpt = tmp_path / "ckpt"
    first = config.build(config.parse(["--config", path, f"--trainer.checkpoint_dir={ckpt}"]))
    config.keep(first.trainer, first.config)
    moved = config.build(config.parse(["--config", path, f"--trainer.checkpoint_dir={ckpt}",
                                       "--trainer.strategy", "ddp", "--trainer.devices", "2"]))
    config.keep(moved.trainer, moved.config)  # another strategy resumes the same maths
    other = config.build(config.parse(["--config", path, f"--trainer.checkpoint_dir={ckpt}", "--trainer.seed", "4",
                                       "--optimizer.init_args.lr", "0.2"]))
    with pytest.raises(config.ConfigError) as e:
        config.keep(other.trainer, other.config)
    assert str(e.value) == (
        f"{ckpt}/config.yaml was written by another configuration: optimizer.init_args.lr, trainer.seed changed; "
        "start in another checkpoint_dir, or pass --trainer.resume false to start afresh")


def test_bad_keys_types_and_paths_are_named_with_their_line(tmp_path, capsys):
    def error(text: str, *flags: str) -> str:
        with pytest.raises(config.ConfigError) as e:
            config.parse(["--config", written(tmp_path, text, "bad.yaml"), *flags])
        return str(e.value)

    bad = str(tmp_path / "bad.yaml")
    assert error(RUN.replace("  seed: 3", "  sed: 3")) == \
        f"{bad}:4: unknown key 'trainer.sed'; did you mean 'trainer.seed'?"
    assert error(RUN.replace("  seed: 3", "  seed: three")) == f"{bad}:4: trainer.seed: expected int, got three"
    assert error(RUN.replace("torch.optim.SGD", "torch.optim.SDG")) == (
        f"{bad}:14: optimizer.class_path: 'torch.optim.SDG' does not import "
        "(module 'torch.optim' has no attribute 'SDG')")
    assert error(RUN, "--trainer.seed", "x") == "command line: trainer.seed: expected int, got x"
    # `shardwise fit`: one line on stderr, status 2
    assert cli_main(["fit", "--config", written(tmp_path, RUN.replace("  seed: 3", "  sed: 3"), "bad.yaml")]) == 2
    assert capsys.readouterr().err == (
        f"shardwise fit: error: {bad}:4: unknown key 'trainer.sed'; did you mean 'trainer.seed'?\n")
