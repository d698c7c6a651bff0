"""The suite's time against its budget: ``make test-budget`` runs pytest with ``--durations=15`` into a log,
then this script reads the log and prints the total against the budget that DEVELOPERS.md states, and the 15
slowest tests.

A report, not a timed test: the machine's load moves the numbers, so nothing fails on them; the point is that
anyone can see, after any run, how far the suite is from its budget and which tests to look at first. Not a
test module (no ``test_`` prefix): pytest does not collect it.

Usage: ``python tests/budget_report.py LOG`` (LOG: the output of ``pytest -q --durations=15``).
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

SLOWEST = 15
DEVELOPERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "DEVELOPERS.md")
# DEVELOPERS.md's one line that states the budget and the goal below it (minutes of pytest on 2 cores).
_BUDGET_LINE = re.compile(r"budget: \*\*(\d+(?:\.\d+)?) minutes\*\*.*the goal is \*\*(\d+(?:\.\d+)?) minutes\*\*")


def budget(text: str) -> tuple[float, float]:
    """(budget, goal) in minutes, read from DEVELOPERS.md's text: the one place they are written."""
    m = _BUDGET_LINE.search(text)
    if m is None:
        raise ValueError("DEVELOPERS.md has no line 'The suite's budget: **N minutes** ...; the goal is **M minutes**'")
    return float(m.group(1)), float(m.group(2))


with open(DEVELOPERS, encoding="utf-8") as _f:
    BUDGET_MIN, GOAL_MIN = budget(_f.read())

# pytest's last line: "1234 passed, 5 skipped, 3 warnings in 812.34s (0:13:32)", with or without "=" around it.
_SUMMARY = re.compile(r"\b(?:passed|failed|errors?|skipped|xfailed|xpassed|deselected|no tests ran)\b.* in "
                      r"(\d+(?:\.\d+)?)s\b")
# One line of "slowest N durations": "45.67s call     tests/test_a.py::test_b".
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)s\s+(setup|call|teardown)\s+(\S.*?)\s*$")


@dataclass(frozen=True)
class Duration:
    seconds: float
    phase: str  # setup, call or teardown: a slow fixture shows as its test's setup
    test: str


def total_seconds(log: str) -> float | None:
    """The session's time from pytest's summary line (the last one, should the log hold several runs)."""
    found = [float(m.group(1)) for line in log.splitlines() if (m := _SUMMARY.search(line))]
    return found[-1] if found else None


def slowest(log: str, n: int = SLOWEST) -> list[Duration]:
    """The ``n`` longest phases pytest's ``--durations`` listed, longest first."""
    rows = [Duration(float(m.group(1)), m.group(2), m.group(3)) for line in log.splitlines()
            if (m := _DURATION.match(line))]
    return sorted(rows, key=lambda d: -d.seconds)[:n]


def verdict(seconds: float) -> str:
    """Where ``seconds`` stand against the goal and the budget, in words."""
    minutes = seconds / 60
    if minutes <= GOAL_MIN:
        return f"within the goal ({GOAL_MIN:g} min)"
    if minutes <= BUDGET_MIN:
        return f"within the budget, {minutes - GOAL_MIN:.1f} min over the goal ({GOAL_MIN:g} min)"
    return f"OVER the budget by {minutes - BUDGET_MIN:.1f} min ({BUDGET_MIN:g} min; goal {GOAL_MIN:g} min)"


def report(log: str) -> str:
    """The report's text for one pytest log."""
    seconds = total_seconds(log)
    if seconds is None:
        return "no pytest summary line in the log: did the run finish?"
    lines = [f"pytest: {seconds:.0f} s = {seconds / 60:.1f} min on {os.cpu_count()} cores; {verdict(seconds)}",
             f"budget: {BUDGET_MIN:g} min of pytest on 2 cores, goal {GOAL_MIN:g} min"]
    rows = slowest(log)
    if rows:
        lines.append(f"the {len(rows)} slowest (pytest --durations={SLOWEST}):")
        lines += [f"  {d.seconds:7.1f} s  {d.phase:8s} {d.test}" for d in rows]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8", errors="replace") as f:
        print(report(f.read()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
