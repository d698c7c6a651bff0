"""Run one example script once per strategy inside the same `shardwise run` ranks.

``python each_strategy.py EXAMPLE ddp,zero1,... -- ARGS...`` runs ``EXAMPLE --strategy S ARGS...`` as
``__main__`` for each strategy S in turn, in this process: under torchrun every rank does the same, so
each run is the example under `shardwise run` with that strategy, joining a new process group as a
second ``fit`` in a script does. One launch per example instead of one per (example, strategy) pair:
the launcher, the ranks' interpreters and their imports (torch, transformers) are paid once.
Rank 0 prints ``each_strategy: S ok`` after each run, so a failure names the strategy it happened in.
"""
from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    example, names, rest = sys.argv[1], sys.argv[2].split(","), sys.argv[4:]
    assert sys.argv[3] == "--", sys.argv
    for name in names:
        if os.environ.get("RANK", "0") == "0":
            print(f"each_strategy: {name} starts", flush=True)
        sys.argv = [example, "--strategy", name, *rest]
        runpy.run_path(example, run_name="__main__")
        if os.environ.get("RANK", "0") == "0":
            print(f"each_strategy: {name} ok", flush=True)


if __name__ == "__main__":
    main()
