"""Step residuals: a tensor sent as its change since the copy its receiver holds.

Adjacent denoising steps produce similar activations, so an exchange that repeats every step can
send each row's change instead of its value. The sender keeps a *reference*, exactly what the
receiver holds; it sends the change since the reference, rounded to a narrow format (bf16, fp8, or
int4 with one power-of-two scale per group of values) and adds the rounded change to its
reference, as the receiver adds it to its copy. The rounding error stays in the reference's
distance to the true value, so a later step sends it again (error feedback): the copies never
drift apart. Only some rows may travel (selected along the second-to-last dim, the tokens; the
last is a row's values); without a residual dtype the rows travel as values.

int4 rows travel as bytes (``torch.uint8``, :func:`row_bytes` of them per row): the values' nibbles
(``q + 8``, ``q`` in [-7, 7], two per byte, even index low), then one signed exponent byte per
group, the group's scale ``2**e``. Everything between a change and its rounded value is exact
arithmetic (scaling by powers of two, floor of a sum with 0.5, bit fields), so the Triton kernels
(:mod:`.residual_kernels`, CUDA and XPU) and this reference (CPU) produce the same bytes.

V-Major's exchanges use it (:mod:`cocodiff_xfuser.vmajor` encodes, :mod:`.sparse` applies); it
knows nothing of layers, steps or policies, so any exchange that repeats per step can use it.
"""

from __future__ import annotations

import math

import torch

from cocodiff_xfuser import commstats

from . import residual_kernels

#: int4 residuals: values per scale (fewer where a row's width is not a multiple).
INT4_GROUP = 32
#: int4's scale exponents, bounded to what one byte and a normal float32 hold.
_EXP_MIN, _EXP_MAX = -100, 126


def group_size(width: int) -> int:
    """The int4 group of a row of ``width`` values (rows of odd width have no int4 form)."""
    if width % 2:
        raise ValueError(f"int4 residuals need rows of even width, not {width}")
    return math.gcd(width, INT4_GROUP)


def row_bytes(width: int, dtype: torch.dtype) -> int:
    """The bytes one row of ``width`` values takes as a residual in ``dtype``."""
    if dtype == torch.int4:
        return width // 2 + width // group_size(width)
    return width * dtype.itemsize


def encode(x: torch.Tensor, reference: torch.Tensor | None, rows: torch.Tensor, dim: int,
           dtype: torch.dtype | None) -> torch.Tensor:
    """The rows ``rows`` (along ``dim``, the second-to-last) of ``x`` as they travel, and the
    reference updated to what the receiver will hold: their values (``reference``, where kept,
    takes them), or with ``dtype`` their change since ``reference`` in that format, which
    ``reference`` adds. Where ``rows`` is every row in order, whole tensors stand in for their rows."""
    every = rows.numel() == x.shape[dim]
    if dtype == torch.int4:
        _count("int4 encode", x, reference)
        return torch.ops.cocodiff_kernels.int4_encode(x, reference, rows)
    fresh = x if every else x.index_select(dim, rows)
    if dtype is None:
        if reference is not None and every:
            reference.copy_(fresh)
        elif reference is not None:
            reference.index_copy_(dim, rows, fresh)
        return fresh
    limit = torch.finfo(dtype).max  # fp8 has no infinity: out-of-range values would cast to NaN
    change = (fresh - (reference if every else reference.index_select(dim, rows))).clamp(-limit, limit).to(dtype)
    if every:
        reference.add_(change.to(x.dtype))
    else:
        reference.index_add_(dim, rows, change.to(x.dtype))
    return change


def apply(held: torch.Tensor, payload: torch.Tensor, rows: torch.Tensor | None, dim: int, is_residual: bool) -> None:
    """The receiver's side: ``held``'s rows ``rows`` along ``dim`` (None: every row, in order) take
    ``payload``, added where it is a residual (int4 ones as bytes), copied where it is values."""
    if is_residual and payload.dtype == torch.uint8:
        _count("int4 apply", held, payload)
        torch.ops.cocodiff_kernels.int4_apply(held, payload, rows)
    elif rows is None and is_residual:
        held.add_(payload.to(held.dtype))
    elif rows is None:
        held.copy_(payload)
    elif is_residual:
        held.index_add_(dim, rows, payload.to(held.dtype))
    else:
        held.index_copy_(dim, rows, payload)


@torch.library.triton_op("cocodiff_kernels::int4_encode", mutates_args={"reference"})
def _int4_encode(x: torch.Tensor, reference: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """:func:`encode` in int4, rows along the second-to-last dim: the Triton kernel where it runs,
    traced into a compiled graph as its launch; elsewhere (the CPU's kernel) the torch reference."""
    if residual_kernels.usable(x, reference):
        return residual_kernels.encode_int4(x, reference, rows, group_size(x.shape[-1]))
    if rows.numel() == x.shape[-2]:
        payload, new = encode_int4(x, reference)
        reference.copy_(new)
        return payload
    payload, new = encode_int4(x.index_select(-2, rows), reference.index_select(-2, rows))
    reference.index_copy_(-2, rows, new)
    return payload


@torch.library.triton_op("cocodiff_kernels::int4_apply", mutates_args={"held"})
def _int4_apply(held: torch.Tensor, payload: torch.Tensor, rows: torch.Tensor | None) -> None:
    """:func:`apply` of an int4 payload, rows along the second-to-last dim (None: every row): as
    :func:`_int4_encode`, the kernel or the torch reference."""
    if residual_kernels.usable(held, payload):
        residual_kernels.apply_int4(held, payload, rows, group_size(held.shape[-1]))
    elif rows is None:
        held.copy_(add_int4(held, payload))
    else:
        held.index_copy_(-2, rows, add_int4(held.index_select(-2, rows), payload))


def _count(kernel: str, *tensors: torch.Tensor | None) -> None:
    """A launch of ``kernel``, where the kernels run on ``tensors``: counted where the graph
    that holds it runs, compiled (:func:`cocodiff_xfuser.commstats.traced`)."""
    if residual_kernels.usable(*tensors):
        commstats.traced("count_kernel", kernel)


def encode_int4(fresh: torch.Tensor, held: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 payload of ``fresh``'s change since ``held`` (``[..., d]`` both), as bytes
    ``[..., row_bytes(d)]``, and ``held`` plus what the payload carries (the new reference)."""
    d = fresh.shape[-1]
    g = group_size(d)
    change = (fresh.float() - held.float()).unflatten(-1, (d // g, g))  # [..., groups, g]
    e = _exponent(change.abs().amax(-1))  # [..., groups]
    q = torch.floor(change * _pow2(-e).unsqueeze(-1) + 0.5).clamp(-7, 7)  # exact: a power-of-two scale
    nibbles = (q.flatten(-2) + 8).to(torch.uint8).unflatten(-1, (d // 2, 2))  # [..., d/2, 2]
    packed = nibbles[..., 0] | (nibbles[..., 1] << 4)
    payload = torch.cat([packed, e.to(torch.int8).view(torch.uint8)], dim=-1)
    return payload, (held.float() + (q * _pow2(e).unsqueeze(-1)).flatten(-2)).to(held.dtype)


def add_int4(held: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
    """``held`` (``[..., d]``) plus the int4 change ``payload`` carries (``[..., row_bytes(d)]``)."""
    d = held.shape[-1]
    g = group_size(d)
    packed, e = payload[..., : d // 2], payload[..., d // 2:].view(torch.int8).int()
    q = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).float() - 8  # [..., d]
    change = q.unflatten(-1, (d // g, g)) * _pow2(e).unsqueeze(-1)
    return (held.float() + change.flatten(-2)).to(held.dtype)


def _exponent(amax: torch.Tensor) -> torch.Tensor:
    """Per group, the scale exponent ``e`` (int32) with ``amax * 2**-e`` in [4, 8): from the bits of
    ``amax`` (its frexp exponent is its biased exponent field - 126), so every device agrees;
    zero and subnormal groups take the smallest."""
    field = (amax.view(torch.int32) >> 23) & 0xFF
    return (field - 129).clamp(_EXP_MIN, _EXP_MAX)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """``2.0**e`` (float32) built from its bits: exact for every ``e`` in [-126, 127]."""
    return ((e + 127) << 23).int().view(torch.float32)
