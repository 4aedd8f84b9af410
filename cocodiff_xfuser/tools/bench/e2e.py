"""``cocodiff bench e2e``: a tiny-but-real DiT pipeline on an emulated cluster, against what users run.

The stock layouts an informed user runs on the same ranks come first: Ulysses over all ranks (the
CoCoDiff paper's baseline), Ulysses inside the node x Ring across nodes (what xDiT and SGLang
advise), Ulysses x CFG parallel across nodes (models with true classifier-free guidance), and
PipeFusion across nodes under Ulysses inside them, at every stage count from one per node to one per
rank (xDiT's own answer to slow links between nodes, through xfuser's pipeline wrapper; lossy: stale
activations, more with more stages, its quality measured as V-Major's).
The fastest stock layout, PipeFusion included, is the headline's denominator; stock's algorithm on the fair flat
exchange (what the backend's own all-to-all does; on ``rail``, what NCCL's PXN does) and stock
Ulysses over all ranks are reported beside it. cocodiff's mechanisms run on Ulysses over all ranks,
and cocodiff runs on every other layout too (bitwise the same stock layout).

Each configuration runs as its own job on the fabric (``Fabric.run``): a first pipeline call
(warm-up, autotuning), then ``repeat`` timed calls. The ranks stop before and after the timed
calls (``generate --sync-dir``) while this driver reads the fabric's tbf byte counters, so the
bytes over slow links are measured for exactly the timed calls. Every configuration runs again with
every link rate raised 100-fold (the floor): the step without link limits on the same ranks, so the
report states how much of each step the links add. Everything is reported per denoising step.

With ``rounds`` > 1 the whole series runs that many times, every other round in reverse order, and
each ratio is the median over rounds of the two configurations' times within one round: a drift of
the host (another job, thermal state) between two configurations' jobs then shows as spread across
rounds rather than as a speed-up. Times are medians over rounds; images and counts are the first
round's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from cocodiff_xfuser.tools import quality
from cocodiff_xfuser.tools.bench import one_at_a_time, parse_shapes
from cocodiff_xfuser.tools.bench.a2a import topology_for
from cocodiff_xfuser.tools.fabric import Fabric, parse_params, wire
from cocodiff_xfuser.tools.generate import output_dir
from cocodiff_xfuser.tools.models import tiny as tiny_models
from cocodiff_xfuser.tools.verify import Run, compare

DEFAULT_SIZE = 256  # image height and width
#: The e2e regime. Two CPU cores compute a DiT step about three orders of magnitude more slowly
#: than a GPU, so at the a2a benchmark's line rates a tiny model is compute-bound, which is not the
#: regime this project is for. Every link is slowed by one constant (1/16.7 of the fabric
#: defaults, the ratios between links kept); ``--param`` overrides, and the report states the
#: regime it measured (each layout's step against its unlimited-link floor).
REGIME_PARAMS = {
    "rail": {"rail_bps": 6e7},
    "shared-uplink": {"uplink_bps": 1.2e8},
    "aurora-like": {"tile_nic_share_bps": 1.5e7},
}
#: The floor: every link rate of the fabric raised this many times (as ``bench a2a --floor``).
FLOOR_FACTOR = 100
DEFAULT_STEPS = 4
DEFAULT_REPEAT = 3  # timed pipeline calls per configuration
DEFAULT_ROUNDS = 1  # runs of the whole series (interleaved: see the module's docstring)
TIMEOUT_S = 1800.0
#: cocodiff's mechanisms, cumulatively, by name -> generate's backend variant. V-Major at its
#: defaults, and in its auto mode at its default PSNR target, is lossy: its quality is reported
#: beside its speed.
MECHANISMS = {
    "tapa": "cocodiff",
    "tapa+vfirst": "cocodiff+vfirst",
    "tapa+vfirst+vmajor": "cocodiff+vfirst+vmajor",
    "tapa+vfirst+vmajor-auto": "cocodiff+vfirst+vmajor-auto",
}
#: The mechanism cocodiff runs on the layouts other than Ulysses over all ranks (lossless; where
#: the Ulysses group stays inside a node, TAPA and V-Major have nothing to do and say so).
ON_EVERY_LAYOUT = "tapa+vfirst"
#: The lossy mechanisms: their PSNR and SSIM are reported beside their speed.
LOSSY = ("tapa+vfirst+vmajor", "tapa+vfirst+vmajor-auto")
STOCK = "ulysses"  # generate's variant for xfuser as it runs
# The slowest shaped link of every preset is the one named "uplink" in the emulation: the node
# uplink (shared-uplink, aurora-like) or the leaf-to-spine uplink carrying cross-rail traffic (rail).
SLOW_DEVICE = "uplink"


@dataclass(frozen=True)
class Layout:
    """A parallel layout of xfuser's on the job's ranks (rank order tp-sp-pp-cfg-dp: Ulysses
    groups are contiguous, ring and CFG peers sit a Ulysses group apart, on other nodes)."""

    ulysses: int
    ring: int = 1
    cfg: bool = False
    pipefusion: int = 1

    @property
    def stale(self) -> bool:
        """PipeFusion's stages work on activations a step old: lossy, whatever the backend."""
        return self.pipefusion > 1

    @property
    def name(self) -> str:
        return (f"U{self.ulysses}" + (f"xR{self.ring}" if self.ring > 1 else "") + ("xCFG2" if self.cfg else "")
                + (f"xPF{self.pipefusion}" if self.pipefusion > 1 else ""))

    def run(self, base: Run) -> Run:
        """``base`` on this layout."""
        return dataclasses.replace(base, ulysses_degree=self.ulysses, ring_degree=self.ring, cfg=self.cfg,
                                   pipefusion=self.pipefusion)

    def flags(self) -> str:
        return (f"--ulysses_degree {self.ulysses} --ring_degree {self.ring}"
                + (" --use_cfg_parallel" if self.cfg else "")
                + (f" --pipefusion_parallel_degree {self.pipefusion}" if self.pipefusion > 1 else ""))


def stock_layouts(model: str, nodes: int, local: int) -> tuple[list[Layout], list[str]]:
    """The stock layouts a user can run on ``nodes`` x ``local`` ranks, Ulysses over all ranks first,
    and a line for each layout the model does not offer."""
    world = nodes * local
    layouts, absent = [Layout(world)], []
    if nodes > 1:
        layouts.append(Layout(local, ring=nodes))
    if tiny_models.SPECS[model].cfg_parallel:
        if world % 2 == 0:
            layouts.append(Layout(world // 2, cfg=True))
    else:
        absent.append("Ulysses x CFG: the model has no true classifier-free guidance (no two batch halves to split)")
    if nodes > 1 and tiny_models.SPECS[model].pipefusion_absent is None:
        layouts += [Layout(world // p, pipefusion=p) for p in tiny_models.pipefusion_stages(model, nodes, world)]
    elif nodes > 1:
        absent.append(f"PipeFusion: {tiny_models.SPECS[model].pipefusion_absent}")
    return layouts, absent


@dataclass(frozen=True)
class Config:
    name: str
    layout: Layout
    variant: str  # generate's backend variant
    mechanism: str  # "stock", "fair-flat" or one of MECHANISMS


def fair_variant(fabric_name: str) -> str:
    """Stock's algorithm on the backend's fair flat exchange: on ``rail``, routed as NCCL's PXN does."""
    return "cocodiff-fair-pxn" if fabric_name == "rail" else "cocodiff-fair-flat"


def configs_for(model: str, fabric_name: str, nodes: int, local: int, mechanisms: Sequence[str]) -> tuple[list[Config], list[str]]:
    """The configurations of one series: every stock layout, the fair flat exchange, the chosen
    mechanisms on Ulysses over all ranks, and cocodiff on every other layout."""
    layouts, absent = stock_layouts(model, nodes, local)
    full = layouts[0]
    configs = [Config(f"stock {lay.name}", lay, STOCK, "stock") for lay in layouts]
    configs.append(Config(f"fair-flat {full.name}", full, fair_variant(fabric_name), "fair-flat"))
    configs += [Config(f"{m} {full.name}", full, MECHANISMS[m], m) for m in mechanisms]
    if ON_EVERY_LAYOUT in mechanisms:  # (V-First steps aside for PipeFusion: there it would be stock)
        configs += [Config(f"{ON_EVERY_LAYOUT} {lay.name}", lay, MECHANISMS[ON_EVERY_LAYOUT], ON_EVERY_LAYOUT)
                    for lay in layouts[1:] if not lay.stale]
    # Under Ulysses x Ring the ring's K/V cross the nodes: V-Major runs on them.
    configs += [Config(f"{m} {lay.name}", lay, MECHANISMS[m], m) for lay in layouts[1:] if lay.ring > 1
                for m in LOSSY if m in mechanisms]
    return configs, absent


def _slow_bytes(fabric: Fabric) -> int:
    return sum(row["sent_bytes"] for row in fabric.qdisc_stats() if row["dev"] == SLOW_DEVICE)


def _run_config(fabric: Fabric, model: str, run: Run, config: Config, repeat: int, work: Path, timeout: float) -> dict:
    sync = work / "sync"
    sync.mkdir(parents=True)
    argv = [sys.executable, *config.layout.run(run).argv((config.variant,), work), "--repeat", str(repeat), "--sync-dir", str(sync)]
    outcome: dict = {}

    def job() -> None:
        outcome["result"] = fabric.run(argv, timeout=timeout, extra_env={"COCODIFF_COMM_STATS": "1", **wire.GPU_WIRE},
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
        raise RuntimeError(f"{config.name} failed on {fabric.preset} (exit {result.returncode}):\n{result.stderr[-4000:]}")
    where = output_dir(work, tiny_models.SPECS[model].model_id, config.variant)
    report = json.loads((where / "result.json").read_text())
    report["images"] = np.load(where / "images.npy")
    report["slow_link_bytes_total"] = counters["done"] - counters["warm"]
    return report


def _quality(reference: np.ndarray, candidate: np.ndarray) -> dict:
    """PSNR (infinite when identical), SSIM and MS-SSIM, as ``cocodiff quality`` measures them."""
    _, summary = quality.measure_images(reference, candidate)
    return {key: summary[key] for key in ("psnr_db", "ssim", "ms_ssim")}


def _active_fraction(ran: dict) -> float | None:
    """V-Major's share of (token, layer, step) rows sent over slow links; None where it did not run."""
    counts = ran.get("v_major") or {}
    return counts["active"] / counts["tokens"] if counts.get("tokens") else None


def _run_series(fabric: Fabric, model: str, run: Run, configs: Sequence[Config], repeat: int, timeout: float,
                tag: str, rounds: int) -> dict[str, list[dict]]:
    """Each configuration's report per round (odd rounds run the series backwards)."""
    reports: dict[str, list[dict]] = {c.name: [] for c in configs}
    with fabric, tempfile.TemporaryDirectory() as tmp:
        for k in range(rounds):
            order = list(configs) if k % 2 == 0 else list(reversed(configs))
            for i, config in enumerate(order):
                label = f"{tag}{config.name}" + (f" (round {k + 1} of {rounds})" if rounds > 1 else "")
                print(f"  {label} ...", file=sys.stderr, flush=True)
                reports[config.name].append(_run_config(fabric, model, run, config, repeat, Path(tmp) / f"{k}-{i}", timeout))
    return reports


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
    mechanisms: Sequence[str] | None = None,
    floor: bool = True,
    names: Sequence[str] | None = None,
    rounds: int = DEFAULT_ROUNDS,
) -> dict:
    """The stock layouts, the fair flat exchange and cocodiff's ``mechanisms`` (default: all) on the
    fabric, side by side (``names``: only those of them, by the report's names; stock over all
    ranks and on each kept layout always runs); with ``floor``, each again with unlimited links;
    the whole series ``rounds`` times, interleaved."""
    if rounds < 1:
        raise ValueError(f"--rounds must be at least 1, not {rounds}")
    unknown = sorted(set(mechanisms or ()) - set(MECHANISMS))
    if unknown:
        raise ValueError(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(MECHANISMS)}")
    if model not in tiny_models.SPECS:
        raise ValueError(f"unknown model {model!r}; choose from {', '.join(tiny_models.SPECS)}")
    configs, absent = configs_for(model, fabric_name, nodes, local, list(MECHANISMS) if mechanisms is None else mechanisms)
    if names is not None:
        unknown = sorted(set(names) - {c.name for c in configs})
        if unknown:
            raise ValueError(f"--only: no configuration {', '.join(unknown)} here; choose from {', '.join(c.name for c in configs)}")
        # Each kept configuration is compared with stock on its layout: that runs too.
        compared = {c.layout for c in configs if c.name in names}
        configs = [c for i, c in enumerate(configs) if i == 0 or c.name in names or (c.mechanism == "stock" and c.layout in compared)]
    params = {**REGIME_PARAMS[fabric_name], **(params or {})}
    fabric = Fabric(fabric_name, nodes, local, params=params, fabric_id=f"e{os.getpid() % 100000}")
    run = Run(model=model, ulysses_degree=fabric.world, topology=topology_for(fabric_name, nodes, local), steps=steps,
              height=size, width=size)
    for config in configs:
        config.layout.run(run).check()
    tiny_models.ensure_fixture(model)
    load_before = os.getloadavg()[0]
    with one_at_a_time():
        reports = _run_series(fabric, model, run, configs, repeat, timeout, "", rounds)
        floors = {}
        if floor:
            fast = {k: v * FLOOR_FACTOR for k, v in fabric.params.items() if k.endswith("_bps")}
            unlimited = Fabric(fabric_name, nodes, local, params=fabric.params | fast, fabric_id=fabric.fabric_id)
            floors = _run_series(unlimited, model, run, configs, repeat, timeout, "floor: ", rounds)
    # Another job on this host's two cores shows in these; judge a series run beside one with care.
    load = {"load_average_before": load_before, "load_average_after": os.getloadavg()[0]}
    return _report(model, fabric, run, configs, absent, reports, floors, repeat, rounds) | load


def _seconds(runs: list[dict]) -> float:
    """A configuration's pipeline time: the median over rounds."""
    return float(np.median([r["seconds"] for r in runs]))


def _ratios(base: list[dict], runs: list[dict]) -> list[float]:
    """``base``'s time over ``runs``' time, round by round."""
    return [b["seconds"] / r["seconds"] for b, r in zip(base, runs)]


def _speedup(base: list[dict], runs: list[dict]) -> float:
    """``base``'s time over ``runs``' time, paired within each round, the median over rounds."""
    return float(np.median(_ratios(base, runs)))


def _report(model: str, fabric: Fabric, run: Run, configs: Sequence[Config], absent: list[str],
            reports: dict[str, list[dict]], floors: dict[str, list[dict]], repeat: int, rounds: int) -> dict:
    steps = run.steps
    by_name = {c.name: c for c in configs}
    stock_un, fair = configs[0].name, next((c.name for c in configs if c.mechanism == "fair-flat"), None)
    stocks = [c.name for c in configs if c.mechanism == "stock"]  # PipeFusion's lossy, the others not
    best = min(stocks, key=lambda name: _seconds(reports[name]))
    lossless = min((n for n in stocks if not by_name[n].layout.stale), key=lambda name: _seconds(reports[name]))
    best_floor = min(stocks, key=lambda name: _seconds(floors[name])) if floors else None
    same_stock = {c.layout: c.name for c in configs if c.mechanism == "stock"}
    rows = []
    for name, runs in reports.items():
        config, r = by_name[name], runs[0]
        comm, per_step = r["comm"], 1.0 / (r["comm"]["runs"] * steps)
        hidden = sum((o["exchange_s"] - o["exposed_s"]) * o["calls"] for o in comm["overlap"] if o["label"].endswith(".v"))
        exposed_s = comm["blocked_s_max_over_ranks"] * per_step
        hidden_s = max(hidden, 0.0) * per_step
        same = reports[same_stock[config.layout]]
        diff = compare(same[0]["images"], r["images"])
        floor_s = _seconds(floors[name]) / steps if floors else None
        step_s = _seconds(runs) / steps
        rows.append({
            "name": name, "layout": config.layout.name, "layout_flags": config.layout.flags(),
            "mechanism": config.mechanism, "stock": config.mechanism == "stock",
            "lossy": config.mechanism in LOSSY or config.layout.stale,
            "step_s": step_s,
            "step_s_rounds": [x["seconds"] / steps for x in runs],
            "floor_step_s": floor_s,
            "links_share": None if floor_s is None else max(0.0, 1.0 - floor_s / step_s),
            "comm_s": exposed_s + hidden_s,
            "comm_exposed_s": exposed_s,
            "comm_hidden_s": hidden_s,
            "slow_link_bytes": r["slow_link_bytes_total"] * per_step,
            "exchanges_per_step": comm["exchanges"] * per_step,
            "bytes_per_step": comm["bytes"] * per_step,
            "v_overlap": [o for o in comm["overlap"] if o["label"].endswith(".v")],
            # Against the same stock layout (cocodiff is exact on every layout but under V-Major).
            "max_abs_diff": diff["max_abs_diff"],
            "bitwise_equal": diff["bitwise_equal"],
            # Against stock Ulysses over all ranks: every layout's images beside one reference.
            **_quality(reports[stock_un][0]["images"], r["images"]),
            "v_major_active_fraction": _active_fraction(r["ran"]),
            "speedup_vs_best_stock": _speedup(reports[best], runs),
            "speedup_vs_best_lossless_stock": _speedup(reports[lossless], runs),
            "speedup_vs_stock": _speedup(reports[stock_un], runs),
            "speedup_vs_same_layout": _speedup(same, runs),
            "speedup_vs_same_layout_rounds": _ratios(same, runs),
            "speedup_vs_fair": _speedup(reports[fair], runs) if fair else None,
            "floor_speedup_vs_best_stock": _speedup(floors[best_floor], floors[name]) if floors else None,
            "exchanges_by_algorithm": r["ran"]["exchanges"],
            "fallbacks": r["ran"]["fallbacks"],
        })
    best_row = next(row for row in rows if row["name"] == best)
    share = best_row["links_share"]
    regime = ("not measured (no floor run)" if share is None else
              f"{'communication' if share >= 0.5 else 'compute'}-bound: the links add {share:.0%} of the best stock "
              f"layout's step ({best}: {best_row['step_s'] * 1e3:.1f} ms, {best_row['floor_step_s'] * 1e3:.1f} ms "
              "with unlimited links)")
    return {
        "model": model,
        "fabric": fabric.preset,
        "nodes": fabric.nodes,
        "local": fabric.local,
        "world_size": fabric.world,
        "size": run.height,
        "steps": steps,
        "timed_runs": repeat,
        "rounds": rounds,
        "per": "denoising step (median pipeline time / steps, the median over rounds; communication summed over "
               "the first round's timed runs / steps); ratios: the median over rounds of each round's ratio",
        "best_stock": best,
        "best_stock_step_s": best_row["step_s"],
        "best_lossless_stock": lossless,
        "best_stock_floor": best_floor,
        "fair_flat": fair,
        "regime": regime,
        "best_stock_links_share": share,
        "layouts_not_run": absent,
        "fabric_params": fabric.params,
        "floor_factor": FLOOR_FACTOR if floors else None,
        "fabric_description": fabric.describe(),
        "configs": rows,
    }


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_report(report: dict) -> str:
    lines = [
        f"{report['model']} {report['size']}x{report['size']}, {report['steps']} steps, {report['world_size']} ranks "
        f"on {report['fabric']} {report['nodes']}x{report['local']} ({report['timed_runs']} timed runs"
        + (f"; {report['rounds']} rounds, interleaved: medians of each round's ratio" if report["rounds"] > 1 else "") + ")",
        f"regime: {report['regime']}; fabric {', '.join(f'{k}={v:g}' for k, v in sorted(report['fabric_params'].items()))}",
        f"headline: against the best stock layout ({report['best_stock']}, PipeFusion included) and the best lossless one "
        f"({report['best_lossless_stock']}); beside them against "
        + (f"{report['fair_flat']} (stock's algorithm on the fair flat exchange) and against " if report["fair_flat"] else "")
        + f"stock {report['configs'][0]['layout']} (the CoCoDiff paper's baseline)",
        *(f"not run: {line}" for line in report["layouts_not_run"]),
        f"{'config':<30} {'step ms':>8} {'floor ms':>8} {'links':>6} {'exposed':>8} {'slow KiB':>9} "
        f"{'vs best':>8} {'vs LL':>8} {'vs fair':>8} {'vs U_N':>8} {'vs same':>8} {'floor vs best':>13} {'exact':>6} {'PSNR dB':>8} {'V-Major':>8}",
    ]
    for c in report["configs"]:
        floor = "-" if c["floor_step_s"] is None else f"{c['floor_step_s'] * 1e3:.1f}"
        share = "-" if c["links_share"] is None else f"{c['links_share']:.0%}"
        floor_ratio = _ratio(c["floor_speedup_vs_best_stock"])
        lines.append(
            f"{c['name'] + (' *' if c['name'] == report['best_stock'] else ''):<30} {c['step_s'] * 1e3:8.1f} {floor:>8} "
            f"{share:>6} {c['comm_exposed_s'] * 1e3:8.1f} {c['slow_link_bytes'] / 1024:9.0f} "
            f"{c['speedup_vs_best_stock']:7.2f}x {c['speedup_vs_best_lossless_stock']:7.2f}x {_ratio(c['speedup_vs_fair']):>8} "
            f"{c['speedup_vs_stock']:7.2f}x "
            f"{c['speedup_vs_same_layout']:7.2f}x "
            f"{floor_ratio:>13} {'yes' if c['bitwise_equal'] else 'no':>6} {c['psnr_db']:8.1f} "
            + ("" if c["v_major_active_fraction"] is None else f"{c['v_major_active_fraction']:7.0%} sent")
        )
    lines.append("* the best stock layout; vs LL: against the best lossless stock layout; vs same: against stock on the same layout; exact: bitwise equal to "
                 "the same stock layout; PSNR: against stock "
                 f"{report['configs'][0]['layout']}; links: the share of the step the links add (1 - floor / step)")
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
    shapes = parse_shapes(args.shapes) if args.shapes else [(args.nodes, args.local)]
    reports = []
    for nodes, local in shapes:
        report = bench_e2e(args.fabric, args.model, nodes, local, args.size, args.steps, args.repeat, params or None,
                           args.timeout, args.configs.split(",") if args.configs else None, floor=not args.no_floor,
                           names=args.only.split(",") if args.only else None, rounds=args.rounds)
        stem = f"e2e-{args.model}-{args.fabric}" + (f"-{nodes}x{local}" if args.shapes else "")
        (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
        if plots.available():
            plots.plot_e2e(report, out / f"{stem}.png")
        else:
            print(plots.MISSING, file=sys.stderr)
        written = f"{out / stem}.json" + (", .png" if plots.available() else "")
        print(format_report(report) + f"\nwritten: {written}", file=sys.stderr if args.json else sys.stdout, flush=True)
        reports.append(report)
    if args.json:
        print(json.dumps(reports[0] if len(reports) == 1 else {"reports": reports}))
    return 0
