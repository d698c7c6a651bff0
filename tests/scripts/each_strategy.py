"""Run one example script once per strategy inside the same `shardwise run` ranks.

``python each_strategy.py EXAMPLE ddp,zero1,... -- ARGS... [++ EXAMPLE2 S1,S2 -- ARGS2... ++ ...]`` runs
``EXAMPLE --strategy S ARGS...`` as ``__main__`` for each strategy S in turn, then the next example's,
in this process; S ``-`` runs ``EXAMPLE ARGS...``, for a script that takes no ``--strategy`` (one
configured by its own flags). Under torchrun every rank does the same, so each run is the example under
`shardwise run` with that strategy, joining a new process group as a second ``fit`` in a script does. One
launch instead of one per (example, strategy) pair: the launcher, the ranks' interpreters and their imports
(torch, transformers) are paid once. Rank 0 prints ``each_strategy: EXAMPLE S ok`` after each run, so a
failure names the example and strategy it happened in. S written ``ps!`` is a pair the example must refuse
before its ranks meet (a check every rank makes alone): every rank expects the exception, rank 0 prints
``each_strategy: EXAMPLE S refused: TYPE: MESSAGE``, and a run that does not raise fails the launch.

Run as plain python (one process, no torchrun), each run is the example as a script: ``--devices N``
spawns its own ranks, which import the example again, as they would from ``python EXAMPLE``; the
interpreter and its imports are paid once. ``--keep-going`` first (one process only: ranks under torchrun
must fail together) goes on after a run that fails: its traceback is printed between its ``starts`` line
and ``each_strategy: EXAMPLE S failed``, so each run reads as its own case, and the exit code is 1.
"""
from __future__ import annotations

import os
import runpy
import sys
import traceback


def groups(argv: list[str]) -> list[tuple[str, list[str], list[str]]]:
    """(example, strategies, its arguments) of every ``++``-separated group of ``argv``."""
    out, group = [], []
    for arg in [*argv, "++"]:
        if arg != "++":
            group.append(arg)
            continue
        assert len(group) >= 3 and group[2] == "--", group
        out.append((group[0], group[1].split(","), group[3:]))
        group = []
    return out


def refused(example: str, name: str, rest: list[str]) -> None:
    """Run ``example`` under strategy ``name``, which it must refuse with an exception, and print that."""
    sys.argv = [example, "--strategy", name, *rest]
    try:
        runpy.run_path(example, run_name="__main__")
    except Exception as e:  # noqa: BLE001 - whichever it raises is printed whole, its type included
        if os.environ.get("RANK", "0") == "0":
            print(f"each_strategy: {example} {name} refused: {type(e).__name__}: {e}", flush=True)
        return
    raise AssertionError(f"{example} ran under {name}, which it should have refused")


def main() -> int:
    argv = sys.argv[1:]
    keep_going = argv[:1] == ["--keep-going"]
    if keep_going:
        assert int(os.environ.get("WORLD_SIZE", "1")) == 1, "--keep-going is for one process, not under torchrun"
        argv = argv[1:]
    failed = False
    for example, names, rest in groups(argv):
        for name in names:
            if name.endswith("!"):
                refused(example, name[:-1], rest)
                continue
            if os.environ.get("RANK", "0") == "0":
                print(f"each_strategy: {example} {name} starts", flush=True)
            sys.argv = [example, *(["--strategy", name] if name != "-" else []), *rest]
            try:
                runpy.run_path(example, run_name="__main__")
            except (Exception, SystemExit) as e:
                if not keep_going:
                    raise
                if not (isinstance(e, SystemExit) and e.code in (None, 0)):  # sys.exit(0) ends a run that passed
                    sys.stdout.write(traceback.format_exc())
                    print(f"each_strategy: {example} {name} failed", flush=True)
                    failed = True
                    continue
            if os.environ.get("RANK", "0") == "0":
                print(f"each_strategy: {example} {name} ok", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
