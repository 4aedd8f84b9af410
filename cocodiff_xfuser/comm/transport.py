"""Batches of point-to-point operations: the one transport of every cocodiff exchange, and the only
module that knows backends.

Every exchange (``flat-p2p``, TAPA's phases, the two-level relay, pipelined parts, V-Major's sparse
exchanges) is a sequence of *batches*: one phase's receives and sends over one group. A batch is
posted with :func:`post` and completes with :meth:`Completion.wait`. The code path is the same on
every backend: ``dist.batch_isend_irecv`` of the batch's operations (NCCL runs it as one
``ncclGroupStart/End``, which is how NCCL builds its own all-to-all; XCCL as one oneCCL group; gloo
issues the operations one by one in list order, see ``torch.distributed.batch_isend_irecv``). Only
the order of the operations inside a batch differs, here and nowhere else:

* ``gloo``: every receive before any send. gloo's tcp transport queues a rank's "ready to receive"
  notice behind that rank's outgoing data, so a receive posted after a large send serializes the
  two directions of a pair (measured here: a 2-rank 8 MiB exchange took 2x the line-rate time on an
  emulated 1 Gbit/s link; gloo's own ``all_to_all_single`` posts sends first and pays it);
* ``xccl`` (and oneCCL's ``ccl``): every send before any receive. oneCCL replays grouped operations
  in enqueue order and a receive blocks until its peer reaches the send: a batch that lists a
  receive before its send deadlocked (meta-pytorch/torchcomms PR #2885);
* ``nccl``: one group, any order (the canonical one: receives, then sends).

Peers are visited staggered (receive from me-1, me-2, ...; send to me+1, me+2, ...) so that ranks do
not all target the same peer first. Zero-size pieces are left out on both sides (both know the sizes).

No tags. NCCL ignores them and matches a pair's messages on one communicator by issue order, so
every batch uses the same tag and correctness rests on the issue order alone, which the rule below
makes the same on every rank: batches are posted only at points of the program (an exchange's
start, ``advance``, ``wait``), never because something completed.

Waiting (:meth:`Completion.wait`) is the other per-backend difference: on gloo it blocks the host
with the job's timeout, and a failure ends the rank with the one-line fault message
(:mod:`.faults`); on NCCL/XCCL ``work.wait()`` only makes the current stream wait (a timeout
argument would turn it into a host-side busy wait, torch's ``WorkNCCL::synchronizeInternal``), and
the group's own timeout, set when cocodiff creates it, bounds the operation: there the backend's
watchdog ends a stalled job, with its own message.

One program order. NCCL and XCCL need every rank to submit the operations of every communicator in
one consistent order, or ranks can deadlock, and NCCL matches a pair's messages by issue order. So
every exchange launches its operations at points of the program that are the same on every rank
(SPMD model code): at ``start``, in ``advance`` and in ``wait``; nothing is ever launched because a
local operation happened to complete first, on any backend. Every collective cocodiff submits, here
or elsewhere, is recorded with :func:`launched`: the audit (``COCODIFF_ORDER_AUDIT=1``, and on under
device semantics) keeps each rank's launches as ``(communicator role, operation)``, and a
distributed test asserts that the sequences agree across ranks.

The fair flat exchange (:func:`fair_flat`) is the third: the flat exchange whose time the autotune
must never exceed. On NCCL and XCCL it is the backend's own all-to-all (stock's ``flat``); on gloo
it is ``flat-p2p``, because gloo's ``all_to_all_single`` posts its sends first and pays the
artefact above, which NCCL's all-to-all does not.

Device semantics (``COCODIFF_DEVICE_SEMANTICS=1``): gloo runs what a device backend would. Batches
take XCCL's order and run as oneCCL replays them: operation by operation, each receive completing
before the next operation is posted, so an exchange whose batches only work in gloo's order hangs
(and times out with the one-line fault message) instead of passing; the order audit (below)
is on. The CPU stand-in for NCCL's and XCCL's rules until multi-GPU tests can run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from .. import commstats
from . import faults

logger = logging.getLogger("cocodiff_xfuser")

DEVICE_SEMANTICS_ENV = "COCODIFF_DEVICE_SEMANTICS"
#: The one tag of every message (see the module docstring: correctness never depends on it).
TAG = 0
_RECEIVES_FIRST = ("gloo",)
_SENDS_FIRST = ("xccl", "ccl")

_device_semantics = os.environ.get(DEVICE_SEMANTICS_ENV, "") not in ("", "0")
_backend_cache: dict[tuple[Any, str], str] = {}
_group_cache: dict[Any, tuple[int, int]] = {}
_ranks_cache: dict[Any, tuple[int, ...]] = {}


# gloo (and NCCL before torch 2.11) reject float8 collectives; the exchange is pure data
# movement, so a same-width integer view is exact.
_FP8_DTYPES = {
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
}


WIRE_DTYPE_ENV = "COCODIFF_WIRE_DTYPE"
# What the wire carries in the emulated clusters, where models compute in float32 on CPU but a GPU job
# sends bf16: with ``COCODIFF_WIRE_DTYPE=bfloat16`` every float32 payload crosses it in that dtype,
# rounded once where it enters an exchange (:func:`wire_values`, as a GPU's tensors already are), so
# the bytes sent (:func:`post`, comm/flat.py) and counted (:func:`wire_bytes`) are a GPU's. Stock's
# exchanges, which are torch's functional collectives, round alike in tools/fabric/wire.py.
_WIRE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_wire_name = os.environ.get(WIRE_DTYPE_ENV, "")
if _wire_name and _wire_name not in _WIRE_DTYPES:
    raise ValueError(f"{WIRE_DTYPE_ENV}={_wire_name!r}: expected one of {', '.join(_WIRE_DTYPES)}")
_wire_float: torch.dtype | None = _WIRE_DTYPES.get(_wire_name)


def wire_float() -> torch.dtype | None:
    """The dtype float32 payloads cross the wire in (None: their own)."""
    return _wire_float


def _rounds(x: torch.Tensor) -> bool:
    return _wire_float is not None and x.dtype == torch.float32


def wire_values(x: torch.Tensor) -> torch.Tensor:
    """``x`` with the values the wire carries (float32 rounded to the wire's dtype; else ``x`` itself)."""
    return x.to(_wire_float).to(x.dtype) if _rounds(x) else x


def on_wire(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype it crosses the wire in (lossless after :func:`wire_values`)."""
    # (_rounds inlined: this runs per exchange)
    return x.to(_wire_float) if _wire_float is not None and x.dtype == torch.float32 else x


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype values of ``dtype`` cross the wire in."""
    return _wire_float if _wire_float is not None and dtype == torch.float32 else dtype


def wire_itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` on the wire."""
    return wire_dtype(dtype).itemsize


def wire_bytes(x: torch.Tensor) -> int:
    """The bytes ``x`` takes on the wire."""
    return x.numel() * wire_itemsize(x.dtype)


def comm_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous, as the bytes a backend can send (fp8 as uint8)."""
    x = x.contiguous()
    return x.view(torch.uint8) if x.dtype in _FP8_DTYPES else x


AUDIT_ENV = "COCODIFF_ORDER_AUDIT"
_launches: list[tuple[str, str]] | None = [] if any(
    os.environ.get(v, "") not in ("", "0") for v in (AUDIT_ENV, DEVICE_SEMANTICS_ENV)
) else None


def auditing() -> bool:
    return _launches is not None


def launched(group: Any, op: str, role: str | None = None) -> None:
    """Record that this rank launched ``op`` on ``group`` (no-op outside an audit).

    ``role`` names the communicator the same way on every rank (``"level 1 of (2, 2)"``); by
    default the group's size, since a rank only sees the groups it belongs to.
    """
    if _launches is not None:
        size = dist.get_world_size(group if group is not None else dist.group.WORLD)
        _launches.append((role or f"group of {size}", op))


def launches() -> list[tuple[str, str]]:
    """This rank's launches so far (empty outside an audit)."""
    return list(_launches or [])


def forget_groups() -> None:
    """Drop everything cached per process group (its backend, this rank's place in it, its
    members): the groups are being destroyed, and a later group may reuse an identity."""
    _backend_cache.clear()
    _group_cache.clear()
    _ranks_cache.clear()


#: When a list: every posted batch as ``("what (role)", [(op, peer, bytes), ...])``, in posting order.
# The batches recorded by the :func:`tracing` blocks in progress, innermost last (what :func:`post` appends to).
_traces: list[list[tuple[str, list[tuple[str, int, int]]]]] = []


def device_semantics() -> bool:
    """Whether gloo runs with a device backend's rules (``COCODIFF_DEVICE_SEMANTICS=1``)."""
    return _device_semantics


def backend_name(group: Any = None, device: torch.device | str = "cpu") -> str:
    """Name of the backend that runs operations of ``group`` on ``device`` (``"gloo"``, ``"nccl"``...)."""
    group = group if group is not None else dist.group.WORLD
    dev = device.type if isinstance(device, torch.device) else torch.device(device).type
    key = (group, dev)
    if key not in _backend_cache:
        config = str(dist.get_backend_config(group))  # "gloo", or "cpu:gloo,cuda:nccl"
        by_device = dict(item.split(":", 1) for item in config.split(",") if ":" in item)
        _backend_cache[key] = by_device.get(dev, config if not by_device else "").lower()
    return _backend_cache[key]


def group_info(group: Any) -> tuple[int, int]:
    """(this rank's group rank, group size), cached."""
    if group not in _group_cache:
        _group_cache[group] = (dist.get_rank(group), dist.get_world_size(group))
    return _group_cache[group]


def group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of ``group``, sorted (what plans and decisions are keyed by), cached."""
    if group not in _ranks_cache:
        _ranks_cache[group] = tuple(sorted(dist.get_process_group_ranks(group)))
    return _ranks_cache[group]


def fair_flat(group: Any = None, device: torch.device | str = "cpu") -> str:
    """The fair flat exchange on ``group``'s backend (module docstring): ``"flat-p2p"`` on gloo,
    ``"flat"`` (the backend's own all-to-all) elsewhere."""
    return "flat-p2p" if backend_name(group, device) in _RECEIVES_FIRST else "flat"


def _order(backend: str) -> str:
    if backend in _RECEIVES_FIRST:
        return "sends first" if _device_semantics else "receives first"  # device semantics: XCCL's order
    return "sends first" if backend in _SENDS_FIRST else "one group"


def post(
    recv: Sequence[Sequence[torch.Tensor]],
    send: Sequence[Sequence[torch.Tensor]],
    group: Any,
    role: str | None,
    what: str,
    buffers: Sequence[torch.Tensor] = (),
) -> Completion:
    """Post one batch over ``group``: receive ``recv[src]`` from every peer and send ``send[dst]`` to
    every peer (indexed by group rank; this rank's own entries are left alone, each entry a list of
    contiguous pieces matched in order by the peer). ``role`` names the communicator and ``what``
    the batch, the same way on every rank (the order audit, fault messages; default role: the
    group's size); ``buffers`` are kept alive until the batch completes."""
    me, world = group_info(group)
    # (One loop, not comprehensions: each is a Python call, and this runs per batch.)
    recvs, sends = [], []  # (the operation, group peer, piece), receives from me-1, me-2, ..., sends to me+1, ...
    landing: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, what the wire delivers into)
    for i in range(1, world):
        src, dst = (me - i) % world, (me + i) % world
        for p in recv[src]:
            if p.numel():
                if _wire_float is not None and p.dtype == torch.float32:  # (_rounds inlined)
                    landing.append((p, torch.empty_like(p, dtype=_wire_float)))
                    p = landing[-1][1]
                recvs.append((dist.irecv, src, p))
        for p in send[dst]:
            if p.numel():
                sends.append((dist.isend, dst, on_wire(p)))
    if _wire_float is not None:
        buffers = (*buffers, *(p for _, _, p in sends), *(w for _, w in landing))
    launched(group, what, role=role)
    where = f"{what} ({role or f'group of {world}'})"
    if not recvs and not sends:
        return Completion([], "", group, where)
    backend = backend_name(group, (recvs or sends)[0][2].device)
    ops = sends + recvs if _order(backend) == "sends first" else recvs + sends
    if _traces:
        _traces[-1].append((where, [("recv" if op is dist.irecv else "send", peer, p.numel() * p.element_size()) for op, peer, p in ops]))
    if _device_semantics and backend in _RECEIVES_FIRST:
        return Completion(_replay(ops, group, where), backend, group, where, buffers, landing)
    if backend == "gloo":
        works = _post_each(ops, group)
    else:
        works = dist.batch_isend_irecv([dist.P2POp(op, p, group=group, tag=TAG, group_peer=peer) for op, peer, p in ops])
    return Completion(works, backend, group, where, buffers, landing)


def _post_each(ops: list[tuple[Any, int, torch.Tensor]], group: Any) -> list[Any]:
    """Post ``ops`` one by one, in order: what ``batch_isend_irecv`` does on a backend that does not
    coalesce (gloo), without its per-op objects and checks (tens of µs per batch). Through the
    process group's own ``send``/``recv``, where ``isend``/``irecv`` end: their checks (a member
    rank, a real tensor, the group rank) hold here by construction and cost Python calls per message."""
    pg = group if group is not None else dist.group.WORLD
    return [pg.send([p], peer, TAG) if op is dist.isend else pg.recv([p], peer, TAG) for op, peer, p in ops]


def _replay(ops: list[tuple[Any, int, torch.Tensor]], group: Any, where: str) -> list[Any]:
    """Run ``ops`` as oneCCL replays a group: in order, each receive complete before the next post."""
    sends = []
    for op, peer, p in ops:
        if op is dist.isend:
            sends.append(dist.isend(p, group=group, tag=TAG, group_dst=peer))
            continue
        try:
            dist.irecv(p, group=group, tag=TAG, group_src=peer).wait(faults.timeout())
        except RuntimeError as e:
            raise faults.failed(f"{_where(where, group)}, receive from group rank {peer} (device semantics)", e) from e
    return sends


def exchange_chunks(out: torch.Tensor, inp: torch.Tensor, group: Any, what: str) -> Completion:
    """The equal-split all-to-all ``inp`` -> ``out`` (contiguous, same size, W chunks) as one batch;
    the own chunk is copied before returning."""
    me, world = group_info(group)
    if inp.numel() != out.numel() or inp.numel() % world:
        raise ValueError(f"equal-split exchange needs equal sizes divisible by {world}: {inp.numel()}, {out.numel()}")
    send = (inp if inp.dim() == 1 else inp.view(-1)).chunk(world)
    recv = (out if out.dim() == 1 else out.view(-1)).chunk(world)
    done = post([[c] for c in recv], [[c] for c in send], group, None, what, (out, inp))
    copy_own(recv[me], send[me])
    return done


def copy_own(dst: torch.Tensor, src: torch.Tensor) -> None:
    """The chunk a rank keeps: a local copy, counted; with the values the wire carries, as the
    stock collective's own chunk has them (it converts the whole input)."""
    dst.copy_(wire_values(src) if _rounds(src) else src)
    commstats.count_copy(src.numel() * src.element_size())


class Completion:
    """A posted batch: :meth:`wait` completes it (see the module docstring for what waiting means
    per backend) and raises :class:`faults.ExchangeFailed` naming the batch if it fails."""

    def __init__(
        self, works: list[Any], backend: str, group: Any, where: str, buffers: Sequence[torch.Tensor] = (),
        landing: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> None:
        self._works = [w for w in works if w is not None]
        self._gloo = backend == "gloo"
        self._group, self._where = group, where
        self._buffers = list(buffers)  # memory the works read or write: alive until they complete
        self._landing = list(landing)  # received in the wire's dtype, copied to their destination on wait
        self._waited = not self._works and not self._landing

    def __del__(self) -> None:
        # Dropped without wait(): destroying gloo works before they complete cancels their buffers,
        # and a peer's message would then match the NEXT batch's receive on this pair (wrong data
        # or a hang). A thread owns them until they complete.
        if not self._waited and self._gloo:
            try:
                threading.Thread(target=_drain, args=(self._works, self._buffers), name="cocodiff-p2p-drain", daemon=True).start()
            except RuntimeError:  # interpreter shutting down: nothing left to protect
                pass

    def wait(self) -> None:
        if self._waited:
            return
        try:
            for w in self._works:
                if self._gloo:
                    w.wait(faults.timeout())
                else:
                    w.wait()
        except RuntimeError as e:
            raise faults.failed(_where(self._where, self._group), e) from e
        for destination, landed in self._landing:
            destination.copy_(landed)
        self._waited = True
        self._buffers, self._landing = [], []


def _where(where: str, group: Any) -> str:
    return f"{where}, group {dist.get_process_group_ranks(group)}"


def _drain(works: list[Any], buffers: list[torch.Tensor]) -> None:
    try:
        for w in works:
            w.wait(faults.timeout())
    except BaseException as e:  # nobody is left to raise it to
        logger.warning("a point-to-point batch that was never waited on failed: %s", e)


@contextlib.contextmanager
def tracing() -> Iterator[list[tuple[str, list[tuple[str, int, int]]]]]:
    """Record every batch posted inside the block: ``("what (role)", [(op, group peer, bytes), ...])`` in the
    backend's order (what the same-path test compares across backends)."""
    _traces.append([])
    try:
        yield _traces[-1]
    finally:
        _traces.pop()
