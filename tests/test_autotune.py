"""Autotuned algorithm choice and the a2a benchmark on real gloo process groups (4 ranks)."""

import json
import os
from pathlib import Path

import pytest

from cocodiff_xfuser.autotune import size_bucket
from cocodiff_xfuser.launcher import torchrun

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "workers" / "collectives_worker.py"
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("autotune")
    return torchrun(4, [str(WORKER), "--cases", "autotune", "--tmpdir", str(tmp)], env=ENV, timeout=180).stdout


def test_size_bucket():
    assert [size_bucket(n) for n in (0, 1, 2, 3, 4, 5, 4096, 4097)] == [1, 1, 2, 4, 4, 8, 4096, 8192]


def test_autotune_cases(report):
    # Agreement across ranks, caching, logging once, bias by one slow rank, overrides, JSON.
    assert "CASE autotune ok" in report, report


def test_exported_decisions(report):
    line = next(line for line in report.splitlines() if line.startswith("DECISIONS "))
    data = json.loads(line.removeprefix("DECISIONS "))
    assert data["version"] == 1 and data["topology"] == "2x2"
    assert sorted(d["bucket_bytes"] for d in data["decisions"]) == [65536, 1 << 20]
    for d in data["decisions"]:
        assert d["group"] == [0, 1, 2, 3] and d["algorithm"] in ("flat", "hierarchical")
        assert d["flat_s"] > 0 and d["hierarchical_s"] > 0


def test_bench_a2a_cli():
    argv = ["-m", "cocodiff_xfuser.bench_a2a", "--topology", "2x2", "--sizes-mib", "0.25,1", "--reps", "3", "--dtype", "fp32", "--json"]
    out = torchrun(4, argv, env=ENV, timeout=180).stdout
    report = json.loads(out[out.index("{"):])
    assert report["topology"] == "2x2" and report["world_size"] == 4 and report["levels"] == [2, 2]
    assert [r["size_bytes"] for r in report["results"]] == [1 << 18, 1 << 20]
    for r in report["results"]:
        assert r["chosen"] in ("flat", "hierarchical")
        assert 0 < r["flat_min_s"] <= r["flat_s"] and 0 < r["hierarchical_min_s"] <= r["hierarchical_s"]
        assert r["chosen_s"] == r[f"{r['chosen']}_s"]
        assert r["speedup_vs_flat"] == pytest.approx(r["flat_s"] / r["chosen_s"])
