"""``cocodiff bench a2a``: the driver on an emulated 2x2 rail fabric (CI-sized smoke run).

Correctness and report completeness only; no timing assertions (figures come from full runs,
see docs/results/). Skips with the reason when namespaces cannot be built here (needs root).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

import pytest

from cocodiff_xfuser.tools.bench import a2a as bench
from cocodiff_xfuser.tools.fabric import Fabric


def test_topology_and_regime_text():
    assert bench.topology_for("rail", 2, 2) == "2x2"
    assert bench.topology_for("aurora-like", 2, 4) == "2x2x2"
    assert bench.topology_for(None, 1, 4) == "1x4"
    assert bench.regime(Fabric("rail", 2, 2), 16 << 20).startswith("routing-bound")
    assert bench.regime(Fabric("shared-uplink", 2, 2), 16 << 20).startswith("bandwidth-bound")
    assert bench.regime(None, 16 << 20).startswith("loopback")


def test_run_cli_reports_unavailable_fabric(monkeypatch, capsys):
    import cocodiff_xfuser.tools.fabric as fabric

    monkeypatch.setattr(fabric, "available", lambda refresh=False: (False, "no namespaces in this test"))
    args = argparse.Namespace(fabric="rail", nodes=2, local=2, sizes_mib="1", reps=1, out=None, json=True)
    assert bench.run_cli(args) == 2
    assert "no namespaces in this test" in capsys.readouterr().err
    args.fabric, args.shapes = None, "2x2,2y2"  # bad input: one line, nothing launched
    assert bench.run_cli(args) == 2
    assert "--shapes: '2y2' is not NODESxLOCAL" in capsys.readouterr().err


def _need_fabric():
    from cocodiff_xfuser.tools.fabric import available

    ok, reason = available()
    if not ok:
        pytest.skip(f"emulated fabric unavailable: {reason}")


@pytest.mark.fabric
def test_smoke_rail_2x2(tmp_path, capsys):
    _need_fabric()
    args = argparse.Namespace(
        fabric="rail", shapes="2x2", sizes_mib="0.5", reps=2, out=str(tmp_path), json=True, timeout=50
    )
    t0 = time.monotonic()
    rc = bench.run_cli(args)  # the worker checks every algorithm bitwise against the stock one
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert time.monotonic() - t0 < 60
    summary = json.loads(captured.out)
    assert summary == json.loads((tmp_path / "a2a-rail.json").read_text())
    report = summary["reports"]["2x2"]
    assert report == json.loads((tmp_path / "a2a-rail-2x2.json").read_text())
    assert (tmp_path / "a2a-rail-2x2.png").stat().st_size > 1000
    assert "flat (stock)" in captured.err and "summary on rail" in captured.err  # tables go to stderr with --json
    (row,) = summary["summary"]
    assert row["shape"] == "2x2" and row["worst_vs_stock"] == report["results"][0]["speedup_vs_flat"]
    assert row["worst_fraction_of_bound_ge_4mib"] is None  # no size >= 4 MiB in this run
    assert row["copies_per_exchange"]["cocodiff"] < row["copies_per_exchange"]["xfuser"]
    # The fabric (namespaces ccd-a<pid>-*) is torn down.
    prefix = f"ccd-a{os.getpid() % 100000}-"
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [line for line in netns.splitlines() if line.startswith(prefix)]

    for key in ("fabric", "nodes", "local", "topology", "regime", "describe", "candidates", "results", "timing"):
        assert key in report, key
    assert (report["fabric"], report["nodes"], report["local"], report["topology"]) == ("rail", 2, 2, "2x2")
    assert report["levels"] == [2, 2] and report["world_size"] == 4
    assert report["describe"].startswith("fabric rail") and report["regime"]
    assert report["candidates"] == ["flat", "flat_p2p", "hierarchical"]
    assert report["tc_drops"] == 0
    (r,) = report["results"]
    assert r["size_bytes"] == 1 << 19
    for name in ("flat", "flat_p2p", "hierarchical"):
        assert 0 < r[f"{name}_min_s"] <= r[f"{name}_s"], name
        assert len(r["times_s"][name]) == 2
    assert r["chosen"] in report["candidates"]
    assert r["chosen_s"] == r[f"{r['chosen']}_s"] > 0
    assert r["speedup_vs_flat"] == pytest.approx(r["flat_s"] / r["chosen_s"])
    assert r["speedup_vs_fair"] == pytest.approx(r["flat_p2p_s"] / r["chosen_s"])
    assert r["bound_s"] == pytest.approx(Fabric("rail", 2, 2).bound_s("all_to_all", 1 << 19))
    assert r["bound_flat_routes_s"] == pytest.approx(2 * r["bound_s"])
    assert r["fraction_of_bound"] == pytest.approx(r["chosen_s"] / r["bound_s"])
    # Every other candidate timed against gloo's fair flat exchange; no pipelining below 1 MiB.
    assert r["autotune"]["reference"] == "flat_p2p" and set(r["autotune"]["ratios"]) == {"flat", "hierarchical"}
    assert r["ulysses"]["cocodiff_layout_s"] > 0
    padded = r["ulysses"]["padding"]
    assert padded["padded_heads"] == padded["heads"] + 1 and padded["time_vs_same_bytes_unpadded"] > 0


@pytest.mark.fabric
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["rail", "shared-uplink", "aurora-like"])
def test_documented_benchmark_runs_on_every_preset(preset, tmp_path, capsys):
    """The runs behind docs/benchmarks.md (every shape, 0.5-16 MiB per rank): complete and
    lossless, never timed here."""
    _need_fabric()
    args = argparse.Namespace(
        fabric=preset, shapes="2x2,2x4,4x2", sizes_mib="0.5,1,2,4,8,16", reps=9, out=str(tmp_path), json=True,
        timeout=1500, floor=preset == "rail",
    )
    assert bench.run_cli(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [row["shape"] for row in summary["summary"]] == ["2x2", "2x4", "4x2"]
    for report in summary["reports"].values():
        assert [r["size_bytes"] for r in report["results"]] == [int(m * 2**20) for m in (0.5, 1, 2, 4, 8, 16)]
        for r in report["results"]:
            assert r["chosen"] in r["times_s"] and r["fraction_of_bound"] >= 0.9 and r["bound_s"] > 0
            assert ("host_floor_s" in r) == (preset == "rail")


@pytest.mark.distributed
def test_a_second_benchmark_stops_at_once(tmp_path):
    """Two benchmarks at once would share the cores and the links: the second one is refused."""
    import subprocess
    import sys

    from cocodiff_xfuser.tools.bench import one_at_a_time

    with one_at_a_time():
        result = subprocess.run(
            [sys.executable, "-m", "cocodiff_xfuser.tools.cli", "bench", "a2a", "--out", str(tmp_path), "--sizes-mib", "1"],
            capture_output=True, text=True, timeout=120,
        )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "another cocodiff benchmark is running (pid" in result.stderr and "one at a time" in result.stderr
