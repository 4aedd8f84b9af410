"""V-Major's per-token change as two fused Triton kernels (one source for CUDA and XPU): the
integer sums of :func:`.policy.integer_sums` for two quantities at once (the squared change and
the reference's or V's squared norm, or the absolute change), over every element of a token's
row but one kept dim (the batch).

``amax`` finds each quantity's largest element (as the bits of a non-negative float, whose order is
the integers'), which fixes its power-of-two scale; ``sums`` floors every element at that scale to
an integer and sums each token's (and batch's) row. Integer sums are exact in any order, so the
kernels and the torch reference agree to the bit (tested under ``TRITON_INTERPRET=1``, which
must be set before triton is first imported) and no CPU test is left guessing which tokens a GPU
ranks first.
"""

from __future__ import annotations

import math

import torch

from cocodiff_xfuser import commstats
from cocodiff_xfuser.comm import residual_kernels

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU hosts without triton run the torch reference
    triton = None

#: The quantities, per element of V (``x``) and its reference: codes the kernels read.
KINDS = {"squared change": 0, "absolute change": 1, "squared reference": 2, "squared value": 3}
#: Launch shapes (elements per program of the largest-element pass, rows of a token per step of
#: its sums, warps of each), chosen on an H200 (docs/benchmarks.md, "On one GPU").
AMAX_BLOCK, AMAX_WARPS, SUMS_ROWS, SUMS_WARPS = 16384, 4, 8, 4


def usable(x: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether the kernels run: where the residual kernels do (triton present, an accelerator or
    the interpreter, both contiguous in float32 or bf16)."""
    return residual_kernels.usable(x, reference)


def sums(kinds: tuple[str, str], x: torch.Tensor, reference: torch.Tensor, dims: tuple[int, ...]
         ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each of the two ``kinds``, the integer sums over ``dims`` (every dim but the token dim,
    the second-to-last, and at most one other) and their scale, as :func:`.policy.integer_sums`
    gives them; two launches in all."""
    *outer, s, d = x.shape
    kept = [i for i in range(len(outer)) if i not in dims]
    if len(kept) > 1 or x.dim() - 1 not in dims:
        raise ValueError(f"change sums keep the token dim and at most one other, not {kept}")
    groups = outer[kept[0]] if kept else 1
    before = math.prod(outer[: kept[0]]) if kept else 1
    inner = math.prod(outer[kept[0] + 1:]) if kept else math.prod(outer)
    bits = torch.zeros(2, dtype=torch.int32, device=x.device)
    codes = [KINDS[k] for k in kinds]
    commstats.count_kernel("change sums")
    _amax[(triton.cdiv(x.numel(), AMAX_BLOCK),)](x, reference, bits, x.numel(), A=codes[0], B=codes[1], BLOCK=AMAX_BLOCK,
                                                 num_warps=AMAX_WARPS)
    out = torch.empty(2, groups, s, dtype=torch.int64, device=x.device)
    scales = torch.empty(2, dtype=torch.float64, device=x.device)
    block_d = min(triton.next_power_of_2(d), 256)
    _sums[(groups, s)](x, reference, bits, out, scales, s, d, inner, groups, before, 62 - x.numel().bit_length(),
                       A=codes[0], B=codes[1], BLOCK_I=min(triton.next_power_of_2(inner), SUMS_ROWS), BLOCK_D=block_d,
                       num_warps=SUMS_WARPS)
    shape = [groups, s] if kept else [s]
    return [(out[i].view(shape), scales[i]) for i in range(2)]


def _jit(fn):
    return fn if triton is None else triton.jit(fn)


@_jit
def _value(x, ref, KIND: tl.constexpr):
    """One quantity per element (float32), as the torch reference computes it."""
    if KIND == 0:
        diff = x - ref
        return diff * diff
    if KIND == 1:
        return tl.abs(x - ref)
    if KIND == 2:
        return ref * ref
    return x * x


@_jit
def _amax(x_ptr, ref_ptr, bits_ptr, N, A: tl.constexpr, B: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < N
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    ref = tl.load(ref_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    tl.atomic_max(bits_ptr, tl.max(_value(x, ref, A), axis=0).to(tl.int32, bitcast=True))
    tl.atomic_max(bits_ptr + 1, tl.max(_value(x, ref, B), axis=0).to(tl.int32, bitcast=True))


@_jit
def _sums(x_ptr, ref_ptr, bits_ptr, out_ptr, scales_ptr, S, D, INNER, GROUPS, BEFORE, TOP, A: tl.constexpr,
          B: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr):
    g, t = tl.program_id(0), tl.program_id(1)
    # Each quantity's shift = TOP - the exponent of its largest element; its sums are at 2**shift
    # (float64, exact), and 2**-shift is their scale.
    shift_a = TOP - (((tl.load(bits_ptr) >> 23) & 0xFF) - 126)
    shift_b = TOP - (((tl.load(bits_ptr + 1) >> 23) & 0xFF) - 126)
    up_a = ((1023 + shift_a).to(tl.int64) << 52).to(tl.float64, bitcast=True)
    up_b = ((1023 + shift_b).to(tl.int64) << 52).to(tl.float64, bitcast=True)
    if (g == 0) & (t == 0):
        tl.store(scales_ptr, ((1023 - shift_a).to(tl.int64) << 52).to(tl.float64, bitcast=True))
        tl.store(scales_ptr + 1, ((1023 - shift_b).to(tl.int64) << 52).to(tl.float64, bitcast=True))
    acc_a = tl.full([], 0, tl.int64)
    acc_b = tl.full([], 0, tl.int64)
    rows = tl.arange(0, BLOCK_I)
    cols = tl.arange(0, BLOCK_D)
    for a in range(BEFORE):
        for i0 in range(0, INNER, BLOCK_I):
            o = (a * GROUPS + g).to(tl.int64) * INNER + i0 + rows  # [BLOCK_I] rows of [outer, S, D]
            for d0 in range(0, D, BLOCK_D):
                inside = ((i0 + rows) < INNER)[:, None] & ((d0 + cols) < D)[None, :]
                offs = (o[:, None] * S + t) * D + d0 + cols[None, :]
                x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
                ref = tl.load(ref_ptr + offs, mask=inside, other=0.0).to(tl.float32)
                acc_a += tl.sum(tl.floor(_value(x, ref, A).to(tl.float64) * up_a).to(tl.int64))
                acc_b += tl.sum(tl.floor(_value(x, ref, B).to(tl.float64) * up_b).to(tl.int64))
    tl.store(out_ptr + g * S + t, acc_a)
    tl.store(out_ptr + (GROUPS + g) * S + t, acc_b)

