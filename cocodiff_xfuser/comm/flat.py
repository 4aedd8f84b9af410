"""Flat all-to-all exchanges for Ulysses sequence parallelism: stock, and the fair flat exchange.

xfuser's Ulysses exchange is ``all_to_all_single`` with equal splits: the input is cut along
dim 0 into W equal chunks, chunk d goes to group rank d, and the output holds the chunk from
group rank s at position s. ``flat`` is that exchange through functional collectives (what
xfuser does); ``flat-p2p`` produces bitwise the same output as one batch of point-to-point
operations (:mod:`.transport`), which is what NCCL's own all-to-all is made of: the fair flat
reference on every backend (on gloo, stock ``flat`` pays an artefact of gloo's posting order that
NCCL does not have; see :mod:`.transport`). Which algorithm runs is decided in :mod:`.autotune`
only: the functions here refuse what they cannot do instead of substituting another algorithm.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

from .. import compat
from . import transport

_FUNCTIONAL = "torch.distributed._functional_collectives"


class AllToAllHandle(Protocol):
    def advance(self) -> bool:
        """Launch the next phase: wait for its inputs (on NCCL/XCCL a wait of the stream, which
        does not block the host), then post it. Called at points of the program that are the same
        on every rank (one program order, :mod:`.transport`). Returns True once every phase has been launched."""

    def wait(self) -> torch.Tensor:
        """Block until the exchange is complete and return its output (same shape as input)."""


#: What a functional collective returns eagerly (traced, a plain tensor the graph waits for).
ASYNC_COLLECTIVE = compat.torch_private(_FUNCTIONAL, "AsyncCollectiveTensor")
#: Where eager collectives and their waits dispatch: below torch's Python autograd kernels (see :mod:`.functional`).
BELOW_AUTOGRAD = compat.torch_private("torch._C", "_AutoDispatchBelowAutograd")


def wait_collective(t: torch.Tensor) -> torch.Tensor:
    # Under tracing functional collectives return plain tensors with the wait already inserted.
    if not isinstance(t, ASYNC_COLLECTIVE):
        return t
    with BELOW_AUTOGRAD():  # (eagerly only: a traced tensor is never one)
        return t.wait()


class FlatHandle:
    """A flat all-to-all in flight: a single phase, launched at creation."""

    def __init__(
        self,
        x: torch.Tensor,
        group: Any,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> None:
        self._dtype = x.dtype
        x = transport.on_wire(x)
        self._wire_dtype = x.dtype
        transport.launched(group, "all_to_all_single")
        all_to_all_single = compat.torch_private(_FUNCTIONAL, "all_to_all_single")
        self._out: torch.Tensor = all_to_all_single(transport.comm_view(x), output_split_sizes, input_split_sizes, group)
        self._done = False

    def advance(self) -> bool:
        return True

    def wait(self) -> torch.Tensor:
        if not self._done:
            self._out = wait_collective(self._out).view(self._wire_dtype).to(self._dtype)
            self._done = True
        return self._out


def start_flat_all_to_all(
    x: torch.Tensor,
    group: Any = None,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
) -> FlatHandle:
    """Start ``all_to_all_single`` over ``group`` (default: world) along dim 0."""
    return FlatHandle(x, group if group is not None else dist.group.WORLD, output_split_sizes, input_split_sizes)


def flat_all_to_all(
    x: torch.Tensor,
    group: Any = None,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
) -> torch.Tensor:
    """``all_to_all_single`` over ``group`` along dim 0 (equal splits unless sizes are given).

    Uses the functional collective, which torch.compile can trace (``dist.*(async_op=True)``
    breaks graphs).
    """
    return start_flat_all_to_all(x, group, output_split_sizes, input_split_sizes).wait()


class P2PHandle:
    """The ``flat-p2p`` exchange in flight: one batch, posted at creation. The input must not be
    modified before ``wait`` (as with the flat handle)."""

    def __init__(self, x: torch.Tensor, group: Any) -> None:
        self._dtype = x.dtype
        inp = transport.comm_view(x)
        self._out = torch.empty_like(inp)
        self._done = transport.exchange_chunks(self._out, inp, group, "flat-p2p")
        self._result: torch.Tensor | None = None

    def advance(self) -> bool:
        return True

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._done.wait()
            self._result = self._out if self._out.dtype == self._dtype else self._out.view(self._dtype)
        return self._result


def p2p_reason(x: torch.Tensor, group: Any = None) -> str | None:
    """Why ``flat-p2p`` cannot exchange ``x`` over ``group`` (None: it can)."""
    group = group if group is not None else dist.group.WORLD
    if torch.compiler.is_compiling():
        return "point-to-point messages cannot be traced by torch.compile"
    if x.dim() == 0 or x.shape[0] % transport.group_info(group)[1]:
        return "the input does not split into equal chunks"
    return None


def start_p2p_all_to_all(x: torch.Tensor, group: Any = None) -> P2PHandle:
    """Start the ``flat-p2p`` exchange (:func:`p2p_reason` says when it cannot run; it never
    substitutes another algorithm)."""
    group = group if group is not None else dist.group.WORLD
    reason = p2p_reason(x, group)
    if reason is not None:
        raise ValueError(f"flat-p2p all-to-all: {reason}")
    return P2PHandle(x, group)


def p2p_all_to_all(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Blocking ``flat-p2p`` exchange, same output as :func:`flat_all_to_all`."""
    return start_p2p_all_to_all(x, group).wait()
