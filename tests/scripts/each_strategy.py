"""Run one example script once per strategy inside the same `shardwise run` ranks.

``python each_strategy.py EXAMPLE ddp,zero1,... -- ARGS... [++ EXAMPLE2 S1,S2 -- ARGS2... ++ ...]`` runs
``EXAMPLE --strategy S ARGS...`` as ``__main__`` for each strategy S in turn, then the next example's,
in this process: under torchrun every rank does the same, so each run is the example under `shardwise
run` with that strategy, joining a new process group as a second ``fit`` in a script does. One launch
instead of one per (example, strategy) pair: the launcher, the ranks' interpreters and their imports
(torch, transformers) are paid once. Rank 0 prints ``each_strategy: EXAMPLE S ok`` after each run, so a
failure names the example and strategy it happened in.
"""
from __future__ import annotations

import os
import runpy
import sys


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


def main() -> None:
    for example, names, rest in groups(sys.argv[1:]):
        for name in names:
            if os.environ.get("RANK", "0") == "0":
                print(f"each_strategy: {example} {name} starts", flush=True)
            sys.argv = [example, "--strategy", name, *rest]
            runpy.run_path(example, run_name="__main__")
            if os.environ.get("RANK", "0") == "0":
                print(f"each_strategy: {example} {name} ok", flush=True)


if __name__ == "__main__":
    main()
