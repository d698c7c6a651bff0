"""Parameter-server checkpoints: the servers write their ranges, the first worker the rest.

A server holds elements ``[lo, hi)`` of all trainable parameters concatenated
and writes them (and the same run of each optimizer state) as pieces of the
parameters they belong to; buffers and frozen parameters come whole from the
first worker (rank ``servers``). Sync runs resume exactly under any layout
(the matrix of tests/checkpoint/test_checkpoint_layouts.py, and here ps -> ps with
another number of servers); async runs restore the servers' weights,
optimizer states and the step count.
"""
from __future__ import annotations

import functools
import math
import os
import shutil
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.nn import functional as F

import shardwise as sw
from shardwise import launch
from shardwise.checkpoint import store as checkpoint
from shardwise.checkpoint.pieces import build_state
from shardwise.parallel.ps.roles import _Layout, _Server
from shardwise.strategies.ps import ParameterServer, _server_held
from shardwise.workloads import digits

pytestmark = pytest.mark.timeout(240)

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


class Net(nn.Module):
    """A small classifier with what a server does not serve: a frozen parameter and a buffer.

    1810 trainable elements: 3 servers get 604, 603, 603, so ranges cut
    ``fc1.weight`` [24, 64] inside a row. ``die_saving``: a rank that exits
    silently when a save asks for its state (``checkpoint.store.prepare``: the
    first worker is asked, for the buffers).
    """

    def __init__(self, gain: float = 1.5, shift: float = 0.25) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(64, 24)
        self.gain = nn.Parameter(torch.full((24,), gain), requires_grad=False)
        self.fc2 = nn.Linear(24, 10)
        self.register_buffer("shift", torch.full((24,), shift))
        self.die_saving: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x) * self.gain + self.shift))

    def state_dict(self, *args, **kwargs):  # type: ignore[override]
        if self.die_saving is not None and dist.is_initialized():
            # Asked for its state by a save (its state is taken before its files are written):
            if dist.get_rank() == self.die_saving and any(f.filename.endswith(os.path.join("checkpoint", "store.py"))
                                               and f.name == "prepare" for f in traceback.extract_stack()):
                os._exit(0)  # a silent death in the middle of a save
        return super().state_dict(*args, **kwargs)


TRAINABLE = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def fit(strategy, devices, steps, ckpt=None, every=None, model=None, optimizer=ADAMW, **kw) -> sw.FitResult:
    work = digits()
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, checkpoint_dir=ckpt,
                      checkpoint_every=every, **kw).fit(
        model if model is not None else Net(), work.train, F.cross_entropy, optimizer, batch_size=48,
        max_steps=steps)


def stored(path: str):
    return dcp.FileSystemReader(path).read_metadata()


def read(path: str, key: str) -> torch.Tensor:
    md = stored(path).state_dict_metadata[key]
    out = torch.empty(md.size, dtype=md.properties.dtype)
    dcp.load({key: out}, checkpoint_id=path, no_dist=True)
    return out


def ranges(numel: int, servers: int) -> list[tuple[int, int]]:
    base, extra = divmod(numel, servers)
    sizes = [base + (1 if s < extra else 0) for s in range(servers)]
    return [(sum(sizes[:s]), sum(sizes[:s + 1])) for s in range(servers)]


# ---- what a server holds ------------------------------------------------------------------
class _Comm:
    size = 4


def test_a_servers_pieces_are_live_views_that_tile_its_range():
    model, servers = Net(), 3
    layout = _Layout(model, servers)
    flat = torch.cat([p.detach().reshape(-1) for p in layout.params])
    shapes = checkpoint.model_shapes(model)
    offsets = dict(zip(layout.first_names, layout.offsets))
    assert layout.first_names == TRAINABLE
    for s, (lo, hi) in enumerate(layout.ranges):
        shard = nn.Parameter(flat[lo:hi].clone())
        opt = ADAMW([shard])
        role = _Server(_Comm(), layout, s, servers, shard, "sync", None)
        checkpoint.materialize(model, opt)
        state = opt.state[shard]
        held = _server_held(role, opt)
        covered: dict[str, list[int]] = {}
        for h in held:
            kind, _, rest = h.key.partition(".")
            name, what = (rest, "param") if kind == "model" else rest.rsplit(".", 1)
            assert name in shapes
            if h.data.dim() == 0:  # Adam's step: the whole scalar, the server's own
                assert what == "step" and h.data is state["step"]
                continue
            live = shard if what == "param" else state[what]
            assert h.data.untyped_storage().data_ptr() == live.untyped_storage().data_ptr()
            # The view sits where the range puts this run of the parameter.
            assert h.data.data_ptr() - live.data_ptr() == (offsets[name] + h.start - lo) * live.element_size()
            start = offsets[name] + h.start
            covered.setdefault(what, []).extend(range(start, start + h.data.numel()))
        assert set(covered) == {"param", "exp_avg", "exp_avg_sq"}
        for what, idx in covered.items():
            assert idx == list(range(lo, hi)), what  # in order, no gap, no overlap
        # And every piece turns into rectangles of its parameter (at most 2 * ndim - 1 per piece).
        pieces = build_state(held, shapes)
        for p in pieces.values():
            assert sum(v.numel() for _, v in p.parts) <= math.prod(p.shape)


def test_each_server_writes_exactly_its_range_and_the_first_worker_the_rest(tmp_path):
    servers, workers = 3, 2
    ckpt = str(tmp_path / "ck")
    run = fit(ParameterServer(servers=servers), servers + workers, 1, ckpt)
    path = checkpoint.checkpoints(ckpt)[-1]
    md = stored(path)
    files = {(i.fqn, tuple(i.offset)): info.relative_path for i, info in md.storage_data.items()}
    layout = _Layout(Net(), servers)
    bounds = ranges(layout.numel, servers)
    offsets = dict(zip(layout.first_names, layout.offsets))
    for what in ("model.{}", "optim.{}.exp_avg", "optim.{}.exp_avg_sq"):
        written: dict[str, list[int]] = {}
        for name in TRAINABLE:
            key = what.format(name)
            tm = md.state_dict_metadata[key]
            for c in tm.chunks:
                # The flat indices (in the parameter) of this rectangle, then in the concatenation.
                box = torch.zeros(tuple(tm.size), dtype=torch.bool)
                box[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))] = True
                flat = box.reshape(-1).nonzero().reshape(-1).tolist()
                written.setdefault(files[key, tuple(c.offsets)], []).extend(offsets[name] + i for i in flat)
        assert set(written) == {f"__{s}_0.distcp" for s in range(servers)}, what
        for s, (lo, hi) in enumerate(bounds):
            assert sorted(written[f"__{s}_0.distcp"]) == list(range(lo, hi)), (what, s)
    for key in ("model.gain", "model.shift"):  # whole, from the first worker only
        tm = md.state_dict_metadata[key]
        assert [(tuple(c.offsets), tuple(c.sizes), files[key, tuple(c.offsets)]) for c in tm.chunks] == \
            [((0,), (24,), f"__{servers}_0.distcp")]
    assert not any(k.startswith("optim.gain") for k in md.state_dict_metadata)
    # Byte for byte what the servers hold (the run's final weights are theirs, sent after the save).
    for name in TRAINABLE + ["gain", "shift"]:
        assert torch.equal(read(path, f"model.{name}"), run.state_dict[name]), name
        if name in TRAINABLE:
            assert int(read(path, f"optim.{name}.step")) == 1


@pytest.mark.float64
def test_sync_resume_under_another_number_of_servers_equals_one_run(tmp_path, same_run):
    ckpt = str(tmp_path / "ck")
    ref = fit("single", 1, 4)
    part = fit(ParameterServer(servers=2), 4, 2, ckpt, every=2)
    same_run(fit("single", 1, 2), part)
    resumed = fit(ParameterServer(servers=3), 5, 4, ckpt, every=2)
    same_run(ref, resumed)
    assert [os.path.basename(p) for p in checkpoint.checkpoints(ckpt)] == ["step_00000002", "step_00000004"]


# ---- asynchronous --------------------------------------------------------------------------
def test_async_save_and_resume_restore_weights_states_and_the_step(tmp_path):
    workers = 2
    ps = functools.partial(ParameterServer, servers=2, mode="async", max_staleness=1)
    ckpt = str(tmp_path / "ck")
    first = fit(ps(), 2 + workers, 4, ckpt, every=2)
    assert len(first.losses) == 4 and all(math.isfinite(v) for v in first.losses)
    saved = checkpoint.checkpoints(ckpt)
    assert [os.path.basename(p) for p in saved] == ["step_00000002", "step_00000004"]
    assert checkpoint.read_manifest(saved[-1])["step"] == 4
    for name in TRAINABLE:
        # The servers' weights at the save (the run ends on them), and one Adam step per applied push.
        assert torch.equal(read(saved[-1], f"model.{name}"), first.state_dict[name])
        assert int(read(saved[-1], f"optim.{name}.step")) == workers * 4
        assert int(read(saved[0], f"optim.{name}.step")) == workers * 2

    # Resumed to 6 with lr=0: the weights stay those restored, the optimizer counts on from 8.
    # The model is built with other values of the frozen parameter and the buffer: both come back.
    with pytest.warns(UserWarning, match="other optimizer settings"):
        still = fit(ps(), 2 + workers, 6, ckpt, every=2, model=Net(gain=3.0, shift=-1.0),
                    optimizer=functools.partial(torch.optim.AdamW, lr=0.0), resume="must")
    assert len(still.losses) == 6 and still.losses[:4] == first.losses
    assert all(math.isfinite(v) for v in still.losses)
    for name in TRAINABLE + ["gain", "shift"]:
        assert torch.equal(still.state_dict[name], first.state_dict[name]), name
    last = checkpoint.checkpoints(ckpt)[-1]
    assert checkpoint.read_manifest(last)["step"] == 6
    assert int(read(last, "optim.fc1.weight.step")) == workers * 6
    # What is not restored: the staleness record covers this process's updates only.
    assert len(still.stats[0]["staleness"]) == workers * 2 and max(still.stats[0]["staleness"]) <= 1

    # And resumed with learning: finite losses, the steps after 6 counted on.
    with pytest.warns(UserWarning, match="other optimizer settings"):
        more = fit(ps(), 2 + workers, 8, ckpt, every=2, resume="must")
    assert more.losses[:6] == still.losses and all(math.isfinite(v) for v in more.losses)
    assert int(read(checkpoint.checkpoints(ckpt)[-1], "optim.fc1.weight.step")) == workers * 8


def test_an_async_checkpoint_resumes_under_sync_and_another_layout(tmp_path):
    ckpt = str(tmp_path / "ck")
    first = fit(ParameterServer(mode="async"), 3, 2, ckpt)
    for target, devices in ((ParameterServer(servers=2), 4), ("ddp", 2)):
        d = str(tmp_path / f"to-{devices}")
        shutil.copytree(checkpoint.checkpoints(ckpt)[-1], os.path.join(d, "step_00000002"))
        with pytest.warns(UserWarning, match="other optimizer settings"):
            run = fit(target, devices, 3, d, optimizer=functools.partial(torch.optim.AdamW, lr=0.0), resume="must")
        assert run.losses[:2] == first.losses
        for name in TRAINABLE + ["gain", "shift"]:
            assert torch.equal(run.state_dict[name], first.state_dict[name]), (target, name)


# ---- failures ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_worker_dying_during_a_save_fails_the_run_without_a_hang(tmp_path, mode):
    ckpt = str(tmp_path / "ck")
    model = Net()
    model.die_saving = 1  # rank 1, the first worker, writes the buffers
    start = time.monotonic()
    # The peers fail in the save's collective (gloo: "Connection reset by peer"), not at the timeout.
    with pytest.raises(launch.WorkerFailed, match=r"checkpoint/store\.py\", line \d+, in \w+"):
        fit(ParameterServer(mode=mode), 3, 4, ckpt, every=2, model=model, timeout_s=8)
    assert time.monotonic() - start < 90
    assert checkpoint.checkpoints(ckpt) == []  # the interrupted save never became a checkpoint
