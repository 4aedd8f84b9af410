"""``cocodiff bench e2e``: a tiny-but-real DiT pipeline on an emulated cluster, stock vs cocodiff.

Each configuration runs as its own job on the fabric (``Fabric.run``): a first pipeline call
(warm-up, autotuning), then ``repeat`` timed calls. The ranks stop before and after the timed
calls (``generate --sync-dir``) while this driver reads the fabric's tbf byte counters, so the
bytes over slow links are measured for exactly the timed calls. Everything is reported per
denoising step.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from cocodiff_xfuser.tools import quality
from cocodiff_xfuser.tools.bench import one_at_a_time
from cocodiff_xfuser.tools.bench.a2a import topology_for
from cocodiff_xfuser.tools.fabric import Fabric, parse_params
from cocodiff_xfuser.tools.generate import output_dir
from cocodiff_xfuser.tools.models import tiny as tiny_models
from cocodiff_xfuser.tools.verify import Run, compare

DEFAULT_SIZE = 256  # image height and width
#: The e2e regime. Two CPU cores compute a DiT step about three orders of magnitude more slowly
#: than a GPU, so at the a2a benchmark's line rates a tiny model is compute-bound (stock spent 28%
#: of a 256 px step in all-to-all on the default rail), which is not the regime this project is
#: for. Every link is slowed by one constant (1/16.7 of the fabric defaults, the ratios between
#: links kept) so that stock spends at least half of a step in all-to-all, as multi-node DiT
#: inference at high resolution does; ``--param`` overrides, and the report states the regime.
REGIME_PARAMS = {
    "rail": {"rail_bps": 6e7},
    "shared-uplink": {"uplink_bps": 1.2e8},
    "aurora-like": {"tile_nic_share_bps": 1.5e7},
}
DEFAULT_STEPS = 4
DEFAULT_REPEAT = 3  # timed pipeline calls per configuration
TIMEOUT_S = 1800.0
# name in the report -> generate's backend variant (V-Major at its defaults, and in its auto mode at
# its default PSNR target, lossy: their quality is reported beside their speed). The two baselines come first: xfuser's stock exchange as it runs,
# and stock's algorithm on the fair flat exchange (what NCCL's all-to-all does; on gloo, stock's
# all_to_all_single pays a posting-order artefact, see cocodiff_xfuser.comm.transport).
CONFIGS = {
    "stock": "ulysses",
    "fair-flat": "cocodiff-fair-flat",
    "tapa": "cocodiff",
    "tapa+vfirst": "cocodiff+vfirst",
    "tapa+vfirst+vmajor": "cocodiff+vfirst+vmajor",
    "tapa+vfirst+vmajor-auto": "cocodiff+vfirst+vmajor-auto",
}
#: What every run measures, the speed-ups' denominators.
BASELINES = ("stock", "fair-flat")
#: The lossy configurations (V-Major): their PSNR and SSIM are reported beside their speed.
LOSSY = ("tapa+vfirst+vmajor", "tapa+vfirst+vmajor-auto")
# The slowest shaped link of every preset is the one named "uplink" in the emulation: the node
# uplink (shared-uplink, aurora-like) or the leaf-to-spine uplink carrying cross-rail traffic (rail).
SLOW_DEVICE = "uplink"


def _slow_bytes(fabric: Fabric) -> int:
    return sum(row["sent_bytes"] for row in fabric.qdisc_stats() if row["dev"] == SLOW_DEVICE)


def _run_config(fabric: Fabric, run: Run, variant: str, repeat: int, work: Path, timeout: float) -> dict:
    sync = work / "sync"
    sync.mkdir(parents=True)
    argv = [sys.executable, *run.argv((variant,), work), "--repeat", str(repeat), "--sync-dir", str(sync)]
    outcome: dict = {}

    def job() -> None:
        outcome["result"] = fabric.run(argv, timeout=timeout, extra_env={"COCODIFF_COMM_STATS": "1"},
                                       capture_output=True, text=True)

    thread = threading.Thread(target=job)
    thread.start()
    counters = {}
    for phase in ("warm", "done"):
        while not (sync / phase).exists() and thread.is_alive():
            time.sleep(0.05)
        if not thread.is_alive():
            break
        counters[phase] = _slow_bytes(fabric)
        (sync / f"{phase}.go").write_text("")
    thread.join()
    result = outcome["result"]
    if result.returncode != 0:
        raise RuntimeError(f"{variant} failed on {fabric.preset} (exit {result.returncode}):\n{result.stderr[-4000:]}")
    where = output_dir(work, tiny_models.SPECS[run.model].model_id, variant)
    report = json.loads((where / "result.json").read_text())
    report["images"] = np.load(where / "images.npy")
    report["slow_link_bytes_total"] = counters["done"] - counters["warm"]
    return report


def _quality(reference: np.ndarray, candidate: np.ndarray) -> dict:
    """PSNR (infinite when identical), SSIM and MS-SSIM against stock, as ``cocodiff quality`` measures them."""
    _, summary = quality.measure_images(reference, candidate)
    return {key: summary[key] for key in ("psnr_db", "ssim", "ms_ssim")}


def _active_fraction(ran: dict) -> float | None:
    """V-Major's share of (token, layer, step) rows sent over slow links; None where it did not run."""
    counts = ran.get("v_major") or {}
    return counts["active"] / counts["tokens"] if counts.get("tokens") else None


def bench_e2e(
    fabric_name: str,
    model: str = "tiny-flux",
    nodes: int = 2,
    local: int = 2,
    size: int = DEFAULT_SIZE,
    steps: int = DEFAULT_STEPS,
    repeat: int = DEFAULT_REPEAT,
    params: dict | None = None,
    timeout: float = TIMEOUT_S,
    configs: Sequence[str] | None = None,
) -> dict:
    """Every configuration of ``CONFIGS`` (or the baselines and ``configs``) on the fabric, side by side."""
    chosen = dict(CONFIGS) if configs is None else {
        name: variant for name, variant in CONFIGS.items() if name in (*BASELINES, *configs)}
    unknown = sorted(set(configs or ()) - set(CONFIGS))
    if unknown:
        raise ValueError(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    params = {**REGIME_PARAMS[fabric_name], **(params or {})}
    fabric = Fabric(fabric_name, nodes, local, params=params, fabric_id=f"e{os.getpid() % 100000}")
    topology = topology_for(fabric_name, nodes, local)
    run = Run(model=model, ulysses_degree=fabric.world, topology=topology, steps=steps, height=size, width=size)
    run.check()
    tiny_models.ensure_fixture(model)
    reports = {}
    with one_at_a_time(), fabric, tempfile.TemporaryDirectory() as tmp:
        for name, variant in chosen.items():
            print(f"  {name} ...", file=sys.stderr, flush=True)
            reports[name] = _run_config(fabric, run, variant, repeat, Path(tmp) / name, timeout)
    stock, fair = reports["stock"], reports["fair-flat"]
    configs = []
    for name, r in reports.items():
        comm, per_step = r["comm"], 1.0 / (r["comm"]["runs"] * steps)
        hidden = sum((o["exchange_s"] - o["exposed_s"]) * o["calls"] for o in comm["overlap"] if o["label"].endswith(".v"))
        exposed_s = comm["blocked_s_max_over_ranks"] * per_step
        hidden_s = max(hidden, 0.0) * per_step
        diff = compare(stock["images"], r["images"])
        configs.append(
            {
                "name": name,
                "step_s": r["seconds"] / steps,
                "comm_s": exposed_s + hidden_s,
                "comm_exposed_s": exposed_s,
                "comm_hidden_s": hidden_s,
                "slow_link_bytes": r["slow_link_bytes_total"] * per_step,
                "exchanges_per_step": comm["exchanges"] * per_step,
                "bytes_per_step": comm["bytes"] * per_step,
                "v_overlap": [o for o in comm["overlap"] if o["label"].endswith(".v")],
                "max_abs_diff": diff["max_abs_diff"],
                "bitwise_equal": diff["bitwise_equal"],
                **_quality(stock["images"], r["images"]),
                "v_major_active_fraction": _active_fraction(r["ran"]),
                "speedup_vs_stock": stock["seconds"] / r["seconds"],
                "speedup_vs_fair": fair["seconds"] / r["seconds"],
                "exchanges_by_algorithm": r["ran"]["exchanges"],
            }
        )
    stock_row = configs[0]
    share = stock_row["comm_exposed_s"] / stock_row["step_s"]
    return {
        "model": model,
        "fabric": fabric_name,
        "nodes": nodes,
        "local": local,
        "ulysses_degree": fabric.world,
        "size": size,
        "steps": steps,
        "timed_runs": repeat,
        "per": "denoising step (median pipeline time / steps; communication summed over the timed runs / steps)",
        "regime": (
            f"{'communication' if share >= 0.5 else 'compute'}-bound: stock spends {share:.0%} of a step blocked "
            f"in all-to-all on this fabric"
            + ("" if share >= 0.5 else " (below half: slow the links with --param to measure the regime this is for)")
        ),
        "stock_comm_share": share,
        "fabric_params": fabric.params,
        "fabric_description": fabric.describe(),
        "configs": configs,
    }


def format_report(report: dict) -> str:
    lines = [
        f"{report['model']} {report['size']}x{report['size']}, {report['steps']} steps, ulysses {report['ulysses_degree']} "
        f"on {report['fabric']} {report['nodes']}x{report['local']} ({report['timed_runs']} timed runs)",
        f"regime: {report['regime']}; fabric {', '.join(f'{k}={v:g}' for k, v in sorted(report['fabric_params'].items()))}",
        "speed-ups: against stock's algorithm on the fair flat exchange (what NCCL's all-to-all does) and against"
        " stock as it runs (on gloo its all_to_all_single pays a posting-order artefact, so 'vs stock' is higher)",
        f"{'config':<18} {'step ms':>8} {'comm ms':>8} {'exposed':>8} {'hidden':>8} {'slow KiB':>9} "
        f"{'vs fair':>8} {'vs stock':>8} {'max|diff|':>10} {'PSNR dB':>8} {'SSIM':>7} {'V-Major':>8}",
    ]
    for c in report["configs"]:
        psnr = f"{c['psnr_db']:.1f}"
        lines.append(
            f"{c['name']:<18} {c['step_s'] * 1e3:8.1f} {c['comm_s'] * 1e3:8.1f} {c['comm_exposed_s'] * 1e3:8.1f} "
            f"{c['comm_hidden_s'] * 1e3:8.1f} {c['slow_link_bytes'] / 1024:9.0f} {c['speedup_vs_fair']:7.2f}x {c['speedup_vs_stock']:7.2f}x "
            f"{c['max_abs_diff']:10.3g} {psnr:>8} {c['ssim']:7.4f} "
            + ("" if c["v_major_active_fraction"] is None else f"{c['v_major_active_fraction']:7.0%} sent")
        )
        for o in c["v_overlap"]:
            lines.append(
                f"{'':<18}   V-First {o['label']}: exchange {o['exchange_s'] * 1e3:.2f} ms, exposed "
                f"{o['exposed_s'] * 1e3:.2f} ms -> {o['hidden_share']:.0%} hidden"
            )
    return "\n".join(lines)


def run_cli(args) -> int:
    from cocodiff_xfuser.tools.bench import plots
    from cocodiff_xfuser.tools.fabric import available

    ok, why = available()
    if not ok:
        raise ValueError(f"cannot build the {args.fabric} fabric here: {why}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    params = parse_params(args.param)
    report = bench_e2e(args.fabric, args.model, args.nodes, args.local, args.size, args.steps, args.repeat,
                       params or None, args.timeout, args.configs.split(",") if args.configs else None)
    stem = f"e2e-{args.model}-{args.fabric}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    if plots.available():
        plots.plot_e2e(report, out / f"{stem}.png")
    else:
        print(plots.MISSING, file=sys.stderr)
    written = f"{out / stem}.json" + (", .png" if plots.available() else "")
    print(json.dumps(report) if args.json else format_report(report) + f"\nwritten: {written}")
    return 0
