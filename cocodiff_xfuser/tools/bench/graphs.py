"""``cocodiff bench graphs``: how cocodiff's attention layers sit inside xDiT's compiled FLUX graph,
on one accelerator.

xDiT compiles FLUX.1's transformer whole, ``mode="reduce-overhead"`` (CUDA graphs), with its
compute/communication overlap passes on. What a layer runs on the host (an opaque operator, a read
of a device value, a graph break) cuts that graph: the pieces between run as separate CUDA graphs
(partitions), the host work outside them. This builds real-size FLUX.1-dev blocks (24 heads x 128,
hidden 3072; ``--double``/``--single`` of them, random weights, bf16) fed a 1024x1024 image (4096
image tokens, 512 text tokens) as rank 0 of Ulysses 8, which holds an eighth of them, in one
process: torch's fake process group at world size 8, whose collectives move nothing (shapes and
host work are real, values are not). Per configuration (``stock``: xfuser's processors and
exchanges; ``cocodiff``: its exact exchange under xfuser's processors; ``+vfirst``: its V-First
processors; ``+vmajor``: V-Major at its defaults (top-k: static shapes, caches the graphs update in
place) over topology 2x4, so the Ulysses exchange crosses nodes; ``-budget``: V-Major under budget,
whose counts the data decides: its per-call path, between graphs),
compiled as xDiT compiles FLUX, it reports:

* from inductor's generated code: each graph's CUDA graph partitions (``Runner(partitions=...)``),
  and the lines that run cocodiff's operators (``torch.ops.cocodiff``) or read a device value on
  the host (``_local_scalar_dense``);
* dynamo's graph breaks, inductor's cudagraph skips and its ``cudagraphs`` log (why it skipped or
  cut, by message);
* one forward at steady state, profiled: the compiled graphs it called, the CUDA graphs it launched,
  the kernels that took the most device time;
* host time (the call, not synchronized) and device time (CUDA events) per block, medians of
  ``--reps`` forwards after ``--warmup`` (a block's attention layer with its MLP);
* what cocodiff counted (``commstats.ran()``): exchanges by algorithm, V-First calls, V-Major's
  sparse exchanges.

Run on one GPU (H100/H200), from the repository's root, within a 10-minute call, and publish the
JSON in docs/results, named for the GPU (the device image lacks xfuser and its stack: the wheels it
installs are made as docs/benchmarks.md, "On one H100", says; the checkout goes on the path with
cocodiff's import hook)::

    python3 -m pip install -q --no-index --no-deps .whl/*.whl && (pwd; cat cocodiff_xfuser.pth) > "$(python3 -c 'import site; print(site.getsitepackages()[0])')/cocodiff_xfuser.pth" && PYTHONUNBUFFERED=1 timeout 540 python3 -m cocodiff_xfuser.tools.bench.graphs --json $OUT/graphs-flux-h100.json

The JSON is rewritten after each configuration, so a run cut short keeps what it measured.
``--tiny`` runs the same at a tiny size (8 heads x 16, 64 image and 16 text tokens), on CPU too.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.metadata
import json
import logging
import re
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from cocodiff_xfuser import compat

CONFIGS = ("stock", "cocodiff", "cocodiff+vfirst", "cocodiff+vfirst+vmajor", "cocodiff+vfirst+vmajor-budget")
WORLD = 8
#: Two nodes of four: Ulysses 8 crosses nodes, so V-Major has a slow level to act on.
TOPOLOGY = "2x4"
DEFAULT_WARMUP = 5
DEFAULT_REPS = 10
#: Kernels listed per configuration, by device time in the profiled forward.
DEVICE_KERNELS = 15


@dataclass(frozen=True)
class Spec:
    """A FLUX.1 transformer's shape and its inputs: image and text tokens of the whole sequence."""

    heads: int
    head_dim: int
    joint_dim: int
    pooled_dim: int
    in_channels: int
    rope: tuple[int, int, int]
    image: int
    text: int


SPECS = {
    "flux-dev": Spec(heads=24, head_dim=128, joint_dim=4096, pooled_dim=768, in_channels=64, rope=(16, 56, 56),
                     image=4096, text=512),
    "tiny": Spec(heads=8, head_dim=16, joint_dim=32, pooled_dim=16, in_channels=16, rope=(4, 6, 6), image=64, text=16),
}

_PARTITIONS = re.compile(r"Runner\(partitions=\[([^\]]*)\]\)")
_COCODIFF_OP = re.compile(r"torch\.ops\.cocodiff\.(\w+)\.\w+\(")  # a call, not a check naming it
_HOST_READ = re.compile(r"_local_scalar_dense(?:\.default)?\(")
#: inductor's loggers of the ``cudagraphs`` artifact (what ``TORCH_LOGS=cudagraphs`` shows).
_CUDAGRAPH_LOGGERS = tuple(f"torch._inductor.{m}.__cudagraphs" for m in ("cudagraph_utils", "cudagraph_trees", "scheduler"))


def _fake_world() -> None:
    # A torch-internal module: the fake backend registers itself when it is imported (tool only).
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)


def _echo_point_to_point() -> None:
    """cocodiff's point-to-point batches as in a world of ranks alike: each received piece is what
    this rank sends that peer, where their shapes match, else zeros (the fake group's receives
    deliver nothing, and V-Major's masks, read from whatever memory held, mark rows out of range)."""
    from cocodiff_xfuser.comm import transport

    post = transport.post

    def posted(recv, send, group, role, what, buffers=()):
        done = post(recv, send, group, role, what, buffers)
        me, _ = transport.group_info(group)
        for peer, (into, out) in enumerate(zip(recv, send)):
            for i, piece in enumerate(into if peer != me else ()):
                echo = out[i] if i < len(out) else None
                if echo is not None and echo.dtype == piece.dtype and echo.shape == piece.shape:
                    piece.copy_(echo)
                else:
                    piece.zero_()
        return done

    transport.post = posted


def _xfuser(text: int) -> None:
    """xfuser's groups for Ulysses 8 over the fake world, and its runtime state without a pipeline
    (:mod:`cocodiff_xfuser.tools.xfuser_state`) for ``text`` tokens of text, compiled."""
    from xfuser import xFuserArgs
    from xfuser.core.distributed import init_distributed_environment, initialize_model_parallel

    from cocodiff_xfuser.tools import xfuser_state

    new_group = dist.new_group

    def fake_group(*args, **kwargs):
        # xfuser asks for gloo groups beside the device's; in one process every group is fake.
        return new_group(*args, **{**kwargs, "backend": "fake"})

    dist.new_group = fake_group
    try:
        init_distributed_environment(backend="fake")
        initialize_model_parallel(sequence_parallel_degree=WORLD, ulysses_degree=WORLD, backend="fake")
    finally:
        dist.new_group = new_group
    engine_config, _ = xFuserArgs(model="tiny", ulysses_degree=WORLD, use_torch_compile=True).create_config()
    xfuser_state.install(engine_config, text)


def _options(config: str):
    from cocodiff_xfuser.settings import Options, VMajorSettings

    # Not auto: its timed choice means nothing where the collectives move nothing. The exact exchange
    # is the backend's all-to-all; V-Major's sparse one is posted point to point (which
    # _echo_point_to_point completes): the fake all-to-all would hand V-Major this rank's own chunk
    # from every peer, read as masks of rows out of range.
    # V-Major's static path exchanges through the (fake) all-to-all whatever the setting: the masks it
    # reads then are whatever memory held, decoded within range (sparse.reference_rows_of).
    v_major = "vmajor" in config
    settings = VMajorSettings.load(policy="budget") if config.endswith("-budget") else VMajorSettings.load()
    return Options(topology=TOPOLOGY, a2a="flat-p2p" if v_major else "flat", v_first="vfirst" in config,
                   v_major=settings if v_major else None)


def _use(config: str) -> None:
    """The job as a user's compiled job of ``config`` runs it: cocodiff's or none, its patches."""
    from xfuser.core.distributed import get_sp_group

    from cocodiff_xfuser.xfuser import activation, job

    if config == "stock":
        job.end()
    else:
        job.start(get_sp_group().ulysses_group, _options(config))
    activation.use_patches(True)


def _model(spec: Spec, double: int, single: int, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from xfuser.model_executor.models.transformers.transformer_flux import xFuserFlux1Transformer2DWrapper

    torch.manual_seed(0)
    with device:
        model = xFuserFlux1Transformer2DWrapper(
            in_channels=spec.in_channels, num_layers=double, num_single_layers=single, attention_head_dim=spec.head_dim,
            num_attention_heads=spec.heads, joint_attention_dim=spec.joint_dim, pooled_projection_dim=spec.pooled_dim,
            guidance_embeds=True, axes_dims_rope=spec.rope)
    return model.to(dtype).eval()


def _inputs(spec: Spec, device: torch.device, dtype: torch.dtype) -> dict:
    """The whole sequence's inputs (xfuser's wrapper keeps this rank's eighth), but the timestep."""
    g = torch.Generator().manual_seed(1)
    side = round(spec.image**0.5)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack((torch.zeros_like(rows), rows, cols), -1).reshape(-1, 3).float()
    found = {
        "hidden_states": torch.randn(1, spec.image, spec.in_channels, generator=g),
        "encoder_hidden_states": torch.randn(1, spec.text, spec.joint_dim, generator=g),
        "pooled_projections": torch.randn(1, spec.pooled_dim, generator=g),
        "img_ids": img_ids,
        "txt_ids": torch.zeros(spec.text, 3),
        "guidance": torch.tensor([3.5]),
    }
    # As FluxPipeline passes them: in the model's dtype, but guidance in float32.
    return {k: v.to(device, torch.float32 if k == "guidance" else dtype) for k, v in found.items()}


class _Pipe:
    """A pipeline as cocodiff sees one: V-Major's context (steps, caches) opens at each call."""

    def __init__(self, run) -> None:
        self._run = run

    def __call__(self):
        return self._run()


def _forwards(model, inputs: dict, device: torch.device, dtype: torch.dtype, warmup: int, reps: int) -> dict:
    """``warmup`` forwards, ``reps`` timed (host and device seconds each), then one profiled: the
    compiled graphs it called and the CUDA graphs it launched. Each forward is a denoising step."""
    cuda = device.type == "cuda"
    steps = warmup + reps + 1

    def forward(step: int) -> tuple[float, float | None]:
        timestep = torch.tensor([1.0 - step / steps], device=device, dtype=dtype)
        torch.compiler.cudagraph_mark_step_begin()
        if cuda:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        with torch.no_grad():
            model(**inputs, timestep=timestep, return_dict=False)
        host = time.perf_counter() - began
        if not cuda:
            return host, None
        end.record()
        end.synchronize()
        return host, start.elapsed_time(end) / 1e3

    for step in range(warmup):
        forward(step)
    timed = [forward(warmup + i) for i in range(reps)]
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as profile:
        forward(steps - 1)
    names = [e.name for e in profile.events()]
    # Where the device time goes (kernels replayed from CUDA graphs included): the largest first.
    kernels = sorted((e for e in profile.key_averages() if e.device_time_total > 0), key=lambda e: -e.device_time_total)
    return {"host_s": [host for host, _ in timed], "device_s": [gpu for _, gpu in timed] if cuda else None,
            "graph_calls": sum(n.startswith("## Call CompiledFxGraph") for n in names),
            "cuda_graph_launches": sum(n == "cudaGraphLaunch" for n in names),
            "device_kernels": [{"name": e.key, "calls": e.count, "device_s": e.device_time_total / 1e6}
                               for e in kernels[:DEVICE_KERNELS]]}


class _Lines(logging.Handler):
    """The messages of inductor's ``cudagraphs`` log, counted (their first lines; the stack traces
    of the nodes it cuts at are left out)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.counts: collections.Counter = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if not text.startswith(" " * 9):
            self.counts[text.strip().splitlines()[0]] += 1


@contextlib.contextmanager
def _cudagraphs_log():
    handler = _Lines()
    loggers = [logging.getLogger(name) for name in _CUDAGRAPH_LOGGERS]
    saved = [(log.level, log.propagate) for log in loggers]
    for log in loggers:
        log.setLevel(logging.DEBUG)
        log.propagate = False  # counted here, not printed
        log.addHandler(handler)
    try:
        yield handler.counts
    finally:
        for log, (level, propagate) in zip(loggers, saved):
            log.removeHandler(handler)
            log.setLevel(level)
            log.propagate = propagate


def _code_report(code: list[str]) -> dict:
    """What inductor's generated code for the forward's graphs holds."""
    partitions = []
    for source in code:
        found = _PARTITIONS.search(source)
        partitions.append(len([p for p in found.group(1).split(",") if p.strip()]) if found else 0)
    calls = [found for source in code for found in _COCODIFF_OP.findall(source)]
    return {"graphs": len(code), "partitions_per_graph": partitions, "partitions": sum(partitions),
            "cocodiff_ops": dict(collections.Counter(calls)),
            "host_reads": [line.strip() for source in code for line in source.splitlines() if _HOST_READ.search(line)]}


def run_config(config: str, spec: Spec, double: int, single: int, device: torch.device, dtype: torch.dtype,
               warmup: int, reps: int) -> dict:
    """One configuration, compiled as xDiT compiles FLUX, ``warmup + reps + 1`` forwards in one request."""
    from xfuser.model_executor.models.runner_models.base_model import xFuserModel

    from cocodiff_xfuser import commstats
    from cocodiff_xfuser.xfuser import activation

    _use(config)
    compat.torch_private("torch._dynamo", "reset")()
    counters = compat.torch_private("torch._dynamo.utils", "counters")
    counters.clear()
    code: list[str] = []
    lowering = compat.torch_private("torch._inductor.graph", "GraphLowering")
    lowering.save_output_code = code.append
    model = _model(spec, double, single, device, dtype)
    inputs = _inputs(spec, device, dtype)
    compiled = torch.compile(model, mode="reduce-overhead")
    pipe = _Pipe(lambda: _forwards(compiled, inputs, device, dtype, warmup, reps))
    # As xDiT's runner compiles: cocodiff adapts the model (its processors, V-Major's context on the
    # pipeline, the graphs' counts replayed per call), then xDiT turns its overlap passes on.
    activation._adapt(pipe, [model])
    xFuserModel._enable_compute_comm_overlap(None)  # it reads no state
    commstats.reset_ran()
    try:
        with _cudagraphs_log() as log:
            timed = pipe()
    finally:
        lowering.save_output_code = None
    blocks = double + single
    ran = commstats.ran()
    if config != "stock" and not ran["exchanges"]:  # a row of stock's exchanges under cocodiff's name
        raise RuntimeError("no cocodiff exchange ran: xfuser's exchange is not routed to it (is cocodiff_xfuser.pth "
                           "in site-packages?)")
    return {
        "name": config,
        "forwards": warmup + reps + 1,
        "host_s_per_block": statistics.median(timed["host_s"]) / blocks,
        "device_s_per_block": statistics.median(timed["device_s"]) / blocks if timed["device_s"] else None,
        "host_s": timed["host_s"], "device_s": timed["device_s"],
        "graph_calls_per_forward": timed["graph_calls"], "cuda_graph_launches_per_forward": timed["cuda_graph_launches"],
        "device_kernels_per_forward": timed["device_kernels"],
        **_code_report(code),
        "graph_breaks": {reason.splitlines()[0]: n for reason, n in counters["graph_break"].items()},
        "frames": counters["frames"]["total"],
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        "cudagraphs_log": dict(log),
        "ran": {**{key: ran[key] for key in ("exchanges", "labels", "v_first_calls", "fallbacks", "v_major_sparse", "kernels")},
                "v_major_tokens": {key: ran["v_major"].get(key, 0) for key in ("active", "tokens")}},
    }


def _versions(device: torch.device) -> dict:
    found = {"torch": torch.__version__, "cuda": torch.version.cuda, "xfuser": compat.xfuser_version(),
             "diffusers": importlib.metadata.version("diffusers"), "device": str(device)}
    if device.type == "cuda":
        found["gpu"] = torch.cuda.get_device_name(device)
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            found["driver"] = smi.stdout.split("\n")[0].strip() or None
        except (OSError, subprocess.TimeoutExpired):
            found["driver"] = None
    return found


def run(configs: tuple[str, ...], tiny: bool, double: int, single: int, device: torch.device, warmup: int, reps: int,
        out: Path | None = None) -> dict:
    """Every configuration in this process (over the fake world it creates); with ``out``, the report
    written there after each one."""
    spec = SPECS["tiny" if tiny else "flux-dev"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    _fake_world()
    _xfuser(spec.text)
    _echo_point_to_point()
    report = {"model": "tiny" if tiny else "flux-dev", "spec": asdict(spec), "double_blocks": double, "single_blocks": single,
              "world": WORLD, "ulysses": WORLD, "topology": TOPOLOGY, "dtype": str(dtype).removeprefix("torch."),
              "warmup": warmup, "reps": reps, "versions": _versions(device), "configs": []}
    for config in configs:
        try:
            row = run_config(config, spec, double, single, device, dtype, warmup, reps)
        except Exception as e:  # noqa: BLE001 - one run on a lent GPU: a configuration that fails leaves the others
            row = {"name": config, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        report["configs"].append(row)
        if out is not None:
            out.write_text(json.dumps(report, indent=1) + "\n")
    return report


def print_report(report: dict) -> None:
    print(f"cocodiff bench graphs: {report['model']} ({report['double_blocks']} double + {report['single_blocks']} single "
          f"blocks), rank 0 of Ulysses {report['ulysses']} (fake process group, topology {report['topology']}), "
          f"{report['dtype']}, {report['versions'].get('gpu', report['versions']['device'])}, torch {report['versions']['torch']}")
    print(f"{'configuration':<24} {'graphs':>6} {'parts':>6} {'breaks':>6} {'skips':>5} {'calls/fw':>8} {'cg/fw':>5} "
          f"{'ops':>4} {'reads':>5} {'host us/block':>13} {'device us/block':>15}")
    for row in report["configs"]:
        if "error" in row:
            print(f"{row['name']:<24} failed: {row['error']}")
            continue
        device = f"{row['device_s_per_block'] * 1e6:15.1f}" if row["device_s_per_block"] is not None else f"{'-':>15}"
        print(f"{row['name']:<24} {row['graphs']:6d} {row['partitions']:6d} {sum(row['graph_breaks'].values()):6d} "
              f"{row['cudagraph_skips']:5d} {row['graph_calls_per_forward']:8d} {row['cuda_graph_launches_per_forward']:5d} "
              f"{sum(row['cocodiff_ops'].values()):4d} {len(row['host_reads']):5d} {row['host_s_per_block'] * 1e6:13.1f} {device}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiny", action="store_true", help="a tiny FLUX (8 heads x 16, 64 image and 16 text tokens), for CPU")
    p.add_argument("--double", type=int, default=2, help="double-stream blocks")
    p.add_argument("--single", type=int, default=2, help="single-stream blocks")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of " + ", ".join(CONFIGS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="forwards before the timed ones (compile, "
                   "CUDA graph recording, V-Major's exact first steps)")
    p.add_argument("--reps", type=int, default=DEFAULT_REPS, help="timed forwards")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the report here (after each configuration)")


def run_cli(args: argparse.Namespace) -> int:
    configs = tuple(c.strip() for c in args.configs.split(","))
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"--configs: {', '.join(unknown)} not among {', '.join(CONFIGS)}")
    if min(args.double, args.single, args.warmup) < 0 or args.double + args.single == 0 or args.reps < 1:
        raise ValueError("--double, --single: at least one block between them; --reps: at least 1; none negative")
    report = run(configs, args.tiny, args.double, args.single, torch.device(args.device), args.warmup, args.reps, args.json)
    print_report(report)
    return 1 if any("error" in row for row in report["configs"]) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cocodiff bench graphs", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_cli(args)
    except ValueError as e:
        print(f"cocodiff bench graphs: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
