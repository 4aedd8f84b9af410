"""fp8 exchanges with one scale per row: the compression xDiT and cache-dit apply to Ulysses traffic.

``--cocodiff-compress fp8`` sends every Ulysses exchange (Q, K, V in, attention output back) as
float8_e4m3fn with one float32 scale per row (a token of one head: ``amax / 448`` over its
channels, cache-dit's per-token scheme; xDiT's fp8 communication keeps one scale per layer). Lossy
on every link, fast ones included: it is one of the points V-Major is measured against
(``cocodiff quality --sweep frontier``), offered because a user may prefer it where it wins.

Each destination's chunk is packed as its fp8 values followed by its scales, so the packed
buffer is again W equal chunks in the same memory order: any all-to-all algorithm, TAPA's phases
included, moves it unchanged.

``--cocodiff-compress fp8-slow`` packs only what crosses the slow level: node-mates get the exact
values, ranks on other nodes every row as fp8 with its scale (:func:`pack_rows`), through the
routings of V-Major's sparse exchange (:mod:`.sparse`: one phase, or two composed with TAPA, whose
slow phase carries only packed rows). No error feedback: each step's rounding is lost.
"""

from __future__ import annotations

import torch

#: Values of ``--cocodiff-compress``.
SETTINGS = ("none", "fp8", "fp8-slow")
FP8 = torch.float8_e4m3fn
#: The dtypes packed (narrower data, xfuser's own fp8 communication, travels as it is).
WIDE = (torch.float32, torch.bfloat16, torch.float16)
_MAX = torch.finfo(FP8).max
#: Scales multiply by the reciprocal: CUDA divides a tensor by a scalar that way, the CPU divides
#: exactly, and one ulp of scale moves values across fp8's rounding ties, so the devices would
#: pack different bytes. A multiplication rounds the same on every device.
_INV_MAX = 1.0 / _MAX
_SCALE_BYTES = 4


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[..., d]`` as fp8 values and one float32 scale per row (``[..., 1]``), both formats' numerics."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
    scale = (amax * _INV_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (x.float() / scale).to(FP8), scale


def _dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (values.float() * scale).to(dtype)


def pack(x: torch.Tensor) -> torch.Tensor:
    """``[W, rows, d]`` (W chunks in send order) as ``[W, rows * (d + 4)]`` bytes: each chunk's
    fp8 values, then its rows' float32 scales."""
    w, rows, d = x.shape
    values, scale = _quantize(x)
    return torch.cat([values.view(torch.uint8).view(w, rows * d), scale.view(w, rows).view(torch.uint8)], dim=1)


def unpack(packed: torch.Tensor, rows: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`pack` (up to fp8's rounding): ``[W, rows * (d + 4)]`` bytes to
    ``[W, rows, d]`` in ``dtype``."""
    w = packed.shape[0]
    values = packed[:, : rows * d].contiguous().view(FP8).view(w, rows, d)
    scale = packed[:, rows * d :].contiguous().view(torch.float32).view(w, rows, 1)
    return _dequantize(values, scale, dtype)


def packed_bytes(rows: int, d: int) -> int:
    """Bytes of one packed chunk of ``rows`` rows of ``d`` channels."""
    return rows * (d + _SCALE_BYTES)


def pack_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows ``[..., d]`` as ``[..., d + 4]`` bytes: each row's fp8 values, then its float32 scale."""
    values, scale = _quantize(x)
    return torch.cat([values.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def unpack_rows(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`pack_rows` (up to fp8's rounding), in ``dtype``."""
    d = packed.shape[-1] - _SCALE_BYTES
    values = packed[..., :d].contiguous().view(FP8)
    scale = packed[..., d:].contiguous().view(torch.float32)
    return _dequantize(values, scale, dtype)
