"""All-to-all exchanges for Ulysses sequence parallelism: flat and topology-aware (TAPA).

xfuser's Ulysses exchange is ``all_to_all_single`` with equal splits: the input is cut along
dim 0 into W equal chunks, chunk d goes to group rank d, and the output holds the chunk from
group rank s at position s. The hierarchical exchange produces bitwise the same output.

Hierarchical exchange. A group whose ranks form a regular sub-grid of the topology has levels
``(s_0, ..., s_{k-1})``, outermost first, and group rank ``g = ravel(g_0, ..., g_{k-1})``. A
rank's data is viewed as ``[s_0, ..., s_{k-1}, c]`` indexed by destination coordinates. Levels
are processed innermost (fastest link) first: the level's dim is brought to the front by a
strided copy, then an all-to-all over the ranks that differ only in that coordinate replaces
the destination coordinate by the source coordinate. After the outermost level the data is in
canonical order, so k levels cost k copies and k exchanges (Tutel's 2DH for k = 2); the
exchanges of one phase run concurrently on disjoint sub-groups.

Ordering across ranks. Collectives on one process group must be issued in the same order on
every rank. Handles advance phases on their own (``progress``) depending on local completion,
which differs between ranks, so a handle only launches its next phase once every handle of the
same group started before it has launched that phase: per sub-group, launches then follow the
start order, which is the same on every rank (SPMD).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from .topology import Topology, restrict

logger = logging.getLogger("cocodiff_xfuser")

# gloo (and NCCL before torch 2.11) reject float8 collectives; the exchange is pure data
# movement, so a same-width integer view is exact.
_FP8_DTYPES = {
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
}


class AllToAllHandle(Protocol):
    def progress(self) -> bool:
        """Launch further phases whose inputs are ready, without blocking.

        Returns True once every phase has been launched (only ``wait`` is left).
        """

    def wait(self) -> torch.Tensor:
        """Block until the exchange is complete and return its output (same shape as input)."""


def _wait(t: torch.Tensor) -> torch.Tensor:
    # Under tracing functional collectives return plain tensors with the wait already inserted.
    return t.wait() if isinstance(t, fc.AsyncCollectiveTensor) else t


def _comm_view(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    return x.view(torch.uint8) if x.dtype in _FP8_DTYPES else x


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
        self._out: torch.Tensor = fc.all_to_all_single(_comm_view(x), output_split_sizes, input_split_sizes, group)
        self._done = False

    def progress(self) -> bool:
        return True

    def wait(self) -> torch.Tensor:
        if not self._done:
            self._out = _wait(self._out).view(self._dtype)
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

    def clear(self) -> None:
        self._free.clear()


@dataclass
class _GroupPlan:
    ranks: tuple[int, ...]
    levels: tuple[int, ...]
    # This rank's sub-group per level: ranks of the group differing only in that coordinate.
    level_groups: list[Any]
    in_flight: list[HierarchicalHandle] = field(default_factory=list)


@dataclass
class _Pending:
    """One launched phase: its output, and the c10d work when it can be polled."""

    out: torch.Tensor
    work: Any = None
    held: list[torch.Tensor] = field(default_factory=list)  # pool buffers read by the collective

    def done(self) -> bool:
        # Functional collectives cannot be polled: only wait() completes them.
        return self.work is not None and self.work.is_completed()

    def wait(self) -> torch.Tensor:
        if self.work is None:
            return _wait(self.out)
        self.work.wait()
        return self.out


class HierarchicalHandle:
    """A hierarchical all-to-all in flight: one phase per level, innermost first."""

    def __init__(self, x: torch.Tensor, plan: _GroupPlan, pool: _BufferPool, pollable: bool) -> None:
        self._plan = plan
        self._pool = pool
        self._pollable = pollable
        self._shape = x.shape
        self._dtype = x.dtype
        data = _comm_view(x).view(-1)
        self._chunk = data.numel() // len(plan.ranks)
        self._order = list(range(len(plan.levels)))  # memory order of the level dims
        self._data = data  # current phase's input, or its output once waited
        self._owned = False  # whether self._data is a pool buffer
        self._phase = -1
        self._pending: _Pending | None = None
        self._result: torch.Tensor | None = None
        plan.in_flight.append(self)
        self._launch_next()

    @property
    def _last(self) -> int:
        return len(self._plan.levels) - 1

    def progress(self) -> bool:
        while self._phase < self._last and self._step(block=False):
            pass
        return self._phase == self._last

    def wait(self) -> torch.Tensor:
        if self._result is None:
            while self._phase < self._last:
                self._step(block=True)
            out = self._pending.wait()
            self._release(self._pending.held)
            self._pending = None
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
        self._data = self._pending.wait()
        self._owned = True
        self._release(self._pending.held)
        self._pending = None
        self._launch_next()
        return True

    def _launch_next(self) -> None:
        self._phase += 1
        levels = self._plan.levels
        level = self._last - self._phase
        data, held = self._data, []
        if self._order[0] != level:
            order = [level] + [d for d in range(len(levels)) if d != level]
            buf = self._pool.acquire(data.numel(), data.dtype, data.device)
            # copy_ into a preallocated buffer: transpose().contiguous() measured ~10x slower (bf16).
            buf.view([levels[d] for d in order] + [self._chunk]).copy_(
                data.view([levels[d] for d in self._order] + [self._chunk]).permute(
                    [self._order.index(d) for d in order] + [len(levels)]
                )
            )
            if self._owned:
                self._pool.release(data)
            data, self._order, self._owned = buf, order, True
        if self._owned:
            held.append(data)
        group = self._plan.level_groups[level]
        last = self._phase == self._last
        if self._pollable:
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
            level_groups = []
            for j in range(len(levels)):
                mine = None
                for members in grid.movedim(j, -1).reshape(-1, levels[j]).tolist():
                    sub = [ranks[i] for i in members]
                    pg = dist.new_group(sub)
                    if rank in sub:
                        mine = pg
                level_groups.append(mine)
            if rank in ranks:
                self._plans[ranks] = _GroupPlan(ranks, tuple(levels), level_groups)
                logger.info("hierarchical all-to-all for group %s: levels %s", list(ranks), levels)

    def levels(self, group: Any = None) -> tuple[int, ...]:
        """Level sizes of ``group`` on this topology; () when it uses the flat exchange."""
        plan = self._plan(group)
        return plan.levels if plan is not None else ()

    def start(
        self,
        x: torch.Tensor,
        group: Any = None,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        *,
        pollable: bool = True,
    ) -> AllToAllHandle:
        """Start an exchange of ``x`` (split along dim 0) over ``group`` (default: world).

        Uneven splits use the flat exchange. ``pollable=True`` issues c10d works whose completion
        ``progress`` can test; ``pollable=False`` issues functional collectives (traceable by
        torch.compile), which only ``wait`` advances.
        """
        group = group if group is not None else dist.group.WORLD
        plan = self._plan(group)
        if (
            plan is None
            or output_split_sizes is not None
            or input_split_sizes is not None
            or x.dim() == 0
            or x.shape[0] % len(plan.ranks)
        ):
            return start_flat_all_to_all(x, group, output_split_sizes, input_split_sizes)
        return HierarchicalHandle(x, plan, self._pool, pollable)

    def __call__(
        self,
        x: torch.Tensor,
        group: Any = None,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> torch.Tensor:
        """Blocking exchange, same contract as ``flat_all_to_all``."""
        return self.start(x, group, output_split_sizes, input_split_sizes, pollable=False).wait()

    def clear_buffers(self) -> None:
        self._pool.clear()

    def _plan(self, group: Any) -> _GroupPlan | None:
        group = group if group is not None else dist.group.WORLD
        if group not in self._plan_by_pg:
            self._plan_by_pg[group] = self._plans.get(tuple(sorted(dist.get_process_group_ranks(group))))
        return self._plan_by_pg[group]
