"""Flat all-to-all exchanges for Ulysses sequence parallelism: stock and receives-first.

xfuser's Ulysses exchange is ``all_to_all_single`` with equal splits: the input is cut along
dim 0 into W equal chunks, chunk d goes to group rank d, and the output holds the chunk from
group rank s at position s. ``flat`` is that exchange through functional collectives (what
xfuser does); ``flat-p2p`` produces bitwise the same output with point-to-point messages.
Which of them (or TAPA, :mod:`.tapa`) runs is decided in :mod:`.registry` only: the functions
here refuse what they cannot do instead of substituting another algorithm.

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
so in-flight exchanges stay correct under the ordering rule of :mod:`.order`. gloo's p2p works do
not report completion until waited on, so a pollable phase that ``progress`` must test gets a
short-lived thread that waits on its works (the wait releases the GIL) and sets an event.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from .. import commstats
from . import faults, order

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


def wait_collective(t: torch.Tensor) -> torch.Tensor:
    # Under tracing functional collectives return plain tensors with the wait already inserted.
    return t.wait() if isinstance(t, fc.AsyncCollectiveTensor) else t


def comm_view(x: torch.Tensor) -> torch.Tensor:
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
        order.launched(group, "all_to_all_single")
        self._out: torch.Tensor = fc.all_to_all_single(comm_view(x), output_split_sizes, input_split_sizes, group)
        self._done = False

    def progress(self) -> bool:
        return True

    def wait(self) -> torch.Tensor:
        if not self._done:
            self._out = wait_collective(self._out).view(self._dtype)
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
#: start, see HierarchicalHandle) use their own tag so that they never meet phase messages, and so
#: do the halves a two-level exchange forwards (see TwoLevelHandle).
P2P_TAG = 0x0CDF
DIRECT_TAG = P2P_TAG + 1
FORWARD_TAG = P2P_TAG + 3  # + 2 is V-Major's (sparse.SPARSE_TAG)
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
    complete, and ``inp`` may be reused, only once all of them are waited on (:func:`post_pieces`
    says the posting order).

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

    order.launched(group, f"p2p (tag {tag})")
    works = post_pieces([pieces(chunk) for chunk in recv], [pieces(chunk) for chunk in send], group, tag)
    recv[me].copy_(send[me])
    commstats.count_copy(send[me].numel() * send.element_size())
    return works


def post_pieces(
    recv: Sequence[Sequence[torch.Tensor]], send: Sequence[Sequence[torch.Tensor]], group: Any, tag: int
) -> list[Any]:
    """Post the receives of ``recv[src]`` from every peer, then the sends of ``send[dst]`` to every
    peer (group ranks; this rank's own entries are left alone), and return the works. Peers are
    visited staggered (receive from me-1, me-2, ...; send to me+1, me+2, ...) so that ranks do not
    all target the same peer first; empty tensors are skipped (both sides know the sizes)."""
    me, world = _group_info(group)
    works = []
    for i in range(1, world):
        src = (me - i) % world
        works += [dist.irecv(p, group=group, tag=tag, group_src=src) for p in recv[src] if p.numel()]
    for i in range(1, world):
        dst = (me + i) % world
        works += [dist.isend(p, group=group, tag=tag, group_dst=dst) for p in send[dst] if p.numel()]
    return [w for w in works if w is not None]


class Completion:
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
                w.wait(faults.timeout())
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
                w.wait(faults.timeout())
        else:
            # The waiter's own wait is bounded; this one only guards against a lost thread.
            if not self._event.wait(2 * faults.timeout().total_seconds()):
                raise faults.ExchangeFailed("the point-to-point waiter did not finish")
            if self._error is not None:
                raise self._error
        self._waited = True
        self._buffers = []


def _drain(works: list[Any], buffers: list[torch.Tensor]) -> None:
    try:
        for w in works:
            w.wait(faults.timeout())
    except BaseException as e:  # nobody is left to raise it to
        logger.warning("an all-to-all that was never waited on failed: %s", e)


class ReceivesFirstHandle:
    """A flat equal-split all-to-all in flight as receives-first p2p (``flat-p2p``): one phase,
    posted at creation. The input must not be modified before ``wait`` (as with the flat handle)."""

    def __init__(self, x: torch.Tensor, group: Any) -> None:
        self._dtype = x.dtype
        self._inp = comm_view(x)  # kept alive until the sends complete
        self._out = torch.empty_like(self._inp)
        works = post_receives_first(self._out.view(-1), self._inp.view(-1), group)
        self._done = Completion(works, poll=False, buffers=(self._inp, self._out))
        self._result: torch.Tensor | None = None

    def progress(self) -> bool:
        return True

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._done.wait()
            self._result = self._out.view(self._dtype)
            self._inp = None
        return self._result


def p2p_reason(x: torch.Tensor, group: Any = None) -> str | None:
    """Why ``flat-p2p`` cannot exchange ``x`` over ``group`` (None: it can)."""
    group = group if group is not None else dist.group.WORLD
    if not uses_receives_first(group, x.device):
        return "receives-first exchanges are for gloo groups on CPU tensors"
    if torch.compiler.is_compiling():
        return "point-to-point messages cannot be traced by torch.compile"
    if x.dim() == 0 or x.shape[0] % _group_info(group)[1]:
        return "the input does not split into equal chunks"
    return None


def start_p2p_all_to_all(x: torch.Tensor, group: Any = None) -> ReceivesFirstHandle:
    """Start the ``flat-p2p`` exchange: ``flat`` with every receive posted before any send.

    Equal splits over a gloo group only (:func:`p2p_reason` says why not); it never substitutes
    another algorithm.
    """
    group = group if group is not None else dist.group.WORLD
    reason = p2p_reason(x, group)
    if reason is not None:
        raise ValueError(f"flat-p2p all-to-all: {reason}")
    return ReceivesFirstHandle(x, group)


def p2p_all_to_all(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Blocking ``flat-p2p`` exchange, same output as :func:`flat_all_to_all`."""
    return start_p2p_all_to_all(x, group).wait()
