"""The int4 residual codec of :mod:`.residuals` as two fused Triton kernels (one source for CUDA
and XPU), launched from :mod:`.residuals`' operators (``cocodiff_kernels::int4_encode``,
``int4_apply``): per selected row (a few per program), ``encode`` gathers the row and its reference,
scales each group by a power of two, packs the nibbles and exponents and writes the reference's
new row; ``apply`` adds a received row to the held copy in place. One launch per call covers every plane of the tensor
(every gated tensor joined along the planes, every destination of a run).

Both compute exactly what :func:`.residuals.encode_int4` and :func:`.residuals.add_int4` compute,
byte for byte (tested under ``TRITON_INTERPRET=1``, which must be set before triton is first
imported, so the tests run them in a process of their own).
"""

from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction
except ImportError:  # CPU hosts without triton run the torch reference
    triton = None


# Read once: the interpreter must be chosen before triton is imported, so it cannot change later.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_DEVICES = ("cuda", "xpu")
_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)
#: Rows and warps per program of the encode and of the apply (rows a power of two), chosen on an
#: H200 (docs/benchmarks.md, "On one GPU").
ENCODE_ROWS, ENCODE_WARPS, APPLY_ROWS, APPLY_WARPS = 8, 1, 8, 2


# The launch grids' arithmetic in plain Python: triton's own ``cdiv`` and ``next_power_of_2`` are
# constexpr functions, whose call from the host costs far more than the arithmetic, at every launch.
def cdiv(n: int, block: int) -> int:
    """Blocks of ``block`` that cover ``n``."""
    return -(-n // block)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n`` <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def runs_on(t: torch.Tensor) -> bool:
    """Whether Triton kernels run on ``t``'s device: triton present, and an accelerator (or the
    interpreter). Compiled as eagerly: a graph traced through the operators that launch them holds
    their launches (:func:`launchable`)."""
    return triton is not None and (_INTERPRETED or t.device.type in _DEVICES)


def launchable(kernel):
    """``kernel`` as the code of a ``torch.library.triton_op`` launches it: wrapped
    (``torch.library.wrap_triton``), so that a graph traced through the operator holds the launch,
    which inductor schedules and a CUDA graph captures (eagerly, inside the operator, the wrap is the
    kernel itself); the interpreter's kernels, which run eagerly only, as they are."""
    return torch.library.wrap_triton(kernel) if isinstance(kernel, JITFunction) else kernel


def usable(*tensors: torch.Tensor | None) -> bool:
    """Whether the kernels run on these tensors: :func:`runs_on` their device, rows contiguous,
    values in float32 or bf16 (the payload's bytes aside)."""
    if triton is None:
        return False
    for t in tensors:  # (runs_on inlined, no generator: this runs several times per V-Major layer)
        if t is not None and not ((_INTERPRETED or t.device.type in _DEVICES) and t.is_contiguous() and t.dtype in _DTYPES):
            return False
    return True


def encode_int4(x: torch.Tensor, reference: torch.Tensor, rows: torch.Tensor, group: int) -> torch.Tensor:
    """:func:`.residuals.encode` in int4 (``group`` values per scale) of rows ``rows`` along the
    second-to-last dim of ``x`` and ``reference`` (both contiguous, ``[..., s, d]``): the payload
    ``[..., k, row bytes]``, and the reference's rows updated in place."""
    *planes, s, d = x.shape
    width = d // 2 + d // group
    k = rows.numel()
    out = torch.empty(*planes, k, width, dtype=torch.uint8, device=x.device)
    n = math.prod(planes)
    if n and k:
        launchable(_encode)[(n, cdiv(k, ENCODE_ROWS))](
            x, reference, rows, out, s, k, D=d, G=group, BLOCK=next_power_of_2(d), WIDTH=width, ROWS=ENCODE_ROWS,
            num_warps=ENCODE_WARPS)
    return out


def apply_int4(held: torch.Tensor, payload: torch.Tensor, rows: torch.Tensor | None, group: int) -> None:
    """:func:`.residuals.apply` of an int4 ``payload`` (``[..., k, row bytes]``, ``group`` values per
    scale) to ``held`` (``[..., s, d]``, contiguous) at rows ``rows`` (None: every row, in order), in place."""
    *_, s, d = held.shape
    k = payload.shape[-2]
    n = math.prod(payload.shape[:-2])
    if n and k:
        every = rows is None
        index = payload if every else rows  # any pointer where the kernel reads no index
        launchable(_apply)[(n, cdiv(k, APPLY_ROWS))](
            held, payload, index, s, k, D=d, G=group, BLOCK=next_power_of_2(d), WIDTH=payload.shape[-1], EVERY=every,
            ROWS=APPLY_ROWS, num_warps=APPLY_WARPS)


def _jit(fn):
    return fn if triton is None else triton.jit(fn)


@_jit
def _encode(x_ptr, ref_ptr, rows_ptr, out_ptr, S, K, D: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr,
            WIDTH: tl.constexpr, ROWS: tl.constexpr):
    plane = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # [ROWS] this program's rows of the payload
    row = tl.load(rows_ptr + t, mask=t < K, other=0).to(tl.int64)
    at = ((plane * S + row) * D)[:, None]
    offs = tl.arange(0, BLOCK)[None, :]
    inside = (t < K)[:, None] & (offs < D)
    ref = tl.load(ref_ptr + at + offs, mask=inside, other=0.0)
    change = tl.load(x_ptr + at + offs, mask=inside, other=0.0).to(tl.float32) - ref.to(tl.float32)  # [ROWS, BLOCK]
    # Each group's exponent from its largest value's bits, as the reference takes it.
    amax = tl.max(tl.abs(tl.reshape(change, (ROWS, BLOCK // G, G))), axis=2)  # [ROWS, BLOCK / G]
    e = tl.minimum(tl.maximum(((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 129, -100), 126)
    scale = tl.reshape(tl.broadcast_to(e[:, :, None], (ROWS, BLOCK // G, G)), (ROWS, BLOCK))
    down = ((127 - scale) << 23).to(tl.float32, bitcast=True)  # 2**-e, exact
    q = tl.minimum(tl.maximum(tl.floor(change * down + 0.5), -7.0), 7.0)
    new = ref.to(tl.float32) + q * ((scale + 127) << 23).to(tl.float32, bitcast=True)
    if ref_ptr.dtype.element_ty == tl.bfloat16:  # round to nearest even by hand: the interpreter truncates
        bits = new.to(tl.uint32, bitcast=True)
        new = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    tl.store(ref_ptr + at + offs, new, mask=inside)
    lo, hi = tl.split(tl.reshape((q + 8.0).to(tl.int32), (ROWS, BLOCK // 2, 2)))
    out = out_ptr + ((plane * K + t) * WIDTH)[:, None]
    half = tl.arange(0, BLOCK // 2)[None, :]
    tl.store(out + half, (lo | (hi << 4)).to(tl.uint8), mask=(t < K)[:, None] & (half < D // 2))
    groups = tl.arange(0, BLOCK // G)[None, :]
    tl.store(out + D // 2 + groups, e.to(tl.int8).to(tl.uint8, bitcast=True), mask=(t < K)[:, None] & (groups < D // G))


@_jit
def _apply(held_ptr, payload_ptr, rows_ptr, S, K, D: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr,
           WIDTH: tl.constexpr, EVERY: tl.constexpr, ROWS: tl.constexpr):
    plane = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # [ROWS] this program's rows of the payload
    row = t.to(tl.int64) if EVERY else tl.load(rows_ptr + t, mask=t < K, other=0).to(tl.int64)
    at = ((plane * S + row) * D)[:, None]
    src = payload_ptr + ((plane * K + t) * WIDTH)[:, None]
    half = tl.arange(0, BLOCK // 2)[None, :]
    packed = tl.load(src + half, mask=(t < K)[:, None] & (half < D // 2), other=0).to(tl.int32)
    q = tl.reshape(tl.join(packed & 15, packed >> 4), (ROWS, BLOCK)).to(tl.float32) - 8.0
    groups = tl.arange(0, BLOCK // G)[None, :]
    e = tl.load(src + D // 2 + groups, mask=(t < K)[:, None] & (groups < D // G), other=0).to(tl.int8, bitcast=True)
    scale = tl.reshape(tl.broadcast_to(e.to(tl.int32)[:, :, None], (ROWS, BLOCK // G, G)), (ROWS, BLOCK))
    offs = tl.arange(0, BLOCK)[None, :]
    inside = (t < K)[:, None] & (offs < D)
    held = tl.load(held_ptr + at + offs, mask=inside, other=0.0)
    new = held.to(tl.float32) + q * ((scale + 127) << 23).to(tl.float32, bitcast=True)
    if held_ptr.dtype.element_ty == tl.bfloat16:  # as in the encode
        bits = new.to(tl.uint32, bitcast=True)
        new = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    tl.store(held_ptr + at + offs, new, mask=inside)
