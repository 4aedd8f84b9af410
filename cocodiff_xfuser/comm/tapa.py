"""TAPA: the topology-aware (hierarchical) all-to-all, bitwise equal to the flat exchange.

A group whose ranks form a regular sub-grid of the topology has levels ``(s_0, ..., s_{k-1})``,
outermost (slowest links) first, and group rank ``g = ravel(g_0, ..., g_{k-1})``. Its exchange is
a few batches of point-to-point operations on the levels' sub-groups (:mod:`.transport`, the same
code on gloo, NCCL and XCCL), in one of two strategies:

* :class:`TwoLevelHandle` (``k = 2``, the rail and shared-uplink shapes): no re-blocking copy;
  every chunk is sent and received in place, and half of each chunk that must cross both levels
  goes over the slow level first, so the slow links are busy from the start;
* :class:`HierarchicalHandle` (any ``k``; used from ``k = 3``): levels innermost first, Tutel's 2DH
  generalized. A rank's data is viewed as ``[s_0, ..., s_{k-1}, c]`` by destination coordinates;
  per level a strided copy brings that level's dim to the front and a batch over the ranks that
  differ only in that coordinate replaces the destination coordinate by the source coordinate.
  The chunks whose destination differs only in the outermost coordinate go there directly at
  start, overlapping the inner phases.

Program order (:mod:`.transport`). A handle posts its first batches at start, the next phase in
``advance`` and the rest in ``wait``, always at the same point of the program on every rank;
``advance`` first waits for the phase's inputs (on NCCL/XCCL a stream wait, which does not block
the host). Nothing is posted because something completed, so messages match by issue order alone.

Pipelining (``parts`` > 1, chosen by the autotune). Every destination chunk is cut into ``parts``
equal slices, each slice set exchanged by its own handle, all started at once; ``wait`` advances
them phase by phase, part by part, so the slow level starts on the first part while the fast level
still moves the next ones. The parts read the input in place and write straight into the slices of
the final output (one message per slot where a slice is strided), so pipelining adds no copy.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import partial
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .. import commstats
from . import subgroups, transport
from .subgroups import GroupPlan
from .topology import Topology


class _BufferPool:
    """Recycles the 1-D intermediate buffers of hierarchical exchanges.

    A buffer is in the pool only while nobody uses it: handles take buffers out and put them
    back once the batch reading them has completed (on NCCL/XCCL: once the current stream waits
    for it, so every later use, on that stream or a batch launched after it, comes after). Buffers are never returned to callers.
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


def _pieces(chunk: torch.Tensor, skip: int, per_slot: bool) -> list[torch.Tensor]:
    """The slots of ``chunk`` (``[S, c]``) but slot ``skip``, as messages: contiguous runs, or one
    per slot (``per_slot``; both sides of a message must cut it alike)."""
    runs = [(0, skip), (skip + 1, chunk.shape[0])] if skip >= 0 else [(0, chunk.shape[0])]
    pieces: list[torch.Tensor] = []
    for a, b in runs:
        if b > a:
            pieces += list(chunk[a:b]) if per_slot else [chunk[a:b].view(-1)]
    return pieces


def _post_level(
    out: torch.Tensor, data: torch.Tensor, plan: GroupPlan, level: int, what: str, skip: int = -1
) -> transport.Completion:
    """The equal-split exchange of ``data`` into ``out`` (both ``[n, S, c]``, chunk i for level peer
    i) over ``level``'s sub-group, slot ``skip`` of every chunk left out; the own chunk is copied."""
    group = plan.level_groups[level]
    me = transport.group_info(group)[0]
    per_slot = not out.is_contiguous()  # a part's strided slice of the output: one message per slot
    done = transport.post(
        [_pieces(c, skip, per_slot) for c in out], [_pieces(c, skip, per_slot) for c in data], group, plan.roles[level], what,
        (out, data),
    )
    transport.copy_own(out[me], data[me])
    return done


def _readable(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the exchange reads it: contiguous, or a part's ``[W, c]`` view with contiguous rows."""
    return transport.comm_view(x) if x.dim() != 2 or x.is_contiguous() else x


class HierarchicalHandle:
    """A k-level exchange in flight: one batch per level, innermost first, and the direct chunks."""

    def __init__(
        self,
        x: torch.Tensor,
        plan: GroupPlan,
        pool: _BufferPool,
        out: torch.Tensor | None = None,
        layout: Sequence[int] | None = None,
    ) -> None:
        """``x``: the input, contiguous, or a ``[W, c]`` view whose rows are contiguous (a part of
        a pipelined exchange). ``out``: where the result goes, ``[W, c]`` with contiguous rows
        (default: a new tensor). ``layout``: the memory order of the level dims of a contiguous
        ``x`` (default: destination-major, ``0, 1, ...``); in
        :meth:`HierarchicalAllToAll.input_layout` the first phase needs no re-blocking copy."""
        self._plan, self._pool = plan, pool
        self._shape, self._dtype = x.shape, x.dtype
        data = _readable(x).view(len(plan.ranks), -1)
        self._chunk = data.shape[1]
        self._order = list(layout) if layout is not None else list(range(len(plan.levels)))  # memory order of the level dims
        self._final = out if out is not None else data.new_empty(data.shape)
        self._last = len(plan.levels) - 1
        self._direct = self._post_direct(data)
        # The current phase's input (1-D, or a part's strided rows) until it is launched.
        self._data: torch.Tensor | None = data.view(-1) if data.is_contiguous() else data
        self._owned = False  # whether self._data is a pool buffer
        self._phase = -1
        self._pending: tuple[transport.Completion, torch.Tensor, list[torch.Tensor]] | None = None
        self._result: torch.Tensor | None = None
        self._launch_next()

    def _post_direct(self, data: torch.Tensor) -> transport.Completion:
        """Send the chunks for the ranks that differ from this one only in the outermost coordinate
        straight into their final place (the inner phases would only copy them locally)."""
        levels = self._plan.levels
        slots = len(self._plan.ranks) // levels[0]
        me, own = divmod(self._plan.index, slots)  # outermost coordinate, position in the block
        coords = [me, *(int(c) for c in torch.unravel_index(torch.tensor(own), levels[1:]))]
        self._skip = own  # the last phase leaves this slot out
        recv = self._final.view(levels[0], slots, -1)
        send = data.view([levels[d] for d in self._order] + [self._chunk])

        def to(dst: int) -> torch.Tensor:  # the chunk for the rank differing in coordinate 0 only
            return send[tuple(dst if d == 0 else coords[d] for d in self._order)]

        n = levels[0]
        return transport.post(
            [[recv[s, own]] for s in range(n)], [[to(d)] for d in range(n)], self._plan.level_groups[0], self._plan.roles[0],
            "direct chunks", (data, self._final),
        )

    def advance(self) -> bool:
        if self._phase < self._last:
            self._data, self._owned = self._complete_phase(), True
            self._launch_next()
        return self._phase == self._last

    def wait(self) -> torch.Tensor:
        if self._result is None:
            while not self.advance():
                pass
            self._complete_phase()
            self._direct.wait()
            self._result = self._final.view(self._dtype).view(self._shape)
        return self._result

    def _complete_phase(self) -> torch.Tensor:
        done, out, held = self._pending
        done.wait()
        for buf in held:
            self._pool.release(buf)
        self._pending = None
        return out

    def _launch_next(self) -> None:
        self._phase += 1
        levels = self._plan.levels
        level = self._last - self._phase
        data, held = self._data, []
        if self._order[0] != level:
            dims = [level] + [d for d in range(len(levels)) if d != level]
            buf = self._pool.acquire(data.numel(), data.dtype, data.device)
            commstats.count_copy(data.numel() * data.element_size())
            # copy_ into a preallocated buffer: transpose().contiguous() measured much slower (bf16).
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
        n = levels[level]
        what = f"phase {self._phase + 1} of {self._last + 1}"
        if self._phase == self._last:  # into the final output; the direct chunks are on their way
            out = self._final
            done = _post_level(out.view(n, -1, self._chunk), data.view(n, -1, self._chunk), self._plan, level, what, self._skip)
        else:
            out = self._pool.acquire(data.numel(), data.dtype, data.device)
            done = _post_level(out.view(n, 1, -1), data.view(n, 1, -1), self._plan, level, what)
        self._pending = (done, out, held)
        self._data, self._owned = None, False


class TwoLevelHandle:
    """The exchange of a two-level plan: copy-free, its slow links busy from the start.

    A chunk ``x[d0, j]`` (destination node ``d0``, inner coordinate ``j``) for another node and
    another inner coordinate must cross one slow link and one fast one. Its first half goes
    inner-first (to inner peer ``j``, which relays it to node ``d0``), its second half
    outer-first (to the rank of this rail on node ``d0``, which forwards it to inner peer ``j``),
    so the slow links carry data from the start instead of waiting for an inner phase. In order:

    0. at start, over the outer level: the direct chunks (``j`` = own) and the outer-first
       halves; over the inner level: the inner-first halves, then the chunks for this node;
    1. ``advance``, once the inner-first halves are in: over the outer level, relay them;
    2. ``advance``, once the outer-first halves are in: over the inner level, forward them.

    Every piece is a contiguous chunk (or half) of the input, a relay buffer or the output, sent
    and received in place, so the only local copy is the own chunk (1/W of the data): re-blocking
    copies, and relaying one route only, each measured slower (docs/benchmarks.md).
    """

    def __init__(self, x: torch.Tensor, plan: GroupPlan, out: torch.Tensor | None = None) -> None:
        self._plan = plan
        self._shape, self._dtype = x.shape, x.dtype
        data = _readable(x)
        l0, l1 = plan.levels
        src = data.view(l0, l1, -1)
        c = src.shape[2]
        h = c // 2  # inner-first: [:h]; outer-first: [h:]
        self._final = out if out is not None else data.new_empty(l0 * l1, c)
        self._out = self._final.view(l0, l1, c)
        self._relay = data.new_empty(l0, l1, h)  # inner-first halves: [destination node, inner source]
        self._forward = data.new_empty(l0, l1, c - h)  # outer-first halves: [source node, destination]
        self._half, self._me, self._phase = h, divmod(plan.index, l1), 0
        m0, m1 = self._me
        transport.copy_own(self._out[m0, m1], src[m0, m1])
        self._buffers = (src, self._relay, self._forward, self._final)
        others = [j for j in range(l1) if j != m1]
        nodes = [d0 for d0 in range(l0) if d0 != m0]
        self._direct = self._post(
            0, "direct chunks and outer-first halves",
            [[self._out[s0, m1], *(self._forward[s0, j] for j in others)] for s0 in range(l0)],
            [[src[d0, m1], *(src[d0, j, h:] for j in others)] for d0 in range(l0)],
        )
        self._inner_first = self._post(
            1, "inner-first halves", [[self._relay[d0, j] for d0 in nodes] for j in range(l1)],
            [[src[d0, j, :h] for d0 in nodes] for j in range(l1)],
        )
        self._posted = [self._post(1, "chunks for this node", [[self._out[m0, j]] for j in range(l1)], [[src[m0, j]] for j in range(l1)])]
        self._result: torch.Tensor | None = None

    def _post(self, level: int, what: str, recv: list, send: list) -> transport.Completion:
        group = self._plan.level_groups[level]
        return transport.post(recv, send, group, self._plan.roles[level], what, self._buffers)

    def advance(self) -> bool:
        l0, l1 = self._plan.levels
        m0, m1 = self._me
        h = self._half
        if self._phase == 0:
            self._inner_first.wait()
            others = [j for j in range(l1) if j != m1]
            self._posted.append(self._post(
                0, "relayed halves", [[self._out[s0, j, :h] for j in others] for s0 in range(l0)],
                [[self._relay[d0, j] for j in others] for d0 in range(l0)],
            ))
            self._phase = 1
        elif self._phase == 1:
            self._direct.wait()
            nodes = [s0 for s0 in range(l0) if s0 != m0]
            self._posted.append(self._post(
                1, "forwarded halves", [[self._out[s0, j, h:] for s0 in nodes] for j in range(l1)],
                [[self._forward[s0, j] for s0 in nodes] for j in range(l1)],
            ))
            self._phase = 2
        return self._phase == 2

    def wait(self) -> torch.Tensor:
        if self._result is None:
            while not self.advance():
                pass
            for done in self._posted:
                done.wait()
            self._posted, self._buffers = [], ()
            self._relay = self._forward = None
            self._result = self._final.view(self._dtype).view(self._shape)
        return self._result


class PipelinedHandle:
    """A hierarchical all-to-all cut into ``parts`` along every destination chunk, each part its
    own handle writing into its slice of the output (see the module docstring)."""

    def __init__(self, x: torch.Tensor, parts: int, start: Callable[..., Any], world: int) -> None:
        self._shape, self._dtype = x.shape, x.dtype
        data = transport.comm_view(x).view(world, parts, -1)
        self._out = torch.empty_like(data)
        self._parts = [start(data[:, p], out=self._out[:, p]) for p in range(parts)]
        self._result: torch.Tensor | None = None

    def advance(self) -> bool:
        return all([h.advance() for h in self._parts])  # every part one phase on: the pipeline

    def wait(self) -> torch.Tensor:
        if self._result is None:
            while not self.advance():
                pass
            for h in self._parts:
                h.wait()
            self._result = self._out.view(self._dtype).view(self._shape)
            self._parts = []
        return self._result


class HierarchicalAllToAll:
    """Topology-aware all-to-all for a fixed set of Ulysses groups.

    Construction is collective: every rank of the world must build it with the same
    ``topology`` and ``groups`` (the global ranks of every Ulysses group of the world), because
    it creates the per-level sub-groups (:mod:`.subgroups`). A rank keeps the plans of the
    groups it belongs to. Groups that are not regular sub-grids of the topology, span fewer than
    two levels, or are unknown use the flat exchange.
    """

    def __init__(self, topology: Topology, groups: Sequence[Sequence[int]]) -> None:
        topology.validate(dist.get_world_size())
        self.topology = topology
        self._pool = _BufferPool()
        #: The plans of this rank's groups, by sorted ranks (the PXN-like relay reads them too).
        self.plans = subgroups.plans(topology, groups)

    def input_layout(self, group: Any = None) -> tuple[int, ...]:
        """The memory order of the level dims (outermost = 0) in which the exchange reads its input
        without a copy: destination-major for the two-level exchange (it sends chunks in place),
        else the innermost level first (the first phase's order). A caller that writes its data
        in this order (and passes it as ``layout``) saves the first re-blocking copy."""
        k = len(self.levels(group))
        if k == 2:
            return (0, 1)
        return (k - 1, *range(k - 1)) if k else ()

    def levels(self, group: Any = None) -> tuple[int, ...]:
        """Level sizes of ``group`` on this topology; () when it uses the flat exchange."""
        plan = self.plan(group)
        return plan.levels if plan is not None else ()

    def reason(self, x: torch.Tensor, group: Any = None, parts: int = 1) -> str | None:
        """Why the hierarchical exchange in ``parts`` cannot exchange ``x`` over ``group`` (None: it can)."""
        plan = self.plan(group)
        if plan is None:
            return "the group spans fewer than two topology levels"
        if torch.compiler.is_compiling():
            return "point-to-point messages cannot be traced by torch.compile"
        if x.dim() == 0 or x.shape[0] % len(plan.ranks):
            return "the input does not split into equal chunks"
        if parts < 1 or x.numel() % (len(plan.ranks) * parts):
            return f"the chunks do not split into {parts} equal parts"
        return None

    def traced_reason(self, x: torch.Tensor, group: Any = None) -> str | None:
        """Why a compiled graph cannot hold this exchange of ``x`` over ``group`` as one functional
        all-to-all per level (None: it can)."""
        plan = self.plan(group)
        if plan is None:
            return "the group spans fewer than two topology levels"
        if x.dim() == 0 or x.numel() % len(plan.ranks):
            return "the input does not split into equal chunks"
        return None

    def start(
        self, x: torch.Tensor, group: Any = None, *, parts: int = 1, layout: Sequence[int] | None = None
    ) -> HierarchicalHandle | TwoLevelHandle | PipelinedHandle:
        """Start an exchange of ``x`` (split along dim 0, equal chunks) over ``group`` (default: world),
        pipelined in ``parts``. ``layout``: the memory order of ``x``'s level dims (default
        destination-major; see :meth:`input_layout`). Raises ValueError where :meth:`reason` says
        it cannot run: it never substitutes another algorithm.
        """
        group = group if group is not None else dist.group.WORLD
        why = self.reason(x, group, parts)
        if why is not None:
            raise ValueError(f"hierarchical all-to-all: {why}")
        plan = self.plan(group)
        if len(plan.levels) == 2:
            start = partial(TwoLevelHandle, plan=plan)
        else:
            start = partial(HierarchicalHandle, plan=plan, pool=self._pool)
        canonical = layout is None or tuple(layout) == tuple(range(len(plan.levels)))
        if not canonical and (parts > 1 or len(plan.levels) == 2):
            raise ValueError(f"hierarchical all-to-all: this exchange reads destination-major input, not layout {tuple(layout)}")
        if parts > 1:
            return PipelinedHandle(x, parts, start, len(plan.ranks))
        return start(x) if canonical else start(x, layout=layout)

    def __call__(self, x: torch.Tensor, group: Any = None, *, parts: int = 1) -> torch.Tensor:
        """Blocking exchange, same output as ``flat_all_to_all``."""
        return self.start(x, group, parts=parts).wait()

    def plan(self, group: Any = None) -> GroupPlan | None:
        """The plan of ``group`` (default: world): its levels and their sub-groups; None when it uses
        the flat exchange. The PXN-like reference (:mod:`.pxn`) relays over the same sub-groups."""
        return self.plans.get(transport.group_ranks(group if group is not None else dist.group.WORLD))
