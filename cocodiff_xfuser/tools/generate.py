"""Image generation through xfuser's own runner, as ``xdit`` does it; run under torchrun.

``python -m cocodiff_xfuser.tools.generate --out DIR [--backends ulysses,cocodiff] <xdit flags>``
runs the pipeline with the flags a user would give ``xdit`` (``--model`` may list several,
comma-separated), once per model and backend and, with ``--cases FILE`` (a JSON list of
``[prompt, seed]`` or of requests, :data:`REQUEST_KEYS`), once per case (one process start for
all of them: start-up dominates on small machines). On the last rank (the one xfuser saves from)
it writes ``DIR/<model>/<backend>/images.npy`` (float images in [0, 1], the cases' images in
order; where their sizes differ, ``case-<i>.npy`` per case instead),
``DIR/progress.json`` (pipeline calls done and due, timed runs included) as it goes, and
``result.json``, with what ran summed over the ranks (``ran``: exchanges per
algorithm and label, V-First calls, fall-backs) and, under ``COCODIFF_ORDER_AUDIT=1``, every
rank's collective launches (``launches``). ``verify``, ``demo``, the benchmarks and the tests
read these.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import statistics
import os
import sys
from pathlib import Path
from typing import Callable

import numpy as np

from cocodiff_xfuser import compat


# Named backend configurations a job can run one after the other.
VARIANTS = {
    "ulysses": {"sp_backend": "ulysses"},
    # Stock's algorithm (xfuser's own USP, its exchanges unchanged) on the fair flat exchange.
    "cocodiff-fair-flat": {"sp_backend": "cocodiff", "cocodiff_a2a": "flat-p2p"},
    # The same on a rail-optimized fabric: the flat exchange as NCCL's PXN routes it.
    "cocodiff-fair-pxn": {"sp_backend": "cocodiff", "cocodiff_a2a": "flat-pxn"},
    "cocodiff": {"sp_backend": "cocodiff"},
    "cocodiff+vfirst": {"sp_backend": "cocodiff", "cocodiff_v_first": True},
    "cocodiff+vfirst+vmajor": {"sp_backend": "cocodiff", "cocodiff_v_first": True, "cocodiff_v_major": "on"},
    "cocodiff+vfirst+vmajor-auto": {"sp_backend": "cocodiff", "cocodiff_v_first": True, "cocodiff_v_major": "auto"},
}


#: What a request may set (``cocodiff verify --requests``); the flags give the rest. ``steps`` is
#: ``--num_inference_steps``, ``batch_size`` the prompt that many times in one pipeline call.
REQUEST_KEYS = ("prompt", "seed", "height", "width", "steps", "guidance_scale", "batch_size")


def case_args(case: list | dict) -> dict:
    """The runner arguments one case sets: ``[prompt, seed]``, or a request (:data:`REQUEST_KEYS`)."""
    if isinstance(case, list):
        prompt, seed = case
        return {"prompt": prompt, "seed": seed}
    unknown = sorted(set(case) - set(REQUEST_KEYS))
    if unknown:
        # The tiny models are text-to-image pipelines: no input image, no strength.
        raise ValueError(f"request {case}: {', '.join(unknown)} not among {', '.join(REQUEST_KEYS)}")
    names = {"steps": "num_inference_steps"}
    args = {names.get(key, key): value for key, value in case.items() if key != "batch_size"}
    batch = int(case.get("batch_size", 1))
    if batch > 1 and "prompt" in case:
        args["prompt"] = [case["prompt"]] * batch
    return args


def output_dir(out: Path, model: str, backend: str) -> Path:
    return out / model.replace("/", "--") / backend


def runner_args(argv: list[str]) -> dict:
    """xfuser runner arguments from ``xdit``-style flags, as its runner parses them."""
    from xfuser import xFuserArgs
    from xfuser.config import FlexibleArgumentParser

    return vars(xFuserArgs.add_runner_args(FlexibleArgumentParser()).parse_args(argv))


def run_backend(args: dict, cases: list, repeat: int = 0, sync_dir: Path | None = None,
                on_call: Callable[[], None] | None = None) -> dict:
    """Generate ``cases`` (:func:`case_args`) through xfuser's runner configured by ``args``, on
    every rank (collective). With ``repeat``, time that many more runs of the last case (``comm``:
    their communication statistics). ``on_call`` follows every pipeline call. Returns ``runner``,
    ``images`` (this rank's output, per case), ``timings``, ``comm``, ``ran`` (summed over the
    ranks), ``launches`` (every rank's collective launches), ``resident`` (every rank's resident
    memory after each case, bytes) and, compiled, ``inductor_code``: the code inductor generated
    for this rank's graphs (cache hits included)."""
    from xfuser.runner import xFuserModelRunner

    from cocodiff_xfuser import commstats
    from cocodiff_xfuser.comm import transport

    commstats.reset_ran()
    code: list[str] | None = None
    if args.get("use_torch_compile"):
        # Each backend compiles as in a process of its own (the last one's cache entries would
        # count toward this one's recompile limit, its counters toward this one's breaks).
        compat.torch_private("torch._dynamo", "reset")()
        compat.torch_private("torch._dynamo.utils", "counters").clear()
        code = []
        compat.torch_private("torch._inductor.graph", "GraphLowering").save_output_code = code.append
    launched_before = len(transport.launches())
    runner = xFuserModelRunner(args)
    input_args = runner.preprocess_args(args)
    input_args["output_type"] = "np"
    runner.initialize(input_args)
    images, timings, dynamo, resident = [], [], [compile_counts()], []
    flags = dict(input_args)
    for case in cases:
        input_args = {**flags, **case_args(case)}
        output, case_timings = runner.run(input_args)
        images.append(list(output.images))
        timings += case_timings
        dynamo.append(compile_counts())
        resident.append(resident_bytes())
        if on_call is not None:
            on_call()
    comm = None
    if repeat:
        output, timings, comm = _timed_runs(runner, input_args, repeat, sync_dir, on_call)
        images = [list(output.images)]
        dynamo.append(compile_counts())
    ran = commstats.sum_ran(gather(commstats.ran()))
    launches = gather(transport.launches()[launched_before:])
    return {"runner": runner, "input_args": input_args, "images": images, "timings": timings, "comm": comm,
            "ran": ran, "launches": launches, "dynamo": gather(dynamo), "resident": gather(resident), "inductor_code": code}


def resident_bytes() -> int:
    """This process's resident memory now (Linux's ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def compile_counts() -> dict:
    """dynamo's counters so far in this process: frames it converted (a recompile converts one
    again) and graph breaks by reason (the first line of each, and the function a disabled call names)."""
    import re

    counters = compat.torch_private("torch._dynamo.utils", "counters")
    breaks: dict[str, int] = {}
    for reason, count in counters["graph_break"].items():
        function = re.search(r"Skip calling function `<function (\S+)", reason)
        key = reason.splitlines()[0] + (f": {function.group(1)}" if function else "")
        breaks[key] = breaks.get(key, 0) + count
    return {"frames": counters["frames"]["total"], "graph_breaks": breaks}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--out", required=True, type=Path)
    ours.add_argument("--backends", default=None, help=f"comma-separated from {sorted(VARIANTS)}; default: the flags")
    ours.add_argument("--variants", type=Path, default=None, help="JSON {name: {runner arg: value}}: more backend variants")
    ours.add_argument("--save-png", action="store_true")
    ours.add_argument("--cases", type=Path, default=None, help="JSON list of [prompt, seed]; default: the flags'")
    ours.add_argument("--repeat", type=int, default=0, help="after a first (warm-up, autotuning) run, time this many runs")
    ours.add_argument("--sync-dir", type=Path, default=None, help="with --repeat: hand-shake files around the timed runs")
    mine, runner_argv = ours.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO)  # as xfuser's runner does
    from cocodiff_xfuser.tools.fabric import wire

    wire.install()

    from xfuser.core.utils.runner_utils import is_last_process

    base = runner_args(runner_argv)
    if base.get("pipefusion_parallel_degree", 1) > 1:
        _count_pipeline_sends(base.get("cocodiff_topology"))
    models = base["model"].split(",")
    backends = mine.backends.split(",") if mine.backends else [base["sp_backend"]]
    variants = {**VARIANTS, **(json.loads(mine.variants.read_text()) if mine.variants else {})}
    unknown = [b for b in backends if b not in variants]
    if unknown:
        raise SystemExit(f"unknown backend variant(s) {unknown}; choose from {sorted(variants)}")
    from cocodiff_xfuser.comm import transport

    cases = json.loads(mine.cases.read_text()) if mine.cases else [[base["prompt"], base["seed"]]]
    if mine.repeat and len(cases) > 1:
        raise SystemExit("--repeat times one case; give --cases with one [prompt, seed] or no --cases")
    try:
        for case in cases:
            case_args(case)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if is_last_process():
        mine.out.mkdir(parents=True, exist_ok=True)
    progress = {"done": 0, "total": len(models) * len(backends) * (len(cases) + mine.repeat)}

    def on_call() -> None:
        progress["done"] += 1
        if is_last_process():
            (mine.out / "progress.json").write_text(json.dumps(progress))

    runner = None
    for model in models:
        for backend in backends:
            done = run_backend({**base, "model": model, **variants[backend]}, cases, mine.repeat, mine.sync_dir, on_call)
            runner = done["runner"]
            if is_last_process():
                path = output_dir(mine.out, model, backend)
                _save(path, done["images"], done["timings"], done["input_args"], done["comm"], mine.save_png,
                      done["ran"], done["launches"] if transport.auditing() else None, cases, done["dynamo"], done["resident"])
                if done["inductor_code"] is not None:
                    (path / "inductor_code.json").write_text(json.dumps(done["inductor_code"]))
    if runner is not None:
        runner.cleanup()


def _count_pipeline_sends(spec: str | None) -> None:
    """Count stock PipeFusion's sends between stages (xfuser's pipeline sends, activations and skip
    connections) as exchanges, ``pipefusion``, with their bytes on the wire where they cross nodes
    of the topology ``spec`` (None or auto: ``LOCAL_WORLD_SIZE`` ranks per node): the byte counter
    cocodiff's exchanges have, for a layout cocodiff does not run (``cocodiff quality``)."""
    from cocodiff_xfuser import commstats
    from cocodiff_xfuser.comm import topology, transport

    world = int(os.environ["WORLD_SIZE"])
    if spec in (None, "", "auto"):
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        nodes = [rank // local for rank in range(world)]
    else:
        found = topology.resolve(spec, world)
        nodes = [found.coords(rank)[0] for rank in range(world)]
    coordinator = compat.target(importlib.import_module("xfuser.core.distributed.group_coordinator"),
                                "PipelineGroupCoordinator")

    def counted(send: Callable, to: str, label: str) -> Callable:
        def send_counted(self, tensor):
            crossing = transport.wire_bytes(tensor) if nodes[getattr(self, to)] != nodes[self.rank] else 0
            commstats.count_exchange("pipefusion", label, slow_link_bytes=crossing, slow_link_bytes_exact=crossing)
            return send(self, tensor)

        return send_counted

    for name, to, label in (("_pipeline_isend", "next_rank", "stage"), ("_pipeline_isend_skip", "skip_rank", "skip")):
        setattr(coordinator, name, counted(compat.target(coordinator, name), to, label))


def _timed_runs(runner, input_args: dict, repeat: int, sync_dir: Path | None, on_call: Callable[[], None] | None = None):
    """``repeat`` runs after the first, with communication statistics of those runs only."""
    import torch.distributed as dist

    from cocodiff_xfuser import commstats

    _handshake(sync_dir, "warm")
    commstats.reset()
    timings = []
    for _ in range(repeat):
        output, run_timings = runner.run(input_args)
        timings += run_timings
        if on_call is not None:
            on_call()
    _handshake(sync_dir, "done")
    comm = commstats.report()
    # The slowest rank sets the pace: report its blocked time.
    from cocodiff_xfuser.comm.timing import slowest
    from cocodiff_xfuser.platform import detect

    device = detect().device(int(os.environ.get("LOCAL_RANK", "0")))
    comm["blocked_s_max_over_ranks"] = slowest([comm["blocked_s"]], dist.group.WORLD, device)[0]
    comm["runs"] = repeat
    return output, timings, comm


def gather(value) -> list:
    """``value`` of every rank, in rank order (collective over the world)."""
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def _handshake(sync_dir: Path | None, name: str, timeout_s: float = 300.0) -> None:
    """All ranks stop; rank 0 announces ``name`` and waits for ``name.go`` (a driver measuring around us)."""
    import time

    import torch.distributed as dist

    dist.barrier()
    if sync_dir is not None and dist.get_rank() == 0:
        (sync_dir / name).write_text("")
        deadline = time.monotonic() + timeout_s
        while not (sync_dir / f"{name}.go").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {name}.go in {sync_dir} after {timeout_s:g} s")
            time.sleep(0.05)
    dist.barrier()


def _save(
    out: Path,
    images: list,
    timings: list,
    args: dict,
    comm: dict | None,
    save_png: bool,
    ran: dict,
    launches: list | None,
    cases: list,
    dynamo: list,
    resident: list,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    per_case = [np.stack([np.asarray(image) for image in case]) for case in images]
    if len({case.shape[1:] for case in per_case}) > 1:
        for i, case in enumerate(per_case):
            np.save(out / f"case-{i}.npy", case)
    else:
        np.save(out / "images.npy", np.concatenate(per_case))
    if save_png:
        from diffusers.utils import numpy_to_pil

        for i, image in enumerate(numpy_to_pil(np.concatenate([c.reshape(-1, *c.shape[-3:]) for c in per_case]))):
            image.save(out / f"image_{i}.png")
    result = {
        "model": args["model"],
        "sp_backend": args["sp_backend"],
        "v_first": bool(args.get("cocodiff_v_first")),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "seconds": statistics.median(timings) if timings else None,
        "timings": timings,
        "steps": args.get("num_inference_steps"),
        "cases": cases,
        "comm": comm,
        "ran": ran,
        "launches": launches,
        "dynamo": dynamo,
        "resident_bytes": resident,
    }
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
