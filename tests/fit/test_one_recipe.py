"""One recipe: ``fit``, ``sw.setup`` and the evaluation passes prepare a rank's model the same way.

Each of the three builds its rank's model from the same model and options through its own entry (the fit's
rank job, ``sw.setup``, an evaluation pass); what every rank then holds of every tensor must be the same, and
fit's optimizer and ``sw.setup``'s must have the same parameter groups, holding the same tensors.
"""
from __future__ import annotations

import copy
import functools
import os

import pytest
import torch

import shardwise as sw
from shardwise import launch
from shardwise.comm.topology import Topology
from shardwise.fit.infer import Inference
from shardwise.fit.job import Job
from shardwise.models import GPT, GPTConfig
from shardwise.optim.param_groups import plan_groups

pytestmark = pytest.mark.timeout(240)

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
CASES = {"ddp": "ddp", "fsdp": "fsdp", "Parallel(pp=2, tp=2)": sw.Parallel(pp=2, tp=2)}


def decay_groups(model):
    """Weight decay on matrices only: two groups, so a group put in the wrong place shows."""
    named = list(model.named_parameters())
    return [{"params": [n for n, p in named if p.dim() >= 2]},
            {"params": [n for n, p in named if p.dim() < 2], "weight_decay": 0.0}]


def held(strategy, model, optimizer, topo):
    """What this rank holds of every model tensor, by the unsplit model's names."""
    return {h.key: (h.start, h.tp, h.data.detach().clone()) for h in strategy.checkpoint_held(model, optimizer, topo)
            if h.key.startswith("model.")}


def groups(strategy, model, optimizer):
    """Each parameter group's settings and the names (in the unsplit model) of the tensors it holds."""
    names = strategy.param_names(model)
    return [({k: v for k, v in g.items() if k != "params"}, [names[id(p)] for p in g["params"]])
            for g in optimizer.param_groups]


def _three_builds(rank, device, folder):
    sw.init(accelerator="cpu")
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16))
    plan, _ = plan_groups(base, ADAMW, decay_groups)
    rows = {}
    for case, strategy in CASES.items():
        options = sw.Trainer(strategy, devices=4, accelerator="cpu").options
        topo = Topology.create(device, options.layout.dims)
        job = Job(options, copy.deepcopy(base), None, None, ADAMW, 8, 1, {}, groups=plan)
        fit = job.build(topo)
        fit_state = held(options.strategy, fit.model, fit.optimizer, topo)
        fit_groups = groups(options.strategy, fit.model, fit.optimizer)
        evaluated = Inference(options, copy.deepcopy(base), None, 8, "validate").build(topo)
        eval_state = held(options.strategy, evaluated.model, evaluated.optimizer, topo)
        topo.close()
        model, opt = sw.setup(copy.deepcopy(base), ADAMW, strategy=strategy, accelerator="cpu",
                              param_groups=decay_groups)
        loop_state = held(model.strategy, model.module, opt, model.topo)
        loop_groups = groups(model.strategy, model.module, opt)
        model.topo.close()
        assert len(fit_groups) == 2 and all(names for _, names in fit_groups), (case, fit_groups)
        rows[case] = {"fit": fit_state, "sw.setup": loop_state, "evaluation": eval_state,
                      "groups": (fit_groups, loop_groups)}
    torch.save(rows, os.path.join(folder, f"rank{rank}.pt"))


def test_fit_setup_and_evaluation_build_the_same_rank_state_and_groups(tmp_path):
    launch.spawn(_three_builds, 4, args=(str(tmp_path),))
    for rank in range(4):
        rows = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert list(rows) == list(CASES)
        for case, row in rows.items():
            fit_groups, loop_groups = row["groups"]
            assert fit_groups == loop_groups, (case, rank)
            for door in ("sw.setup", "evaluation"):
                assert list(row[door]) == list(row["fit"]), (case, rank, door)
                for key, (start, tp, data) in row["fit"].items():
                    got = row[door][key]
                    assert (got[0], got[1]) == (start, tp) and torch.equal(got[2], data), (case, rank, door, key)
