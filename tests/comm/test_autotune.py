"""Autotuned algorithm choice and the a2a benchmark on real gloo process groups (4 ranks)."""

import json
import os
from pathlib import Path

import pytest

from cocodiff_xfuser.comm.autotune import pick, size_bucket
from cocodiff_xfuser.comm.registry import A2A_SETTINGS, ALGORITHMS
from cocodiff_xfuser.tools.launcher import torchrun

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "workers" / "collectives_worker.py"
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("autotune")
    return torchrun(4, [str(WORKER), "--cases", "autotune", "--tmpdir", str(tmp)], env=ENV, timeout=180).stdout


def test_size_bucket():
    assert [size_bucket(n) for n in (0, 1, 2, 3, 4, 5, 4096, 4097)] == [1, 1, 2, 4, 4, 8, 4096, 8192]


def test_pick_prefers_simpler_within_margin():
    assert pick({"flat": 1.0, "flat-p2p": 0.98, "hierarchical": 0.5}, 0.03) == "hierarchical"
    assert pick({"flat": 1.0, "flat-p2p": 0.98, "hierarchical": 0.975}, 0.03) == "flat"
    assert pick({"flat": 1.0, "flat-p2p": 0.6, "hierarchical": 0.59}, 0.03) == "flat-p2p"
    assert pick({"flat": 1.0, "hierarchical": 0.9}, 0.03) == "hierarchical"
    assert pick({"flat": 1.0}, 0.03) == "flat"
    # Reduced (identical) timings give identical picks; order of the mapping does not matter.
    assert pick({"hierarchical": 0.5, "flat": 1.0}, 0.03) == pick({"flat": 1.0, "hierarchical": 0.5}, 0.03)


def test_modes_cover_algorithms():
    assert A2A_SETTINGS[0] == "auto" and set(A2A_SETTINGS[1:]) == set(ALGORITHMS)
    assert ALGORITHMS[0] == "flat"  # the stock exchange, the tie winner


def test_autotune_cases(report):
    # Agreement across ranks, caching, logging once, bias by one slow rank, overrides, JSON.
    assert "CASE autotune ok" in report, report


def test_exported_decisions(report):
    line = next(line for line in report.splitlines() if line.startswith("DECISIONS "))
    data = json.loads(line.removeprefix("DECISIONS "))
    assert data["version"] == 1 and data["topology"] == "2x2"
    assert sorted(d["bucket_bytes"] for d in data["decisions"]) == [65536, 1 << 20]
    for d in data["decisions"]:
        assert d["group"] == [0, 1, 2, 3] and d["algorithm"] in ALGORITHMS
        assert d["flat_s"] > 0 and d["hierarchical_s"] > 0 and d["flat_p2p_s"] > 0


def test_bench_a2a_cli():
    argv = ["-m", "cocodiff_xfuser.tools.bench.a2a", "--topology", "2x2", "--sizes-mib", "0.25,1", "--reps", "3", "--dtype", "fp32", "--json"]
    out = torchrun(4, argv, env=ENV, timeout=180).stdout
    report = json.loads(out[out.index("{"):])
    assert report["topology"] == "2x2" and report["world_size"] == 4 and report["levels"] == [2, 2]
    assert report["candidates"] == ["flat", "flat_p2p", "hierarchical"]
    assert report["timing"] == "common-start"  # every rank on this host
    assert [r["size_bytes"] for r in report["results"]] == [1 << 18, 1 << 20]
    for r in report["results"]:
        assert r["chosen"] in report["candidates"]
        for name in ("flat", "flat_p2p", "hierarchical", "hierarchical_collective"):
            assert 0 < r[f"{name}_min_s"] <= r[f"{name}_s"] and len(r["times_s"][name]) == 3
        assert r["chosen_s"] == r[f"{r['chosen']}_s"]
        assert r["speedup_vs_flat"] == pytest.approx(r["flat_s"] / r["chosen_s"])
