"""The package's shape: layers, no import circle, few and deliberate deferred imports, room in every folder.

Every ``import`` statement counts, wherever it is written: at the top of a
module, inside a function, under ``if TYPE_CHECKING:``. A deferred import still
says "this module needs that one"; hiding it in a function (or behind
``TYPE_CHECKING``) only hides the dependency from the reader, and a circle
drawn with deferred imports is still a circle: it works only as long as
nobody reorders the calls. So, on the graph of all the imports:

* no circle: two modules never need each other, however indirectly;
* layers: every module of the package sits in one layer of :data:`LAYERS` and
  imports only from its own layer and the ones below: the mechanisms
  (``parallel/``, ``comm/``) and the base modules (``dims``, ``layout``,
  ``step``, ``precision``, ...) know nothing of the strategies, the Trainer
  (``fit/``), checkpoints or the planner built on top of them, and
  ``strategies/`` knows nothing of ``fit/``;
* an import inside a function is kept only where it pays at start-up
  (``shardwise --help`` and ``import shardwise`` stay free of torch, an optional
  or heavy library loads when it is used): each one is listed in
  :data:`LOCAL_IMPORTS` with its reason, and there are at most
  :data:`MAX_LOCAL_IMPORTS` of them. "It dodged a circle" is not a reason: the
  circle is the thing to fix.

The dimension names ("pp", "dp", "tp", ...) are written once, in
``shardwise/dims.py``; every other module names a dimension through its
constants, so that a typo is a NameError rather than a silent miss. And one
smell alarm: a module over :data:`MAX_MODULE_LINES` lines probably holds more
than one concern (a generous bound, not a budget to cut modules by). And one for
the floor plan: a folder with more than :data:`MAX_FOLDER_MODULES` modules (the
package root: :data:`MAX_ROOT_MODULES`) has become a hall; give its parts rooms
(sub-packages by role) before a newcomer has to search it.
"""
from __future__ import annotations

import ast
import functools
import importlib.machinery
import importlib.util
import itertools
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pytest

import shardwise.dims

pytestmark = pytest.mark.timeout(60)

ROOT = "shardwise"
PKG = pathlib.Path(__file__).resolve().parents[2] / ROOT
MAX_MODULE_LINES = 600
MAX_LOCAL_IMPORTS = 80

MAX_FOLDER_MODULES = 15
MAX_ROOT_MODULES = 24

# The layers, bottom first: a module (or a package and everything under it) imports only from its own layer and
# the layers below. Every module of the package is in exactly one. The package root is the top: its lazy names
# lead to the Trainer, the strategies and the loop.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("shardwise.dims", "shardwise.layout", "shardwise.step", "shardwise.precision", "shardwise.data",
              "shardwise.models", "shardwise.moe", "shardwise.workloads", "shardwise.stats", "shardwise.console",
              "shardwise.extras", "shardwise.torch_private", "shardwise.optim", "shardwise.seeding")),
    ("communication", ("shardwise.comm",)),
    ("the step log", ("shardwise.loggers",)),  # sw.log reduces its scalars over the ranks' groups
    ("mechanisms", ("shardwise.parallel",)),
    ("plans and checkpoints", ("shardwise.plan", "shardwise.checkpoint")),
    ("strategies", ("shardwise.strategies",)),
    ("processes and weights", ("shardwise.launch", "shardwise.cluster", "shardwise.pool", "shardwise.init_from",
                                "shardwise.recipe")),
    ("fault tolerance", ("shardwise.ft",)),  # a replica's step is a strategy; the Trainer starts the replicas
    ("the two doors", ("shardwise.fit", "shardwise.loop")),
    ("commands", ("shardwise.cli", "shardwise.__main__", "shardwise.commands", "shardwise.bench", ROOT)),
)

# "<module>: <imported module>" -> why that import waits for a function to run. Every import statement inside a
# function body must be covered here; an entry nothing matches any more is stale and must go.
_NO_TORCH_FOR_HELP = "keeps `shardwise --help` free of torch: loaded when the command runs"
_ROOT_LAZY = "a name of the lazy package root (PEP 562): `import shardwise` does not import torch"
_PLOT = "matplotlib only when a plot is drawn"
_DCP = "torch.distributed.checkpoint loads only when a checkpoint is saved or loaded"
_HF = "transformers is optional: only for a Hugging Face model"
_DYNAMO = "torch._dynamo (seconds to import) loads only when compile is used"
LOCAL_IMPORTS: dict[str, str] = {
    # the package root and the torch-free command line
    "shardwise: shardwise.strategies.registry": _ROOT_LAZY,
    "shardwise.cli: torch.distributed.run": _NO_TORCH_FOR_HELP,
    "shardwise.cli: shardwise.comm.topology": _NO_TORCH_FOR_HELP,
    "shardwise.cli: shardwise.launch": _NO_TORCH_FOR_HELP,
    "shardwise.cli: shardwise.commands.verify": _NO_TORCH_FOR_HELP,
    "shardwise.cli: shardwise.workloads": _NO_TORCH_FOR_HELP,
    "shardwise.cli: shardwise.checkpoint.tools": _NO_TORCH_FOR_HELP,
    "shardwise.cli: shardwise.commands.demo": _NO_TORCH_FOR_HELP,
    "shardwise.cli: shardwise.plan.command.cli": _NO_TORCH_FOR_HELP,
    "shardwise.cli: shardwise.fit.config": _NO_TORCH_FOR_HELP,
    "shardwise.bench: shardwise.bench.pairs": _NO_TORCH_FOR_HELP,
    "shardwise.bench: rich.table": "`shardwise.bench.Table` stays importable without loading rich for --help",
    # optional or heavy libraries, loaded when used
    "shardwise.commands.plots: matplotlib": _PLOT,
    "shardwise.commands.plots: matplotlib.pyplot": _PLOT,
    "shardwise.commands.plots: matplotlib.patches": _PLOT,
    "shardwise.commands.plots: PIL.Image": _PLOT + " (Pillow, matplotlib's dependency, shrinks a saved PNG)",
    "shardwise.checkpoint.store: torch.distributed.checkpoint": _DCP,
    "shardwise.checkpoint.store: shardwise.checkpoint.pieces": _DCP + " (its planners build on it)",
    "shardwise.checkpoint.tools: transformers": _HF,
    "shardwise.fit.job: transformers.utils.output_capturing": _HF,
    "shardwise.checkpoint.background: shardwise.checkpoint.pieces": _DCP + " (a staged state holds its Pieces)",
    "shardwise.torch_private: torch._dynamo": _DYNAMO,
    "shardwise.torch_private: torch._dynamo.trace_rules": _DYNAMO,
    "shardwise.torch_private: torch._dynamo.utils": _DYNAMO,
    "shardwise.torch_private: torch._inductor.runtime.cache_dir_utils": "torch._inductor loads only when compile "
                                                                        "is used",
    "shardwise.parallel.cp.apply: transformers": _HF,
    "shardwise.parallel.cp.apply: transformers.masking_utils": _HF,
    "shardwise.parallel.cp.torch_cp: transformers.integrations.sdpa_attention": _HF,
    "shardwise.loggers.files: torch.utils.tensorboard": "tensorboard is optional: only when its logger opens",
    "shardwise.loggers.files: torch.utils.tensorboard.summary": "tensorboard is optional: only when its logger opens",
    "shardwise.loggers.trackers: mlflow.entities": "mlflow is optional: only when its logger writes (rank 0)",
    "shardwise.loggers.trackers: mlflow.tracking": "mlflow is optional: only when its logger opens (rank 0)",
    "shardwise.loggers.trackers: wandb": "wandb is optional: only when its logger opens (rank 0)",
    "shardwise.fit.progress: rich.progress": "rich.progress loads only when a progress bar is drawn",
    "shardwise.fit.prestart.checks: shardwise.plan": "the planner loads only when the memory check runs "
                                                     "(memory_check='off' skips it), through the lazy plan package "
                                                     "whose plan_run tests replace",
    "shardwise.torch_private: torch.distributed.elastic.rendezvous.dynamic_rendezvous": (
        "torchelastic's rendezvous, only for `shardwise run` (its absence is tolerated)"),
    "shardwise.parallel.dp.torch_dp: torch.distributed.optim": "torch.distributed.optim jit-scripts its "
        "functional optimizers on import (about 1 s, with deprecation warnings): only when engine='torch' runs zero1",
    "shardwise.torch_private: torch.distributed.tensor._redistribute": "DTensor (0.55 s) loads only when "
        "engine='torch' starts, the one caller, not with every user of torch_private",
    "shardwise.torch_private: torch.distributed.tensor.debug": "DTensor (0.55 s) loads only when engine='torch' "
        "starts, the one caller, not with every user of torch_private",
    "shardwise.stats: resource": "resource exists on Unix only; read only where /proc is missing (macOS)",
}


# ---- the package, parsed -------------------------------------------------------------------------
def _name_of(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


@functools.cache
def _modules() -> dict[str, tuple[pathlib.Path, ast.Module]]:
    return {_name_of(p): (p, ast.parse(p.read_text(), str(p))) for p in sorted(PKG.rglob("*.py"))}


@functools.cache
def _is_module(name: str) -> bool:
    """Whether ``name`` is a module (of the package, or an installed one), found without importing anything."""
    if name == ROOT or name.startswith(ROOT + "."):
        return name in _modules()
    top, *rest = name.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    places = list(spec.submodule_search_locations or [])
    for i, part in enumerate(rest):
        found = [str(pathlib.Path(p) / part) for p in places if (pathlib.Path(p) / part / "__init__.py").exists()]
        if not found and i == len(rest) - 1:
            return any((pathlib.Path(p) / (part + s)).exists()
                       for p in places for s in importlib.machinery.all_suffixes())
        places = found
    return bool(places) or not rest


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules an import statement of ``module`` imports: ``from a import b`` is ``a.b`` when that is a
    module, else ``a`` (``from shardwise import __version__`` is the package root)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        package = module if _modules()[module][0].name == "__init__.py" else module.rpartition(".")[0]
        parts = package.split(".")
        parts = parts[:len(parts) - node.level + 1]
        base = ".".join([*parts, base] if base else parts)
    return sorted({f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base for a in node.names})


def _is_type_checking(test: ast.expr) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


def _imports(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement of a module, with whether it is inside a function (``TYPE_CHECKING`` blocks are not)."""
    def visit(node: ast.AST, local: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, local
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from visit(child, False)
            for child in node.orelse:
                yield from visit(child, local)
            return
        inner = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            yield from visit(child, inner)
    return visit(tree, False)


@functools.cache
def _graph() -> dict[str, dict[str, list[int]]]:
    """importer -> {imported module of the package -> lines}: every import, wherever it is written."""
    graph: dict[str, dict[str, list[int]]] = {}
    for name, (_, tree) in _modules().items():
        edges = graph.setdefault(name, {})
        for node, _ in _imports(tree):
            for target in _imported(name, node):
                if target in _modules() and target != name:
                    edges.setdefault(target, []).append(node.lineno)
    return graph


def _where(importer: str, imported: str) -> str:
    path = _modules()[importer][0].relative_to(PKG.parent)
    return ", ".join(f"{path}:{line}" for line in _graph()[importer][imported])


# ---- circles -------------------------------------------------------------------------------------
def _strongly_connected(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module: each is one knot of circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(out)


def _shortest_circle(graph: dict[str, dict[str, list[int]]], start: str, within: set[str]) -> list[str]:
    """The shortest path from ``start`` back to itself through the modules ``within``."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    return [*paths[v], start]
                if w in within and w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    return [start]


def test_no_import_circle():
    graph = _graph()
    report = []
    for component in _strongly_connected(graph):
        members = set(component)
        report.append(f"{len(component)} modules import each other: {', '.join(component)}")
        for start in component:
            circle = _shortest_circle(graph, start, members)
            report.append("  " + " -> ".join(circle))
            report.extend(f"      {a} -> {b} ({_where(a, b)})" for a, b in itertools.pairwise(circle))
            members.difference_update(circle)  # one circle per module is enough to read the knot
            if not members:
                break
    assert not report, "import circles (every import counts, deferred ones too):\n" + "\n".join(report)


# ---- layers --------------------------------------------------------------------------------------
def _under(name: str, prefix: str) -> bool:
    """``name`` is ``prefix`` or inside it; the package root is only itself."""
    return name == prefix or (prefix != ROOT and name.startswith(prefix + "."))


def _layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of the longest prefix that holds ``module``."""
    found = [(len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
             if _under(module, prefix)]
    return max(found)[1] if found else None


def test_every_module_has_a_layer():
    missing = sorted(m for m in _modules() if _layer_of(m) is None)
    assert not missing, "modules in no layer (add them, or their package, to LAYERS in this file):\n" + \
        "\n".join(missing)


def test_layers():
    violations = []
    for importer, edges in sorted(_graph().items()):
        mine = _layer_of(importer)
        for imported in sorted(edges):
            theirs = _layer_of(imported)
            if mine is not None and theirs is not None and theirs > mine:
                violations.append(f"{importer} ({LAYERS[mine][0]}) -> {imported} ({LAYERS[theirs][0]}, above) "
                                  f"({_where(importer, imported)})")
    assert not violations, "imports against the layers (LAYERS in this file says which layer sits on which):\n" + \
        "\n".join(violations)


# ---- function-local imports ----------------------------------------------------------------------
def _local_imports() -> list[tuple[str, str, int]]:
    """(module, imported module, line) of every import statement inside a function body."""
    out = []
    for name, (_, tree) in _modules().items():
        for node, local in _imports(tree):
            if local:
                out += [(name, target, node.lineno) for target in _imported(name, node)]
    return out


def _local_statements() -> int:
    return sum(local for _, tree in _modules().values() for _, local in _imports(tree))


def test_function_local_imports_are_listed():
    found = _local_imports()
    keys = {f"{m}: {t}" for m, t, _ in found}
    unlisted = sorted(f"{_modules()[m][0].relative_to(PKG.parent)}:{line}: {m}: {t}"
                      for m, t, line in found if f"{m}: {t}" not in LOCAL_IMPORTS)
    stale = sorted(k for k in LOCAL_IMPORTS if k not in keys)
    problems = []
    if unlisted:
        problems.append("imports inside functions that are not in LOCAL_IMPORTS (move them to the top of the "
                        "module, or list them with the start-up reason they pay for):\n  " + "\n  ".join(unlisted))
    if stale:
        problems.append("LOCAL_IMPORTS entries that no import matches any more (remove them):\n  " +
                        "\n  ".join(stale))
    assert not problems, "\n".join(problems)
    assert all(reason.strip() and "\n" not in reason for reason in LOCAL_IMPORTS.values())
    count = _local_statements()
    assert count <= MAX_LOCAL_IMPORTS, f"{count} import statements inside functions, at most {MAX_LOCAL_IMPORTS}"


# ---- dimension names -----------------------------------------------------------------------------
def _docstrings(tree: ast.Module) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def _strategy_names(tree: ast.Module) -> set[int]:
    """Strings that name a strategy, not a dimension: the strategies "dp", "tp" and "pp" share the words.

    A strategy's name is written twice by design, in its class (``name: ClassVar[str] = "tp"``) and as
    a key of the registry's ``BUILTIN`` table; neither is a parallel dimension.
    """
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and \
                        stmt.target.id == "name" and stmt.value is not None:
                    out.add(id(stmt.value))
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "BUILTIN" \
                and isinstance(node.value, ast.Dict):
            out.update(id(k) for k in node.value.keys if k is not None)
    return out


def _dimension_strings(tree: ast.Module) -> Iterator[ast.Constant]:
    skip = _docstrings(tree) | _strategy_names(tree)
    names = set(shardwise.dims.NAMES)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names \
                and id(node) not in skip:
            yield node


def test_dimension_names_are_written_once():
    dims = _modules()["shardwise.dims"][1]
    counts = {name: 0 for name in shardwise.dims.NAMES}
    for node in _dimension_strings(dims):
        counts[node.value] += 1
    assert counts == dict.fromkeys(shardwise.dims.NAMES, 1), f"shardwise/dims.py should write each name once: {counts}"
    offenders = [f'{path.relative_to(PKG.parent)}:{node.lineno} "{node.value}"'
                 for name, (path, tree) in _modules().items() if name != "shardwise.dims"
                 for node in sorted(_dimension_strings(tree), key=lambda n: (n.lineno, n.col_offset))]
    assert not offenders, "dimension names written outside shardwise/dims.py (use its constants: " \
        "from shardwise.dims import DP, TP, ...):\n" + "\n".join(offenders)


# ---- size ------------------------------------------------------------------------------------------
def test_no_module_is_huge():
    huge = [f"{path.relative_to(PKG.parent)}: {n} lines" for path, _ in _modules().values()
            if (n := path.read_text().count("\n")) > MAX_MODULE_LINES]
    assert not huge, f"modules over {MAX_MODULE_LINES} lines (more than one concern?):\n" + "\n".join(huge)


def _folder_modules() -> dict[pathlib.Path, int]:
    """folder -> modules at its top level (``__init__`` and ``__main__`` are the folder itself, not rooms in it)."""
    counts: dict[pathlib.Path, int] = {}
    for path, _ in _modules().values():
        counts.setdefault(path.parent, 0)
        counts[path.parent] += path.stem not in ("__init__", "__main__")
    return counts


def test_every_folder_has_room():
    crowded = [f"{folder.relative_to(PKG.parent)}/: {n} modules (at most {limit})"
               for folder, n in sorted(_folder_modules().items())
               if n > (limit := MAX_ROOT_MODULES if folder == PKG else MAX_FOLDER_MODULES)]
    assert not crowded, "folders grown into halls (split them into sub-packages by role):\n" + "\n".join(crowded)


def test_every_module_imports_in_a_fresh_interpreter():
    # One interpreter per check would cost a second each; one that imports every module in turn still
    # catches a name imported from a module that no longer defines it, whichever module is imported first.
    names = sorted(n for n in _modules() if not n.endswith("__main__"))
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\n"
    done = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr[-2000:]
