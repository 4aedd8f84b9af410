"""Figures for benchmark reports (matplotlib, Agg backend: no display needed; the ``bench`` extra)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Mapping

# (JSON key, legend label, line style)
_A2A_SERIES = (
    ("flat", "flat (stock all_to_all_single)", dict(color="tab:gray", marker="o")),
    ("flat_p2p", "flat-p2p (fair flat: one p2p batch)", dict(color="tab:blue", marker="s")),
    ("flat_pxn", "flat-pxn (PXN-like: cross-rail relayed in the node)", dict(color="tab:cyan", marker="D")),
    ("hierarchical", "hierarchical (TAPA)", dict(color="tab:red", marker="^")),
    ("hierarchical_x2", "hierarchical, 2-part pipeline", dict(color="tab:purple", marker="<", linestyle="-.")),
    ("hierarchical_x4", "hierarchical, 4-part pipeline", dict(color="tab:brown", marker=">", linestyle="-.")),
)


MISSING = "no figure: matplotlib is not installed (pip install 'cocodiff-xfuser[bench]'); the JSON has every number"


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def plot_a2a(report: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Time vs message size per algorithm (median line, min as a faint marker), with the fabric's
    physical bounds (any routing; flat's direct routes) when the report has them."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    results = list(report["results"])
    sizes = [r["size_bytes"] / 2**20 for r in results]
    fig, ax = plt.subplots(figsize=(7.0, 4.6), dpi=120)
    for key, label, style in _A2A_SERIES:
        present = [(size, r) for size, r in zip(sizes, results) if f"{key}_s" in r]  # pipelining: >= 1 MiB
        if not present:
            continue
        xs = [size for size, _ in present]
        ax.plot(xs, [r[f"{key}_s"] * 1e3 for _, r in present], label=f"{label} (median)", **style)
        ax.plot(xs, [r[f"{key}_min_s"] * 1e3 for _, r in present], linestyle="none", marker=style["marker"],
                color=style["color"], alpha=0.35)
    if all(r.get("bound_s") for r in results):
        ax.plot(sizes, [r["bound_s"] * 1e3 for r in results], color="black", linestyle="-", linewidth=1.2,
                label="physical bound (best routing)")
        ax.plot(sizes, [r["bound_flat_routes_s"] * 1e3 for r in results], color="black", linestyle=":",
                linewidth=1.2, label="bound on flat's direct routes")
    if all(r.get("host_floor_s") for r in results):
        ax.plot(sizes, [r["host_floor_s"] * 1e3 for r in results], color="tab:green", linestyle="--", linewidth=1.0,
                label="host floor (chosen, links unshaped)")
    for s, r in zip(sizes, results):
        ax.annotate(f"{r['chosen'].replace('_', '-')}\n{r.get('speedup_vs_reference', r['speedup_vs_flat']):.2f}x", (s, r["chosen_s"] * 1e3),
                    textcoords="offset points", xytext=(7, 2), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [f"{s:g}" for s in sizes])
    ax.set_xlabel("message size per rank (MiB)")
    ax.set_ylabel("time (ms), latest end over ranks")
    fabric = report.get("fabric") or "loopback"
    ax.set_title(
        f"all-to-all on {fabric} {report.get('nodes', '?')}x{report.get('local', '?')}"
        f" ({report.get('dtype', '')}, {report.get('reps', '?')} reps; faint: min)",
        fontsize=10,
    )
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_e2e(report: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Per-step time of each configuration, stacked: compute, exposed communication, and (hatched,
    on top) the communication V-First hid behind compute, like the paper's breakdown."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    configs = report["configs"]
    names = [c["name"] for c in configs]
    exposed = [c["comm_exposed_s"] * 1e3 for c in configs]
    compute = [max(c["step_s"] * 1e3 - e, 0.0) for c, e in zip(configs, exposed)]
    hidden = [c["comm_hidden_s"] * 1e3 for c in configs]
    fig, ax = plt.subplots(figsize=(8.0, 4.8), dpi=120)
    ax.tick_params(axis="x", labelsize=6, labelrotation=30)
    ax.bar(names, compute, color="tab:gray", label="compute (step - exposed communication)")
    ax.bar(names, exposed, bottom=compute, color="tab:red", label="exposed all-to-all")
    ax.bar(names, hidden, bottom=[a + b for a, b in zip(compute, exposed)], color="none", edgecolor="tab:blue",
           hatch="//", label="all-to-all hidden by V-First")
    for i, c in enumerate(configs):
        ax.annotate(f"{c['speedup_vs_best_stock']:.2f}x", (i, compute[i] + exposed[i]), ha="center", va="bottom", fontsize=8)
        if c.get("floor_step_s"):  # the same configuration with unlimited links
            ax.plot([i - 0.4, i + 0.4], [c["floor_step_s"] * 1e3] * 2, color="black", linewidth=1,
                    label="unlimited links (floor)" if i == 0 else None)
    ax.set_ylim(0, 1.4 * max(a + b + c for a, b, c in zip(compute, exposed, hidden)))
    ax.set_ylabel("ms per denoising step")
    ax.set_title(f"{report['model']} {report['size']}px, {report['fabric']} {report['nodes']}x{report['local']}: "
                 f"x = vs the best stock layout ({report['best_stock']})", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
