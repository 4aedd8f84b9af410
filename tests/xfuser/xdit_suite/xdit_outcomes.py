"""A pytest plugin loaded into runs of xDiT's own suite (``-p xdit_outcomes``) by test_xdit_suite.py:
writes every test's outcome, by node id, to the JSON file named by ``$XDIT_OUTCOMES``."""

from __future__ import annotations

import json
import os

_outcomes: dict[str, str] = {}


def pytest_collectreport(report) -> None:
    if report.failed:  # a module that cannot be imported: one "error" for the whole module
        _outcomes[report.nodeid] = "error"


def pytest_runtest_logreport(report) -> None:
    if report.when == "call":
        outcome = report.outcome  # passed, failed or skipped (xfail counts as skipped)
    elif report.failed:
        outcome = "error"  # setup or teardown
    elif report.skipped:
        outcome = "skipped"
    else:
        return
    if _outcomes.get(report.nodeid) != "error":
        _outcomes[report.nodeid] = outcome


def pytest_sessionfinish(session) -> None:
    with open(os.environ["XDIT_OUTCOMES"], "w") as f:
        json.dump(_outcomes, f, indent=1, sort_keys=True)
