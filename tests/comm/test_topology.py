"""Unit tests for cocodiff_xfuser.comm.topology (no processes, no devices)."""

from types import SimpleNamespace

import pytest
import torch

from cocodiff_xfuser.comm import topology as topo_mod
from cocodiff_xfuser.comm.topology import Level, Topology, detect_from_environment, resolve, restrict, xpu_tiles_per_gpu


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
    with pytest.raises(ValueError, match="12 ranks per node.*world size 8"):
        Topology.from_preset("aurora", 8)
    with pytest.raises(ValueError, match="unknown topology preset.*aurora"):
        Topology.from_preset("no-such-machine", 8)


def test_preset_from_path(tmp_path):
    path = tmp_path / "rack.yaml"
    path.write_text("levels:\n  - name: rack\n  - name: node\n    size: 2\n  - name: gpu\n    size: 4\n    bandwidth_gbps: 100\n")
    t = Topology.from_preset(path, 16)
    assert t.sizes == (2, 2, 4) and t.names == ("rack", "node", "gpu") and t.levels[2].bandwidth_gbps == 100.0


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
