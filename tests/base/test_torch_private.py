"""The private torch APIs shardwise relies on (shardwise/torch_private.py lists them): each still exists with the
signature or shape relied on, so that a torch upgrade that moves one fails here, by name. And they stay in
that one module: no other module of the package names a private torch API (two known exceptions, listed).
"""
from __future__ import annotations

import ast
import inspect
import pathlib
import re
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardwise import torch_private as tp

pytestmark = pytest.mark.timeout(60)

PKG = pathlib.Path(__file__).resolve().parents[2] / "shardwise"


# ---- the module itself --------------------------------------------------------------------------------
def _top_level_imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else (node.module or "").split(".")[0])
    return names


@pytest.mark.parametrize(("module", "allowed"), [("torch_private.py", {"torch"}), ("extras.py", set())])
def test_leaf_modules_import_only_torch_and_the_standard_library(module, allowed):
    outside = _top_level_imports(PKG / module) - set(sys.stdlib_module_names) - {"__future__"} - allowed
    assert outside == set(), f"shardwise/{module} imports {sorted(outside)}"


# What names a private torch API: `torch._x`, `dist._x`, `nn.x._Y`, `from torch._x import` / `from torch.a._b`,
# and the two private members reached through other names (the rendezvous handler's, the profiler's results).
_PRIVATE = re.compile(r"\b(?:torch|dist|nn|F|distributed_c10d)(?:\.[A-Za-z]\w*)*\._(?!_)\w+|"
                      r"^\s*from torch(?:\.\w+)*\._(?!_)\w+|^\s*import torch(?:\.\w+)*\._(?!_)\w+|"
                      r"\b_create_tcp_store_server\b|\bkineto_results\b", re.M)
# Modules allowed to name a private torch API besides torch_private.py (none).
KNOWN: dict[str, list[str]] = {}


def _code_only(text: str) -> str:
    """``text`` with its comments and string literals (docstrings included) blanked."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    spans = [(n.lineno, n.col_offset, n.end_lineno, n.end_col_offset) for n in ast.walk(tree)
             if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    out = [list(line) for line in lines]
    for l0, c0, l1, c1 in spans:
        for ln in range(l0, (l1 or l0) + 1):
            row = out[ln - 1]
            start = c0 if ln == l0 else 0
            end = c1 if ln == l1 else len(row)
            for i in range(start, min(end, len(row))):
                if row[i] != "\n":
                    row[i] = " "
    return "".join("".join(row).split("#")[0].rstrip("\n") + "\n" for row in out)


def test_no_other_module_names_a_private_torch_api():
    found = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = f"shardwise/{path.relative_to(PKG).as_posix()}"
        if rel == "shardwise/torch_private.py":
            continue
        hits = sorted({m.group(0).strip() for m in _PRIVATE.finditer(_code_only(path.read_text()))})
        if hits and hits != KNOWN.get(rel):
            found[rel] = hits
    assert found == {}, f"private torch APIs outside shardwise/torch_private.py (route them through it): {found}"


# ---- each private API ---------------------------------------------------------------------------------
def test_the_rendezvous_store_server_can_be_replaced(monkeypatch):
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler as Handler

    original = Handler._create_tcp_store_server
    assert list(inspect.signature(original).parameters) == ["self", "master_addr", "master_port"]
    assert "self._create_tcp_store_server(" in inspect.getsource(Handler)  # the handler still calls it
    monkeypatch.setattr(Handler, "_create_tcp_store_server", original)  # put back after the test
    store = object()
    assert tp.host_rendezvous_stores(lambda: store)
    assert Handler._create_tcp_store_server(None, "0.0.0.0", 29500) is store


def test_the_default_store_of_a_process_group():
    assert inspect.signature(dist.distributed_c10d._get_default_store).parameters == {}
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        store = tp.c10d_default_store()
        assert isinstance(store, dist.Store)
        store.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        dist.destroy_process_group()


def test_the_worker_info_is_hidden_in_the_block(monkeypatch):
    from torch.utils.data._utils import worker

    info = worker.WorkerInfo(id=1, num_workers=2, seed=0, dataset=None)
    monkeypatch.setattr(worker, "_worker_info", info)  # what a DataLoader worker process has
    assert torch.utils.data.get_worker_info() is info
    with tp.as_main_process():
        assert torch.utils.data.get_worker_info() is None
    assert torch.utils.data.get_worker_info() is info


def test_a_callback_runs_when_the_backward_pass_ends():
    calls = []

    def hook(grad):
        tp.at_backward_end(lambda: calls.append("end"))
        calls.append("hook")
        return grad

    x = torch.ones(3, requires_grad=True)
    y = x * 2
    y.register_hook(hook)
    (y * x).sum().backward()
    assert calls == ["hook", "end"]


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_graph_task_tells_a_recompute(reentrant):
    seen = []

    def block(x):
        seen.append((tp.in_backward(), tp.recomputing()))
        return torch.tanh(x) * 2

    x = torch.ones(3, requires_grad=True)
    y = checkpoint(block, x, use_reentrant=reentrant)
    y.register_hook(lambda g: seen.append((tp.in_backward(), tp.recomputing())))  # a backward hook: no recompute
    y.sum().backward()
    assert seen == [(False, False), (True, False), (True, True)]  # the forward, the hook, the recompute


def test_the_profilers_memory_records():
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with prof:
        t = torch.ones(1000, dtype=torch.float32)
        del t
    records = tp.memory_records(prof)
    assert 4000 in records and -4000 in records
    assert records.index(4000) < records.index(-4000)  # in time order


OPS = {
    tp.FLASH_ATTENTION_CPU:
        "aten::_scaled_dot_product_flash_attention_for_cpu(Tensor "
        "query, Tensor key, Tensor value, float "
        "dropout_p=0., bool is_causal=False, *, Tensor? attn_mask=None, float? scale=None) -> (Tensor output, "
        "Tensor logsumexp)",
    tp.FLASH_ATTENTION_CPU_BACKWARD:
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward(Tensor "
        "grad_out, Tensor query, Tensor key, "
        "Tensor value, Tensor out, Tensor logsumexp, float dropout_p, bool is_causal, *, Tensor? attn_mask=None, "
        "float? scale=None) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)",
}


@pytest.mark.parametrize("op", list(OPS), ids=["forward", "backward"])
def test_the_cpu_flash_attention_schema(op):
    assert str(op.default._schema) == OPS[op]


def test_the_cpu_flash_attention_shapes_in_float64():
    q, k, v = (torch.randn(2, 3, 5, 4, dtype=torch.float64) for _ in range(3))
    out, lse = tp.FLASH_ATTENTION_CPU(q, k, v, 0.0, True, scale=0.5)
    assert out.shape == (2, 3, 5, 4) and lse.shape == (2, 3, 5) and out.dtype == torch.float64
    ref = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    torch.testing.assert_close(out, ref)
    grads = tp.FLASH_ATTENTION_CPU_BACKWARD(torch.ones_like(out), q, k, v, out, lse, 0.0, True, scale=0.5)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_the_batchnorm_base_class():
    for cls in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.LazyBatchNorm1d):
        assert issubclass(cls, tp.BatchNormBase)
    assert not issubclass(nn.InstanceNorm1d, tp.BatchNormBase) and not issubclass(nn.LayerNorm, tp.BatchNormBase)


# ---- relied on in place (torch_private's docstring says where) -----------------------------------------
def test_the_fused_unscale_of_the_fp16_loss_scaler():
    op = torch._amp_foreach_non_finite_check_and_unscale_
    schemas = torch._C._jit_get_schemas_for_operator("aten::_amp_foreach_non_finite_check_and_unscale_")
    assert [str(s) for s in schemas] \
        == ["aten::_amp_foreach_non_finite_check_and_unscale_(Tensor(a!)[] self, Tensor(b!) found_inf, "
            "Tensor inv_scale) -> ()"]
    grads, found = [torch.tensor([2.0, 4.0]), torch.tensor([float("inf")])], torch.zeros(1)
    op(grads, found, torch.full((1,), 0.5))
    assert grads[0].tolist() == [1.0, 2.0] and found.item() == 1.0


def test_the_checkpointable_protocol_dcp_calls():
    from torch.distributed import _checkpointable
    from torch.distributed.checkpoint import planner_helpers, utils

    for name in ("__create_write_items__", "__create_chunk_list__", "__get_tensor_shard__"):
        assert callable(getattr(_checkpointable._Checkpointable, name))
    assert '"__create_write_items__"' in inspect.getsource(planner_helpers)
    assert '"__create_chunk_list__"' in inspect.getsource(planner_helpers)
    assert '"__get_tensor_shard__"' in inspect.getsource(utils)


def test_the_module_the_worker_pool_preloads():
    import importlib.util

    from shardwise.pool import PRELOAD

    assert "torch._dynamo" in PRELOAD and importlib.util.find_spec("torch._dynamo") is not None


def test_the_compile_helpers():
    """The skip list compiled blocks leave our communication to, the compilation record, the inductor cache."""
    import torch._dynamo
    from torch._dynamo import trace_rules, utils

    assert callable(trace_rules.add) and callable(torch._dynamo.reset)
    assert {"co_name", "recompile_reason"} <= set(utils.CompilationMetrics.__dataclass_fields__)
    tp.forget_compilations(everything=False)
    assert tp.compilations() == []
    assert isinstance(tp.inductor_cache_dir(), str)


def test_the_dtensor_caches_that_hold_meshes_can_be_emptied():
    from torch.distributed.tensor import _redistribute

    assert hasattr(_redistribute._gen_transform_infos, "cache_clear")
    tp.forget_dtensor_plans()  # the debug module's two clears still exist under their names
