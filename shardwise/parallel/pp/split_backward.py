"""A stage's backward in two halves: B (input gradients, now) and W (weight gradients, later).

Zero Bubble Pipeline Parallelism (Qi, Wan, Huang and Lin, ICLR 2024,
arXiv:2401.10241) splits each stage's backward into B, the gradient with
respect to the stage's input, which the previous stage waits for, and W, the
gradient with respect to the stage's weights, which nobody waits for, so a
schedule (ZB-H1, ZBV, DualPipeV) can move W into the bubbles. This module is
that split for any stage, through autograd on the stage's saved graph:

* :func:`backward_input` walks the graph from the outputs. ``I`` is the set of
  nodes with a path to a stage input: exactly the nodes that
  ``torch.autograd.grad(outputs, inputs)`` runs. The weight region ``R`` is
  the set of the other nodes with a path to a parameter (such a node never
  reaches ``I``: if it did it would reach an input). A *boundary* node is a node
  of ``I`` with an edge into ``R`` (``AddmmBackward`` of a Linear: its input edge
  is in ``I``, its weight and bias edges in ``R``). B runs the input-only
  autograd pass and a pre-hook on every boundary node keeps the gradient that
  arrives there (for a Linear, dY).
* :meth:`WeightGrad.backward_weight` re-roots autograd at the boundary nodes
  with the kept gradients and ``inputs=`` the parameters. Autograd computes only
  the outputs of a node that lead to a requested input, so a boundary node now
  computes only its weight side (``x^T dY`` and ``sum(dY)``, not ``dY W`` again)
  and the nodes of ``R`` run once. The pass ends in the parameters'
  ``AccumulateGrad`` nodes, so ``p.grad`` accumulates and the
  ``register_post_accumulate_grad_hook`` hooks that data-parallel wrappers
  reduce in fire as in a plain backward, once per parameter.

Parameters are grouped (union-find over ``R`` and its boundary nodes), so each
parameter is reached by exactly one autograd call and its hooks fire once. One
call rooted at every boundary node would be wrong in cost: the input edge of a
deep Linear leads (through ``I``) to a shallower Linear's boundary node, so
autograd would compute the whole input-gradient chain again. Groups whose
boundary nodes lie on one level (no path through ``I`` between them: q, k and v
of an attention) share a call. This is torch.distributed.pipelining's idea
(``stage_backward_input``/``stage_backward_weight``), written so that gradients
land through ``AccumulateGrad`` (the upstream helpers assign ``p.grad``, so no
hook fires) and no parameter sits in two groups.

What it costs (FLOPs and node runs measured in tests/parallel/pp/test_split_backward.py):

* FLOPs: B + W = the plain backward for Linear, GPT and Llama blocks and CNNs
  with BatchNorm; only boundary nodes run twice, once per side. A parameter
  used at two depths of the stage is exact, but its group's boundary nodes are
  joined through ``I``: W re-runs the ``I`` nodes between them (a pre-hook on
  each boundary node puts back the kept gradient, so nothing counts twice).
* Time outside the kernels: each W call makes the engine walk the whole graph
  below its roots, so W's overhead grows with levels x graph size (a few
  hundred microseconds per call for a 16-block stage on a small CPU).
* Memory: the graph is retained from B to W, so what only B needed (GELU's
  input, attention's saved q/k/v) is freed after W, not after B.
* A tensor hook on an activation whose node is a boundary node runs again in
  W; its result is replaced by the kept gradient, its side effects are not.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightGrad", "backward_input"]

Grads = tuple[torch.Tensor | None, ...]


@dataclass
class _Group:
    """Parameters whose W shares nodes (or one autograd call's worth of such groups), and the roots W starts from."""

    boundary: list[Node] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    # Stage outputs that are themselves in R (computed from parameters alone): W roots at them directly.
    roots: list[tuple[GradientEdge, torch.Tensor]] = field(default_factory=list)


class WeightGrad:
    """What :func:`backward_input` kept for W: call :meth:`backward_weight` once."""

    def __init__(self, groups: list[_Group], kept: dict[Node, Grads]) -> None:
        self._groups: list[_Group] | None = groups
        self._kept = kept

    @property
    def done(self) -> bool:
        """Whether :meth:`backward_weight` has run (the handle then holds nothing of the graph)."""
        return self._groups is None

    def backward_weight(self) -> None:
        """Accumulate every parameter's gradient into ``p.grad``, as the plain backward would, and free the graph."""
        if self._groups is None:
            raise RuntimeError("backward_weight() was already called for this backward_input()")
        groups, kept = self._groups, self._kept
        # Dropped first: even if a call below fails, the handle no longer keeps the graph alive.
        self._groups, self._kept = None, {}
        for i, g in enumerate(groups):
            edges: list[GradientEdge] = []
            grads: list[torch.Tensor] = []
            for node in g.boundary:
                for nr, t in enumerate(kept[node]):
                    if t is not None:
                        edges.append(GradientEdge(node, nr))
                        grads.append(t)
            for edge, t in g.roots:
                edges.append(edge)
                grads.append(t)
            if not edges:
                continue  # only undefined gradients reached this group: plain backward leaves .grad alone too
            # The kept gradient is the whole gradient of a boundary node. What arrives can differ: kept + recomputed
            # if another root of a tied group reaches it through I, or kept with a tensor hook applied twice.
            handles = [node.register_prehook(lambda _, k=kept[node]: k) for node in g.boundary]
            try:
                # Only the last call may free what it ran: a node between a group's boundary nodes runs in several.
                torch.autograd.backward(edges, grads, inputs=g.params, retain_graph=i < len(groups) - 1)
            finally:
                for h in handles:
                    h.remove()
            g.boundary.clear()
            g.roots.clear()


def _tensors(x: torch.Tensor | Sequence[torch.Tensor | None] | None, n: int) -> list[torch.Tensor | None]:
    if x is None:
        return [None] * n
    return [x] if isinstance(x, torch.Tensor) else list(x)


def _parents(roots: Iterable[Node], stop: set[Node]) -> dict[Node, list[Node]]:
    """Every node reachable from ``roots`` (not past ``stop``), mapped to the nodes with an edge into it."""
    parents: dict[Node, list[Node]] = {}
    todo: deque[Node] = deque()
    for r in roots:
        if r not in parents:
            parents[r] = []
            todo.append(r)
    while todo:
        node = todo.popleft()
        if node in stop:
            continue  # the stage ends at its inputs: what produced them belongs to an earlier stage
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                todo.append(child)
            parents[child].append(node)
    return parents


def _find(link: dict[Node, Node], n: Node) -> Node:
    while link.setdefault(n, n) is not n:
        link[n] = link[link[n]]  # path halving keeps the trees flat
        n = link[n]
    return n


def backward_input(outputs: torch.Tensor | Sequence[torch.Tensor],
                   grads: torch.Tensor | Sequence[torch.Tensor | None] | None,
                   inputs: torch.Tensor | Sequence[torch.Tensor],
                   params: Iterable[torch.Tensor]) -> tuple[Grads, WeightGrad]:
    """B: the gradients of ``inputs`` now, no parameter gradient; W later, through the returned handle.

    ``grads`` are the gradients of ``outputs`` (None for a scalar loss: ones). Returns the inputs' gradients
    (None for an input the outputs do not depend on or that does not require grad) and a :class:`WeightGrad`
    whose ``backward_weight()`` then accumulates into ``p.grad`` for every ``p`` of ``params`` exactly what
    ``torch.autograd.backward(outputs, grads)`` would have. Until then the graph is kept (``retain_graph``);
    the caller may drop ``outputs``. The returned input gradients can share storage with what W keeps: do not
    change them in place before W. The graph is walked from ``outputs`` down to ``inputs``, not past them.
    """
    pairs = _output_pairs(outputs, grads)
    xs = list(_tensors(inputs, 1))
    wanted = [i for i, x in enumerate(xs) if x is not None and x.requires_grad]
    ps = list({id(p): p for p in params if p.requires_grad}.values())
    out_edges = [get_gradient_edge(o) for o, _ in pairs]
    in_nodes = {get_gradient_edge(xs[i]).node for i in wanted}  # type: ignore[arg-type]
    parents = _parents((e.node for e in out_edges), in_nodes)
    in_i = _reaching(parents, in_nodes)
    groups, boundary = _weight_groups(parents, in_i, ps, out_edges, pairs)
    calls = _calls(groups, _levels(parents, in_i, set(boundary)))
    dx, kept = _input_pass(pairs, xs, wanted, boundary)
    return dx, WeightGrad(list(calls.values()), kept)


Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # each output with its gradient


def _output_pairs(outputs: torch.Tensor | Sequence[torch.Tensor],
                  grads: torch.Tensor | Sequence[torch.Tensor | None] | None) -> Pairs:
    """Each output that has a graph, with its gradient (ones for a scalar given none), as a plain backward
    takes them: an output without a graph contributes nothing."""
    outs = [o for o in _tensors(outputs, 1) if o is not None]
    gs = _tensors(grads, len(outs))
    if len(gs) != len(outs):
        raise ValueError(f"{len(outs)} outputs but {len(gs)} output gradients")
    pairs: Pairs = []
    for o, g in zip(outs, gs):
        if not o.requires_grad:
            continue
        if g is None:
            if o.numel() != 1:
                raise RuntimeError("grad can be implicitly created only for scalar outputs")
            g = torch.ones_like(o)
        pairs.append((o, g))
    return pairs


def _reaching(parents: dict[Node, list[Node]], in_nodes: set[Node]) -> set[Node]:
    """I: the nodes with a path to an input (what the input-only pass runs)."""
    in_i: set[Node] = set()
    todo = deque(n for n in in_nodes if n in parents)
    while todo:
        for u in parents[todo.popleft()]:
            if u not in in_i:
                in_i.add(u)
                todo.append(u)
    return in_i


def _weight_groups(parents: dict[Node, list[Node]], in_i: set[Node], ps: list[torch.Tensor],
                   out_edges: list[GradientEdge], pairs: Pairs) -> tuple[dict[Node, _Group], list[Node]]:
    """R: the other nodes with a path to a parameter, and the edges into it, joined into groups (by their
    root); returns the groups and the boundary nodes (in I, feeding R), in a fixed order."""
    # A parameter's node is the AccumulateGrad leaf the walk found that holds it: asking each parameter for its
    # gradient edge instead (get_gradient_edge) builds a view of it per call, most of this function's time.
    by_id = {id(p): p for p in ps}
    p_node = {n: by_id[id(v)] for n in parents if (v := getattr(n, "variable", None)) is not None and id(v) in by_id}
    # Dicts as ordered sets, here and below: the order of W's roots is then the same from run to run.
    region: dict[Node, None] = dict.fromkeys(n for n in p_node if n in parents and n not in in_i)
    link: dict[Node, Node] = {}
    todo = deque(region)
    while todo:
        v = todo.popleft()
        for u in parents[v]:
            link[_find(link, u)] = _find(link, v)
            if u not in in_i and u not in region:
                region[u] = None
                todo.append(u)
    groups: dict[Node, _Group] = {}

    def group(n: Node) -> _Group:
        return groups.setdefault(_find(link, n), _Group())

    for n, p in p_node.items():
        if n in region:
            group(n).params.append(p)
    boundary = list(dict.fromkeys(u for v in region for u in parents[v] if u in in_i))
    for u, g in {u: group(u) for u in boundary}.items():
        g.boundary.append(u)
    for e, (_, g) in zip(out_edges, pairs):  # type: ignore[assignment]
        if e.node in region:
            group(e.node).roots.append((e, g))  # type: ignore[arg-type]
    return groups, boundary


def _levels(parents: dict[Node, list[Node]], in_i: set[Node], on_boundary: set[Node]) -> dict[Node, int]:
    """A node's level: the most boundary nodes on a path from it down to an input. A boundary node that reaches
    another through I has a higher level, so the groups whose boundary is on one level share one autograd call
    without recomputing anything (q, k and v of an attention); each call walks the graph below its roots."""
    below: dict[Node, list[Node]] = {n: [] for n in in_i}
    for c in in_i:
        for u in parents[c]:
            if u in in_i:
                below[u].append(c)
    waiting = {n: len(cs) for n, cs in below.items()}
    level: dict[Node, int] = {}
    todo = deque(n for n, k in waiting.items() if k == 0)
    while todo:
        n = todo.popleft()
        level[n] = (n in on_boundary) + max((level[c] for c in below[n]), default=0)
        for u in parents[n]:
            if u in in_i:
                waiting[u] -= 1
                if not waiting[u]:
                    todo.append(u)
    return level


def _calls(groups: dict[Node, _Group], level: dict[Node, int]) -> dict[tuple[str, int], _Group]:
    """The autograd calls of W: the groups whose boundary is on one level joined into one call."""
    calls: dict[tuple[str, int], _Group] = {}
    for i, g in enumerate(x for x in groups.values() if x.params):
        levels = {level[u] for u in g.boundary}
        c = calls.setdefault(("level", levels.pop()) if len(levels) == 1 else ("own", i), _Group())
        c.boundary += g.boundary
        c.params += g.params
        c.roots += g.roots
    return calls


def _input_pass(pairs: Pairs, xs: list[torch.Tensor | None], wanted: list[int],
                boundary: list[Node]) -> tuple[Grads, dict[Node, Grads]]:
    """B: the input-only pass; each boundary node's pre-hook keeps the gradient that arrives there. Returns the
    inputs' gradients and those kept gradients."""
    kept: dict[Node, Grads] = {}

    # One closure per node: a pre-hook is told the gradients, not which node it is on.
    def keep(node: Node) -> Callable[[Grads], None]:
        def hook(grad_outputs: Grads) -> None:
            kept[node] = tuple(grad_outputs)
        return hook

    handles = [u.register_prehook(keep(u)) for u in boundary]
    dx: list[torch.Tensor | None] = [None] * len(xs)
    try:
        if wanted and pairs:
            got = torch.autograd.grad(
                [o for o, _ in pairs],
                [xs[i] for i in wanted],  # type: ignore[arg-type]
                [g for _, g in pairs],
                retain_graph=True,
                allow_unused=True,
            )
            for i, t in zip(wanted, got):
                dx[i] = t
    finally:
        for h in handles:
            h.remove()
    missing = [n for n in boundary if n not in kept]
    if missing:
        names = sorted(n.name() for n in missing)
        raise RuntimeError(f"the input pass did not run {names}: the graph walk and the engine disagree")
    return tuple(dx), kept
