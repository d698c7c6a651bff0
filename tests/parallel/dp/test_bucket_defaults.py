"""Each bucket default is one named constant (shardwise/parallel/dp/buckets.py) that the wrappers, the
strategies and the planner read, so that ``sw.DDP()``, ``sw.Parallel()`` and the plan cannot disagree."""
from __future__ import annotations

import ast
import inspect
import pathlib
from collections.abc import Iterator

import shardwise as sw
from shardwise.parallel.dp.buckets import DDP_BUCKET_MB, ZERO_BUCKET_MB
from shardwise.parallel.dp.ddp import DDPModule
from shardwise.parallel.dp.zero_module import ZeROModule
from shardwise.plan.specs import TrainingSpec

PKG = pathlib.Path(sw.__file__).resolve().parent


def _default(fn: object, name: str) -> object:
    return inspect.signature(fn).parameters[name].default  # type: ignore[arg-type]


def test_wrappers_strategies_and_planner_read_one_constant() -> None:
    assert _default(DDPModule, "bucket_cap_mb") == sw.DDP().bucket_cap_mb == DDP_BUCKET_MB
    assert _default(ZeROModule, "bucket_cap_mb") == sw.ZeRO1().bucket_cap_mb == sw.ZeRO2().bucket_cap_mb \
        == ZERO_BUCKET_MB
    assert sw.Parallel().bucket_cap_mb is None  # None: the wrapper's own default, the constant above
    assert TrainingSpec().bucket_bytes == DDP_BUCKET_MB * 2**20


def _numbers(node: ast.AST | None) -> bool:
    """A default written as a number (``25.0``, ``25 * 2**20``) rather than read from a constant."""
    nodes = list(ast.walk(node)) if node is not None else []
    return any(isinstance(n, ast.Constant) and isinstance(n.value, (int, float)) for n in nodes) \
        and all(isinstance(n, (ast.Constant, ast.BinOp, ast.operator)) for n in nodes)


def _written_defaults(tree: ast.AST) -> Iterator[int]:
    """Lines giving something named ``bucket...`` a number: a field, an argument's default, an ``x or 25.0``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and "bucket" in node.target.id \
                and _numbers(node.value):
            yield node.lineno
        if isinstance(node, ast.arguments):
            args = [*node.posonlyargs, *node.args][-len(node.defaults):] if node.defaults else []
            pairs = [*zip(args, node.defaults), *zip(node.kwonlyargs, node.kw_defaults)]
            yield from (d.lineno for a, d in pairs if "bucket" in a.arg and _numbers(d))
        if isinstance(node, ast.BoolOp) and "bucket" in ast.unparse(node.values[0]) and _numbers(node.values[-1]):
            yield node.lineno


def test_no_module_writes_a_bucket_default_of_its_own() -> None:
    found = [f"{p.relative_to(PKG)}:{line}" for p in sorted(PKG.rglob("*.py")) if p.name != "buckets.py"
             for line in _written_defaults(ast.parse(p.read_text()))]
    assert found == []
