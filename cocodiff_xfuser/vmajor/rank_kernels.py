"""V-Major's ranking of tokens by change as two Triton kernels (one source for CUDA and XPU), in
place of a stable sort, a cumulative sum and a second sort with their small operations.

``ranks``: per token, its place in the stable ascending order of the keys (the number of tokens
before it: smaller, or equal with a lower index), what ``torch.sort(keys, stable=True)`` places it
at. For the budget policy the same pass sums the keys ranked below each token (its running sum in
that order) and counts the tokens whose running sum stays within the allowed error: those left out.
Every comparison and sum is of integers (or of float64 keys compared, never added), so the counts
are exact in any order and every device ranks alike.

``top``: the ``k`` tokens ranked last (the largest change), ascending, and the sparse exchange's
mask of them (:meth:`.sparse.Selection.mask`'s bytes), in one launch.

Each token compares itself with every other: ``s**2`` comparisons, spread over the device, which at
a rank's tokens per layer cost less than the sort's passes. Both write what the torch reference in
:mod:`.policy` writes (tested under ``TRITON_INTERPRET=1``, which must be set before triton is first
imported: :mod:`cocodiff_xfuser.tools.kernel_check`).
"""

from __future__ import annotations

import struct

import torch

from cocodiff_xfuser.comm import residual_kernels, sparse
from cocodiff_xfuser.comm.residual_kernels import cdiv

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU hosts without triton run the torch reference
    triton = None

#: The ranking's tokens per program, the other tokens compared with them per pass, its warps; the
#: choice's tokens per program (at least 8: whole mask bytes). Powers of two, chosen on an H200
#: (docs/benchmarks.md, "On one GPU").
TOKENS, PASS, WARPS, TOP_TOKENS = 4, 512, 4, 128


def usable(keys: torch.Tensor) -> bool:
    """Whether the kernels rank ``keys`` (``[s]``, contiguous): on a device Triton runs on."""
    return residual_kernels.runs_on(keys) and keys.dim() == 1 and keys.is_contiguous()


def ranks(keys: torch.Tensor, budget: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every token's stable ascending rank (int64) by ``keys`` (``[s]``: the budget's int64 sums, or
    a policy's float64 changes), and with ``budget`` (the norms' integer sums, the keys' and the
    norms' scales, the error bound squared) how many tokens the budget leaves out (float32 ``[1]``,
    an exact count): those whose running sum times the keys' scale is within the norms' sum times
    theirs times the bound."""
    s = keys.numel()
    out = torch.empty(s, dtype=torch.long, device=keys.device)
    left = torch.zeros(1, dtype=torch.float32, device=keys.device) if budget is not None else None
    norms, scale, norm_scale, bound = budget if budget is not None else (keys, keys, keys, 0.0)
    residual_kernels.launchable(_rank)[(cdiv(s, TOKENS),)](
        keys, norms, scale, norm_scale, out, out if left is None else left, s, _float64_bits(bound),
        BUDGET=budget is not None, BI=TOKENS, BJ=PASS, num_warps=WARPS)
    return out, left


def top(ranks: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` tokens ranked last by ``ranks`` (int64 ``[k]``, ascending) and their mask."""
    s = ranks.numel()
    active = torch.empty(k, dtype=torch.long, device=ranks.device)
    mask = torch.empty(sparse.mask_bytes(s), dtype=torch.uint8, device=ranks.device)
    residual_kernels.launchable(_top)[(cdiv(mask.numel() * 8, TOP_TOKENS),)](
        ranks, active, mask, s, s - k, mask.numel(), BI=TOP_TOKENS)
    return active, mask


def _float64_bits(x: float) -> int:
    """``x``'s float64 bits as an integer: a Python float reaches a kernel as float32."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _jit(fn):
    return fn if triton is None else triton.jit(fn)


@_jit
def _rank(keys_ptr, norms_ptr, scale_ptr, norm_scale_ptr, ranks_ptr, left_ptr, S, BOUND, BUDGET: tl.constexpr,
          BI: tl.constexpr, BJ: tl.constexpr):
    i = tl.program_id(0) * BI + tl.arange(0, BI)
    in_i = i < S
    key_i = tl.load(keys_ptr + i, mask=in_i, other=0)
    # Per pair, summed over the passes and reduced once at the end: whether j comes before i, and
    # j's key where it does (budget).
    rank = tl.zeros([BI, BJ], dtype=tl.int32)
    below = tl.zeros([BI, BJ], dtype=tl.int64)
    norms = tl.zeros([BJ], dtype=tl.int64)
    for j0 in range(0, S, BJ):
        j = j0 + tl.arange(0, BJ)
        in_j = j < S
        key_j = tl.load(keys_ptr + j, mask=in_j, other=0)
        before = (key_j[None, :] < key_i[:, None]) | ((key_j[None, :] == key_i[:, None]) & (j[None, :] < i[:, None]))
        before = before & in_j[None, :]  # [BI, BJ]
        rank += before.to(tl.int32)
        if BUDGET:
            below += tl.where(before, key_j[None, :], 0)
            norms += tl.load(norms_ptr + j, mask=in_j, other=0)
    tl.store(ranks_ptr + i, tl.sum(rank, axis=1).to(tl.int64), mask=in_i)
    if BUDGET:
        below = tl.sum(below, axis=1)  # the keys ranked before each token
        # As the reference: norms' sum (float64) x their scale x the bound, against each running sum x its scale.
        allowed = tl.sum(norms).to(tl.float64) * tl.load(norm_scale_ptr) * BOUND.to(tl.int64).to(tl.float64, bitcast=True)
        kept = ((below + key_i).to(tl.float64) * tl.load(scale_ptr) <= allowed) & in_i
        tl.atomic_add(left_ptr, tl.sum(kept.to(tl.float32)))  # whole numbers below 2**24: exact in any order


@_jit
def _top(ranks_ptr, active_ptr, mask_ptr, S, FIRST, MASK_BYTES, BI: tl.constexpr):
    start = tl.program_id(0) * BI
    i = start + tl.arange(0, BI)
    sent = (tl.load(ranks_ptr + i, mask=i < S, other=-1) >= FIRST).to(tl.int32)
    earlier = tl.zeros([BI], dtype=tl.int32)  # sent tokens before this program's
    for j0 in range(0, start, BI):
        j = j0 + tl.arange(0, BI)
        earlier += (tl.load(ranks_ptr + j, mask=j < S, other=-1) >= FIRST).to(tl.int32)
    slot = tl.sum(earlier) + tl.cumsum(sent, 0) - 1
    tl.store(active_ptr + slot, i.to(tl.int64), mask=sent == 1)
    # The mask: bit t % 8 of byte t // 8 for a sent token t (padding bytes zero).
    byte = tl.sum(tl.reshape(sent, (BI // 8, 8)) << tl.arange(0, 8)[None, :], axis=1)
    b = start // 8 + tl.arange(0, BI // 8)
    tl.store(mask_ptr + b, byte.to(tl.uint8), mask=b < MASK_BYTES)
