"""Ring attention's K/V, gathered once over the ring group through the transport.

torch's ``_templated_ring_attention`` (what xfuser's ring attention runs on its ring group) moves
each rank's packed K/V around the ring through a *rotater*: ``exchange_buffers(kv)`` before each of
the first ``size - 1`` steps, ``next_buffer()`` at each later one. torch's default rotater
all-gathers the first step's buffer once (``all_gather_single``) and hands step ``i`` the block of
ring rank ``rank - i``. :class:`RingGather` is that all-gather as one batch of the transport: every
ring peer receives this rank's buffer and this rank theirs, so the same bytes land in the same
places, under the one program order, device semantics and the timeout every other exchange has.

Peers on other nodes may receive another message instead of the buffer (:class:`Remote`: V-Major's
step residuals of the K/V they already hold); the caller turns those messages into their rows. Such
a gather needs to know what the call's buffer holds, which torch's rotater, created inside its ring
attention with only the group, cannot be told: :func:`attend` runs torch's ring loop over a rotater
its caller makes for the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import transport


@dataclass(frozen=True)
class Remote:
    """What the ring peers in ``peers`` (ring ranks) exchange instead of the buffer: this rank's
    ``pieces`` (contiguous, each sent as its bytes) and, per peer, the byte sizes of the pieces it sends."""

    peers: tuple[int, ...]
    pieces: tuple[torch.Tensor, ...]
    sizes: dict[int, tuple[int, ...]]


class RingGather:
    """The all-gather of ``buffer`` (any shape, flattened) over the ring ``group``, in flight from
    creation; :meth:`wait` gives ``[ring size, buffer.numel()]``, row ``r`` ring rank ``r``'s buffer.
    With ``remote``, the rows of its peers are left unwritten: their pieces are in :attr:`received`
    (peer -> byte tensors) once :meth:`wait` returns."""

    def __init__(self, buffer: torch.Tensor, group: Any, remote: Remote | None = None) -> None:
        me, size = transport.group_info(group)
        data = transport.comm_view(buffer).view(-1)  # [n], fp8 as its bytes
        self._dtype = buffer.dtype
        self._out = data.new_empty(size, data.numel())  # [source ring rank, n]
        transport.copy_own(self._out[me], data)
        far = remote.peers if remote is not None else ()
        self.received = {j: [data.new_empty(n, dtype=torch.uint8) for n in remote.sizes[j]] for j in far}
        message = [transport.comm_view(p).view(-1).view(torch.uint8) for p in remote.pieces] if far else []
        # Indexed by ring rank: each peer's row (or pieces) in, this rank's buffer (or message) out.
        recv = [self.received[j] if j in far else [row] for j, row in enumerate(self._out)]
        send = [message if j in far else [data] for j in range(size)]
        self._done = transport.post(recv, send, group, "ring", "ring K/V", (data, self._out, *message))

    def advance(self) -> bool:
        return True  # one phase, posted at creation

    def wait(self) -> torch.Tensor:
        self._done.wait()
        return self._out.view(self._dtype)


class Rotater:
    """torch's ring-attention rotater protocol (``exchange_buffers``, ``next_buffer``) over one
    gather per attention call: like torch's default, the first buffer is all-gathered once
    (``start(buffer)``: a handle whose ``wait`` gives ``[ring size, n]``, a :class:`RingGather` or
    what wraps one) and step ``i`` reads ring rank ``rank - i``'s block, so attention sees the bytes
    it would."""

    def __init__(self, group: Any, start: Callable[[torch.Tensor], Any]) -> None:
        self._group, self._start = group, start
        self._gather: Any = None
        self._step = 0

    def exchange_buffers(self, curr_buffer: torch.Tensor) -> None:
        self._step += 1
        if self._gather is None:
            self._gather = self._start(curr_buffer)

    def next_buffer(self) -> torch.Tensor:
        me, _ = transport.group_info(self._group)
        return self._gather.wait()[me - self._step]  # negative: wraps around the ring, as torch's chunk index does


def attend(op: Callable[..., Any], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Any,
           start: Callable[[torch.Tensor], Any], merger: Any, **kwargs: Any) -> torch.Tensor:
    """Ring attention as xfuser's ``ring_attn`` runs torch's ``_templated_ring_attention`` (not causal,
    no load balance, ``seq_dim`` 1) over torch's all-gather rotation: ``start(buffer)`` gathers this
    call's K then V (flattened) once, a handle whose ``wait`` gives ``[ring size, n]``, and step ``i``
    attends to ring rank ``rank - i``'s block. The same ``op`` calls on the same blocks, merged in the
    same order by torch's ``merger`` (a new ``_SDPAMerger``, as the caller makes it): the bits of
    torch's ring over the same bytes. ``kwargs`` go to ``op``."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)  # (what a traced graph reads of the group)
    key, value = key.contiguous(), value.contiguous()  # as torch's loop makes them
    gathered = start(torch.cat([key.flatten(), value.flatten()])) if size > 1 else None
    n = key.numel()
    for i in range(size):
        if i > 0:
            kv = gathered.wait()[rank - i]  # ring rank (rank - i)'s K then V; negative: wraps as torch's chunk index
            key, value = kv[:n].reshape(key.shape), kv[n:].reshape(value.shape)
        out, lse, *_ = op(query, key, value, is_causal=False, **kwargs)
        merger.step(out, lse, False)
    return merger.results()[0]
