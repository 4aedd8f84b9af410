"""``cocodiff bench host``: the entry points' timer, and the report from real jobs (slow tier)."""

from __future__ import annotations

import json
import time

import pytest

from cocodiff_xfuser.tools import cli
from cocodiff_xfuser.tools.bench import host


@pytest.mark.unit
def test_the_timer_counts_outermost_calls_only():
    timer = host._Timer()
    inner = timer.wrap(lambda: time.sleep(0.01), "exchange_s")
    outer = timer.wrap(lambda: (time.sleep(0.01), inner()), "decision_s")
    outer()
    inner()
    assert 0.02 <= timer.seconds["decision_s"] < 0.05  # the nested call is inside the outer one's time
    assert 0.01 <= timer.seconds["exchange_s"] < 0.03  # only the call made from outside


@pytest.mark.unit
def test_the_time_standing_for_the_collectives_is_not_counted():
    timer = host._Timer()

    def exchange():
        time.sleep(0.01)  # the entry point's own work
        started = time.perf_counter()
        time.sleep(0.03)  # the batch posted as nothing, echoing bytes
        timer.exclude(time.perf_counter() - started)

    timer.wrap(exchange, "exchange_s")()
    assert 0.01 <= timer.seconds["exchange_s"] < 0.025


@pytest.mark.unit
def test_an_unknown_mode_is_one_line(capsys):
    assert cli.main(["bench", "host", "--modes", "eager,graph"]) == 2
    assert capsys.readouterr().err.strip() == "cocodiff bench host: --modes: graph not among eager, compiled"


@pytest.mark.slow
@pytest.mark.distributed
def test_the_report_gives_every_configuration_eager_and_compiled(capsys):
    # 4 steps: V-Major's exchanges go sparse after its 2 warm-up steps (the batches taken out, the
    # masks that arrive must still mark the rows that do).
    assert cli.main(["bench", "host", "--steps", "4", "--repeat", "1", "--rounds", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {row["name"]: row for row in report["configs"]}
    assert list(rows) == ["ulysses", *host.CONFIGS]
    for mode in host.MODES:
        assert rows["ulysses"][mode]["step_ratio"] == 1.0 and "host_s_per_exchange" not in rows["ulysses"][mode]
        for name in host.CONFIGS:
            m = rows[name][mode]
            assert m["step_s"] > 0 and m["host_s_per_exchange"] > 0 and m["host_s_per_layer"] >= m["host_s_per_exchange"]
            # tiny-flux: 2 double and 2 single blocks per step on each rank; stock's processors
            # exchange twice per layer, V-First's at least twice (V rides with Q/K at sparse steps).
            assert m["layers_per_step"] == 4 and m["exchanges_per_step"] >= 8, (name, mode, m)
