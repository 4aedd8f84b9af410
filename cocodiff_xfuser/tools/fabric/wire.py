"""bf16 on the emulated wire for stock's exchanges too.

The emulated clusters compute in float32 (bf16 matmuls are slow on CPU), but a GPU job sends bf16.
With ``COCODIFF_WIRE_DTYPE`` set, cocodiff's own exchanges carry float32 payloads in that dtype
(:mod:`cocodiff_xfuser.comm.transport`); this does the same for torch's functional collectives, which
stock's exchanges are (xfuser's Ulysses all-to-all, torch's ring all-gather): the payload is rounded
to the wire's dtype, sent, and widened again, so stock and cocodiff round alike and their images
stay comparable bit for bit. PipeFusion's point-to-point activations (xfuser's pipeline sends and
receives) cross the same way: narrowed when sent, received narrow and widened when waited for.
Installed in every rank of a job by :mod:`cocodiff_xfuser.tools.generate`.
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable

import torch

from cocodiff_xfuser import compat
from cocodiff_xfuser.comm import transport

_FUNCTIONAL = "torch.distributed._functional_collectives"
_COORDINATOR = "xfuser.core.distributed.group_coordinator"
#: The environment of a job whose figures stand for a GPU's: bf16 on the wire (the emulated
#: pipeline benchmarks, check and quality; bench a2a sends the message sizes it names).
GPU_WIRE = {transport.WIRE_DTYPE_ENV: "bfloat16"}
#: The functional collectives stock's exchanges use.
COLLECTIVES = ("all_to_all_single", "all_gather_single")


def install() -> None:
    """Round stock's float32 payloads to the wire's dtype in this process (nothing without one)."""
    dtype = transport.wire_float()
    if dtype is None:
        return
    wait = compat.torch_private(_FUNCTIONAL, "wait_tensor")
    for name in COLLECTIVES:
        collective = compat.torch_private(_FUNCTIONAL, name)
        funcol = importlib.import_module(collective.__module__)  # the module callers read it from
        if not getattr(getattr(funcol, name), "_cocodiff_wire", False):
            setattr(funcol, name, _on_wire(collective, wait, dtype))
    pipeline = compat.target(importlib.import_module(_COORDINATOR), "PipelineGroupCoordinator")
    for name, make in (("_pipeline_isend", _send_on_wire), ("_pipeline_isend_skip", _send_on_wire),
                       ("_pipeline_irecv", _receive_on_wire), ("_pipeline_irecv_skip", _receive_on_wire)):
        method = compat.target(pipeline, name)
        if not getattr(method, "_cocodiff_wire", False):
            setattr(pipeline, name, make(method, dtype))


def _on_wire(collective: Callable, wait: Callable, dtype: torch.dtype) -> Callable:
    @functools.wraps(collective)
    def on_wire(x: torch.Tensor, *args, **kwargs):
        if x.dtype != torch.float32:
            return collective(x, *args, **kwargs)
        return wait(collective(x.to(dtype), *args, **kwargs)).to(x.dtype)

    on_wire._cocodiff_wire = True  # type: ignore[attr-defined]
    return on_wire


def _send_on_wire(send: Callable, dtype: torch.dtype) -> Callable:
    @functools.wraps(send)
    def send_on_wire(self, tensor: torch.Tensor):
        return send(self, tensor.to(dtype) if tensor.dtype == torch.float32 else tensor)

    send_on_wire._cocodiff_wire = True  # type: ignore[attr-defined]
    return send_on_wire


def _receive_on_wire(receive: Callable, dtype: torch.dtype) -> Callable:
    @functools.wraps(receive)
    def receive_on_wire(self, tensor: torch.Tensor):
        if tensor.dtype != torch.float32:
            return receive(self, tensor)
        narrow = torch.empty_like(tensor, dtype=dtype)
        return _Widening(receive(self, narrow), narrow, tensor)

    receive_on_wire._cocodiff_wire = True  # type: ignore[attr-defined]
    return receive_on_wire


class _Widening:
    """A receive into a narrow buffer, widened into xfuser's when xfuser waits for it (the only
    use xfuser makes of a pipeline receive's handle)."""

    def __init__(self, work, narrow: torch.Tensor, into: torch.Tensor) -> None:
        self.work, self.narrow, self.into = work, narrow, into

    def wait(self) -> bool:
        self.work.wait()
        self.into.copy_(self.narrow)
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()
