"""``cocodiff check``: does cocodiff give stock's images here, and how much faster is it? One command.

Started through the job's launcher (torchrun, the shipped Slurm/PBS launchers, mpiexec), it runs
in process on every rank of the job; with ``--fabric`` (as root) it brings an emulated cluster up
and runs the same job on it. On a model (a tiny stand-in) at a small size and few steps, in four
stages:

1. **equivalence**: stock Ulysses, then the fair flat exchange, TAPA and TAPA + V-First (bitwise
   equal to stock on every rank, or a failure) and V-Major (PSNR against stock), each timed;
2. **exchanges**: stock's, the fair flat, TAPA and the autotune's choice timed on the job's
   Ulysses group at the per-rank sizes of the model's exchanges (``cocodiff bench a2a``'s worker),
   written as the calibration: a ``cocodiff bench a2a`` JSON, which ``cocodiff plan --calibrate`` reads;
3. **prediction**: the planner fitted on that calibration, with a step's compute measured in
   stage 1, ranks every ulysses x ring x CFG layout, stock and with cocodiff;
4. **measurement**: the planner's best few layouts and the stock layouts an informed user runs
   (Ulysses inside the node x Ring across nodes, Ulysses x CFG across nodes for CFG models), each
   stock and with cocodiff (and, where the ring crosses nodes, with V-Major on the ring's K/V), and
   stock Ulysses inside the node x PipeFusion across nodes where the model runs it (lossy: its PSNR
   against stage 1's stock); the recommendation is the fastest lossless configuration measured
   (stock where stock wins: the first line of advice says so), or a lossy one (V-Major, PipeFusion)
   only where ``--min-psnr`` asks for it and its measured PSNR meets it.

Rank 0 reports: a progress bar on stderr, the sections on stdout and, with ``--json``, the report
as the last line. A failure is one line naming the rank and the reason.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any, Mapping

from cocodiff_xfuser.platform import MPI_ENV, adopt_mpi_environment
from cocodiff_xfuser.tools import plan as plan_tool
from cocodiff_xfuser.tools import quality
from cocodiff_xfuser.tools.bench import e2e as bench_e2e
from cocodiff_xfuser.tools.fabric import PRESETS as FABRICS
from cocodiff_xfuser.tools.fabric import wire
from cocodiff_xfuser.tools.models import tiny as tiny_models
from cocodiff_xfuser.tools.verify import Run, compare

DEFAULT_STEPS = 4
DEFAULT_REPEAT = 2  # timed pipeline calls per configuration, after one that warms up and autotunes
A2A_REPS = 3
#: Stage 1 on Ulysses over all ranks: stock, the fair flat exchange, then cocodiff's mechanisms
#: (generate's backend variants).
CONFIGS = {"stock": "ulysses", "fair-flat": "cocodiff-fair-flat", "tapa": "cocodiff", "tapa+vfirst": "cocodiff+vfirst",
           "tapa+vfirst+vmajor": "cocodiff+vfirst+vmajor"}
LOSSY = ("tapa+vfirst+vmajor",)
#: Stage 4 measures the planner's best this many layouts, besides the informed user's stock layouts.
MEASURE_TOP = 3
#: The V-Major image must stay this close to stock's (dB) for the check to pass.
MIN_PSNR_DB = 30.0


def models() -> list[str]:
    """What the check runs: the stand-ins the planner has a spec of."""
    return sorted(set(plan_tool.MODELS) & set(tiny_models.SPECS))


def message_sizes(model: str, size: int, ulysses: int) -> list[int]:
    """The distinct per-rank sizes (bytes) of the model's Ulysses exchanges at ``size``, stock's and V-First's."""
    spec = plan_tool.MODELS[model]
    return sorted({round(x) for v_first in (False, True)
                   for _, x, _ in plan_tool.step_messages(spec, size, ulysses=ulysses, v_first=v_first)})


def burst(model: str, size: int, ulysses: int, nbytes: int) -> int:
    """Exchanges of ``nbytes`` per timed sample: as many as move a step's bytes, back to back as a
    denoising step issues them. Fewer would time what an idle link does (an emulated link's token
    bucket, a switch's buffers), not what it sustains inside a step."""
    spec = plan_tool.MODELS[model]
    step_bytes = sum(x * n for _, x, n in plan_tool.step_messages(spec, size, ulysses=ulysses, v_first=True))
    return max(1, math.ceil(step_bytes / nbytes))


def effective_tflops(model: str, size: int, ulysses: int, compute_s: float) -> float:
    """The FLOP rate (TFLOP/s per rank) at which the planner's FLOP count of a step at ``ulysses``
    takes the measured ``compute_s``: how the planner's compute estimate is calibrated."""
    spec = plan_tool.MODELS[model]
    img, txt = spec.tokens(size)
    b = 2 if spec.cfg else 1
    flops = b * plan_tool.forward_flops(spec, img, txt, ulysses)
    return flops / compute_s / 1e12


def launched(env: Mapping[str, str] = os.environ) -> bool:
    """Whether a launcher (torchrun's or an MPI launcher's variables) started this process as one rank of a job."""
    return any(name in env for name in ("RANK", *MPI_ENV["RANK"]))


def join_job(env: dict = os.environ) -> None:
    """torch's rank variables, from an MPI launcher's where it set no ``RANK``; a line for what is missing."""
    adopt_mpi_environment(env)
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in env]
    if missing:
        raise ValueError(f"the launcher set no {', '.join(missing)}: export them (MASTER_ADDR: the first node's "
                         "address), or start the check with torchrun or a shipped launcher")


def emulated(env: Mapping[str, str] = os.environ) -> dict | None:
    """The emulated fabric this rank runs on, from the variables the emulator gives every rank
    (None elsewhere): the fields that make an a2a report priceable at the fabric's line rates."""
    if "CCD_FABRIC_PRESET" not in env:
        return None
    params = (kv.split("=", 1) for kv in env.get("CCD_FABRIC_PARAMS", "").split(",") if kv)
    return {"fabric": env["CCD_FABRIC_PRESET"], "nodes": int(env["CCD_NODES"]), "local": int(env["CCD_LOCAL"]),
            "fabric_params": {k: float(v) for k, v in params}}


def equivalence(name: str, verdicts: list[dict | None], ran: dict) -> tuple[dict, list[str]]:
    """One configuration's row from every rank's comparison with stock (None: that rank got no
    images) and what ran (summed over the ranks: exchanges per algorithm, fall-backs), and a line
    per rank that failed."""
    lossy = name in LOSSY
    failures = []
    for rank, v in enumerate(verdicts):
        if v is None:
            continue
        if lossy and v["psnr_db"] < MIN_PSNR_DB:
            failures.append(f"rank {rank}: {name} is {v['psnr_db']:.1f} dB PSNR from stock, below {MIN_PSNR_DB:g}")
        elif not lossy and not v["bitwise_equal"]:
            failures.append(f"rank {rank}: {name} differs from stock (max |diff| {v['max_abs_diff']:.3g})")
    seen = [v for v in verdicts if v is not None]
    row = {"name": name, "ok": not failures, "lossy": lossy, "ranks_compared": len(seen),
           "bitwise_equal": all(v["bitwise_equal"] for v in seen),
           "max_abs_diff": max(v["max_abs_diff"] for v in seen), "psnr_db": min(v["psnr_db"] for v in seen), "ran": ran}
    return row, failures


class Progress:
    """Rank 0's progress bar (stderr) over the pipeline calls and exchange sizes; the stage under way."""

    def __init__(self, total: int, draw: bool) -> None:
        self.stage = "start-up"
        self.bar = None
        if draw:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="cocodiff check", unit="part", file=sys.stderr)

    def begin(self, stage: str, parts: int = 0) -> None:
        """``parts``: what the stage adds to the total, where only the stages before it tell."""
        self.stage = stage
        if self.bar is not None:
            self.bar.total += parts
            self.bar.set_postfix_str(stage)

    def tick(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def job(model: str, size: int, steps: int, repeat: int, topology: str | None, out: Path, progress: Progress,
        min_psnr: float | None = None) -> dict | None:
    """The four stages on every rank of the job (collective); rank 0 returns the report."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from xfuser.core.distributed.parallel_state import destroy_model_parallel

    from cocodiff_xfuser import platform
    from cocodiff_xfuser.comm.timing import slowest
    from cocodiff_xfuser.comm.topology import resolve
    from cocodiff_xfuser.tools import generate
    from cocodiff_xfuser.tools.bench import a2a as bench_a2a

    world = int(os.environ["WORLD_SIZE"])
    run = Run(model=model, ulysses_degree=world, topology=topology, steps=steps, height=size, width=size)
    run.check()
    spec = plan_tool.MODELS[model]
    sizes = message_sizes(model, size, world)
    cases = [[quality.default_prompts(model)[0], run.seed]]
    base = generate.runner_args(run.runner_argv())
    device = platform.detect().device(int(os.environ.get("LOCAL_RANK", "0")))

    def timed(args: dict) -> dict:
        """One configuration run on every rank (collective): its images on this rank, and its step,
        the spread of its timed calls and its blocked communication, each the slowest rank's."""
        done = generate.run_backend(args, cases, repeat, on_call=progress.tick)
        # xfuser's pipeline wrappers (SD3's, PipeFusion's) give images on the last rank only: None elsewhere.
        flat = [image for case in done["images"] for image in case]
        comm, images = done["comm"], np.stack(flat) if flat else None
        timings = done["timings"]
        median = statistics.median(timings)
        # The slowest rank sets the pace: one reduction; the blocked time is the slowest rank's already.
        step_s, spread = slowest([median / steps, (max(timings) - min(timings)) / median], dist.group.WORLD, device)
        return {"step_s": step_s, "spread": spread,
                "images": images, "exposed_s": comm["blocked_s_max_over_ranks"] / (comm["runs"] * steps),
                "runner": done["runner"],
                "ran": {**{k: done["ran"][k] for k in ("exchanges", "fallbacks", "v_first_calls")},
                        "v_major_tokens": done["ran"]["v_major"].get("tokens", 0)}}

    def measured(mechanism: str, layout: bench_e2e.Layout, v_first: bool, timed_run: dict, psnr_db: float, exact: bool) -> dict:
        return candidate(mechanism, layout, v_first, timed_run["step_s"], psnr_db, exact, spread=timed_run["spread"],
                         idle=mechanism != "stock" and not any(timed_run["ran"]["exchanges"].values()))

    progress.begin("equivalence")
    ran = {name: timed({**base, **generate.VARIANTS[variant]}) for name, variant in CONFIGS.items()}
    stock = ran["stock"]["images"]
    verdicts = {name: generate.gather(verdict_against(stock, ran[name]["images"])) for name in list(CONFIGS)[1:]}
    step_s = {name: r["step_s"] for name, r in ran.items()}
    exposed_s = {name: r["exposed_s"] for name, r in ran.items()}

    progress.begin("exchanges")
    topo = resolve(topology, world)  # collective where detected: on every rank
    dtype = {4: torch.float32, 2: torch.bfloat16}[spec.dtype_bytes]
    reports = []
    for nbytes in sizes:
        reports.append(bench_a2a.run_benchmark(topo, [nbytes], reps=A2A_REPS, dtype=dtype,
                                               device=device, burst=burst(model, size, world, nbytes), layouts=False))
        progress.tick()

    progress.begin("prediction")
    fabric = emulated()
    calibration = out / "check-calibration.json"
    report, layouts = None, None
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        a2a = {"fabric": None, **(fabric or {}), **reports[0], "burst": None,
               "results": [{**r, "burst": rep["burst"]} for rep in reports for r in rep["results"]]}
        calibration.write_text(json.dumps(a2a, indent=1) + "\n")
        # A step's compute: TAPA's step less the communication it was blocked in, both measured (stock's
        # unblocked time also holds the copies of xfuser's layout around its exchanges).
        compute_s = step_s["tapa"] - exposed_s["tapa"]
        tflops = effective_tflops(model, size, world, compute_s)
        planned = plan_tool.plan(model, size, cluster=fabric and fabric["fabric"], nodes=fabric["nodes"] if fabric else 1,
                                 local=fabric and fabric["local"], steps=steps, calibrate=calibration, tflops=tflops,
                                 fabric_params=fabric and fabric["fabric_params"])
        best = planned["ranked"][0]
        # The recommendation's predicted step: cocodiff's, or the best stock layout's where it is no longer.
        step = best["step_s"] if planned["recommended"]["backend"] == "cocodiff" else planned["best_stock"]["stock_step_s"]
        at_job = next(r for r in planned["ranked"] if (r["ulysses"], r["ring"], r["cfg"]) == (world, 1, 1))
        layouts = measured_layouts(planned, model, size, topo.sizes[0], world // topo.sizes[0])
        rows, failures = zip(*(equivalence(name, verdicts[name], ran[name]["ran"]) for name in list(CONFIGS)[1:]))
        report = {
            "model": model, "size": size, "steps": steps, "world_size": world, "topology": str(topo),
            "fabric": fabric, "equivalence": list(rows), "equivalent": all(r["ok"] for r in rows),
            "failures": [line for lines in failures for line in lines],
            "measured": {name: {"step_s": step_s[name], "comm_exposed_s": exposed_s[name]} for name in CONFIGS},
            "exchanges": [{k: r.get(k) for k in ("size_bytes", "burst", "flat_s", "flat_p2p_s", "flat_pxn_s", "hierarchical_s", "chosen", "chosen_s")}
                          for r in a2a["results"]],
            "calibration": str(calibration), "calibrated": planned["calibration"],
            "compute_s": compute_s, "effective_tflops": tflops,
            "planned": {**planned["recommended"], "v_first": best["v_first"]}, "v_major": planned["v_major"],
            "planned_best_stock": planned["best_stock"],
            "predicted_step_s": step, "predicted_comm_s": step - best["compute_s"],
            "predicted_stock_step_s": at_job["stock_step_s"], "predicted_gain": at_job["stock_step_s"] / step,
        }
    shared = [None if layouts is None else [(lay, v_first) for lay, v_first in layouts]]
    dist.broadcast_object_list(shared, src=0)

    def ring_across_nodes(ulysses: int, ring: int) -> bool:  # ring peers sit a Ulysses group apart
        return ring > 1 and ulysses * ring > world // topo.sizes[0]

    runs = sum(1 if lay.stale else 3 if ring_across_nodes(lay.ulysses, lay.ring) else 2 for lay, _ in shared[0])
    progress.begin("measurement", parts=runs * (1 + repeat))
    full = bench_e2e.Layout(world)
    candidates = [measured("stock", full, False, ran["stock"], math.inf, True)]
    candidates += [measured(name, full, name != "tapa", ran[name], min(v["psnr_db"] for v in verdicts[name] if v),
                            all(v["bitwise_equal"] for v in verdicts[name] if v))
                   for name in ("tapa", "tapa+vfirst", "tapa+vfirst+vmajor") if any(verdicts[name])]
    runner = ran["stock"]["runner"]
    for layout, v_first in shared[0]:
        ulysses, ring = layout.ulysses, layout.ring
        destroy_model_parallel()  # xfuser builds its groups again for each layout's degrees
        args = generate.runner_args(layout.run(run).runner_argv())
        stock_run = timed({**args, **generate.VARIANTS["ulysses"]})
        if layout.stale:  # lossy: its images against stage 1's stock
            verdict = generate.gather(verdict_against(stock, stock_run["images"]))
            candidates.append(measured("stock", layout, False, stock_run, min(v["psnr_db"] for v in verdict if v), False))
            continue
        mine = "tapa+vfirst" if v_first else "tapa"
        coco_run = timed({**args, **generate.VARIANTS[CONFIGS[mine]]})
        runner = coco_run["runner"]
        verdict = generate.gather(verdict_against(stock_run["images"], coco_run["images"]))
        exact = all(v["bitwise_equal"] for v in verdict if v)
        candidates.append(measured("stock", layout, False, stock_run, math.inf, True))
        candidates.append(measured(mine, layout, v_first, coco_run, math.inf if exact else -math.inf, exact))
        if ring_across_nodes(ulysses, ring):  # V-Major on the ring's K/V
            lossy_run = timed({**args, **generate.VARIANTS[CONFIGS["tapa+vfirst+vmajor"]]})
            verdict = generate.gather(verdict_against(stock_run["images"], lossy_run["images"]))
            candidates.append(measured("tapa+vfirst+vmajor", layout, True, lossy_run, min(v["psnr_db"] for v in verdict if v),
                                       all(v["bitwise_equal"] for v in verdict if v)))
    dist.barrier()
    runner.cleanup()
    if report is None:
        return None
    report["failures"] += [f"{c['name']} differs from stock {c['layout']}" for c in candidates if not c["exact"] and not c["lossy"]]
    report["equivalent"] = report["equivalent"] and all(c["exact"] for c in candidates if not c["lossy"])
    planned = report["planned"]
    kind = "stock" if planned["backend"] == "stock" else "tapa+vfirst" if planned["v_first"] else "tapa"
    planned_name = f"{kind} {bench_e2e.Layout(planned['ulysses'], planned['ring'], planned['cfg'] == 2).name}"
    measured_planned = next((c["step_s"] for c in candidates if c["name"] == planned_name), None)
    return {**report, **recommend(candidates, min_psnr), "measured_stock_step_s": step_s["stock"],
            "measured_fair_step_s": step_s["fair-flat"], "planned_step_s": measured_planned,
            "prediction_error": None if measured_planned is None else report["predicted_step_s"] / measured_planned - 1.0}


def verdict_against(reference, candidate) -> dict | None:
    """This rank's comparison of ``candidate`` with ``reference`` (None where xfuser's pipeline gave
    this rank no images for either: it outputs on the last rank)."""
    if reference is None or candidate is None:
        return None
    verdict = compare(reference, candidate)
    verdict["psnr_db"] = math.inf if verdict["bitwise_equal"] else quality.measure_images(reference, candidate)[1]["psnr_db"]
    return verdict


def measured_layouts(planned: dict, model: str, size: int, nodes: int, local: int) -> list[tuple[bench_e2e.Layout, bool]]:
    """Stage 4's layouts, each with whether cocodiff runs V-First there: the planner's best
    ``MEASURE_TOP``, its best stock layout and the stock layouts an informed user runs, less Ulysses
    over all ranks (stage 1 measured it) and layouts stock cannot split. PipeFusion's (stock only:
    V-First steps aside there) come last."""
    ranked = planned["ranked"]
    informed, _ = bench_e2e.stock_layouts(model, nodes, local)
    picks = [*ranked[:MEASURE_TOP], planned["best_stock"],
             *(r for lay in informed[1:] if lay.pipefusion == 1 for r in ranked
               if (r["ulysses"], r["ring"], r["cfg"] == 2) == (lay.ulysses, lay.ring, lay.cfg))]
    layouts = []
    for row in picks:
        layout = bench_e2e.Layout(row["ulysses"], row["ring"], row["cfg"] == 2)
        if (layout, row["v_first"]) in layouts or layout == bench_e2e.Layout(nodes * local):
            continue
        if tiny_models.uneven(model, layout.ulysses, layout.ring, size, size) is None:
            layouts.append((layout, row["v_first"]))
    piped = [lay for lay in informed if lay.stale and tiny_models.uneven(model, lay.ulysses, 1, size, size) is None]
    return layouts + [(lay, False) for lay in piped]


def candidate(mechanism: str, layout: "bench_e2e.Layout", v_first: bool, step_s: float, psnr_db: float, exact: bool,
              spread: float = 0.0, idle: bool = False) -> dict:
    """One measured configuration: its name, the flags that run it, its step and quality, the spread of
    its timed calls (range over median, the slowest rank's) and, for cocodiff, whether it ran none of
    its own exchanges (``idle``: stock's work under another flag, e.g. a layout with Ulysses degree 1)."""
    stock = mechanism == "stock"
    flags = layout.flags() + ("" if stock else " --sp-backend cocodiff" + (" --cocodiff-v-first" if v_first else "")
                              + (" --cocodiff-v-major on" if mechanism in LOSSY else ""))
    return {"name": f"{mechanism} {layout.name}", "layout": layout.name, "stock": stock,
            "lossy": mechanism in LOSSY or layout.stale,
            "flags": flags, "step_s": step_s, "psnr_db": psnr_db, "exact": exact, "spread": spread, "idle": idle}


def noise(candidates: list[dict]) -> float:
    """The relative difference two measurements of the same work show here: the widest spread of any
    configuration's timed calls, and each idle cocodiff run against stock on its layout (the same work,
    measured twice)."""
    stock = {c["layout"]: c["step_s"] for c in candidates if c["stock"]}
    aa = [abs(stock[c["layout"]] / c["step_s"] - 1.0) for c in candidates if c["idle"] and c["layout"] in stock]
    return max([c["spread"] for c in candidates] + aa)


def recommend(candidates: list[dict], min_psnr: float | None) -> dict:
    """The fastest lossless candidate (a lossy one, V-Major or stock PipeFusion, only at or above
    ``min_psnr``), the best stock layout under the same rule, and the advice's first line. cocodiff
    is recommended only where it beats that stock layout by more than the noise; an idle cocodiff run
    is never a candidate."""

    def allowed(c: dict) -> bool:
        return (c["exact"] and not c["lossy"]) or (c["lossy"] and min_psnr is not None and c["psnr_db"] >= min_psnr)

    stock = min((c for c in candidates if c["stock"] and allowed(c)), key=lambda c: c["step_s"])
    margin = noise(candidates)
    coco = [c for c in candidates if not c["stock"] and not c["idle"] and allowed(c)]
    best = min(coco, key=lambda c: c["step_s"], default=None)
    chosen = best if best is not None and stock["step_s"] / best["step_s"] - 1.0 > margin else stock
    if chosen["stock"]:
        advice = (f"run stock: {chosen['name']} is the fastest here"
                  + (f" ({chosen['psnr_db']:.1f} dB PSNR vs stock {candidates[0]['layout']})" if chosen["lossy"] else "")
                  + ("" if best is None else f"; cocodiff's best ({best['name']}) takes {best['step_s'] / chosen['step_s']:.2f}x its step")
                  + (f", a tie within {margin:.0%} (the noise measured here)" if best and best["step_s"] < chosen["step_s"] else ""))
    else:
        quality = "bitwise equal to stock" if not chosen["lossy"] else f"{chosen['psnr_db']:.1f} dB PSNR vs stock"
        advice = (f"run cocodiff: {chosen['name']} is {stock['step_s'] / chosen['step_s']:.2f}x the best stock layout "
                  f"({stock['name']}), {quality}")
    return {"candidates": candidates, "min_psnr_db": min_psnr, "advice": advice, "noise": margin,
            "best_stock": stock["name"], "best_stock_step_s": stock["step_s"], "best_stock_flags": stock["flags"],
            "recommended": chosen["name"], "recommended_step_s": chosen["step_s"], "recommended_flags": chosen["flags"],
            "recommended_psnr_db": chosen["psnr_db"], "speedup_vs_best_stock": stock["step_s"] / chosen["step_s"]}


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:8.2f}" if seconds else f"{'-':>8}"


def format_report(r: dict) -> str:
    fab = r["fabric"]
    where = (f"emulated {fab['fabric']} {fab['nodes']}x{fab['local']}, "
             + ", ".join(f"{k}={v:g}" for k, v in sorted(fab["fabric_params"].items()))) if fab else "this cluster"
    lines = [f"{r['model']} {r['size']} px, {r['steps']} steps, {r['world_size']} ranks (topology {r['topology']}) on {where}",
             f"advice: {r['advice']}",
             f"equivalence on Ulysses over all ranks against stock (bitwise on every rank; V-Major: PSNR >= {MIN_PSNR_DB:g} dB), step times:",
             f"  {'':4} {'stock':<20} {'':16} {r['measured']['stock']['step_s'] * 1e3:8.1f} ms"]
    for row in r["equivalence"]:
        what = "bitwise equal" if row["bitwise_equal"] else f"{row['psnr_db']:.1f} dB PSNR"
        lines.append(f"  {'ok' if row['ok'] else 'FAIL':4} {row['name']:<20} {what:<16} "
                     f"{r['measured'][row['name']]['step_s'] * 1e3:8.1f} ms")
        for reason, count in sorted(row["ran"]["fallbacks"].items()):
            lines.append(f"  {'':4} {'':<20} fell back ({count}x over the ranks): {reason}")
        if row["lossy"] and not row["ran"]["fallbacks"] and not row["ran"]["v_major_tokens"]:
            lines.append(f"  {'':4} {'':<20} no step ran sparsely (its warm-up took every step: raise --steps)")
    lines.append("exchanges on the Ulysses group, ms each (median; a step's bytes back to back):")
    lines.append(f"  {'KiB/rank':>9} {'x':>3} {'stock':>8} {'fair flat':>9} {'PXN-like':>8} {'TAPA':>8} {'chosen':>8}")
    for e in r["exchanges"]:
        lines.append(f"  {e['size_bytes'] / 1024:9.1f} {e['burst']:3d} {_ms(e['flat_s'])} {_ms(e['flat_p2p_s']):>9} "
                     f"{_ms(e['flat_pxn_s'])} {_ms(e['hierarchical_s'])} {_ms(e['chosen_s'])} {e['chosen']}")
    lines.append(f"calibration: {r['calibration']} (cocodiff plan --calibrate FILE reads it)")
    lines.append(f"planned: {r['planned']['flags']}")
    lines.append(f"  predicted step {r['predicted_step_s'] * 1e3:.1f} ms (compute {r['compute_s'] * 1e3:.1f} ms, measured, "
                 f"+ exposed communication {r['predicted_comm_s'] * 1e3:.1f} ms): {r['predicted_gain']:.2f}x stock's predicted "
                 f"{r['predicted_stock_step_s'] * 1e3:.1f} ms"
                 + ("" if r["prediction_error"] is None else f"; measured, the prediction is {r['prediction_error']:+.0%} off"))
    lines.append("measured layouts, stock and with cocodiff (exact: bitwise equal to the same stock layout; idle: cocodiff "
                 f"exchanged nothing there; noise {r['noise']:.0%}):")
    for c in sorted(r["candidates"], key=lambda c: c["step_s"]):
        what = ("idle" if c["idle"] else "exact" if c["exact"] else f"{c['psnr_db']:.1f} dB") if not c["stock"] else (
            f"stock, {c['psnr_db']:.1f} dB" if c["lossy"] else "stock")
        lines.append(f"  {c['name']:<28} {c['step_s'] * 1e3:8.1f} ms  {c['step_s'] and r['best_stock_step_s'] / c['step_s']:5.2f}x "
                     f"best stock  {what:<8} {c['flags']}")
    lines.append(f"  recommended: {r['recommended_flags']} ({r['recommended_step_s'] * 1e3:.1f} ms per step; best stock "
                 f"{r['best_stock_flags']}: {r['best_stock_step_s'] * 1e3:.1f} ms)")
    vm = r["v_major"]
    if vm and vm["recommended"] and r["min_psnr_db"] is None:
        what = f"{vm['layout']} {vm['flag']}" if vm["layout"] else vm["flag"]
        lines.append(f"  optional, lossy: {what} ({vm['note']}; --min-psnr DB lets the check "
                     "recommend it where its measured PSNR meets DB)")
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "check", help="will cocodiff help here? equivalence, exchange timings as a calibration, the recommendation "
                      "with its predicted and measured step (run it through the job's launcher, or --fabric as root)",
        description="Start it on every rank through the job's launcher (torchrun --nproc-per-node N -m "
                    "cocodiff_xfuser.tools.cli check ..., the shipped Slurm/PBS launchers, mpiexec), or give --fabric "
                    "to run it on an emulated cluster (root).")
    p.add_argument("--model", choices=models(), default="digits-flux", help="the stand-in to run and plan for")
    p.add_argument("--size", type=int, default=None, help="image height and width (default: the model's)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, help="timed pipeline calls per configuration")
    p.add_argument("--topology", "--cocodiff_topology", "--cocodiff-topology", default=None,
                   help="NxL[xT] or a preset (default: detected); the launchers' --cocodiff_topology is the same")
    # The launchers add --sp-backend cocodiff to the command they run; the check runs stock and cocodiff both.
    p.add_argument("--sp-backend", "--sp_backend", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default="check-output", help="directory for the calibration and the report")
    p.add_argument("--fabric", choices=FABRICS, default=None, help="run on an emulated cluster (network namespaces; root)")
    p.add_argument("--nodes", type=int, default=2, help="with --fabric")
    p.add_argument("--local", type=int, default=2, help="ranks per node, with --fabric")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="with --fabric: a link override")
    p.add_argument("--timeout", type=float, default=bench_e2e.TIMEOUT_S, help="seconds, with --fabric")
    p.add_argument("--min-psnr", type=float, default=None, metavar="DB",
                   help="also recommend a lossy configuration (V-Major) where its measured PSNR vs stock is at least DB")
    p.add_argument("--json", action="store_true", help="the last line: the report as one JSON object")


def run_cli(args: Any) -> int:
    if launched():
        return _on_ranks(args)
    if args.fabric is None:
        raise ValueError("start it on every rank through the job's launcher (torchrun --nproc-per-node N -m "
                         "cocodiff_xfuser.tools.cli check ..., the shipped Slurm/PBS launchers, mpiexec), or give "
                         "--fabric to run it on an emulated cluster (root)")
    return _on_fabric(args)


def _on_fabric(args: Any) -> int:
    """Bring the emulated cluster up, run the check on its ranks, take it down."""
    from cocodiff_xfuser.tools.bench import one_at_a_time
    from cocodiff_xfuser.tools.bench.a2a import topology_for
    from cocodiff_xfuser.tools.fabric import Fabric, available, parse_params

    ok, why = available()
    if not ok:
        raise ValueError(f"cannot build the {args.fabric} fabric here: {why}")
    params = {**bench_e2e.REGIME_PARAMS[args.fabric], **parse_params(args.param)}
    fab = Fabric(args.fabric, args.nodes, args.local, params=params, fabric_id=f"c{os.getpid() % 100000}")
    worker = [sys.executable, "-m", "cocodiff_xfuser.tools.cli", "check", "--model", args.model, "--steps", str(args.steps),
              "--repeat", str(args.repeat), "--topology", topology_for(args.fabric, args.nodes, args.local),
              "--out", str(Path(args.out).resolve()), *(["--size", str(args.size)] if args.size else []),
              *(["--json"] if args.json else []), *(["--min-psnr", str(args.min_psnr)] if args.min_psnr is not None else [])]
    with one_at_a_time(), fab:
        rc = fab.run(worker, timeout=args.timeout, extra_env=wire.GPU_WIRE).returncode
    if rc == 124:
        print(f"cocodiff check: timed out after {args.timeout:g} s (--timeout)", file=sys.stderr)
    return rc


def _quiet() -> None:
    """Rank 0's stderr carries the check's progress bar and its stdout the report: the libraries'
    progress bars and notices off (xfuser's loggers print to stdout; the environment is read when
    xfuser and transformers load)."""
    os.environ.setdefault("LOG_LEVEL", "error")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore", category=FutureWarning)
    from diffusers import DiffusionPipeline
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    diffusers_logging.disable_progress_bar()
    DiffusionPipeline._progress_bar_config = {"disable": True}  # every pipeline's denoising bar


def _on_ranks(args: Any) -> int:
    """This process is one rank of the job: run the stages, rank 0 reports."""
    join_job()
    _quiet()
    from cocodiff_xfuser import commstats

    wire.install()
    commstats.enable()
    rank = int(os.environ["RANK"])
    size = args.size or tiny_models.SPECS[args.model].height
    parts = (len(CONFIGS) + 1) * (1 + args.repeat) + len(message_sizes(args.model, size, int(os.environ["WORLD_SIZE"])))
    progress = Progress(parts, draw=rank == 0)
    try:
        report = job(args.model, size, args.steps, args.repeat, args.topology, Path(args.out), progress, args.min_psnr)
    except ValueError as e:  # the user's input, found alike on every rank
        if rank == 0:
            print(f"cocodiff check: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:  # noqa: BLE001 - one line, then the launcher stops the other ranks
        print(f"cocodiff check: rank {rank}: {progress.stage} failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
              file=sys.stderr, flush=True)
        os._exit(1)
    finally:
        progress.close()
    if report is None:
        return 0
    (Path(args.out) / "check.json").write_text(json.dumps(report, indent=1) + "\n")
    print(format_report(report), flush=True)
    for line in report["failures"]:
        print(f"cocodiff check: {line}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(report), flush=True)
    return 0 if report["equivalent"] else 1
