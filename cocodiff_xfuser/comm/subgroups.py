"""The sub-groups cocodiff's exchanges run on, each created once for TAPA and V-Major alike.

``dist.new_group`` is collective over the world: every rank must create every sub-group, in the
same order. Callers pass the same rank sets in the same order on every rank (they derive them
from the agreed topology and the gathered Ulysses groups); a set created before is reused, on
every rank alike, so a two-level group's levels serve TAPA's phases and V-Major's two phases.

Each new group is used once right away, by a barrier of its members: NCCL creates a communicator
on its first operation, which must involve every rank of the group, and a later batch may leave a
rank out (V-Major's slow phase when it has no active rows to send or receive).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch.distributed as dist

from . import faults, transport

_created: dict[tuple[int, ...], Any] = {}


def member_of(rank_sets: Sequence[Sequence[int]]) -> Any:
    """Create the process group of every set in ``rank_sets`` not created yet (collective, with
    cocodiff's timeout) and return the one that holds this rank (None if none does)."""
    rank, mine, new = dist.get_rank(), None, False
    for ranks in rank_sets:
        key = tuple(sorted(ranks))
        if key not in _created:
            _created[key] = dist.new_group(list(key), timeout=faults.timeout())
            new = new or rank in key
        if rank in key:
            mine = _created[key]
    if new:
        transport.launched(mine, "barrier (first use)")
        dist.barrier(group=mine)
    return mine


def release() -> None:
    """Destroy every sub-group created here, in creation order, and let go of every process group
    the exchanges cached (collective: every rank calls it at the same program point, after its
    last exchange). A group still referenced at exit is destroyed in the interpreter's teardown,
    where gloo has ended ranks with std::terminate ("terminate called without an active exception")."""
    if _created and dist.is_initialized():
        # No rank may tear a connection down while a peer still talks on it.
        dist.barrier()
        for group in _created.values():  # one order on every rank: creation order
            dist.destroy_process_group(group)
    _created.clear()
    transport.forget_groups()
