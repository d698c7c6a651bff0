"""``python -m shardwise.plan ...``: the planner's command line on its own."""
from __future__ import annotations

import argparse
import sys

from shardwise.plan.command.cli import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardwise plan",
                                     description="Predict memory, communication and step time of every layout.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
