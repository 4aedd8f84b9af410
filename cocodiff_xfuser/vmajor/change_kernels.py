"""V-Major's per-token change as two fused Triton kernels (one source for CUDA and XPU): the
integer sums of :func:`.policy.integer_sums` for two quantities at once (the squared change and
the reference's or V's squared norm, or the absolute change), over every element of a token's
row but one kept dim (the batch).

``sums`` reads each token's (and batch's) row once from memory: its largest element of each
quantity (as the bits of a non-negative float, whose order is the integers') fixes the row's
power-of-two scale, at which every element is floored to an integer and summed. ``common`` brings
every row's sum to the scale of the row with the largest element (a right shift, a floor). Integer
sums are exact in any order, so the kernels and the torch reference agree to the bit (tested under
``TRITON_INTERPRET=1``, which must be set before triton is first imported) and no CPU test is left
guessing which tokens a GPU ranks first.
"""

from __future__ import annotations

import math

import torch

from cocodiff_xfuser.comm import residual_kernels
from cocodiff_xfuser.comm.residual_kernels import next_power_of_2

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU hosts without triton run the torch reference
    triton = None

#: The quantities, per element of V (``x``) and its reference: codes the kernels read.
KINDS = {"squared change": 0, "absolute change": 1, "squared reference": 2, "squared value": 3}
#: Launch shapes (rows of a token per step of its sums and their warps, sums brought to one scale
#: per step), chosen on an H200 (docs/benchmarks.md, "On one GPU").
SUMS_ROWS, SUMS_WARPS, COMMON_BLOCK = 8, 4, 1024


def usable(x: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether the kernels run: where the residual kernels do (triton present, an accelerator or
    the interpreter, both contiguous in float32 or bf16)."""
    return residual_kernels.usable(x, reference)


def sums(kinds: tuple[str, str], x: torch.Tensor, reference: torch.Tensor, dims: tuple[int, ...]
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """For the two ``kinds``, the integer sums over ``dims`` (every dim but the token dim, the
    second-to-last, and at most one other) and their scales, as :func:`.policy.integer_sums` gives
    them (int64 ``[2, ...]``, float64 ``[2]``); two launches in all: one pass over ``x`` and
    ``reference`` for every sum at its own scale, then one program per quantity bringing them to one."""
    *outer, s, d = x.shape
    kept = [i for i in range(len(outer)) if i not in dims]
    if len(kept) > 1 or x.dim() - 1 not in dims:
        raise ValueError(f"change sums keep the token dim and at most one other, not {kept}")
    groups = outer[kept[0]] if kept else 1
    before = math.prod(outer[: kept[0]]) if kept else 1
    inner = math.prod(outer[kept[0] + 1:]) if kept else math.prod(outer)
    codes = [KINDS[k] for k in kinds]
    own = torch.empty(2, groups * s, dtype=torch.int64, device=x.device)
    exponents = torch.empty(2, groups * s, dtype=torch.int32, device=x.device)
    top = 62 - x.numel().bit_length()
    residual_kernels.launchable(_sums)[(groups, s)](
        x, reference, own, exponents, s, d, inner, groups, before, top, A=codes[0], B=codes[1],
        BLOCK_I=min(next_power_of_2(inner), SUMS_ROWS), BLOCK_D=min(next_power_of_2(d), 256), num_warps=SUMS_WARPS)
    out = torch.empty(2, *([groups, s] if kept else [s]), dtype=torch.int64, device=x.device)
    scales = torch.empty(2, dtype=torch.float64, device=x.device)
    residual_kernels.launchable(_common)[(2,)](own, exponents, out, scales, groups * s, top,
                                               BLOCK=min(next_power_of_2(groups * s), COMMON_BLOCK))
    return out, scales


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
def _sums(x_ptr, ref_ptr, own_ptr, exps_ptr, S, D, INNER, GROUPS, BEFORE, TOP, A: tl.constexpr, B: tl.constexpr,
          BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr):
    g, t = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_I)
    cols = tl.arange(0, BLOCK_D)
    # This sum's elements, read twice (the second time from cache): first their largest, which
    # fixes their scale 2**(TOP - e) (float64, exact), then floored at it and summed.
    largest_a = tl.full([], 0.0, tl.float32)
    largest_b = tl.full([], 0.0, tl.float32)
    for a in range(BEFORE):
        for i0 in range(0, INNER, BLOCK_I):
            o = (a * GROUPS + g).to(tl.int64) * INNER + i0 + rows  # [BLOCK_I] rows of [outer, S, D]
            for d0 in range(0, D, BLOCK_D):
                inside = ((i0 + rows) < INNER)[:, None] & ((d0 + cols) < D)[None, :]
                offs = (o[:, None] * S + t) * D + d0 + cols[None, :]
                x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
                ref = tl.load(ref_ptr + offs, mask=inside, other=0.0).to(tl.float32)
                largest_a = tl.maximum(largest_a, tl.max(_value(x, ref, A)))
                largest_b = tl.maximum(largest_b, tl.max(_value(x, ref, B)))
    e_a = ((largest_a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126
    e_b = ((largest_b.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126
    up_a = ((1023 + TOP - e_a).to(tl.int64) << 52).to(tl.float64, bitcast=True)
    up_b = ((1023 + TOP - e_b).to(tl.int64) << 52).to(tl.float64, bitcast=True)
    acc_a = tl.full([], 0, tl.int64)
    acc_b = tl.full([], 0, tl.int64)
    for a in range(BEFORE):
        for i0 in range(0, INNER, BLOCK_I):
            o = (a * GROUPS + g).to(tl.int64) * INNER + i0 + rows
            for d0 in range(0, D, BLOCK_D):
                inside = ((i0 + rows) < INNER)[:, None] & ((d0 + cols) < D)[None, :]
                offs = (o[:, None] * S + t) * D + d0 + cols[None, :]
                x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
                ref = tl.load(ref_ptr + offs, mask=inside, other=0.0).to(tl.float32)
                acc_a += tl.sum(tl.floor(_value(x, ref, A).to(tl.float64) * up_a).to(tl.int64))
                acc_b += tl.sum(tl.floor(_value(x, ref, B).to(tl.float64) * up_b).to(tl.int64))
    tl.store(own_ptr + g * S + t, acc_a)
    tl.store(own_ptr + (GROUPS + g) * S + t, acc_b)
    tl.store(exps_ptr + g * S + t, e_a)
    tl.store(exps_ptr + (GROUPS + g) * S + t, e_b)


@_jit
def _common(own_ptr, exps_ptr, out_ptr, scales_ptr, N, TOP, BLOCK: tl.constexpr):
    # One quantity per program: its sums brought to the scale of the one with the largest element.
    base = tl.program_id(0).to(tl.int64) * N
    largest = tl.full([BLOCK], -126, tl.int32)
    for j0 in range(0, N, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        largest = tl.maximum(largest, tl.load(exps_ptr + base + j, mask=j < N, other=-126))
    e = tl.max(largest)
    for j0 in range(0, N, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        own = tl.load(own_ptr + base + j, mask=j < N, other=0)
        shift = tl.minimum(e - tl.load(exps_ptr + base + j, mask=j < N, other=0), 63).to(tl.int64)
        tl.store(out_ptr + base + j, own >> shift, mask=j < N)
    tl.store(scales_ptr + tl.program_id(0), ((1023 + e - TOP).to(tl.int64) << 52).to(tl.float64, bitcast=True))
