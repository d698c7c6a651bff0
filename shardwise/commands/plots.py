"""Pictures of real runs: throughput against device count, memory per rank, pipeline timelines.

Three figures, each drawn from numbers a run measured (nothing here is modelled):

* :func:`throughput_figure`: samples per second against the number of devices,
  one line per strategy, from :func:`measure_throughput` (Trainer runs; the
  rate is the global batch over the median step time of the slowest rank).
* :func:`memory_figure`: one stacked bar per rank per strategy, split into
  parameters, gradients, optimizer states (exact tensor bytes the strategy
  holds, ``FitResult.stats`` keys ``params_bytes``, ``grads_bytes``,
  ``optimizer_bytes``) and activations (``activation_bytes``: the peak bytes
  autograd held for backward during the first step, counted by saved-tensor
  hooks).
* :func:`timeline_figure`: pipeline schedules side by side, one row per stage,
  one box per forward and per backward of each micro-batch, placed at the
  times the :class:`~shardwise.parallel.pp.schedules.Recorder` saw them; the gaps
  are the bubble (GPipe, Huang et al. 2019: ``(p - 1) / (m + p - 1)`` of the step).

matplotlib runs on its Agg backend (no display needed). :func:`write_all` makes
the set of PNGs that ``shardwise demo --plot DIR`` and ``shardwise bench --plot DIR``
write.
"""
from __future__ import annotations

import argparse
import os
import pickle
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.nn import functional as F

from shardwise import launch
from shardwise.comm.topology import Topology
from shardwise.dims import PP, TP
from shardwise.fit.trainer import Trainer
from shardwise.parallel.pp.build import build_pipeline
from shardwise.parallel.pp.run import pipeline_step
from shardwise.parallel.pp.schedules import (
    SCHEDULES,
    Action,
    Recorder,
    bubble_fraction,
    default_chunks,
    shape_of,
    simulate,
)
from shardwise.workloads import load as load_workload

KINDS = (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer states"),
         ("activation", "activations"))
_COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "activation": "#c44e52",
           "F": "#8fbce6", "B": "#f2a65a", "W": "#9ccc65"}
BOX = "box"  # gid of each forward/backward box in a timeline, so tests can count them
BAR = "throughput-bar"  # gid of each bar of throughput_bars
BOX_LABEL = "box-label"  # gid of each box's "Fi"/"Bi" text in a timeline (hidden where the box is too narrow)


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend; matplotlib (about 0.3 s) loads when the first figure is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _unit(max_bytes: float) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if max_bytes >= scale:
            return float(scale), name
    return 1.0, "B"


def save(fig: Any, path: str | os.PathLike[str], dpi: int = 100, colors: int | None = None) -> str:
    """Write ``fig`` as a PNG (creating the folder) and close it; returns the path.

    ``colors`` reduces the PNG to a palette of that many colours: a picture of
    flat boxes and text needs few, and a big one (every schedule's timeline)
    then takes about a quarter of the bytes in the repository.
    """
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=dpi, format="png")
    pyplot().close(fig)
    if colors is not None:
        from PIL import Image  # matplotlib's own dependency: there whenever matplotlib is

        with Image.open(path) as im:
            small = im.convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
        small.save(path, format="png", optimize=True)
    return path


# ---- throughput ----------------------------------------------------------------------------------
def throughput_figure(records: Iterable[Mapping[str, Any]], title: str = "Throughput against device count") -> Any:
    """Samples/s against devices, one line per strategy; records have ``strategy``, ``devices``, ``samples_per_s``."""
    plt = pyplot()
    by: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        by.setdefault(str(r["strategy"]), []).append((int(r["devices"]), float(r["samples_per_s"])))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = distinct_colors(len(by))
    for (name, pts), color in zip(by.items(), colors):
        pts.sort()
        ax.plot([d for d, _ in pts], [s for _, s in pts], marker="o", label=name, color=color)
    ax.set_xticks(sorted({d for pts in by.values() for d, _ in pts}))
    ax.set_title(title)
    ax.set_xlabel("devices (processes)")
    ax.set_ylabel("samples / s (global batch / median step)")
    ax.grid(alpha=0.3)
    ax.legend(title="strategy", fontsize=8)
    fig.tight_layout()
    return fig


def distinct_colors(n: int) -> list[Any]:
    """``n`` colours no two alike (matplotlib's default cycle repeats after 10): tab10, then tab20's lighter
    halves, then evenly spaced hues."""
    import matplotlib

    base = list(matplotlib.colormaps["tab10"].colors) + list(matplotlib.colormaps["tab20"].colors[1::2])  # type: ignore[attr-defined]
    if n <= len(base):
        return base[:n]
    hsv = matplotlib.colormaps["hsv"]
    return [hsv(i / n) for i in range(n)]


def throughput_bars(records: Sequence[Mapping[str, Any]], title: str = "Throughput by strategy") -> Any:
    """One horizontal bar per run (strategy and device count), samples/s, each its own colour, the value
    printed at the bar's end; for runs at one or two device counts, where lines would be single points."""
    plt = pyplot()
    rows = list(records)
    labels = [f"{r['strategy']} ({r['devices']} dev.)" for r in rows]
    values = [float(r["samples_per_s"]) for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 0.38 * len(rows) + 1.6))
    y = list(range(len(rows)))
    bars = ax.barh(y, values, color=distinct_colors(len(rows)), height=0.7)
    for b, v in zip(bars, values):
        b.set_gid(BAR)
        ax.text(v, b.get_y() + b.get_height() / 2, f" {v:,.0f}", va="center", fontsize=8)
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()  # the first run on top, in the order the table lists them
    ax.set_xlim(0, max(values, default=1.0) * 1.18)
    ax.set_title(title)
    ax.set_xlabel("samples / s (global batch / median step after the first, slowest rank)")
    ax.set_ylabel("strategy (devices)")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def _fit(strategy: str, devices: int, workload: str, steps: int) -> Any:
    work = load_workload(workload)
    return Trainer(strategy, devices, accelerator="cpu", progress=False, memory_check="off").fit(
        work.make_model(), work.train, work.loss_fn, work.optimizer(), work.batch_size, steps), work.batch_size


def measure_throughput(strategies: Sequence[str], devices: Sequence[int], workload: str = "gpt",
                       steps: int = 8) -> list[dict[str, Any]]:
    """One Trainer run per (strategy, devices); samples/s = global batch / median step time of the slowest rank."""
    out = []
    for s in strategies:
        for n in devices:
            res, batch = _fit(s, n, workload, steps)
            step = max(st["step_time_s"] for st in res.stats)
            out.append({"strategy": s, "devices": n, "samples_per_s": batch / step, "step_time_s": step})
    return out


# ---- memory --------------------------------------------------------------------------------------
def memory_rows(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per rank of each labelled FitResult: the four byte counts the memory figure stacks."""
    rows = []
    for label, res in results.items():
        for st in res.stats:
            rows.append({"strategy": label, "rank": st["rank"],
                         **{k: int(st.get(f"{k}_bytes", 0)) for k, _ in KINDS}})
    return rows


def memory_figure(rows: Sequence[Mapping[str, Any]], title: str = "Memory per rank") -> Any:
    """Stacked bars, one per rank per strategy: parameters, gradients, optimizer states, activations."""
    plt = pyplot()
    totals = [sum(r[k] for k, _ in KINDS) for r in rows]
    scale, unit = _unit(max(totals, default=1))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(rows) + 2), 4.4))
    x = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for key, label in KINDS:
        h = [r[key] / scale for r in rows]
        ax.bar(x, h, bottom=bottom, color=_COLORS[key], label=label, width=0.7)
        bottom = [b + v for b, v in zip(bottom, h)]
    # Labels as wide as a bar slot stay horizontal; longer ones are turned so neighbours never overlap.
    wide = max((len(str(r["strategy"])) for r in rows), default=0) > 6
    ax.set_xticks(x, [f"{r['strategy']} r{r['rank']}" if wide else f"{r['strategy']}\nrank {r['rank']}"
                      for r in rows], fontsize=8, rotation=60 if wide else 0, ha="right" if wide else "center",
                  rotation_mode="anchor")
    ax.set_title(title)
    ax.set_xlabel("strategy and rank")
    ax.set_ylabel(f"bytes held ({unit})")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def measure_memory(strategies: Sequence[str], devices: int = 2, workload: str = "digits",
                   steps: int = 3) -> dict[str, Any]:
    """FitResults of short runs, keyed by strategy name (their stats feed :func:`memory_rows`)."""
    return {s: _fit(s, devices, workload, steps)[0] for s in strategies}


# ---- pipeline timeline ---------------------------------------------------------------------------
# The schedules of the table at import, in its order (kept for callers; simulated_schedules reads the table).
ALL_SCHEDULES = tuple(SCHEDULES)


def timeline_figure(runs: Mapping[str, Sequence[Any]], title: str = "Pipeline schedules",
                    stacked: bool = False) -> Any:
    """Schedules side by side; each stage a row, each forward/backward of a micro-batch a labelled box.

    ``runs`` maps a schedule name to the :class:`~shardwise.parallel.pp.schedules.Event`
    list of ONE step (all stages); times are shifted so the step starts at 0.
    ``stacked`` puts the schedules one under the other on one shared time axis
    (a step that ends earlier is visibly shorter), each with its legend on the
    right; otherwise they sit in a row, each on its own axis.
    """
    plt = pyplot()
    n, rows = len(runs), _stages(runs)
    if stacked:
        fig, axes = plt.subplots(n, 1, figsize=(15.0, n * (0.45 * rows + 0.9) + 1.0), squeeze=False, sharex=True,
                                 sharey=True)
        panels = list(axes[:, 0])
    else:
        fig, axes = plt.subplots(1, n, figsize=(6.0 * n, 0.6 * rows + 2.8), squeeze=False, sharey=True)
        panels = list(axes[0])
    span = max((e.end for ev in runs.values() for e in ev), default=1.0) - \
        min((e.start for ev in runs.values() for e in ev), default=0.0)
    ms = 1e3 if span < 10 else 1.0  # real clocks are seconds; show ms. Simulated clocks are units.
    labelled: list[tuple[Any, Any]] = []  # (box, its "Fi"/"Bi" label)
    for ax, (name, events) in zip(panels, runs.items()):
        t0 = min(e.start for e in events)
        whole = {(e.stage, e.mb, e.chunk) for e in events if e.whole}
        for e in events:
            if e.kind == "W" and (e.stage, e.mb, e.chunk) in whole:
                continue  # done inside its whole backward's box (BWi)
            left, width = (e.start - t0) * ms, (e.end - e.start) * ms
            bar = ax.barh(e.stage, width, left=left, height=0.7, color=_COLORS[e.kind], edgecolor="black",
                          linewidth=0.6)
            bar.patches[0].set_gid(BOX)
            # The action's own name: "F3.1" names the chunk (two per rank), "BW3" a whole backward.
            label = repr(Action(e.kind, e.mb, e.chunk, e.whole))
            labelled.append((bar.patches[0], ax.text(left + width / 2, e.stage, label, ha="center",
                                                     va="center", fontsize=7, gid=BOX_LABEL)))
        stages = sorted({e.stage for e in events})
        ax.set_yticks(stages, [f"stage {s}" for s in stages])
        if not ax.yaxis_inverted():  # stage 0 on top (axes are shared: invert once)
            ax.invert_yaxis()
        ax.set_title(f"{_title(name)}: bubble {bubble_fraction(list(events)):.0%}",
                     fontsize=10 if stacked else None)
        if not stacked or ax is panels[-1]:  # stacked, the axis is shared: named once, under the last
            ax.set_xlabel("time in the step (ms)" if ms != 1.0 else "time (model units)")
        ax.set_ylabel("pipeline stage (rank)" if not stacked else "stage (rank)")
        handles = _legend_handles(events, bool(whole))
        if stacked:
            # Beside its own row: which kinds a schedule has (split or not) stays next to its boxes.
            ax.legend(handles=handles, fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
            ax.tick_params(labelbottom=True)  # times under every row, not only the last: rows are read alone
        else:
            # Three entries side by side run into the next panel's: stacked then.
            ax.legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2),
                      ncol=len(handles) if len(handles) < 3 else 1, frameon=False)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title)
    # Stacked, the first row's title sits right under the figure's: keep a strip free for the latter.
    fig.tight_layout(rect=(0.0, 0.0, 1.0, 1.0 - 0.25 / fig.get_figheight()) if stacked else None)
    _hide_labels_wider_than_their_box(fig, labelled)
    return fig


def _legend_handles(events: Sequence[Any], whole: bool) -> list[Any]:
    """One schedule's legend: the kinds of box it draws (a split backward has input and weight gradients)."""
    from matplotlib.patches import Patch

    handles = [Patch(color=_COLORS["F"], label="forward of micro-batch i (Fi)"),
               Patch(color=_COLORS["B"], label="backward of micro-batch i (Bi)")]
    if any(e.kind == "W" for e in events):  # a split backward: B is the input gradient, W the weights'
        handles[1] = Patch(color=_COLORS["B"], label="input gradient of micro-batch i (Bi)")
        handles.append(Patch(color=_COLORS["W"], label="weight gradient of micro-batch i (Wi)"))
        if whole:
            handles.append(Patch(color=_COLORS["B"], label="both in one pass (BWi)"))
    return handles


def _hide_labels_wider_than_their_box(fig: Any, labelled: Sequence[tuple[Any, Any]]) -> None:
    """A box too narrow for its label (a real step's short forwards) keeps its colour but loses the label, so
    that labels never run into their neighbours' ("F1F2F3")."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for box, text in labelled:
        if text.get_window_extent(renderer).width > box.get_window_extent(renderer).width:
            text.set_visible(False)


def _title(name: str) -> str:
    """A schedule's title in the table; any other run keeps its own name."""
    return SCHEDULES[name].title if name in SCHEDULES else name


def _stages(runs: Mapping[str, Sequence[Any]]) -> int:
    return max((e.stage + 1 for ev in runs.values() for e in ev), default=1)


def count_boxes_in(ax: Any) -> int:
    """Forward/backward boxes drawn on one axes of a timeline figure."""
    return sum(1 for p in ax.patches if p.get_gid() == BOX)


def count_boxes(fig: Any) -> int:
    """Forward/backward boxes drawn in a timeline figure (all schedules)."""
    return sum(count_boxes_in(ax) for ax in fig.axes)


def _timeline_worker(rank: int, device: torch.device, schedules: list[str], m: int, width: int, batch: int,
                     path: str) -> None:
    p = torch.distributed.get_world_size()
    topo = Topology.create(device, dp=1, tp=1, pp=p)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, width, generator=g)
    out = {}
    for schedule in schedules:
        torch.manual_seed(0)
        layers = [mod for _ in range(2 * p) for mod in (torch.nn.Linear(width, width), torch.nn.ReLU())][:-1]
        # Each schedule's own chunk count and placement (the V ones: 2 chunks, rank r holds r and 2p-1-r).
        pm = build_pipeline(torch.nn.Sequential(*layers).to(device), topo, chunks=default_chunks(schedule),
                            shape=shape_of(schedule))
        rec = Recorder()
        for _step in range(3):  # the first step exchanges shapes; the last one is drawn
            topo.comm("world").barrier(name="plots.barrier")
            pipeline_step(pm, [(x, torch.zeros_like(x))], F.mse_loss, topo, schedule, m, rec)
        events = [e for e in rec.gather(topo.comm(PP)) if e.step == rec.step - 1]
        out[schedule] = events
    if rank == 0:
        with open(path, "wb") as f:
            pickle.dump(out, f)
    topo.close()


def record_pipeline(schedules: Sequence[str] = ("gpipe", "1f1b"), stages: int = 2, microbatches: int = 4,
                    width: int = 256, batch: int = 256) -> dict[str, list[Any]]:
    """Recorded events of one real pipeline step per schedule (``stages`` processes, an MLP of Linear(width))."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "events.pkl")
        launch.spawn(_timeline_worker, stages, args=(list(schedules), microbatches, width, batch, path))
        with open(path, "rb") as f:
            return pickle.load(f)  # type: ignore[no-any-return]


# ---- everything ----------------------------------------------------------------------------------
def write_all(plot_dir: str | os.PathLike[str], max_devices: int = 2, steps: int = 6, tag: str = "strategies",
              memory_results: Mapping[str, Any] | None = None,
              throughput_records: Sequence[Mapping[str, Any]] | None = None) -> list[str]:
    """Measure (unless given) and write ``throughput_<tag>.png``, ``memory_<tag>.png``, ``pipeline_timeline.png``."""
    devices = [n for n in (1, 2, 4, 8) if n <= max_devices]
    if throughput_records is None:
        throughput_records = measure_throughput(["ddp", "zero1", "zero2", "zero3", "fsdp", TP, PP], devices,
                                                "gpt", steps)
    if memory_results is None:
        memory_results = measure_memory(["ddp", "zero1", "zero2", "zero3"], 2, "digits", min(steps, 3))
    paths = [
        save(throughput_figure(throughput_records, "Throughput against device count (tiny GPT, global batch 16)"),
             os.path.join(plot_dir, f"throughput_{tag}.png")),
        save(memory_figure(memory_rows(memory_results), "Memory per rank by kind"),
             os.path.join(plot_dir, f"memory_{tag}.png")),
        save(timeline_figure(record_pipeline(), "Recorded pipeline step: 2 stages, 4 micro-batches"),
             os.path.join(plot_dir, "pipeline_timeline.png")),
    ]
    return paths


def write_demo(plot_dir: str | os.PathLike[str], finished: Mapping[str, tuple[Any, int, int]]) -> list[str]:
    """The demo's pictures from its own runs (``label -> (FitResult, devices, global batch)``), plus a timeline."""
    results = {label: r for label, (r, _, _) in finished.items()}
    return [
        save(throughput_bars(samples_per_s(finished), "shardwise demo: throughput (digits MLP, 2 CPU cores)"),
             os.path.join(plot_dir, "throughput_demo.png")),
        save(memory_figure(memory_rows(results), "shardwise demo: memory per rank by kind (digits MLP)"),
             os.path.join(plot_dir, "memory_demo.png")),
        save(timeline_figure(record_pipeline(), "Recorded pipeline step: 2 stages, 4 micro-batches"),
             os.path.join(plot_dir, "pipeline_demo.png")),
    ]


def samples_per_s(results: Mapping[str, tuple[Any, int, int]]) -> list[dict[str, Any]]:
    """Throughput records from finished runs: ``label -> (FitResult, devices, global batch)``."""
    out = []
    for label, (res, n, batch) in results.items():
        step = max(st["step_time_s"] for st in res.stats)
        out.append({"strategy": label, "devices": n, "samples_per_s": batch / step if step > 0 else 0.0})
    return out


__all__ = ["ALL_SCHEDULES", "BAR", "BOX", "BOX_LABEL", "count_boxes", "count_boxes_in", "distinct_colors",
           "measure_memory", "measure_throughput", "memory_figure", "memory_rows", "pyplot", "record_pipeline",
           "samples_per_s", "save", "simulated_schedules", "throughput_bars", "throughput_figure", "timeline_figure",
           "write_all", "write_demo"]


def main(argv: list[str] | None = None) -> int:
    """``python -m shardwise.commands.plots DIR``: the PNGs of docs/pictures.md (real runs, plus a simulated
    timeline)."""
    ap = argparse.ArgumentParser(prog="python -m shardwise.commands.plots",
                                 description="Measure and draw the PNGs of docs/pictures.md (throughput, memory, "
                                             "recorded and simulated pipeline timelines), printing every number.")
    ap.add_argument("dir", metavar="DIR", help="the folder to write the PNGs in")
    ap.add_argument("--max-devices", type=int, default=4, metavar="N",
                    help="throughput at 1, 2, 4, 8 devices up to N (default: 4)")
    ap.add_argument("--steps", type=int, default=6, metavar="N", help="steps of each measured run (default: 6)")
    a = ap.parse_args(argv)
    devices = [n for n in (1, 2, 4, 8) if n <= a.max_devices]
    records = measure_throughput(["ddp", "zero1", "zero2", "zero3", "fsdp", TP, PP], devices, "gpt", a.steps)
    for r in records:
        print(f"throughput {r['strategy']:6s} devices={r['devices']}: {r['samples_per_s']:8.1f} samples/s "
              f"(median step {1e3 * r['step_time_s']:.2f} ms)")
    memory = measure_memory(["ddp", "zero1", "zero2", "zero3"], 2, "digits", min(a.steps, 3))
    for r in memory_rows(memory):
        print(f"memory {r['strategy']:6s} rank {r['rank']}: " + ", ".join(f"{k} {r[k]:,} B" for k, _ in KINDS))
    for path in write_all(a.dir, a.max_devices, a.steps, memory_results=memory, throughput_records=records):
        print(f"wrote {path}")
    sim = {s: simulate(s, 4, 8, t_f=1.0, t_b=2.0) for s in ("gpipe", "1f1b")}
    print("wrote " + save(timeline_figure(sim, "Simulated schedules: 4 stages, 8 micro-batches, "
                                               "backward = 2 x forward"),
                          os.path.join(a.dir, "pipeline_simulated.png")))
    print("wrote " + save(simulated_schedules(), os.path.join(a.dir, "pipeline_schedules_all.png"), colors=64))
    return 0


def simulated_schedules(schedules: Sequence[str] | None = None, stages: int = 4, microbatches: int = 8) -> Any:
    """``schedules`` (None: every one of the table) one under the other on the simulator's clock and one shared
    time axis, all with the same ``stages`` and ``microbatches``: per stage F 1 and a backward of 2 (B 1 + W 1
    when split); a schedule with two chunks per rank runs each chunk in half the time, so all do the same work
    and their spans compare."""
    runs = {}
    for s in SCHEDULES if schedules is None else schedules:
        v = default_chunks(s)
        runs[s] = simulate(s, stages, microbatches, v, t_f=1.0 / v, t_b=2.0 / v)
    return timeline_figure(runs, f"Simulated, all with p = {stages} ranks and m = {microbatches} micro-batches; "
                                 "per stage F 1, backward 2 (B 1 + W 1 when split); two chunks per rank: halves",
                           stacked=True)


if __name__ == "__main__":
    raise SystemExit(main())
