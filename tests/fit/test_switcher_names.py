"""The names a switcher from Lightning types: each alias and each refusal, asserted exactly.

Pre-start checks only: every test that builds a Trainer runs under ``no_spawn`` (starting a rank is a
failure), and CUDA is faked where a test needs it (``torch.device("cuda", i)`` is only a name until used).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch

import shardwise as sw
from shardwise import cli
from shardwise import precision as precision_mod
from shardwise.comm.topology import pick_device
from shardwise.extras import EXTRAS, MissingExtra, require

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VALID = "valid strategies: single, ddp, dp, ps, zero1, zero2, zero3, fsdp, hsdp, tp, pp, parallel, diloco"


def trainer(strategy="ddp", devices=2, **kw):
    return sw.Trainer(strategy, devices, progress=False, **kw)


@pytest.fixture
def gpus(monkeypatch):
    """Four fake GPUs: torch.cuda says they exist (nothing here touches one)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


# ---- strategy names ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("typed", "name"), [("DDP", "ddp"), ("Zero3", "zero3"), ("FSDP", "fsdp"), ("HSDP", "hsdp"),
                                             ("Parallel", "parallel"), ("ddp", "ddp")])
def test_a_strategy_name_in_any_case(typed, name, no_spawn):
    assert sw.resolve(typed).name == name
    assert trainer(typed, accelerator="cpu").strategy.name == name


@pytest.mark.parametrize(("typed", "near"), [
    ("zero4", "; did you mean 'zero3', 'zero2' or 'zero1'?"),
    ("hdsp", "; did you mean 'hsdp' or 'dp'?"),
    ("Zerro3", "; did you mean 'zero3', 'zero2' or 'zero1'?"),
    ("nosuch", ""),
])
def test_a_near_miss_is_told_the_nearest_names(typed, near, no_spawn):
    with pytest.raises(ValueError) as e:
        trainer(typed, accelerator="cpu")
    assert str(e.value) == f"unknown strategy {typed!r}; {VALID}{near}"


# ---- accelerator="gpu" ------------------------------------------------------------------------------
@pytest.mark.parametrize("typed", ["gpu", "GPU", "cuda", "Cuda"])
def test_gpu_is_cuda(typed, no_spawn):
    assert trainer(accelerator=typed).accelerator == "cuda"


def test_gpu_is_refused_like_cuda_where_there_is_none(no_gpu, no_spawn):
    with pytest.raises(ValueError) as e:
        trainer(accelerator="gpu").fit(torch.nn.Linear(4, 2), [(torch.zeros(4), 0)] * 8,
                                       torch.nn.functional.cross_entropy, torch.optim.SGD, batch_size=4, max_steps=1)
    assert str(e.value) == ("accelerator='cuda' but no CUDA device is available; use accelerator='cpu' "
                            "(or 'auto', which picks CUDA only when present)")


def test_each_rank_picks_its_gpu(gpus):
    assert [pick_device("gpu", r) for r in range(2)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert [pick_device("cuda:1,3", r) for r in range(2)] == [torch.device("cuda", 1), torch.device("cuda", 3)]


# ---- devices=-1 and devices=[...] -------------------------------------------------------------------
def test_devices_minus_one_is_every_gpu(gpus, no_spawn):
    t = trainer(devices=-1)
    assert (t.devices, t.device_ids, t.options.rank_accelerator) == (4, None, "auto")


def test_a_list_of_gpus_is_those_gpus(gpus, no_spawn):
    t = trainer(devices=[1, 3], accelerator="gpu")
    assert (t.devices, t.device_ids, t.options.rank_accelerator) == (2, (1, 3), "cuda:1,3")


@pytest.mark.parametrize("devices", [[0, 4], [1, 1], [-1]])
def test_a_list_of_gpus_that_are_not_there(devices, gpus, no_spawn):
    with pytest.raises(ValueError) as e:
        trainer(devices=devices)
    assert str(e.value) == (f"devices={devices!r} lists GPU indices: they must be distinct, from 0 to 3 "
                            "(this machine has 4 GPUs)")


@pytest.mark.parametrize(("devices", "accelerator", "message"), [
    (-1, "cpu", "devices=-1 means every GPU, but this run is on CPU (accelerator='cpu'): pass the number of "
                "processes, e.g. devices=2"),
    (-1, "auto", "devices=-1 means every GPU, but this run is on CPU (no CUDA device is available): pass the "
                 "number of processes, e.g. devices=2"),
    ([0, 1], "cpu", "devices=[0, 1] lists GPU indices, but this run is on CPU (accelerator='cpu'): pass the "
                    "number of processes, devices=2"),
    ([0, 1], "gpu", "devices=[0, 1] lists GPU indices, but this run is on CPU (no CUDA device is available): "
                    "pass the number of processes, devices=2"),
])
def test_gpu_devices_are_refused_on_cpu(devices, accelerator, message, no_gpu, no_spawn):
    with pytest.raises(ValueError) as e:
        trainer(devices=devices, accelerator=accelerator)
    assert str(e.value) == message


def test_other_devices_values_are_refused(no_spawn):
    with pytest.raises(ValueError) as e:
        trainer(devices=0, accelerator="cpu")
    assert str(e.value) == "devices must be a positive integer, 'auto', -1 (every GPU) or a list of GPU indices, got 0"


# ---- precision ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("typed", "name"), [(16, "16-mixed"), ("16", "16-mixed"), ("bf16", "bf16-mixed"),
                                             (32, "32"), ("32", "32"), ("32-true", "32"),
                                             ("16-mixed", "16-mixed"), ("bf16-mixed", "bf16-mixed")])
def test_precision_aliases(typed, name, no_spawn):
    assert precision_mod.check(typed) == name
    assert trainer(accelerator="cpu", precision=typed).precision == name


@pytest.mark.parametrize("typed", [64, "fp16", True])
def test_other_precisions_are_refused(typed):
    with pytest.raises(ValueError) as e:
        precision_mod.check(typed)
    valid = ", ".join(repr(p) for p in precision_mod.PRECISIONS)  # '32', 'bf16-mixed', '16-mixed', ...
    assert str(e.value) == f"precision must be one of {valid}, got {typed!r}"


# ---- the command line: one line per user error -------------------------------------------------------
def test_verify_with_an_unknown_strategy_is_one_line(no_spawn, capsys):
    assert cli.main(["verify", "--strategy", "nosuch"]) == 2
    assert capsys.readouterr().err == f"shardwise: error: unknown strategy 'nosuch'; {VALID}\n"
    assert cli.main(["verify", "--strategy", "zero4", "--devices", "4"]) == 2
    assert capsys.readouterr().err == (f"shardwise: error: unknown strategy 'zero4'; {VALID}; did you mean 'zero3', "
                                       "'zero2' or 'zero1'?\n")


def test_a_missing_model_file_is_one_line(tmp_path, no_spawn, capsys):
    missing = tmp_path / "model.py"
    assert cli.main(["verify", "--model", f"{missing}:make"]) == 2
    assert capsys.readouterr().err == f"shardwise: error: model file '{missing}' does not exist\n"
    (tmp_path / "model.py").write_text("x = 1\n")
    assert cli.main(["verify", "--model", f"{missing}:make"]) == 2
    assert capsys.readouterr().err == f"shardwise: error: {missing} has no function 'make'\n"


def _argparse_says(choices, value):
    """argparse's own words for a value outside ``choices`` (they differ between Python versions)."""
    p = argparse.ArgumentParser(exit_on_error=False)
    p.add_argument("x", choices=choices)
    with pytest.raises(argparse.ArgumentError) as e:
        p.parse_args([value])
    return str(e.value).removeprefix("argument x: ")


VERBS = ["run", "fit", "demo", "verify", "bench", "plan", "checkpoint"]


@pytest.mark.parametrize(("argv", "message"), [
    (["verify", "--devices", "two"], "argument --devices: invalid int value: 'two' (see shardwise verify --help)"),
    (["checkpoint", "export", "d", "o", "--format", "onnx"],
     f"argument --format: {_argparse_says(['pt', 'hf'], 'onnx')} (see shardwise checkpoint export --help)"),
    (["verb"], f"argument {{{','.join(VERBS)}}}: {_argparse_says(VERBS, 'verb')} (see shardwise --help)"),
])
def test_a_bad_flag_value_is_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err == f"shardwise: error: {message}\n"


@pytest.mark.parametrize("how", ["flag", "flag after the verb", "env"])
def test_the_whole_traceback_on_request(how, monkeypatch, no_spawn):
    argv = ["verify", "--strategy", "nosuch"]
    if how == "env":
        monkeypatch.setenv("SHARDWISE_TRACEBACK", "1")
    argv = ["--traceback", *argv] if how == "flag" else [*argv, "--traceback"] if how != "env" else argv
    with pytest.raises(ValueError, match="^unknown strategy 'nosuch'"):
        cli.main(argv)


def test_the_command_itself_prints_one_line_and_exits_2():
    r = subprocess.run([sys.executable, "-m", "shardwise", "verify", "--strategy", "nosuch"], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (2, "", f"shardwise: error: unknown strategy 'nosuch'; {VALID}\n")


# ---- extras: a missing optional package names the extra --------------------------------------------
@pytest.mark.parametrize(("argv", "extra", "line"), [
    (["demo"], "demo", "shardwise demo needs scikit-learn: pip install 'shardwise[demo]'"),
    (["demo", "--plot", "pics"], "plots", "shardwise demo --plot needs matplotlib: pip install 'shardwise[plots]'"),
    (["bench", "--plot", "pics"], "plots", "shardwise bench --plot needs matplotlib: pip install 'shardwise[plots]'"),
    (["verify"], "demo", "shardwise verify --model digits needs scikit-learn: pip install 'shardwise[demo]'"),
])
def test_a_verb_without_its_extra_is_one_line(argv, extra, line, monkeypatch, no_spawn, capsys):
    monkeypatch.setitem(sys.modules, EXTRAS[extra][0], None)  # importlib.util.find_spec then finds nothing
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == line + "\n"


@pytest.mark.parametrize(("feature", "extra", "line"), [
    ("the digits workload (scikit-learn's bundled digits)", "demo",
     "the digits workload (scikit-learn's bundled digits) needs scikit-learn: pip install 'shardwise[demo]'"),
    ("a Hugging Face export (--format hf)", "hf",
     "a Hugging Face export (--format hf) needs transformers: pip install 'shardwise[hf]'"),
])
def test_library_features_without_their_extra(feature, extra, line, monkeypatch):
    monkeypatch.setitem(sys.modules, EXTRAS[extra][0], None)
    with pytest.raises(MissingExtra) as e:
        require(feature, extra)
    assert str(e.value) == line
    if extra == "demo":
        from shardwise.workloads import digits
        with pytest.raises(MissingExtra) as e:
            digits()
        assert str(e.value) == line


def test_tensorboard_dir_without_tensorboard_warns_with_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # not found, as when it is not installed
    with pytest.warns(UserWarning) as w:
        trainer = sw.Trainer("single", accelerator="cpu", tensorboard_dir=tmp_path, metrics_path=tmp_path / "m.jsonl")
    assert [str(x.message) for x in w] == ["Trainer(tensorboard_dir=) needs tensorboard: pip install "
                                           "'shardwise[tensorboard]'; logging without TensorBoard"]
    assert [type(lg).__name__ for lg in trainer.loggers] == ["JSONL"]


@pytest.mark.parametrize(("make", "line"), [
    (lambda: sw.loggers.MLflow(), "sw.loggers.MLflow needs mlflow-skinny: pip install 'shardwise[mlflow]'"),
    (lambda: sw.Trainer("single", logger="wandb"), "sw.loggers.WandB needs wandb: pip install 'shardwise[wandb]'"),
    (lambda: sw.loggers.TensorBoard(), "sw.loggers.TensorBoard needs tensorboard: pip install "
                                       "'shardwise[tensorboard]'"),
])
def test_a_logger_without_its_extra_names_it(make, line, monkeypatch):
    for module in ("mlflow", "wandb", "tensorboard"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(MissingExtra) as e:
        make()
    assert str(e.value) == line


# ---- Lightning's Trainer arguments, strategy names, callbacks and modules --------------------------
@pytest.mark.parametrize(("kw", "message"), [
    ({"val_check_interval": 100}, "Trainer(val_check_interval=100) is fit(val_every=N) here: validate every N "
                                  "optimizer steps (an epoch is len(dataset) // batch_size of them)"),
    ({"check_val_every_n_epoch": 2}, "Trainer(check_val_every_n_epoch=2) is fit(val_every=N) here, in optimizer "
                                     "steps: N = 2 x (len(dataset) // batch_size)"),
    ({"default_root_dir": "runs"}, "Trainer(default_root_dir='runs') is checkpoint_dir='runs' here: checkpoints "
                                   "there, and the logs of logger='csv' (or another name) under "
                                   "<checkpoint_dir>/logs"),
    ({"min_epochs": 3}, "Trainer(min_epochs=3) has no equivalent here: a run trains until max_epochs or max_steps, "
                        "or until a callback stops it (shardwise.EarlyStopping's patience, info.stop)"),
    ({"max_time": "00:01:00:00"}, "Trainer(max_time='00:01:00:00') has no equivalent here: bound the run with "
                                  "max_steps= or max_epochs=, or stop it from a callback (info.stop) when its time "
                                  "is up"),
    ({"num_nodes": 2}, "Trainer(num_nodes=2) is the launcher's here: it starts the nodes (shardwise run --nnodes 2, "
                       "or srun), and devices='auto' (the default) takes its world size"),
    ({"num_sanity_val_steps": 2}, "Trainer(num_sanity_val_steps=2) has no equivalent here: the model, the loss and "
                                  "the validation metrics are checked on meta before any process starts, and "
                                  "fast_dev_run=True runs one step and one validation batch"),
    ({"enable_checkpointing": True}, "Trainer(enable_checkpointing=True) disagrees with checkpoint_dir=, which says "
                                     "whether and where checkpoints are written, e.g. "
                                     "Trainer(checkpoint_dir='checkpoints', checkpoint_every=100)"),
    ({"limit_test_batches": 5}, "Trainer(limit_test_batches=5) has no equivalent here: test on a part of the set, "
                                "trainer.test(model, torch.utils.data.Subset(dataset, range(n)), ...)"),
    ({"use_distributed_sampler": False}, "Trainer(use_distributed_sampler=False) has no equivalent here: each rank "
                                         "reads its part of every global batch, without a sampler; "
                                         "Trainer(shuffle=False) keeps the dataset's order"),
    ({"fast_dev_run": 5}, "fast_dev_run=5: here fast_dev_run=True runs one step and one validation batch; for 5 "
                          "steps pass fit(max_steps=5) and limit_val_batches=5"),
    ({"benchmark": True, "deterministic": True}, "benchmark=True lets cuDNN pick its fastest algorithms, which "
                                                 "deterministic=True forbids: pass one of them"),
])
def test_lightning_trainer_arguments_we_refuse_name_ours(kw, message, no_spawn):
    with pytest.raises(ValueError) as e:
        trainer(accelerator="cpu", **kw)
    assert str(e.value) == message


def test_lightning_trainer_arguments_we_take(tmp_path, no_spawn):
    t = trainer(accelerator="cpu", enable_progress_bar=False, num_nodes=1, num_sanity_val_steps=0,
                enable_checkpointing=False, max_steps=7, benchmark=False, enable_model_summary=False)
    assert (t.progress, t.max_steps, t.benchmark, t.enable_model_summary) == (False, 7, False, False)
    assert trainer(accelerator="cpu", max_steps=-1).max_steps is None  # Lightning's "no bound"
    assert trainer(accelerator="cpu", enable_checkpointing=True, checkpoint_dir=tmp_path).checkpoint_dir == \
        str(tmp_path)
    with pytest.raises(TypeError) as e:  # not Lightning's either: Python's words, with the nearest name
        trainer(accelerator="cpu", max_epoch=3)
    assert str(e.value) == "Trainer() got an unexpected keyword argument 'max_epoch'; did you mean 'max_epochs'?"


@pytest.mark.parametrize(("typed", "message"), [
    ("deepspeed_stage_2", "strategy 'deepspeed_stage_2' is Lightning's name: it is 'zero2' here"),
    ("deepspeed_stage_3", "strategy 'deepspeed_stage_3' is Lightning's name: it is 'zero3' here"),
    ("deepspeed_stage_1", "strategy 'deepspeed_stage_1' is Lightning's name: it is 'zero1' here"),
    ("ddp_spawn", "strategy 'ddp_spawn' is Lightning's name: it is 'ddp' here"),
    ("ddp_find_unused_parameters_true", "strategy 'ddp_find_unused_parameters_true' is Lightning's name: it is "
                                        "sw.DDP(find_unused_parameters=True) here"),
    ("auto", "strategy 'auto' is Lightning's choice by device count; name one here: 'ddp' for several devices, "
             "'single' for one (the default)"),
])
def test_lightning_strategy_names_are_told_ours(typed, message, no_spawn):
    with pytest.raises(ValueError) as e:
        trainer(typed, accelerator="cpu")
    assert str(e.value) == message


class LightningLike(torch.nn.Module):
    """A LightningModule as the methods tell it (Lightning is not installed here)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _lightning_class(name, module, **hooks):
    """A class that says it comes from ``module``, as Lightning's own and their subclasses do."""
    return type(name, (), {"__module__": module, **hooks})


EarlyStoppingL = _lightning_class("EarlyStopping", "lightning.pytorch.callbacks.early_stopping",
                                  on_validation_end=lambda self, trainer, pl_module: None)
MySampler = type("MySampler", (_lightning_class("Callback", "pytorch_lightning.callbacks.callback"),),
                 {"on_train_epoch_end": lambda self, trainer, pl_module: None})


class OldHooks:
    def on_train_epoch_end(self, trainer, pl_module) -> None:  # Lightning's signature, on a class of one's own
        pass


@pytest.mark.parametrize(("callback", "message"), [
    (EarlyStoppingL(), "callback EarlyStopping is a Lightning callback (lightning.pytorch.callbacks.early_stopping."
                       "EarlyStopping): its hooks take (trainer, pl_module), shardwise's take (info); use "
                       "shardwise.EarlyStopping(monitor=, patience=, mode=, min_delta=)"),
    (MySampler(), "callback MySampler is a Lightning callback (pytorch_lightning.callbacks.callback.Callback): its "
                  "hooks take (trainer, pl_module), shardwise's take (info); port it to a subclass of "
                  "shardwise.Callback"),
    (OldHooks(), "callback OldHooks.on_train_epoch_end(trainer, pl_module) cannot be called as "
                 "on_train_epoch_end(info), as shardwise calls every hook: info.model is the model, with info.step, "
                 "info.epoch, info.metrics (see shardwise.Callback)"),
])
def test_lightning_callbacks_are_named_as_such(callback, message, no_spawn):
    with pytest.raises(TypeError) as e:
        trainer(accelerator="cpu", callbacks=[callback])
    assert str(e.value) == message


def test_a_lightning_module_is_told_what_to_pass(no_spawn):
    data = [(torch.zeros(4), 0)] * 8
    with pytest.raises(TypeError) as e:
        trainer("single", 1, accelerator="cpu").fit(LightningLike(), data)
    assert str(e.value) == (
        "LightningLike is a LightningModule (it has training_step and configure_optimizers): shardwise's fit takes "
        "the pieces apart: fit(model, dataset, loss_fn=fn(output, target), optimizer=functools.partial("
        "torch.optim.AdamW, lr=...), batch_size=...), or fit(..., training_step=fn(model, batch) -> loss, "
        "optimizer=...) for a step of your own; the model's forward is used as it is (docs: migrate/lightning)")


def test_a_compiled_model_is_unwrapped_with_a_warning(no_spawn):
    model = LightningLike()  # given the pieces, a LightningModule's forward trains as any model's
    before = model.layer.weight.detach().clone()
    compiled = torch.compile(model, backend="eager")
    with pytest.warns(UserWarning) as w:
        result = trainer("single", 1, accelerator="cpu", max_steps=2).fit(  # Trainer(max_steps=): fit's default
            compiled, [(torch.ones(4), 0)] * 8, torch.nn.functional.cross_entropy, torch.optim.SGD, batch_size=4)
    assert len(result.losses) == 2
    assert [str(x.message) for x in w] == [
        "fit got a torch.compile(model) wrapper: it runs the model inside it (its _orig_mod, the same parameters), "
        "uncompiled; pass the model itself, with Trainer(compile=True) to compile each block after the strategy "
        "wraps it"]
    assert w[0].filename == __file__  # the warning points at the user's line
    assert not torch.equal(model.layer.weight, before)  # trained: the wrapper's own module


def test_the_model_summary_at_the_start(no_spawn, capsys):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
    args = (model, [(torch.zeros(8), 0)] * 16, torch.nn.functional.cross_entropy, torch.optim.Adam)
    fit = dict(batch_size=4, max_steps=1)
    shown = {}
    for progress, summary in (("lines", True), ("lines", False), (False, True)):
        with pytest.raises(no_spawn):  # printed before any process starts (the calling process is rank 0)
            sw.Trainer("fsdp", 2, accelerator="cpu", progress=progress, device_memory=10**9,
                       enable_model_summary=summary).fit(*args, **fit)
        shown[progress, summary] = capsys.readouterr().err
    assert shown["lines", True] == (
        "shardwise: model Sequential: 195 parameters (195 trainable); per rank: 97 to 98\n"  # each rank's shards
        "shardwise: planned memory per rank: fsdp on dp=2 tp=1 pp=1: 3.87 kB of 1.00 GB per device (parameters "
        "392 B, gradients 392 B, optimizer 784 B, activations 0 B, buffers 2.30 kB); activations not counted (no "
        "transformer config on the model)\n")
    assert shown["lines", False] == shown[False, True] == ""  # off, or no progress shown
