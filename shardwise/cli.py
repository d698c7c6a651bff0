"""The `shardwise` command: run, demo, verify, bench, plan, checkpoint."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any, NoReturn

# Only torch-free modules here, so that `shardwise --help` answers at once: each command imports what it runs.
import shardwise.cluster as cluster  # (`from shardwise import cluster` would ask the package, which imports torch)
from shardwise import __version__
from shardwise.bench import add_arguments as bench_args
from shardwise.bench import run as bench_run
from shardwise.extras import MissingExtra, require
from shardwise.plan.command.args import add_arguments as plan_args

# What a user's input or installation gets wrong (an unknown strategy, a bad flag value, a missing file, a missing
# extra): one line on stderr and exit 2, the whole traceback only with --traceback or SHARDWISE_TRACEBACK=1.
USER_ERRORS = (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, MissingExtra)
TRACEBACK_HELP = "on an error, print the whole Python traceback, not one line (also: SHARDWISE_TRACEBACK=1)"

RUN_HELP = """usage: shardwise run [--nproc N] [--standalone] [torchrun flags ...] SCRIPT [SCRIPT ARGS ...]

Start SCRIPT on N processes with torchrun (torch.distributed.run). Inside,
sw.Trainer(...).fit joins the running group (devices='auto' is the world
size) and every rank returns the result; sw.init() joins it for hand-written
loops.

shardwise's flags:
  --nproc N, --nprocs N  processes on this node (short for --nproc-per-node N)
  --standalone           one node, private rendezvous on loopback (the default when
                         no --nnodes, --rdzv-* or --master-* flag is given: the job's
                         store listens on 127.0.0.1 only, on a port the OS picks)
  -h, --help             this text
  --help-torchrun        torchrun's own help (every flag it takes)

Every other flag goes to torchrun unchanged, for example:
  --nnodes 2 --node-rank 0 --rdzv-endpoint HOST:PORT --rdzv-backend c10d   several machines
  --max-restarts 3       restart every worker after a failure (resume from checkpoint_dir)
  --rdzv-id ID           the job's name in the rendezvous

Inside a SLURM allocation, `srun --ntasks-per-node=1 shardwise run --nproc N
SCRIPT` starts one per node and, with no rendezvous flag given, they meet on
the allocation's first node by themselves (--nnodes, --node-rank and a c10d
rendezvous from SLURM's variables; docs/clusters.md).

Threads per rank default to the cores of this machine divided by N
(OMP_NUM_THREADS, when not set). Examples:
  shardwise run --nproc 2 examples/char_gpt.py --strategy fsdp
  shardwise run --nnodes 2 --node-rank 0 --nproc 4 --rdzv-endpoint 10.0.0.1:29400 train.py
"""


def torchrun_args(argv: list[str], env: Mapping[str, str]) -> tuple[list[str], bool]:
    """torchrun's arguments for ``shardwise run ARGV`` in environment ``env``, and whether the job is one node
    with a private rendezvous on loopback (the caller prepends those flags: they need a live store).

    Nothing is started here. ``--nproc N`` is short for ``--nproc-per-node N``.
    Inside an srun step of several tasks (one ``shardwise run`` per node),
    with no rendezvous flag given, the tasks meet as torchrun's nodes
    (:func:`shardwise.cluster.allocation_run_args`); otherwise one node gets the
    private rendezvous, as does ``--standalone``.
    """
    args = list(argv)
    for i, a in enumerate(args):
        if a in ("--nproc", "--nprocs"):
            args[i] = "--nproc-per-node"
        elif a.startswith(("--nproc=", "--nprocs=")):
            args[i] = "--nproc-per-node=" + a.split("=", 1)[1]
    if "--standalone" in args:
        return [a for a in args if a != "--standalone"], True
    if cluster.gives_rendezvous(args):
        return args, False  # the user said how the nodes meet
    allocation = cluster.allocation_run_args(env)
    if allocation:
        return allocation + args, False
    return args, True


def _run(argv: list[str]) -> int:
    """torchrun with all its flags passed through; ``--nproc N`` is short for ``--nproc-per-node N``."""
    if not argv or argv[0] in ("-h", "--help"):
        print(RUN_HELP, end="", file=sys.stdout if argv else sys.stderr)  # no script: the text as an error
        return 0 if argv else 2
    if argv[0] == "--help-torchrun":
        argv = ["--help"]
    try:
        args, private = torchrun_args(argv, os.environ)
    except cluster.ClusterError as e:
        print(f"shardwise run: {e}", file=sys.stderr)
        return 2
    if private:
        note = cluster.allocation_note(os.environ)
        if note is not None and argv != ["--help"]:
            print(f"shardwise run: {note}", file=sys.stderr)
    # The arguments are checked before torch is imported (seconds): a refusal comes at once.
    nproc = 1
    for i, a in enumerate(args):
        value = args[i + 1] if a == "--nproc-per-node" and i + 1 < len(args) else \
            a.split("=", 1)[1] if a.startswith("--nproc-per-node=") else None
        if value is None:
            continue
        if value.lstrip("-").isdigit() and int(value) < 1:
            print(f"shardwise run: --nproc must be at least 1, got {value}", file=sys.stderr)
            return 2
        if value.isdigit():
            nproc = int(value)
    from torch.distributed import run as torchrun

    from shardwise.comm.topology import threads_per_rank

    store = None
    if private:
        from shardwise.launch import loopback_rendezvous

        store, rdzv = loopback_rendezvous()
        args = rdzv + args
    # torchrun sets 1 thread per rank; share this host's cores instead.
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nproc)))
    try:
        torchrun.main(args)
    finally:
        del store  # the rendezvous store lives exactly as long as the job
    return 0


def _verify(a: argparse.Namespace) -> int:
    from shardwise.commands.verify import FLOOR_FACTOR, judge
    from shardwise.workloads import load

    if a.model == "digits":
        require("shardwise verify --model digits", "demo")
    work = load(a.model)
    v = judge(work, a.strategy, a.devices, a.steps, rtol=a.rtol, accumulate_grad_batches=a.accumulate,
              sync_batchnorm=a.sync_batchnorm, engine=a.engine)
    r, f = v.run, v.floor
    under = "" if a.engine == "shardwise" else f" under engine={a.engine}"
    print(f"verify {a.strategy}{under} on {a.devices} devices, workload {work.name}, {a.steps} steps")
    print(f"  noise floor (single device, float32 against {v.floor_source}): losses {f.max_loss_rel:.2e}, "
          f"weights {f.max_param_rel:.2e} relative (worst tensor); tolerance {FLOOR_FACTOR:g}x the floor, per weight "
          f"tensor, at least {a.rtol:g}")
    print(f"  losses:  largest difference {r.max_loss_diff:.3e} (relative {r.max_loss_rel:.3e}, tolerance "
          f"{v.loss_tol:.2e}) {'equal' if v.losses_equal else 'DIFFERENT'}")
    name, diff, tol = v.worst
    print(f"  weights: largest difference {r.max_param_diff:.3e}; closest to its tolerance: {name} (relative "
          f"{diff:.3e}, tolerance {tol:.2e}) {'equal' if v.params_equal else 'DIFFERENT'}")
    if v.reason is not None:  # not the same maths: the numbers above cannot make it equal
        print(f"  {v.reason}")
    print(f"  {'EQUAL' if v.equal else 'MISMATCH'}")
    return 0 if v.equal else 1


def _checkpoint(a: argparse.Namespace) -> int:
    """``ls``: one line per checkpoint, exit 1 when the newest is not intact; ``export``: the model, plainly."""
    from shardwise.checkpoint import tools

    try:
        if a.verb == "ls":
            entries = tools.listing(a.dir)
            print(f"checkpoints in {a.dir} (oldest first)")
            for line in tools.table(entries):
                print("  " + line)
            print(tools.summary(entries))
            return tools.exit_code(entries)
        done = tools.export(a.dir, a.out, a.format)
    except tools.NoCheckpoint as e:
        print(f"shardwise checkpoint {a.verb}: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"shardwise checkpoint {a.verb}: {e}", file=sys.stderr)
        return 1
    for path, why in done.skipped:
        print(f"skipped {path}: {why}", file=sys.stderr)
    what = "a directory from_pretrained loads" if done.format == "hf" else "one state dict (torch.load)"
    print(f"exported step {done.step} of {done.source} ({done.model_class}) to {done.out}: {what}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, its error one line (no usage block): ``shardwise: error: argument --devices: invalid int value:
    'x' (see shardwise verify --help)``, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"shardwise: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """Every verb and flag, without importing torch (so that ``--help`` answers at once)."""
    p = _Parser(prog="shardwise", description="Distributed training, every classic way.")
    p.add_argument("--version", action="version", version=f"shardwise {__version__} (torch {_torch_version()})",
                   help="print shardwise's and torch's versions and exit")
    p.add_argument("--traceback", action="store_true", help=TRACEBACK_HELP)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{run,fit,demo,verify,bench,plan,checkpoint}")
    sub.add_parser("run", help="launch a script on N processes (torchrun; all its flags pass through; "
                               "`shardwise run --help` for ours)", add_help=False,
                   description=RUN_HELP.split("\n\n")[1].replace("\n", " "))  # main() answers run --help itself
    sub.add_parser("fit", help="train from a configuration file: --config run.yaml, every Trainer and fit option "
                               "as --trainer.NAME/--fit.NAME (`shardwise fit --help`)", add_help=False,
                   description="Train the model, dataset, loss and optimizer a YAML file names, with every Trainer "
                               "and fit option from the file or a flag (a flag wins); --print_config prints the "
                               "resolved configuration.")  # main() answers fit --help itself (jsonargparse)
    _demo_args(sub)
    _verify_args(sub)
    bench_args(_verb(sub, "bench", "ours against PyTorch's own implementation, side by side",
                     "Run each of our implementations next to PyTorch's own (DDP, ZeRO, FSDP, pipeline, "
                     "tensor parallel...) on the same model and data, alternating repetitions, and print "
                     "median step times, memory and bytes sent side by side."))
    plan_args(_verb(sub, "plan", "predict memory, communication and step time of every layout",
                    "Predict, without running anything, the per-device memory, communication and step time of "
                    "every data/tensor/pipeline layout of a model on a cluster, and recommend the fastest that "
                    "fits."))
    _checkpoint_args(sub)
    return p


def _demo_args(sub: argparse._SubParsersAction[Any]) -> None:
    """``shardwise demo``: every strategy on the digits classifier."""
    d = _verb(sub, "demo", "train the digits classifier under every strategy and compare",
              "Train the 8x8 digits MLP under every strategy (single, ddp, dp, ps, ZeRO 1-3, fsdp, hsdp, tp, pp, "
              "3d) on CPU processes and print one table: final loss, test accuracy, equality with single-device "
              "training, median step time, peak memory and bytes sent. About 90 s on 2 cores.")
    d.add_argument("--steps", type=int, default=60, metavar="N",
                   help="optimizer steps of each strategy's run (default: 60)")
    d.add_argument("--plot", dest="plot_dir", default=None, metavar="DIR",
                   help="also write throughput, memory and pipeline-timeline PNGs under DIR")


def _verify_args(sub: argparse._SubParsersAction[Any]) -> None:
    """``shardwise verify``: one strategy against single-device training."""
    v = _verb(sub, "verify", "check a strategy against single-device training",
              "Train the same model under STRATEGY and on one device, measure the noise floor (the one-device "
              "run in float32 against the same run in float64 and with its samples in other orders) and report "
              "EQUAL (exit 0) or MISMATCH (exit 1) "
              "for the losses and every weight tensor; a model that mixes the samples of a batch (BatchNorm) "
              "under a strategy that splits the batch is a MISMATCH with the reason (docs/verify.md).")
    v.add_argument("--strategy", default="ddp", metavar="NAME",
                   help="the strategy to check: ddp, dp, ps, zero1, zero2, zero3, fsdp, hsdp, tp, pp "
                        "(default: ddp)")
    v.add_argument("--devices", type=int, default=2, metavar="N", help="devices for that strategy (default: 2)")
    v.add_argument("--model", default="digits", metavar="WORKLOAD",
                   help="built-in workload (digits, gpt, mlp1024) or path.py:factory (default: digits)")
    v.add_argument("--steps", type=int, default=20, metavar="N", help="optimizer steps of each run (default: 20)")
    v.add_argument("--accumulate", type=int, default=1, metavar="K",
                   help="accumulate_grad_batches of every run (default: 1)")
    v.add_argument("--rtol", type=float, default=1e-6,
                   help="the smallest relative tolerance, used when the measured noise floor is lower (default: 1e-6)")
    v.add_argument("--engine", choices=("shardwise", "torch"), default="shardwise",
                   help="whose mechanism runs the strategy: shardwise's (default) or PyTorch's own (DDP, FSDP2, "
                        "DTensor, pipelining; docs/how-to/engines.md)")
    v.add_argument("--sync-batchnorm", action="store_true",
                   help="train the strategy's run with Trainer(sync_batchnorm=True): BatchNorm normalises with the "
                        "whole global batch's statistics")


def _checkpoint_args(sub: argparse._SubParsersAction[Any]) -> None:
    """``shardwise checkpoint ls|export``."""
    c = _verb(sub, "checkpoint", "list checkpoints with their layout, size and integrity; export one")
    cv = c.add_subparsers(dest="verb", required=True)
    ls = _verb(cv, "ls", "one line per checkpoint (exit 1 when the newest is not intact)",
               "One line per checkpoint under DIR, oldest first: step, layout, size and integrity; exit 1 when "
               "the newest is not intact (a resume would fall back to an older one).")
    ls.add_argument("dir", metavar="DIR", help="a checkpoint_dir (or one step_N directory)")
    ex = _verb(cv, "export", "the model as one state dict file, or a from_pretrained directory (Hugging Face)",
               "Write the model of a checkpoint (saved under any strategy and device count) as one plain state "
               "dict file, or as a directory from_pretrained loads (Hugging Face models).")
    ex.add_argument("dir", metavar="DIR",
                    help="a checkpoint_dir (its newest intact checkpoint) or one step_N directory")
    ex.add_argument("out", metavar="OUT", help="the file (pt) or directory (hf) to write")
    ex.add_argument("--format", choices=["pt", "hf"], default=None,
                    help="pt: torch.save of the plain state dict; hf: save_pretrained (default: hf for a Hugging "
                         "Face model, else pt)")


def _verb(sub: argparse._SubParsersAction[Any], name: str, help: str,
          description: str | None = None) -> argparse.ArgumentParser:
    """A verb whose ``--help`` opens with what it does (the one-line help, or a longer description); it takes
    ``--traceback`` after the verb too."""
    verb = sub.add_parser(name, help=help, description=description or help[:1].upper() + help[1:] + ".")
    verb.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS, help=TRACEBACK_HELP)
    return verb  # type: ignore[no-any-return]


def _torch_version() -> str:
    try:
        return version("torch")  # the installed distribution's metadata: no import of torch itself
    except PackageNotFoundError:
        return "not installed"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    lead = 1 if argv[:1] == ["--traceback"] else 0  # run's errors are one line, torchrun's and the script's its own
    if argv[lead:lead + 1] == ["run"]:  # everything after `run` belongs to torchrun
        return _run(argv[lead + 1:])
    if argv[lead:lead + 1] == ["fit"]:  # its flags are generated from the Trainer's signature (jsonargparse)
        return _fit(argv[lead + 1:], traceback=lead == 1)
    a = build_parser().parse_args(argv)
    try:
        return _verb_main(a)
    except USER_ERRORS as e:
        if a.traceback or os.environ.get("SHARDWISE_TRACEBACK", "0") not in ("", "0"):
            raise
        print(str(e) if isinstance(e, MissingExtra) else f"shardwise: error: {e}", file=sys.stderr)
        return 2


def _fit(argv: list[str], traceback: bool) -> int:
    """``shardwise fit``: a run configured by a YAML file and flags (:mod:`shardwise.fit.config`)."""
    try:
        require("shardwise fit", "config")
        from shardwise.fit.config import main as fit_main

        fit_main(argv)
    except USER_ERRORS as e:
        if traceback or os.environ.get("SHARDWISE_TRACEBACK", "0") not in ("", "0"):
            raise
        print(str(e) if isinstance(e, MissingExtra) else f"shardwise fit: error: {e}", file=sys.stderr)
        return 2
    return 0


def _verb_main(a: argparse.Namespace) -> int:
    """Run the verb ``a`` names (every one but ``run``, which :func:`main` hands to torchrun)."""
    if a.cmd in ("demo", "bench") and a.plot_dir is not None:
        require(f"shardwise {a.cmd} --plot", "plots")
    if a.cmd == "demo":
        require("shardwise demo", "demo")
        from shardwise.commands.demo import main as demo_main
        return demo_main(steps=a.steps, plot_dir=a.plot_dir)
    if a.cmd == "verify":
        return _verify(a)
    if a.cmd == "bench":
        return bench_run(a)
    if a.cmd == "plan":
        from shardwise.plan.command.cli import run as plan_run
        return plan_run(a)
    if a.cmd == "checkpoint":
        return _checkpoint(a)
    return 2


if __name__ == "__main__":
    sys.exit(main())
