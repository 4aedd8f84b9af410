"""Autotuned algorithm choice and the a2a benchmark on real gloo process groups (4 ranks)."""

import json
import os
from pathlib import Path

import pytest

from cocodiff_xfuser.comm.autotune import (
    MAX_BURST,
    MAX_REPS,
    candidate_key,
    pick,
    sampling,
    size_bucket,
    split_key,
)
from cocodiff_xfuser.comm.autotune import A2A_SETTINGS, ALGORITHMS
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


def test_pick_needs_evidence_before_leaving_flat():
    # (median ratio to flat, upper confidence bound): both must say "faster".
    assert pick({"flat-p2p": [0.98, 1.0], "hierarchical": [0.5, 0.6]}, 0.03) == "hierarchical"
    assert pick({"flat-p2p": [0.9, 1.02], "hierarchical": [0.5, 1.1]}, 0.03) == "flat"  # noisy: stays stock
    assert pick({"flat-p2p": [0.98, 0.99]}, 0.03) == "flat"  # within the margin
    assert pick({"flat-p2p": [0.6, 0.7], "hierarchical": [0.59, 0.65]}, 0.03) == "flat-p2p"  # simpler on a tie
    assert pick({"hierarchical": [0.5, 0.6], "hierarchical/2": [0.49, 0.55]}, 0.03) == "hierarchical"
    assert pick({"hierarchical": [0.5, 0.6], "hierarchical/4": [0.3, 0.4]}, 0.03) == "hierarchical/4"
    assert pick({}, 0.03) == "flat"
    # Reduced (identical) inputs give identical picks; the order of the mapping does not matter.
    a = {"hierarchical": [0.5, 0.6], "flat-p2p": [0.49, 0.52]}
    assert pick(a, 0.03) == pick(dict(reversed(list(a.items()))), 0.03) == "flat-p2p"


def test_pick_against_the_fair_flat_reference():
    # On gloo the reference is flat-p2p: stock flat is one more candidate that needs evidence.
    assert pick({"flat": [0.99, 1.1], "hierarchical": [1.2, 1.3]}, 0.03, "flat-p2p") == "flat-p2p"
    assert pick({"flat": [0.9, 0.95], "hierarchical": [1.2, 1.3]}, 0.03, "flat-p2p") == "flat"
    assert pick({"flat": [0.6, 0.7], "hierarchical": [0.59, 0.65]}, 0.03, "flat-p2p") == "flat"  # simpler on a tie
    assert pick({}, 0.03, "flat-p2p") == "flat-p2p"


def test_sampling_grows_for_small_messages():
    assert sampling(16 << 20, 9) == (9, 2) and sampling(4 << 20, 9) == (9, 2)
    pairs, burst = sampling(1 << 20, 9)
    assert pairs == 19 and burst == 4  # 2x the pairs (odd) and calls per sample at 1/4 the size
    assert sampling(1 << 10, 9) == (MAX_REPS, MAX_BURST)


def test_candidate_keys_round_trip():
    assert candidate_key("hierarchical", 4) == "hierarchical/4" and candidate_key("flat") == "flat"
    assert split_key("hierarchical/4") == ("hierarchical", 4) and split_key("flat-p2p") == ("flat-p2p", 1)


def test_modes_cover_algorithms():
    assert A2A_SETTINGS[0] == "auto" and set(A2A_SETTINGS[1:]) == set(ALGORITHMS)
    assert ALGORITHMS[:2] == ("flat", "flat-p2p")  # stock, then the fair flat: the simplest first


@pytest.mark.distributed
def test_autotune_cases(report):
    # Agreement across ranks, caching, logging once, bias by one slow rank, overrides, JSON.
    assert "CASE autotune ok" in report, report


@pytest.mark.distributed
def test_exported_decisions(report):
    line = next(line for line in report.splitlines() if line.startswith("DECISIONS "))
    data = json.loads(line.removeprefix("DECISIONS "))
    assert data["version"] == 1 and data["topology"] == "2x2"
    assert sorted(d["bucket_bytes"] for d in data["decisions"]) == [65536, 1 << 20]
    for d in data["decisions"]:
        assert d["group"] == [0, 1, 2, 3] and d["algorithm"] in ALGORITHMS
        assert d["flat_s"] > 0 and d["hierarchical_s"] > 0 and d["flat_p2p_s"] > 0 and d["flat_pxn_s"] > 0


@pytest.mark.slow  # the benchmark's command line: a benchmark run
@pytest.mark.distributed
def test_bench_a2a_cli():
    argv = ["-m", "cocodiff_xfuser.tools.bench.a2a", "--topology", "2x2", "--sizes-mib", "0.25,1", "--reps", "3", "--dtype", "fp32", "--json"]
    out = torchrun(4, argv, env=ENV, timeout=180).stdout
    report = json.loads(out[out.index("{"):])
    assert report["topology"] == "2x2" and report["world_size"] == 4 and report["levels"] == [2, 2]
    assert report["candidates"] == ["flat", "flat_p2p", "flat_pxn", "hierarchical"]
    assert report["timing"] == "common-start"  # every rank on this host
    assert [r["size_bytes"] for r in report["results"]] == [1 << 18, 1 << 20]
    for r in report["results"]:
        assert r["chosen"] in r["times_s"]
        for name in ("flat", "flat_p2p", "flat_pxn", "hierarchical"):
            assert 0 < r[f"{name}_min_s"] <= r[f"{name}_s"] and len(r["times_s"][name]) == 3
        # Pipelined candidates from 1 MiB per rank on.
        assert ("hierarchical_x2" in r["times_s"]) == (r["size_bytes"] >= 1 << 20)
        u = r["ulysses"]  # xfuser's layout (stack, contiguous, reshape) vs cocodiff's, bitwise checked
        assert u["cocodiff_copies_per_exchange"] < u["xfuser_copies_per_exchange"] and u["cocodiff_layout_s"] > 0
        assert r["chosen_s"] == r[f"{r['chosen']}_s"]
        assert r["speedup_vs_flat"] == pytest.approx(r["flat_s"] / r["chosen_s"])
        assert r["speedup_vs_fair"] == pytest.approx(r["flat_p2p_s"] / r["chosen_s"])
        assert r["speedup_vs_pxn"] == pytest.approx(r["flat_pxn_s"] / r["chosen_s"])
