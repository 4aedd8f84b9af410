"""``cocodiff demo``: tiny FLUX on 4 CPU ranks declared as 2 nodes x 2, stock Ulysses vs cocodiff."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from cocodiff_xfuser.tools.generate import output_dir
from cocodiff_xfuser.tools.models import tiny as tiny_models
from cocodiff_xfuser.tools.verify import REFERENCE, Run, compare, generate

MODEL = "tiny-flux"
TOPOLOGY = "2x2"
SIZE = 128  # image height and width
STEPS = 8
TIMEOUT_S = 900.0


def main(args) -> int:
    out = Path(args.out)
    # One warm-up call first (it includes cocodiff's all-to-all autotuning), then one timed call.
    run = Run(model=MODEL, ulysses_degree=4, topology=TOPOLOGY, steps=args.steps, height=args.size, width=args.size,
              extra=("--repeat", "1"))
    run.check()
    print(f"[1/3] building {tiny_models.SPECS[MODEL].model_id} (seeded random weights, no hub) ...", flush=True)
    tiny_models.ensure_fixture(MODEL)
    print(
        f"[2/3] {args.size}x{args.size}, {args.steps} steps, ulysses 4 on {TOPOLOGY} (2 nodes x 2 ranks): "
        f"stock Ulysses, then cocodiff, in one torchrun job ...",
        flush=True,
    )
    started = time.perf_counter()
    work = out / "runs"
    results = generate(run, ("ulysses", "cocodiff"), work, timeout=args.timeout, save_png=True)
    print(f"      done in {time.perf_counter() - started:.1f} s (process start-up included)", flush=True)

    print("[3/3] results", flush=True)
    stock, ours = results["ulysses"], results["cocodiff"]
    diff = compare(stock["images"], ours["images"])
    rows = [
        ("backend", "pipeline s (warm)", "max |diff| vs stock", "bitwise equal", "image"),
        (REFERENCE, f"{stock['seconds']:.3f}", "-", "-", "stock.png"),
        ("cocodiff", f"{ours['seconds']:.3f}", f"{diff['max_abs_diff']:.3g}", str(diff["bitwise_equal"]), "cocodiff.png"),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))
    model_id = tiny_models.SPECS[MODEL].model_id
    for backend, name in (("ulysses", "stock.png"), ("cocodiff", "cocodiff.png")):
        shutil.copy(output_dir(work, model_id, backend) / "image_0.png", out / name)
    report = {"model": MODEL, "topology": TOPOLOGY, "ulysses_degree": 4, "size": args.size, "steps": args.steps,
              "seconds_stock": stock["seconds"], "seconds_cocodiff": ours["seconds"], **diff}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(f"  images and report.json in {out.resolve()}")
    print("  (CPU over loopback: communication is not the bottleneck here; see `cocodiff bench` for the emulated cluster)")
    return 0 if diff["bitwise_equal"] else 1
