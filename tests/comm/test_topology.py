"""Unit tests for cocodiff_xfuser.comm.topology (no processes, no devices)."""

from types import SimpleNamespace

import pytest
import torch

from cocodiff_xfuser.comm import topology as topo_mod
from cocodiff_xfuser.comm.topology import (
    Level,
    Topology,
    detect_from_environment,
    load_preset,
    presets,
    resolve,
    restrict,
    xpu_tiles_per_gpu,
)


@pytest.mark.parametrize(
    "spec, sizes, names",
    [
        ("2x2", (2, 2), ("node", "gpu")),
        ("2x6x2", (2, 6, 2), ("node", "gpu", "tile")),
        (" 4X8 ", (4, 8), ("node", "gpu")),
        ("1x8", (1, 8), ("node", "gpu")),
    ],
)
def test_parse(spec, sizes, names):
    t = Topology.parse(spec)
    assert t.sizes == sizes and t.names == names
    assert str(t) == "x".join(map(str, sizes))
    assert Topology.parse(str(t)) == t


@pytest.mark.parametrize("spec", ["", "8", "2x", "x2", "0x4", "2x0", "2x-1", "2.5x2", "axb", "2x2x2x2", "2 x", None, 22])
def test_parse_errors(spec):
    with pytest.raises(ValueError, match="invalid topology"):
        Topology.parse(spec)


def test_level_sizes_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        Topology((Level("node", 0),))
    with pytest.raises(ValueError, match="at least one level"):
        Topology(())


def test_rank_numbering_innermost_fastest():
    t = Topology.parse("2x6x2")
    for node in range(2):
        for gpu in range(6):
            for tile in range(2):
                assert t.coords((node * 6 + gpu) * 2 + tile) == (node, gpu, tile)
    with pytest.raises(ValueError):
        t.coords(24)


def test_presets():
    aurora = Topology.from_preset("aurora", 24)
    assert aurora.sizes == (2, 6, 2) and aurora.names == ("node", "gpu", "tile")
    assert aurora.levels[0].bandwidth_gbps is not None
    assert Topology.from_preset("aurora", 12).sizes == (1, 6, 2)
    dgx = Topology.from_preset("dgx-h100", 16)
    assert dgx.sizes == (2, 8) and dgx.levels[1].bandwidth_gbps == 450
    h200 = Topology.from_preset("dgx-h200", 32)
    assert h200.sizes == (4, 8) and h200.levels[1].bandwidth_gbps == 450 and h200.levels[0].bandwidth_gbps == 50
    pcie = Topology.from_preset("pcie-8gpu", 16)
    assert pcie.sizes == (2, 8) and pcie.levels[1].bandwidth_gbps < 100  # no NVLink
    with pytest.raises(ValueError, match="12 ranks per node.*world size 8"):
        Topology.from_preset("aurora", 8)
    with pytest.raises(ValueError, match="unknown topology preset.*aurora"):
        Topology.from_preset("no-such-machine", 8)
    with pytest.raises(ValueError, match="unknown topology preset"):
        Topology.from_preset("../configs/aurora", 12)  # names, not relative paths into configs/


def test_preset_names():
    assert {"aurora", "dgx-h100", "dgx-h200", "pcie-8gpu"} <= set(presets())
    assert presets() == sorted(presets())


@pytest.mark.parametrize("name", presets())
def test_shipped_presets_follow_the_schema(name):
    """Every shipped preset loads, and every level carries bandwidth, latency and a citation
    (the cost model reads them)."""
    preset = load_preset(name)
    assert preset.description and preset.source and preset.path.name == f"{name}.yaml"
    for level in preset.levels:
        assert level.bandwidth_gbps > 0 and level.latency_us > 0, (name, level)
        assert isinstance(level.source, str) and len(level.source) > 20, (name, level)
    topology = preset.topology(2 * preset.ranks_per_node)
    assert topology.world_size == 2 * preset.ranks_per_node and topology.sizes[0] == 2
    assert topology.levels[0].latency_us == preset.levels[0].latency_us
    assert topology.levels[0].source == preset.levels[0].source
    # Outer levels are the slow ones.
    bandwidths = [level.bandwidth_gbps for level in preset.levels]
    assert bandwidths == sorted(bandwidths), (name, bandwidths)


def test_level_keyword_defaults():
    level = Level("gpu", 4)
    assert level.bandwidth_gbps is None and level.latency_us is None and level.source is None
    assert Level("gpu", 4, 450.0).bandwidth_gbps == 450.0
    assert Level("gpu", 4, latency_us=2.0, source="measured: x").latency_us == 2.0
    with pytest.raises(ValueError, match="latency_us must be a positive number"):
        Level("gpu", 4, latency_us=0)


def test_preset_from_path(tmp_path):
    path = tmp_path / "rack.yaml"
    path.write_text(
        "description: two racks\nsource: 'measured: osu_bw'\nlevels:\n  - name: rack\n    latency_us: 5\n"
        "  - name: node\n    size: 2\n  - name: gpu\n    size: 4\n    bandwidth_gbps: 100\n    source: a datasheet\n"
    )
    t = Topology.from_preset(path, 16)
    assert t.sizes == (2, 2, 4) and t.names == ("rack", "node", "gpu") and t.levels[2].bandwidth_gbps == 100.0
    assert t.levels[0].latency_us == 5.0 and t.levels[2].source == "a datasheet" and t.levels[1].source is None
    preset = load_preset(str(path))
    assert preset.description == "two racks" and preset.source == "measured: osu_bw" and preset.ranks_per_node == 8


@pytest.mark.parametrize(
    "text, match",
    [
        ("levels: []\n", "non-empty 'levels'"),
        ("{}\n", "non-empty 'levels'"),
        ("levels:\n  - name: node\n    size: 2\n  - name: gpu\n    size: 4\n", "must not set a size"),
        ("levels:\n  - name: node\n  - name: gpu\n", "needs a 'size'"),
        ("levels:\n  - size: 4\n", "needs a 'name'"),
        ("levels:\n  - name: node\n  - name: gpu\n    size: 0\n", "positive"),
    ],
)
def test_preset_errors(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        Topology.from_preset(path, 8)


_GOOD_INNER = "  - name: gpu\n    size: 4\n"


@pytest.mark.parametrize(
    "text, key, match",
    [
        # unknown keys (a typo must not be silently ignored)
        ("levels:\n  - name: node\n  - name: gpu\n    size: 4\n    bandwith_gbps: 450\n",
         "levels[1]", r"unknown key 'bandwith_gbps' \(expected one of: name, size, bandwidth_gbps, latency_us, source\)"),
        ("level:\n  - name: node\n", "'level'", r"unknown key 'level' \(expected one of: levels, description, source\)"),
        # missing required keys
        ("description: x\n", "levels", "non-empty 'levels'"),
        ("levels:\n  - name: node\n  - name: gpu\n", "levels[1]", "missing required key 'size'"),
        ("levels:\n  - name: node\n  - size: 4\n", "levels[1]", "missing required key 'name'"),
        # wrong types and values
        ("levels:\n  - name: node\n  - name: gpu\n    size: '4'\n", "levels[1].size", "positive integer, got '4'"),
        ("levels:\n  - name: node\n  - name: gpu\n    size: 2.5\n", "levels[1].size", "positive integer, got 2.5"),
        ("levels:\n  - name: node\n  - name: gpu\n    size: true\n", "levels[1].size", "positive integer, got True"),
        ("levels:\n  - name: node\n    bandwidth_gbps: fast\n" + _GOOD_INNER, "levels[0].bandwidth_gbps", "positive number, got 'fast'"),
        ("levels:\n  - name: node\n    bandwidth_gbps: -1\n" + _GOOD_INNER, "levels[0].bandwidth_gbps", "positive number, got -1"),
        ("levels:\n  - name: node\n    latency_us: 0\n" + _GOOD_INNER, "levels[0].latency_us", "positive number, got 0"),
        ("levels:\n  - name: node\n    latency_us: .nan\n" + _GOOD_INNER, "levels[0].latency_us", "positive number"),
        ("levels:\n  - name: node\n    source: 3\n" + _GOOD_INNER, "levels[0].source", "non-empty string, got 3"),
        ("levels:\n  - name: 5\n" + _GOOD_INNER, "levels[0].name", "non-empty string, got 5"),
        ("levels:\n  - name: node\n    size: 2\n" + _GOOD_INNER, "levels[0].size", "must not set a size"),
        ("description: [a]\nlevels:\n  - name: node\n" + _GOOD_INNER, "description", "non-empty string"),
        ("source: ''\nlevels:\n  - name: node\n" + _GOOD_INNER, "source", "non-empty string"),
        ("levels:\n  - name: gpu\n" + _GOOD_INNER, "levels[1].name", "duplicate level name 'gpu'"),
        ("levels:\n  - node\n", "levels[0]", "expected a mapping"),
        ("levels: {name: node}\n", "levels", "non-empty 'levels' list"),
        ("- name: node\n", "levels", "expected a mapping with a non-empty 'levels' list"),
        ("levels: [\n", "YAML", "not valid YAML"),
    ],
)
def test_preset_schema_errors_name_file_and_key(tmp_path, text, key, match):
    path = tmp_path / "dgx-h200.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        Topology.from_preset(path, 8)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert key in message and "\n" not in message, message


def test_validate():
    t = Topology.parse("2x4")
    assert t.validate(8) is t
    with pytest.raises(ValueError, match=r"2x4.*8 ranks.*world size is 6"):
        t.validate(6)


def test_detect():
    assert Topology.detect(4, ["a", "a", "b", "b"]).sizes == (2, 2)
    assert Topology.detect(4, ["a"] * 4, local_world_size=4).sizes == (1, 4)
    # Several torchrun agents on one host: emulated nodes.
    assert Topology.detect(4, ["a"] * 4, local_world_size=2).sizes == (2, 2)
    aurora = Topology.detect(24, ["x"] * 12 + ["y"] * 12, local_world_size=12, xpu_tiles_per_gpu=2)
    assert aurora.sizes == (2, 6, 2) and aurora.names == ("node", "gpu", "tile")
    assert Topology.detect(2, ["a", "b"], xpu_tiles_per_gpu=1).sizes == (2, 1)


@pytest.mark.parametrize(
    "world, hosts, local, tiles, match",
    [
        (4, ["a", "b", "a", "b"], None, None, "not contiguous"),
        (4, ["a", "a", "a", "b"], None, None, "different numbers"),
        (4, ["a", "a", "b"], None, None, "3 hostnames for world size 4"),
        (6, ["a"] * 6, 4, None, "LOCAL_WORLD_SIZE=4 does not divide"),
        (6, ["a"] * 3 + ["b"] * 3, None, 2, "not a multiple of 2 tiles"),
    ],
)
def test_detect_errors(world, hosts, local, tiles, match):
    with pytest.raises(ValueError, match=match):
        Topology.detect(world, hosts, local, tiles)


@pytest.mark.parametrize(
    "spec, ranks, levels",
    [
        ("4x2", [0, 1, 2, 3], [2, 2]),  # partial span of the node level
        ("2x4", [0, 1, 2, 3], [4]),  # one node: a single level
        ("2x2", [0, 2], [2]),  # strided: across nodes only
        ("2x2", [2, 0], [2]),  # order of the input does not matter
        ("2x2", [0, 1, 2, 3], [2, 2]),
        ("4x2", [0, 1, 2, 3, 4, 5], [3, 2]),
        ("2x6x2", list(range(24)), [2, 6, 2]),
        ("2x6x2", list(range(12)), [6, 2]),
        ("2x6x2", [0, 1], [2]),  # the two tiles of one GPU
        ("2x6x2", [0, 12], [2]),  # same tile across nodes
        ("2x6x2", [0, 2, 4], [3]),  # part of the GPUs of a node, one tile each
        ("2x6x2", [0, 1, 12, 13], [2, 2]),  # nodes x tiles, skipping the GPU level
        ("2x4", [5], []),
    ],
)
def test_restrict(spec, ranks, levels):
    t = Topology.parse(spec)
    assert restrict(t, ranks) == levels
    assert t.restrict(ranks) == levels


@pytest.mark.parametrize(
    "spec, ranks, match",
    [
        ("2x2", [0, 1, 2], "not a regular sub-grid"),
        ("2x4", [0, 1, 3, 6], "not a regular sub-grid"),
        ("2x4", [0, 1, 4], "not a regular sub-grid"),
        ("2x2", [0, 0, 1, 1], "distinct"),
        ("2x2", [], "non-empty"),
        ("2x2", [0, 4], "outside topology"),
    ],
)
def test_restrict_irregular(spec, ranks, match):
    with pytest.raises(ValueError, match=match):
        restrict(Topology.parse(spec), ranks)


def test_resolve(monkeypatch):
    assert resolve("2x2", 4).sizes == (2, 2)
    assert resolve("dgx-h100", 16).sizes == (2, 8)
    assert resolve("pcie-8gpu", 8).sizes == (1, 8)
    with pytest.raises(ValueError, match="world size is 8"):
        resolve("2x2", 8)
    monkeypatch.setattr(topo_mod, "detect_from_environment", lambda group=None: Topology.parse("2x4"))
    assert resolve(None, 8).sizes == (2, 4)


def _fake_xpu(name="Intel(R) Data Center GPU Max 1550", available=True):
    return SimpleNamespace(is_available=lambda: available, get_device_properties=lambda i: SimpleNamespace(name=name))


def test_xpu_tiles_per_gpu():
    assert xpu_tiles_per_gpu({}, _fake_xpu()) == 2
    assert xpu_tiles_per_gpu({}, _fake_xpu("Intel(R) Data Center GPU Max 1100")) == 1
    assert xpu_tiles_per_gpu({"ZE_FLAT_DEVICE_HIERARCHY": "COMPOSITE"}, _fake_xpu()) == 1
    assert xpu_tiles_per_gpu({"ZE_FLAT_DEVICE_HIERARCHY": "FLAT"}, _fake_xpu()) == 2
    assert xpu_tiles_per_gpu({}, _fake_xpu(available=False)) is None
    assert xpu_tiles_per_gpu({"COCODIFF_TILES_PER_GPU": "4"}, _fake_xpu(available=False)) == 4
    assert xpu_tiles_per_gpu({}) is None  # this machine: torch.xpu present, no device


def test_detect_from_environment(monkeypatch):
    import torch.distributed as dist

    hosts = ["n0"] * 12 + ["n1"] * 12

    def all_gather_object(out, obj, group=None):
        out[:] = hosts

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 24)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "12")
    monkeypatch.delenv("COCODIFF_TILES_PER_GPU", raising=False)
    monkeypatch.delenv("ZE_FLAT_DEVICE_HIERARCHY", raising=False)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "get_device_properties", lambda i: SimpleNamespace(name="Intel(R) Data Center GPU Max 1550"))
    assert detect_from_environment().sizes == (2, 6, 2)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    assert detect_from_environment().sizes == (2, 12)
