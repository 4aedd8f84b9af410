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

Receives-first exchanges (gloo). gloo's ``all_to_all_single`` posts each send before the matching
receive, and its tcp transport sends a receiver's "ready to receive" notice on the same stream as
that rank's outgoing data: a rank that posts late has its notice queued behind its whole outgoing
chunk, which serializes the two directions of a pair (measured: a 2-rank 8 MiB exchange took 2x
the line-rate time on an emulated 1 Gbit/s link). :func:`post_receives_first` posts every
``irecv`` of an equal-split exchange before any ``isend`` (gloo runs point-to-point operations in
call order; it does not coalesce), which removes that artefact while producing bitwise the same
output. It is used for the phases of the hierarchical exchange and, as ``flat-p2p``, for a whole
flat exchange, on process groups whose backend for the tensor's device is gloo; NCCL/XCCL keep the
functional collective. Point-to-point messages of one pair and tag are matched in posting order,
so in-flight exchanges stay correct under the same ordering rule as above. gloo's p2p works do
not report completion until waited on, so a pollable phase that ``progress`` must test gets a
short-lived thread that waits on its works (the wait releases the GIL) and sets an event.
In receives-first mode the hierarchical exchange also sends, at start, the chunks whose
destination differs from the sender only in the outermost coordinate straight to it (the inner
phases would only copy them locally), and its last phase leaves them out, so that part of the
slowest exchange overlaps the inner phases (rail 2x2, 4 MiB/rank: 31 -> 23 ms measured).
"""

from __future__ import annotations

import logging
import threading
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


#: Tag of the receives-first point-to-point messages (any tag works; a fixed non-default one keeps
#: them apart from user p2p traffic with the default tag 0 on the same group). Messages of one
#: pair and tag match in posting order; the hierarchical exchange's direct messages (posted at
#: start, see HierarchicalHandle) use their own tag so that they never meet phase messages.
P2P_TAG = 0x0CDF
DIRECT_TAG = P2P_TAG + 1
_RECEIVES_FIRST_BACKENDS = {"gloo"}
_backend_cache: dict[tuple[Any, str], str] = {}
_group_cache: dict[Any, tuple[int, int]] = {}


def backend_name(group: Any = None, device: torch.device | str = "cpu") -> str:
    """Name of the backend that runs collectives of ``group`` on ``device`` (``"gloo"``, ``"nccl"``...)."""
    group = group if group is not None else dist.group.WORLD
    dev = torch.device(device).type
    key = (group, dev)
    if key not in _backend_cache:
        config = str(dist.get_backend_config(group))  # "gloo", or "cpu:gloo,cuda:nccl"
        by_device = dict(item.split(":", 1) for item in config.split(",") if ":" in item)
        _backend_cache[key] = by_device.get(dev, config if not by_device else "").lower()
    return _backend_cache[key]


def uses_receives_first(group: Any = None, device: torch.device | str = "cpu") -> bool:
    """Whether exchanges over ``group`` on ``device`` use receives-first p2p: gloo on CPU tensors."""
    return torch.device(device).type == "cpu" and backend_name(group, device) in _RECEIVES_FIRST_BACKENDS


def _group_info(group: Any) -> tuple[int, int]:
    if group not in _group_cache:
        _group_cache[group] = (dist.get_rank(group), dist.get_world_size(group))
    return _group_cache[group]


def post_receives_first(
    out: torch.Tensor,
    inp: torch.Tensor,
    group: Any = None,
    *,
    skip_slot: tuple[int, int] | None = None,
    tag: int = P2P_TAG,
) -> list[Any]:
    """Post the equal-split exchange ``inp`` -> ``out`` over ``group``: every irecv, then every isend.

    ``inp`` and ``out`` are contiguous with the same number of elements, divisible by the group
    size W; chunk d of ``inp`` goes to group rank d, chunk s of ``out`` receives group rank s's
    chunk (``all_to_all_single`` with equal splits). Peers are visited in a staggered order
    (receive from me-1, me-2, ...; send to me+1, me+2, ...) so that ranks do not all target the
    same peer first. The own chunk is copied before returning. Returns the works: ``out`` is
    complete, and ``inp`` may be reused, only once all of them are waited on.

    ``skip_slot=(k, n)``: every chunk is n equal slots and slot k of the chunks exchanged with
    peers is neither sent nor received (it travels separately; the own chunk is copied whole).
    """
    group = group if group is not None else dist.group.WORLD
    me, world = _group_info(group)
    if inp.numel() != out.numel() or inp.numel() % world:
        raise ValueError(f"receives-first exchange needs equal sizes divisible by {world}: {inp.numel()}, {out.numel()}")
    send, recv = inp.view(world, -1), out.view(world, -1)

    def pieces(chunk: torch.Tensor) -> list[torch.Tensor]:
        if skip_slot is None:
            return [chunk] if chunk.numel() else []
        k, n = skip_slot
        slots = chunk.view(n, -1)
        return [p.reshape(-1) for p in (slots[:k], slots[k + 1 :]) if p.numel()]

    works = []
    for i in range(1, world):
        src = (me - i) % world
        works += [dist.irecv(p, group=group, tag=tag, group_src=src) for p in pieces(recv[src])]
    for i in range(1, world):
        dst = (me + i) % world
        works += [dist.isend(p, group=group, tag=tag, group_dst=dst) for p in pieces(send[dst])]
    recv[me].copy_(send[me])
    return [w for w in works if w is not None]


class _Completion:
    """Completion of a set of c10d works, pollable with ``done`` when ``poll`` is set.

    gloo's send/recv works report ``is_completed() == False`` until ``wait`` is called, so polling
    needs a waiter: one daemon thread per polled phase (a pool could queue one phase's waiter
    behind another that depends on this rank's progress).
    """

    def __init__(self, works: list[Any], poll: bool, buffers: Sequence[torch.Tensor] = ()) -> None:
        self._works = works
        self._buffers = list(buffers)  # memory the works read or write: alive until they complete
        self._event: threading.Event | None = None
        self._error: BaseException | None = None
        self._waited = not works
        if poll and works:
            self._event = threading.Event()
            threading.Thread(target=self._run, name="cocodiff-a2a-wait", daemon=True).start()

    def _run(self) -> None:
        try:
            for w in self._works:
                w.wait()
        except BaseException as e:  # re-raised by wait() in the caller's thread
            self._error = e
        finally:
            self._event.set()

    def __del__(self) -> None:
        # A handle dropped without wait(): destroying gloo works before they complete cancels
        # their buffers, and a peer's message would then match the NEXT exchange's receive on
        # this pair (wrong data or a hang). Let a thread own them until they complete.
        if not self._waited and self._event is None:
            works, buffers = self._works, self._buffers
            try:
                threading.Thread(target=_drain, args=(works, buffers), name="cocodiff-a2a-drain", daemon=True).start()
            except RuntimeError:  # interpreter shutting down: nothing left to protect
                pass

    def done(self) -> bool:
        return self._waited or (self._event is not None and self._event.is_set())

    def wait(self) -> None:
        if self._waited:
            return
        if self._event is None:
            for w in self._works:
                w.wait()
        else:
            self._event.wait()
            if self._error is not None:
                raise self._error
        self._waited = True
        self._buffers = []


def _drain(works: list[Any], buffers: list[torch.Tensor]) -> None:
    try:
        for w in works:
            w.wait()
    except BaseException as e:  # nobody is left to raise it to
        logger.warning("an all-to-all that was never waited on failed: %s", e)


class ReceivesFirstHandle:
    """A flat equal-split all-to-all in flight as receives-first p2p (``flat-p2p``): one phase,
    posted at creation. The input must not be modified before ``wait`` (as with the flat handle)."""

    def __init__(self, x: torch.Tensor, group: Any) -> None:
        self._dtype = x.dtype
        self._inp = _comm_view(x)  # kept alive until the sends complete
        self._out = torch.empty_like(self._inp)
        works = post_receives_first(self._out.view(-1), self._inp.view(-1), group)
        self._done = _Completion(works, poll=False, buffers=(self._inp, self._out))
        self._result: torch.Tensor | None = None

    def progress(self) -> bool:
        return True

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._done.wait()
            self._result = self._out.view(self._dtype)
            self._inp = None
        return self._result


def _p2p_eligible(x: torch.Tensor, group: Any) -> bool:
    return (
        uses_receives_first(group, x.device)
        and not torch.compiler.is_compiling()
        and x.dim() > 0
        and x.shape[0] % _group_info(group)[1] == 0
    )


def start_p2p_all_to_all(
    x: torch.Tensor,
    group: Any = None,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
) -> AllToAllHandle:
    """Start the ``flat-p2p`` exchange: ``flat`` with every receive posted before any send.

    Equal splits over a gloo group only; uneven splits, other backends (NCCL/XCCL keep the
    functional collective) and torch.compile tracing start the flat exchange instead.
    """
    group = group if group is not None else dist.group.WORLD
    if output_split_sizes is not None or input_split_sizes is not None or not _p2p_eligible(x, group):
        return start_flat_all_to_all(x, group, output_split_sizes, input_split_sizes)
    return ReceivesFirstHandle(x, group)


def p2p_all_to_all(
    x: torch.Tensor,
    group: Any = None,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
) -> torch.Tensor:
    """Blocking ``flat-p2p`` exchange, same contract as :func:`flat_all_to_all`."""
    return start_p2p_all_to_all(x, group, output_split_sizes, input_split_sizes).wait()


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
    index: int = 0  # this rank's position in ``ranks`` (its group rank)


@dataclass
class _Pending:
    """One launched phase: its output, and the c10d work (or p2p completion) when there is one."""

    out: torch.Tensor
    work: Any = None  # c10d Work (pollable collective) or _Completion (receives-first p2p)
    held: list[torch.Tensor] = field(default_factory=list)  # pool buffers read by the collective
    src: torch.Tensor | None = None  # the phase's input, kept alive until its sends complete

    def done(self) -> bool:
        # Functional collectives cannot be polled: only wait() completes them.
        if isinstance(self.work, _Completion):
            return self.work.done()
        return self.work is not None and self.work.is_completed()

    def wait(self) -> torch.Tensor:
        if self.work is None:
            return _wait(self.out)
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
        self, x: torch.Tensor, plan: _GroupPlan, pool: _BufferPool, pollable: bool, receives_first: bool = False
    ) -> None:
        self._plan = plan
        self._pool = pool
        self._pollable = pollable
        self._p2p = receives_first
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
        self._direct: _Completion | None = None
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
        works = []
        if send.shape[2]:
            for i in range(1, levels[0]):
                src = (me - i) % levels[0]
                works.append(dist.irecv(recv[src, own], group=group, tag=DIRECT_TAG, group_src=src))
            for i in range(1, levels[0]):
                dst = (me + i) % levels[0]
                works.append(dist.isend(send[dst, own], group=group, tag=DIRECT_TAG, group_dst=dst))
        self._direct = _Completion([w for w in works if w is not None], poll=False, buffers=(data, out))
        self._final_out, self._slot = out, (own, slots)

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
            if self._direct is not None:
                self._direct.wait()
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
        if self._p2p:
            if last:  # the direct chunks are already on their way into the final output
                out, skip = self._final_out, self._slot
                self._final_out = None
            else:
                out, skip = self._pool.acquire(data.numel(), data.dtype, data.device), None
            works = post_receives_first(out, data, group, skip_slot=skip)
            # Only a non-final phase of a pollable handle is ever polled (progress stops at the last).
            done = _Completion(works, self._pollable and not last, (out, data))
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

    def __init__(
        self, topology: Topology, groups: Sequence[Sequence[int]], receives_first: bool | None = None
    ) -> None:
        topology.validate(dist.get_world_size())
        rank = dist.get_rank()
        self.topology = topology
        # None: receives-first p2p phases where the backend is gloo (uses_receives_first).
        self.receives_first = receives_first
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
                self._plans[ranks] = _GroupPlan(ranks, tuple(levels), level_groups, index=ranks.index(rank))
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
        receives_first: bool | None = None,
    ) -> AllToAllHandle:
        """Start an exchange of ``x`` (split along dim 0) over ``group`` (default: world).

        Uneven splits use the flat exchange. ``pollable=True`` issues c10d works whose completion
        ``progress`` can test; ``pollable=False`` issues functional collectives (traceable by
        torch.compile), which only ``wait`` advances. On gloo groups the phases are receives-first
        p2p exchanges instead (both modes; pollable phases get a waiter thread), unless
        ``receives_first`` (default: the instance's setting) is False; while torch.compile traces,
        the functional collectives are used.
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
        if receives_first is None:
            receives_first = self.receives_first
        if receives_first is None:
            receives_first = uses_receives_first(group, x.device)
        p2p = bool(receives_first) and not torch.compiler.is_compiling()
        return HierarchicalHandle(x, plan, self._pool, pollable, p2p)

    def __call__(
        self,
        x: torch.Tensor,
        group: Any = None,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        *,
        receives_first: bool | None = None,
    ) -> torch.Tensor:
        """Blocking exchange, same contract as ``flat_all_to_all``."""
        return self.start(
            x, group, output_split_sizes, input_split_sizes, pollable=False, receives_first=receives_first
        ).wait()

    def clear_buffers(self) -> None:
        self._pool.clear()

    def _plan(self, group: Any) -> _GroupPlan | None:
        group = group if group is not None else dist.group.WORLD
        if group not in self._plan_by_pg:
            self._plan_by_pg[group] = self._plans.get(tuple(sorted(dist.get_process_group_ranks(group))))
        return self._plan_by_pg[group]
