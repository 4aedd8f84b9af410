"""The ``cocodiff`` command: ``verify``, ``quality``, ``demo``, ``topology``, ``plan``, ``check`` and ``bench {a2a,e2e,kernels,host,graphs}``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path

from cocodiff_xfuser.settings import MODES
from cocodiff_xfuser.tools import demo, generate, quality, verify
from cocodiff_xfuser.tools import check as check_tool
from cocodiff_xfuser.tools import topology_cli
from cocodiff_xfuser.tools import payoff_map
from cocodiff_xfuser.tools import plan as plan_tool
from cocodiff_xfuser.tools.bench import a2a as bench_a2a
from cocodiff_xfuser.tools.bench import e2e as bench_e2e
from cocodiff_xfuser.tools.bench import graphs as bench_graphs
from cocodiff_xfuser.tools.bench import host as bench_host
from cocodiff_xfuser.tools.bench import kernels as bench_kernels
from cocodiff_xfuser.tools.fabric import PRESETS as FABRICS
from cocodiff_xfuser.tools.launcher import TorchrunError
from cocodiff_xfuser.tools.models import digits
from cocodiff_xfuser.tools.models import tiny as tiny_models


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cocodiff", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    verify_cmd = sub.add_parser("verify", help="stock Ulysses vs cocodiff on a tiny model, same seed, compared")
    verify_cmd.add_argument("--model", required=True, choices=sorted(tiny_models.SPECS))
    verify_cmd.add_argument("--ulysses-degree", type=int, required=True)
    verify_cmd.add_argument("--ring-degree", type=int, default=1)
    verify_cmd.add_argument("--cfg-parallel", action="store_true", help="guidance halves on two rank groups (CFG models)")
    verify_cmd.add_argument("--topology", default=None, help="emulated NxL[xT] (nodes x ranks per node [x tiles])")
    verify_cmd.add_argument("--steps", type=int, default=None)
    verify_cmd.add_argument("--v-first", action="store_true", help="cocodiff with V-First processors")
    verify_cmd.add_argument("--requests", type=Path, default=None, metavar="FILE.json",
                            help="a JSON list of requests (" + ", ".join(generate.REQUEST_KEYS) + "): cocodiff serves them "
                            "one after another in one job, then each in a fresh job; every image must be bitwise the same")
    verify_cmd.add_argument("--timeout", type=float, default=verify.TIMEOUT_S, help="seconds per torchrun job")
    verify_cmd.add_argument("--json", action="store_true", help="print one JSON object")

    quality_cmd = sub.add_parser(
        "quality",
        help="images of a cocodiff configuration vs stock Ulysses and one process: PSNR, SSIM, MS-SSIM, classifier",
        description="Other flags (--cocodiff_a2a ..., any xdit flag) go to the cocodiff run unchanged.",
    )
    quality_cmd.add_argument("--model", choices=sorted(tiny_models.SPECS), default=digits.NAME)
    quality_cmd.add_argument("--ulysses-degree", type=int, default=quality.DEFAULT_ULYSSES)
    quality_cmd.add_argument("--ring-degree", type=int, default=1)
    quality_cmd.add_argument("--topology", default=None, help="emulated NxL[xT]; default: 2 nodes x (ranks / 2)")
    quality_cmd.add_argument("--prompts", default=None, help="comma-separated; default: every digit (digits-flux, digits-sd3)")
    quality_cmd.add_argument("--seeds", type=int, default=quality.DEFAULT_SEEDS, help="seeds per prompt")
    quality_cmd.add_argument("--seed", type=int, default=0, help="the first seed")
    quality_cmd.add_argument("--steps", type=int, default=None, help="default: the model's")
    quality_cmd.add_argument("--v-first", action="store_true", help="cocodiff with V-First processors")
    quality_cmd.add_argument("--v-major", choices=MODES, default="off",
                             help="cocodiff with V-Major (--cocodiff-v-major; auto takes --cocodiff-v-major-min-psnr DB)")
    quality_cmd.add_argument("--sweep", choices=sorted(quality.SWEEPS), default=None,
                             help="measure every V-Major setting of the sweep against stock (JSON and a plot in --out; "
                                  "v-major-budget: also the auto mode's calibration points)")
    quality_cmd.add_argument("--out", default="quality-output", help="directory for quality.json and quality.png")
    quality_cmd.add_argument("--timeout", type=float, default=quality.TIMEOUT_S, help="seconds for the torchrun job")
    quality_cmd.add_argument("--json", action="store_true", help="print one JSON object")

    demo_cmd = sub.add_parser("demo", help="the trained digits model on 4 CPU ranks (2 nodes x 2), stock vs cocodiff")
    demo_cmd.add_argument("--out", default="demo-output", help="directory for the grid and the report")
    demo_cmd.add_argument("--seed", type=int, default=0)
    demo_cmd.add_argument("--timeout", type=float, default=demo.TIMEOUT_S)
    demo_cmd.add_argument("--no-cluster", action="store_true",
                          help="the loopback part only: skip the emulated cluster (which needs root and 3-4 minutes)")

    topology_cli.add_parser(sub)

    plan_cmd = sub.add_parser("plan", help="cost model: predicted communication per step, recommended degrees and flags; --validate")
    plan_tool.add_arguments(plan_cmd)
    payoff_map.add_arguments(plan_cmd)
    check_tool.add_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks, side by side in one run (emulated cluster: run as root)")
    kinds = bench.add_subparsers(dest="kind", required=True)
    a2a = kinds.add_parser("a2a", help="all-to-all: flat vs hierarchical vs the autotuned choice, vs the physical bound")
    e2e = kinds.add_parser("e2e", help="a tiny DiT pipeline: the stock layouts users run vs cocodiff's mechanisms, with unlimited-link floors")
    for p in (a2a, e2e):
        p.add_argument("--fabric", choices=FABRICS, default=None if p is a2a else "rail",
                       help="emulated cluster preset (network namespaces; needs root)" + ("; default: loopback" if p is a2a else ""))
        p.add_argument("--nodes", type=int, default=2)
        p.add_argument("--local", type=int, default=2, help="ranks per node")
        p.add_argument("--out", default="bench-output", help="directory for the JSON and the PNG")
        p.add_argument("--timeout", type=float, default=(bench_a2a if p is a2a else bench_e2e).TIMEOUT_S)
        p.add_argument("--json", action="store_true", help="print the report as one JSON object")
        p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="fabric parameter override")
    a2a.add_argument("--sizes-mib", default=",".join(map(str, bench_a2a.DEFAULT_SIZES_MIB)), help="message sizes per rank, MiB")
    a2a.add_argument("--reps", type=int, default=bench_a2a.DEFAULT_REPS)
    a2a.add_argument("--floor", action="store_true", help="also measure each size with the links unshaped (this host's floor)")
    for p in (a2a, e2e):
        p.add_argument("--shapes", help="NODESxLOCAL,... (e.g. 2x2,2x4,4x2): one run per shape" + (" and a summary" if p is a2a else "")
                       + "; overrides --nodes/--local")
    kernels = kinds.add_parser("kernels", help="one rank's layer compute at a real model's size and V-Major's work beside it "
                               "(this machine's GPU, or CPU)")
    bench_kernels.add_arguments(kernels)
    host = kinds.add_parser("host", help="cocodiff's own host time per exchange and per layer, and the step against stock's, "
                            "eager and compiled (loopback)")
    bench_host.add_arguments(host)
    graphs = kinds.add_parser("graphs", help="cocodiff's layers inside xDiT's compiled FLUX graph at real size, one rank of "
                              "Ulysses 8 in one process (a fake process group): CUDA graph partitions, host and device time")
    bench_graphs.add_arguments(graphs)
    e2e.add_argument("--model", choices=sorted(tiny_models.SPECS), default="tiny-flux")
    e2e.add_argument("--size", type=int, default=bench_e2e.DEFAULT_SIZE, help="image height and width")
    e2e.add_argument("--steps", type=int, default=bench_e2e.DEFAULT_STEPS)
    e2e.add_argument("--repeat", type=int, default=bench_e2e.DEFAULT_REPEAT, help="timed pipeline calls per configuration")
    e2e.add_argument("--rounds", type=int, default=bench_e2e.DEFAULT_ROUNDS,
                     help="runs of the whole series, every other one backwards; ratios are medians of each round's")
    e2e.add_argument("--configs", default=None, help=f"cocodiff's mechanisms, comma-separated, besides the stock layouts "
                     f"and the fair flat exchange; default: all of {','.join(bench_e2e.MECHANISMS)}")
    e2e.add_argument("--only", default=None, metavar="NAMES", help="only these configurations, comma-separated, by the "
                     "report's names (e.g. 'stock U2xR2,tapa+vfirst+vmajor U2xR2'); stock over all ranks and on each "
                     "kept layout always run")
    e2e.add_argument("--no-floor", action="store_true", help="skip the runs with unlimited links (the report then "
                     "cannot state how much of a step the links add)")
    return parser


#: Optional modules, by top-level name, and the extra that installs each.
EXTRAS = {"sklearn": "quality", "skimage": "quality", "pytorch_msssim": "quality", "tqdm": "quality", "matplotlib": "bench"}
#: What a command needs before it launches anything (``bench`` draws its figures only if it can).
NEEDS = {"quality": ("sklearn", "skimage", "pytorch_msssim", "tqdm"), "demo": ("sklearn", "skimage", "pytorch_msssim", "tqdm"),
         "check": ("skimage", "tqdm")}


def main(argv: list[str] | None = None) -> int:
    """Run a command; bad input, and an optional dependency missing, is one line on stderr and exit
    status 2 (no traceback)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in ("verify", "quality"):  # these pass flags on to xfuser's runner
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    name = " ".join(filter(None, ("cocodiff", args.command, getattr(args, "kind", None))))
    try:
        for module in NEEDS.get(args.command, ()):
            importlib.import_module(module)
        if args.command == "verify":
            return verify.main(args, extra)
        if args.command == "quality":
            return quality.main(args, extra)
        if args.command == "demo":
            return demo.main(args)
        if args.command == "bench" and args.kind == "kernels":
            return bench_kernels.run_cli(args)
        if args.command == "bench" and args.kind == "host":
            return bench_host.run_cli(args)
        if args.command == "bench" and args.kind == "graphs":
            return bench_graphs.run_cli(args)
        if args.command == "bench" and args.kind == "a2a":
            return bench_a2a.run_cli(args)
        if args.command == "topology":
            return topology_cli.run_cli(args)
        if args.command == "plan":
            return payoff_map.run_cli(args) if args.map else plan_tool.run_cli(args)
        if args.command == "check":
            return check_tool.run_cli(args)
        if args.command == "bench" and args.kind == "e2e":
            return bench_e2e.run_cli(args)
    except ValueError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    except TorchrunError as e:
        print(f"{name}: the job failed: {e.first_line()}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as e:
        extra = EXTRAS.get((e.name or "").partition(".")[0])
        if extra is None:
            raise
        print(f"{name}: needs {e.name}, which is not installed: pip install 'cocodiff-xfuser[{extra}]'", file=sys.stderr)
        return 2
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
