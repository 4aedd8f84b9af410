"""Emulated multi-node fabrics: description, physical lower bound, and a launcher.

One module holds the numbers of every preset; ``emulate_cluster.sh`` (beside this module, shipped
in the wheel), which builds the namespaces, links, routes and ``tc tbf`` limits, reads them through
``python -m cocodiff_xfuser.tools.fabric --shell-env PRESET --nodes N --local L`` so that the emulated
cluster and :meth:`Fabric.bound_s` always use the same bandwidths.

Standard library only (the bash script runs it with whatever Python it finds, and importing it
must not pull torch).

Usage::

    from cocodiff_xfuser.tools.fabric import Fabric, available
    ok, why = available()                      # root + ip + tc + namespaces work here?
    fab = Fabric("rail", nodes=2, local=2)
    fab.bound_s("all_to_all", 16 * 2**20)      # physical lower bound, seconds
    with fab:                                  # emulate_cluster.sh up ... down
        r = fab.run(["python", "-m", "pkg.worker"], timeout=120)   # torchrun-style env per rank
        print(r.returncode, fab.qdisc_stats())

    python -m cocodiff_xfuser.tools.fabric --bound rail --nodes 2 --local 2 --size-mib 16

Rank layout (all presets): ``rank = node * local + local_rank`` (node-major, like torchrun).

Presets (rates are line rates in bit/s per direction; every link is full duplex):

``shared-uplink``
    the ranks of a node share one uplink to a switch (``uplink_bps``, default 2 Gbit/s per node).
    Intra-node traffic stays on an unlimited bridge inside the node.
``rail``
    rail-optimised fabric: each rank has its own NIC (``rail_bps``, default 1 Gbit/s) cabled to the
    leaf switch of its rail (leaf *i* = local rank *i* of every node).  Same-rail traffic is one hop
    through that leaf; cross-rail traffic goes NIC -> leaf -> spine -> leaf -> NIC, and each leaf's
    uplink to the spine is oversubscribed ``spine_oversubscription`` times (default 4:1, i.e.
    ``nodes * rail_bps / 4``; 500 Mbit/s per leaf uplink at 2 nodes).  Intra-node: unlimited bridge.
``aurora-like``
    three levels, scaled from Aurora's published figures (see :data:`AURORA_PUBLISHED` and
    :func:`aurora_emulated_rates`): the two tiles (stacks) of one GPU share an unlimited bridge
    (MDFI), each tile has a rate-limited Xe Link port to the node's GPU-to-GPU fabric, and the node's
    NICs are one rate-limited node uplink to a switch.  ``local`` = tiles per node (even).

    Ratios and why.  What an all-to-all sees is the bandwidth each tile can inject into each level,
    so those per-tile figures are kept and everything is divided by ONE constant:

    * NIC share per tile: published 8 Slingshot-11 NICs x 200 Gb/s (25 GB/s) per node = 200 GB/s,
      over 6 GPUs x 2 tiles = 16.7 GB/s per tile  ->  emulated 250 Mbit/s per tile (the constant:
      1 emulated bit/s per ~533 real bit/s).  The node uplink is ``local x 250 Mbit/s`` (1 Gbit/s for
      4 tiles), shared by the node's tiles like the real NICs are.
    * Xe Link per tile: published 28 GB/s per Xe Link (quoted, see AURORA_PUBLISHED); 6 GPUs
      all-to-all, ASSUMED one link per GPU pair, shared by the GPU's two tiles: 5 x 28 / 2 =
      70 GB/s per tile = 4.2 x the NIC share -> emulated 1.05 Gbit/s per tile port.  With fewer emulated GPUs per node the per-tile injection
      ratio, not the link count, is preserved.
    * Tile pair (MDFI, on package): fastest level; no citable figure found, emulated as an unlimited
      bridge (CPU-bound: 15-38 Gbit/s one-way measured here, i.e. >= 14x the Xe port).
    * GPU -> NIC (PCIe Gen5 x16, published 64 GB/s per GPU vs a 33 GB/s NIC share): not a
      bottleneck, emulated unlimited; inter-node traffic goes tile -> node router -> uplink and does
      not use the Xe ports.

Link classes and the bound
--------------------------
:attr:`Fabric.link_classes` maps a class name to :class:`LinkClass` (``count`` links, ``Bps`` bytes/s
per direction each, ``None`` = unlimited).  A byte that crosses a class uses one direction of the
sender-side link of that class and one direction of the receiver-side link (out of the NIC, into
the NIC; up the leaf uplink, down the other leaf uplink), so with ``count`` full-duplex links the
class moves at most ``count * Bps`` bytes/s; that is its aggregate bandwidth.

:meth:`Fabric.bound_s` is the physical lower bound of an exchange: for each class the bytes that
must cross it divided by its aggregate bandwidth, max over classes.  With ``pattern="all_to_all"``
the routing is chosen to minimise those bytes (on ``rail`` every inter-node byte can take a free
intra-node hop to the rank on the destination's rail and then use rails only, so the spine carries
nothing; on ``shared-uplink``/``aurora-like`` every inter-node byte crosses the node uplink and
every intra-node cross-GPU byte crosses Xe Link).  ``pattern="flat"`` charges each byte to the
classes of the fabric's direct route (what a flat all-to-all actually uses), ``"two_phase"`` to the
route of a two-phase exchange (intra-group hop, then direct), ``"pxn"`` to NCCL's PXN route (a hop
inside the source node to the rank with the destination's local index, i.e. on its rail, then
direct; :mod:`cocodiff_xfuser.comm.pxn`).  For a WxW byte matrix the per-class
aggregate is still used, which is valid but loose for skewed matrices.  Bytes are link-layer bytes:
TCP/IP/Ethernet headers (~0.7% at the emulation's MTU 9000) and the unlimited bridges' CPU cost are
not in the bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

__all__ = [
    "AURORA_PUBLISHED",
    "DEFAULT_PARAMS",
    "Fabric",
    "LinkClass",
    "PRESETS",
    "SCRIPT",
    "aurora_emulated_rates",
    "available",
]

SCRIPT = Path(__file__).resolve().parent / "emulate_cluster.sh"

PRESETS = ("shared-uplink", "rail", "aurora-like")

#: Emulation-wide constants (also read by the bash script).
MTU = 9000
TBF_MIN_LIMIT_BYTES = 16 * 1024 * 1024  # tbf limit < 4 MB stalls TCP (measured here)
#: Per-socket send buffer cap pinned in every rank namespace (net.ipv4.tcp_wmem max).  A TCP flow
#: never has more than this in the network, so a tbf queue of ``flows x TCP_WMEM_MAX`` never
#: tail-drops (drops made reno stall and the figures wrong).
TCP_WMEM_MAX = 4 * 1024 * 1024
TBF_MIN_BURST_BYTES = 128 * 1024  # >= one 64 KiB GSO super-packet
TBF_BURST_SECONDS = 0.001  # burst = 1 ms of line rate (or the minimum above)

#: Aurora's published figures (per direction), the source of the aurora-like ratios.
#: - 8 HPE Slingshot-11 NICs per node (ALCF Aurora machine overview); Slingshot ports are
#:   200 Gb/s (ALCF interconnect page) = 25 GB/s per NIC, 200 GB/s per node.
#: - 6 PVC GPUs x 2 stacks (tiles) per node, GPUs connected all-to-all by Xe Link (ALCF);
#:   28 GB/s theoretical per Xe Link (Ibeid et al., "Scaling MPI Applications on Aurora",
#:   arXiv 2512.04291, as quoted by a third-party summary of it; not checked against the paper's
#:   own text).  ASSUMPTION: one Xe Link per GPU pair, shared by the GPU's two tiles.
#: - Tile-to-tile (MDFI, on-package) is the fastest level; we found no citable figure, so it is
#:   emulated as an unlimited bridge (CPU-bound here, several times the Xe port; see docs).
#: - PCIe Gen5 x16 per GPU, 64 GB/s (same paper): the GPU->NIC path is not the bottleneck
#:   (a GPU's NIC share is 200/6 = 33 GB/s), so it is emulated as unlimited.
AURORA_PUBLISHED = {
    "nics_per_node": 8,
    "nic_Bps": 25e9,
    "gpus_per_node": 6,
    "tiles_per_gpu": 2,
    "xe_link_Bps": 28e9,
    "xe_links_per_gpu_pair": 1,
    "pcie_per_gpu_Bps": 64e9,
}

#: Default parameters per preset (rates in bit/s).  Override any of them with ``params=``
#: (Python) or ``--param key=value`` (CLI and bash script).
DEFAULT_PARAMS: Dict[str, Dict[str, float]] = {
    "shared-uplink": {"uplink_bps": 2e9},
    "rail": {"rail_bps": 1e9, "spine_oversubscription": 4.0},
    # One tile's share of its node's NICs is scaled to 250 Mbit/s; everything else follows from
    # the published ratios (see aurora_emulated_rates).
    "aurora-like": {"tile_nic_share_bps": 250e6},
}


def aurora_emulated_rates(tile_nic_share_bps: float = 250e6) -> Dict[str, float]:
    """Scale Aurora's published per-tile injection bandwidths down by one constant.

    Per tile (one rank): NIC share = 8 * 25 GB/s / 12 tiles = 16.7 GB/s; Xe Link = 5 peer GPUs *
    28 GB/s / 2 tiles = 70 GB/s (ratio 4.2 : 1).  The constant is chosen so that the NIC share
    becomes ``tile_nic_share_bps``; the emulated node uplink is ``tiles * tile_nic_share_bps``
    (computed by :class:`Fabric`), the Xe port per tile ``4.2 * tile_nic_share_bps``.
    """
    p = AURORA_PUBLISHED
    tiles = p["gpus_per_node"] * p["tiles_per_gpu"]
    nic_share_Bps = p["nics_per_node"] * p["nic_Bps"] / tiles
    xe_tile_Bps = (p["gpus_per_node"] - 1) * p["xe_links_per_gpu_pair"] * p["xe_link_Bps"] / p["tiles_per_gpu"]
    scale = tile_nic_share_bps / (8.0 * nic_share_Bps)  # emulated bit/s per real byte/s
    return {
        "scale": scale,
        "tile_nic_share_bps": tile_nic_share_bps,
        "xe_tile_bps": xe_tile_Bps * 8.0 * scale,
        "xe_to_nic_ratio": xe_tile_Bps / nic_share_Bps,
    }


@dataclasses.dataclass(frozen=True)
class LinkClass:
    """One class of links: ``count`` full-duplex links of ``Bps`` bytes/s per direction."""

    name: str
    count: int
    Bps: Optional[float]  # None = unlimited (bridge / loopback, CPU-bound)
    description: str
    shaped: bool = False  # True when the emulation rate-limits it with tc tbf

    @property
    def aggregate_Bps(self) -> float:
        return float("inf") if self.Bps is None else self.count * self.Bps


PatternT = Union[str, Sequence[Sequence[float]]]


class Fabric:
    """Description of one emulated fabric (``preset``, ``nodes`` x ``local`` ranks).

    Pure description until :meth:`up` (or the context manager) builds it with the bash script.
    """

    def __init__(
        self,
        preset: str = "rail",
        nodes: int = 2,
        local: int = 2,
        *,
        params: Optional[Mapping[str, float]] = None,
        fabric_id: Optional[str] = None,
        script: Union[str, Path, None] = None,
    ) -> None:
        if preset not in PRESETS:
            raise ValueError(f"unknown fabric preset {preset!r}; choose one of {', '.join(PRESETS)}")
        nodes, local = int(nodes), int(local)
        if not 1 <= nodes <= 64:
            raise ValueError(f"nodes must be in 1..64, got {nodes}")
        if not 1 <= local <= 64:
            raise ValueError(f"local ranks per node must be in 1..64, got {local}")
        if preset == "aurora-like" and local % 2:
            raise ValueError("aurora-like needs an even number of local ranks (2 tiles per GPU)")
        merged = dict(DEFAULT_PARAMS[preset])
        for k, v in (params or {}).items():
            if k not in merged:
                raise ValueError(f"unknown parameter {k!r} for preset {preset}; known: {sorted(merged)}")
            merged[k] = float(v)
        self.preset = preset
        self.nodes = nodes
        self.local = local
        self.params = merged
        self.fabric_id = fabric_id if fabric_id is not None else os.environ.get("CCD_ID", "0")
        self.script = Path(script) if script is not None else SCRIPT
        self._brought_up = False

    # ------------------------------------------------------------------ layout
    @property
    def world(self) -> int:
        return self.nodes * self.local

    @property
    def group(self) -> int:
        """Size of the innermost unlimited group (node for shared-uplink/rail, GPU for aurora-like)."""
        return 2 if self.preset == "aurora-like" else self.local

    def node_of(self, rank: int) -> int:
        return rank // self.local

    def local_of(self, rank: int) -> int:
        return rank % self.local

    def gpu_of(self, rank: int) -> int:
        """Group (GPU) index inside the node (aurora-like); 0 on the other presets."""
        return self.local_of(rank) // self.group

    def rank_address(self, rank: int) -> str:
        return f"10.77.{self.node_of(rank)}.{10 + self.local_of(rank)}"

    def namespace(self, rank: int) -> str:
        return f"ccd-{self.fabric_id}-n{self.node_of(rank)}r{self.local_of(rank)}"

    @property
    def prefix(self) -> str:
        return f"ccd-{self.fabric_id}-"

    # ------------------------------------------------------------------ rates
    def rates_bps(self) -> Dict[str, float]:
        """Line rates (bit/s per direction) of the shaped links, by role."""
        p = self.params
        if self.preset == "shared-uplink":
            return {"uplink": p["uplink_bps"]}
        if self.preset == "rail":
            return {"rail": p["rail_bps"], "spine": self.nodes * p["rail_bps"] / p["spine_oversubscription"]}
        r = aurora_emulated_rates(p["tile_nic_share_bps"])
        return {"xe": r["xe_tile_bps"], "uplink": self.local * p["tile_nic_share_bps"]}

    @property
    def link_classes(self) -> Dict[str, LinkClass]:
        r = self.rates_bps()
        N, L = self.nodes, self.local
        if self.preset == "shared-uplink":
            return {
                "intra": LinkClass("intra", N, None, "node bridge (unlimited)"),
                "uplink": LinkClass("uplink", N, r["uplink"] / 8, "node uplink to the switch, shared by the node's ranks", True),
            }
        if self.preset == "rail":
            return {
                "intra": LinkClass("intra", N, None, "node bridge (unlimited)"),
                "rail": LinkClass("rail", N * L, r["rail"] / 8, "per-rank NIC to its rail's leaf switch", True),
                "spine": LinkClass("spine", L, r["spine"] / 8, "leaf-to-spine uplink, one per rail (cross-rail traffic)", True),
            }
        return {
            "tile": LinkClass("tile", N * L // 2, None, "tile pair of one GPU (MDFI; unlimited bridge)"),
            "pcie": LinkClass("pcie", N * L // 2, None, "GPU to node router (PCIe; unlimited)"),
            "xe": LinkClass("xe", N * L, r["xe"] / 8, "per-tile Xe Link port to the node's GPU-GPU fabric", True),
            "uplink": LinkClass("uplink", N, r["uplink"] / 8, "node NICs (aggregate) to the switch", True),
        }

    # ------------------------------------------------------------------ routing
    def route(self, src: int, dst: int) -> Tuple[str, ...]:
        """Link classes a packet from ``src`` to ``dst`` crosses under the emulation's routing.

        Each class appears once: crossing a class means leaving through the sender-side link of
        that class and arriving through the receiver-side one (e.g. cross-rail = NIC out, leaf
        uplink up, other leaf uplink down, NIC in = ``("rail", "spine")``).
        """
        self._check(src, dst)
        if src == dst:
            return ()
        same_node = self.node_of(src) == self.node_of(dst)
        if self.preset == "shared-uplink":
            return ("intra",) if same_node else ("uplink",)
        if self.preset == "rail":
            if same_node:
                return ("intra",)
            if self.local_of(src) == self.local_of(dst):
                return ("rail",)
            return ("rail", "spine")
        # aurora-like
        if same_node and self.gpu_of(src) == self.gpu_of(dst):
            return ("tile",)
        if same_node:
            return ("xe",)
        return ("pcie", "uplink")

    def mandatory(self, src: int, dst: int) -> frozenset:
        """Shaped link classes that EVERY physical path from ``src`` to ``dst`` crosses."""
        self._check(src, dst)
        if src == dst:
            return frozenset()
        same_node = self.node_of(src) == self.node_of(dst)
        if self.preset == "shared-uplink":
            return frozenset() if same_node else frozenset({"uplink"})
        if self.preset == "rail":
            # Inter-node bytes always leave through a NIC; the spine is avoidable by an intra-node
            # hop to the rank on the destination's rail.
            return frozenset() if same_node else frozenset({"rail"})
        if same_node and self.gpu_of(src) == self.gpu_of(dst):
            return frozenset()
        return frozenset({"xe"}) if same_node else frozenset({"uplink"})

    def two_phase_route(self, src: int, dst: int) -> Tuple[str, ...]:
        """Classes crossed by a two-phase exchange: hop inside ``src``'s unlimited group to the member
        with ``dst``'s index in its group, then the direct route from there."""
        self._check(src, dst)
        if src == dst:
            return ()
        g = self.group
        base = src - (self.local_of(src) % g)
        hop = base + (self.local_of(dst) % g)
        first = self.route(src, hop) if hop != src else ()
        return first + (self.route(hop, dst) if hop != dst else ())

    def pxn_route(self, src: int, dst: int) -> Tuple[str, ...]:
        """Classes crossed under NCCL's PXN routing: a hop inside ``src``'s node to the rank with
        ``dst``'s local index (``dst``'s rail on ``rail``), then the direct route from there."""
        self._check(src, dst)
        hop = self.node_of(src) * self.local + self.local_of(dst)
        return self.route(src, hop) + self.route(hop, dst)

    def first_hop(self, src: int, dst: int) -> Tuple[str, Optional[str]]:
        """(device, gateway) the sender's namespace uses for ``dst``; checks the built routes."""
        self._check(src, dst)
        n, l = self.node_of(src), self.local_of(src)
        r = self.route(src, dst)
        if self.preset == "shared-uplink":
            return ("eth0", None) if r == ("intra",) else ("eth0", f"10.80.{n}.1")
        if self.preset == "rail":
            if r == ("intra",):
                return ("eth0", None)
            return ("up0", None) if r == ("rail",) else ("up0", f"10.80.{100 + l}.1")
        if r == ("tile",):
            return ("eth0", None)
        return ("up0", None) if r == ("xe",) else ("eth0", f"10.80.{n}.1")

    def _check(self, *ranks: int) -> None:
        for r in ranks:
            if not 0 <= r < self.world:
                raise ValueError(f"rank {r} out of range for world size {self.world}")

    # ------------------------------------------------------------------ bound
    def traffic_matrix(self, size_bytes_per_rank: float) -> List[List[float]]:
        """Equal-split all-to-all: each rank sends ``size/W`` bytes to every rank (itself included)."""
        c = float(size_bytes_per_rank) / self.world
        return [[c] * self.world for _ in range(self.world)]

    def class_bytes(self, pattern: PatternT = "all_to_all", size_bytes_per_rank: float = 0.0,
                    routing: Optional[str] = None) -> Dict[str, float]:
        """Bytes each link class carries (each byte counted once per class traversal)."""
        routing_of = {"all_to_all": "min", "a2a": "min", "alltoall": "min", "min": "min",
                      "flat": "direct", "direct": "direct",
                      "two_phase": "two_phase", "two-phase": "two_phase", "hierarchical": "two_phase",
                      "tapa": "two_phase", "pxn": "pxn"}
        if isinstance(pattern, str):
            if pattern not in routing_of:
                raise ValueError(f"unknown pattern {pattern!r}; use one of {sorted(routing_of)} or a WxW byte matrix")
            matrix = self.traffic_matrix(size_bytes_per_rank)
            routing = routing or routing_of[pattern]
        else:
            matrix = [[float(x) for x in row] for row in pattern]
            if len(matrix) != self.world or any(len(row) != self.world for row in matrix):
                raise ValueError(f"traffic matrix must be {self.world}x{self.world}")
            routing = routing or "min"
        if routing not in ("min", "direct", "two_phase", "pxn"):
            raise ValueError(f"unknown routing {routing!r}")
        out = {name: 0.0 for name in self.link_classes}
        for s in range(self.world):
            for d in range(self.world):
                b = matrix[s][d]
                if not b or s == d:
                    continue
                if routing == "min":
                    classes: Iterable[str] = self.mandatory(s, d)
                elif routing == "direct":
                    classes = self.route(s, d)
                elif routing == "two_phase":
                    classes = self.two_phase_route(s, d)
                else:
                    classes = self.pxn_route(s, d)
                for c in classes:
                    out[c] += b
        return out

    def bound_breakdown(self, pattern: PatternT = "all_to_all", size_bytes_per_rank: float = 0.0,
                        routing: Optional[str] = None) -> Dict[str, Dict[str, float]]:
        """Per class: bytes, aggregate bytes/s and seconds (bytes / aggregate)."""
        cb = self.class_bytes(pattern, size_bytes_per_rank, routing)
        res = {}
        for name, lc in self.link_classes.items():
            agg = lc.aggregate_Bps
            res[name] = {"bytes": cb[name], "aggregate_Bps": agg,
                         "seconds": 0.0 if cb[name] == 0 else cb[name] / agg}
        return res

    def bound_s(self, pattern: PatternT = "all_to_all", size_bytes_per_rank: float = 0.0,
                routing: Optional[str] = None) -> float:
        """Physical lower bound (seconds) of the exchange: max over link classes of bytes/aggregate.

        ``pattern``: ``"all_to_all"`` (equal splits, routing minimising each class's bytes: the bound
        of ANY algorithm), ``"flat"`` (equal splits on the direct routes), ``"two_phase"``, ``"pxn"``,
        or a WxW matrix of bytes (``routing`` = ``"min"`` default, ``"direct"``, ``"two_phase"`` or ``"pxn"``).
        """
        bd = self.bound_breakdown(pattern, size_bytes_per_rank, routing)
        return max((v["seconds"] for v in bd.values()), default=0.0)

    # ------------------------------------------------------------------ shell interface
    def flows_per_link(self, role: str) -> int:
        """Rank pairs (TCP flows of one process group) whose direct route crosses ONE link of
        ``role`` in one direction during a flat all-to-all (sizes the tbf queue)."""
        N, L, W = self.nodes, self.local, self.world
        if role == "uplink":  # node uplink (shared-uplink, aurora-like)
            return L * (W - L)
        if role == "rail":  # one rank's NIC
            return W - L
        if role == "spine":  # one leaf's uplink: rail-l ranks to other rails on other nodes
            return N * (L - 1) * (N - 1)
        if role == "xe":  # one tile's Xe port: tiles of the other GPUs of its node
            return L - 2
        raise ValueError(role)

    def shell_env(self) -> str:
        """``KEY=value`` lines the bash script evals (all values shell-quoted)."""
        def tbf(role: str, bps: float) -> str:
            Bps = bps / 8.0
            burst = max(int(Bps * TBF_BURST_SECONDS), TBF_MIN_BURST_BYTES)
            limit = max(TBF_MIN_LIMIT_BYTES, int(Bps * 0.1), self.flows_per_link(role) * TCP_WMEM_MAX)
            return f"rate {int(round(bps))}bit burst {burst} limit {limit}"

        env = {
            "CCD_PRESET": self.preset,
            "CCD_NODES": self.nodes,
            "CCD_LOCAL": self.local,
            "CCD_WORLD": self.world,
            "CCD_GROUP": self.group,
            "CCD_MTU": MTU,
        }
        for role, bps in self.rates_bps().items():
            env[f"CCD_RATE_{role.upper()}"] = int(round(bps))
            env[f"CCD_TBF_{role.upper()}"] = tbf(role, bps)
        env["CCD_TCP_WMEM"] = f"4096 16384 {TCP_WMEM_MAX}"
        env["CCD_PARAMS"] = ",".join(f"{k}={v:g}" for k, v in sorted(self.params.items()))
        return "".join(f"{k}={shlex.quote(str(v))}\n" for k, v in env.items())

    def describe(self) -> str:
        lines = [f"fabric {self.preset}: {self.nodes} nodes x {self.local} ranks = {self.world} ranks"]
        for lc in self.link_classes.values():
            bw = "unlimited" if lc.Bps is None else f"{lc.Bps * 8 / 1e6:.0f} Mbit/s each"
            lines.append(f"  {lc.name:7s} {lc.count:3d} x {bw:22s} {lc.description}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ lifecycle
    def _script_args(self) -> List[str]:
        args = ["--preset", self.preset, "--nodes", str(self.nodes), "--local", str(self.local),
                "--id", self.fabric_id]
        for k, v in sorted(self.params.items()):
            args += ["--param", f"{k}={v:g}"]  # all of them: a running fabric must match exactly
        return args

    def _script(self, cmd: str, *args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        argv = ["bash", str(self.script), cmd, *args]
        return subprocess.run(argv, check=check, env=_script_env(), **kw)

    def up(self) -> "Fabric":
        ok, reason = available()
        if not ok:
            raise RuntimeError(f"cannot build an emulated fabric here: {reason}")
        self._script("up", *self._script_args())
        self._brought_up = True
        return self

    def down(self) -> None:
        self._script("down", "--id", self.fabric_id, check=False)
        self._brought_up = False

    def is_up(self) -> bool:
        r = self._script("status", "--id", self.fabric_id, "--quiet", check=False,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return r.returncode == 0

    def __enter__(self) -> "Fabric":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def run(self, argv: Sequence[str], timeout: Optional[float] = None, *, port: Optional[int] = None,
            logdir: Union[str, Path, None] = None, tag_output: bool = False,
            extra_env: Optional[Mapping[str, str]] = None, **popen_kw) -> subprocess.CompletedProcess:
        """Run ``argv`` on every rank (torchrun-style env) and wait; returns the first non-zero exit
        code (124 on timeout).  Brings the fabric up and down around the run unless it is up."""
        args = ["run", *self._script_args()]
        if timeout is not None:
            args += ["--timeout", str(int(max(1, round(timeout))))]
        if port is not None:
            args += ["--port", str(port)]
        if logdir is not None:
            args += ["--logdir", str(logdir)]
        if tag_output:
            args += ["--tag-output"]
        env = _script_env(popen_kw.pop("env", None))
        env.update(extra_env or {})
        return subprocess.run(["bash", str(self.script), *args, "--", *argv], env=env, **popen_kw)

    def qdisc_stats(self) -> List[Dict[str, object]]:
        """Per shaped interface: namespace, device, sent bytes, drops, overlimits (fabric must be up)."""
        r = self._script("stats", "--id", self.fabric_id, check=True, capture_output=True, text=True)
        rows = []
        for line in r.stdout.splitlines():
            f = line.split()
            if len(f) == 5 and f[0].startswith("ccd-"):
                rows.append({"ns": f[0], "dev": f[1], "sent_bytes": int(f[2]), "dropped": int(f[3]),
                             "overlimits": int(f[4])})
        return rows


_AVAILABLE: Optional[Tuple[bool, str]] = None


def _script_env(base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The script's environment: its Python is this interpreter unless ``CCD_PYTHON`` says otherwise."""
    env = dict(os.environ if base is None else base)
    env.setdefault("CCD_PYTHON", sys.executable)
    return env


def available(refresh: bool = False) -> Tuple[bool, str]:
    """Whether network namespaces with veth, bridges and tbf can be created here.

    Returns ``(ok, reason)``; ``reason`` says what is missing when not ok (for ``pytest.skip``).
    The check creates and deletes one probe namespace (``ccd-probe-<pid>``).
    """
    global _AVAILABLE
    if _AVAILABLE is not None and not refresh:
        return _AVAILABLE
    _AVAILABLE = _probe()
    return _AVAILABLE


def _probe() -> Tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, "needs root (network namespaces, veth, tc); run the fabric tests as root"
    for tool in ("ip", "tc", "bash", "setsid", "flock"):
        if shutil.which(tool) is None:
            return False, f"{tool!r} not found on PATH (install iproute2 / util-linux)"
    if not SCRIPT.exists():
        return False, f"{SCRIPT} is missing"
    ns = f"ccd-probe-{os.getpid()}"

    def sh(*a: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(a), capture_output=True, text=True)

    try:
        r = sh("ip", "netns", "add", ns)
        if r.returncode:
            return False, f"cannot create a network namespace: {r.stderr.strip()}"
        for step, argv in (
            ("veth", ["ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"]),
            ("bridge", ["ip", "-n", ns, "link", "add", "b0", "type", "bridge"]),
            ("tbf", ["tc", "-n", ns, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "1gbit",
                     "burst", "131072", "limit", "6291456"]),
        ):
            r = sh(*argv)
            if r.returncode:
                return False, f"cannot create a {step} in a namespace: {r.stderr.strip()}"
        r = sh("ip", "netns", "exec", ns, "sh", "-c",
               "echo reno > /proc/sys/net/ipv4/tcp_congestion_control")
        if r.returncode:
            return False, f"cannot select TCP reno inside a namespace: {r.stderr.strip()}"
        return True, "ok"
    finally:
        sh("ip", "netns", "del", ns)


# ---------------------------------------------------------------------- CLI
def parse_params(pairs: Sequence[str]) -> Dict[str, float]:
    """``--param KEY=NUMBER`` link overrides as a dict; a malformed one is a ValueError naming it."""
    params = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        try:
            if not sep:
                raise ValueError(pair)
            params[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--param {pair!r}: expected KEY=NUMBER") from None
    return params


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cocodiff_xfuser.tools.fabric",
                                 description="Emulated fabric presets: shell env, description, bounds.")
    ap.add_argument("--shell-env", metavar="PRESET", help="print KEY=value lines for emulate_cluster.sh")
    ap.add_argument("--describe", metavar="PRESET", help="print the link classes of a preset")
    ap.add_argument("--bound", metavar="PRESET", help="print the bounds of an all-to-all on a preset")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--local", type=int, default=2)
    ap.add_argument("--param", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--size-mib", type=float, default=16.0, help="bytes per rank for --bound (MiB)")
    ap.add_argument("--available", action="store_true", help="check whether namespaces can be built here")
    a = ap.parse_args(argv)
    try:
        if a.available:
            ok, reason = available()
            print(reason)
            return 0 if ok else 1
        preset = a.shell_env or a.describe or a.bound
        if not preset:
            ap.print_help()
            return 2
        fab = Fabric(preset, a.nodes, a.local, params=parse_params(a.param))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.shell_env:
        sys.stdout.write(fab.shell_env())
    elif a.describe:
        print(fab.describe())
    else:
        size = a.size_mib * 2**20
        print(fab.describe())
        for pat in ("all_to_all", "flat", "two_phase"):
            bd = fab.bound_breakdown(pat, size)
            parts = ", ".join(f"{k}={v['seconds'] * 1e3:.1f}ms" for k, v in bd.items() if v["bytes"])
            print(f"  {pat:10s} bound {fab.bound_s(pat, size) * 1e3:8.2f} ms  ({parts})")
    return 0
