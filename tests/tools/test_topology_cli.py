"""``cocodiff topology``: groups as xfuser 0.7.0 builds them, TAPA's plan as tapa.py builds it, errors.

In process (``cli.main``), no process group: the cross-checks run xfuser's RankGenerator, yunchang's
``set_seq_parallel_pg`` and ``HierarchicalAllToAll.__init__`` against a recording fake of the few
``torch.distributed`` calls they make.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch.distributed as dist

from cocodiff_xfuser.comm import subgroups, tapa
from cocodiff_xfuser.comm.topology import Topology
from cocodiff_xfuser.tools import cli, topology_cli


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch):
    for key in ("LOCAL_WORLD_SIZE", "WORLD_SIZE", "COCODIFF_TILES_PER_GPU"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(topology_cli, "_accelerator_count", lambda: 0)


def _run(capsys, *args: str) -> tuple[int, str, str]:
    rc = cli.main(["topology", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _json(capsys, *args: str) -> dict:
    rc, out, err = _run(capsys, *args, "--json")
    assert rc == 0, err
    return json.loads(out)


def test_2x4_json_groups_and_phases(capsys):
    rep = _json(capsys, "--topology", "2x4")
    assert rep["topology"]["spec"] == "2x4" and rep["topology"]["world_size"] == 8
    assert rep["topology"]["origin"]["kind"] == "sizes"
    assert rep["degrees"] == {"ulysses": 8, "ring": 1, "cfg": 1}
    assert rep["groups"]["ulysses"] == [list(range(8))]
    [plan] = rep["plans"]
    assert plan["algorithm"] == "hierarchical"
    assert plan["levels"] == [{"name": "node", "size": 2}, {"name": "gpu", "size": 4}]
    gpu, node = plan["phases"]  # innermost (fastest) level first
    assert gpu["level"] == "gpu" and gpu["subgroups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert node["level"] == "node" and node["subgroups"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert gpu["sent_fraction"] == {"value": 0.75, "fraction": "3/4"} and gpu["peers"] == 3
    assert node["sent_fraction"] == {"value": 0.5, "fraction": "1/2"} and node["peers"] == 1
    # The flat exchange sends the same share over the node level (TAPA changes message count, not slow bytes).
    assert plan["flat_fraction_by_level"] == {"node": {"value": 0.5, "fraction": "1/2"}, "gpu": {"value": 0.375, "fraction": "3/8"}}


def test_2x4_text(capsys):
    rc, out, err = _run(capsys, "--topology", "2x4")
    assert rc == 0 and err == ""
    assert "topology 2x4 (2 node x 4 gpu), 8 ranks" in out
    assert "ulysses groups:  [0..7]" in out
    assert "phase 1 gpu    4 ranks, sent 3/4 to 3 peers" in out and "sub-groups [0..3] [4..7]" in out
    assert "phase 2 node   2 ranks, sent 1/2 to 1 peer," in out and "sub-groups [0,4] [1,5] [2,6] [3,7]" in out


def test_preset_with_world_size(capsys):
    rep = _json(capsys, "--topology", "dgx-h100", "--world-size", "16", "--ulysses-degree", "8", "--ring-degree", "2")
    t = rep["topology"]
    assert t["spec"] == "2x8" and t["origin"]["preset"] == "dgx-h100" and t["origin"]["path"].endswith("dgx-h100.yaml")
    assert [(lv["name"], lv["bandwidth_gbps"]) for lv in t["levels"]] == [("node", 50.0), ("gpu", 450.0)]
    assert all(lv["latency_us"] > 0 and lv["source"] for lv in t["levels"])
    assert rep["groups"]["ulysses"] == [list(range(8)), list(range(8, 16))]
    assert rep["groups"]["ring"] == [[i, i + 8] for i in range(8)]
    for plan in rep["plans"]:  # each Ulysses group is one node: NVLink only, flat
        assert plan["algorithm"] == "flat" and plan["levels"] == [{"name": "gpu", "size": 8}]
        [phase] = plan["phases"]
        assert phase["bandwidth_gbps"] == 450.0 and phase["subgroups"] == [plan["ranks"]]


def test_aurora_24_ranks(capsys):
    rep = _json(capsys, "--topology", "aurora", "--world-size", "24")
    assert rep["topology"]["spec"] == "2x6x2" and rep["degrees"]["ulysses"] == 24
    [plan] = rep["plans"]
    assert plan["algorithm"] == "hierarchical" and [p["level"] for p in plan["phases"]] == ["tile", "gpu", "node"]
    tile, gpu, node = plan["phases"]
    assert tile["subgroups"] == [[r, r + 1] for r in range(0, 24, 2)]
    assert gpu["subgroups"] == [list(range(s, s + 12, 2)) for s in (0, 1, 12, 13)]
    assert node["subgroups"] == [[r, r + 12] for r in range(12)]
    assert [p["sent_fraction"]["fraction"] for p in plan["phases"]] == ["1/2", "5/6", "1/2"]
    assert [p["bandwidth_gbps"] for p in plan["phases"]] == [100.0, 28.0, 16.7]
    rc, out, _ = _run(capsys, "--topology", "aurora", "--world-size", "24")
    assert rc == 0 and "preset aurora" in out and "2 node x 6 gpu x 2 tile" in out and "source:" in out


def test_cfg_parallel_and_repeated_plans(capsys):
    rep = _json(capsys, "--topology", "4x2", "--cfg-parallel")
    assert rep["degrees"] == {"ulysses": 4, "ring": 1, "cfg": 2}
    assert rep["groups"]["ulysses"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and rep["groups"]["cfg"] == [[i, i + 4] for i in range(4)]
    assert [p["levels"] for p in rep["plans"]] == [[{"name": "node", "size": 2}, {"name": "gpu", "size": 2}]] * 2
    assert rep["plans"][1]["phases"][0]["subgroups"] == [[4, 5], [6, 7]]
    rc, out, _ = _run(capsys, "--topology", "4x2", "--cfg-parallel")
    assert "1 more group(s) with the plan of [0..3], on their own ranks: [4..7]" in out


def test_detected_without_topology(capsys, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    rep = _json(capsys)
    origin = rep["topology"]["origin"]
    assert rep["topology"]["spec"] == "2x2" and origin["kind"] == "detected"
    assert origin["ranks_per_node_from"] == "LOCAL_WORLD_SIZE" and origin["world_size_from"] == "WORLD_SIZE"
    rc, out, _ = _run(capsys)
    assert rc == 0 and "detected on" in out and "what this host alone detects" in out
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("WORLD_SIZE")
    assert _json(capsys, "--world-size", "4")["topology"]["spec"] == "1x4"  # all ranks on this host
    monkeypatch.setattr(topology_cli, "_accelerator_count", lambda: 8)
    assert _json(capsys)["topology"]["spec"] == "1x8"
    assert _json(capsys, "--world-size", "16")["topology"]["spec"] == "2x8"
    monkeypatch.setenv("COCODIFF_TILES_PER_GPU", "2")  # XPU tiles as ranks
    assert _json(capsys)["topology"]["spec"] == "1x4x2"


@pytest.mark.parametrize(
    "args, match",
    [
        (["--topology", "2x4", "--ulysses-degree", "3"], "not the world size 8"),
        (["--topology", "2x4", "--ulysses-degree", "4"], "ulysses degree 4 x ring degree 1 x CFG degree 1 = 4"),
        (["--topology", "2x4", "--ring-degree", "3"], "not a multiple of ring degree 3"),
        (["--topology", "2x4", "--world-size", "6"], "has 8 ranks but the world size is 6"),
        (["--topology", "aurora"], "needs --world-size"),
        (["--topology", "aurora", "--world-size", "8"], "12 ranks per node; world size 8"),
        (["--topology", "no-such-machine", "--world-size", "8"], "unknown topology preset 'no-such-machine'"),
        (["--topology", "2x0"], "invalid topology"),
        (["--topology", "2x4", "--ring-degree", "0"], "ring degree must be a positive integer"),
        (["--world-size", "0"], "--world-size must be a positive integer"),
        ([], "nothing to detect"),
    ],
)
def test_errors_exit_2_with_one_line(capsys, args, match):
    rc, out, err = _run(capsys, *args)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("cocodiff topology: ") and match in err, err


def test_bad_key_in_preset_file_exits_2_naming_file_and_key(capsys, tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("levels:\n  - name: node\n  - name: gpu\n    size: 4\n    bandwith_gbps: 450\n")
    rc, _, err = _run(capsys, "--topology", str(path), "--world-size", "8")
    assert rc == 2 and err.count("\n") == 1
    assert f"{path}: levels[1]: unknown key 'bandwith_gbps'" in err


def test_bad_env_exits_2(capsys, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    rc, _, err = _run(capsys, "--world-size", "4")
    assert rc == 2 and "not a multiple of the 3 ranks per node (LOCAL_WORLD_SIZE)" in err
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    rc, _, err = _run(capsys)
    assert rc == 2 and "LOCAL_WORLD_SIZE='two' is not an integer" in err


# ---------------------------------------------------------------------------------------------
# Cross-checks against the code that builds the groups at run time


def _load(package: str, relative: str, name: str):
    """A module file of an installed package, without importing the package (xfuser's import is slow)."""
    root = Path(importlib.util.find_spec(package).submodule_search_locations[0])
    spec = importlib.util.spec_from_file_location(name, root / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("world, ulysses, ring, cfg", [(8, 8, 1, 1), (8, 4, 2, 1), (8, 2, 2, 2), (16, 4, 1, 4), (24, 6, 2, 2), (6, 3, 1, 2)])
def test_groups_match_xfuser_and_yunchang(monkeypatch, world, ulysses, ring, cfg):
    groups = topology_cli.parallel_groups(world, ulysses, ring, cfg)
    # xfuser 0.7.0 initialize_model_parallel: RankGenerator(tp, sp, pp, cfg, dp, fs, "tp-sp-pp-cfg-dp").
    utils = _load("xfuser", "core/distributed/utils.py", "_xfuser_distributed_utils")
    gen = utils.RankGenerator(1, ulysses * ring, 1, cfg, 1, 1, "tp-sp-pp-cfg-dp")
    assert groups["sp"] == gen.get_ranks("sp")
    assert sorted(groups["cfg"]) == sorted(gen.get_ranks("cfg"))
    # yunchang.set_seq_parallel_pg as xfuser calls it (no use_ulysses_low: the default, True).
    yglobals = _load("yunchang", "globals.py", "_yunchang_globals")
    created: list[list[int]] = []
    monkeypatch.setattr(dist, "new_group", lambda ranks, *a, **k: created.append(list(ranks)) or tuple(ranks))
    ulysses_of, ring_of = {}, {}
    for rank in range(world):
        created.clear()
        yglobals.set_seq_parallel_pg(ulysses, ring, rank, world)
        ulysses_of[rank] = list(yglobals.PROCESS_GROUP.ULYSSES_PG)
        ring_of[rank] = list(yglobals.PROCESS_GROUP.RING_PG)
    assert sorted(map(tuple, groups["ulysses"])) == sorted({tuple(g) for g in ulysses_of.values()})
    assert sorted(map(tuple, groups["ring"])) == sorted({tuple(g) for g in ring_of.values()})


@pytest.mark.parametrize(
    "spec, ulysses, ring, cfg",
    [("2x4", 8, 1, 1), ("4x2", 4, 2, 1), ("4x2", 8, 1, 1), ("2x6x2", 24, 1, 1), ("2x6x2", 12, 1, 2), ("2x6x2", 4, 1, 6),
     ("4x4", 8, 2, 1), ("2x2x2", 8, 1, 1), ("2x3", 3, 1, 2), ("3x4", 6, 2, 1)],
)
def test_plan_matches_tapa(monkeypatch, spec, ulysses, ring, cfg):
    """The sub-groups the CLI prints are the ones HierarchicalAllToAll creates, rank by rank."""
    topology = Topology.parse(spec)
    world = topology.world_size
    groups = topology_cli.parallel_groups(world, ulysses, ring, cfg)["ulysses"]
    plans = {tuple(p["ranks"]): p for p in (topology_cli.exchange_plan(topology, g) for g in groups)}
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "new_group", lambda ranks, *a, **k: list(ranks))  # a group is its ranks here
    monkeypatch.setattr(dist, "barrier", lambda group=None, *a, **k: None)
    monkeypatch.setattr(subgroups, "_created", {})
    for rank in range(world):
        monkeypatch.setattr(dist, "get_rank", lambda group=None, rank=rank: rank)
        exchange = tapa.HierarchicalAllToAll(topology, groups)
        [mine] = [g for g in groups if rank in g]
        plan = plans[tuple(sorted(mine))]
        built = exchange.plans.get(tuple(sorted(mine)))
        # No plan in tapa: the flat exchange (fewer than two levels, or not a regular sub-grid).
        assert (built is not None) == (plan["algorithm"] == "hierarchical"), (plan, built)
        if built is None:
            continue
        assert list(built.levels) == [lv["size"] for lv in plan["levels"]]
        # tapa keeps this rank's sub-group per level, outermost first; the CLI lists phases innermost first.
        for level_ranks, phase in zip(built.level_groups, reversed(plan["phases"])):
            assert level_ranks in phase["subgroups"]
            assert sorted(r for g in phase["subgroups"] for r in g) == sorted(mine)
