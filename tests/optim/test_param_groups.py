"""Parameter groups under every strategy: the groups a factory or ``param_groups`` makes on the unsplit
model are carried onto shards and slices, shape-dependent optimizers and factories that ignore their parameters
are refused before start, and group settings changed mid-run survive a resume under another layout.

Every equivalence here runs in float64 against the same recipe on one device. Weight decay of 0.5 on the matrix
group only (or two learning rates by name) moves the weights far beyond the tolerance when a group lands on the
wrong tensors: the flat shards of ZeRO/FSDP all have ``dim() == 1``.
"""
from __future__ import annotations

import functools
import json
import os
import shutil

import docs_snippet
import pytest
import torch
from tiny_hf import logits_loss, mixtral
from torch import nn

import shardwise as sw
from shardwise import checkpoint, launch
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.optim.param_groups import GroupedFactory, ignored_params_message, named_params, needs_whole, plan_groups
from shardwise.workloads import CharText, digits, stdlib_text

pytestmark = [pytest.mark.timeout(300), pytest.mark.float64]

SEQ, BATCH, STEPS = 16, 8, 3


def gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, block_size=SEQ, n_layer=2, n_head=4, n_embd=32))


def by_dim(params, lr: float = 1e-2, decay: float = 0.5) -> torch.optim.Optimizer:
    """nanoGPT's configure_optimizers: weight decay on matrices (and embeddings), none on biases and norms."""
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": decay},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=lr)


def by_name(model: nn.Module) -> list[dict]:
    """Fine-tuning's per-module learning rates: the embeddings slower than the rest."""
    emb = [p for n, p in model.named_parameters() if "emb" in n]
    return [{"params": emb, "lr": 1e-3}, {"params": [p for n, p in model.named_parameters() if "emb" not in n]}]


RECIPES = {
    "by-dim": dict(optimizer=by_dim),
    "by-name": dict(optimizer=functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1), param_groups=by_name),
}
MODELS = {"gpt": (gpt, lm_loss), "mixtral": (mixtral, logits_loss)}
LAYOUTS = {
    "ddp": ("gpt", lambda: "ddp", 2),
    "dp": ("gpt", lambda: "dp", 2),
    "zero1": ("gpt", lambda: "zero1", 2),
    "zero2": ("gpt", lambda: "zero2", 2),
    "zero3": ("gpt", lambda: "zero3", 2),
    "fsdp": ("gpt", lambda: "fsdp", 2),
    "hsdp": ("gpt", lambda: "hsdp", 4),
    "tp": ("gpt", lambda: "tp", 2),
    "pp": ("gpt", lambda: "pp", 2),
    "cp2": ("gpt", lambda: sw.Parallel(cp=2), 2),
    "ep2-mixtral": ("mixtral", lambda: sw.Parallel(ep=2), 2),
    "dp2-tp2-zero3": ("gpt", lambda: sw.Parallel(dp=2, tp=2, zero=3), 4),
    "dp2-pp2-zero1-zbv": ("gpt", lambda: sw.Parallel(dp=2, pp=2, zero=1, schedule="zbv", microbatches=4), 4),
}


def fit(model: str, recipe: str, strategy: object, devices: int, steps: int = STEPS, **kw: object) -> sw.FitResult:
    make, loss = MODELS[model]
    how = {**RECIPES[recipe], **{k: kw.pop(k) for k in ("optimizer", "param_groups") if k in kw}}
    trainer = sw.Trainer(strategy, devices, accelerator="cpu", progress=False, **kw)
    return trainer.fit(make(), CharText(stdlib_text(20_000), SEQ), loss, batch_size=BATCH, max_steps=steps, **how)


_refs: dict[tuple[str, str], sw.FitResult] = {}


def reference(model: str, recipe: str) -> sw.FitResult:
    if (model, recipe) not in _refs:
        _refs[(model, recipe)] = fit(model, recipe, "single", 1)
    return _refs[(model, recipe)]


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_groups_train_the_single_device_model(layout, recipe, same_run):
    model, make, devices = LAYOUTS[layout]
    same_run(reference(model, recipe), fit(model, recipe, make(), devices))


def test_the_recipe_matters_at_this_tolerance(same_run):
    """The check above can fail: without the decay group the same run ends elsewhere."""
    plain = fit("gpt", "by-dim", "single", 1, optimizer=functools.partial(torch.optim.AdamW, lr=1e-2,
                                                                          weight_decay=0.0))
    with pytest.raises(AssertionError):
        same_run(reference("gpt", "by-dim"), plain)


def frozen_gpt() -> nn.Module:
    """LoRA's shape of problem: the embeddings and the first block frozen, inside the groups all the same."""
    m = gpt()
    for n, p in m.named_parameters():
        if "emb" in n or n.startswith("blocks.0."):
            p.requires_grad_(False)
    return m


class Groups(sw.Callback):
    """Fails the run unless every rank's optimizer has ``n`` groups (an empty one where it holds nothing of it)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def on_step_end(self, info) -> None:  # noqa: D102
        got = len(info.optimizer.param_groups)
        if got != self.n:
            raise AssertionError(f"rank {info.rank} has {got} parameter groups, not {self.n}")


def frozen_apart(model: nn.Module) -> list[dict]:
    """A group of frozen parameters only (the embeddings), kept as on one device."""
    emb = [p for n, p in model.named_parameters() if "emb" in n]
    return [{"params": emb, "lr": 0.0}, {"params": [p for n, p in model.named_parameters() if "emb" not in n]}]


@pytest.mark.parametrize("recipe", ["by-dim", "frozen-group"])
def test_frozen_parameters_inside_groups_train_the_single_device_model_under_zero3(recipe, same_run):
    how = dict(optimizer=by_dim) if recipe == "by-dim" else \
        dict(optimizer=functools.partial(torch.optim.AdamW, lr=1e-2), param_groups=frozen_apart)

    def run(strategy: str, devices: int) -> sw.FitResult:
        return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, callbacks=[Groups(2)]).fit(
            frozen_gpt(), CharText(stdlib_text(20_000), SEQ), lm_loss, batch_size=BATCH, max_steps=STEPS, **how)

    ref, run3 = run("single", 1), run("zero3", 2)
    same_run(ref, run3)
    assert torch.equal(ref.state_dict["tok_emb.weight"], frozen_gpt().state_dict()["tok_emb.weight"])


# ---- refused before any process starts ------------------------------------------------------------------------
class Whole(torch.optim.SGD):
    needs_whole_parameters = True  # how a user declares an optimizer of their own


def flat(strategy: str) -> str:
    if strategy == "tp":
        return "tensor-parallel slices of the parameters"
    return "flat 1-D shards of the parameters (ZeRO/FSDP)"


def square_model() -> nn.Module:
    torch.manual_seed(0)  # only 2-D parameters: Muon takes nothing else, on one device either
    return nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 4, bias=False))


def samples() -> list[tuple[torch.Tensor, int]]:
    g = torch.Generator().manual_seed(0)  # in the test's default dtype (float64 here)
    return [(torch.randn(8, generator=g), i % 4) for i in range(32)]


@pytest.mark.parametrize("optimizer", ["Adafactor", "Muon", "Whole"])
@pytest.mark.parametrize("strategy", ["zero2", "fsdp", "tp"])
def test_shape_dependent_optimizers_are_refused_where_parameters_are_split(strategy, optimizer, no_spawn):
    cls = Whole if optimizer == "Whole" else getattr(torch.optim, optimizer)
    factory = functools.partial(cls, lr=1e-2)
    with pytest.raises(ValueError) as e:
        made = sw.TP(plan={"0": "colwise", "2": "rowwise"}) if strategy == "tp" else strategy
        sw.Trainer(made, 2, accelerator="cpu", progress=False).fit(
            square_model(), samples(), nn.functional.cross_entropy, factory, batch_size=8, max_steps=2)
    assert str(e.value) == (
        f"{optimizer} computes each parameter's update from its whole shape, but strategy {strategy!r} gives the "
        f"optimizer {flat(strategy)}, so it would run other maths than one device; use a strategy that keeps "
        "parameters whole ('ddp', 'dp', 'pp', or sw.Parallel without zero and tp), or an element-wise optimizer "
        "such as AdamW (an optimizer of your own that is element-wise says so with the class attribute "
        "needs_whole_parameters = False)")


def test_which_optimizers_need_whole_parameters():
    class ElementWiseLamb(torch.optim.Adam):
        needs_whole_parameters = False

    class Lamb(torch.optim.Adam):
        pass

    assert needs_whole(torch.optim.Adafactor) and needs_whole(torch.optim.Muon) and needs_whole(Lamb)
    assert not needs_whole(torch.optim.AdamW) and not needs_whole(ElementWiseLamb)


def test_shape_dependent_optimizers_train_whole_parameters_under_ddp(same_run):
    def run(strategy: str, devices: int, cls: type) -> sw.FitResult:
        return sw.Trainer(strategy, devices, accelerator="cpu", progress=False).fit(
            square_model(), samples(), nn.functional.cross_entropy, functools.partial(cls, lr=1e-2), batch_size=8,
            max_steps=3)

    for cls in (torch.optim.Adafactor, torch.optim.Muon):
        same_run(run("single", 1, cls), run("ddp", 2, cls))


def configure(model: nn.Module, params) -> torch.optim.Optimizer:
    """The nanoGPT habit: a factory bound to the model with functools.partial, ignoring what it is given."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.mark.parametrize("strategy", ["single", "ddp", "zero2", "fsdp"])
def test_a_factory_that_ignores_its_parameters_is_refused(strategy, no_spawn):
    model = square_model()
    with pytest.raises(ValueError) as e:
        sw.Trainer(strategy, 1 if strategy == "single" else 2, accelerator="cpu", progress=False).fit(
            model, samples(), nn.functional.cross_entropy, functools.partial(configure, model), batch_size=8,
            max_steps=2)
    assert str(e.value) == ignored_params_message(torch.optim.AdamW(model.parameters()))
    assert str(e.value).startswith("the optimizer factory built AdamW over parameters it was not given: ")


def test_a_factory_that_leaves_out_trainable_parameters_is_refused(no_spawn):
    with pytest.raises(ValueError, match=r"^the optimizer factory left out 2 trainable parameter\(s\) of the 4 it "
                                         r"was given: they would never be updated; "):
        sw.Trainer("zero2", 2, accelerator="cpu", progress=False).fit(
            nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)), samples(), nn.functional.cross_entropy,
            lambda ps: torch.optim.SGD([p for p in ps if p.dim() == 2], lr=0.1), batch_size=8, max_steps=2)


def test_the_parameter_server_refuses_groups_with_different_settings(no_spawn):
    with pytest.raises(ValueError, match=r"^strategy 'ps' steps one flat range of every parameter per server, so it "
                                         r"cannot give parameter groups different settings \(2 here\); "):
        fit("gpt", "by-dim", "ps", 2)


def test_param_groups_must_name_the_models_parameters(no_spawn):
    with pytest.raises(ValueError, match=r"^param_groups\(model\) returned 'nosuch', which is not a parameter"):
        sw.Trainer("ddp", 2, accelerator="cpu", progress=False).fit(
            square_model(), samples(), nn.functional.cross_entropy, functools.partial(torch.optim.SGD, lr=0.1),
            batch_size=8, max_steps=2, param_groups=lambda m: [{"params": ["0.weight", "nosuch"]}])


# ---- a group's lr changed mid-run, killed, resumed under another layout ----------------------------------------
class SlowEmbeddings(sw.Callback):
    """Divides the embeddings' group lr by 4 after step 2 (a change no schedule replays); with ``die``, kills the
    run after step 5, whose newest checkpoint is then step 4's."""

    def __init__(self, die: bool = False) -> None:
        self.die = die

    def on_step_end(self, info) -> None:  # noqa: D102
        if info.step == 2:
            info.optimizer.param_groups[0]["lr"] /= 4
        if self.die and info.step == 5:
            raise RuntimeError("killed after step 5")


def test_a_group_lr_changed_mid_run_survives_a_resume_under_another_layout(tmp_path, same_run):
    ck = str(tmp_path / "ck")

    def run(strategy: object, devices: int, die: bool = False, **kw: object) -> sw.FitResult:
        return fit("gpt", "by-name", strategy, devices, steps=6, callbacks=[SlowEmbeddings(die)], **kw)

    ref = run("single", 1)
    with pytest.raises(launch.WorkerFailed, match="killed after step 5"):
        run("zero2", 2, die=True, checkpoint_dir=ck, checkpoint_every=2)
    step4 = checkpoint.latest_valid(ck)
    manifest = checkpoint.read_manifest(step4)
    assert manifest["format"] == checkpoint.FORMAT and manifest["step"] == 4
    assert [g["lr"] for g in manifest["param_groups"]] == [1e-3 / 4, 1e-2]
    old = str(tmp_path / "format2")
    shutil.copytree(step4, os.path.join(old, os.path.basename(step4)))
    same_run(ref, run(sw.Parallel(dp=2, pp=2, zero=1), 4, checkpoint_dir=ck))

    # A resume whose groups hold other parameters says so, before any process starts.
    with pytest.raises(ValueError, match=r"was written with other parameter groups: 2 groups of 2, 35 parameters "
                                         r"there, 2 groups of 15, 22 here; "):
        fit("gpt", "by-dim", "ddp", 2, steps=8, checkpoint_dir=ck)

    # Format 2 recorded no groups: it still resumes, with the settings this run starts with.
    manifest["format"] = 2
    del manifest["param_groups"], manifest["run"]["optimizer"]["groups"]
    with open(os.path.join(old, os.path.basename(step4), checkpoint.MANIFEST), "w") as f:
        json.dump(manifest, f)
    again = run("ddp", 2, checkpoint_dir=old)
    assert again.losses[:4] == pytest.approx(ref.losses[:4], rel=1e-12)
    assert again.losses[4:] != pytest.approx(ref.losses[4:], rel=1e-9)  # the embeddings' lr is 1e-3 again


# ---- the hand-written loop ------------------------------------------------------------------------------------
def test_the_planned_groups_are_the_factorys_on_one_device():
    """What every strategy carries is what torch builds from the recipe on the bare model."""
    factory = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    for model, made, direct in [(gpt(), by_dim, by_dim), (gpt(), factory, None)]:
        plan, _ = plan_groups(model, made, by_name if direct is None else None)
        grouped = GroupedFactory(made, plan)
        opt = grouped(model.parameters())
        grouped.finish(named_params(model.named_parameters()))
        want = direct(model.parameters()) if direct is not None else factory(by_name(model))
        assert [g["params"] for g in opt.param_groups] == [g["params"] for g in want.param_groups]
        assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == \
            [{k: v for k, v in g.items() if k != "params"} for g in want.param_groups]


LOOP_STEPS = 4


def lr_at(step: int) -> float:
    return 1.0 / (1 + step)  # nanoGPT's loop sets every group's lr each step from its own schedule


def loop(model: nn.Module, opt: torch.optim.Optimizer, batches, step_fn) -> list[float]:
    base = [g["lr"] for g in opt.param_groups]
    losses = []
    for step, (x, y) in enumerate(batches):
        for g, lr in zip(opt.param_groups, base):
            g["lr"] = lr * lr_at(step)
        losses.append(step_fn(model, x, y))
        opt.step()
        opt.zero_grad()
    return losses


def loop_batches(work) -> list:
    xs = torch.stack([work.train[i][0] for i in range(64 * LOOP_STEPS)])
    ys = torch.tensor([int(work.train[i][1]) for i in range(64 * LOOP_STEPS)])
    return list(zip(xs.split(64), ys.split(64)))


def _loop_rank(rank: int, device: torch.device, out: str) -> None:
    work = digits()
    results = {}
    for strategy in ("zero2", "pp"):
        sw.init(accelerator="cpu")
        torch.manual_seed(0)
        model, opt = sw.setup(work.make_model(), by_dim, strategy=strategy, accelerator="cpu")
        assert len(opt.param_groups) == 2  # on every rank and stage, empty where it holds nothing of a group

        def step(m, x, y):
            if strategy == "pp":
                return float(m.train_step(x, y, work.loss_fn))
            x, y = x.chunk(2)[rank], y.chunk(2)[rank]
            loss = work.loss_fn(m(x), y)
            loss.backward()
            return float(sw.all_reduce_mean(loss.detach(), m))

        losses = loop(model, opt, loop_batches(work), step)
        results[strategy] = (model.state_dict(), losses)
    if rank == 0:
        torch.save(results, out)


def test_a_loop_that_sets_each_groups_lr_equals_one_device_under_zero2_and_pp(tmp_path, same_run):
    work = digits()
    torch.manual_seed(0)
    model = work.make_model()
    opt = by_dim(model.parameters())
    def step(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = work.loss_fn(m(x), y)
        loss.backward()
        return float(loss.detach())

    ref = Ran(model.state_dict(), loop(model, opt, loop_batches(work), step))
    out = str(tmp_path / "loop.pt")
    launch.spawn(_loop_rank, 2, args=(out,))
    runs = torch.load(out, weights_only=True)
    assert list(runs) == ["zero2", "pp"]
    for state, losses in runs.values():
        same_run(ref, Ran(state, losses))


class Ran:
    def __init__(self, state_dict, losses):
        self.state_dict, self.losses = state_dict, losses


@pytest.mark.float32
def test_the_docs_snippet_runs(tmp_path, monkeypatch):
    """docs/practical.md's "Parameter groups and optimizers" program, as written (tests/docs_snippet.py)."""
    docs_snippet.run("practical.md", "param-groups", tmp_path, monkeypatch)


def test_the_parameter_server_steps_one_group_with_its_own_settings(same_run):
    """One group whose lr is not the factory's: the servers' flat ranges take the group's settings."""
    how = dict(optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
               param_groups=lambda m: [{"params": list(m.parameters()), "lr": 3e-3}])
    plain = fit("gpt", "by-dim", "single", 1, optimizer=functools.partial(torch.optim.AdamW, lr=3e-3))
    same_run(plain, fit("gpt", "by-dim", sw.ParameterServer(servers=1), 3, **how))
