"""``cocodiff bench kernels``: one rank's compute per attention layer at a real model's size, and
V-Major's per-layer work beside it, on this machine's accelerator (or CPU).

What one GPU can show of a multi-rank job: the planner prices a layer's compute as FLOPs at an
assumed TFLOP/s (:func:`cocodiff_xfuser.tools.plan.layer_flops`); this measures the same layer
shape per Ulysses degree U (projections and MLP on the rank's ``S/U`` tokens, attention over all
``S`` tokens with ``H/U`` heads) and reports the TFLOP/s it achieved. V-Major's added work per
layer at its defaults (the policy's ranking of tokens by change; for every gated tensor at once,
the residual encode of the tokens it sends to the ranks on the other node of two, and the
receiver's apply) is timed on the V a rank holds at that size, with the plain fp8 exchange's
pack/unpack beside it, so the report says what share of the layer's compute V-Major adds, and
beside its floor: the bytes that work must move (:func:`v_major_bytes`) over the device's memory
bandwidth. The report also says whether the Triton kernels write the torch reference's bytes
(compiled on a GPU, interpreted on a CPU). The exchanges themselves need several ranks
(``bench a2a`` / ``bench e2e``).

Run without xfuser: ``python -m cocodiff_xfuser.tools.bench.kernels --model flux-dev --size 1024``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from cocodiff_xfuser.comm import compress, residuals
from cocodiff_xfuser.settings import RESIDUAL_DTYPES, Budget, Threshold, VMajorSettings
from cocodiff_xfuser.tools import kernel_check
from cocodiff_xfuser.tools.plan import MODELS, TFLOPS, device_memory_bps, layer_flops
from cocodiff_xfuser.vmajor import policy

DEFAULT_REPS = 20
#: V-Major's budget policy's share of tokens sent per step at which its encode is timed (a typical
#: middle step; the report also times every token, as the policy sends at its first steps).
SENT_SHARE = 0.3
#: Tensors V-Major's decision gates per layer, by scope (Q, K, V in; the attention output back).
GATED = {"v": 1, "qkv": 3, "qkvo": 4}
#: Calls of a function per CUDA graph timed: a replay's own start is the graph's, not the layer's,
#: so it is spread over as many calls as a few layers make.
GRAPH_CALLS = 20


def _timer(device: torch.device, graph: bool) -> Callable[[Callable[[], object], int], float]:
    """Median seconds of ``fn`` over ``reps`` runs after two warm-ups. On a GPU, timed with CUDA
    events; with ``graph``, :data:`GRAPH_CALLS` calls of ``fn`` are captured in one CUDA graph and
    its replay is timed, per call: the GPU's own time, without the host's kernel launches or a
    replay's own start (what a layer inside a compiled or graphed model pays)."""
    def timed(fn: Callable[[], object], reps: int) -> float:
        run = fn
        if graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                for _ in range(GRAPH_CALLS):
                    fn()
            run = captured.replay
        for _ in range(2):
            run()
        samples = []
        for _ in range(reps):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3 / (GRAPH_CALLS if graph else 1))
            else:
                t0 = time.perf_counter()
                run()
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)
    return timed


def v_major_bytes(values: int, value_bytes: int, gated: int, sent: float, crossing: float, payload_per_value: float) -> float:
    """What V-Major's work per layer must move through memory at least: V and its reference read
    once to rank the tokens; per gated tensor (``values`` of ``value_bytes`` each), for the ``sent``
    share of the tokens of the ``crossing`` share of the chunks (those for ranks on other nodes),
    the encode reads the rows and their reference and writes the reference and the payload, the
    receiver's apply reads its copy and the payload and writes its copy (``payload_per_value``:
    bytes per value on the wire)."""
    encoded = gated * sent * crossing * values
    return 2 * values * value_bytes + encoded * (5 * value_bytes + 2 * payload_per_value)


def _crossing(w: int) -> int:
    """The chunks of a Ulysses degree ``w`` that go to the other node of 2 (the ring's one peer at U=1)."""
    return max(w // 2, 1)


def memory_bandwidth(device: torch.device) -> tuple[float, str]:
    """The device's memory bandwidth (bytes/s) and where it comes from: the published figure of a
    known GPU, else a timed copy of 256 MiB (read and written)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = device_memory_bps(name)
        if known is not None:
            return known, f"published, {name}"
    src = torch.empty(2**28, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _timer(device, False)(lambda: dst.copy_(src), 5)
    return 2 * src.numel() / seconds, "measured: a 256 MiB copy"


def layer(model: str, size: int, ulysses: int, device: torch.device, dtype: torch.dtype, reps: int, graph: bool,
          settings: VMajorSettings, memory_bps: float) -> dict:
    """One rank's attention layer at Ulysses degree ``ulysses``, and V-Major's work on its V (as
    launched one kernel at a time, or with ``graph`` replayed from a CUDA graph)."""
    spec = MODELS[model]
    image, text = spec.tokens(size)
    s = image + text
    if s % ulysses or spec.heads % ulysses:
        raise ValueError(f"{model} at {size}px: {s} tokens and {spec.heads} heads must divide by ulysses={ulysses}")
    h, d = spec.heads // ulysses, spec.head_dim
    width = spec.heads * d
    s_local = s // ulysses
    gated = GATED[settings.scope]
    timed = _timer(device, graph)
    residual = settings.residual or torch.float8_e4m3fn  # V-Major's work is timed on residuals
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    x = rand(1, s_local, width)
    qkv_w, out_w = rand(3 * width, width) / width**0.5, rand(width, width) / width**0.5
    up_w, down_w = rand(4 * width, width) / width**0.5, rand(width, 4 * width) / (4 * width) ** 0.5
    q, k, v = (rand(1, h, s, d) for _ in range(3))  # after the input exchange: all tokens, H/U heads
    qk_w, norm_w = rand(2 * width, width) / width**0.5, rand(d)
    cos, sin = rand(s_local, 1, d), rand(s_local, 1, d)

    def v_first_window() -> torch.Tensor:
        """What V-First's early V exchange hides behind: Q/K projection, per-head RMS norm, RoPE."""
        qk = F.rms_norm(F.linear(x, qk_w).view(1, s_local, 2 * spec.heads, d), (d,), norm_w)  # [1, s/U, 2H, d]
        pairs = qk.unflatten(-1, (d // 2, 2))  # [1, s/U, 2H, d/2, 2]: RoPE rotates channel pairs
        rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        return (qk * cos + rotated * sin).sum()

    def projections() -> torch.Tensor:
        y = F.linear(x, out_w) + F.linear(F.gelu(F.linear(x, up_w)), down_w)
        return F.linear(x, qkv_w).sum() + y.sum()

    with torch.no_grad():
        proj_s = timed(projections, reps)
        attn_s = timed(lambda: F.scaled_dot_product_attention(q, k, v), reps)
        window_s = timed(v_first_window, reps)

        # V as V-Major sees it: destination-major [W, 1, b, h/W, s, d] of this rank's tokens, and
        # every gated tensor's chunks for the ranks on the other node (of 2) joined along dim 1.
        w = ulysses
        shape = (w, 1, 1, spec.heads // w, s_local, d)
        v_rank = rand(*shape)
        reference = v_rank + 0.02 * rand(*shape)  # the copy from the last step: close to V
        crossing = (_crossing(w), gated, 1, spec.heads // w, s_local, d)
        gated_x = rand(*crossing)
        gated_ref = gated_x + 0.02 * rand(*crossing)
        held = gated_ref.clone()
        k = math.ceil(SENT_SHARE * s_local)
        every = torch.arange(s_local, device=device)

        def ranked() -> torch.Tensor:
            """The tokens to send and their mask, as policy.decide chooses them (no host read)."""
            rule = settings.rule
            change = ranks = None
            if isinstance(rule, (Budget, Threshold)):
                change, _, ranks = policy.measure(rule, v_rank, reference, 4, (0, 1, 3, 5))
            if ranks is None:
                change = policy.token_change(rule.metric, v_rank, reference, 4, (0, 1, 3, 5)) if change is None else change
                ranks, _ = policy.rank(change)
            return policy.top(ranks, k)[0]

        sent = ranked()
        rank_s = timed(ranked, reps)
        ref = gated_ref.clone()
        encode_s = timed(lambda: residuals.encode(gated_x, ref, sent, 4, residual), reps)
        payload = residuals.encode(gated_x, gated_ref.clone(), sent, 4, residual)
        apply_s = timed(lambda: residuals.apply(held, payload, sent, 4, True), reps)
        encode_all_s = timed(lambda: residuals.encode(gated_x, ref, every, 4, residual), reps)
        rows = v_rank.reshape(w, -1, d)
        packed = compress.pack(rows)
        fp8_s = timed(lambda: compress.pack(rows), reps) + timed(lambda: compress.unpack(packed, rows.shape[1], d, dtype), reps)

    flops = layer_flops(spec, s, s_local)
    compute_s = proj_s + attn_s
    vmajor_s = rank_s + encode_s + apply_s
    moved = v_major_bytes(s_local * spec.heads * d, v_rank.element_size(), gated, k / s_local, _crossing(w) / w,
                          residuals.row_bytes(d, residual) / d)
    return {
        "ulysses": ulysses, "gated_tensors": gated, "tokens": s, "tokens_local": s_local, "heads_local": h,
        "projections_s": proj_s, "attention_s": attn_s, "compute_s": compute_s,
        "achieved_tflops": flops / compute_s / 1e12, "layer_flops": flops,
        # The planner's V-First window: the Q/K projections' share of the layer's FLOPs.
        "v_first_window_s": window_s, "planner_window_s": compute_s * 4 * width / (24 * width + 4 * s),
        "v_major_rank_s": rank_s, "v_major_encode_s": encode_s, "v_major_apply_s": apply_s,
        "v_major_s": vmajor_s, "v_major_share_of_compute": vmajor_s / compute_s,
        "v_major_bytes": moved, "v_major_floor_s": moved / memory_bps,
        "v_major_encode_every_token_s": encode_all_s, "fp8_pack_unpack_s": fp8_s,
    }


def run(model: str, size: int, ulyssess: list[int], device: torch.device, dtype: torch.dtype, reps: int,
        residual_dtype: str | None = None) -> dict:
    """Every degree's layer, launched kernel by kernel, and on a GPU also replayed from CUDA graphs."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    modes = (False, True) if device.type == "cuda" else (False,)
    settings = VMajorSettings.load(residual_dtype=residual_dtype)  # V-Major's defaults, but for the residual
    memory_bps, memory_source = memory_bandwidth(device)
    rows = [{**layer(model, size, u, device, dtype, reps, graph, settings, memory_bps), "graph": graph}
            for graph in modes for u in ulyssess]
    check = kernel_check.compare(device) if device.type != "cpu" else kernel_check.interpreted()
    return {"model": model, "size": size, "device": name, "dtype": str(dtype).removeprefix("torch."),
            "torch": torch.__version__, "reps": reps, "sent_share": SENT_SHARE, "v_major": settings.describe(),
            "memory_bps": memory_bps, "memory_bps_source": memory_source,
            "triton_matches_reference": check["triton_matches_reference"], "triton_check": check,
            "planner_assumed_tflops": TFLOPS, "layers": MODELS[model].layers, "rows": rows}


def print_report(rep: dict) -> None:
    print(f"{rep['model']} at {rep['size']}px, {rep['dtype']}, {rep['device']} (torch {rep['torch']}), "
          f"median of {rep['reps']}; the planner assumes TFLOP/s of "
          + ", ".join(f"{k} {v:g}" for k, v in rep["planner_assumed_tflops"].items()))
    print(f"{'launch':>6} {'U':>3} {'tokens':>7} {'proj ms':>8} {'attn ms':>8} {'TFLOP/s':>8} {'window':>7} {'model':>7} {'V-Major ms':>10} {'of layer':>8} "
          f"{'rank':>7} {'encode':>7} {'apply':>7} {'enc all':>7} {'fp8 p+u':>7} {'floor':>7} {'x floor':>7}")
    for r in rep["rows"]:
        print(f"{'graph' if r['graph'] else 'eager':>6} {r['ulysses']:3d} {r['tokens_local']:7d} {r['projections_s'] * 1e3:8.3f} {r['attention_s'] * 1e3:8.3f} "
              f"{r['achieved_tflops']:8.1f} {r['v_first_window_s'] * 1e3:7.3f} {r['planner_window_s'] * 1e3:7.3f} {r['v_major_s'] * 1e3:10.3f} {r['v_major_share_of_compute']:8.1%} "
              f"{r['v_major_rank_s'] * 1e3:7.3f} {r['v_major_encode_s'] * 1e3:7.3f} {r['v_major_apply_s'] * 1e3:7.3f} "
              f"{r['v_major_encode_every_token_s'] * 1e3:7.3f} {r['fp8_pack_unpack_s'] * 1e3:7.3f} "
              f"{r['v_major_floor_s'] * 1e3:7.3f} {r['v_major_s'] / r['v_major_floor_s']:7.1f}")
    print(f"V-Major's floor: the bytes its work moves at {rep['memory_bps'] / 1e9:.0f} GB/s ({rep['memory_bps_source']}); "
          f"Triton kernels match the torch reference: {rep['triton_matches_reference']}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=sorted(MODELS), default="flux-dev")
    p.add_argument("--size", type=int, default=1024, help="image height and width")
    p.add_argument("--ulysses", default="1,2,4,8", help="Ulysses degrees, comma-separated")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--reps", type=int, default=DEFAULT_REPS)
    p.add_argument("--residual-dtype", choices=[d for d in RESIDUAL_DTYPES if d != "none"], default=None,
                   help="V-Major's residual (default: V-Major's default)")
    p.add_argument("--out", default=None, help="also write the report as JSON here")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object instead of a table")


def run_cli(args: argparse.Namespace) -> int:
    try:
        degrees = [int(u) for u in args.ulysses.split(",")]
    except ValueError:
        raise ValueError(f"--ulysses: comma-separated integers, not {args.ulysses!r}") from None
    rep = run(args.model, args.size, degrees, torch.device(args.device), getattr(torch, args.dtype), args.reps, args.residual_dtype)
    if args.json:
        print(json.dumps(rep))
    else:
        print_report(rep)
    if args.out:
        Path(args.out).write_text(json.dumps(rep, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cocodiff bench kernels", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_cli(args)
    except ValueError as e:
        print(f"cocodiff bench kernels: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
