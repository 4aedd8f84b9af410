"""Micro-benchmark: flat vs hierarchical all-to-all on the real process group.

Run under torchrun, e.g.::

    torchrun --nproc-per-node 4 -m cocodiff_xfuser.bench_a2a --topology 2x2 --sizes-mib 1,4 --json

Flat and hierarchical runs alternate (A B A B), each timed as barrier -> op -> max over ranks;
the report gives median and min per size, the algorithm ``auto`` mode picks and its median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .autotune import AutoAllToAll, time_interleaved
from .collectives import HierarchicalAllToAll, flat_all_to_all
from .topology import Topology, resolve

DEFAULT_SIZES_BYTES = (1 << 20, 4 << 20, 16 << 20)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def run_benchmark(
    topology: Topology,
    sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
    groups: Sequence[Sequence[int]] | None = None,
    reps: int = 9,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | None = None,
) -> dict[str, Any] | None:
    """Benchmark on every rank (collective over the world); rank 0 returns the report.

    ``groups`` lists the global ranks of every Ulysses group (default: one group of all ranks);
    each rank measures its own group, the report covers rank 0's group.
    """
    world = dist.get_world_size()
    rank = dist.get_rank()
    groups = [list(g) for g in groups] if groups is not None else [list(range(world))]
    device = device or torch.device("cpu")
    # Sub-groups are created in the same order on every rank (new_group is collective).
    pgs = [dist.group.WORLD if len(g) == world else dist.new_group(sorted(g)) for g in groups]
    mine = next(i for i, g in enumerate(groups) if rank in g)
    group, pg = sorted(groups[mine]), pgs[mine]
    hier = HierarchicalAllToAll(topology, groups)
    tuner = AutoAllToAll(hier)
    results = []
    for size in sizes_bytes:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        numel = max(size // itemsize // len(group), 1) * len(group)
        x = torch.randn(numel, device=device).to(dtype)
        times = time_interleaved(
            {"flat": lambda: flat_all_to_all(x, pg), "hierarchical": lambda: hier(x, pg)}, pg, device, reps
        )
        chosen = tuner.choose(x, pg)
        median = {name: statistics.median(t) for name, t in times.items()}
        results.append(
            {
                "size_bytes": numel * itemsize,
                "flat_s": median["flat"],
                "flat_min_s": min(times["flat"]),
                "hierarchical_s": median["hierarchical"],
                "hierarchical_min_s": min(times["hierarchical"]),
                "chosen": chosen,
                "chosen_s": median[chosen],
                "speedup_vs_flat": median["flat"] / median[chosen],
            }
        )
    if rank != 0:
        return None
    return {
        "topology": str(topology),
        "world_size": world,
        "group": group,
        "levels": list(hier.levels(pg)),
        "dtype": str(dtype).removeprefix("torch."),
        "reps": reps,
        "results": results,
    }


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"topology {report['topology']}, world {report['world_size']}, group levels {report['levels']},"
        f" {report['dtype']}, {report['reps']} reps (median / min, ms)",
        f"{'MiB/rank':>9} {'flat':>16} {'hierarchical':>16}  chosen        speedup",
    ]
    for r in report["results"]:
        lines.append(
            f"{r['size_bytes'] / 2**20:9.2f} {r['flat_s'] * 1e3:7.2f} / {r['flat_min_s'] * 1e3:6.2f}"
            f" {r['hierarchical_s'] * 1e3:7.2f} / {r['hierarchical_min_s'] * 1e3:6.2f}"
            f"  {r['chosen']:<12} {r['speedup_vs_flat']:6.2f}x"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", help="NxL[xT], preset name or YAML path; default: detect")
    parser.add_argument("--sizes-mib", default="1,4,16", help="comma-separated message sizes per rank, MiB")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    sizes = [int(float(s) * 2**20) for s in args.sizes_mib.split(",") if s.strip()]

    torch.set_num_threads(1)
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))), "nccl"
        torch.cuda.set_device(device)
    elif hasattr(torch, "xpu") and torch.xpu.is_available():
        device, backend = torch.device("xpu", int(os.environ.get("LOCAL_RANK", 0))), "xccl"
        torch.xpu.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)
    try:
        topology = resolve(args.topology, dist.get_world_size())
        report = run_benchmark(topology, sizes, reps=args.reps, dtype=DTYPES[args.dtype], device=device)
        if report is not None:
            print(json.dumps(report, indent=2) if args.json else format_report(report), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
