"""Ring attention's K/V, gathered once over the ring group through the transport.

torch's ``_templated_ring_attention`` (what xfuser's ring attention runs on its ring group) moves
each rank's packed K/V around the ring through a *rotater*: ``exchange_buffers(kv)`` before each of
the first ``size - 1`` steps, ``next_buffer()`` at each later one. torch's default rotater
all-gathers the first step's buffer once (``all_gather_single``) and hands step ``i`` the block of
ring rank ``rank - i``. :class:`RingGather` is that all-gather as one batch of the transport: every
ring peer receives this rank's buffer and this rank theirs, so the same bytes land in the same
places, under the one program order, device semantics and the timeout every other exchange has.
"""

from __future__ import annotations

from typing import Any

import torch

from . import transport


class RingGather:
    """The all-gather of ``buffer`` (any shape, flattened) over the ring ``group``, in flight from
    creation; :meth:`wait` gives ``[ring size, buffer.numel()]``, row ``r`` ring rank ``r``'s buffer."""

    def __init__(self, buffer: torch.Tensor, group: Any) -> None:
        me, size = transport.group_info(group)
        data = transport.comm_view(buffer).view(-1)  # [n], fp8 as its bytes
        self._dtype = buffer.dtype
        self._out = data.new_empty(size, data.numel())  # [source ring rank, n]
        transport.copy_own(self._out[me], data)
        # Indexed by ring rank: each peer's row in, this rank's buffer out (own entries are left alone).
        self._done = transport.post([[row] for row in self._out], [[data]] * size, group, "ring", "ring K/V", (data, self._out))

    def advance(self) -> bool:
        return True  # one phase, posted at creation

    def wait(self) -> torch.Tensor:
        self._done.wait()
        return self._out.view(self._dtype)
