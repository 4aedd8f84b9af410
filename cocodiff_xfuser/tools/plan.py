"""``cocodiff plan``: a communication cost model per link level, its validation, and a planner.

The model
---------
One exchange of ``x`` bytes per rank over a group is priced per link level:

* **flat** (stock ``all_to_all_single``): every rank sends ``(W-1)/W`` of its data at once on the
  direct routes; each level (or emulated link class) carries the bytes whose route crosses it and
  the slowest one decides: ``max_level(bytes_level / bandwidth_level) + latency``. On the emulated
  ``rail`` fabric cross-rail bytes also cross the oversubscribed spine
  (:meth:`Fabric.bound_s` with ``"flat"`` routes).
* **TAPA** (``hierarchical``): one phase per level, fastest first; the phase of level ``i`` moves
  ``x (s_i - 1) / s_i`` bytes per rank over that level; phases run one after the other:
  ``sum_i (latency_i + bytes_i / bandwidth_i)``. In ``P`` parts the phases overlap:
  ``max_i t_i + (sum_i t_i - max_i t_i) / P``.
* **efficiency and host**: measured exchanges are slower than line rate (TCP through ``tc tbf``,
  more so with more nodes, i.e. more flows per link) and, on the emulated cluster (many ranks on
  2 CPU cores), bounded by the host: ``t = max(eff * t_link + latency, host)`` with
  ``eff = e0 + e1 (nodes - 2)`` and ``host = (ranks / cores) (h_phase * phases + h_byte * x)``.
  On GPU presets ``eff = 1`` and ``host = 0`` unless ``--calibrate`` fits them.
* **per step**: per attention layer the Ulysses input exchange (Q, K, V; xfuser's FLUX processor
  stacks them in one message, its SD3 processor sends three) and the output exchange, each
  ``b * s / (U R) * ceil(h/U) U * d * dtype`` bytes per tensor; V-First splits the input into V,
  then Q/K, and hides up to the Q/K projection time of V's exchange (the compute estimate: on the
  emulated runs the stock step time minus its communication; on GPU presets a FLOP count at a
  stated TFLOP/s); V-Major scales the slow level's Q/K/V bytes by the active fraction and the
  residual dtype (defaults from ``docs/results/quality-digits-flux-vmajor-defaults.json``); ring attention passes K/V
  ``R - 1`` times per layer, hidden behind attention compute where it fits. V-Major's own kernels
  are priced from ``bench kernels`` on one H100, scaled by memory bandwidth on other GPUs, and the
  plan says below which link speed the bytes they save are worth their time.
* **host time** per attention layer, stock's and each cocodiff configuration's: ``bench host``'s
  exact counts per layer (Python calls, torch operators, Triton launches) at what one of each cost
  an H200's host, added in full to the step (an upper bound: a GPU runs behind its host).

Validation (``--validate``): every shipped measurement in ``docs/results`` the model can predict
(a2a: flat and hierarchical at every size, fabric and shape, and the chosen exchange where it is
neither, e.g. pipelined ``hierarchical_x2``; the rail host floors; e2e: every configuration's
exposed communication per step). Leave-one-fabric-out: the four shared coefficients (e0, e1,
h_phase, h_byte) are fitted by least squares on the a2a measurements of the OTHER fabrics and the
fabric's own line rates come from its preset and parameters; e2e points use coefficients fitted on
all a2a points (no e2e time is ever fitted) and take two inputs from measured runs: V-First
points the compute time from the stock run's measured ``step_s - comm_exposed_s``, V-Major points
their own run's measured ``v_major_active_fraction`` (a token count share, not a time). No point
is predicted from its own value.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from cocodiff_xfuser.shipped import RESULTS
from cocodiff_xfuser.tools import gpu_model
from cocodiff_xfuser.tools.dit_specs import MODELS, ModelSpec, forward_flops, layer_flops
from cocodiff_xfuser.tools.fabric import PRESETS as FABRICS, Fabric

RESULTS_DIR = RESULTS  # installed with the package (cocodiff_xfuser/shipped.py)
TARGET_MEDIAN = 0.15
#: Achieved dense bf16 TFLOP/s per rank assumed for the compute estimate (V-First's window, the
#: step time): ASSUMPTIONS, about 40% of the datasheet peak (H100/H200 SXM 989, PVC tile ~420).
TFLOPS = {"dgx-h100": 400.0, "dgx-h200": 400.0, "aurora": 150.0, "pcie-8gpu": 150.0}
DEFAULT_TFLOPS = 200.0
#: V-Major at its defaults (configs/policies/v-major.yaml) as the planner prices it: this shipped
#: quality run at the defaults (the share of rows sent over slow links, as residuals in the default
#: dtype, :func:`v_major_scale`, in every exchange).
V_MAJOR_DEFAULTS_RUN = "quality-digits-flux-vmajor-defaults.json"
#: V-Major on the ring's K/V: the share of tokens sent, from this shipped quality run at the defaults.
RING_V_MAJOR_RUN = "quality-digits-flux-u2r2-ring-vmajor.json"
#: Stock PipeFusion's quality by its stage count: the PipeFusion points of this shipped frontier sweep
#: (``cocodiff quality --sweep frontier``: the same images, PSNR against stock Ulysses).
PIPEFUSION_RUN = "sweep-frontier-digits-flux.json"
#: ``cocodiff bench host``'s run whose counts per attention layer (eager: Python calls, torch
#: operators, V-Major's Triton launches) the planner prices host time from, stock's and cocodiff's.
HOST_RUN = "host-tiny-flux.json"
#: What one of each costs a GPU's host (one H200's; the file says how each was measured or derived).
HOST_COSTS = "host-costs-h200.json"
#: The configurations whose host time per layer the planner prices, as :data:`HOST_RUN` names them.
HOST_CONFIGS = {"stock": "ulysses", "cocodiff": "cocodiff", "v_first": "cocodiff+vfirst", "v_major": "cocodiff+vfirst+vmajor"}
#: V-Major's own work per layer on the GPU (change sums, ranking, int4 encode, apply), as ``bench
#: kernels`` measured it on one GPU replayed from CUDA graphs (the device's own time; the host's,
#: launches included, is priced apart from :data:`HOST_RUN`): the shipped runs, fitted per byte of
#: V a rank holds, price it as measured on the presets of a measured GPU, and scaled from
#: :data:`KERNEL_GPU`'s by memory bandwidth on the others (its kernels stream V and its residuals
#: through memory). Runs of a previous release's kernels are kept in ``previous/``, out of this
#: pattern's reach.
KERNELS = "kernels-*.json"
KERNEL_GPU = "H200"
#: Published memory bandwidth (bytes/s) of one device as torch names it (a substring of
#: ``torch.cuda.get_device_name()`` / ``torch.xpu.get_device_name()``; the longest match wins).
DEVICE_MEMORY_BPS = {
    "H100": 3.35e12,  # H100 SXM, HBM3 (NVIDIA H100 datasheet); torch: "NVIDIA H100 80GB HBM3"
    "H100 PCIe": 2.0e12,  # NVIDIA H100 datasheet, PCIe
    "H100 NVL": 3.9e12,  # NVIDIA H100 datasheet, NVL
    "H200": 4.8e12,  # HBM3e (NVIDIA H200 datasheet, SXM and NVL)
    "A100": 1.555e12,  # A100 40GB, HBM2 (NVIDIA A100 datasheet, SXM and PCIe)
    "A100-SXM4-80GB": 2.039e12,  # NVIDIA A100 datasheet, 80GB SXM
    "A100 80GB PCIe": 1.935e12,  # NVIDIA A100 datasheet, 80GB PCIe
    "L40S": 864e9,  # GDDR6 (NVIDIA L40S datasheet)
    # One stack (tile): 3.2768 TB/s per 2-stack GPU (Intel ark, Data Center GPU Max 1550); with
    # ZE_FLAT_DEVICE_HIERARCHY=FLAT (Aurora's default) torch sees each stack as a device of this name.
    "Max 1550": 3.2768e12 / 2,
}
#: Each topology preset's GPU (a key of :data:`DEVICE_MEMORY_BPS`, as its configs/<preset>.yaml
#: describes it), and the preset an emulated fabric stands for: the fabrics run on a CPU host, so
#: V-Major's kernels there are priced on the GPU of the cluster they emulate.
PRESET_GPUS = {"dgx-h100": "H100", "dgx-h200": "H200", "aurora": "Max 1550", "pcie-8gpu": "L40S"}
EMULATES = {"rail": "dgx-h100", "shared-uplink": "dgx-h100", "aurora-like": "aurora"}
MEMORY_BPS = {preset: DEVICE_MEMORY_BPS[gpu] for preset, gpu in PRESET_GPUS.items()}
#: What real collectives achieved on a preset's hardware, where a source measured it: the
#: uncalibrated plan says it beside its line-rate prices.
MEASURED = {
    "aurora": "the CoCoDiff paper measured a 48 MB all-to-all on one Aurora node at 25.5 ms with oneCCL "
              "and 6.0 ms with TAPA, far below these line rates",
}
CALIBRATE_HOW = ("calibrate in one step: time the exchanges where the job runs, with your launcher "
                 "(torchrun ... -m cocodiff_xfuser.tools.bench.a2a --topology NxL --json > a2a.json), and pass "
                 "that JSON with --calibrate a2a.json")


def step_messages(spec: ModelSpec, size: int, *, frames: int = 1, batch: int = 1, ulysses: int = 1,
                  ring: int = 1, cfg_parallel: bool = False, v_first: bool = False,
                  height: Optional[int] = None) -> List[Tuple[str, float, int]]:
    """Per-rank all-to-all messages of one denoising step: ``(kind, bytes, count)``.

    ``kind`` is ``qkv``/``q``/``k``/``v``/``qk``/``out``; one unit is one tensor's
    ``b * s / (U R) * ceil(h/U) U * d * dtype`` (padded heads when ``U`` does not divide ``h``).
    """
    img, txt = spec.tokens(size, frames, height)
    if ulysses == 1:
        return []
    b = batch * (2 if spec.cfg and not cfg_parallel else 1)
    heads = math.ceil(spec.heads / ulysses) * ulysses
    units = [("qkv", 3)] if spec.stacked_qkv else [("q", 1), ("k", 1), ("v", 1)]
    if v_first:
        units = [("v", 1), ("qk", 2)]
    out = []
    for count, joint in spec.attn:
        s = img + (txt if joint else 0)
        unit = b * s / (ulysses * ring) * heads * spec.head_dim * spec.dtype_bytes
        out += [(k, n * unit, count) for k, n in units + [("out", 1)]]
    return out


# ---------------------------------------------------------------------------------- clusters
@dataclass(frozen=True)
class LinkLevel:
    name: str
    size: int
    Bps: Optional[float]  # bytes/s per rank crossing the level; None = unlimited
    latency_s: float = 0.0


@dataclass
class Coeffs:
    """What calibration fits (see the module docstring); defaults: an ideal GPU cluster."""

    e0: float = 1.0
    e1: float = 0.0
    h_phase: float = 0.0
    h_byte: float = 0.0
    cores: float = 0.0  # 0: no host term
    flat_factor: float = 1.0  # measured flat / best-routing slope (real-cluster calibration)
    source: str = "preset line rates, ideal links, no host term"


class Cluster:
    """A group of ranks as link levels (outermost first), or an emulated fabric."""

    def __init__(self, levels: Sequence[LinkLevel], fabric: Optional[Fabric] = None, name: str = ""):
        self.levels = [lv for lv in levels if lv.size > 1]
        self.fabric = fabric
        self.name = name

    @property
    def world(self) -> int:
        return math.prod(lv.size for lv in self.levels) if self.levels else 1

    @property
    def nodes(self) -> int:
        return self.fabric.nodes if self.fabric else (self.levels[0].size if len(self.levels) > 1 else 1)

    @classmethod
    def from_preset(cls, preset: str, nodes: int) -> "Cluster":
        """``nodes`` nodes of a topology preset; its schema errors (ValueError) name the file and key."""
        from cocodiff_xfuser.comm.topology import load_preset  # light: no torch

        p = load_preset(preset)
        levels = []
        for lv in p.topology(nodes * p.ranks_per_node).levels:
            if lv.bandwidth_gbps is None:
                raise ValueError(f"preset {preset!r}: level {lv.name!r} has no bandwidth_gbps; calibrate "
                                 "with --calibrate a2a.json")
            levels.append(LinkLevel(lv.name, lv.size, lv.bandwidth_gbps * 1e9, (lv.latency_us or 0.0) * 1e-6))
        return cls(levels, name=preset)

    @classmethod
    def from_fabric(cls, fab: Fabric) -> "Cluster":
        lc = fab.link_classes
        if fab.preset == "aurora-like":
            levels = [LinkLevel("node", fab.nodes, lc["uplink"].Bps / fab.local),
                      LinkLevel("gpu", fab.local // 2, lc["xe"].Bps), LinkLevel("tile", 2, None)]
        else:
            Bps = lc["rail"].Bps if fab.preset == "rail" else lc["uplink"].Bps / fab.local
            levels = [LinkLevel("node", fab.nodes, Bps), LinkLevel("gpu", fab.local, None)]
        return cls(levels, fabric=fab, name=f"{fab.preset} {fab.nodes}x{fab.local}")

    def subgroup(self, size: int) -> "Cluster":
        """The cluster of ``size`` contiguous ranks (innermost levels first)."""
        if self.world % size:
            raise ValueError(f"a group of {size} does not divide {self.world} ranks")
        levels, left = [], size
        for lv in reversed(self.levels):
            take = min(left, lv.size)
            if left % take or (take < lv.size and lv.size % take):
                raise ValueError(f"a group of {size} ranks does not fit the levels {self.describe()}")
            levels.insert(0, replace(lv, size=take))
            left //= take
        if self.fabric is not None and size > 1:
            inner = math.prod(lv.size for lv in levels[1:]) if len(levels) > 1 else size
            if levels and levels[0].name == "node":
                return Cluster.from_fabric(Fabric(self.fabric.preset, levels[0].size, inner, params=self.fabric.params))
        return Cluster(levels, name=self.name)

    def describe(self) -> str:
        return " x ".join(f"{lv.size} {lv.name}" + (f" ({lv.Bps / 1e9:g} GB/s)" if lv.Bps else "") for lv in self.levels)

    # -- link times (seconds), before efficiency and host terms
    def flat_link(self, x: float, slow_scale: float = 1.0) -> float:
        if self.fabric is not None:
            cb = self.fabric.bound_breakdown("flat", x)
            slow = {"uplink", "rail", "spine"}  # classes crossed by inter-node bytes
            return max((v["seconds"] * (slow_scale if k in slow else 1.0) for k, v in cb.items()), default=0.0)
        t, outer = 0.0, 1
        for i, lv in enumerate(self.levels):
            frac = (lv.size - 1) / lv.size / outer
            if lv.Bps:
                t = max(t, x * frac / lv.Bps * (slow_scale if i == 0 else 1.0))
            outer *= lv.size
        return t

    def phases(self, x: float, slow_scale: float = 1.0) -> List[float]:
        """TAPA's phase link times, innermost level first."""
        out = []
        for i, lv in reversed(list(enumerate(self.levels))):
            scale = slow_scale if i == 0 and len(self.levels) > 1 else 1.0
            out.append(0.0 if not lv.Bps else x * (lv.size - 1) / lv.size / lv.Bps * scale)
        return out

    def latency(self, flat: bool) -> float:
        lats = [lv.latency_s for lv in self.levels]
        return (max(lats) if flat else sum(lats)) if lats else 0.0

    def time(self, algorithm: str, x: float, c: Coeffs, slow_scale: float = 1.0) -> float:
        """Predicted seconds of one exchange (``flat``, ``flat_p2p``, ``hierarchical[_xP]``)."""
        if self.world <= 1:
            return 0.0
        eff = c.e0 + c.e1 * max(0, self.nodes - 2)
        if algorithm.startswith("flat") or len(self.levels) < 2:
            link, nph = self.flat_link(x, slow_scale) * c.flat_factor, 1
            lat = self.latency(True)
        else:
            parts = int(algorithm.rsplit("_x", 1)[1]) if "_x" in algorithm else 1
            ph = self.phases(x, slow_scale)
            link = max(ph) + (sum(ph) - max(ph)) / parts
            nph = len(self.levels) * parts
            lat = self.latency(False) * parts
        host = (self.world / c.cores) * (c.h_phase * nph + c.h_byte * x) if c.cores else 0.0
        return max(eff * link + lat, host)

    def best(self, x: float, c: Coeffs, slow_scale: float = 1.0) -> Tuple[str, float]:
        cands = ["flat"] + (["hierarchical", "hierarchical_x2", "hierarchical_x4"] if len(self.levels) > 1 else [])
        return min(((a, self.time(a, x, c, slow_scale)) for a in cands), key=lambda t: t[1])


# ---------------------------------------------------------------------------------- calibration
@dataclass
class Sample:
    cluster: Cluster
    algorithm: str
    x: float
    measured: float
    group: str = ""
    label: str = ""


def fit(samples: Sequence[Sample], cores: float = 2.0, iters: int = 60) -> Coeffs:
    """Least squares on relative error: link-bound points fit (e0, e1), host-bound (h_phase, h_byte),
    alternating until the split into the two regimes is stable."""
    import numpy as np

    if len(samples) < 2:
        raise ValueError("calibration needs at least two measurements")
    c = Coeffs(1.1, 0.05, 0.002, 1e-9, cores, source="")
    split = None
    for _ in range(iters):
        link_rows, host_rows = [], []
        for s in samples:
            cl, a = s.cluster, s.algorithm
            host_only = Coeffs(0.0, 0.0, c.h_phase, c.h_byte, cores)
            link_only = replace(c, cores=0.0)
            lt, ht = cl.time(a, s.x, link_only), cl.time(a, s.x, host_only)
            nph = 1 if a.startswith("flat") or len(cl.levels) < 2 else len(cl.levels) * (int(a.rsplit("_x", 1)[1]) if "_x" in a else 1)
            if lt >= ht:
                base = lt / (c.e0 + c.e1 * max(0, cl.nodes - 2))
                link_rows.append([base / s.measured, base * max(0, cl.nodes - 2) / s.measured])
            else:
                w = cl.world / cores
                host_rows.append([w * nph / s.measured, w * s.x / s.measured])
        new_split = (len(link_rows), len(host_rows))
        if len(link_rows) >= 2:
            A = np.array(link_rows)
            if np.ptp(A[:, 1]) == 0 or not A[:, 1].any():
                c.e0, c.e1 = float(np.linalg.lstsq(A[:, :1], np.ones(len(A)), rcond=None)[0][0]), 0.0
            else:
                c.e0, c.e1 = (float(v) for v in np.linalg.lstsq(A, np.ones(len(A)), rcond=None)[0])
        if len(host_rows) >= 2:
            h = np.linalg.lstsq(np.array(host_rows), np.ones(len(host_rows)), rcond=None)[0]
            c.h_phase, c.h_byte = max(float(h[0]), 0.0), max(float(h[1]), 0.0)
        if new_split == split:
            break
        split = new_split
    return c


def _a2a_reports(paths: Sequence[Path]) -> List[dict]:
    reps = []
    for p in paths:
        try:
            d = json.loads(Path(p).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read a2a results {p}: {e}") from None
        if "reports" in d:  # a multi-shape summary: the per-shape files hold the same reports
            continue
        if not isinstance(d, dict) or "results" not in d or "levels" not in d:
            raise ValueError(f"{p} is not a `cocodiff bench a2a` JSON (no results/levels)")
        reps.append(d)
    return reps


def a2a_samples(report: dict, floor: bool = False) -> List[Sample]:
    """Samples of one a2a report per size: flat (stock), flat_p2p (the fair flat exchange),
    hierarchical, and the chosen exchange when it is none of them (pipelined ``hierarchical_xP``);
    with ``floor`` the host floors instead
    (emulated fabrics only: the same exchanges at 100x the line rates)."""
    fabric = report.get("fabric")
    if fabric in FABRICS:
        fab = Fabric(fabric, report["nodes"], report["local"], params=report.get("fabric_params"))
        cl = Cluster.from_fabric(fab)
        shape = f"{report['nodes']}x{report['local']}"
        if floor:
            cl = Cluster.from_fabric(Fabric(fab.preset, fab.nodes, fab.local, params={
                k: v * 100 if k.endswith("_bps") else v for k, v in fab.params.items()}))
    elif floor:
        return []
    else:  # a real cluster: levels only, bandwidths unknown (fitted per level by calibrate())
        cl = Cluster([LinkLevel(f"level{i}", s, None) for i, s in enumerate(report["levels"])])
        fabric, shape = "cluster", "x".join(map(str, report["levels"]))
    out = []
    for r in report["results"]:
        x, mib = float(r["size_bytes"]), f"{fabric} {shape} {r['size_bytes'] / 2**20:g} MiB"
        if floor:
            if r.get("host_floor_s"):
                out.append(Sample(cl, "best", x, r["host_floor_s"], f"a2a/{fabric}/host-floor", f"{mib} host floor"))
            continue
        for alg in ("flat", "flat_p2p", "hierarchical", "chosen"):
            a = r["chosen"] if alg == "chosen" else alg
            m = r.get(f"{alg}_s")
            # chosen: not measured twice; the PXN-like relay is not one of the model's algorithms
            if m and (alg != "chosen" or a not in ("flat", "flat_p2p", "hierarchical", "flat_pxn")):
                out.append(Sample(cl, a, x, float(m), f"a2a/{fabric}/{alg}", f"{mib} {alg} ({a})"))
    return out


def calibrate_file(path: Path, cores: float = 2.0) -> Tuple[Coeffs, Optional[Cluster]]:
    """Coefficients from one ``cocodiff bench a2a`` JSON (emulated fabric: its line rates + fitted
    efficiency and host terms; a real cluster: the slowest level's effective bandwidth and latency
    fitted by least squares on the flat exchange, the inner levels' from the hierarchical one)."""
    import numpy as np

    reps = _a2a_reports([path]) or _a2a_reports(sorted(Path(path).parent.glob(Path(path).stem + "-*.json")))
    if not reps:
        raise ValueError(f"{path}: no a2a measurements")
    if all(r.get("fabric") in FABRICS for r in reps):
        c = fit([s for r in reps for s in a2a_samples(r)], cores)
        c.source = f"fitted on {path} (fabric line rates + efficiency and host terms)"
        return c, None
    r = reps[0]
    levels = list(r["levels"]) or [r["world_size"]]  # one level (one node): no hierarchy to split
    W = math.prod(levels)

    def line(key: str) -> Tuple[float, float]:
        xs = np.array([float(p["size_bytes"]) for p in r["results"] if p.get(key)])
        ts = np.array([float(p[key]) for p in r["results"] if p.get(key)])
        if len(xs) < 2:
            raise ValueError(f"{path}: fewer than two {key} measurements")
        slope, lat = np.polyfit(xs, ts, 1)
        return max(float(lat), 0.0), max(float(slope), 1e-15)

    # The slowest (node) level from the best routing's slope: TAPA's node phase carries (N-1)/N of
    # a rank's data, its inner phases are taken as free (fast levels); flat's extra cost over that
    # routing (contention, oversubscription) is kept as one factor on its slope.
    lat0, slope0 = line("flat_s")
    lat1, slope1 = line("hierarchical_s") if any(p.get("hierarchical_s") for p in r["results"]) else (lat0, slope0)
    best_lat, best_slope = (lat1, slope1) if slope1 < slope0 else (lat0, slope0)
    outer_frac = (levels[0] - 1) / levels[0]
    lv = [LinkLevel("node", levels[0], outer_frac / best_slope, best_lat)]
    if len(levels) > 1:
        lv.append(LinkLevel("gpu", W // levels[0], None))
    c = Coeffs(flat_factor=slope0 / best_slope, source=f"the slowest level's latency and bandwidth fitted on {path}")
    return c, Cluster(lv, name=str(path))


# ---------------------------------------------------------------------------------- e2e
_RATE = re.compile(r"^\s*(\w+)\s+(\d+) x ([\d.]+) Mbit/s each", re.M)


def _e2e_fabric(d: dict) -> Fabric:
    """The run's fabric: its ``fabric_params``, or (older reports) the rates in its description."""
    preset, N, L = d["fabric"], d["nodes"], d["local"]
    params = d.get("fabric_params")
    if params is None:
        rates = {m.group(1): float(m.group(3)) * 1e6 for m in _RATE.finditer(d["fabric_description"])}
        if preset == "rail":
            params = {"rail_bps": rates["rail"]}
        elif preset == "shared-uplink":
            params = {"uplink_bps": rates["uplink"]}
        else:
            params = {"tile_nic_share_bps": rates["uplink"] / L}
    return Fabric(preset, N, L, params=params)


def v_major_scale(spec: ModelSpec, active: float, steps: int) -> float:
    """The share of an exchange's slow-link bytes V-Major sends at its defaults: every row at its
    first step (as residuals against zeros, or exact without a residual dtype), then the ``active``
    share of the rows (as residuals in the default dtype, or values)."""
    from cocodiff_xfuser.comm import residuals  # torch: loaded only where V-Major is priced
    from cocodiff_xfuser.settings import VMajorSettings

    residual = VMajorSettings.load().residual
    first = min(1.0, 1 / max(steps, 1))
    if residual is None:
        return first + (1 - first) * active
    per_value = residuals.row_bytes(spec.head_dim, residual) / (spec.head_dim * spec.dtype_bytes)
    return per_value * (first + (1 - first) * active)


def predict_step(spec: ModelSpec, cl: Cluster, c: Coeffs, *, size: int, frames: int = 1, batch: int = 1,
                 ulysses: int, ring: int = 1, cfg_parallel: bool = False, algorithm: str = "best",
                 v_first: bool = False, v_major: Optional[float] = None, steps: int = 50,
                 compute_layer_s: Optional[float] = None, tflops: float = DEFAULT_TFLOPS,
                 height: Optional[int] = None) -> dict:
    """Per-step exposed communication of one configuration (seconds and its parts).

    ``cl`` is the Ulysses group's cluster; ``v_major``: active fraction on the slow level (None = off);
    ``compute_layer_s``: measured compute per attention layer (else FLOPs / ``tflops``)."""
    img, txt = spec.tokens(size, frames, height)
    msgs = step_messages(spec, size, frames=frames, batch=batch, ulysses=ulysses, ring=ring,
                         cfg_parallel=cfg_parallel, v_first=v_first, height=height)
    per_layer = max(len(msgs) // len(spec.attn), 1)
    res_scale = 1.0 if v_major is None else v_major_scale(spec, v_major, steps)  # every exchange (scope qkvo)
    total = hidden = nbytes = 0.0
    algs: Dict[str, int] = {}
    for i, (kind, x, count) in enumerate(msgs):
        scale = res_scale
        if algorithm == "best":
            a, t = cl.best(x, c, scale)
        else:
            a, t = algorithm, cl.time(algorithm, x, c, scale)
        algs[a] = algs.get(a, 0) + count
        nbytes += x * count
        if kind == "v" and v_first:
            joint = spec.attn[i // per_layer][1]
            s = img + (txt if joint else 0)
            b = batch * (2 if spec.cfg and not cfg_parallel else 1)
            if compute_layer_s is None:
                comp = b * layer_flops(spec, s, s / (ulysses * ring)) / (tflops * 1e12)
            else:
                comp = compute_layer_s
            D = spec.heads * spec.head_dim
            window = comp * 4 * D / (24 * D + 4 * s)  # Q/K projections' share of the block
            hidden += min(t, window) * count
        total += t * count
    ring_bytes, ring_attn = [], []
    if ring > 1:  # K/V blocks passed R-1 times per layer, overlapped with the attention blocks
        b = batch * (2 if spec.cfg and not cfg_parallel else 1)
        D = math.ceil(spec.heads / ulysses) * spec.head_dim
        for count, joint in spec.attn:
            s = img + (txt if joint else 0)
            ring_bytes.append((count, (ring - 1) * 2 * b * s / ring * D * spec.dtype_bytes))
            ring_attn.append(4 * b * (s / ring) * s * D / (tflops * 1e12))  # this rank's attention
    return {"comm_s": total - hidden, "v_hidden_s": hidden, "ring": list(zip(ring_bytes, ring_attn)),
            "bytes": nbytes, "algorithms": algs}


def e2e_samples(path: Path, c: Coeffs) -> List[Tuple[Sample, float]]:
    d = json.loads(Path(path).read_text())
    spec = MODELS.get(d["model"])
    if spec is None:
        return []
    cl = Cluster.from_fabric(_e2e_fabric(d))
    # Ulysses over all ranks only (older reports ran nothing else); their mechanism was their name.
    world = d.get("ulysses_degree") or d["world_size"]
    rows = [x for x in d["configs"] if x.get("layout", f"U{world}") == f"U{world}"]
    stock = next(x for x in rows if x.get("mechanism", x["name"]) == "stock")
    compute_layer = (stock["step_s"] - stock["comm_exposed_s"]) / spec.layers
    out = []
    for cfg in rows:
        name, mechanism = cfg["name"], cfg.get("mechanism", cfg["name"])
        if mechanism == "fair-flat" and "flat-pxn" in cfg["exchanges_by_algorithm"]:
            continue  # PXN's relayed routing is not one of the model's algorithms
        p = predict_step(spec, cl, c, size=d["size"], ulysses=world, steps=d["steps"],
                         algorithm={"stock": "flat", "fair-flat": "flat_p2p"}.get(mechanism, "best"),
                         v_first="vfirst" in mechanism, v_major=cfg["v_major_active_fraction"] if "vmajor" in mechanism else None,
                         compute_layer_s=compute_layer)
        if abs(p["bytes"] - cfg["bytes_per_step"]) > 0.01 * cfg["bytes_per_step"]:
            raise ValueError(f"{path}: model {spec.name} gives {p['bytes']:.0f} bytes per step, "
                             f"the run measured {cfg['bytes_per_step']:.0f}")
        s = Sample(cl, name, 0.0, cfg["comm_exposed_s"], f"e2e/{d['model']}-{d['fabric']}",
                   f"{d['model']} {d['fabric']} {name} (exposed comm per step)")
        out.append((s, p["comm_s"]))
    return out


# ---------------------------------------------------------------------------------- validate
def validate(results: Path = RESULTS_DIR) -> dict:
    results = Path(results)
    reps = _a2a_reports(sorted(results.glob("a2a-*-*x*.json")))
    e2e = sorted(results.glob("e2e-*.json"))
    if not reps:
        raise ValueError(f"no a2a results (a2a-<fabric>-<shape>.json) in {results}")
    by_fabric: Dict[str, List[Sample]] = {}
    for r in reps:
        by_fabric.setdefault(r["fabric"], []).extend(a2a_samples(r))
    rows = []
    for fabric, samples in by_fabric.items():
        train = [s for f, ss in by_fabric.items() if f != fabric for s in ss]
        c = fit(train)
        for s in samples + [f for r in reps if r["fabric"] == fabric for f in a2a_samples(r, floor=True)]:
            pred = s.cluster.best(s.x, c)[1] if s.algorithm == "best" else s.cluster.time(s.algorithm, s.x, c)
            rows.append((s, pred))
    c_all = fit([s for ss in by_fabric.values() for s in ss])
    for p in e2e:
        rows += e2e_samples(p, c_all)
    points = [{"group": s.group, "point": s.label, "measured_s": s.measured, "predicted_s": pr,
               "rel_error": pr / s.measured - 1} for s, pr in rows]
    groups: Dict[str, List[float]] = {}
    for p in points:
        groups.setdefault(p["group"], []).append(abs(p["rel_error"]))
    med = statistics.median(abs(p["rel_error"]) for p in points)
    return {
        "method": ("leave-one-fabric-out: a2a points of a fabric are predicted from its line rates with "
                   "efficiency and host coefficients fitted on the other fabrics' a2a points; e2e points "
                   "with coefficients fitted on all a2a points, and two inputs taken from measured runs: "
                   "V-First points take the compute time from the stock run's measured step_s - "
                   "comm_exposed_s, V-Major points their own run's measured v_major_active_fraction "
                   "(a token count share, not a time)"),
        "median_abs_rel_error": med, "target": TARGET_MEDIAN, "met": med <= TARGET_MEDIAN,
        "points": len(points),
        "groups": {g: {"points": len(v), "median_abs_rel_error": statistics.median(v)} for g, v in sorted(groups.items())},
        "coefficients_all_a2a": {k: v for k, v in vars(c_all).items() if k != "source"},
        "per_point": points,
    }


# ---------------------------------------------------------------------------------- plan
def plan(model: str, size: int, *, cluster: Optional[str], nodes: int, local: Optional[int] = None, frames: int = 1,
         batch: int = 1, steps: int = 50, calibrate: Optional[Path] = None, tflops: Optional[float] = None,
         pad_heads: bool = True, fabric_params: Optional[dict] = None) -> dict:
    """The ranked configurations and the recommendation (``fabric_params``: an emulated fabric's
    link overrides, as its run used them)."""
    spec = MODELS.get(model)
    if spec is None:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(sorted(MODELS))}")
    if size <= 0 or size % spec.pixels_per_token or batch < 1 or frames < 1 or nodes < 1 or steps < 1:
        raise ValueError(f"--size must be a positive multiple of {spec.pixels_per_token}; --batch, --frames, "
                         "--nodes, --steps positive")
    if cluster in FABRICS:
        full = Cluster.from_fabric(Fabric(cluster, nodes, local or 2, params=fabric_params))
        c = fit([s for r in _a2a_reports(sorted(RESULTS_DIR.glob("a2a-*-*x*.json"))) for s in a2a_samples(r)])
        c.source = "fitted on the shipped a2a results (emulated fabric, 2-core host)"
    else:  # no preset (None): the calibration's cluster
        full = Cluster.from_preset(cluster, nodes) if cluster is not None else None
        c = Coeffs()
    if calibrate is not None:
        c, fitted = calibrate_file(Path(calibrate))
        if fitted is not None:
            full = fitted
    if full is None:
        raise ValueError("no cluster: name a preset, or calibrate with a real cluster's a2a JSON")
    calibrated = calibrate is not None or cluster in FABRICS
    if calibrated:
        calibration = f"calibrated: {c.source}"
    else:
        measured = MEASURED.get(cluster, "no measurement of real collectives on this hardware is shipped")
        calibration = (f"UNCALIBRATED: links priced at the {cluster} preset's line rates; real collectives run below "
                       f"them, and how far decides whether TAPA helps ({measured}); {CALIBRATE_HOW}")
    W = full.world
    tf = tflops or TFLOPS.get(cluster, DEFAULT_TFLOPS)
    img, txt = spec.tokens(size, frames)
    ring_active = ring_v_major_measured()["v_major_active_fraction"]
    host = host_costs()
    layers = sum(n for n, _ in spec.attn)
    rows = []
    for C in ([1, 2] if spec.cfg and W % 2 == 0 else [1]):
        for U in gpu_model.divisors(W // C):
            R = W // C // U
            if spec.heads % U and not pad_heads:
                continue
            if spec.flux and R > 1 and (img % (U * R) or txt % (U * R)):
                continue  # uneven tokens: cocodiff pads them without ring only, stock refuses uneven image
            try:
                group = full.subgroup(U)
            except ValueError:
                continue
            kw = dict(size=size, frames=frames, batch=batch, ulysses=U, ring=R, cfg_parallel=C == 2,
                      steps=steps, tflops=tf)
            stock = predict_step(spec, group, c, algorithm="flat", **kw)
            tapa = predict_step(spec, group, c, **kw)
            vfirst = predict_step(spec, group, c, v_first=U > 1, **kw)
            coco = vfirst if vfirst["comm_s"] < tapa["comm_s"] else tapa
            ring_cl = full.subgroup(U * R) if R > 1 else None
            ring_s, ring_v_major_s = 0.0, None
            if ring_cl is not None and ring_cl.levels:  # ring neighbours sit U ranks apart
                lv = ring_cl.levels[0]  # the slowest level the ring's span crosses

                def ring_exposed(scale: float) -> float:  # what the attention does not cover
                    return sum(count * max(0.0, (nb * scale / lv.Bps if lv.Bps else 0.0) + lv.latency_s * (R - 1) - attn)
                               for (count, nb), attn in coco["ring"])

                ring_s = ring_exposed(1.0)
                if lv.name == "node":  # V-Major on the ring's K/V across nodes, its bytes scaled as measured
                    ring_v_major_s = ring_exposed(v_major_scale(spec, ring_active, steps))
            b = batch * (2 if spec.cfg and C == 1 else 1)
            pad = math.ceil(spec.heads / U) * U / spec.heads
            compute = b * forward_flops(spec, img, txt, U * R, pad) / (tf * 1e12)
            # The host's time, added in full (an upper bound: a GPU runs behind its host), per
            # layer as bench host counted it on a Ulysses layer (a ring's own host work is not in it).
            host_s = layers * host["v_first" if coco is vfirst and U > 1 else "cocodiff"]
            stock_host_s = layers * host["stock"]
            rows.append({
                "ulysses": U, "ring": R, "cfg": C, "head_padding": pad, "pad_bytes_overhead": pad - 1,
                "bytes_per_step": coco["bytes"], "stock_comm_s": stock["comm_s"] + ring_s,
                "tapa_comm_s": tapa["comm_s"] + ring_s, "cocodiff_comm_s": coco["comm_s"] + ring_s,
                "v_first": coco is vfirst and U > 1, "v_hidden_s": coco["v_hidden_s"], "ring_s": ring_s, "algorithms": coco["algorithms"],
                "compute_s": compute, "host_s": host_s, "step_s": compute + coco["comm_s"] + ring_s + host_s,
                "stock_host_s": stock_host_s, "stock_step_s": compute + stock["comm_s"] + ring_s + stock_host_s,
                "ring_bytes_per_step": sum(n * nb for (n, nb), _ in coco["ring"]),
                # With V-Major on the ring's K/V (lossy; None where the ring stays inside a node).
                "ring_v_major_step_s": None if ring_v_major_s is None else compute + coco["comm_s"] + ring_v_major_s + host_s,
            })
    if not rows:
        raise ValueError(f"no ulysses x ring x cfg factorization of {W} ranks fits {spec.name}")
    rows.sort(key=lambda r: r["step_s"])
    pipefusion = pipefusion_rows(spec, full, c, size=size, frames=frames, batch=batch, steps=steps, tflops=tf,
                                 host_s=layers * host["stock"])
    best = rows[0]
    best_stock = min(rows, key=lambda r: r["stock_step_s"])
    # Stock where cocodiff's predicted step, its own host time included, is no shorter.
    stock_wins = best_stock["stock_step_s"] <= best["step_s"]
    chosen = best_stock if stock_wins else best
    flags = ["--ulysses_degree", str(chosen["ulysses"]), "--ring_degree", str(chosen["ring"])]
    if chosen["cfg"] == 2:
        flags.append("--use_cfg_parallel")
    if not stock_wins:
        flags += ["--sp-backend", "cocodiff"] + (["--cocodiff-v-first"] if best["v_first"] else [])
    return {"model": spec.name, "model_source": spec.source, "size": size, "frames": frames, "batch": batch,
            "steps": steps, "cluster": cluster, "nodes": nodes, "world": W, "levels": full.describe(),
            "tokens": {"image": img, "text": txt}, "calibrated": calibrated, "calibration": calibration,
            "coefficients": c.source,
            "compute_estimate": f"FLOPs at {tf:g} TFLOP/s per rank (assumed)", "ranked": rows,
            "host": {**host, "source": f"`cocodiff bench host`'s counts per layer ({HOST_RUN}, eager, tiny-flux on "
                                        f"Ulysses 2) at one H200 host's cost per Python call, torch operator and Triton "
                                        f"launch ({HOST_COSTS}), added in full to every step: an upper bound"},
            "recommended": {"flags": " ".join(flags), "backend": "stock" if stock_wins else "cocodiff",
                            **{k: chosen[k] for k in ("ulysses", "ring", "cfg")}},
            "best_stock": best_stock,
            "speedup_vs_best_stock": best_stock["stock_step_s"] / min(best["step_s"], best_stock["stock_step_s"]),
            "pipefusion": pipefusion,
            "v_major": v_major_plan(spec, full, c, rows, cluster, size=size, frames=frames, batch=batch, steps=steps,
                                    tflops=tf)}


def pipefusion_rows(spec: ModelSpec, full: Cluster, c: Coeffs, *, size: int, frames: int, batch: int, steps: int,
                    tflops: float, host_s: float) -> List[dict]:
    """Stock PipeFusion's layouts, fastest first: Ulysses inside (stock's exchange on its group) x
    ``P`` stages over the rest (and CFG parallel where the model has it), priced as :mod:`.gpu_model`
    prices them: a stage computes and exchanges 1/P of the layers for every patch, the pipeline's
    fill costs (P - 1) / P of one step over the run, and each step a rank passes its activations to
    the next stage over the slowest link the stages span (the hop that crosses nodes paces the
    pipeline). Lossy (stale activations): each row carries PipeFusion's measured PSNR at its stage
    count (:data:`PIPEFUSION_RUN`), None where unmeasured."""
    if not spec.pipefusion:
        return []
    img, txt = spec.tokens(size, frames)
    quality = pipefusion_measured()
    D = spec.heads * spec.head_dim
    out = []
    for C in ([1, 2] if spec.cfg and full.world % 2 == 0 else [1]):
        for P in gpu_model.divisors(full.world // C):
            U = full.world // C // P
            if P == 1 or P > spec.layers or spec.heads % U:
                continue
            try:
                group, span = full.subgroup(U), full.subgroup(U * P)
            except ValueError:
                continue
            stock = predict_step(spec, group, c, algorithm="flat", size=size, frames=frames, batch=batch, ulysses=U,
                                 cfg_parallel=C == 2, steps=steps, tflops=tflops)
            b = batch * (2 if spec.cfg and C == 1 else 1)
            compute = b * forward_flops(spec, img, txt, U) / (tflops * 1e12) / P
            comm = stock["comm_s"] / P
            link = span.levels[0] if span.levels else None
            send_bytes = b * (img + txt) / U * D * spec.dtype_bytes
            send = send_bytes / link.Bps + link.latency_s if link is not None and link.Bps else 0.0
            pipe = (compute + comm) * (P - 1) / (P * steps) + send
            name = f"U{U}xPF{P}" + ("xC2" if C == 2 else "")
            out.append({"name": name, "ulysses": U, "pipefusion": P, "cfg": C, "compute_s": compute, "comm_s": comm,
                        "pipefusion_s": pipe, "host_s": host_s, "step_s": compute + comm + pipe + host_s,
                        "send_bytes_per_step": send_bytes, "send_link": link.name if link is not None else None,
                        "psnr_db": quality.get(P)})
    return sorted(out, key=lambda r: r["step_s"])


def plan_gpu(model: str, size: int, *, gpu: str, mode: str, gpus_per_node: int, nodes: int, height: Optional[int] = None,
             frames: int = 1, steps: int = 50, inter_node_gbps: Optional[float] = None) -> dict:
    """Every layout of ``gpus_per_node x nodes`` GPUs of a class (:mod:`.gpu_model`), stock and with
    cocodiff's exact exchange, ranked by the whole run: its step and total seconds. cocodiff's
    Ulysses exchange takes the fitted stock exchange's time scaled by what the per-level model
    gives the two (TAPA's phases, V-First's hidden V); eager, its host floor scales stock's by
    ``bench host``'s counts per layer (the same source for both)."""
    spec = MODELS.get(model)
    if spec is None:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(sorted(MODELS))}")
    if mode not in gpu_model.MODES:
        raise ValueError(f"--mode must be one of {', '.join(gpu_model.MODES)}")
    height = height or size
    if min(size, height) <= 0 or size % spec.pixels_per_token or height % spec.pixels_per_token or min(
            frames, steps, gpus_per_node, nodes) < 1:
        raise ValueError(f"--size and --height must be positive multiples of {spec.pixels_per_token}; --frames, "
                         "--steps, --gpus-per-node, --nodes positive")
    g = gpu_model.gpu(gpu)
    run = gpu_model.Run(spec, size, height, frames, steps, g, mode, gpus_per_node, nodes, inter_node_gbps)
    c = gpu_model.fitted()
    levels = [LinkLevel("node", nodes, (inter_node_gbps or g.inter_node_gbps) * 1e9),
              LinkLevel("gpu", gpus_per_node, g.node_link_gbps * 1e9)]
    full = Cluster(levels, name=f"{gpu} {nodes}x{gpus_per_node}")
    links = Coeffs(e0=1 / c.a2a_share, source="the all-to-all's share of link rate fitted on xDiT's published runs")
    host = host_costs()
    pipefusion_quality = pipefusion_measured()
    tflops = g.tflops * c.rate_share(g, mode)
    fixed = c.fixed_s(run)
    rows = []
    for layout in gpu_model.layouts(run, stock=False):
        stock = gpu_model.step(run, layout, c)
        runs_stock = spec.heads % layout.ulysses == 0
        if runs_stock:
            rows.append(_gpu_row(layout, "stock", stock, steps, fixed))
            if layout.pipefusion > 1:  # at its measured quality, where there is one
                rows[-1]["psnr_db"] = pipefusion_quality.get(layout.pipefusion)
        if layout.ulysses == 1:
            continue  # no Ulysses exchange: cocodiff runs stock's layers
        group = full.subgroup(layout.ulysses)
        kw = dict(size=size, height=height, frames=frames, ulysses=layout.ulysses, ring=layout.ring,
                  cfg_parallel=layout.cfg == 2, steps=steps, tflops=tflops)
        flat = predict_step(spec, group, links, algorithm="flat", **kw)["comm_s"]
        tapa, vfirst = predict_step(spec, group, links, **kw), predict_step(spec, group, links, v_first=True, **kw)
        best = vfirst if vfirst["comm_s"] < tapa["comm_s"] else tapa
        ulysses = stock["ulysses_s"] * best["comm_s"] / flat if flat else stock["ulysses_s"]
        ratio = host["v_first" if best is vfirst else "cocodiff"] / host["stock"]
        device = stock["compute_s"] + ulysses + stock["ring_s"] + stock["pipefusion_s"]
        parts = {**stock, "ulysses_s": ulysses, "host_s": stock["host_s"] * ratio,
                 "step_s": max(device, stock["host_s"] * ratio), "host_bound": stock["host_s"] * ratio > device,
                 "v_first": best is vfirst, "algorithms": best["algorithms"]}
        rows.append(_gpu_row(layout, "cocodiff", parts, steps, fixed))
        v_major = _gpu_v_major(run, layout, c, group, links, kw, stock, parts, flat, host, steps, fixed)
        if v_major is not None:
            rows.append(v_major)
    if not rows:
        raise ValueError(f"no ulysses x ring x cfg x pipefusion layout of {run.world} GPUs fits {spec.name}")
    rows.sort(key=lambda r: r["total_s"])
    # The best of the layouts the fit has seen the like of (PipeFusion's are priced, not validated).
    stock_rows = [r for r in rows if r["backend"] == "stock" and r["validated"]]
    best_stock = stock_rows[0] if stock_rows else None
    best = next(r for r in rows if r["validated"] and not r["lossy"])
    best_lossy = next((r for r in rows if r["validated"] and r["lossy"]), None)
    best_pipefusion = next((r for r in rows if r["backend"] == "stock" and r["pipefusion"] > 1 and r["psnr_db"] is not None),
                           None)
    return {"model": spec.name, "model_source": spec.source, "size": f"{size}x{height}", "frames": frames,
            "steps": steps, "gpu": g.key, "gpu_name": g.name, "mode": mode, "gpus_per_node": gpus_per_node,
            "nodes": nodes, "world": run.world, "levels": full.describe(), "fixed_s": fixed,
            "constants": ("fitted on xDiT's published runs (docs/results/xdit-published.yaml; `cocodiff plan "
                          "--validate`)" if (g.key, "eager") in c.share else
                          f"{g.key} has no published run: {g.like}'s achieved shares of its datasheet figures"),
            "ranked": rows, "best": best, "best_stock": best_stock, "best_lossy": best_lossy,
            "best_pipefusion": best_pipefusion,
            "speedup_vs_best_stock": best_stock["total_s"] / best["total_s"] if best_stock else None}


def _gpu_v_major(run: "gpu_model.Run", layout: "gpu_model.Layout", c: "gpu_model.Constants", group: Cluster,
                 links: Coeffs, kw: dict, stock: dict, lossless: dict, flat: float, host: dict, steps: int,
                 fixed: float) -> Optional[dict]:
    """cocodiff with V-Major (lossy) on whichever of the layout's exchanges cross nodes: the Ulysses
    one (its slow level's bytes scaled as the defaults' quality run measured; the fitted stock
    exchange scaled as the per-level model prices the two) and the ring's K/V (as its own run
    measured); its kernels priced from one H200's, scaled by memory bandwidth; eager, its host time
    by ``bench host``'s counts. None where nothing crosses nodes."""
    spec, g = run.model, run.gpu
    on_ulysses = layout.ulysses > run.gpus_per_node
    on_ring = layout.ring > 1 and layout.ulysses * layout.ring > run.gpus_per_node
    if not (on_ulysses or on_ring):
        return None
    parts, quality = dict(lossless), []
    if on_ulysses:
        measured = v_major_defaults()
        vm = predict_step(spec, group, links, v_first=True, v_major=measured["v_major_active_fraction"], **kw)
        parts["ulysses_s"] = stock["ulysses_s"] * vm["comm_s"] / flat
        quality.append(measured["psnr_db"])
    if on_ring:
        measured = ring_v_major_measured()
        parts["ring_s"] = gpu_model.step(run, layout, c, v_major_scale(spec, measured["v_major_active_fraction"], steps))["ring_s"]
        quality.append(measured["psnr_db"])
    fixed_s, per_byte = v_major_layer_cost(KERNEL_GPU)
    scale = DEVICE_MEMORY_BPS[KERNEL_GPU] / (g.memory_gbps * 1e9)
    img, txt = spec.tokens(run.width, run.frames, run.height)
    batch = (2 if spec.cfg else 1) / layout.cfg
    tensors = (1 if on_ulysses else 0) + (2 if on_ring else 0)
    kernels = sum(n * tensors * scale * (fixed_s + per_byte * batch * (img + (txt if j else 0)) / (layout.ulysses * layout.ring)
                                         * spec.heads * spec.head_dim * spec.dtype_bytes) for n, j in spec.attn) / layout.pipefusion
    host_s = parts["host_s"] * host["v_major"] / host["v_first"] if run.mode == "eager" else 0.0
    device = parts["compute_s"] + parts["ulysses_s"] + parts["ring_s"] + parts["pipefusion_s"] + kernels
    parts.update(host_s=host_s, step_s=max(device, host_s), host_bound=host_s > device, v_major_kernels_s=kernels,
                 v_major_on=" and ".join(x for x, on in (("ulysses", on_ulysses), ("ring", on_ring)) if on))
    row = _gpu_row(layout, "cocodiff+v-major", parts, steps, fixed)
    row.update(lossy=True, psnr_db=min(quality))
    return row


def _gpu_row(layout: "gpu_model.Layout", backend: str, parts: dict, steps: int, fixed: float) -> dict:
    # PipeFusion's stale activations make any backend's images lossy.
    return {"name": layout.name, "backend": backend, "lossy": layout.pipefusion > 1, "psnr_db": None,
            "ulysses": layout.ulysses, "ring": layout.ring, "cfg": layout.cfg, "pipefusion": layout.pipefusion,
            "validated": gpu_model.validated(layout), "step_s": parts["step_s"], "total_s": steps * parts["step_s"] + fixed,
            "parts": {k: v for k, v in parts.items() if k != "step_s"}}


def v_major_plan(spec: ModelSpec, full: Cluster, c: Coeffs, rows: List[dict], cluster: Optional[str], *, size: int,
                 frames: int, batch: int, steps: int, tflops: float) -> Optional[dict]:
    """V-Major where the layout crosses nodes (None elsewhere): on the Ulysses exchanges of the best
    layout, or on the ring's K/V; recommended where it saves a fifth of the best lossless
    communication, its kernels and host time included, else said why not."""
    best, host, (cost, priced) = rows[0], host_costs(), v_major_kernel_cost(cluster)
    img, txt = spec.tokens(size, frames)
    slow = full.subgroup(best["ulysses"])

    def kernels_s(row: dict, tensors: int) -> float:
        """Its kernels per step on ``tensors`` of the size of the V a rank holds ([s / (U R)] tokens x
        every head), what the fit is per byte of."""
        b = batch * (2 if spec.cfg and row["cfg"] == 1 else 1)
        return sum(n * (cost[0] + cost[1] * tensors * b * (img + (txt if j else 0)) / (row["ulysses"] * row["ring"])
                        * spec.heads * spec.head_dim * spec.dtype_bytes) for n, j in spec.attn)

    def work_s(row: dict, tensors: int) -> float:
        # V-Major runs on V-First's layer: its host time is what its layer adds to that one's.
        return kernels_s(row, tensors) + spec.layers * (host["v_major"] - host["v_first"])

    def section(row: dict, tensors: int, slow_bytes: float, measured: dict, comm_s: float, layout: Optional[str],
                on: str) -> dict:
        """``slow_bytes``: what a rank sends across nodes per step in the exchanges V-Major gates; it
        saves the share :func:`predict_step` takes off them, and pays on links slower than those bytes
        per second of its kernels."""
        kernels = kernels_s(row, tensors)
        saved = slow_bytes * (1 - v_major_scale(spec, measured["v_major_active_fraction"], steps)) / spec.layers
        work = work_s(row, tensors)
        return {"on": on, "recommended": False, "flag": "--cocodiff-v-major on", "layout": layout, "comm_s": comm_s,
                "compute_s": work, "v_major_kernel_s": kernels / spec.layers, "kernels_priced": priced,
                "slow_link_bytes_saved_per_layer": saved, "v_major_break_even_gbps": saved / kernels * spec.layers / 1e9,
                "note": f"lossy, on {on}: {measured['psnr_db']:.1f} dB PSNR vs stock on digits-flux at the "
                        f"defaults ({measured['slow_link_bytes_saved_fraction']:.0%} of the slow-link bytes saved; its "
                        f"kernels and host time {work * 1e3:.2f} ms per step, its kernels {priced}); judge on your model"}

    def work_text(sec: dict) -> str:
        kernels = sec["v_major_kernel_s"] * spec.layers
        return f"its kernels {kernels * 1e3:.2f} ms and host time {(sec['compute_s'] - kernels) * 1e3:.2f} ms per step"

    ulysses = None
    if len(slow.levels) > 1 and slow.levels[0].name == "node":
        measured = v_major_defaults()
        vm = predict_step(spec, slow, c, v_major=measured["v_major_active_fraction"], size=size, frames=frames,
                          batch=batch, ulysses=best["ulysses"], ring=best["ring"], cfg_parallel=best["cfg"] == 2,
                          steps=steps, tflops=tflops, v_first=True)
        nodes = slow.levels[0].size  # a rank sends (N-1)/N of every exchange across nodes, flat or TAPA
        ulysses = section(best, 1, vm["bytes"] * (nodes - 1) / nodes, measured, vm["comm_s"] + best["ring_s"], None,
                          f"the Ulysses exchanges across nodes at U{best['ulysses']} R{best['ring']}"
                          + (" cfg 2" if best["cfg"] == 2 else ""))
        ulysses["recommended"] = vm["comm_s"] + ulysses["compute_s"] < 0.8 * best["cocodiff_comm_s"]
        if not ulysses["recommended"]:
            ulysses["note"] = (f"not recommended: its predicted communication {vm['comm_s'] * 1e3:.2f} ms, "
                               f"{work_text(ulysses)}, do not save a fifth of the best lossless communication "
                               f"({best['cocodiff_comm_s'] * 1e3:.2f} ms per step)")
    # On the ring's K/V (two tensors), on the layout where it predicts the shortest step, where it saves
    # as much as V-Major on the Ulysses exchanges must (a fifth of the best lossless communication)
    # and more than V-Major there.
    row = min((r for r in rows if r["ring_v_major_step_s"] is not None),
              key=lambda r: r["ring_v_major_step_s"] + work_s(r, 2), default=None)
    if row is None:
        return ulysses
    measured = ring_v_major_measured()
    ring = section(row, 2, row["ring_bytes_per_step"], measured, row["ring_v_major_step_s"] - row["compute_s"],
                   f"--ulysses_degree {row['ulysses']} --ring_degree {row['ring']}"
                   + (" --use_cfg_parallel" if row["cfg"] == 2 else "") + " --sp-backend cocodiff"
                   + (" --cocodiff-v-first" if row["v_first"] else ""), "the ring's K/V across nodes")
    ring_step = row["ring_v_major_step_s"] + ring["compute_s"]
    ulysses_step = best["compute_s"] + ulysses["comm_s"] + ulysses["compute_s"] if ulysses else None
    ring["recommended"] = ring_step < best["step_s"] - 0.2 * best["cocodiff_comm_s"] and not (
        ulysses and ulysses["recommended"] and ulysses_step <= ring_step)
    if ring["recommended"] or ulysses is not None:
        return ring if ring["recommended"] else ulysses
    ring["note"] = (f"not recommended: on the ring's K/V at {ring['layout']} its predicted step, {work_text(ring)} "
                    f"included, {ring_step * 1e3:.2f} ms, is not a fifth of the best lossless communication "
                    f"({best['cocodiff_comm_s'] * 1e3:.2f} ms) below the best step ({best['step_s'] * 1e3:.2f} ms)")
    return ring


def device_memory_bps(name: str) -> Optional[float]:
    """The published memory bandwidth (bytes/s) of the device torch names ``name``
    (:data:`DEVICE_MEMORY_BPS`, the longest key it contains); None where none is known."""
    keys = [k for k in DEVICE_MEMORY_BPS if k in name]
    return DEVICE_MEMORY_BPS[max(keys, key=len)] if keys else None


def v_major_kernel_cost(cluster: Optional[str]) -> Tuple[Tuple[float, float], str]:
    """V-Major's seconds per layer on ``cluster``'s GPU as ``(fixed, per byte of V)`` and how they
    were priced: as measured where the shipped runs measured that GPU, else :data:`KERNEL_GPU`'s
    fit with both terms scaled by memory bandwidth; a cluster of no known GPU (a preset file of its
    own, a calibration's cluster) is priced as :data:`KERNEL_GPU`."""
    preset = EMULATES.get(cluster, cluster)
    gpu = PRESET_GPUS.get(preset, KERNEL_GPU)
    where = (f", as on {preset}: {cluster} is emulated on this CPU host" if cluster in EMULATES
             else "" if preset in PRESET_GPUS else ", assumed here: this cluster's GPU is not known")
    own = v_major_layer_cost(gpu)
    if own is not None:
        return own, f"measured on one {gpu}{where}"
    fixed, per_byte = v_major_layer_cost(KERNEL_GPU)
    scale = DEVICE_MEMORY_BPS[KERNEL_GPU] / MEMORY_BPS[preset]
    return (fixed * scale, per_byte * scale), (f"scaled from one {KERNEL_GPU} by memory bandwidth, "
                                               f"{DEVICE_MEMORY_BPS[KERNEL_GPU] / 1e12:.3g} -> {MEMORY_BPS[preset] / 1e12:.3g} TB/s{where}")


def v_major_layer_cost(gpu: str) -> Optional[Tuple[float, float]]:
    """V-Major's GPU seconds per layer on ``gpu`` as ``(fixed, per byte of V)``, least squares over
    the shipped ``bench kernels`` runs on that GPU (replayed from CUDA graphs); None without any."""
    points = [(r["tokens_local"] * r["heads_local"] * r["ulysses"] * MODELS[d["model"]].head_dim
               * MODELS[d["model"]].dtype_bytes, r["v_major_s"])
              for path in sorted(RESULTS_DIR.glob(KERNELS)) for d in [json.loads(path.read_text())]
              if gpu in d["device"] for r in d["rows"] if r["graph"]]
    if len(points) < 2:
        return None
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - slope * mx, slope


def ring_v_major_measured() -> dict:
    """The shipped quality run of V-Major on the ring's K/V at the defaults (:data:`RING_V_MAJOR_RUN`)."""
    return json.loads((RESULTS_DIR / RING_V_MAJOR_RUN).read_text())


def host_costs() -> dict:
    """Host seconds per attention layer of each of :data:`HOST_CONFIGS`: its counts per layer
    (:data:`HOST_RUN`, eager) at a GPU host's cost of each (:data:`HOST_COSTS`)."""
    cost = json.loads((RESULTS_DIR / HOST_COSTS).read_text())
    rows = {r["name"]: r["eager"]["counts"] for r in json.loads((RESULTS_DIR / HOST_RUN).read_text())["configs"]}
    return {key: rows[name]["python_calls_per_layer"] * cost["python_call_s"] + rows[name]["torch_ops_per_layer"] * cost["torch_op_s"]
            + rows[name]["kernel_launches_per_layer"] * cost["triton_launch_s"] for key, name in HOST_CONFIGS.items()}


def pipefusion_measured() -> dict[int, float]:
    """Stock PipeFusion's PSNR (dB) by stage count, as :data:`PIPEFUSION_RUN` measured it."""
    points = json.loads((RESULTS_DIR / PIPEFUSION_RUN).read_text())["points"]
    return {int(p["settings"]["layout"].split("PF")[1]): p["psnr_db"] for p in points if "layout" in p["settings"]}


def v_major_defaults() -> dict:
    """The shipped quality run of V-Major at the defaults (:data:`V_MAJOR_DEFAULTS_RUN`)."""
    return json.loads((RESULTS_DIR / V_MAJOR_DEFAULTS_RUN).read_text())


# ---------------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=sorted(MODELS), help="the model to plan for")
    p.add_argument("--size", type=int, default=1024, help="image width (and height, unless --height), pixels")
    p.add_argument("--height", type=int, default=None, help="image height, pixels (--gpu; default: --size)")
    p.add_argument("--frames", type=int, default=1, help="video frames")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--cluster", default="dgx-h100",
                   help=f"topology preset (configs/*.yaml or a path) or emulated fabric ({', '.join(FABRICS)})")
    p.add_argument("--gpu", choices=sorted(gpu_model.gpus()), default=None,
                   help="price a GPU class's nodes (configs/gpus/classes.yaml, fitted on xDiT's published runs) instead of --cluster")
    p.add_argument("--mode", choices=gpu_model.MODES, default="compiled", help="--gpu: xDiT run eagerly or with --use_torch_compile")
    p.add_argument("--gpus-per-node", type=int, default=8, help="--gpu: GPUs per node")
    p.add_argument("--inter-node-gbps", type=float, default=None,
                   help="--gpu: GB/s per GPU per direction between nodes (default: the class's reference server)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=None, help="ranks per node (emulated fabrics only)")
    p.add_argument("--calibrate", type=Path, default=None, help="a `cocodiff bench a2a` JSON to fit the model on")
    p.add_argument("--tflops", type=float, default=None, help="achieved TFLOP/s per rank for the compute estimate")
    p.add_argument("--no-pad-heads", action="store_true", help="only Ulysses degrees that divide the heads")
    p.add_argument("--validate", action="store_true", help="compare predictions with the shipped measurements (--results: a checkout's docs/results adds the e2e runs)")
    p.add_argument("--results", type=Path, default=RESULTS_DIR)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_cli(args: argparse.Namespace) -> int:
    if args.validate:
        rep = {**validate(args.results), "published": gpu_model.validate()}
        if args.json:
            print(json.dumps(rep, indent=1))
            return 0
        _print_published(rep["published"])
        for p in rep["per_point"]:
            print(f"{p['point']:58s} measured {p['measured_s'] * 1e3:8.1f} ms  predicted "
                  f"{p['predicted_s'] * 1e3:8.1f} ms  {p['rel_error']:+6.1%}")
        print(f"\n{rep['method']}")
        for g, v in rep["groups"].items():
            print(f"  {g:36s} {v['points']:3d} points  median |error| {v['median_abs_rel_error']:.3f}")
        print(f"median_abs_rel_error {rep['median_abs_rel_error']:.3f} over {rep['points']} points "
              f"(target <= {TARGET_MEDIAN}: {'met' if rep['met'] else 'NOT met'})")
        return 0
    if not args.model:
        raise ValueError("--model is required (or --validate)")
    if args.gpu:
        rep = plan_gpu(args.model, args.size, gpu=args.gpu, mode=args.mode, gpus_per_node=args.gpus_per_node,
                       nodes=args.nodes, height=args.height, frames=args.frames, steps=args.steps,
                       inter_node_gbps=args.inter_node_gbps)
        print(json.dumps(rep, indent=1)) if args.json else _print_gpu_plan(rep)
        return 0
    rep = plan(args.model, args.size, cluster=args.cluster, nodes=args.nodes, local=args.local, frames=args.frames,
               batch=args.batch, steps=args.steps, calibrate=args.calibrate, tflops=args.tflops,
               pad_heads=not args.no_pad_heads)
    if args.json:
        print(json.dumps(rep, indent=1))
        return 0
    print(rep["calibration"])
    print(f"{rep['model']} {rep['size']}px x{rep['frames']} batch {rep['batch']}: {rep['tokens']['image']} image + "
          f"{rep['tokens']['text']} text tokens; {rep['cluster']} x{rep['nodes']} = {rep['world']} ranks ({rep['levels']})")
    print(f"links: {rep['coefficients']}; compute: {rep['compute_estimate']}")
    host = rep["host"]
    print("host per attention layer: " + ", ".join(f"{key.replace('_', '-')} {host[key] * 1e6:.0f} us" for key in HOST_CONFIGS)
          + f" ({host['source']})")
    print(f"{'U':>3} {'R':>3} {'cfg':>3} {'pad':>6} {'MiB/step':>9} {'stock ms':>9} {'tapa ms':>8} {'cocodiff ms':>11} "
          f"{'V hidden':>8} {'ring ms':>7} {'host ms':>7} {'compute':>8} {'stock step':>10} {'step ms':>8}")
    for r in rep["ranked"]:
        mark = " <- best stock layout" if r is rep["best_stock"] else ""
        print(f"{r['ulysses']:3d} {r['ring']:3d} {r['cfg']:3d} {r['pad_bytes_overhead']:+6.1%} "
              f"{r['bytes_per_step'] / 2**20:9.1f} {r['stock_comm_s'] * 1e3:9.2f} {r['tapa_comm_s'] * 1e3:8.2f} "
              f"{r['cocodiff_comm_s'] * 1e3:11.2f} {r['v_hidden_s'] * 1e3:8.2f} {r['ring_s'] * 1e3:7.2f} "
              f"{r['host_s'] * 1e3:7.2f} {r['compute_s'] * 1e3:8.2f} {r['stock_step_s'] * 1e3:10.2f} {r['step_s'] * 1e3:8.2f}{mark}")
    bs = rep["best_stock"]
    print(f"best stock layout: --ulysses_degree {bs['ulysses']} --ring_degree {bs['ring']}"
          f"{' --use_cfg_parallel' if bs['cfg'] == 2 else ''} (predicted stock step {bs['stock_step_s'] * 1e3:.2f} ms); the recommendation "
          f"is predicted at {rep['speedup_vs_best_stock']:.2f}x its step")
    why = " (stock: cocodiff's predicted step, its host time included, is no shorter)" if rep["recommended"]["backend"] == "stock" else ""
    print(f"recommended: {rep['recommended']['flags']}{why}")
    _print_pipefusion(rep)
    vm = rep["v_major"]
    if vm is None:
        return 0
    print(f"V-Major pays below {vm['v_major_break_even_gbps']:.1f} GB/s per GPU link (its kernels: "
          f"{vm['v_major_kernel_s'] * 1e6:.0f} us per layer, {vm['kernels_priced']}; "
          f"{vm['slow_link_bytes_saved_per_layer'] / 2**20:.2f} MiB per layer saved on {vm['on']})")
    what = f"{vm['layout']} {vm['flag']}" if vm["layout"] else f"add {vm['flag']}"
    print(f"optional, lossy: {what} (comm {vm['comm_s'] * 1e3:.2f} ms/step; {vm['note']})" if vm["recommended"]
          else f"V-Major {vm['note']}")
    return 0


def _print_pipefusion(rep: dict) -> None:
    """Stock PipeFusion's layouts against the best exact stock layout's predicted step."""
    best = rep["best_stock"]["stock_step_s"]
    for r in rep["pipefusion"]:
        quality = "unmeasured" if r["psnr_db"] is None else f"{r['psnr_db']:.1f} dB measured on digits-flux"
        print(f"stock PipeFusion {r['name']:10s} (lossy) step {r['step_s'] * 1e3:8.2f} ms = {best / r['step_s']:.2f}x the "
              f"best exact stock layout (pipeline {r['pipefusion_s'] * 1e3:.2f} ms: fill and "
              f"{r['send_bytes_per_step'] / 2**20:.2f} MiB/step to the next stage; {quality})")


def _print_published(rep: dict) -> None:
    """xDiT's published rows against the GPU model (``--validate``)."""
    for p in rep["per_row"]:
        print(f"{p['line']:34s} {p['model']:13s} {p['gpus']:2d}x {p['gpu']:5s} {p['mode']:8s} {p['layout']:7s} "
              f"published {p['published_s']:8.2f} s  predicted {p['predicted_s']:8.2f} s  {p['error']:+6.1%}")
    for g in rep["groups"]:
        print(f"  {g['group']:44s} fastest published {g['published_fastest']:6s} predicted {g['predicted_fastest']:6s}"
              f"{'' if g['ranked_first'] else '  (missed)'}")
    held = rep["held_out"]
    print(f"xDiT's published runs, {rep['rows']} rows ({len(rep['not_expressible'])} not expressible): median "
          f"|error| {rep['median_abs_error']:.1%}, worst {rep['worst_abs_error']:.1%}, fastest layout ranked first "
          f"{rep['fastest_ranked_first']:.0%} ({', '.join(f'{k} {v}' for k, v in rep['met'].items())}); held out: "
          f"median {held['median_abs_error']:.1%}, worst {held['worst_abs_error']:.1%}, ranked first "
          f"{held['fastest_ranked_first']:.0%}\n{rep['method']}\n")


def _print_gpu_plan(rep: dict) -> None:
    print(f"{rep['model']} {rep['size']} x{rep['frames']}, {rep['steps']} steps on {rep['nodes']} x {rep['gpus_per_node']} "
          f"{rep['gpu_name']} ({rep['levels']}), {rep['mode']}; constants {rep['constants']}")
    print(f"fixed per run (text encoders, VAE decode): {rep['fixed_s']:.2f} s")
    print(f"{'layout':10s} {'backend':8s} {'step ms':>9s} {'total s':>8s} {'compute':>8s} {'ulysses':>8s} {'ring':>7s} "
          f"{'pipe':>6s} {'host':>7s}")
    for r in rep["ranked"]:
        p = r["parts"]
        quality = "" if r["psnr_db"] is None else f", {r['psnr_db']:.1f} dB measured"
        mark = "" if r["validated"] else f"  (PipeFusion: priced, not validated{quality})"
        mark = "  <- best stock layout" if r is rep["best_stock"] else mark
        print(f"{r['name']:10s} {r['backend']:8s} {r['step_s'] * 1e3:9.1f} {r['total_s']:8.2f} {p['compute_s'] * 1e3:8.1f} "
              f"{p['ulysses_s'] * 1e3:8.2f} {p['ring_s'] * 1e3:7.2f} {p['pipefusion_s'] * 1e3:6.2f} {p['host_s'] * 1e3:7.1f}{mark}")
    best = rep["best"]
    print(f"best: {best['name']} ({best['backend']}), {rep['speedup_vs_best_stock']:.2f}x the best stock layout"
          if rep["best_stock"] else f"best: {best['name']} ({best['backend']})")
    for lossy in (rep["best_lossy"], rep["best_pipefusion"]):
        if lossy is not None and rep["best_stock"]:
            priced = "" if lossy["validated"] else ", priced, not validated"
            print(f"lossy: {lossy['name']} ({lossy['backend']}), {rep['best_stock']['total_s'] / lossy['total_s']:.2f}x the "
                  f"best stock layout at {lossy['psnr_db']:.1f} dB (measured on digits-flux{priced})")
