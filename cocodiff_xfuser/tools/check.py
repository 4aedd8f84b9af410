"""``cocodiff check``: will cocodiff help on this cluster? One command on the emulated one (as root).

On the model (or a tiny stand-in) at a small size and few steps, in four stages:

1. **equivalence**: stock Ulysses, the fair flat exchange, TAPA and TAPA + V-First (bitwise equal
   to stock) and V-Major (PSNR against stock), each timed (``cocodiff bench e2e``'s runs);
2. **exchanges**: stock, the fair flat exchange, TAPA and the autotune's choice timed on the job's
   Ulysses group at the message sizes of the model's exchanges (``cocodiff bench a2a``'s worker),
   written as the calibration JSON (``cocodiff plan --calibrate`` reads it);
3. **prediction**: ``cocodiff plan`` fitted on that JSON, with the compute of a step taken from stage
   1 (stock's step minus its exposed communication, as an effective FLOP rate), ranks every
   ulysses x ring factorization and recommends degrees and flags, with their predicted step time;
4. **measurement**: the recommended configuration, run after the prediction, timed the same way.

A failed stage is one line naming it (and the rank, where a rank failed); the others still run
where they can.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from cocodiff_xfuser.tools import plan as plan_tool
from cocodiff_xfuser.tools.bench import a2a as bench_a2a
from cocodiff_xfuser.tools.bench import e2e as bench_e2e
from cocodiff_xfuser.tools.fabric import PRESETS as FABRICS, Fabric
from cocodiff_xfuser.tools.models import tiny as tiny_models
from cocodiff_xfuser.tools.verify import Run

DEFAULT_STEPS = 4
DEFAULT_REPEAT = 2
A2A_REPS = 5
#: Stage 1's configurations besides the baselines: the lossless ones must be bitwise stock.
EQUIVALENCE = ("tapa", "tapa+vfirst", "tapa+vfirst+vmajor")
#: The V-Major image must stay this close to stock's (dB) for the check to pass.
MIN_PSNR_DB = 30.0
#: The recommendation's flags -> generate's backend variant.
VARIANT = {False: "cocodiff", True: "cocodiff+vfirst"}


def message_sizes_mib(model: str, size: int, ulysses: int) -> list[float]:
    """The distinct per-rank message sizes (MiB) of the model's Ulysses exchanges at ``size``."""
    spec = plan_tool.MODELS[model]
    sizes = {x for _, x, _ in plan_tool.step_messages(spec, size, ulysses=ulysses)}
    sizes |= {x for _, x, _ in plan_tool.step_messages(spec, size, ulysses=ulysses, v_first=True)}
    return sorted(x / 2**20 for x in sizes)


def effective_tflops(model: str, size: int, ulysses: int, compute_s: float) -> float:
    """The FLOP rate (TFLOP/s per rank) at which the planner's FLOP count of a step at ``ulysses``
    takes the measured ``compute_s``: how the planner's compute estimate is calibrated."""
    spec = plan_tool.MODELS[model]
    img, txt = spec.tokens(size)
    b = 2 if spec.cfg else 1
    flops = b * sum(n * plan_tool.layer_flops(spec, img + (txt if j else 0), (img + (txt if j else 0)) / ulysses)
                    for n, j in spec.attn)
    return flops / compute_s / 1e12


def _equivalence(report: dict) -> list[dict]:
    rows = []
    for c in report["configs"]:
        if c["name"] in bench_e2e.BASELINES and c["name"] != "fair-flat":
            continue
        lossy = c["name"] in bench_e2e.LOSSY
        ok = c["psnr_db"] >= MIN_PSNR_DB if lossy else c["bitwise_equal"]
        rows.append({"name": c["name"], "ok": bool(ok), "bitwise_equal": c["bitwise_equal"], "psnr_db": c["psnr_db"],
                     "max_abs_diff": c["max_abs_diff"], "step_s": c["step_s"], "speedup_vs_stock": c["speedup_vs_stock"],
                     "speedup_vs_fair": c["speedup_vs_fair"]})
    return rows


def check(fabric: str, model: str, nodes: int = 2, local: int = 2, size: int | None = None, steps: int = DEFAULT_STEPS,
          repeat: int = DEFAULT_REPEAT, out: Path = Path("check-output"), timeout: float = bench_e2e.TIMEOUT_S,
          progress: Any = None) -> dict:
    """Run the four stages on an emulated ``fabric`` (module docstring); the report as a dict."""
    if model not in plan_tool.MODELS or model not in tiny_models.SPECS:
        known = sorted(set(plan_tool.MODELS) & set(tiny_models.SPECS))
        raise ValueError(f"--model {model!r}: the check runs {', '.join(known)}")
    if fabric not in FABRICS:
        raise ValueError(f"--fabric {fabric!r}: expected one of {', '.join(FABRICS)}")
    size = size or tiny_models.SPECS[model].height or bench_e2e.DEFAULT_SIZE
    world = nodes * local
    params = bench_e2e.REGIME_PARAMS[fabric]
    out.mkdir(parents=True, exist_ok=True)
    tick = progress or (lambda stage: None)

    tick("equivalence")
    e2e = bench_e2e.bench_e2e(fabric, model, nodes, local, size, steps, repeat, timeout=timeout, configs=EQUIVALENCE)
    equivalence = _equivalence(e2e)
    stock = next(c for c in e2e["configs"] if c["name"] == "stock")
    compute_s = stock["step_s"] - stock["comm_exposed_s"]

    tick("exchanges")
    sizes = message_sizes_mib(model, size, world)
    a2a = bench_a2a.bench_a2a(fabric, nodes, local, sizes, A2A_REPS, out, dtype="fp32", plot=False, echo=False,
                              stem="check-calibration", params=params, timeout=timeout)
    calibration = out / "check-calibration.json"

    tick("prediction")
    tflops = effective_tflops(model, size, world, compute_s)
    planned = plan_tool.plan(model, size, cluster=fabric, nodes=nodes, local=local, steps=steps, calibrate=calibration,
                             tflops=tflops, fabric_params=params)
    best = planned["ranked"][0]
    # Gains against stock as the job ran it in stage 1: all ranks in one Ulysses group.
    stock_row = next(r for r in planned["ranked"] if (r["ulysses"], r["ring"], r["cfg"]) == (world, 1, 1))

    tick("measurement")
    run = Run(model=model, ulysses_degree=best["ulysses"], ring_degree=best["ring"],
              topology=bench_a2a.topology_for(fabric, nodes, local), steps=steps, height=size, width=size)
    run.check()
    variant = VARIANT[bool(best["v_first"])]
    fab = Fabric(fabric, nodes, local, params=params, fabric_id=f"c{os.getpid() % 100000}")
    with bench_e2e.one_at_a_time(), fab, tempfile.TemporaryDirectory() as tmp:
        measured = bench_e2e._run_config(fab, run, variant, repeat, Path(tmp) / "recommended", timeout)
    measured_step_s = measured["seconds"] / steps

    exchanges = [{k: r.get(k) for k in ("size_bytes", "flat_s", "flat_p2p_s", "hierarchical_s", "chosen", "chosen_s")}
                 for r in a2a["results"]]
    report = {
        "model": model, "fabric": fabric, "nodes": nodes, "local": local, "size": size, "steps": steps,
        "fabric_params": params,
        "equivalence": equivalence, "equivalent": all(row["ok"] for row in equivalence),
        "exchanges": exchanges, "calibration": str(calibration),
        "compute_s": compute_s, "effective_tflops": tflops,
        "recommended": {**planned["recommended"], "v_first": best["v_first"]},
        "predicted_step_s": best["step_s"], "predicted_stock_step_s": stock_row["stock_step_s"],
        "predicted_gain": stock_row["stock_step_s"] / best["step_s"],
        "measured_step_s": measured_step_s, "measured_stock_step_s": stock["step_s"],
        "measured_gain": stock["step_s"] / measured_step_s,
        "prediction_error": measured_step_s / best["step_s"] - 1.0,
    }
    (out / "check.json").write_text(json.dumps(report, indent=1))
    return report


def format_report(r: dict) -> str:
    lines = [f"{r['model']} {r['size']}px, {r['steps']} steps on {r['fabric']} {r['nodes']}x{r['local']}",
             "equivalence (against stock Ulysses; V-Major by PSNR):"]
    for row in r["equivalence"]:
        what = "bitwise equal" if row["bitwise_equal"] else f"PSNR {row['psnr_db']:.1f} dB"
        lines.append(f"  {'ok  ' if row['ok'] else 'FAIL'} {row['name']:<20} {what:<16} step {row['step_s'] * 1e3:7.1f} ms "
                     f"({row['speedup_vs_fair']:.2f}x fair flat, {row['speedup_vs_stock']:.2f}x stock)")
    lines.append("exchanges on the job's Ulysses group (ms):")
    lines.append(f"  {'KiB':>9} {'stock':>8} {'fair flat':>9} {'TAPA':>8} {'chosen':>8}")
    for e in r["exchanges"]:
        ms = lambda v: f"{v * 1e3:8.3f}" if v else f"{'-':>8}"  # noqa: E731
        lines.append(f"  {e['size_bytes'] / 1024:9.1f} {ms(e['flat_s'])} {ms(e['flat_p2p_s']):>9} {ms(e['hierarchical_s'])} "
                     f"{ms(e['chosen_s'])} {e['chosen']}")
    lines.append(f"calibration written to {r['calibration']} (cocodiff plan --calibrate {r['calibration']})")
    rec = r["recommended"]
    lines.append(f"recommended: {rec['flags']}")
    lines.append(f"predicted step {r['predicted_step_s'] * 1e3:.1f} ms against stock's {r['predicted_stock_step_s'] * 1e3:.1f} ms: "
                 f"{r['predicted_gain']:.2f}x (compute {r['compute_s'] * 1e3:.1f} ms per step, measured)")
    lines.append(f"measured step {r['measured_step_s'] * 1e3:.1f} ms against stock's {r['measured_stock_step_s'] * 1e3:.1f} ms: "
                 f"{r['measured_gain']:.2f}x; the prediction was {r['prediction_error']:+.0%} off")
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("check", help="will cocodiff help here? equivalence, exchange timings, calibration, "
                                     "recommendation, predicted and measured gain (emulated cluster: run as root)")
    p.add_argument("--fabric", choices=FABRICS, required=True, help="emulated cluster preset (network namespaces; needs root)")
    p.add_argument("--model", default="digits-flux", help="the model (or a tiny stand-in) to check")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=2, help="ranks per node")
    p.add_argument("--size", type=int, default=None, help="image height and width (default: the model's)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, help="timed pipeline calls per configuration")
    p.add_argument("--out", default="check-output", help="directory for the calibration and the report")
    p.add_argument("--timeout", type=float, default=bench_e2e.TIMEOUT_S)
    p.add_argument("--json", action="store_true", help="the last line: the report as one JSON object")


def run_cli(args: Any) -> int:
    from cocodiff_xfuser.tools.fabric import available

    ok, why = available()
    if not ok:
        raise ValueError(f"cannot build the {args.fabric} fabric here: {why}")
    from tqdm import tqdm

    stages = ("equivalence", "exchanges", "prediction", "measurement")
    with tqdm(total=len(stages), desc="cocodiff check", unit="stage", file=sys.stderr) as bar:
        def progress(stage: str) -> None:
            bar.set_postfix_str(stage)
            bar.update(0 if stage == stages[0] else 1)

        report = check(args.fabric, args.model, args.nodes, args.local, args.size, args.steps, args.repeat,
                       Path(args.out), args.timeout, progress)
        bar.update(1)
    print(format_report(report))
    for row in report["equivalence"]:
        if not row["ok"]:
            print(f"cocodiff check: {row['name']} differs from stock (max |diff| {row['max_abs_diff']:.3g})", file=sys.stderr)
    if args.json:
        print(json.dumps(report))
    return 0 if report["equivalent"] else 1
