"""``cocodiff plan --map``: where cocodiff pays, for a model, a size and a GPU class.

Over the bandwidth between nodes per GPU (:data:`GBPS`, Gb/s per direction) and the node count
(:data:`NODES`), each cell is :func:`cocodiff_xfuser.tools.plan.plan_gpu`'s plan of that cluster:
the best configuration of all (stock, cocodiff lossless, or, where their measured quality is at
least the PSNR floor, cocodiff with V-Major and stock PipeFusion, priced but not validated) and its
whole run's time against the best stock layout's (PipeFusion among them at the floor). The JSON
holds every cell; the PNG colours each by that ratio and names its winner.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from cocodiff_xfuser.tools import plan
from cocodiff_xfuser.tools.bench import plots

#: Gb/s per GPU per direction between nodes: from a shared 1 GbE uplink to a 400 Gb/s NIC per GPU.
GBPS = (1, 2, 5, 10, 25, 50, 100, 200, 400)
NODES = (1, 2, 4, 8, 16)
#: The least PSNR (dB, against the exact image) a lossy configuration may give to be chosen.
DEFAULT_MIN_PSNR = 40.0


def build(model: str, size: int, *, gpu: str, mode: str = "compiled", gpus_per_node: int = 8,
          height: Optional[int] = None, frames: int = 1, steps: int = 50, min_psnr: float = DEFAULT_MIN_PSNR) -> dict:
    """Every cell of the map (one plan per node count and bandwidth)."""
    cells = []
    for nodes in NODES:
        for gbps in GBPS:
            rep = plan.plan_gpu(model, size, gpu=gpu, mode=mode, gpus_per_node=gpus_per_node, nodes=nodes, height=height,
                                frames=frames, steps=steps, inter_node_gbps=gbps / 8)
            # Every lossy row measured at the floor (the fastest may be under it: PipeFusion's more
            # stages); V-Major only on layouts the fit has seen (none with PipeFusion: unmeasured).
            lossy = [r for r in rep["ranked"] if r["lossy"] and (r["validated"] or r["backend"] == "stock")
                     and r["psnr_db"] is not None and r["psnr_db"] >= min_psnr]
            best = min([rep["best"], *lossy], key=lambda r: r["total_s"])
            stock = min([rep["best_stock"], *(r for r in lossy if r["backend"] == "stock")], key=lambda r: r["total_s"])
            lossless = rep["best_stock"]
            cells.append({"nodes": nodes, "inter_node_gbps": gbps, "best": _named(best), "best_stock": _named(stock),
                          "best_lossless": _named(rep["best"]), "best_lossless_stock": _named(lossless),
                          "speedup_vs_best_stock": stock["total_s"] / best["total_s"],
                          "lossless_speedup_vs_best_lossless_stock": lossless["total_s"] / rep["best"]["total_s"]})
    return {"model": model, "size": f"{size}x{height or size}", "frames": frames, "steps": steps, "gpu": gpu, "mode": mode,
            "gpus_per_node": gpus_per_node, "min_psnr_db": min_psnr, "gbps": list(GBPS), "nodes": list(NODES),
            "how": ("each cell: cocodiff plan --gpu at that node count and Gb/s per GPU between nodes; the best of "
                    "stock, cocodiff lossless and, where their measured PSNR is at least min_psnr_db, cocodiff with "
                    "V-Major and stock PipeFusion (priced, not validated: xDiT's published runs the constants are "
                    "fitted on hold none; chosen only at a stage count whose quality was measured), its whole run "
                    "against the best stock layout's (PipeFusion among them at the floor); beside it, cocodiff "
                    "lossless against the best lossless stock layout"),
            "cells": cells}


def _named(row: dict) -> dict:
    return {"layout": row["name"], "backend": row["backend"], "total_s": row["total_s"], "step_s": row["step_s"],
            "pipefusion": row["pipefusion"], "validated": row["validated"],
            **({"psnr_db": row["psnr_db"]} if row["lossy"] else {})}


def _label(cell: dict) -> str:
    best = cell["best"]
    what = {"stock": "stock", "cocodiff": "cocodiff", "cocodiff+v-major": "V-Major"}[best["backend"]]
    what = "PipeFusion" if best["backend"] == "stock" and best["pipefusion"] > 1 else what
    return f"{what}\n{best['layout']}\n{cell['speedup_vs_best_stock']:.2f}x"


def render(report: dict, path: Path) -> Path:
    """The map as a PNG: nodes up, bandwidth across (log), each cell coloured by the speed-up."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    gbps, nodes = report["gbps"], report["nodes"]
    grid = [[next(c for c in report["cells"] if c["nodes"] == n and c["inter_node_gbps"] == g) for g in gbps] for n in nodes]
    values = [[math.log2(c["speedup_vs_best_stock"]) for c in row] for row in grid]
    fig, ax = plt.subplots(figsize=(1.05 * len(gbps) + 1.6, 0.85 * len(nodes) + 1.4), dpi=110)
    top = max(1.0, max(abs(v) for row in values for v in row))
    image = ax.imshow(values, cmap="RdYlGn", vmin=-top, vmax=top, aspect="auto", origin="lower")
    for i, row in enumerate(grid):
        for j, cell in enumerate(row):
            ax.text(j, i, _label(cell), ha="center", va="center", fontsize=6.2)
    ax.set_xticks(range(len(gbps)), [str(g) for g in gbps])
    ax.set_yticks(range(len(nodes)), [str(n) for n in nodes])
    ax.set_xlabel("Gb/s per GPU between nodes")
    ax.set_ylabel(f"nodes of {report['gpus_per_node']} {report['gpu']}")
    frames = f" x{report['frames']}" if report["frames"] > 1 else ""
    ax.set_title(f"{report['model']} {report['size']}{frames}, {report['steps']} steps, {report['mode']}: best of stock, "
                 f"cocodiff, V-Major, PipeFusion (>= {report['min_psnr_db']:g} dB)\nvs the best stock layout", fontsize=8)
    bar = fig.colorbar(image, ax=ax, fraction=0.03)
    bar.set_label("speed-up (log2)", fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def write(report: dict, out: Path) -> dict:
    """The JSON, and the PNG where matplotlib is installed, under ``out``: their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    frames = f"-x{report['frames']}" if report["frames"] > 1 else ""
    stem = f"map-{report['model']}-{report['size']}{frames}-{report['gpu']}-{report['mode']}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    written = {"json": str(out / f"{stem}.json")}
    if plots.available():
        written["png"] = str(render(report, out / f"{stem}.png"))
    else:
        written["png"] = None
        written["why"] = plots.MISSING
    return written


def add_arguments(p) -> None:
    """``--map`` and its own options, on ``cocodiff plan``'s parser (which gives the model, size,
    --gpu, --mode, --gpus-per-node, --frames, --height and --steps)."""
    p.add_argument("--map", action="store_true",
                   help="with --gpu: write the map of where cocodiff pays (PNG and JSON) over nodes x Gb/s per GPU")
    p.add_argument("--min-psnr", type=float, default=DEFAULT_MIN_PSNR,
                   help="--map: the least PSNR (dB) of a lossy configuration it may choose")
    p.add_argument("--out", type=Path, default=Path("plan-output"), help="--map: where the PNG and JSON go")


def run_cli(args) -> int:
    if not args.model or not args.gpu:
        raise ValueError("--map needs --model and --gpu")
    report = build(args.model, args.size, gpu=args.gpu, mode=args.mode, gpus_per_node=args.gpus_per_node,
                   height=args.height, frames=args.frames, steps=args.steps, min_psnr=args.min_psnr)
    written = write(report, args.out)
    print(json.dumps(written) if args.json else "\n".join(f"{k}: {v}" for k, v in written.items()))
    return 0
