"""Step residuals: a tensor sent as its change since the copy its receiver holds.

Adjacent denoising steps produce similar activations, so an exchange that repeats every step can
send each row's change instead of its value. The sender keeps a *reference*, exactly what the
receiver holds; it sends the change since the reference, rounded to a narrow dtype (fp8 or bf16)
and clamped to that dtype's range, and adds the rounded change to its reference, as the receiver
adds it to its copy. The rounding error stays in the reference's distance to the true value, so a
later step sends it again (error feedback): the copies never drift apart. Only some rows may travel
(selected along one dim); without a residual dtype the rows travel as values.

V-Major's exchanges use it (:mod:`cocodiff_xfuser.vmajor` encodes, :mod:`.sparse` applies); it
knows nothing of layers, steps or policies, so any exchange that repeats per step can use it.
"""

from __future__ import annotations

import torch


def encode(x: torch.Tensor, reference: torch.Tensor | None, rows: torch.Tensor, dim: int,
           dtype: torch.dtype | None) -> torch.Tensor:
    """The rows ``rows`` (along ``dim``) of ``x`` as they travel, and the reference updated to what
    the receiver will hold: their values (``reference``, where kept, takes them), or with ``dtype``
    their change since ``reference`` in that dtype, which ``reference`` adds. Where ``rows`` is
    every row in order, whole tensors stand in for their rows."""
    every = rows.numel() == x.shape[dim]
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
    ``payload``, added where it is a residual, copied where it is values."""
    if rows is None and is_residual:
        held.add_(payload.to(held.dtype))
    elif rows is None:
        held.copy_(payload)
    elif is_residual:
        held.index_add_(dim, rows, payload.to(held.dtype))
    else:
        held.index_copy_(dim, rows, payload)
