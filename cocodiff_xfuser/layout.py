"""The job's layout: every fact that chooses which collectives run, computed once, the same on every
rank, and passed explicitly.

The exchanger builds it when the job starts (:meth:`Layout.gather`, collective over the world: each
rank's Ulysses and ring group), from the agreed topology. Whether a rank's Ulysses group and ring
cross nodes decides whether V-Major runs on them, which group V-Major's clock agrees over, and
how many peers' copies the ring's caches hold; a rank's node decides what it sends over slow links.
Every such fact is read here, from the same inputs on every rank (as torchtitan's ``ParallelDims``
is validated once and handed down), so no rank can decide alone.

An uneven layout (Ulysses groups or rings that cross nodes beside others that do not, ranks with
different numbers of ring peers on other nodes) is refused in one line: V-Major would run on some
ranks and not on others, and their collectives would differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Sequence

import torch.distributed as dist

from cocodiff_xfuser.comm import transport
from cocodiff_xfuser.comm.topology import Topology


@dataclass(frozen=True)
class Layout:
    """The Ulysses groups and rings of the whole job on its topology, seen from ``rank``."""

    topology: Topology
    ulysses_groups: tuple[tuple[int, ...], ...]  # every rank's Ulysses group (global ranks, group order), by rank
    ring_groups: tuple[tuple[int, ...], ...] | None  # every rank's ring group, by rank; None: no ring
    rank: int

    @classmethod
    def gather(cls, topology: Topology, ulysses: Any, ring: Any | None) -> Layout:
        """This job's layout from this rank's Ulysses and ring process groups (collective over the
        world, the same on every rank); ValueError naming an uneven layout."""
        mine = (tuple(dist.get_process_group_ranks(ulysses)), None if ring is None else transport.group_ranks(ring))
        everyone: list[Any] = [None] * dist.get_world_size()
        transport.launched(None, "all_gather_object")
        dist.all_gather_object(everyone, mine)
        rings = [r for _, r in everyone]
        if any(r is None for r in rings) and any(r is not None for r in rings):
            raise ValueError("cocodiff: some ranks have a ring group and others not; launch every rank with the same degrees")
        layout = cls(topology, tuple(u for u, _ in everyone), None if rings[0] is None else tuple(rings), dist.get_rank())
        layout.check()
        return layout

    def check(self) -> None:
        """One line for an uneven layout (module docstring)."""
        for name, groups in (("Ulysses groups", self.ulysses_groups), ("rings", self.ring_groups or ())):
            crossing = {g for g in groups if self.crosses(g)}
            staying = set(groups) - crossing
            if crossing and staying:
                raise ValueError(
                    f"cocodiff: uneven layout on topology {self.topology} ({self.topology.describe()}): {name} "
                    f"{_ranks(crossing)} span nodes, {_ranks(staying)} do not; choose degrees that split every group alike")
        if self.ring_groups is not None:
            peers = {len(self._remote(self.ring_groups[r], r)) for r in range(len(self.ring_groups))}
            if len(peers) > 1:
                raise ValueError(
                    f"cocodiff: uneven layout on topology {self.topology} ({self.topology.describe()}): ranks have "
                    f"{' or '.join(map(str, sorted(peers)))} ring peers on other nodes; choose degrees that split every ring alike")

    @cached_property
    def node_of(self) -> tuple[int, ...]:
        """Every global rank's node (the topology's outermost coordinate)."""
        return tuple(self.topology.coords(r)[0] for r in range(len(self.ulysses_groups)))

    def nodes_and_lanes(self, ranks: Sequence[int]) -> tuple[list[int], list[int]]:
        """Per member of the group ``ranks`` (in that order): its node's position among the group's
        nodes, and its position among the group's members on that node (its lane)."""
        return self.topology.nodes_and_lanes(ranks)

    def crosses(self, ranks: Sequence[int]) -> bool:
        """Whether the group ``ranks`` has members on more than one node."""
        return len({self.node_of[r] for r in ranks}) > 1

    def _remote(self, ranks: Sequence[int], rank: int) -> tuple[int, ...]:
        return tuple(j for j, r in enumerate(ranks) if self.node_of[r] != self.node_of[rank])

    @property
    def ulysses(self) -> tuple[int, ...]:
        """This rank's Ulysses group."""
        return self.ulysses_groups[self.rank]

    @cached_property
    def ulysses_remote(self) -> tuple[int, ...]:
        """The positions of this rank's Ulysses group (group order) on other nodes than this rank's."""
        return self._remote(self.ulysses, self.rank)

    @cached_property
    def slow_share(self) -> float:
        """The share of an equal-split Ulysses exchange this rank sends to other nodes."""
        return len(self.ulysses_remote) / len(self.ulysses)

    @cached_property
    def ring_remote(self) -> tuple[int, ...]:
        """The ring positions (sorted ranks) on other nodes than this rank's: each receives this rank's
        K/V over the slow links; () without a ring or where it stays in one node (on every rank alike)."""
        if self.ring_groups is None:
            return ()
        return self._remote(sorted(self.ring_groups[self.rank]), self.rank)

    @cached_property
    def ring_far(self) -> tuple[bool, ...]:
        """Per ring position, whether it is on another node than this rank's (() without a ring)."""
        if self.ring_groups is None:
            return ()
        return tuple([j in self.ring_remote for j in range(len(self.ring_groups[self.rank]))])

    @property
    def ulysses_crosses(self) -> bool:
        """Whether the Ulysses groups cross nodes (all of them alike)."""
        return bool(self.ulysses_remote)

    @property
    def clock_spans_world(self) -> bool:
        """Whether V-Major's clock agrees over the world: the ring crosses nodes, and ring peers sit in
        other Ulysses groups (else over the Ulysses group)."""
        return bool(self.ring_remote)


def _ranks(groups: set[tuple[int, ...]]) -> str:
    return ", ".join(str(list(g)) for g in sorted(groups))
