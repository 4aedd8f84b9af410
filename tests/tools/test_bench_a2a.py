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


def test_pxn_routes_reach_the_bound_on_rail():
    """NCCL's PXN route (a hop to the rank on the destination's rail, then that rail) keeps every
    byte off the spine: on rail its bound is the physical one; elsewhere it is no better than flat's."""
    fab = Fabric("rail", 2, 4)
    assert fab.pxn_route(0, 5) == ("intra", "rail") and fab.pxn_route(0, 4) == ("rail",) and fab.pxn_route(0, 1) == ("intra",)
    for nodes, local in ((2, 2), (2, 4), (4, 2)):
        fab = Fabric("rail", nodes, local)
        pxn = fab.bound_s("pxn", 16 << 20)
        assert pxn == pytest.approx(fab.bound_s("all_to_all", 16 << 20)) and pxn < fab.bound_s("flat", 16 << 20)
    for preset in ("shared-uplink", "aurora-like"):
        fab = Fabric(preset, 2, 4)
        assert fab.bound_s("pxn", 16 << 20) >= fab.bound_s("flat", 16 << 20)


def _row(size_mib: float, ms: dict[str, float], chosen: str) -> dict:
    """One result row as the worker and the driver write it (times in ms)."""
    row = {"size_bytes": int(size_mib * 2**20), "chosen": chosen, "chosen_s": ms[chosen] / 1e3, "fraction_of_bound": None,
           "times_s": {k: [v / 1e3] for k, v in ms.items()}, "ulysses": None}
    for k, v in ms.items():
        row[f"{k}_s"] = row[f"{k}_min_s"] = v / 1e3
    for key, ref in (("speedup_vs_flat", "flat"), ("speedup_vs_fair", "flat_p2p"), ("speedup_vs_pxn", "flat_pxn")):
        row[key] = row[f"{ref}_s"] / row["chosen_s"]
    return row


def test_headline_is_against_pxn_on_rail():
    """On rail the headline ("vs ...", first of the speed-ups) is against the PXN-like flat exchange,
    with the fair flat exchange and stock beside it; elsewhere against the fair flat exchange."""
    results = [_row(1, {"flat": 12.0, "flat_p2p": 10.0, "flat_pxn": 4.4, "hierarchical": 4.0}, "hierarchical"),
               _row(16, {"flat": 240.0, "flat_p2p": 200.0, "flat_pxn": 100.0, "hierarchical": 80.0}, "hierarchical")]
    assert bench.headline_reference("rail", results) == "flat_pxn"
    assert bench.headline_reference("shared-uplink", results) == bench.headline_reference(None, results) == "flat_p2p"
    assert bench.headline_reference("rail", [{k: v for k, v in results[0].items() if k != "flat_pxn_s"}]) == "flat_p2p"
    report = {"fabric": "rail", "nodes": 2, "local": 2, "topology": "2x2", "world_size": 4, "levels": [2, 2],
              "dtype": "bfloat16", "reps": 1, "reference": "flat_pxn", "results": results}
    for r in results:
        r["speedup_vs_reference"] = r["speedup_vs_pxn"]
    table = bench.format_report(report).splitlines()
    assert "headline vs pxn" in table[1] and "flat-pxn (PXN)" in table[2]
    assert table[2].split("chosen")[1].split() == ["vs", "pxn", "vs", "fair", "vs", "stock"]
    assert table[4].split()[-3:] == ["1.25x", "2.50x", "3.00x"]  # 16 MiB: 100 / 80, 200 / 80, 240 / 80
    row = bench.summarize(report)
    assert row["reference"] == "flat_pxn" and row["worst_vs_reference"] == pytest.approx(1.1) and row["worst_vs_reference_at_mib"] == 1
    assert row["largest_vs_reference"] == 1.25 and row["largest_vs_fair"] == 2.5 and row["largest_vs_stock"] == 3.0
    summary = bench.format_summary("rail", [row]).splitlines()
    assert "the PXN-like flat exchange (the headline)" in summary[0]
    assert summary[1].split()[1:4] == ["worst", "vs", "pxn"] and "worst vs fair" in summary[1]
    assert summary[2].split()[1:4] == ["1.10x", "1", "1.25x"]


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


@pytest.mark.slow  # a benchmark on the emulated cluster
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
    assert "flat-pxn (PXN)" in captured.err and "headline vs pxn" in captured.err
    (row,) = summary["summary"]
    assert row["shape"] == "2x2" and row["worst_vs_stock"] == report["results"][0]["speedup_vs_flat"]
    assert row["reference"] == "flat_pxn" and row["worst_vs_reference"] == report["results"][0]["speedup_vs_reference"]
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
    assert report["candidates"] == ["flat", "flat_p2p", "flat_pxn", "hierarchical"]
    assert report["tc_drops"] == 0 and report["reference"] == "flat_pxn"
    (r,) = report["results"]
    assert r["size_bytes"] == 1 << 19
    for name in ("flat", "flat_p2p", "flat_pxn", "hierarchical"):
        assert 0 < r[f"{name}_min_s"] <= r[f"{name}_s"], name
        assert len(r["times_s"][name]) == 2
    assert r["chosen"] in report["candidates"]
    assert r["chosen_s"] == r[f"{r['chosen']}_s"] > 0
    assert r["speedup_vs_flat"] == pytest.approx(r["flat_s"] / r["chosen_s"])
    assert r["speedup_vs_fair"] == pytest.approx(r["flat_p2p_s"] / r["chosen_s"])
    assert r["speedup_vs_reference"] == r["speedup_vs_pxn"] == pytest.approx(r["flat_pxn_s"] / r["chosen_s"])
    assert r["bound_s"] == pytest.approx(Fabric("rail", 2, 2).bound_s("all_to_all", 1 << 19))
    assert r["bound_flat_routes_s"] == pytest.approx(2 * r["bound_s"]) and r["bound_pxn_routes_s"] == pytest.approx(r["bound_s"])
    assert r["fraction_of_bound"] == pytest.approx(r["chosen_s"] / r["bound_s"])
    # Every other candidate timed against gloo's fair flat exchange; no pipelining below 1 MiB.
    assert r["autotune"]["reference"] == "flat_p2p" and set(r["autotune"]["ratios"]) == {"flat", "flat_pxn", "hierarchical"}
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
        assert report["reference"] == ("flat_pxn" if preset == "rail" else "flat_p2p")
        for r in report["results"]:
            assert r["chosen"] in r["times_s"] and r["fraction_of_bound"] >= 0.9 and r["bound_s"] > 0
            assert preset != "rail" or r["flat_pxn_s"] > 0
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
