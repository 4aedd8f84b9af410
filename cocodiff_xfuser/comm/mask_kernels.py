"""The sparse exchange's mask decode (:func:`.sparse.rows_of`) as one Triton kernel (one source for
CUDA and XPU): per mask, a prefix sum over its bits gives each set bit its rank among them, its
slot, where the row's index is written. One launch decodes every mask of a run of sources, in place
of the reference's dozen small operations.

It writes what :func:`.sparse.reference_rows_of` writes (tested under ``TRITON_INTERPRET=1``, which
must be set before triton is first imported: :mod:`cocodiff_xfuser.tools.kernel_check`).
"""

from __future__ import annotations

import torch

from cocodiff_xfuser.comm import residual_kernels
from cocodiff_xfuser.comm.residual_kernels import next_power_of_2

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU hosts without triton run the torch reference
    triton = None


def usable(mask: torch.Tensor) -> bool:
    """Whether the kernel decodes ``mask``: bytes on a device Triton runs on, one mask or a run of
    them (``[n, bytes]``, each contiguous)."""
    return residual_kernels.runs_on(mask) and mask.dtype == torch.uint8 and mask.dim() <= 2 and mask.stride(-1) == 1


def rows(mask: torch.Tensor, s: int, k: int) -> torch.Tensor:
    """The ``k`` rows (int64, ascending) that each mask of ``mask`` (``[bytes]`` or ``[n, bytes]``)
    marks among ``s``: ``[k]`` or ``[n, k]``."""
    n = mask.shape[0] if mask.dim() == 2 else 1
    out = torch.empty(*mask.shape[:-1], k, dtype=torch.long, device=mask.device)
    if n and k:
        stride = mask.stride(0) if mask.dim() == 2 else 0
        residual_kernels.launchable(_rows)[(n,)](mask, out, s, k, stride, BLOCK=next_power_of_2(s))
    return out


def _jit(fn):
    return fn if triton is None else triton.jit(fn)


@_jit
def _rows(mask_ptr, out_ptr, S, K, STRIDE, BLOCK: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, BLOCK)
    inside = t < S
    byte = tl.load(mask_ptr + m * STRIDE + t // 8, mask=inside, other=0).to(tl.int32)
    bit = (byte >> (t % 8)) & 1
    slot = tl.cumsum(bit, 0) - 1  # the row's rank among the set bits
    tl.store(out_ptr + m * K + slot, t.to(tl.int64), mask=inside & (bit == 1) & (slot < K))
