"""Hardware topology of the ranks: nested levels, outermost first.

A topology of sizes ``(2, 6, 2)`` is 2 nodes x 6 GPUs x 2 tiles (Aurora); ``(N, 8)`` is N DGX
nodes. Ranks are numbered contiguously with the innermost level fastest, so
``rank = (node * L + gpu) * T + tile``; this is how torchrun numbers ranks across nodes.
"""

from __future__ import annotations

import math
import os
import re
import socket
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..shipped import CONFIGS

#: Topology presets (the top-level configs/, installed with the package).
CONFIG_DIR = CONFIGS

_DEFAULT_NAMES = {2: ("node", "gpu"), 3: ("node", "gpu", "tile")}

# Intel Data Center GPU Max 1550 (Aurora's PVC) has two stacks ("tiles") per card; the Max 1100
# has one. torch.xpu reports no stack count, so the card name is the only portable hint.
_XPU_TILES_BY_NAME = {"Max 1550": 2}


@dataclass(frozen=True)
class Level:
    """One hardware level: ``size`` children per parent.

    ``bandwidth_gbps`` is the nominal unidirectional bandwidth (GB/s) one rank has for traffic
    that crosses this level, ``latency_us`` the one-way latency (microseconds) of a small
    transfer crossing it, and ``source`` where these figures come from; informational, for cost
    models and reports.
    """

    name: str
    size: int
    bandwidth_gbps: float | None = None
    latency_us: float | None = None
    source: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ValueError(f"level {self.name!r}: size must be a positive integer, got {self.size!r}")
        for key in ("bandwidth_gbps", "latency_us"):
            value = getattr(self, key)
            if value is not None and not _positive_number(value):
                raise ValueError(f"level {self.name!r}: {key} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class Topology:
    levels: tuple[Level, ...]

    def __post_init__(self) -> None:
        if not self.levels:
            raise ValueError("a topology needs at least one level")

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(level.size for level in self.levels)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(level.name for level in self.levels)

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def __str__(self) -> str:
        return "x".join(str(s) for s in self.sizes)

    def describe(self) -> str:
        return " x ".join(f"{level.size} {level.name}" for level in self.levels)

    @classmethod
    def from_sizes(cls, sizes: Sequence[int], names: Sequence[str] | None = None) -> Topology:
        if names is None:
            names = _DEFAULT_NAMES.get(len(sizes)) or tuple(f"level{i}" for i in range(len(sizes)))
        if len(names) != len(sizes):
            raise ValueError(f"{len(sizes)} level sizes but {len(names)} names")
        return cls(tuple(Level(n, s) for n, s in zip(names, sizes)))

    @classmethod
    def parse(cls, spec: str) -> Topology:
        """Parse ``"NxL"`` or ``"NxLxT"`` (nodes x GPUs per node [x tiles per GPU])."""
        fields = spec.strip().lower().split("x") if isinstance(spec, str) else []
        if len(fields) not in _DEFAULT_NAMES:
            raise ValueError(f"invalid topology {spec!r}: expected NxL or NxLxT, e.g. '2x4' or '2x6x2'")
        sizes = []
        for field in fields:
            field = field.strip()
            if not re.fullmatch(r"[0-9]+", field) or int(field) < 1:
                raise ValueError(f"invalid topology {spec!r}: {field!r} is not a positive integer")
            sizes.append(int(field))
        return cls.from_sizes(sizes)

    @classmethod
    def from_preset(cls, path_or_name: str | os.PathLike, world_size: int) -> Topology:
        """Load a YAML preset (a path, or a name in ``configs/``, e.g. ``"aurora"``).

        The preset lists levels outermost first; the outermost (node) level has no size, it is
        ``world_size`` divided by the ranks per node. The file is validated against the preset
        schema (:func:`load_preset`).
        """
        return load_preset(path_or_name).topology(world_size)

    @classmethod
    def detect(
        cls,
        world_size: int,
        hostnames: Sequence[str],
        local_world_size: int | None = None,
        xpu_tiles_per_gpu: int | None = None,
    ) -> Topology:
        """Build the topology from the hostname of every rank (index = rank).

        Ranks of one host must be contiguous and every host must hold the same number. A
        ``local_world_size`` (torchrun's ranks per agent) smaller than the ranks per host splits a
        host into several nodes: that is how emulated nodes on one machine are described. With
        ``xpu_tiles_per_gpu > 1`` each node is split into GPUs x tiles.
        """
        if len(hostnames) != world_size:
            raise ValueError(f"got {len(hostnames)} hostnames for world size {world_size}")
        runs: list[tuple[str, int]] = []
        for host in hostnames:
            if runs and runs[-1][0] == host:
                runs[-1] = (host, runs[-1][1] + 1)
            else:
                runs.append((host, 1))
        if len({host for host, _ in runs}) != len(runs):
            raise ValueError(f"ranks of a host are not contiguous: {list(hostnames)}")
        if len({count for _, count in runs}) != 1:
            raise ValueError(f"hosts hold different numbers of ranks: {dict(runs)}")
        per_node = runs[0][1]
        if local_world_size is not None and local_world_size != per_node:
            if local_world_size < 1 or per_node % local_world_size:
                raise ValueError(
                    f"LOCAL_WORLD_SIZE={local_world_size} does not divide the {per_node} ranks per host"
                )
            per_node = local_world_size
        nodes = world_size // per_node
        tiles = xpu_tiles_per_gpu or 1
        if tiles == 1:
            return cls.from_sizes((nodes, per_node))
        if per_node % tiles:
            raise ValueError(f"{per_node} ranks per node is not a multiple of {tiles} tiles per GPU")
        return cls.from_sizes((nodes, per_node // tiles, tiles))

    def validate(self, world_size: int) -> Topology:
        if self.world_size != world_size:
            raise ValueError(
                f"topology {self} ({self.describe()}) has {self.world_size} ranks but the world size is {world_size}"
            )
        return self

    def coords(self, rank: int) -> tuple[int, ...]:
        """Coordinates of a global rank, outermost level first."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside topology {self}")
        out = []
        for size in reversed(self.sizes):
            rank, c = divmod(rank, size)
            out.append(c)
        return tuple(reversed(out))

    def restrict(self, group_ranks: Sequence[int]) -> list[int]:
        return restrict(self, group_ranks)

    def nodes_and_lanes(self, group_ranks: Sequence[int]) -> tuple[list[int], list[int]]:
        """Per member of a group (in the given order): its node's position among the group's nodes,
        and its position among the group's members on that node (its lane: its rail)."""
        node_of = [self.coords(r)[0] for r in group_ranks]
        nodes = sorted(set(node_of))
        node = [nodes.index(n) for n in node_of]
        return node, [node[:j].count(node[j]) for j in range(len(node))]


def restrict(topology: Topology, group_ranks: Sequence[int]) -> list[int]:
    """Level sizes, outermost first, of the sub-grid formed by a group's global ranks.

    The group must be a Cartesian product of coordinate sets, one per topology level (a regular
    sub-grid), so that its sorted ranks enumerate that product in row-major order. Levels the
    group does not span (size 1) are dropped: on 2x4, ``[0, 1, 2, 3]`` gives ``[4]``; on 4x2 it
    gives ``[2, 2]``; on 2x2, ``[0, 2]`` gives ``[2]``.
    """
    ranks = sorted(group_ranks)
    if not ranks or len(set(ranks)) != len(ranks):
        raise ValueError(f"group ranks must be non-empty and distinct, got {list(group_ranks)}")
    coords = [topology.coords(r) for r in ranks]
    per_level = [sorted({c[i] for c in coords}) for i in range(len(topology.levels))]
    if math.prod(len(s) for s in per_level) != len(ranks):
        raise ValueError(
            f"group {ranks} is not a regular sub-grid of topology {topology} ({topology.describe()})"
        )
    return [len(s) for s in per_level if len(s) > 1]


def level_subgroups(ranks: Sequence[int], levels: Sequence[int]) -> list[list[list[int]]]:
    """Per level of a group's sub-grid (``levels`` from :func:`restrict`, outermost first), its
    sub-groups: the global ranks that differ only in that level's coordinate. The phases of TAPA
    run on them, and V-Major's two phases on those of a two-level group (:mod:`.subgroups`)."""
    ranks = sorted(ranks)
    subgroups = []
    for j, size in enumerate(levels):
        stride = math.prod(levels[j + 1 :])
        starts = [i for i in range(len(ranks)) if (i // stride) % size == 0]
        subgroups.append([[ranks[i + m * stride] for m in range(size)] for i in starts])
    return subgroups


def resolve(spec: str | os.PathLike | None, world_size: int) -> Topology:
    """Topology from a CLI-style spec: ``"2x4"``, a preset name or path, or None to detect (collective)."""
    if spec is None:
        topology = detect_from_environment()
    elif isinstance(spec, str) and re.fullmatch(r"[0-9x ]+", spec.lower()):
        topology = Topology.parse(spec)
    else:
        topology = Topology.from_preset(spec, world_size)
    return topology.validate(world_size)


def xpu_tiles_per_gpu(env: Mapping[str, str] | None = None, xpu: Any = None) -> int | None:
    """Tiles (stacks) per XPU card that appear as separate ranks, or None when not on XPU.

    Order: ``COCODIFF_TILES_PER_GPU`` (explicit override); ``ZE_FLAT_DEVICE_HIERARCHY=COMPOSITE``
    means one device per card, so tiles are not ranks (1); otherwise (FLAT, the default on
    PVC) the card name from ``torch.xpu.get_device_properties`` picks the stack count.
    """
    env = os.environ if env is None else env
    if env.get("COCODIFF_TILES_PER_GPU"):
        return int(env["COCODIFF_TILES_PER_GPU"])
    if xpu is None:
        import torch

        xpu = getattr(torch, "xpu", None)
    if xpu is None or not xpu.is_available():
        return None
    if env.get("ZE_FLAT_DEVICE_HIERARCHY", "").upper() == "COMPOSITE":
        return 1
    name = xpu.get_device_properties(0).name
    return next((tiles for key, tiles in _XPU_TILES_BY_NAME.items() if key in name), 1)


def detect_from_environment(group: Any = None) -> Topology:
    """Collective: detect the topology of ``group`` (default: world) from hostnames and env."""
    import torch.distributed as dist

    from . import transport

    world_size = dist.get_world_size(group)
    hostnames: list[Any] = [None] * world_size
    transport.launched(group, "all_gather_object")
    dist.all_gather_object(hostnames, socket.gethostname(), group=group)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return Topology.detect(world_size, hostnames, int(local) if local else None, xpu_tiles_per_gpu())


# The preset schema: keys of a level and of the file, with their checks (see :func:`load_preset`).
_LEVEL_KEYS = ("name", "size", "bandwidth_gbps", "latency_us", "source")
_TOP_KEYS = ("levels", "description", "source")


@dataclass(frozen=True)
class Preset:
    """A validated topology preset: its levels, outermost first, the outermost one without a size
    (it is given the placeholder 1 here; :meth:`topology` derives it from the world size)."""

    name: str
    path: Path
    levels: tuple[Level, ...]
    description: str | None = None
    source: str | None = None

    @property
    def ranks_per_node(self) -> int:
        return math.prod(level.size for level in self.levels[1:])

    def topology(self, world_size: int) -> Topology:
        outer, *inner = self.levels
        per_node = self.ranks_per_node
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1 or world_size % per_node:
            raise ValueError(
                f"preset {self.name!r} has {per_node} ranks per {outer.name}; world size {world_size} is not a multiple"
            )
        return Topology((replace(outer, size=world_size // per_node), *inner))


def presets() -> list[str]:
    """Names of the presets shipped in ``configs/`` (for ``--topology NAME``)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def preset_path(path_or_name: str | os.PathLike) -> Path:
    """The file of a preset: an existing path, else ``configs/NAME.yaml``."""
    path = Path(path_or_name)
    if path.is_file():
        return path
    shipped = CONFIG_DIR / f"{path_or_name}.yaml"
    if re.fullmatch(r"[A-Za-z0-9_.-]+", str(path_or_name)) and shipped.is_file():
        return shipped
    raise ValueError(f"unknown topology preset {str(path_or_name)!r}; known presets: {presets()}")


def load_preset(path_or_name: str | os.PathLike) -> Preset:
    """Read and validate a preset file.

    Schema: top-level keys ``levels`` (required: a non-empty list, outermost level first),
    ``description`` and ``source`` (strings). Every level has exactly these keys: ``name``
    (string, required, unique), ``size`` (positive integer; required, except on the outermost
    level, which must not set it), ``bandwidth_gbps`` (positive number: nominal unidirectional
    GB/s per rank for traffic crossing the level), ``latency_us`` (positive number: one-way
    small-message latency of a transfer crossing the level) and ``source`` (string: where the
    figures come from). Any violation raises ValueError naming the file and the key.
    """
    import yaml

    path = preset_path(path_or_name)
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping with a non-empty 'levels' list, got {type(data).__name__}")
    for key in data:
        if key not in _TOP_KEYS:
            raise ValueError(f"{path}: unknown key {key!r} (expected one of: {', '.join(_TOP_KEYS)})")
    for key in ("description", "source"):
        if key in data and not _non_empty_str(data[key]):
            raise ValueError(f"{path}: {key}: expected a non-empty string, got {data[key]!r}")
    raw_levels = data.get("levels")
    if not isinstance(raw_levels, list) or not raw_levels:
        raise ValueError(f"{path}: levels: expected a non-empty 'levels' list, got {raw_levels!r}")
    levels = tuple(_level_from_yaml(path, raw, i) for i, raw in enumerate(raw_levels))
    seen: set[str] = set()
    for i, level in enumerate(levels):
        if level.name in seen:
            raise ValueError(f"{path}: levels[{i}].name: duplicate level name {level.name!r}")
        seen.add(level.name)
    return Preset(path.stem, path, levels, data.get("description"), data.get("source"))


def _positive_number(value: Any) -> bool:
    return (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


def _non_empty_str(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _level_from_yaml(path: Path, raw: Any, index: int) -> Level:
    """Level ``index`` of a preset; the outermost one gets a placeholder size that the caller replaces."""
    where = f"{path}: levels[{index}]"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping with a 'name', got {raw!r}")
    for key in raw:
        if key not in _LEVEL_KEYS:
            raise ValueError(f"{where}: unknown key {key!r} (expected one of: {', '.join(_LEVEL_KEYS)})")
    if "name" not in raw:
        raise ValueError(f"{where}: missing required key 'name' (every level needs a 'name')")
    name = raw["name"]
    if not _non_empty_str(name):
        raise ValueError(f"{where}.name: expected a non-empty string, got {name!r}")
    outermost = index == 0
    if outermost and "size" in raw:
        raise ValueError(
            f"{where}.size: the outermost level {name!r} must not set a size (it is derived from the world size)"
        )
    if not outermost and "size" not in raw:
        raise ValueError(f"{where}: missing required key 'size' (level {name!r} needs a 'size')")
    size = 1 if outermost else raw["size"]
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{where}.size: expected a positive integer, got {size!r}")
    for key in ("bandwidth_gbps", "latency_us"):
        if key in raw and not _positive_number(raw[key]):
            raise ValueError(f"{where}.{key}: expected a positive number, got {raw[key]!r}")
    if "source" in raw and not _non_empty_str(raw["source"]):
        raise ValueError(f"{where}.source: expected a non-empty string, got {raw['source']!r}")
    bandwidth, latency = raw.get("bandwidth_gbps"), raw.get("latency_us")
    return Level(
        name,
        size,
        None if bandwidth is None else float(bandwidth),
        None if latency is None else float(latency),
        raw.get("source"),
    )
