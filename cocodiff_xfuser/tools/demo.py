"""``cocodiff demo``: the trained digits model on 4 CPU ranks declared as 2 nodes x 2, stock
Ulysses vs cocodiff (TAPA's autotuned exchange and V-First), every digit, compared."""

from __future__ import annotations

import shutil
from pathlib import Path

from cocodiff_xfuser.tools import quality
from cocodiff_xfuser.tools.models import digits
from cocodiff_xfuser.tools.verify import Run

TOPOLOGY = "2x2"
TIMEOUT_S = 900.0


def main(args) -> int:
    out = Path(args.out)
    run = Run(model=digits.NAME, ulysses_degree=4, topology=TOPOLOGY, v_first=True, seed=args.seed)
    print(
        f"[1/2] cocodiff/{digits.NAME} (a FLUX transformer trained on scikit-learn's digits, shipped): "
        f"\"digit 0\" ... \"digit 9\", {digits.SIZE} px, {digits.STEPS} steps, ulysses 4 on {TOPOLOGY} "
        "(2 nodes x 2 ranks): stock Ulysses, then cocodiff with V-First, in one torchrun job; "
        "then each digit in one process with plain diffusers ...",
        flush=True,
    )
    report = quality.measure(run, digits.CLASSES, [args.seed], out, timeout=args.timeout)
    shutil.copy(out / "quality.png", out / "digits.png")
    print("[2/2] results", flush=True)
    print(quality.format_report(report, out))
    verdict = "BITWISE EQUAL" if report["identical"] else "DIFFERENT"
    print(f"  cocodiff vs stock Ulysses: {verdict}; {out / 'digits.png'}: stock (top), cocodiff (middle), "
          f"{quality.DIFF_GAIN}x |difference| (bottom)")
    print(
        "  On this CPU over loopback communication is not the bottleneck. For the speed-up, run a pipeline on an "
        "emulated, communication-bound cluster (as root, network namespaces; docs/benchmarks.md):\n"
        "    sudo .venv/bin/cocodiff bench e2e --fabric rail --model tiny-sd3 --size 128 --param rail_bps=6e7"
    )
    return 0 if report["identical"] else 1
