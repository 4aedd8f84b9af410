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

Two levels in receives-first mode (:class:`TwoLevelHandle`, the rail and shared-uplink
shapes): no re-blocking copies at all, every chunk is sent and received in place, and half of
each relayed chunk goes over the slow level first, so the slow links are busy from the start.

Pipelining (``parts`` > 1, chosen by the autotune). Every destination chunk is cut into
``parts`` equal slices and each slice set is exchanged by its own handle, all started at once;
``wait`` then advances them phase by phase, part by part (phase 2 of part 1, phase 2 of part 2,
...), so the slow level starts on the first part while the fast level still moves the next
ones. The parts read the input in place and, in receives-first mode, write straight into the
slices of the final output (one message per slot), so pipelining adds no copy; with collectives
(NCCL, XCCL) each part's output is copied into place. The launch sequence is a fixed function of
the program (the parts are handles started in order), so the ordering rule above covers it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from .. import commstats
from . import faults, order
from .flat import (
    DIRECT_TAG,
    FORWARD_TAG,
    P2P_TAG,
    AllToAllHandle,
    Completion,
    backend_name,
    comm_view,
    post_pieces,
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
        out: torch.Tensor | None = None,
        layout: Sequence[int] | None = None,
    ) -> None:
        """``x``: the input, contiguous, or a ``[W, c]`` view whose rows are contiguous (a part of
        a pipelined exchange). ``out``: where receives-first mode writes the result, ``[W, c]``
        with contiguous rows (default: a new tensor); a strided ``out`` is received one slot
        (row) per message, on every rank alike. ``layout``: the memory order of the level dims
        of a contiguous ``x`` (default: destination-major, ``0, 1, ...``); in
        :meth:`HierarchicalAllToAll.input_layout` the first phase needs no re-blocking copy."""
        data = self._bind(x, plan, pool, pollable, receives_first, completion_driven).view(len(plan.ranks), -1)
        self._chunk = data.shape[1]
        self._dest = out
        self._order = list(layout) if layout is not None else list(range(len(plan.levels)))  # memory order of the level dims
        # The current phase's input (1-D, or a part's strided rows), or its output once waited.
        self._data = data.view(-1) if data.is_contiguous() else data
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

    def _bind(
        self, x: torch.Tensor, plan: _GroupPlan, pool: _BufferPool, pollable: bool, p2p: bool, completion_driven: bool
    ) -> torch.Tensor:
        """The state every handle keeps; returns ``x`` as the exchange reads it (contiguous, or a
        part's ``[W, c]`` view with contiguous rows)."""
        self._plan, self._pool, self._pollable, self._completion_driven = plan, pool, pollable, completion_driven
        self._p2p = p2p
        self._shape, self._dtype = x.shape, x.dtype
        return comm_view(x) if x.dim() != 2 or x.is_contiguous() else x

    def _post_direct(self, data: torch.Tensor) -> None:
        levels = self._plan.levels
        slots = len(self._plan.ranks) // levels[0]
        me, own = divmod(self._plan.index, slots)  # outermost coordinate, position in the block
        coords = [me, *(int(c) for c in torch.unravel_index(torch.tensor(own), levels[1:]))]
        group = self._plan.level_groups[0]
        # The final output: the last phase fills the rest.
        out = self._dest if self._dest is not None else data.new_empty(data.shape)
        recv = out.view(levels[0], slots, -1)
        send = data.view([levels[d] for d in self._order] + [self._chunk])

        def to(dst: int) -> torch.Tensor:  # the chunk for the rank differing in coordinate 0 only
            return send[tuple(dst if d == 0 else coords[d] for d in self._order)]

        order.launched(group, "p2p direct", role=f"level 0 of {levels}")
        works = []
        if self._chunk:
            for i in range(1, levels[0]):
                src = (me - i) % levels[0]
                works.append(dist.irecv(recv[src, own], group=group, tag=DIRECT_TAG, group_src=src))
            for i in range(1, levels[0]):
                dst = (me + i) % levels[0]
                works.append(dist.isend(to(dst), group=group, tag=DIRECT_TAG, group_dst=dst))
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
            while earlier._phase < min(following, earlier._last):
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
            commstats.count_copy(data.numel() * data.element_size())
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
            if out.is_contiguous():
                works = post_receives_first(out.view(-1), data.view(-1), group, skip_slot=skip)
            else:
                works = _post_slots(out, data, group, skip)
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


class TwoLevelHandle(HierarchicalHandle):
    """The receives-first exchange of a two-level plan: copy-free, its slow links busy from the start.

    A chunk ``x[d0, j]`` (destination node ``d0``, inner coordinate ``j``) for another node and
    another inner coordinate must cross one slow link and one fast one. Its first half goes
    inner-first (to inner peer ``j``, which relays it to node ``d0``), its second half
    outer-first (to the rank of this rail on node ``d0``, which forwards it to inner peer ``j``),
    so the slow links carry data from the start instead of waiting for an inner phase. In order:

    0. at start, over the outer level: the direct chunks (``j`` = own) and the outer-first
       halves; then over the inner level the inner-first halves, then the chunks for this node;
    1. once the inner-first halves are in: over the outer level, relay them to their nodes;
    2. once the outer-first halves are in: over the inner level, forward them.

    Every piece is a contiguous chunk (or half) of the input, a relay buffer or the output, sent
    and received in place, so the only local copy is the own chunk (1/W of the data). Forwarded
    halves use their own tag: phase 2 launches on completion (on gloo), and must never match a
    later exchange's inner-phase messages. The phases follow :class:`HierarchicalHandle`'s launch
    rule (rail 2x4, 16 MiB/rank, separate runs: 122 ms with re-blocking copies, 99 ms copy-free
    relaying inner-first only, 81-91 ms with both routes).
    """

    _last = 2
    _PHASES = ("inner level, chunks to relay and for this node", "outer level, relayed halves", "inner level, forwarded halves")

    def __init__(
        self,
        x: torch.Tensor,
        plan: _GroupPlan,
        pool: _BufferPool,
        pollable: bool,
        receives_first: bool = True,
        completion_driven: bool = False,
        out: torch.Tensor | None = None,
    ) -> None:
        data = self._bind(x, plan, pool, pollable, receives_first, completion_driven)
        l0, l1 = plan.levels
        self._src = data.view(l0, l1, -1)
        c = self._src.shape[2]
        self._half = c // 2  # inner-first: [:half]; outer-first: [half:]
        self._final = out if out is not None else data.new_empty(l0 * l1, c)
        self._out = self._final.view(l0, l1, c)
        self._relay = data.new_empty(l0, l1, self._half)  # inner-first halves: [destination node, inner source]
        self._forward = data.new_empty(l0, l1, c - self._half)  # outer-first halves: [source node, destination]
        self._me = divmod(plan.index, l1)
        self._phase, self._pending, self._result = -1, None, None
        self._tail: list[tuple[str, Completion]] = []  # waited at the end: (what, completion)
        m0, m1 = self._me
        h = self._half
        self._out[m0, m1].copy_(self._src[m0, m1])
        commstats.count_copy(c * self._src.element_size())
        outer = plan.level_groups[0]
        order.launched(outer, "p2p direct and outer-first", role=f"level 0 of {plan.levels}")
        others = [j for j in range(l1) if j != m1]
        works = post_pieces(
            [[self._out[s0, m1], *(self._forward[s0, j] for j in others)] for s0 in range(l0)],
            [[self._src[d0, m1], *(self._src[d0, j, h:] for j in others)] for d0 in range(l0)],
            outer,
            DIRECT_TAG,
        )
        self._direct = Completion(works, poll=pollable and completion_driven, buffers=(self._src, self._final, self._forward))
        plan.in_flight.append(self)
        self._launch_next()

    def _launch_next(self) -> None:
        self._phase += 1
        l0, l1 = self._plan.levels
        m0, m1 = self._me
        h = self._half
        buffers = (self._src, self._relay, self._forward, self._final)
        level = (1, 0, 1)[self._phase]
        group = self._plan.level_groups[level]
        order.launched(group, f"phase {self._phase + 1}", role=f"level {level} of {self._plan.levels}")
        if self._phase == 0:
            nodes = [d0 for d0 in range(l0) if d0 != m0]
            works = post_pieces(
                [[self._relay[d0, j] for d0 in nodes] for j in range(l1)],
                [[self._src[d0, j, :h] for d0 in nodes] for j in range(l1)],
                group,
                P2P_TAG,
            )
            local = post_pieces([[self._out[m0, j]] for j in range(l1)], [[self._src[m0, j]] for j in range(l1)], group, P2P_TAG)
            self._tail.append(("this node's chunks", Completion(local, poll=False, buffers=buffers)))
            self._pending = _Pending(self._final, Completion(works, self._pollable, buffers))
        elif self._phase == 1:
            others = [j for j in range(l1) if j != m1]
            works = post_pieces(
                [[self._out[s0, j, :h] for j in others] for s0 in range(l0)],
                [[self._relay[d0, j] for j in others] for d0 in range(l0)],
                group,
                P2P_TAG,
            )
            self._tail.append(("relayed halves", Completion(works, poll=False, buffers=buffers)))
            self._pending = _Pending(self._final, self._direct)  # phase 2 waits for the outer-first halves
        else:
            nodes = [s0 for s0 in range(l0) if s0 != m0]
            works = post_pieces(
                [[self._out[s0, j, h:] for s0 in nodes] for j in range(l1)],
                [[self._forward[s0, j] for s0 in nodes] for j in range(l1)],
                group,
                FORWARD_TAG,
            )
            self._pending = _Pending(self._final, Completion(works, poll=False, buffers=buffers))
            self._plan.in_flight.remove(self)
            self._src = self._relay = self._forward = None

    def _finish_phase(self) -> torch.Tensor:
        try:
            return self._pending.wait()
        except RuntimeError as e:
            level = (1, 0, 1)[self._phase]
            raise faults.failed(f"phase {self._phase + 1} of 3 ({self._PHASES[self._phase]}), sub-group {self._plan.level_ranks[level]}", e) from e

    def wait(self) -> torch.Tensor:
        if self._result is None:
            result = super().wait()
            for what, done in self._tail:
                try:
                    done.wait()
                except RuntimeError as e:
                    raise faults.failed(f"{what}, group {self._plan.ranks}", e) from e
            self._tail = []
            return result
        return self._result


def _post_slots(out: torch.Tensor, data: torch.Tensor, group: Any, skip: tuple[int, int] | None) -> list[Any]:
    """The receives-first exchange of :func:`post_receives_first` into an ``out`` whose slots
    (rows) are contiguous but not adjacent: one message per slot and peer, slot ``skip[0]`` left
    out of the peers' chunks. Every rank of a pipelined exchange posts this way (senders match
    their receivers' messages)."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    k, slots = skip if skip is not None else (-1, out.shape[0] // world)
    send, recv = data.view(world, slots, -1), out.view(world, slots, -1)

    def pieces(chunk: torch.Tensor) -> list[torch.Tensor]:
        return [chunk[j] for j in range(slots) if j != k]

    order.launched(group, f"p2p (tag {P2P_TAG}, per slot)")
    works = post_pieces([pieces(c) for c in recv], [pieces(c) for c in send], group, P2P_TAG)
    recv[me].copy_(send[me])
    commstats.count_copy(send[me].numel() * send.element_size())
    return works


class PipelinedHandle:
    """A hierarchical all-to-all cut into ``parts`` along every destination chunk, each part its
    own :class:`HierarchicalHandle` (see the module docstring)."""

    def __init__(self, x: torch.Tensor, parts: int, start: Callable[..., HierarchicalHandle], world: int, p2p: bool) -> None:
        self._shape, self._dtype = x.shape, x.dtype
        data = comm_view(x).view(world, parts, -1)
        self._out = torch.empty_like(data)
        self._p2p = p2p
        self._parts = [start(data[:, p], out=self._out[:, p] if p2p else None) for p in range(parts)]
        self._result: torch.Tensor | None = None

    def progress(self) -> bool:
        return all([h.progress() for h in self._parts])

    def wait(self) -> torch.Tensor:
        if self._result is None:
            last = self._parts[0]._last
            for phase in range(1, last + 1):  # phase by phase, part by part: the pipeline
                for h in self._parts:
                    while h._phase < phase and h._result is None:
                        h._step(block=True)
            for p, h in enumerate(self._parts):
                out = h.wait()
                if not self._p2p:
                    self._out[:, p].copy_(out.view(self._out.shape[0], -1))
                    commstats.count_copy(out.numel() * out.element_size())
            self._result = self._out.view(self._dtype).view(self._shape)
            self._parts = []
        return self._result


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

    def input_layout(self, group: Any = None, device: torch.device | str = "cpu") -> tuple[int, ...]:
        """The memory order of the level dims (outermost = 0) in which the exchange reads its input
        without a copy: destination-major for the two-level receives-first exchange (it sends
        chunks in place), else the innermost level first (the first phase's order). A caller
        that writes its data in this order (and passes it as ``layout``) saves the first
        re-blocking copy."""
        k = len(self.levels(group))
        group = group if group is not None else dist.group.WORLD
        if k == 2 and uses_receives_first(group, device) and not torch.compiler.is_compiling():
            return (0, 1)
        return (k - 1, *range(k - 1)) if k else ()

    def levels(self, group: Any = None) -> tuple[int, ...]:
        """Level sizes of ``group`` on this topology; () when it uses the flat exchange."""
        plan = self._plan(group)
        return plan.levels if plan is not None else ()

    def reason(self, x: torch.Tensor, group: Any = None, parts: int = 1) -> str | None:
        """Why the hierarchical exchange in ``parts`` cannot exchange ``x`` over ``group`` (None: it can)."""
        plan = self._plan(group)
        if plan is None:
            return "the group spans fewer than two topology levels"
        if x.dim() == 0 or x.shape[0] % len(plan.ranks):
            return "the input does not split into equal chunks"
        if parts < 1 or x.numel() % (len(plan.ranks) * parts):
            return f"the chunks do not split into {parts} equal parts"
        return None

    def start(
        self,
        x: torch.Tensor,
        group: Any = None,
        *,
        pollable: bool = True,
        receives_first: bool | None = None,
        parts: int = 1,
        layout: Sequence[int] | None = None,
    ) -> HierarchicalHandle | PipelinedHandle:
        """Start an exchange of ``x`` (split along dim 0, equal chunks) over ``group`` (default: world),
        pipelined in ``parts``. ``layout``: the memory order of ``x``'s level dims (default
        destination-major; see :meth:`input_layout`).

        ``pollable=True`` issues c10d works whose completion ``progress`` can test;
        ``pollable=False`` issues functional collectives (traceable by torch.compile), which only
        ``wait`` advances. On gloo groups the phases are receives-first p2p exchanges instead (both
        modes; pollable phases get a waiter thread), unless ``receives_first`` is False; while torch.compile traces, the functional collectives are
        used. Raises ValueError where :meth:`reason` says it cannot run: it never substitutes
        another algorithm.
        """
        group = group if group is not None else dist.group.WORLD
        why = self.reason(x, group, parts)
        if why is not None:
            raise ValueError(f"hierarchical all-to-all: {why}")
        if receives_first is None:
            receives_first = uses_receives_first(group, x.device)
        p2p = bool(receives_first) and not torch.compiler.is_compiling()
        completion_driven = order.completion_driven(backend_name(group, x.device))
        plan = self._plan(group)
        handle = TwoLevelHandle if p2p and len(plan.levels) == 2 else HierarchicalHandle
        start = partial(
            handle, plan=plan, pool=self._pool, pollable=pollable, receives_first=p2p, completion_driven=completion_driven
        )
        canonical = layout is None or tuple(layout) == tuple(range(len(plan.levels)))
        if not canonical and (parts > 1 or handle is TwoLevelHandle):
            raise ValueError(f"hierarchical all-to-all: this exchange reads destination-major input, not layout {tuple(layout)}")
        if parts > 1:
            return PipelinedHandle(x, parts, start, len(plan.ranks), p2p)
        return start(x) if canonical else start(x, layout=layout)

    def __call__(
        self, x: torch.Tensor, group: Any = None, *, receives_first: bool | None = None, parts: int = 1
    ) -> torch.Tensor:
        """Blocking exchange, same output as ``flat_all_to_all``."""
        return self.start(x, group, pollable=False, receives_first=receives_first, parts=parts).wait()

    def _plan(self, group: Any) -> _GroupPlan | None:
        group = group if group is not None else dist.group.WORLD
        if group not in self._plan_by_pg:
            self._plan_by_pg[group] = self._plans.get(tuple(sorted(dist.get_process_group_ranks(group))))
        return self._plan_by_pg[group]
