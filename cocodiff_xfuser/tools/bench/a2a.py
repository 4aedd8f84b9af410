"""Micro-benchmark of the all-to-all algorithms: stock flat, the fair flat-p2p, the PXN-like flat-pxn, hierarchical (TAPA).

Two layers:

* the rank worker, run under torchrun (or :meth:`Fabric.run`), e.g.::

      torchrun --nproc-per-node 4 -m cocodiff_xfuser.tools.bench.a2a --topology 2x2 --sizes-mib 1,4 --json

  times every algorithm available on the group, interleaved (A B C D, B C D A, ...), and rank 0
  prints the report (median and min over repetitions of the latest end over ranks);
* :func:`bench_a2a` (``cocodiff bench a2a``): brings an emulated fabric up (or uses loopback
  torchrun), runs the worker on every rank, adds the fabric's physical bounds, prints a table and
  writes ``a2a.json`` and ``a2a.png``.

Algorithms (JSON keys use ``_`` for ``-``):

``flat``
    the stock exchange, what xfuser does: ``all_to_all_single`` through functional collectives.
``flat_p2p``
    the fair flat exchange: the same messages as one batch of point-to-point operations, what
    NCCL's own all-to-all is made of. On gloo, stock pays an artefact of gloo's posting order
    (:mod:`cocodiff_xfuser.comm.transport`) that NCCL does not: speed-ups are reported against both.
``flat_pxn``
    the flat exchange routed as NCCL routes it on a rail-optimized cluster (PXN, NCCL 2.12): a
    message for another node and another rail goes first to this node's rank on that rail, which
    forwards it over its rail (:mod:`cocodiff_xfuser.comm.pxn`); groups with a node x local plan.
``hierarchical``
    TAPA (``hierarchical_x2``/``_x4``: pipelined in 2 or 4 parts), built from the same batches.

The headline ratio (``reference``, ``speedup_vs_reference``): on the ``rail`` fabric against
``flat_pxn``, since that is what NCCL's all-to-all does there; elsewhere against ``flat_p2p``. Every
row also has ``speedup_vs_fair`` (flat-p2p), ``speedup_vs_flat`` (stock) and, where it ran,
``speedup_vs_pxn``.

Timing. Every repetition starts at a common instant: rank 0 names a start time on the shared
monotonic clock (all ranks of an emulated fabric or of a loopback job run on one host), every rank
waits for it, runs the exchange, and the repetition's time is the latest end over ranks minus the
start. A ``barrier -> op -> max over ranks`` measurement includes the barrier's exit skew, which
reached ~20 ms on the emulated fabrics while the previous exchange's tail drained through the
shaped queues; the common start removes it. A rank that learns the start instant too late starts
late and its lateness is included (counted in ``late_starts``). When the ranks do not share a
host (a real cluster) the worker falls back to ``barrier`` timing (``timing`` in the report).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

import torch
import torch.distributed as dist

from cocodiff_xfuser import commstats, padding, platform
from cocodiff_xfuser.comm.autotune import AutoAllToAll, Registry, candidate_key, size_bucket, split_key
from cocodiff_xfuser.comm.tapa import HierarchicalAllToAll
from cocodiff_xfuser.comm.timing import elapsed, slowest
from cocodiff_xfuser.comm.topology import Topology, resolve
from cocodiff_xfuser.ulysses_layout import heads, sequence
from cocodiff_xfuser.tools import same_bits
from cocodiff_xfuser.tools.bench import one_at_a_time, parse_shapes, plots

DEFAULT_SIZES_MIB = (4, 8, 16)
DEFAULT_REPS = 9
#: Calls per sample, back to back: the steady state of a denoising loop, where an exchange
#: follows the previous one's tail.
DEFAULT_BURST = 2
TIMEOUT_S = 1800.0
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TIMINGS = ("auto", "common-start", "barrier")
#: Seconds between naming the common start instant and the start (the broadcast must arrive).
START_LEAD_S = 0.05


def json_key(candidate: str) -> str:
    """``hierarchical/4`` -> ``hierarchical_x4``, ``flat-p2p`` -> ``flat_p2p``."""
    return candidate.replace("-", "_").replace("/", "_x")


# ================================================================================ rank worker
def _same_host(group: Any) -> bool:
    """Whether every rank of ``group`` runs on this host (shared CLOCK_MONOTONIC)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    me = (socket.gethostname(), boot)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, me, group=group)
    return bool(boot) and all(e == me for e in everyone)


class _Timer:
    """Times ``burst`` back-to-back calls of one op per call (seconds per op), after a barrier
    (``method`` "barrier") or from a scheduled start; ``finish`` gives every recorded time as
    the slowest rank's (:mod:`cocodiff_xfuser.comm.timing`)."""

    def __init__(self, method: str, group: Any, device: torch.device, burst: int = 1) -> None:
        self.method, self.group, self.device, self.burst = method, group, device, burst
        self.local: list[float] = []
        self.late_starts = 0
        self.max_late_s = 0.0

    def __call__(self, fn: Callable[[], Any], record: bool) -> None:
        dist.barrier(group=self.group)  # drain: every rank has completed the previous op
        seconds = elapsed(fn, self.device, self.burst) if self.method == "barrier" else self._scheduled(fn, record)
        if record:
            self.local.append(seconds)

    def _scheduled(self, fn: Callable[[], Any], record: bool) -> float:
        """Seconds per call of ``fn``, every rank starting at one wall-clock time rank 0 sets
        ``START_LEAD_S`` ahead (a barrier releases ranks at skewed times)."""
        platform.detect().synchronize(self.device)
        t = torch.tensor([time.monotonic() + START_LEAD_S], dtype=torch.float64, device=self.device)
        dist.broadcast(t, group=self.group, group_src=0)
        start = t.item()
        wait = start - time.monotonic()
        if wait < 0:
            self.late_starts += record
            self.max_late_s = max(self.max_late_s, -wait) if record else self.max_late_s
        elif wait > 0.003:
            time.sleep(wait - 0.002)
        while time.monotonic() < start:
            pass
        for _ in range(self.burst):
            fn()
        platform.detect().synchronize(self.device)
        return (time.monotonic() - start) / self.burst

    def finish(self) -> tuple[list[float], int, float]:
        *times, late_starts, max_late_s = slowest([*self.local, self.late_starts, self.max_late_s], self.group, self.device)
        self.local = []
        return times, int(late_starts), max_late_s


#: Heads per rank and head dim of the Ulysses-shaped exchange (Q and K of ``[1, W*2, s, 64]``).
ULYSSES_HEADS, ULYSSES_HEAD_DIM = 2, 64


def _ulysses_layouts(x: torch.Tensor, pg: Any, tuner: AutoAllToAll, timer: _Timer, reps: int, warmup: int) -> dict[str, Any] | None:
    """The Ulysses Q/K input exchange at ``x``'s size, as xfuser lays it out (``torch.stack``,
    ``permute().contiguous()``, the exchange, ``permute().reshape()``) and as cocodiff does
    (:func:`cocodiff_xfuser.ulysses_layout.heads`), both with the chosen algorithm: bitwise-equal outputs,
    local copies per exchange in passes over the message (counted), and the time of those copies
    alone and of the whole exchange (medians, max over ranks). None when the size does not
    split into such tensors."""
    world = dist.get_world_size(pg)
    per_tensor = x.numel() // 2
    s = per_tensor // (world * ULYSSES_HEADS * ULYSSES_HEAD_DIM)
    if s == 0 or per_tensor % (world * ULYSSES_HEADS * ULYSSES_HEAD_DIM):
        return None
    q, k = (torch.randn(1, world * ULYSSES_HEADS, s, ULYSSES_HEAD_DIM, device=x.device).to(x.dtype) for _ in range(2))
    algorithm = tuner.choose(x, pg)
    levels = tuner.registry.tapa.levels(pg) if tuner.registry.tapa is not None else ()
    folded = algorithm == "hierarchical" and tuner.parts(x, pg) == 1
    order = tuner.registry.tapa.input_layout(pg) if folded else (0,)

    def xfuser_layout() -> torch.Tensor:
        stacked = torch.stack((q, k)).view(2, 1, world, ULYSSES_HEADS, s, ULYSSES_HEAD_DIM).permute(2, 0, 1, 3, 4, 5)
        return stacked.contiguous()

    def xfuser_output(out: torch.Tensor) -> torch.Tensor:
        return out.view(world, 2, 1, ULYSSES_HEADS, s, ULYSSES_HEAD_DIM).permute(1, 2, 3, 0, 4, 5).reshape(2, 1, ULYSSES_HEADS, -1, ULYSSES_HEAD_DIM)

    def cocodiff_layout(tensors: tuple[torch.Tensor, ...] = (q, k)) -> torch.Tensor:
        return heads(tensors, levels if folded else (world,), order)

    def cocodiff_output(out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return sequence(out.view(world, 2, 1, ULYSSES_HEADS, s, ULYSSES_HEAD_DIM), 2)

    def xfuser_path() -> torch.Tensor:
        return xfuser_output(tuner.run(algorithm, xfuser_layout().view(-1), pg))

    def cocodiff_path(tensors: tuple[torch.Tensor, ...] = (q, k)) -> tuple[torch.Tensor, ...]:
        extra = {"layout": order} if folded else {}
        return cocodiff_output(tuner.start(algorithm, cocodiff_layout(tensors).view(-1), pg, **extra).wait())

    # One head short of a multiple of the degree (like 38 heads on 4 ranks): cocodiff pads it
    # with a zero head (padding.py), stock cannot split it. Same bytes on the wire as above.
    short = (q[:, 1:], k[:, 1:])

    def padded_path() -> tuple[torch.Tensor, ...]:  # the zero head is trimmed after the output exchange
        return cocodiff_path(tuple(padding.pad_heads(t, world) for t in short))

    ref = xfuser_path()
    if not all(same_bits(a, b) for a, b in zip(cocodiff_path(), ref)):
        raise AssertionError(f"rank {dist.get_rank()}: cocodiff's Ulysses layout differs from xfuser's")
    nbytes = x.numel() * x.element_size()
    before = commstats.ran()["copied_bytes"]
    tuner.run(algorithm, x, pg)
    inside = commstats.ran()["copied_bytes"] - before  # the algorithm's own copies, destination-major input
    before = commstats.ran()["copied_bytes"]
    cocodiff_path()
    cocodiff_passes = (commstats.ran()["copied_bytes"] - before) / nbytes
    ops = {
        "xfuser_layout": xfuser_path,
        "cocodiff_layout": cocodiff_path,
        "xfuser_copies_only": lambda: xfuser_output(xfuser_layout()),
        "cocodiff_copies_only": lambda: cocodiff_output(cocodiff_layout()),
        "cocodiff_padded": padded_path,
    }
    names, log = list(ops), []
    for rep in range(warmup + reps):
        first = rep % len(names)
        for name in names[first:] + names[:first]:
            timer(ops[name], record=rep >= warmup)
            if rep >= warmup:
                log.append(name)
    times, _, _ = timer.finish()
    median = {name: statistics.median([t for n, t in zip(log, times) if n == name]) for name in names}
    return {
        "algorithm": candidate_key(algorithm, tuner.parts(x, pg)),
        "tensors": [2, 1, world * ULYSSES_HEADS, s, ULYSSES_HEAD_DIM],
        # xfuser: stack and contiguous (2 passes) before, the permuting reshape (1) after.
        "xfuser_copies_per_exchange": 3 + inside / nbytes,
        "cocodiff_copies_per_exchange": cocodiff_passes,
        **{f"{name}_s": t for name, t in median.items()},
        # The padded exchange against the unpadded one of the same bytes (measured), and against an
        # ideal uneven one sending only the real heads' bytes (extrapolated: time x real / padded bytes).
        "padding": {
            "heads": world * ULYSSES_HEADS - 1,
            "padded_heads": world * ULYSSES_HEADS,
            "extra_bytes_share": 1 / (world * ULYSSES_HEADS - 1),
            "time_vs_same_bytes_unpadded": median["cocodiff_padded"] / median["cocodiff_layout"],
            "time_vs_ideal_real_bytes": median["cocodiff_padded"]
            / (median["cocodiff_layout"] * (world * ULYSSES_HEADS - 1) / (world * ULYSSES_HEADS)),
        },
    }


def run_benchmark(
    topology: Topology,
    sizes_bytes: Sequence[int] = tuple(s << 20 for s in DEFAULT_SIZES_MIB),
    groups: Sequence[Sequence[int]] | None = None,
    reps: int = DEFAULT_REPS,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | None = None,
    timing: str = "auto",
    warmup: int = 2,
    autotune_reps: int | None = None,
    burst: int = DEFAULT_BURST,
    layouts: bool = True,
) -> dict[str, Any] | None:
    """Benchmark on every rank (collective over the world); rank 0 returns the report.

    ``groups`` lists the global ranks of every Ulysses group (default: one group of all ranks);
    each rank measures its own group, the report covers rank 0's group. ``chosen`` is what an
    ``auto`` :class:`AutoAllToAll` picks for the size (its own short measurement, as in a real
    run); ``chosen_s`` is that algorithm's median in this benchmark. ``layouts``: also compare
    xfuser's and cocodiff's Ulysses layouts where the size splits into them (``ulysses``).
    """
    if timing not in TIMINGS:
        raise ValueError(f"timing {timing!r}: expected one of {TIMINGS}")
    world = dist.get_world_size()
    rank = dist.get_rank()
    groups = [list(g) for g in groups] if groups is not None else [list(range(world))]
    device = device or torch.device("cpu")
    # Sub-groups are created in the same order on every rank (new_group is collective).
    pgs = [dist.group.WORLD if len(g) == world else dist.new_group(sorted(g)) for g in groups]
    mine = next(i for i, g in enumerate(groups) if rank in g)
    group, pg = sorted(groups[mine]), pgs[mine]
    if timing == "auto":
        timing = "common-start" if _same_host(dist.group.WORLD) else "barrier"
    hier = HierarchicalAllToAll(topology, groups)
    registry = Registry(hier)
    tuner = AutoAllToAll(registry) if autotune_reps is None else AutoAllToAll(registry, reps=autotune_reps)
    timer = _Timer(timing, pg, device, burst)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    results, late, max_late = [], 0, 0.0
    for size in sizes_bytes:
        numel = max(size // itemsize // len(group), 1) * len(group)
        x = torch.randn(numel, device=device).to(dtype)
        ops: dict[str, Callable[[], Any]] = {}
        for key in tuner.candidates(x, pg):
            name, parts = split_key(key)
            options = {"parts": parts} if parts > 1 else {}
            ops[json_key(key)] = lambda run=registry[name].run, options=options: run(x, pg, **options)
        # Correctness first: every algorithm gives bitwise the stock output.
        ref = registry["flat"].run(x, pg)
        for name, op in ops.items():
            if not same_bits(op(), ref):
                raise AssertionError(f"rank {rank}: {name} differs from the stock all-to-all at {size} bytes")
        names = list(ops)
        order_log: list[str] = []
        for rep in range(warmup + reps):
            k = rep % len(names)
            for name in names[k:] + names[:k]:  # rotate: A B C D, B C D A, ...
                timer(ops[name], record=rep >= warmup)
                if rep >= warmup:
                    order_log.append(name)
        flat_times, n_late, late_s = timer.finish()
        late, max_late = late + n_late, max(max_late, late_s)
        times: dict[str, list[float]] = {name: [] for name in names}
        for name, t in zip(order_log, flat_times):
            times[name].append(t)
        chosen = json_key(candidate_key(tuner.choose(x, pg), tuner.parts(x, pg)))
        median = {name: statistics.median(t) for name, t in times.items()}
        decision = tuner.decisions.get((tuple(group), size_bucket(numel * itemsize), False))
        entry: dict[str, Any] = {"size_bytes": numel * itemsize}
        for name in names:
            entry[f"{name}_s"] = median[name]
            entry[f"{name}_min_s"] = min(times[name])
        entry.update(
            chosen=chosen,
            chosen_s=median[chosen],
            chosen_min_s=min(times[chosen]),
            speedup_vs_flat=median["flat"] / median[chosen],
            speedup_vs_fair=median["flat_p2p"] / median[chosen],
            speedup_vs_pxn=median["flat_pxn"] / median[chosen] if "flat_pxn" in median else None,
            fastest=min(median, key=median.get),
            autotune=None
            if decision is None
            else {
                "reference": json_key(decision.reference),
                "flat_s": decision.flat_s,
                "pairs": decision.pairs,
                "ratios": {json_key(k): v for k, v in decision.ratios.items()},
            },
            times_s=times,
        )
        entry["ulysses"] = _ulysses_layouts(x, pg, tuner, timer, reps, warmup) if layouts else None
        results.append(entry)
    if rank != 0:
        return None
    return {
        "topology": str(topology),
        "world_size": world,
        "group": group,
        "levels": list(hier.levels(pg)),
        "backend": dist.get_backend(pg),
        "dtype": str(dtype).removeprefix("torch."),
        "reps": reps,
        "burst": burst,
        "warmup": warmup,
        "timing": timing,
        "late_starts": late,
        "max_late_start_s": max_late,
        "candidates": [a.replace("-", "_") for a in registry.eligible(torch.empty(len(group), device=device), pg)],
        "results": results,
    }


_TITLES = {"flat": "flat (stock)", "flat_p2p": "flat-p2p (fair)", "flat_pxn": "flat-pxn (PXN)"}
#: The speed-ups: reference -> (row key, short name, what it is).
_RATIOS = {
    "flat_pxn": ("speedup_vs_pxn", "pxn", "the PXN-like flat exchange"),
    "flat_p2p": ("speedup_vs_fair", "fair", "the fair flat exchange"),
    "flat": ("speedup_vs_flat", "stock", "stock"),
}


def _title(key: str) -> str:
    return _TITLES.get(key, key.replace("hierarchical", "hier").replace("_x", " x").replace("_", "-"))


def _ratio_columns(report: dict[str, Any]) -> list[tuple[str, str]]:
    """(row key, column title) of the speed-ups: the headline (against the report's ``reference``)
    first, then the others that have values."""
    reference = report.get("reference", "flat_p2p")
    ran = {ref for ref, (key, _, _) in _RATIOS.items() if any(r.get(key) is not None for r in report["results"])}
    shown = sorted((ref for ref in _RATIOS if ref == reference or ref in ran), key=lambda ref: ref != reference)
    return [(_RATIOS[ref][0], f"vs {_RATIOS[ref][1]}") for ref in shown]


def format_report(report: dict[str, Any]) -> str:
    """Table: median / min in ms per algorithm, the choice, speed-ups (the headline first), and the bound when known."""
    keys = list(dict.fromkeys(k for r in report["results"] for k in r["times_s"]))
    present = [(k, _title(k)) for k in keys]
    ratios = _ratio_columns(report)
    head = (
        f"topology {report['topology']}, world {report['world_size']}, group levels {report['levels']},"
        f" {report['dtype']}, {report['reps']} reps, timing {report.get('timing', 'barrier')}"
        f" (median / min, ms; latest end over ranks; speed-up = reference time / chosen time, headline {ratios[0][1]})"
    )
    lines = [head]
    if report.get("fabric"):
        lines.insert(0, report.get("describe", f"fabric {report['fabric']}"))
    cols = "".join(f" {title:>17}" for _, title in present)
    bound = any(r.get("bound_s") for r in report["results"])
    lines.append(
        f"{'MiB/rank':>8}{cols}  {'chosen':<12}" + "".join(f" {title:>8}" for _, title in ratios)
        + (f" {'bound':>7} {'flat-rt':>7} {'chosen/bound':>12}" if bound else "")
        + (f" {'floor':>7} {'/achievable':>10}" if any(r.get("host_floor_s") for r in report["results"]) else "")
    )
    for r in report["results"]:
        row = f"{r['size_bytes'] / 2**20:8.2f}"
        for k, _ in present:
            row += f" {r[f'{k}_s'] * 1e3:8.1f} / {r[f'{k}_min_s'] * 1e3:6.1f}" if f"{k}_s" in r else f" {'-':>17}"
        row += f"  {r['chosen']:<12}" + "".join(f" {'-':>8}" if r.get(key) is None else f" {r[key]:7.2f}x" for key, _ in ratios)
        if bound and r.get("bound_s"):
            row += f" {r['bound_s'] * 1e3:7.1f} {r['bound_flat_routes_s'] * 1e3:7.1f} {r['fraction_of_bound']:11.2f}x"
            if r.get("host_floor_s"):
                row += f" {r['host_floor_s'] * 1e3:7.1f} {r['fraction_of_achievable']:9.2f}x"
        lines.append(row)
    if report.get("regime"):
        lines.append(f"regime: {report['regime']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Rank worker entry point (torchrun / Fabric.run); rank 0 prints the report; the process ends here."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", help="NxL[xT], preset name or YAML path; default: detect")
    parser.add_argument("--sizes-mib", default=",".join(map(str, DEFAULT_SIZES_MIB)), help="comma-separated message sizes per rank, MiB")
    parser.add_argument("--reps", type=int, default=DEFAULT_REPS)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--burst", type=int, default=DEFAULT_BURST, help="back-to-back calls per sample")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--timing", choices=TIMINGS, default="auto")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    sizes = [int(float(s) * 2**20) for s in args.sizes_mib.split(",") if s.strip()]

    torch.set_num_threads(1)
    plat = platform.detect()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    plat.set_device(local_rank)
    device = plat.device(local_rank)
    dist.init_process_group(plat.dist_backend)
    try:
        topology = resolve(args.topology, dist.get_world_size())
        report = run_benchmark(
            topology, sizes, reps=args.reps, dtype=DTYPES[args.dtype], device=device, timing=args.timing,
            warmup=args.warmup, burst=args.burst,
        )
        if report is not None:
            print(json.dumps(report, indent=2) if args.json else format_report(report), flush=True)
        # No rank may tear its connections down while a peer still talks on them: a gloo pair
        # reset mid-message aborts the peer (seen once as "terminate called" at exit).
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Process groups still referenced by module caches would be destroyed in the interpreter's
    # teardown, which under load has ended a rank with std::terminate after its report was out.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ================================================================================ driver
def topology_for(fabric: str | None, nodes: int, local: int) -> str:
    """The cocodiff topology spec matching a fabric's rank layout (node-major)."""
    if fabric == "aurora-like":
        return f"{nodes}x{local // 2}x2"  # node x GPU x tile (2 tiles per GPU)
    return f"{nodes}x{local}"


def headline_reference(fabric: str | None, results: Sequence[dict[str, Any]]) -> str:
    """The exchange the headline ratio is against: on ``rail`` the PXN-like flat exchange, which is
    what NCCL's all-to-all does on a rail-optimized cluster (:mod:`cocodiff_xfuser.comm.pxn`);
    elsewhere, or where it did not run (a group within one node), the fair flat exchange."""
    if fabric == "rail" and all("flat_pxn_s" in r for r in results):
        return "flat_pxn"
    return "flat_p2p"


def regime(fab: Any, size_bytes: int) -> str:
    """One sentence on what limits an all-to-all on ``fab`` (a :class:`Fabric`) and who can win."""
    if fab is None:
        return (
            "loopback: every rank on this host over TCP loopback, CPU- and memory-bound, no emulated links;"
            " no physical bound applies and ratios say little about a real fabric"
        )
    best, flat = fab.bound_s("all_to_all", size_bytes), fab.bound_s("flat", size_bytes)
    flat_bd = fab.bound_breakdown("flat", size_bytes)
    flat_cls = max(flat_bd, key=lambda c: flat_bd[c]["seconds"])
    best_bd = fab.bound_breakdown("all_to_all", size_bytes)
    best_cls = max(best_bd, key=lambda c: best_bd[c]["seconds"])
    size = f"{size_bytes / 2**20:g} MiB/rank"
    if flat > best * 1.05:
        return (
            f"routing-bound: flat's direct routes are limited by the '{flat_cls}' links ({flat * 1e3:.1f} ms at {size}),"
            f" {flat / best:.2f}x the best routing's bound ({best * 1e3:.1f} ms, '{best_cls}' links); a topology-aware"
            " exchange can avoid the bottleneck"
        )
    return (
        f"bandwidth-bound: every inter-node byte crosses the '{best_cls}' links whatever the algorithm"
        f" (flat routes = bound = {best * 1e3:.1f} ms at {size}); a hierarchical exchange cannot take bytes off"
        " those links and adds local work: at best it ties the flat exchange"
    )


def _parse_sizes(sizes_mib: Any) -> list[float]:
    if isinstance(sizes_mib, str):
        return [float(s) for s in sizes_mib.split(",") if s.strip()]
    return [float(s) for s in sizes_mib]


def _extract_json(stdout: str) -> dict[str, Any]:
    start = next((i for i, line in enumerate(stdout.splitlines()) if line.startswith("{")), None)
    if start is None:
        raise RuntimeError(f"no JSON report in the worker's output:\n{stdout[-4000:]}")
    return json.loads("\n".join(stdout.splitlines()[start:]))


def bench_a2a(
    fabric: str | None,
    nodes: int = 2,
    local: int = 2,
    sizes_mib: Sequence[float] | str = DEFAULT_SIZES_MIB,
    reps: int = DEFAULT_REPS,
    out_dir: str | os.PathLike | None = None,
    *,
    dtype: str = "bf16",
    timing: str = "auto",
    warmup: int = 2,
    timeout: float = TIMEOUT_S,
    fabric_id: str | None = None,
    plot: bool = True,
    echo: bool | str = True,
    stem: str = "a2a",
    params: dict[str, float] | None = None,
    floor: bool = False,
) -> dict[str, Any]:
    """Run the all-to-all benchmark and return the report (also written to ``out_dir``).

    ``fabric``: an emulated fabric preset (``rail``, ``shared-uplink``, ``aurora-like``; needs
    root, see :func:`cocodiff_xfuser.tools.fabric.available`), brought up for the run and torn down
    after it; ``None`` runs ``nodes * local`` ranks on loopback with torchrun. ``reps`` >= 9 is
    advised for figures (the report keeps every repetition). ``echo`` prints the table (on
    stderr with ``echo="stderr"``).
    Writes ``a2a.json`` and (``plot``) ``a2a.png`` into ``out_dir`` when given (``stem``
    renames them, e.g. ``a2a-rail``).

    ``floor``: also run the worker on the same fabric with every link rate raised 100-fold, and
    report per size the chosen algorithm's time there (``host_floor_s``: what this host's CPUs
    and kernel need for the exchange without link limits; on 2 cores with 8 ranks it can exceed
    the links' bound) and ``fraction_of_achievable`` = chosen / max(bound, host floor).
    """
    from cocodiff_xfuser.tools.fabric import Fabric

    sizes = _parse_sizes(sizes_mib)
    if not sizes or reps < 1:
        raise ValueError("need at least one size and one repetition")
    topology = topology_for(fabric, nodes, local)
    argv = [
        "-m", "cocodiff_xfuser.tools.bench.a2a", "--topology", topology, "--sizes-mib", ",".join(f"{s:g}" for s in sizes),
        "--reps", str(reps), "--warmup", str(warmup), "--dtype", dtype, "--timing", timing, "--json",
    ]
    env = {
        "OMP_NUM_THREADS": "1",
    }
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    fabric_id = fabric_id or f"a{os.getpid() % 100000}"

    def on_fabric(fab: Any) -> tuple[str, int]:
        with fab:
            r = fab.run([sys.executable, *argv], timeout=timeout, capture_output=True, text=True, extra_env=env)
            stats = fab.qdisc_stats()
        if r.returncode != 0:
            raise RuntimeError(
                f"benchmark on fabric {fabric} {nodes}x{local} failed (exit {r.returncode}):\n"
                f"--- stdout ---\n{r.stdout[-4000:]}\n--- stderr ---\n{r.stderr[-4000:]}"
            )
        return r.stdout, sum(s["dropped"] for s in stats)

    floor_report = None
    with one_at_a_time():
        fab = None
        drops = None
        if fabric:
            fab = Fabric(fabric, nodes, local, params=params, fabric_id=fabric_id)
            stdout, drops = on_fabric(fab)
            if floor:
                unshaped = {k: v * 100 for k, v in fab.params.items() if k.endswith("_bps")}
                floor_report = _extract_json(on_fabric(Fabric(fabric, nodes, local, params=fab.params | unshaped, fabric_id=fabric_id))[0])
        else:
            from cocodiff_xfuser.tools.launcher import torchrun

            stdout = torchrun(nodes * local, argv, env=env, timeout=timeout).stdout
    report = _extract_json(stdout)
    top_size = int(max(sizes) * 2**20)
    report = {
        "fabric": fabric,
        "nodes": nodes,
        "local": local,
        **report,
        "regime": regime(fab, top_size),
        "describe": fab.describe() if fab is not None else f"loopback: {nodes * local} ranks on one host (torchrun)",
        "tc_drops": drops,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "wall_s": time.monotonic() - t0,
    }
    report["reference"] = reference = headline_reference(fabric, report["results"])
    for r in report["results"]:
        size = r["size_bytes"]
        r["speedup_vs_reference"] = r[f"{reference}_s"] / r["chosen_s"]
        if fab is not None:
            r["bound_s"] = fab.bound_s("all_to_all", size)
            r["bound_flat_routes_s"] = fab.bound_s("flat", size)
            r["bound_pxn_routes_s"] = fab.bound_s("pxn", size)
            r["fraction_of_bound"] = r["chosen_s"] / r["bound_s"] if r["bound_s"] > 0 else None
            if floor_report is not None:
                same = next(f for f in floor_report["results"] if f["size_bytes"] == size)
                r["host_floor_s"] = same[f"{r['chosen']}_s"]
                r["fraction_of_achievable"] = r["chosen_s"] / max(r["bound_s"], r["host_floor_s"])
        else:
            r["bound_s"] = r["bound_flat_routes_s"] = r["bound_pxn_routes_s"] = r["fraction_of_bound"] = None
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        report["files"] = {"json": f"{stem}.json"}  # names in out_dir
        if plot and not plots.available():
            print(plots.MISSING, file=sys.stderr)
        elif plot:
            report["files"]["png"] = plots.plot_a2a(report, out / f"{stem}.png").name
        (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    if echo:
        print(format_report(report), file=sys.stderr if echo == "stderr" else sys.stdout, flush=True)
    return report


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """One shape's headline numbers: the worst ratio of the chosen exchange to the headline
    reference (the PXN-like flat exchange on rail, else the fair flat one), to the fair flat
    exchange and to stock over sizes (reference time / chosen time, >= 1 is faster), the ratios at
    the largest size, the worst ratio to the physical bound at >= 4 MiB, and the copies per Ulysses
    exchange at the largest size (xfuser's layout vs cocodiff's)."""
    results = report["results"]
    worst = min(results, key=lambda r: r["speedup_vs_flat"])
    worst_fair = min(results, key=lambda r: r["speedup_vs_fair"])
    worst_ref = min(results, key=lambda r: r["speedup_vs_reference"])
    largest = max(results, key=lambda r: r["size_bytes"])
    large = [r["fraction_of_bound"] for r in results if r["size_bytes"] >= 4 << 20 and r.get("fraction_of_bound")]
    achievable = [r["fraction_of_achievable"] for r in results if r["size_bytes"] >= 4 << 20 and r.get("fraction_of_achievable")]
    ulysses = next((r["ulysses"] for r in reversed(results) if r.get("ulysses")), None)
    return {
        "shape": f"{report['nodes']}x{report['local']}",
        "topology": report["topology"],
        "reference": report["reference"],
        "worst_vs_reference": worst_ref["speedup_vs_reference"],
        "worst_vs_reference_at_mib": worst_ref["size_bytes"] / 2**20,
        "largest_vs_reference": largest["speedup_vs_reference"],
        "worst_vs_fair": worst_fair["speedup_vs_fair"],
        "worst_vs_fair_at_mib": worst_fair["size_bytes"] / 2**20,
        "largest_mib": largest["size_bytes"] / 2**20,
        "largest_vs_fair": largest["speedup_vs_fair"],
        "largest_vs_stock": largest["speedup_vs_flat"],
        "worst_vs_stock": worst["speedup_vs_flat"],
        "worst_at_mib": worst["size_bytes"] / 2**20,
        "chosen": [r["chosen"] for r in results],
        "worst_fraction_of_bound_ge_4mib": max(large) if large else None,
        "worst_fraction_of_achievable_ge_4mib": max(achievable) if achievable else None,
        "copies_per_exchange": None
        if ulysses is None
        else {"xfuser": ulysses["xfuser_copies_per_exchange"], "cocodiff": ulysses["cocodiff_copies_per_exchange"]},
        "copy_time_s": None
        if ulysses is None
        else {"xfuser": ulysses["xfuser_copies_only_s"], "cocodiff": ulysses["cocodiff_copies_only_s"]},
        "padding": None if ulysses is None else ulysses["padding"],
    }


def format_summary(fabric: str | None, rows: list[dict[str, Any]]) -> str:
    references = sorted({r["reference"] for r in rows})
    ref = _RATIOS[references[0]][1] if len(references) == 1 else "ref"
    fair_too = references != ["flat_p2p"]  # the headline is not the fair flat exchange: show that one beside it
    lines = [
        f"summary on {fabric or 'loopback'}: chosen vs {' / '.join(_RATIOS[k][2] for k in references)} (the headline),"
        f"{' vs the fair flat exchange,' if fair_too else ''} vs stock (reference time / chosen time), chosen / bound,"
        " Ulysses copies",
        f"{'shape':>6} {'worst vs ' + ref:>14} {'at MiB':>7} {'largest vs ' + ref:>16}"
        + (f" {'worst vs fair':>14} {'at MiB':>7} {'largest vs fair':>16}" if fair_too else "")
        + f" {'vs stock':>9} {'worst vs stock':>15} {'at MiB':>7} {'chosen/bound >= 4 MiB':>22} {'/max(bound,floor)':>18}"
        f" {'copies xfuser -> cocodiff':>26} {'copy ms':>16}",
    ]
    for r in rows:
        bound = r["worst_fraction_of_bound_ge_4mib"]
        copies, ms = r["copies_per_exchange"], r["copy_time_s"]
        bound_text = "-" if bound is None else f"{bound:.2f}x"
        reach = r["worst_fraction_of_achievable_ge_4mib"]
        reach_text = "-" if reach is None else f"{reach:.2f}x"
        copies_text = "-" if copies is None else "{xfuser:.2f} -> {cocodiff:.2f}".format(**copies)
        ms_text = "-" if ms is None else f"{ms['xfuser'] * 1e3:.1f} -> {ms['cocodiff'] * 1e3:.1f}"
        fair = f" {r['worst_vs_fair']:13.2f}x {r['worst_vs_fair_at_mib']:7g} {r['largest_vs_fair']:15.2f}x" if fair_too else ""
        lines.append(
            f"{r['shape']:>6} {r['worst_vs_reference']:13.2f}x {r['worst_vs_reference_at_mib']:7g}"
            f" {r['largest_vs_reference']:15.2f}x{fair} {r['largest_vs_stock']:8.2f}x {r['worst_vs_stock']:14.2f}x"
            f" {r['worst_at_mib']:7g} {bound_text:>22} {reach_text:>18}"
            f" {copies_text:>26} {ms_text:>16}"
        )
    for r in rows:
        if r.get("padding"):
            p = r["padding"]
            lines.append(
                f"{r['shape']:>6} padding {p['heads']} heads to {p['padded_heads']} (stock cannot split them): "
                f"+{p['extra_bytes_share']:.1%} bytes; time {p['time_vs_same_bytes_unpadded']:.2f}x the unpadded exchange "
                f"of the same bytes, {p['time_vs_ideal_real_bytes']:.2f}x an ideal one of the real bytes (extrapolated)"
            )
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    """``cocodiff bench a2a``. Reads ``args.fabric`` (preset name, or None / "none" / "loopback"),
    ``args.nodes``, ``args.local``, ``args.sizes_mib`` (``"4,8,16"`` or a list), ``args.reps``,
    ``args.out`` (directory, or None to write nothing), ``args.json`` (print the JSON report on
    stdout, the table on stderr); optional ``args.timeout`` (seconds), ``args.dtype``."""
    from cocodiff_xfuser.tools.fabric import available, parse_params

    fabric = getattr(args, "fabric", None)
    if fabric in ("", "none", "loopback"):
        fabric = None
    if fabric is not None:
        ok, why = available()
        if not ok:
            print(f"cocodiff bench a2a: cannot build the {fabric} fabric here: {why}", file=sys.stderr)
            return 2
    as_json = bool(getattr(args, "json", False))
    shapes = getattr(args, "shapes", None)
    try:
        params = parse_params(getattr(args, "param", None) or []) or None
        layouts = parse_shapes(shapes) if shapes else [
            (int(getattr(args, "nodes", 2) or 2), int(getattr(args, "local", 2) or 2))
        ]
        reports = []
        for nodes, local in layouts:
            reports.append(bench_a2a(
                fabric,
                nodes,
                local,
                getattr(args, "sizes_mib", None) or DEFAULT_SIZES_MIB,
                int(getattr(args, "reps", None) or DEFAULT_REPS),
                getattr(args, "out", None),
                dtype=getattr(args, "dtype", None) or "bf16",
                timeout=float(getattr(args, "timeout", None) or TIMEOUT_S),
                echo="stderr" if as_json else True,
                stem=f"a2a-{fabric or 'loopback'}-{nodes}x{local}" if shapes else "a2a",
                params=params,
                floor=bool(getattr(args, "floor", False)),
            ))
    except ValueError as e:  # bad input, or another benchmark running
        print(f"cocodiff bench a2a: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"cocodiff bench a2a: {e}", file=sys.stderr)
        return 1
    report = reports[0]
    if shapes:
        rows = [summarize(r) for r in reports]
        print(format_summary(fabric, rows), file=sys.stderr if as_json else sys.stdout, flush=True)
        report = {"fabric": fabric, "summary": rows, "reports": {row["shape"]: r for row, r in zip(rows, reports)}}
        out = getattr(args, "out", None)
        if out is not None:
            (Path(out) / f"a2a-{fabric or 'loopback'}.json").write_text(json.dumps(report, indent=2) + "\n")
    if as_json:
        print(json.dumps(report, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    main()
