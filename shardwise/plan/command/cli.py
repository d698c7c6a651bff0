"""``shardwise plan``: every layout of a model on a cluster, as a table or as JSON.

The lead CLI registers this module's :func:`add_arguments` on its ``plan``
sub-parser and calls :func:`run`; ``python -m shardwise.plan`` does the same alone.
"""
from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from shardwise.console import make_console

# Re-exported: tests and the lead CLI take the flags from here too.
from shardwise.plan.command.args import (  # noqa: F401
    add_arguments,
    parse_bytes,
    parse_count,
    parse_flops,
    parse_rate,
    parse_seconds,
    parse_shape,
)
from shardwise.plan.estimate import DiLoCoEstimate, Estimate, estimate_diloco, plan, recommend
from shardwise.plan.fit import fmt_bytes
from shardwise.plan.memory import no_stored_scores
from shardwise.plan.model import ModelSpec, known_model, short_count
from shardwise.plan.specs import GPU_PRESETS, ClusterSpec, TrainingSpec
from shardwise.plan.trace import trace_factory


def build_model(a: argparse.Namespace) -> ModelSpec:
    if a.model and ":" in a.model and a.model.split(":")[0].endswith(".py"):
        if not a.input_shape:
            raise ValueError("a traced factory needs --input-shape (batch first), e.g. --input-shape 8,64")
        return trace_factory(a.model, a.input_shape, a.input_dtype)
    if a.model:
        spec = known_model(a.model)
        return spec.replace(params=a.params) if a.params else spec
    if a.layers or a.hidden or a.heads:
        if not (a.layers and a.hidden and a.heads):
            raise ValueError("a transformer shape needs --layers, --hidden and --heads")
        moe = dict(experts=a.experts, top_k=a.top_k, moe_ffn_hidden=a.moe_ffn_hidden) if a.experts else {}
        return ModelSpec.transformer(a.layers, a.hidden, a.heads, vocab=a.vocab if a.vocab is not None else 50257,
                                     seq_len=a.seq_len or 2048, params=a.params, ffn_hidden=a.ffn_hidden,
                                     kv_heads=a.kv_heads, gated_mlp=a.gated_mlp or bool(a.experts), **moe)
    if a.params:
        return ModelSpec.from_params(a.params, seq_len=a.seq_len or 2048)
    raise ValueError("describe the model: --model NAME or path.py:factory, --params N, or --layers/--hidden/--heads")


def build_cluster(a: argparse.Namespace) -> ClusterSpec:
    kw: dict[str, object] = dict(GPU_PRESETS[a.gpu])
    for flag, key in (("device_memory", "device_memory_bytes"), ("intra_bw", "intra_bw"), ("inter_bw", "inter_bw"),
                      ("intra_latency", "intra_latency_s"), ("inter_latency", "inter_latency_s"),
                      ("peak_flops", "peak_flops"), ("efficiency", "compute_efficiency"),
                      ("reserve", "reserved_bytes")):
        if getattr(a, flag) is not None:
            kw[key] = getattr(a, flag)
    if a.reserve is None and a.device_memory is not None:
        # The preset's reserve is for a real GPU; never let it eat more than a tenth of a smaller memory.
        kw["reserved_bytes"] = min(int(GPU_PRESETS[a.gpu].get("reserved_bytes", 0)), a.device_memory // 10)
    devices = a.nodes * a.devices_per_node if a.nodes else (a.devices or a.devices_per_node)
    return ClusterSpec.with_devices(devices, a.devices_per_node, name=a.gpu, **kw)


def build_training(a: argparse.Namespace) -> TrainingSpec:
    return TrainingSpec(global_batch=a.global_batch, micro_batch=a.micro_batch, seq_len=a.seq_len,
                        precision=a.precision, optimizer=a.optimizer,
                        activation_checkpointing=a.activation_checkpointing, sequence_parallel=a.sequence_parallel,
                        flash_attention=a.flash_attention, schedule=a.schedule, fp32_grads=a.fp32_grads,
                        offload=a.offload, no_sync=a.no_sync, autocast=a.autocast,
                        checkpoint_async=a.checkpoint_async)


def run(args: argparse.Namespace) -> int:
    """Run the planner for parsed ``args``; 0 when some layout fits, 1 when none does, 2 on bad input."""
    try:
        model, cluster, training = build_model(args), build_cluster(args), build_training(args)
        strategies = [s.strip() for s in args.strategies.split(",")] if args.strategies else None
        modes = [m.strip() for m in args.cp_modes.split(",") if m.strip()]
        for flag, value in (("--max-cp", args.max_cp), ("--max-ep", args.max_ep)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} {value}: must be at least 1")
        ests = plan(model, cluster, training, strategies, args.max_tp, args.max_cp, modes, args.max_ep)
        if args.diloco is not None and args.diloco < 1:
            raise ValueError(f"--diloco {args.diloco}: the inner steps between two syncs, at least 1")
        diloco = estimate_diloco(model, cluster, training, args.diloco) if args.diloco else None
    except (ValueError, KeyError, FileNotFoundError, AttributeError, argparse.ArgumentTypeError) as e:
        print(f"shardwise plan: error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    best = recommend(ests)
    if args.format == "json":
        rows = [dict(e.to_dict(), recommended=e is best) for e in ests]
        print(json.dumps(rows, indent=2))
    else:
        print_table(ests, best, model, cluster, training, args.top, args.width, args.explain)
        if args.diloco:
            print_diloco(diloco, ests, cluster, args.width)
    return 0 if best is not None else 1


def print_diloco(d: DiLoCoEstimate | None, ests: list[Estimate], cluster: ClusterSpec, width: int | None) -> None:
    """DiLoCo's bytes and step time beside ddp's over every device (the same global batch per step)."""
    con = make_console(width, highlight=False)
    ddp = next((e for e in ests if e.layout.strategy == "ddp" and e.layout.dp == cluster.devices), None)
    if d is None or ddp is None:
        con.print("DiLoCo: no ddp layout over one node, or over every device, to compare (see the table)")
        return
    table = Table(caption=f"per device and inner step; DiLoCo: {d.replicas} replicas (one per node) of ddp on "
                          f"{cluster.devices_per_node}, a sync every {d.sync_every} steps", header_style="bold")
    for col in ("run", "comm bytes/step", "across nodes", "step s"):
        table.add_column(col, justify="left" if col == "run" else "right")
    across = sum(c.bytes_sent for c in ddp.collectives if c.kind != "host_copy") if cluster.nodes > 1 else 0
    table.add_row(f"ddp over {cluster.devices}", fmt_bytes(ddp.comm_bytes_per_step), fmt_bytes(across),
                  f"{ddp.step_time_s:.3g}")
    table.add_row(f"diloco H={d.sync_every}", fmt_bytes(d.comm_bytes_per_step),
                  fmt_bytes(d.cross_replica_bytes_per_step), f"{d.step_time_s:.3g}")
    con.print(table)


def print_table(ests: list[Estimate], best: Estimate | None, model: ModelSpec, cluster: ClusterSpec,
                training: TrainingSpec, top: int = 25, width: int | None = None, explain: int = 3) -> None:
    """The readable report: inputs, recommendation, one row per layout, then why the first ones fit or not."""
    con = make_console(width, highlight=False)
    _print_inputs(con, model, cluster, training, ests[0] if ests else None)
    if not ests:
        con.print("[red]no valid layout[/] (check the global batch against the device count)")
        return
    _print_verdict(con, ests, best, model, training)
    shown = ests if top <= 0 else ests[:top]
    con.print(_layout_table(ests, shown, best, cluster))
    if len(shown) < len(ests):
        con.print(f"... {len(ests) - len(shown)} more layouts (--top 0 shows all)")
    if explain > 0:
        con.print("[bold]why[/] (per device):")
        for i, e in enumerate(shown[:explain], 1):
            con.print(f"{i:>3}. {explain_memory(e)}")
    for note in sorted({n for e in ests for n in e.notes}):
        con.print(f"note: {note}")


def _print_inputs(con: Console, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                  e0: Estimate | None) -> None:
    """What was planned: the model (and its trace), the cluster, the training setup."""
    shape = (f", {model.layers} layers, hidden {model.hidden}, {model.heads} heads"
             + (" (guessed)" if model.shape_inferred else "")) if model.is_transformer else ""
    named = "" if model.name.endswith(" params") else f"{model.name}: "  # from --params: the count is the name
    con.print(f"[bold]model[/] {named}{short_count(model.params)} parameters{shape}")
    if model.is_moe:
        con.print(f"[bold]experts[/] {model.experts} per layer, top-{model.top_k}: "
                  f"{short_count(model.expert_params)} expert parameters, {short_count(model.active_params)} "
                  "active per token; expert parallelism (ep) keeps E/ep experts per device")
    if model.trace is not None:
        tr = model.trace
        largest = max(tr.layer_outputs, key=lambda kv: kv[1], default=("-", 0))
        con.print(f"[bold]traced[/] on meta with input {tr.input_shape} {tr.input_dtype}: {len(tr.layer_outputs)} "
                  f"leaf layers, largest output {largest[0]} {fmt_bytes(largest[1])}; autograd keeps "
                  f"{fmt_bytes(tr.saved_bytes)} for backward; {tr.flops / tr.batch:.3g} FLOPs per sample")
    con.print(f"[bold]cluster[/] {cluster.devices} x {cluster.name} ({cluster.nodes} node(s) of "
              f"{cluster.devices_per_node}), {fmt_bytes(cluster.device_memory_bytes)} each, "
              f"{fmt_bytes(cluster.reserved_bytes)} reserved")
    if e0 is not None:
        con.print(f"[bold]training[/] {training.precision}, {training.optimizer}, global batch {e0.global_batch} x "
                  f"{e0.seq_len} tokens, micro-batch {training.micro_batch}"
                  + (" (autocast: fp32 model states)" if training.autocast else "")
                  + (", activation checkpointing" if training.activation_checkpointing else "")
                  + (", sequence parallel" if training.sequence_parallel else "")
                  + (", flash attention" if training.flash_attention else
                     ", fused attention (the model's)" if model.fused_attention and model.trace is None else ""))


def _print_verdict(con: Console, ests: list[Estimate], best: Estimate | None, model: ModelSpec,
                   training: TrainingSpec) -> None:
    """The recommended layout, or the leanest one and what would make it fit."""
    if best is not None:
        con.print(f"[bold green]Recommended: {best.layout.label}[/] - {best.step_time_s:.3g} s/step, "
                  f"{best.tokens_per_s:,.0f} tokens/s, MFU {best.mfu:.0%}, {fmt_bytes(best.total_bytes)} of "
                  f"{fmt_bytes(best.available_bytes)} per device")
    else:
        least = min(ests, key=lambda e: e.total_bytes)
        con.print(f"[bold red]Nothing fits.[/] The leanest layout, {least.layout.label}, needs "
                  f"{fmt_bytes(least.total_bytes)} of {fmt_bytes(least.available_bytes)} per device.")
        if model.is_transformer and model.trace is None and not no_stored_scores(model, training) and \
                least.largest_term == "activations":
            # Korthikanti et al.'s 5 a s^2 b bytes of scores per layer grow with the square of the sequence.
            con.print(f"The stored attention scores grow with the square of the {least.seq_len}-token sequence: "
                      "--flash-attention (SDPA's flash and memory-efficient kernels on GPUs) stores none of them.")


def _layout_table(ests: list[Estimate], shown: list[Estimate], best: Estimate | None, cluster: ClusterSpec) -> Table:
    """One row per shown layout, the best one in green."""
    # Device memory sets the unit: a layout needing 100x the device still reads in the same unit.
    mem_unit, mem_scale = _unit(cluster.device_memory_bytes)
    comm_unit, comm_scale = _unit(max(e.comm_bytes_per_step for e in ests))
    table = Table(caption=f"fitting layouts first, each group by predicted step time; per device; "
                          f"1 {mem_unit} = {mem_scale:.0e} bytes; fits: no (the largest term)".replace("e+0", "e"),
                  header_style="bold")
    for col in ("#", "layout", "fits", f"memory {mem_unit}", "params", "grads", "optim.", "activ.", "buffers",
                f"comm {comm_unit}/step", "step s", "MFU"):
        # A terminal (or COLUMNS) narrower than the table wraps cells onto more lines ("fold") instead of
        # cutting them to "…"; a pipe is wide enough (shardwise.console.make_console).
        table.add_column(col, justify="left" if col in ("layout", "fits") else "right", overflow="fold")
    for i, e in enumerate(shown, 1):
        table.add_row(str(i), e.layout.label, "yes" if e.fits else f"[red]no[/] ({_SHORT.get(e.largest_term, 'buf.')})",
                      *(f"{v / mem_scale:.1f}" for v in (e.total_bytes, e.params_bytes, e.grads_bytes,
                                                         e.optimizer_bytes, e.activation_bytes, e.buffer_bytes)),
                      f"{e.comm_bytes_per_step / comm_scale:.1f}", f"{e.step_time_s:.3g}", f"{e.mfu:.0%}",
                      style="green" if e is best else None)
    return table


_SHORT = {"parameters": "params", "gradients": "grads", "optimizer": "optim.", "activations": "activ."}


def explain_memory(e: Estimate) -> str:
    """One layout's verdict with every term of its per-device memory, as code the Trainer accepts."""
    gb = 1e9
    verdict = (f"fits, {(e.available_bytes - e.total_bytes) / gb:.1f} GB free" if e.fits else
               f"does not fit, {(e.total_bytes - e.available_bytes) / gb:.1f} GB over; the largest term is "
               f"{e.largest_term}")
    held = ""
    if e.pp > 1 and e.layout.zero_stage >= 2 and e.microbatches > 1:
        held = " (whole gradients of the stage held while micro-batches accumulate)"
    terms = ", ".join(f"{k} {v / gb:.2f}" for k, v in e.memory_terms.items())
    host = "".join(f"; host memory: {k} {v / gb:.2f}" for k, v in e.host_buffers.items())
    return (f"{e.layout.label} = {e.layout.code(e.schedule)}: {e.total_bytes / gb:.2f} of "
            f"{e.available_bytes / gb:.2f} GB, {verdict}. In GB: {terms}{held}{host}")


def _unit(largest: float) -> tuple[str, float]:
    """The decimal unit that keeps a column's numbers readable."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if largest >= scale:
            return unit, scale
    return "B", 1.0
