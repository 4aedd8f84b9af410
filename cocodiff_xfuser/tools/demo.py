"""``cocodiff demo``: the trained digits model on 4 CPU ranks declared as 2 nodes x 2, stock
Ulysses vs cocodiff (TAPA's autotuned exchange and V-First), every digit, compared; then, where
this host can build an emulated cluster (root), the same model on a communication-bound one: the
best stock layout beside cocodiff's best lossless and lossy configurations."""

from __future__ import annotations

import shutil
from pathlib import Path

from cocodiff_xfuser.tools import fabric, quality
from cocodiff_xfuser.tools.bench import e2e
from cocodiff_xfuser.tools.models import digits
from cocodiff_xfuser.tools.verify import Run

TOPOLOGY = "2x2"
TIMEOUT_S = 900.0
#: The emulated cluster: Aurora's ratios, each tile's share of its node's NICs slower than the e2e
#: regime's, so that the links add a large share of the best stock layout's step (the demo measures
#: and states it: its floor, with unlimited links, runs too): where cocodiff is meant to act.
CLUSTER = "aurora-like"
CLUSTER_PARAMS = {"tile_nic_share_bps": 1e7}
#: What it runs (stock Ulysses over all ranks always runs): the layouts xDiT advises across nodes
#: (Ring, and PipeFusion at 2 and 4 stages: lossy), and cocodiff's lossless (with stock's
#: processors, and with V-First) and lossy stacks.
CLUSTER_CONFIGS = ("stock U2xR2", "stock U2xPF2", "stock U1xPF4", "tapa U4", "tapa+vfirst U4", "tapa+vfirst+vmajor U4")
#: Timed calls per configuration, after a warm-up (their median).
CLUSTER_REPEAT = 3
CLUSTER_COMMAND = (f"sudo .venv/bin/cocodiff bench e2e --fabric {CLUSTER} --model {digits.NAME} --size {digits.SIZE} "
                   f"--steps {digits.STEPS}" + "".join(f" --param {k}={v:g}" for k, v in CLUSTER_PARAMS.items()))


def main(args) -> int:
    out = Path(args.out)
    run = Run(model=digits.NAME, ulysses_degree=4, topology=TOPOLOGY, v_first=True, seed=args.seed)
    ok, why = (False, "--no-cluster") if args.no_cluster else fabric.available()
    parts = 3 if ok else 2
    print(
        f"[1/{parts}] cocodiff/{digits.NAME} (a FLUX transformer trained on scikit-learn's digits, shipped): "
        f"\"digit 0\" ... \"digit 9\", {digits.SIZE} px, {digits.STEPS} steps, ulysses 4 on {TOPOLOGY} "
        "(2 nodes x 2 ranks): stock Ulysses, then cocodiff with V-First, in one torchrun job; "
        "then each digit in one process with plain diffusers ...",
        flush=True,
    )
    report = quality.measure(run, digits.CLASSES, [args.seed], out, timeout=args.timeout)
    shutil.copy(out / "quality.png", out / "digits.png")
    print(f"[2/{parts}] results", flush=True)
    print(quality.format_report(report, out))
    verdict = "BITWISE EQUAL" if report["identical"] else "DIFFERENT"
    print(f"  cocodiff vs stock Ulysses: {verdict}; {out / 'digits.png'}: stock (top), cocodiff (middle), "
          f"{quality.DIFF_GAIN}x |difference| (bottom)")
    print("  On this CPU over loopback communication is not the bottleneck: the step times above say nothing of a cluster.")
    if not ok:
        print(f"  For the speed-up on an emulated, communication-bound cluster (here: {why}), run as root:\n    {CLUSTER_COMMAND}")
        return 0 if report["identical"] else 1
    print(f"[3/{parts}] {digits.NAME} on an emulated communication-bound cluster ({CLUSTER} 2x2, "
          f"{CLUSTER_PARAMS}; one job per configuration, the median of {CLUSTER_REPEAT} calls after a warm-up, then again "
          "with unlimited links) ...", flush=True)
    bench = e2e.bench_e2e(CLUSTER, digits.NAME, size=digits.SIZE, steps=digits.STEPS, repeat=CLUSTER_REPEAT, params=CLUSTER_PARAMS,
                          mechanisms=("tapa", "tapa+vfirst", "tapa+vfirst+vmajor"), names=CLUSTER_CONFIGS, timeout=args.timeout)
    print(cluster_summary(bench))
    print(f"  Every layout and mechanism: {CLUSTER_COMMAND}")
    return 0 if report["identical"] else 1


def cluster_summary(report: dict) -> str:
    """The best stock layout (PipeFusion included) and the best lossless one, stock PipeFusion, and
    cocodiff's fastest lossless and lossy configurations, side by side."""
    rows = report["configs"]
    best = next(c for c in rows if c["name"] == report["best_stock"])
    lossless = next(c for c in rows if c["name"] == report["best_lossless_stock"])
    picks = [("best stock layout", best),
             *(("best lossless stock layout", c) for c in rows if c is lossless and c is not best),
             *(("stock, lossy (PipeFusion)", c) for c in rows if c["stock"] and c["lossy"] and c is not best),
             ("cocodiff, lossless", min((c for c in rows if not c["stock"] and not c["lossy"]), key=lambda c: c["step_s"])),
             ("cocodiff, lossy (V-Major)", min((c for c in rows if c["lossy"] and not c["stock"]), key=lambda c: c["step_s"]))]
    lines = [f"  the links add {best['links_share']:.0%} of the best stock layout's step ({best['name']}: "
             f"{best['step_s'] * 1e3:.1f} ms, {best['floor_step_s'] * 1e3:.1f} ms with unlimited links)"
             + ("" if lossless is best else f" and {lossless['links_share']:.0%} of the best lossless one's "
                f"({lossless['name']}: {lossless['step_s'] * 1e3:.1f} ms, {lossless['floor_step_s'] * 1e3:.1f} ms)"),
             f"  {'':<26} {'configuration':<24} {'ms/step':>8} {'vs best stock':>13} {'vs best lossless':>16} {'PSNR dB':>8} "
             f"{'slow-link KiB/step':>18}"]
    for label, c in picks:
        lines.append(f"  {label:<26} {c['name']:<24} {c['step_s'] * 1e3:8.1f} {c['speedup_vs_best_stock']:12.2f}x "
                     f"{c['speedup_vs_best_lossless_stock']:15.2f}x {c['psnr_db']:8.1f} {c['slow_link_bytes'] / 1024:18.0f}")
    lines.append(f"  (PSNR against stock {rows[0]['layout']}; Ulysses x Ring differs from it by float rounding, PipeFusion by its "
                 "stale activations)")
    return "\n".join(lines)
