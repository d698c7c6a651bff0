"""``make test-budget``'s report (tests/budget_report.py) reads pytest's own summary and --durations lines."""
from __future__ import annotations

import budget_report as br
import pytest

LOG = """........................................................................ [ 99%]
============================= slowest 15 durations =============================
2.50s setup    tests/test_a.py::test_slow_fixture
61.20s call     tests/test_b.py::test_slowest[ddp]
0.01s teardown tests/test_b.py::test_slowest[ddp]

(3 durations < 0.005s hidden.  Use -vv to show these durations.)
1234 passed, 5 skipped, 3 warnings in 812.34s (0:13:32)
"""


def test_total_and_slowest_are_pytests() -> None:
    assert br.total_seconds(LOG) == 812.34
    assert [(d.seconds, d.phase, d.test) for d in br.slowest(LOG, 2)] == \
        [(61.2, "call", "tests/test_b.py::test_slowest[ddp]"), (2.5, "setup", "tests/test_a.py::test_slow_fixture")]


def test_the_report_says_where_the_run_stands_against_goal_and_budget() -> None:
    assert "OVER the budget by 1.5 min" in br.report(LOG)
    assert br.verdict(11 * 60).startswith("within the budget") and br.verdict(9 * 60).startswith("within the goal")
    assert "no pytest summary" in br.report("killed\n")


def test_the_budget_is_read_from_developers_md() -> None:
    with open(br.DEVELOPERS, encoding="utf-8") as f:
        budget, goal = br.budget(f.read())
    assert f"budget: {budget:g} min of pytest on 2 cores, goal {goal:g} min" in br.report(LOG)
    assert br.budget("The suite's budget: **9 minutes** of pytest; the goal is **7.5 minutes**.") == (9.0, 7.5)
    with pytest.raises(ValueError, match="DEVELOPERS.md has no line"):
        br.budget("a budget of 12 minutes")
