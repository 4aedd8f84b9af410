"""``cocodiff bench kernels``: one rank's compute per attention layer at a real model's size, and
V-Major's per-layer work beside it, on this machine's accelerator (or CPU).

What one GPU can show of a multi-rank job: the planner prices a layer's compute as FLOPs at an
assumed TFLOP/s (:func:`cocodiff_xfuser.tools.plan.layer_flops`); this measures the same layer
shape per Ulysses degree U (projections and MLP on the rank's ``S/U`` tokens, attention over all
``S`` tokens with ``H/U`` heads) and reports the TFLOP/s it achieved. V-Major's added work per
layer at its defaults (the budget policy's ranking of tokens by change, then per gated tensor the
residual encode of the tokens it sends and the receiver's apply) is timed on the V a rank holds at that size, with the plain fp8
exchange's pack/unpack beside it, so the report says what share of the layer's compute V-Major
adds. The exchanges themselves need several ranks (``bench a2a`` / ``bench e2e``).

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
from cocodiff_xfuser.settings import VMajorSettings
from cocodiff_xfuser.tools.plan import MODELS, TFLOPS, layer_flops
from cocodiff_xfuser.vmajor import policy

DEFAULT_REPS = 20
#: V-Major's budget policy's share of tokens sent per step at which its encode is timed (a typical
#: middle step; the report also times every token, as the policy sends at its first steps).
SENT_SHARE = 0.3
#: Tensors V-Major's decision gates per layer, by scope (Q, K, V in; the attention output back).
GATED = {"v": 1, "qkv": 3, "qkvo": 4}


def _timer(device: torch.device, graph: bool) -> Callable[[Callable[[], object], int], float]:
    """Median seconds of ``fn`` over ``reps`` runs after two warm-ups. On a GPU, timed with CUDA
    events; with ``graph``, ``fn`` is captured once in a CUDA graph and its replay is timed: the
    GPU's own time, without the host's kernel launches (what a compiled or graphed model pays)."""
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
                samples.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                run()
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)
    return timed


def layer(model: str, size: int, ulysses: int, device: torch.device, dtype: torch.dtype, reps: int, graph: bool,
          settings: VMajorSettings) -> dict:
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

        # V as V-Major sees it: destination-major [W, 1, b, h/W, s, d] of this rank's tokens.
        w = ulysses
        shape = (w, 1, 1, spec.heads // w, s_local, d)
        v_rank, reference = rand(*shape), rand(*shape)
        reference = v_rank + 0.02 * reference  # the copy from the last step: close to V
        held = reference.clone()
        sent = torch.arange(s_local - math.ceil(SENT_SHARE * s_local), s_local, device=device)
        every = torch.arange(s_local, device=device)
        rank_s = timed(lambda: policy.share_needed(policy.squared_change(v_rank, reference), v_rank, settings.rule.error), reps)
        ref = reference.clone()
        encode_s = timed(lambda: residuals.encode(v_rank, ref, sent, 4, settings.residual), reps)
        payload = residuals.encode(v_rank, reference.clone(), sent, 4, settings.residual)
        apply_s = timed(lambda: residuals.apply(held, payload, sent, 4, settings.residual is not None), reps)
        encode_all_s = timed(lambda: residuals.encode(v_rank, ref, every, 4, settings.residual), reps)
        rows = v_rank.reshape(w, -1, d)
        packed = compress.pack(rows)
        fp8_s = timed(lambda: compress.pack(rows), reps) + timed(lambda: compress.unpack(packed, rows.shape[1], d, dtype), reps)

    flops = layer_flops(spec, s, s_local)
    compute_s = proj_s + attn_s
    vmajor_s = rank_s + gated * (encode_s + apply_s)
    return {
        "ulysses": ulysses, "gated_tensors": gated, "tokens": s, "tokens_local": s_local, "heads_local": h,
        "projections_s": proj_s, "attention_s": attn_s, "compute_s": compute_s,
        "achieved_tflops": flops / compute_s / 1e12, "layer_flops": flops,
        # The planner's V-First window: the Q/K projections' share of the layer's FLOPs.
        "v_first_window_s": window_s, "planner_window_s": compute_s * 4 * width / (24 * width + 4 * s),
        "v_major_rank_s": rank_s, "v_major_encode_s": encode_s, "v_major_apply_s": apply_s,
        "v_major_s": vmajor_s, "v_major_share_of_compute": vmajor_s / compute_s,
        "v_major_encode_every_token_s": encode_all_s, "fp8_pack_unpack_s": fp8_s,
    }


def run(model: str, size: int, ulyssess: list[int], device: torch.device, dtype: torch.dtype, reps: int) -> dict:
    """Every degree's layer, launched kernel by kernel, and on a GPU also replayed from CUDA graphs."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    modes = (False, True) if device.type == "cuda" else (False,)
    settings = VMajorSettings.load()  # V-Major's defaults
    rows = [{**layer(model, size, u, device, dtype, reps, graph, settings), "graph": graph} for graph in modes for u in ulyssess]
    return {"model": model, "size": size, "device": name, "dtype": str(dtype).removeprefix("torch."),
            "torch": torch.__version__, "reps": reps, "sent_share": SENT_SHARE, "v_major": settings.describe(),
            "planner_assumed_tflops": TFLOPS, "layers": MODELS[model].layers, "rows": rows}


def print_report(rep: dict) -> None:
    print(f"{rep['model']} at {rep['size']}px, {rep['dtype']}, {rep['device']} (torch {rep['torch']}), "
          f"median of {rep['reps']}; the planner assumes {rep['planner_assumed_tflops']} TFLOP/s")
    print(f"{'launch':>6} {'U':>3} {'tokens':>7} {'proj ms':>8} {'attn ms':>8} {'TFLOP/s':>8} {'window':>7} {'model':>7} {'V-Major ms':>10} {'of layer':>8} "
          f"{'rank':>7} {'encode':>7} {'apply':>7} {'enc all':>7} {'fp8 p+u':>7}")
    for r in rep["rows"]:
        print(f"{'graph' if r['graph'] else 'eager':>6} {r['ulysses']:3d} {r['tokens_local']:7d} {r['projections_s'] * 1e3:8.3f} {r['attention_s'] * 1e3:8.3f} "
              f"{r['achieved_tflops']:8.1f} {r['v_first_window_s'] * 1e3:7.3f} {r['planner_window_s'] * 1e3:7.3f} {r['v_major_s'] * 1e3:10.3f} {r['v_major_share_of_compute']:8.1%} "
              f"{r['v_major_rank_s'] * 1e3:7.3f} {r['v_major_encode_s'] * 1e3:7.3f} {r['v_major_apply_s'] * 1e3:7.3f} "
              f"{r['v_major_encode_every_token_s'] * 1e3:7.3f} {r['fp8_pack_unpack_s'] * 1e3:7.3f}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=sorted(MODELS), default="flux-dev")
    p.add_argument("--size", type=int, default=1024, help="image height and width")
    p.add_argument("--ulysses", default="1,2,4,8", help="Ulysses degrees, comma-separated")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--reps", type=int, default=DEFAULT_REPS)
    p.add_argument("--out", default=None, help="also write the report as JSON here")


def run_cli(args: argparse.Namespace) -> int:
    try:
        degrees = [int(u) for u in args.ulysses.split(",")]
    except ValueError:
        raise ValueError(f"--ulysses: comma-separated integers, not {args.ulysses!r}") from None
    rep = run(args.model, args.size, degrees, torch.device(args.device), getattr(torch, args.dtype), args.reps)
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
