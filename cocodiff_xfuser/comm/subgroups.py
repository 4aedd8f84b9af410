"""The sub-groups cocodiff's exchanges run on, each created once for TAPA and V-Major alike, and
the group plans over them (:class:`GroupPlan`, :func:`plans`), which TAPA and the PXN-like relay read.

``dist.new_group`` is collective over the world: every rank must create every sub-group, in the
same order. Callers pass the same rank sets in the same order on every rank (they derive them
from the agreed topology and the gathered Ulysses groups); a set created before is reused, on
every rank alike, so a two-level group's levels serve TAPA's phases and V-Major's two phases.

Each new group is used once right away, by a barrier of its members: NCCL creates a communicator
on its first operation, which must involve every rank of the group, and a later batch may leave a
rank out (V-Major's slow phase when it has no active rows to send or receive).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch.distributed as dist

from . import faults, transport
from .topology import Topology, level_subgroups, restrict

logger = logging.getLogger("cocodiff_xfuser")

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


@dataclass(frozen=True)
class GroupPlan:
    """How a group spans the topology: its levels (outermost first) and this rank's sub-group of
    each, everything an exchange reads precomputed (it runs no code here)."""

    ranks: tuple[int, ...]
    levels: tuple[int, ...]
    level_groups: list[Any]  # this rank's sub-group per level: the ranks differing only in that coordinate
    index: int  # this rank's position in ``ranks`` (its group rank)
    #: The communicator of each level, named the same on every rank (order audit, faults).
    roles: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "roles", tuple(f"level {i} of {self.levels}" for i in range(len(self.levels))))


def plans(topology: Topology, groups: Sequence[Sequence[int]]) -> dict[tuple[int, ...], GroupPlan]:
    """The plans of the groups in ``groups`` that hold this rank and span at least two levels of
    ``topology`` as regular sub-grids, by their sorted ranks (collective over the world: creates
    every group's level sub-groups, in one order on every rank). The others use a flat exchange."""
    rank, found = dist.get_rank(), {}
    # Sorted, de-duplicated: every rank creates the same sub-groups in the same order.
    for ranks in sorted({tuple(sorted(g)) for g in groups}):
        try:
            levels = restrict(topology, ranks)
        except ValueError as e:
            if rank in ranks:
                logger.warning("using the flat all-to-all for group %s: %s", list(ranks), e)
            continue
        if len(levels) < 2:
            continue
        level_groups = [member_of(sets) for sets in level_subgroups(ranks, levels)]
        if rank in ranks:
            found[ranks] = GroupPlan(ranks, tuple(levels), level_groups, ranks.index(rank))
            logger.info("hierarchical all-to-all for group %s: levels %s", list(ranks), levels)
    return found
