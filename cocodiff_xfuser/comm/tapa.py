"""TAPA: the topology-aware (hierarchical) all-to-all, bitwise equal to the flat exchange.

Hierarchical exchange. A group whose ranks form a regular sub-grid of the topology has levels
``(s_0, ..., s_{k-1})``, outermost first, and group rank ``g = ravel(g_0, ..., g_{k-1})``. A
rank's data is viewed as ``[s_0, ..., s_{k-1}, c]`` indexed by destination coordinates. Levels
are processed innermost (fastest link) first: the level's dim is brought to the front by a
strided copy, then an all-to-all over the ranks that differ only in that coordinate replaces
the destination coordinate by the source coordinate. After the outermost level the data is in
canonical order, so k levels cost k copies and k exchanges (Tutel's 2DH for k = 2); the
exchanges of one phase run concurrently on disjoint sub-groups.

Ordering across ranks (the rule is in :mod:`.order`). A handle launches its first phase at
start and the others in ``wait``; waiting for a handle first launches the pending phases of the
handles of the same group started before it, so per sub-group launches follow the start order,
the same on every rank (SPMD). Only on gloo does ``progress`` also launch a phase as soon as the
previous one completed locally (under the same start-order rule).

In receives-first mode (gloo, see :mod:`.flat`) the hierarchical exchange also sends, at start, the chunks whose
destination differs from the sender only in the outermost coordinate straight to it (the inner
phases would only copy them locally), and its last phase leaves them out, so that part of the
slowest exchange overlaps the inner phases (rail 2x2, 4 MiB/rank: 31 -> 23 ms measured).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from . import faults, order
from .flat import (
    DIRECT_TAG,
    AllToAllHandle,
    Completion,
    backend_name,
    comm_view,
    post_receives_first,
    uses_receives_first,
    wait_collective,
)
from .topology import Topology, restrict

logger = logging.getLogger("cocodiff_xfuser")


class _BufferPool:
    """Recycles the 1-D intermediate buffers of hierarchical exchanges.

    A buffer is in the pool only while nobody uses it: handles take buffers out and put them
    back once the collective reading them has completed. Buffers are never returned to callers.
    """

    def __init__(self, per_key: int = 2, max_keys: int = 8) -> None:
        self._free: OrderedDict[tuple, list[torch.Tensor]] = OrderedDict()
        self._per_key = per_key
        self._max_keys = max_keys

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free.get((numel, dtype, device))
        return free.pop() if free else torch.empty(numel, dtype=dtype, device=device)

    def release(self, t: torch.Tensor) -> None:
        key = (t.numel(), t.dtype, t.device)
        free = self._free.setdefault(key, [])
        self._free.move_to_end(key)
        if len(free) < self._per_key:
            free.append(t)
        while len(self._free) > self._max_keys:
            self._free.popitem(last=False)


@dataclass
class _GroupPlan:
    ranks: tuple[int, ...]
    levels: tuple[int, ...]
    # This rank's sub-group per level: ranks of the group differing only in that coordinate.
    level_groups: list[Any]
    in_flight: list[HierarchicalHandle] = field(default_factory=list)
    index: int = 0  # this rank's position in ``ranks`` (its group rank)
    level_ranks: list[list[int]] = field(default_factory=list)  # global ranks of this rank's sub-group per level


@dataclass
class _Pending:
    """One launched phase: its output, and the c10d work (or p2p completion) when there is one."""

    out: torch.Tensor
    work: Any = None  # c10d Work (pollable collective) or Completion (receives-first p2p)
    held: list[torch.Tensor] = field(default_factory=list)  # pool buffers read by the collective
    src: torch.Tensor | None = None  # the phase's input, kept alive until its sends complete

    def done(self) -> bool:
        # Functional collectives cannot be polled: only wait() completes them.
        if isinstance(self.work, Completion):
            return self.work.done()
        return self.work is not None and self.work.is_completed()

    def wait(self) -> torch.Tensor:
        if self.work is None:
            return wait_collective(self.out)
        self.work.wait()
        self.src = None
        return self.out


class HierarchicalHandle:
    """A hierarchical all-to-all in flight: one phase per level, innermost first.

    Receives-first mode also sends, at start, the chunks whose destination differs from this rank
    only in the outermost coordinate straight to it (they would only be copied locally until the
    last phase), and the last phase leaves them out: on a rail-like fabric that part of the slow
    outer exchange overlaps the inner phases instead of following them.
    """

    def __init__(
        self,
        x: torch.Tensor,
        plan: _GroupPlan,
        pool: _BufferPool,
        pollable: bool,
        receives_first: bool = False,
        completion_driven: bool = False,
    ) -> None:
        self._plan = plan
        self._pool = pool
        self._pollable = pollable
        self._completion_driven = completion_driven
        self._p2p = receives_first
        self._shape = x.shape
        self._dtype = x.dtype
        data = comm_view(x).view(-1)
        self._chunk = data.numel() // len(plan.ranks)
        self._order = list(range(len(plan.levels)))  # memory order of the level dims
        self._data = data  # current phase's input, or its output once waited
        self._owned = False  # whether self._data is a pool buffer
        self._phase = -1
        self._pending: _Pending | None = None
        self._result: torch.Tensor | None = None
        self._direct: Completion | None = None
        self._final_out: torch.Tensor | None = None
        self._slot: tuple[int, int] | None = None  # (own slot, slots) of the direct chunks
        if receives_first:
            self._post_direct(data)
        plan.in_flight.append(self)
        self._launch_next()

    def _post_direct(self, data: torch.Tensor) -> None:
        levels = self._plan.levels
        slots = len(self._plan.ranks) // levels[0]
        me, own = divmod(self._plan.index, slots)  # outermost coordinate, position in the block
        group = self._plan.level_groups[0]
        out = torch.empty_like(data)  # the final output: the last phase fills the rest
        send, recv = data.view(levels[0], slots, -1), out.view(levels[0], slots, -1)
        order.launched(group, "p2p direct", role=f"level 0 of {levels}")
        works = []
        if send.shape[2]:
            for i in range(1, levels[0]):
                src = (me - i) % levels[0]
                works.append(dist.irecv(recv[src, own], group=group, tag=DIRECT_TAG, group_src=src))
            for i in range(1, levels[0]):
                dst = (me + i) % levels[0]
                works.append(dist.isend(send[dst, own], group=group, tag=DIRECT_TAG, group_dst=dst))
        self._direct = Completion([w for w in works if w is not None], poll=False, buffers=(data, out))
        self._final_out, self._slot = out, (own, slots)

    @property
    def _last(self) -> int:
        return len(self._plan.levels) - 1

    def progress(self) -> bool:
        if self._completion_driven:
            while self._phase < self._last and self._step(block=False):
                pass
        return self._phase == self._last

    def wait(self) -> torch.Tensor:
        if self._result is None:
            while self._phase < self._last:
                self._step(block=True)
            out = self._finish_phase()
            self._release(self._pending.held)
            self._pending = None
            if self._direct is not None:
                try:
                    self._direct.wait()
                except RuntimeError as e:
                    raise faults.failed(f"direct sends, sub-group {self._plan.level_ranks[0]}", e) from e
                self._direct = None
            self._result = out.view(self._dtype).view(self._shape)
        return self._result

    def _step(self, block: bool) -> bool:
        """Finish the current phase and launch the next; False if that would block."""
        following = self._phase + 1
        for earlier in self._plan.in_flight[: self._plan.in_flight.index(self)]:
            while earlier._phase < following:
                if not block:
                    return False
                earlier._step(block=True)
        if not block and not self._pending.done():
            return False
        self._data = self._finish_phase()
        self._owned = True
        self._release(self._pending.held)
        self._pending = None
        self._launch_next()
        return True

    def _finish_phase(self) -> torch.Tensor:
        try:
            return self._pending.wait()
        except RuntimeError as e:
            level = self._last - self._phase
            where = f"phase {self._phase + 1} of {self._last + 1}, sub-group {self._plan.level_ranks[level]}"
            raise faults.failed(where, e) from e

    def _launch_next(self) -> None:
        self._phase += 1
        levels = self._plan.levels
        level = self._last - self._phase
        data, held = self._data, []
        if self._order[0] != level:
            dims = [level] + [d for d in range(len(levels)) if d != level]
            buf = self._pool.acquire(data.numel(), data.dtype, data.device)
            # copy_ into a preallocated buffer: transpose().contiguous() measured ~10x slower (bf16).
            buf.view([levels[d] for d in dims] + [self._chunk]).copy_(
                data.view([levels[d] for d in self._order] + [self._chunk]).permute(
                    [self._order.index(d) for d in dims] + [len(levels)]
                )
            )
            if self._owned:
                self._pool.release(data)
            data, self._order, self._owned = buf, dims, True
        if self._owned:
            held.append(data)
        group = self._plan.level_groups[level]
        last = self._phase == self._last
        order.launched(group, f"phase {self._phase + 1}", role=f"level {level} of {levels}")
        if self._p2p:
            if last:  # the direct chunks are already on their way into the final output
                out, skip = self._final_out, self._slot
                self._final_out = None
            else:
                out, skip = self._pool.acquire(data.numel(), data.dtype, data.device), None
            works = post_receives_first(out, data, group, skip_slot=skip)
            # Only a non-final phase of a pollable handle is ever polled (progress stops at the last).
            done = Completion(works, self._pollable and not last, (out, data))
            self._pending = _Pending(out, done, held, data)
        elif self._pollable:
            # The final output goes to the caller: never a pool buffer.
            out = torch.empty_like(data) if last else self._pool.acquire(data.numel(), data.dtype, data.device)
            work = dist.all_to_all_single(out, data, group=group, async_op=True)
            self._pending = _Pending(out, work, held)
        else:
            self._pending = _Pending(fc.all_to_all_single(data, None, None, group), None, held)
        self._data, self._owned = None, False
        if last:
            self._plan.in_flight.remove(self)

    def _release(self, buffers: list[torch.Tensor]) -> None:
        for buf in buffers:
            self._pool.release(buf)


class HierarchicalAllToAll:
    """Topology-aware all-to-all for a fixed set of Ulysses groups.

    Construction is collective: every rank of the world must build it with the same
    ``topology`` and ``groups`` (the global ranks of every Ulysses group of the world), because
    it creates the per-level sub-groups with ``dist.new_group``. A rank keeps the plans of the
    groups it belongs to. Groups that are not regular sub-grids of the topology, span fewer than
    two levels, or are unknown use the flat exchange.
    """

    def __init__(self, topology: Topology, groups: Sequence[Sequence[int]]) -> None:
        topology.validate(dist.get_world_size())
        rank = dist.get_rank()
        self.topology = topology
        self._pool = _BufferPool()
        self._plans: dict[tuple[int, ...], _GroupPlan] = {}
        self._plan_by_pg: dict[Any, _GroupPlan | None] = {}
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
            grid = torch.arange(len(ranks)).view(levels)
            level_groups, level_ranks = [], []
            for j in range(len(levels)):
                mine = None
                for members in grid.movedim(j, -1).reshape(-1, levels[j]).tolist():
                    sub = [ranks[i] for i in members]
                    pg = dist.new_group(sub, timeout=faults.timeout())
                    if rank in sub:
                        mine = pg
                        level_ranks.append(sub)
                level_groups.append(mine)
            if rank in ranks:
                self._plans[ranks] = _GroupPlan(
                    ranks, tuple(levels), level_groups, index=ranks.index(rank), level_ranks=level_ranks
                )
                logger.info("hierarchical all-to-all for group %s: levels %s", list(ranks), levels)

    def levels(self, group: Any = None) -> tuple[int, ...]:
        """Level sizes of ``group`` on this topology; () when it uses the flat exchange."""
        plan = self._plan(group)
        return plan.levels if plan is not None else ()

    def reason(self, x: torch.Tensor, group: Any = None) -> str | None:
        """Why the hierarchical exchange cannot exchange ``x`` over ``group`` (None: it can)."""
        plan = self._plan(group)
        if plan is None:
            return "the group spans fewer than two topology levels"
        if x.dim() == 0 or x.shape[0] % len(plan.ranks):
            return "the input does not split into equal chunks"
        return None

    def start(
        self, x: torch.Tensor, group: Any = None, *, pollable: bool = True, receives_first: bool | None = None
    ) -> HierarchicalHandle:
        """Start an exchange of ``x`` (split along dim 0, equal chunks) over ``group`` (default: world).

        ``pollable=True`` issues c10d works whose completion ``progress`` can test;
        ``pollable=False`` issues functional collectives (traceable by torch.compile), which only
        ``wait`` advances. On gloo groups the phases are receives-first p2p exchanges instead (both
        modes; pollable phases get a waiter thread), unless ``receives_first`` is False; while torch.compile traces, the functional collectives are
        used. Raises ValueError where :meth:`reason` says it cannot run: it never substitutes
        another algorithm.
        """
        group = group if group is not None else dist.group.WORLD
        why = self.reason(x, group)
        if why is not None:
            raise ValueError(f"hierarchical all-to-all: {why}")
        if receives_first is None:
            receives_first = uses_receives_first(group, x.device)
        p2p = bool(receives_first) and not torch.compiler.is_compiling()
        completion_driven = order.completion_driven(backend_name(group, x.device))
        return HierarchicalHandle(x, self._plan(group), self._pool, pollable, p2p, completion_driven)

    def __call__(self, x: torch.Tensor, group: Any = None, *, receives_first: bool | None = None) -> torch.Tensor:
        """Blocking exchange, same output as ``flat_all_to_all``."""
        return self.start(x, group, pollable=False, receives_first=receives_first).wait()

    def _plan(self, group: Any) -> _GroupPlan | None:
        group = group if group is not None else dist.group.WORLD
        if group not in self._plan_by_pg:
            self._plan_by_pg[group] = self._plans.get(tuple(sorted(dist.get_process_group_ranks(group))))
        return self._plan_by_pg[group]
