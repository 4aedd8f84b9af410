"""``cocodiff bench host``: cocodiff's own host time per exchange and per attention layer, the step
against stock's, and what the host does per layer, counted, for stock and every configuration,
eager and compiled, on loopback with shapes whose device work is negligible.

On a GPU a FLUX layer computes in a fraction of a millisecond, so the Python an exchange runs is
time the device waits for. Per mode (eager, ``--use_torch_compile``), three kinds of torchrun jobs
(2 ranks as topology 2x1, so V-Major is active; one job at a time), on one of two layouts
(``--layout``): Ulysses 2 (its exchanges cross the nodes), or ring 2 (Ulysses 1 x Ring 2: the ring's
K/V cross them, and V-Major runs on them):

* **steps**: stock and every configuration in one job (``generate --repeat``): each one's median
  step and its ratio to stock's; ``--rounds`` such jobs, the medians over them (this host's speed
  drifts by tens of percent between jobs minutes apart, and a ratio within one job by a few);
* **host time**: ``--rounds`` rounds of one job per configuration (stock's first, eager), the
  medians over the rounds, and eager each configuration's host time per layer over stock's of the
  same round (``host_layer_vs_stock``, the median: a round's jobs are a minute apart, the host's
  drift hits both). A job runs the configuration alone with its point-to-point batches taken out
  (every batch is posted as nothing and completes at once, so gloo's latency is not counted; the
  exchanges move no data, byte messages echo what the rank sends its peer (or arrive as zeros), the
  time that takes is not counted, and the images mean nothing). Eagerly an exact exchange is the
  default path's, the functional collectives a compiled graph holds, on the flat route (forced: no
  timed choice), the collective itself stood in for by a copy whose time is not counted, as stock's
  is below; compiled, the fair flat exchange is forced, so that every exchange left outside the graph
  is a batch. The time the timed calls spent in cocodiff's entry points, outermost calls only: the
  V-First processors' decision at a layer's entry, V's start, Q/K's exchange with V's wait, the
  output exchange, and, under stock's processors, the routed exchange (``Exchanger.all_to_all`` and
  the functional path's ``all_to_all``).
  ``host_s_per_exchange``: the exchange entry points' time over the exchanges that ran;
  ``host_s_per_layer``: all of it over the attention layer calls (V-First calls, or with stock's
  processors one per input and output exchange pair). V-Major takes the path a GPU takes, its
  Triton kernels (change sums, int4 encode and apply, mask decode), each launch stood in for by the torch
  reference, whose time is not counted: it is the device's work (the reference's own operations
  would count as host time on this CPU); ``kernel_launches_per_layer``: the launches a GPU's host
  makes besides. For reference, stock eager is timed the same way in xfuser's own exchange
  functions (the input and output all-to-all: layouts around the collective, which is stood in
  for); compiled, they are traced into the graph;
* **counts** (``counts``: deterministic, where the timings move by 20-40% between runs here): two
  jobs of stock and every configuration, alike but for their steps (:data:`COUNT_STEPS`), with the
  exact exchange on the backend's own all-to-all (``flat``: what a GPU's backend runs, and no
  timed choice that could differ between jobs), and the batches' and collectives' real Python. Of
  each backend's last two pipeline calls, the first counts its Python calls (``sys.setprofile``)
  and the second the torch operators it dispatches (``torch.profiler``'s CPU events: the
  profiler's own Python would count as calls); the longer job's count less the shorter's, over the
  attention layers of the steps between and the mean over the ranks, is what a layer costs at
  steady state (prompt encoding, the VAE, the set-up cancel; each step's own work is spread over
  its layers). **Python calls**: every function call of the main thread (generator resumptions
  included), and apart those of cocodiff's own modules; this tool's frames, everything under a
  stood-in launch and tqdm's progress bar (it redraws by the clock) are not counted, nor, apart,
  calls inside :data:`KERNEL_OPS` operators (their CPU kernels; on a GPU, a Triton launch).
  **Operators** per namespace (``aten``, ``cocodiff``,
  :data:`KERNEL_OPS`, the collectives'): each one host code dispatched, from Python or from a
  compiled graph's code (its extern kernels), and those :data:`OPERATORS`' Python kernels
  dispatch; apart, those inside :data:`KERNEL_OPS` operators, and a compiled graph's own kernels
  (``inductor_kernels``: C++ here, named by inductor's kernel profile; Triton launches on a GPU).
  Missed: what an operator's C++ kernel calls (``aten::linear``'s ``mm``: not host code's
  dispatch), a compiled graph's allocations and tensor reinterpretations (no operators), and
  C++ work that is neither (gloo's threads, a graph's guards). **Launches**: V-Major's Triton
  launches (commstats), each stood in for as above. The path is this host's: gloo posts
  point-to-point messages one by one where NCCL batches them. ``count_targets_met``: the issue's
  targets for them (:data:`COUNT_TARGETS`), each met or not.

Configurations are named as ``tools/generate.py``'s backends are.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

from cocodiff_xfuser.tools import generate, launcher

CONFIGS = ("cocodiff", "cocodiff+vfirst", "cocodiff+vfirst+vmajor")
MODES = ("eager", "compiled")
#: The layouts (``--layout``), as xdit's degrees: Ulysses 2, or Ulysses 1 x Ring 2.
LAYOUTS = {"ulysses": ("--ulysses_degree", "2"), "ring": ("--ulysses_degree", "1", "--ring_degree", "2")}
#: The issue's targets on this machine: cocodiff's own host time per exact exchange, per V-Major
#: layer (eager), and the step ratio to stock per configuration (eager and compiled).
TARGETS = {
    "host_s_per_exchange": 30e-6,
    "host_s_per_layer_v_major": 100e-6,
    "step_ratio": {"cocodiff": 1.05, "cocodiff+vfirst": 1.15, "cocodiff+vfirst+vmajor": 1.20},
}
#: The issue's targets for the deterministic counts: each configuration's Python calls per layer
#: at most this many times stock's, per mode; compiled, none of them in cocodiff's own modules.
COUNT_TARGETS = {
    "python_calls_vs_stock": {"eager": {"cocodiff": 1.1, "cocodiff+vfirst": 1.1, "cocodiff+vfirst+vmajor": 1.3},
                              "compiled": {"cocodiff": 1.1, "cocodiff+vfirst": 1.1}},
    "python_calls_cocodiff_compiled": 0,
}
#: The two counting jobs' step counts: their difference leaves what every step repeats.
COUNT_STEPS = (4, 8)
#: cocodiff's own operator namespace, which no exchange uses any more: counted, to show that none ran.
OPERATORS = "cocodiff"
#: V-Major's Triton operators: their CPU kernels stand for the device's work (a launch on a GPU).
KERNEL_OPS = "cocodiff_kernels"
#: The functional collectives' namespace: torch's Python autograd kernel of each, counted apart.
COLLECTIVE_OPS = "_c10d_functional"
DEFAULT_STEPS = 12
DEFAULT_REPEAT = 5
DEFAULT_ROUNDS = 3
TIMEOUT_S = 900.0
_RESULT = "host.json"


def _runner_argv(model: str, steps: int, compiled: bool, layout: str) -> list[str]:
    argv = ["--model", model, *LAYOUTS[layout], "--cocodiff-topology", "2x1", "--height", "64", "--width", "64",
            "--num_inference_steps", str(steps), "--prompt", "a cat", "--seed", "1"]
    return argv + (["--use_torch_compile"] if compiled else [])


def _steps(model: str, steps: int, repeat: int, compiled: bool, out: Path, timeout: float, layout: str) -> dict[str, float]:
    """Median step (s) of stock and every configuration, from one job."""
    backends = ("ulysses", *CONFIGS)
    argv = ["-m", "cocodiff_xfuser.tools.generate", "--out", str(out), "--backends", ",".join(backends),
            "--repeat", str(repeat), *_runner_argv(model, steps, compiled, layout)]
    launcher.torchrun(2, argv, timeout=timeout)
    found = {}
    for backend in backends:
        result = json.loads((generate.output_dir(out, model, backend) / "result.json").read_text())
        found[backend] = statistics.median(result["timings"]) / steps
    return found


def _host(model: str, config: str, steps: int, repeat: int, compiled: bool, out: Path, timeout: float, layout: str) -> dict:
    """One configuration alone, its batches (stock: its collectives) taken out: its entry points'
    time, summed over the ranks' timed calls, and what they ran."""
    forced = [] if config == "ulysses" else ["--cocodiff-a2a", "flat-p2p" if compiled else "flat"]
    argv = ["-m", "cocodiff_xfuser.tools.bench.host", "--worker", "--out", str(out), "--backends", config, "--repeat", str(repeat),
            *forced, *_runner_argv(model, steps, compiled, layout)]
    launcher.torchrun(2, argv, timeout=timeout)
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob(f"rank*-{_RESULT}"))]
    total = {key: sum(r[key] for r in ranks) for key in ("decision_s", "exchange_s", "exchanges", "layers", "launches")}
    return {
        "host_s_per_exchange": total["exchange_s"] / max(total["exchanges"], 1),
        "host_s_per_layer": (total["decision_s"] + total["exchange_s"]) / max(total["layers"], 1),
        "kernel_launches_per_layer": total["launches"] / max(total["layers"], 1),
        "exchanges_per_step": total["exchanges"] / len(ranks) / (steps * repeat),
        "layers_per_step": total["layers"] / len(ranks) / (steps * repeat),
    }


def _counts(model: str, compiled: bool, out: Path, timeout: float, layout: str = "ulysses") -> dict[str, dict]:
    """Per configuration (stock first), what its host does per attention layer at steady state,
    counted: the last calls of two jobs that differ only in their steps (:data:`COUNT_STEPS`), the
    difference over the attention layers of the steps between, the mean over the ranks; and the
    jobs' own counts (``calls``, per job's steps, per rank)."""
    backends = ("ulysses", *CONFIGS)
    out.mkdir(parents=True, exist_ok=True)
    variants = out / "variants.json"
    # The exact exchange forced to the backend's own all-to-all, what a GPU's backend runs: the
    # autotune's timed choice may differ between jobs, and the counts with it.
    variants.write_text(json.dumps({c: {**generate.VARIANTS[c], "cocodiff_a2a": "flat"} for c in CONFIGS}))
    jobs = {}
    for steps in COUNT_STEPS:
        argv = ["-m", "cocodiff_xfuser.tools.bench.host", "--count", "--out", str(out / str(steps)), "--backends", ",".join(backends),
                "--variants", str(variants), "--repeat", "2", *_runner_argv(model, steps, compiled, layout)]
        launcher.torchrun(2, argv, timeout=timeout)
        jobs[steps] = [json.loads(p.read_text()) for p in sorted((out / str(steps)).glob(f"rank*-{_COUNTS}"))]
    few, many = (jobs[steps] for steps in COUNT_STEPS)
    steps = COUNT_STEPS[1] - COUNT_STEPS[0]
    # Stock's processors exchange twice per layer, or on the ring layout gather the ring's K/V once
    # (compiled stock's exchanges are traced: not counted).
    per_layer = 1 if layout == "ring" else 2
    layers = statistics.fmean(m["cocodiff"]["exchanges"] - f["cocodiff"]["exchanges"] for f, m in zip(few, many)) / per_layer / steps

    def per_layer(config: str, count) -> float:
        return statistics.fmean(count(m[config]) - count(f[config]) for f, m in zip(few, many)) / (steps * layers)

    found = {}
    for config in backends:
        namespaces = sorted({ns for job in few + many for ns in job[config]["torch_ops"]})
        found[config] = {
            "layers_per_step": layers,
            **{f"{key}_per_layer": per_layer(config, lambda c, key=key: c[key])
               for key in ("python_calls", "python_calls_cocodiff", "python_calls_in_kernel_ops", "python_calls_in_collectives")},
            "torch_ops_per_layer": per_layer(config, lambda c: sum(c["torch_ops"].values())),
            "torch_ops_by_namespace_per_layer": {ns: per_layer(config, lambda c, ns=ns: c["torch_ops"].get(ns, 0)) for ns in namespaces},
            "torch_ops_in_kernel_ops_per_layer": per_layer(config, lambda c: c["in_kernel_ops"]),
            "inductor_kernels_per_layer": per_layer(config, lambda c: c["inductor_kernels"]),
            "kernel_launches_per_layer": per_layer(config, lambda c: c["kernels"]),
            "calls": {str(s): [job[config] for job in jobs[s]] for s in COUNT_STEPS},
        }
    return found


def run(model: str, steps: int, repeat: int, modes: tuple[str, ...], timeout: float = TIMEOUT_S, rounds: int = DEFAULT_ROUNDS,
        layout: str = "ulysses") -> dict:
    """The report: per configuration (stock first) and mode, the step, its ratio to stock's (medians
    over ``rounds`` jobs, each ratio within its job) and, for cocodiff's, its own host time per
    exchange and per layer (medians over ``rounds`` rounds of jobs; eager, its ratio to stock's)."""
    rows = {name: {"name": name} for name in ("ulysses", *CONFIGS)}
    with tempfile.TemporaryDirectory(prefix="cocodiff-bench-host-") as tmp:
        for mode in modes:
            compiled = mode == "compiled"
            jobs = [_steps(model, steps, repeat, compiled, Path(tmp) / f"steps-{mode}-{r}", timeout, layout) for r in range(rounds)]
            rows["ulysses"][mode] = {"step_s": statistics.median(j["ulysses"] for j in jobs), "step_ratio": 1.0}
            # Compiled, stock's exchanges are traced: no Python of theirs runs per call.
            timed = CONFIGS if compiled else ("ulysses", *CONFIGS)
            hosts = [{config: _host(model, config, steps, repeat, compiled, Path(tmp) / f"host-{mode}-{config}-{r}", timeout, layout)
                      for config in timed} for r in range(rounds)]
            if not compiled:
                rows["ulysses"][mode].update(_medians([h["ulysses"] for h in hosts]))
            for config in CONFIGS:
                ratios = [j[config] / j["ulysses"] for j in jobs]
                rows[config][mode] = {"step_s": statistics.median(j[config] for j in jobs), "step_ratio": statistics.median(ratios),
                                      "step_ratios": ratios, **_medians([h[config] for h in hosts])}
                if not compiled:
                    vs_stock = [h[config]["host_s_per_layer"] / h["ulysses"]["host_s_per_layer"] for h in hosts]
                    rows[config][mode].update(host_layer_vs_stock=statistics.median(vs_stock), host_layer_vs_stock_rounds=vs_stock)
            for config, counts in _counts(model, compiled, Path(tmp) / f"counts-{mode}", timeout, layout).items():
                rows[config][mode]["counts"] = counts
    return {"model": model, "layout": layout, "steps": steps, "repeat": repeat, "rounds": rounds, "targets": TARGETS, "count_steps": list(COUNT_STEPS),
            "count_targets": COUNT_TARGETS, "count_targets_met": _count_targets(rows, modes), "configs": list(rows.values())}


def _count_targets(rows: dict, modes: tuple[str, ...]) -> list[dict]:
    """Each of :data:`COUNT_TARGETS` that ``modes`` measured: its value and whether it is met."""
    found = []
    for mode in modes:
        stock = rows["ulysses"][mode]["counts"]["python_calls_per_layer"]
        for config, limit in COUNT_TARGETS["python_calls_vs_stock"][mode].items():
            ratio = rows[config][mode]["counts"]["python_calls_per_layer"] / stock
            found.append({"mode": mode, "config": config, "target": f"Python calls per layer <= {limit}x stock's",
                          "value": ratio, "met": ratio <= limit})
        if mode == "compiled":
            for config in CONFIGS:
                calls = rows[config][mode]["counts"]["python_calls_cocodiff_per_layer"]
                limit = COUNT_TARGETS["python_calls_cocodiff_compiled"]
                found.append({"mode": mode, "config": config, "target": f"Python calls per layer in cocodiff's modules <= {limit}",
                              "value": calls, "met": calls <= limit})
    return found


def _medians(rounds: list[dict]) -> dict:
    """Each figure of :func:`_host`'s, the median over ``rounds``; its host time per layer of each round beside."""
    return {**{key: statistics.median(r[key] for r in rounds) for key in rounds[0]},
            "host_s_per_layer_rounds": [r["host_s_per_layer"] for r in rounds]}


def print_report(report: dict) -> None:
    degrees = " x ".join(f"{k.removeprefix('--').removesuffix('_degree').capitalize()} {v}"
                         for k, v in zip(LAYOUTS[report["layout"]][::2], LAYOUTS[report["layout"]][1::2]))
    print(f"cocodiff bench host: {report['model']}, {degrees} on loopback (topology 2x1), {report['steps']} steps, "
          f"median of {report['repeat']} calls, of {report['rounds']} jobs; host time with the batches taken out")
    print(f"{'configuration':<24} {'mode':<9} {'step ms':>8} {'vs stock':>9} {'us/exchange':>12} {'us/layer':>9} "
          f"{'vs stock':>9} {'launches':>9}")
    for row in report["configs"]:
        for mode in MODES:
            m = row.get(mode)
            if m is None:
                continue
            vs_stock = f"{m['host_layer_vs_stock']:>8.2f}x" if "host_layer_vs_stock" in m else f"{'-':>9}"
            host = (f"{m['host_s_per_exchange'] * 1e6:>12.1f} {m['host_s_per_layer'] * 1e6:>9.1f} {vs_stock} {m['kernel_launches_per_layer']:>9.2f}"
                    if "host_s_per_exchange" in m else f"{'-':>12} {'-':>9} {'-':>9} {'-':>9}")
            print(f"{row['name']:<24} {mode:<9} {m['step_s'] * 1e3:>8.2f} {m['step_ratio']:>8.2f}x {host}")
    t = report["targets"]
    print(f"targets: <= {t['host_s_per_exchange'] * 1e6:.0f} us per exact exchange, <= "
          f"{t['host_s_per_layer_v_major'] * 1e6:.0f} us per V-Major layer (eager); step ratios "
          + ", ".join(f"{name} <= {r:.2f}x" for name, r in t["step_ratio"].items()))
    few, many = report["count_steps"]
    print(f"\ncounted per attention layer: the last calls of a {many}- and a {few}-step job, their difference over the "
          f"attention layers between (Python calls: in cocodiff's modules, inside {KERNEL_OPS} operators, inside "
          f"{COLLECTIVE_OPS} operators (torch's autograd kernels, among the calls); torch operators "
          f"dispatched from host code: cocodiff's, {KERNEL_OPS}', inside those; Triton launches stood in for; inductor's kernels)")
    print(f"{'configuration':<24} {'mode':<9} {'calls':>7} {'cocodiff':>8} {'in kops':>7} {'in coll':>7} {'ops':>6} {'cocodiff':>8} "
          f"{'kops':>5} {'in kops':>7} {'launches':>8} {'inductor':>8}")
    for row in report["configs"]:
        for mode in MODES:
            if mode not in row:
                continue
            c = row[mode]["counts"]
            ops = c["torch_ops_by_namespace_per_layer"]
            print(f"{row['name']:<24} {mode:<9} {c['python_calls_per_layer']:>7.1f} {c['python_calls_cocodiff_per_layer']:>8.1f} "
                  f"{c['python_calls_in_kernel_ops_per_layer']:>7.1f} {c['python_calls_in_collectives_per_layer']:>7.1f} "
                  f"{c['torch_ops_per_layer']:>6.1f} {ops.get(OPERATORS, 0):>8.1f} "
                  f"{ops.get(KERNEL_OPS, 0):>5.1f} {c['torch_ops_in_kernel_ops_per_layer']:>7.1f} {c['kernel_launches_per_layer']:>8.1f} "
                  f"{c['inductor_kernels_per_layer']:>8.1f}")
    for t in report["count_targets_met"]:
        print(f"{'met' if t['met'] else 'NOT met':<8} {t['mode']:<9} {t['config']:<24} {t['target']}: {t['value']:.2f}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="cocodiff/tiny-flux", help="an xdit model name (device work should be negligible)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, help="timed pipeline calls per configuration")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                   help="jobs timing every configuration's steps, and rounds of host-time jobs (medians over them)")
    p.add_argument("--modes", default=",".join(MODES), help="eager, compiled or both, comma-separated")
    p.add_argument("--layout", choices=tuple(LAYOUTS), default="ulysses",
                   help="Ulysses 2 (its exchanges cross the nodes) or Ulysses 1 x Ring 2 (the ring's K/V cross them)")
    p.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per torchrun job")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def run_cli(args: argparse.Namespace) -> int:
    modes = tuple(args.modes.split(","))
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"--modes: {', '.join(unknown)} not among {', '.join(MODES)}")
    report = run(args.model, args.steps, args.repeat, modes, args.timeout, args.rounds, args.layout)
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0


# The worker: generate's job with the entry points timed and the batches taken out.

class _Timer:
    """Time in outermost calls of the wrapped entry points (nested ones are inside them)."""

    def __init__(self) -> None:
        self.seconds = {"decision_s": 0.0, "exchange_s": 0.0}
        self._depth = 0
        self._excluded = 0.0  # inside timed calls: time that stands for the collectives

    def exclude(self, seconds: float) -> None:
        self._excluded += seconds

    def wrap(self, fn, kind: str):
        import torch

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            excluded, started = self._excluded, time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - started - (self._excluded - excluded)
                self._depth -= 1

        return torch.compiler.disable(timed)


#: The profile's range around a stood-in launch: the device's work, not counted.
_STOOD_IN = "cocodiff bench host: a stood-in launch"
_TOOLING = "cocodiff_xfuser.tools."
_COUNTS = "counts.json"


def _namespace(name: str) -> str | None:
    """The operator namespace of a profile event's name (``aten::add_``); None for other ranges."""
    found = re.fullmatch(r"(\w+)::\w+", name)
    return found.group(1) if found else None


class _PythonCalls:
    """Python function calls on this thread while entered (``sys.setprofile``'s call events,
    generator resumptions included): ``all``, ``cocodiff`` (those of cocodiff's own modules) and,
    apart from both, ``in_kernel_ops`` (those inside :data:`KERNEL_OPS` operators: their CPU
    kernels, what a Triton launch does on a GPU). ``in_collectives``, counted in ``all`` too: those
    inside :data:`COLLECTIVE_OPS` operators, the Python autograd kernel torch registers for each
    functional collective, which runs under ``torch.no_grad()`` as well, for stock as for cocodiff.
    This tooling's own frames are not counted, nor anything under a stood-in launch (the device's
    work; commstats counts the launch) or under tqdm's progress bar."""

    def __init__(self) -> None:
        import torch._ops

        self.counts = {"all": 0, "cocodiff": 0, "in_kernel_ops": 0, "in_collectives": 0}
        self._operator_calls = (torch._ops.OpOverload.__call__.__code__, torch._ops.OpOverloadPacket.__call__.__code__)
        # (frame, the count its callees go to or None, whether they count in ``all`` too) of the call in progress
        self._inside = None

    def __enter__(self) -> "_PythonCalls":
        sys.setprofile(self._event)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)

    def _event(self, frame, event: str, arg) -> None:
        if self._inside is not None:
            outer, key, in_all = self._inside
            if event == "return" and frame is outer:
                self._inside = None
            elif event == "call" and key:
                self.counts[key] += 1
                self.counts["all"] += in_all
            return
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        # tqdm redraws its progress bar by the clock: its calls would differ between runs.
        if frame.f_code is _StandIn._launch.__code__ or module.split(".")[0] == "tqdm":
            self._inside = (frame, None, False)
            return
        if module.startswith(_TOOLING):
            return
        self.counts["all"] += 1
        self.counts["cocodiff"] += module.split(".")[0] == "cocodiff_xfuser"
        if frame.f_code in self._operator_calls:
            namespace = str(frame.f_locals["self"]).split(".")[0]
            if namespace == KERNEL_OPS:
                self._inside = (frame, "in_kernel_ops", False)
            elif namespace == COLLECTIVE_OPS:
                self._inside = (frame, "in_collectives", True)


def _dispatches(events) -> dict:
    """Torch operators dispatched from host code among a CPU profile's ``events``: per namespace,
    those no other operator called and those the Python kernels of :data:`OPERATORS` called;
    apart, ``in_kernel_ops`` (called by :data:`KERNEL_OPS` operators' CPU kernels) and
    ``inductor_kernels`` (a compiled graph's own kernels, C++ on this CPU, as inductor's kernel
    profile names them; Triton launches on a GPU). Not counted: what an operator's C++ kernel calls
    (``aten::linear``'s ``aten::mm``), anything under a stood-in launch, and host work that is no
    operator (a compiled graph's allocations and tensor reinterpretations, the Python around)."""
    found = {"torch_ops": {}, "in_kernel_ops": 0, "inductor_kernels": 0}
    for event in events:
        namespace = _namespace(event.name)
        if namespace is None and "cpp_fused" not in event.name:
            continue
        caller = event.cpu_parent
        while caller is not None and caller.name != _STOOD_IN and _namespace(caller.name) is None:
            caller = caller.cpu_parent
        by = None if caller is None else _namespace(caller.name)
        if caller is not None and by not in (OPERATORS, KERNEL_OPS):
            continue  # a C++ kernel's own call, or the device's work
        if by == KERNEL_OPS:
            found["in_kernel_ops"] += 1
        elif namespace is None:
            found["inductor_kernels"] += 1
        else:
            found["torch_ops"][namespace] = found["torch_ops"].get(namespace, 0) + 1
    return found


class _StandIn:
    """A Triton kernel whose launches (``kernel[grid](*args)``) the torch ``reference`` computes
    instead, its time not counted: it stands for the device's work."""

    def __init__(self, reference, timer: _Timer) -> None:
        self._reference, self._timer = reference, timer

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kwargs) -> None:
        import torch

        started = time.perf_counter()
        with torch.profiler.record_function(_STOOD_IN):
            self._reference(*args, **kwargs)
        self._timer.exclude(time.perf_counter() - started)


def _encode_int4(x, reference, rows, out, s, k, **_):
    """``residual_kernels._encode``: rows ``rows`` of ``x`` ``[..., s, d]`` encoded into ``out``
    ``[..., k, row bytes]`` against ``reference``, whose rows take what they carry."""
    from cocodiff_xfuser.comm import residuals

    payload, new = residuals.encode_int4(x.index_select(-2, rows), reference.index_select(-2, rows))
    out.copy_(payload)
    reference.index_copy_(-2, rows, new)


def _apply_int4(held, payload, rows, s, k, EVERY, **_):
    """``residual_kernels._apply``: ``payload`` (``n`` planes of ``k`` rows) added to ``held`` (``n`` planes
    of ``s`` rows) at ``rows`` (``EVERY``: every row in order), in place."""
    from cocodiff_xfuser.comm import residuals

    n = payload.numel() // (k * payload.shape[-1])
    held, payload = held.view(n, s, -1), payload.view(n, k, -1)  # [n, s, d], [n, k, row bytes]
    if EVERY:
        held.copy_(residuals.add_int4(held, payload))
    else:
        held.index_copy_(1, rows, residuals.add_int4(held.index_select(1, rows), payload))


#: ``change_kernels.KINDS``' quantities, per element of V and its reference (float32).
_QUANTITIES = {0: lambda x, r: (x - r).square(), 1: lambda x, r: (x - r).abs(), 2: lambda x, r: r.square(),
               3: lambda x, r: x.square()}


def _change_sums(x, reference, own, exponents, s, d, inner, groups, before, top, A, B, **_):
    """``change_kernels._sums``: per kept group and token, each quantity's sum at its own scale and
    that scale's exponent."""
    from cocodiff_xfuser.vmajor import policy

    # [before, groups, inner, s, d]: the token dim and the kept one (groups), summed over the rest.
    x, r = (t.float().reshape(before, groups, inner, s, d) for t in (x, reference))
    for i, kind in enumerate((A, B)):
        sums, e = policy.own_scale_sums(_QUANTITIES[kind](x, r), (0, 2, 4), top)
        own[i].copy_(sums.flatten())
        exponents[i].copy_(e.flatten())


def _change_common(own, exponents, out, scales, n, top, **_):
    """``change_kernels._common``: each quantity's sums at the scale of its largest exponent."""
    from cocodiff_xfuser.vmajor import policy

    for i in range(2):  # out: [2, groups, s] or [2, s], the sums as own holds them ([2, groups * s])
        out.view(2, -1)[i], scales[i] = policy.one_scale(own[i], exponents[i].long(), top)


def _rank(keys, norms, scale, norm_scale, ranks, left, s, bound, BUDGET, **_):
    """``rank_kernels._rank``: the keys' stable ascending ranks, and the budget's count."""
    from cocodiff_xfuser.vmajor import policy

    budget = (norms, scale, norm_scale, struct.unpack("<d", struct.pack("<q", bound))[0]) if BUDGET else None
    got, count = policy.reference_ranks(keys, budget)
    ranks.copy_(got)
    if BUDGET:
        left.copy_(count)


def _top(ranks, active, mask, s, first, mask_bytes, **_):
    """``rank_kernels._top``: the tokens ranked at ``first`` or above, ascending, and their mask."""
    from cocodiff_xfuser.vmajor import policy

    got, bits = policy.reference_top(ranks, s - first)
    active.copy_(got)
    mask.copy_(bits)


def _mask_rows(mask, out, s, k, stride, **_):
    """``mask_kernels._rows``: the rows each mask of ``mask`` marks, into ``out``."""
    from cocodiff_xfuser.comm import sparse

    out.copy_(sparse.reference_rows_of(mask, s, k))


def _kernels_stood_in(timer: _Timer) -> None:
    """V-Major's Triton kernels launched on this CPU's tensors, each launch stood in for (the GPU's
    path: where triton is missing, the torch reference runs, counted)."""
    from cocodiff_xfuser.comm import mask_kernels, residual_kernels
    from cocodiff_xfuser.vmajor import change_kernels, rank_kernels

    if residual_kernels.triton is None:
        return
    residual_kernels._DEVICES = (*residual_kernels._DEVICES, "cpu")
    residual_kernels._encode, residual_kernels._apply = _StandIn(_encode_int4, timer), _StandIn(_apply_int4, timer)
    change_kernels._sums, change_kernels._common = _StandIn(_change_sums, timer), _StandIn(_change_common, timer)
    mask_kernels._rows = _StandIn(_mask_rows, timer)
    rank_kernels._rank, rank_kernels._top = _StandIn(_rank, timer), _StandIn(_top, timer)


#: xfuser's Ulysses exchanges (what stock's layers call), timed in a stock job.
_STOCK_EXCHANGES = ("_combined_qkv_all_to_all", "_ft_c_input_all_to_all", "_ft_c_output_all_to_all")


def _stood_in_collective(timer: _Timer):
    """A functional all-to-all stood in for: a copy of its input, whose time ``timer`` does not count."""

    def nothing(x, *args, **kwargs):
        started = time.perf_counter()
        out = x.clone()
        timer.exclude(time.perf_counter() - started)
        return out

    return nothing


def _stock_timed(timer: _Timer) -> None:
    """Stock's exchange functions timed, the functional all-to-all under them stood in for (a copy
    of the input, not counted)."""
    import importlib

    from cocodiff_xfuser import compat

    for name in _STOCK_EXCHANGES:
        function = compat.usp(name)
        setattr(importlib.import_module(function.__module__), name, timer.wrap(function, "exchange_s"))
    collective = compat.torch_private("torch.distributed._functional_collectives", "all_to_all_single")
    setattr(importlib.import_module(collective.__module__), "all_to_all_single", _stood_in_collective(timer))


def _functional_timed(timer: _Timer) -> None:
    """Eagerly, cocodiff's functional path timed in its entry points (V's start, Q/K's exchange with
    V's wait, the output's, the routed one), the collective under them stood in for (a copy of the
    input, not counted)."""
    from cocodiff_xfuser import ulysses_collectives
    from cocodiff_xfuser.comm import functional

    for name in ("start_v", "exchange_inputs", "output", "all_to_all"):
        setattr(ulysses_collectives, name, timer.wrap(getattr(ulysses_collectives, name), "exchange_s"))
    functional._all_to_all_single = _stood_in_collective(timer)


def _worker(argv: list[str]) -> None:
    import torch

    from cocodiff_xfuser import commstats, ulysses_handles
    from cocodiff_xfuser.comm import transport
    from cocodiff_xfuser.exchanger import Exchanger
    from cocodiff_xfuser.processors import ulysses

    timer = _Timer()
    _kernels_stood_in(timer)
    if argv[argv.index("--backends") + 1] == "ulysses":
        _stock_timed(timer)
    elif "--use_torch_compile" not in argv:
        _functional_timed(timer)
    ulysses.fallback_reason = timer.wrap(ulysses.fallback_reason, "decision_s")
    ulysses.start_input_exchange = timer.wrap(ulysses.start_input_exchange, "exchange_s")
    for name in ("exchange_inputs", "output"):
        setattr(ulysses_handles, name, timer.wrap(getattr(ulysses_handles, name), "exchange_s"))
    Exchanger.all_to_all = timer.wrap(Exchanger.all_to_all, "exchange_s")

    def post_nothing(recv, send, group, role, what, buffers=()):
        # Nothing crosses. Byte messages (V-Major's masks and rows) that no sent piece matches are
        # zeroed and the rest echo what this rank sends that peer (the counts are agreed, so a
        # mask still marks as many rows as arrive): a mask received as whatever memory held would
        # mark rows out of range. Not counted as host time: it stands for the collective.
        started = time.perf_counter()
        for into, out in zip(recv, send):
            for i, piece in enumerate(into):
                if piece.dtype != torch.uint8:
                    continue
                echo = out[i] if i < len(out) else None
                if echo is not None and echo.dtype == piece.dtype and echo.shape == piece.shape:
                    piece.copy_(echo)
                else:
                    piece.zero_()
        timer.exclude(time.perf_counter() - started)
        return transport.Completion([], "", group, what)

    transport.post = post_nothing

    counted = {}

    def counts() -> tuple[int, int, int]:
        ran = commstats.ran()
        return sum(ran["exchanges"].values()), ran["v_first_calls"], sum(ran["kernels"].values())

    def reset(original):
        def reset_with_timer():  # generate resets the statistics before its timed calls
            original()
            timer.seconds = dict.fromkeys(timer.seconds, 0.0)
            counted["before"] = counts()

        return reset_with_timer

    commstats.reset = reset(commstats.reset)
    out = Path(argv[argv.index("--out") + 1])
    generate.main(argv)
    exchanges, v_first, launches = (now - before for now, before in zip(counts(), counted["before"]))
    rank = int(os.environ.get("RANK", "0"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}-{_RESULT}").write_text(json.dumps(
        # Stock's processors: two exchanges per layer, or on the ring layout one gather of its K/V.
        {**timer.seconds, "exchanges": exchanges, "launches": launches,
         "layers": v_first if v_first else exchanges // (1 if "--ring_degree" in argv else 2)}
    ))


def _count_worker(argv: list[str]) -> None:
    """generate's job (``--repeat 2``) with each backend's last two pipeline calls counted: the
    first of them its Python calls, the second its operators (the profiler's own Python would
    count as calls); V-Major on the GPU's path, each launch stood in for."""
    import torch
    from xfuser.runner import xFuserModelRunner

    from cocodiff_xfuser import commstats

    _kernels_stood_in(_Timer())
    torch._inductor.config.cpp.enable_kernel_profile = True  # names the compiled graphs' own kernels in the profile
    counted: list[list[dict]] = []  # per backend, per pipeline call
    run_backend, run = generate.run_backend, xFuserModelRunner.run

    def each_backend(*args, **kwargs):
        counted.append([])
        return run_backend(*args, **kwargs)

    def counting(runner, input_args):
        calls = counted[-1]  # the warm-up call, then the two counted ones
        if len(calls) == 1:
            before = commstats.ran()
            with _PythonCalls() as python:
                result = run(runner, input_args)
            after = commstats.ran()
            calls.append({**{f"python_calls{'' if k == 'all' else '_' + k}": n for k, n in python.counts.items()},
                          **{key: sum(after[key].values()) - sum(before[key].values()) for key in ("exchanges", "kernels")}})
        elif len(calls) == 2:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                result = run(runner, input_args)
            calls.append(_dispatches(profile.events()))
        else:
            result = run(runner, input_args)
            calls.append({})
        return result

    generate.run_backend, xFuserModelRunner.run = each_backend, counting
    out = Path(argv[argv.index("--out") + 1])
    generate.main(argv)
    backends = argv[argv.index("--backends") + 1].split(",")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{int(os.environ.get('RANK', '0'))}-{_COUNTS}").write_text(json.dumps(
        {backend: {**calls[-2], **calls[-1]} for backend, calls in zip(backends, counted)}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2:])
    elif sys.argv[1:2] == ["--count"]:
        _count_worker(sys.argv[2:])
    else:
        parser = argparse.ArgumentParser(prog="cocodiff bench host", description=__doc__.splitlines()[0])
        add_arguments(parser)
        sys.exit(run_cli(parser.parse_args()))
