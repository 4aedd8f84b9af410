"""The exchanger: every Ulysses exchange of one process starts here and returns one handle type.

Built once per job when xfuser has built its process groups (:mod:`cocodiff_xfuser.xfuser.job`
holds it for xfuser's entry points; the V-First processors are given it when they are installed),
it owns the Ulysses group, its topology levels, V-Major's slow level and the autotune. Every
exchange (xfuser's routed all-to-all, V-First's input and output exchanges, V-Major's sparse ones,
fp8 on every link or only the slow ones) starts through :meth:`Exchanger.start`,
:meth:`~Exchanger.start_heads` or :meth:`~Exchanger.start_sparse` and returns an :class:`Exchange`
(``advance``, ``wait``); under ring attention, the ring's K/V too (:meth:`~Exchanger.start_ring`,
through torch's rotater protocol, or under V-Major on the ring explicitly per call). Every exact
exchange's route is the job's one router's (:mod:`cocodiff_xfuser.router`). The input exchange's
head blocks are written once, in the order the chosen exchange sends them
(:mod:`cocodiff_xfuser.ulysses_layout`). This module knows nothing about how it is wired in.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Callable, TypeVar

import torch
import torch.distributed as dist

from cocodiff_xfuser import commstats, compat, padding
from cocodiff_xfuser.comm import compress, faults, ring, sparse, transport
from cocodiff_xfuser.comm import topology as topo
from cocodiff_xfuser.comm.agreement import agree
from cocodiff_xfuser.comm.autotune import AutoAllToAll, DecisionsFile, Registry
from cocodiff_xfuser.comm.flat import AllToAllHandle
from cocodiff_xfuser.comm.tapa import HierarchicalAllToAll
from cocodiff_xfuser.layout import Layout
from cocodiff_xfuser.router import Route, Router
from cocodiff_xfuser.settings import Options, TopK
from cocodiff_xfuser.ulysses_layout import heads

if TYPE_CHECKING:  # (a type only: the exchanger runs in stock jobs too, which load nothing of V-Major)
    from cocodiff_xfuser.vmajor import ring as vmajor_ring

logger = logging.getLogger("cocodiff_xfuser")
T = TypeVar("T")

class Exchange:
    """An exchange in flight, whichever algorithm runs it: ``advance`` launches its next phase,
    ``wait`` gives the result in the shape the exchanger promised (``where``: its fault line's
    place, made once; ``unpack``: what turns the exchanged bytes back into values, for a compressed
    exchange; ``peers``: what a sparse exchange learns of the senders' active tokens, filled by its wait)."""

    def __init__(
        self, exchanger: Exchanger, handle: AllToAllHandle, shape: torch.Size, label: str, algorithm: str, where: str,
        unpack: Callable[[torch.Tensor], torch.Tensor] | None = None, peers: dict[int, torch.Tensor] | None = None,
    ) -> None:
        self._exchanger, self._handle, self._shape = exchanger, handle, shape
        self.label, self.algorithm, self._where = label, algorithm, where
        self._unpack = unpack
        self.peers = peers
        self.done = False
        self._out: torch.Tensor | None = None

    def advance(self) -> bool:
        return self._exchanger.finish(self._handle.advance, self.label, self.algorithm, self._where)

    def wait(self) -> torch.Tensor:
        # Idempotent: the autotune completes pending exchanges before it measures, and their
        # owners wait again later (a sparse exchange adds residuals: it must complete once).
        if not self.done:
            out = self._exchanger.finish(self._handle.wait, self.label, self.algorithm, self._where)
            self._out = (out if self._unpack is None else self._unpack(out)).reshape(self._shape)
            self.done = True
        return self._out


class Exchanger:
    """Runs the Ulysses exchanges of one process: flat or hierarchical, chosen per message size.

    Closed (:meth:`close`) when its job ends or falls back to stock: processors that still hold
    it then take the stock path.
    """

    def __init__(self, group: dist.ProcessGroup, options: Options, ring_group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.ring_group = ring_group  # the ring attention's group, where the ring degree is above 1
        self.options = options
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank()
        self._group_desc = f"group {dist.get_process_group_ranks(group)}"  # for the one-line fault report
        faults.set_timeout(options.timeout_s)
        # Statistics calibrate by waiting for V at once, which changes the launch order; device
        # semantics change the order inside every batch.
        agree(commstats.enabled(), "COCODIFF_COMM_STATS")
        agree(transport.device_semantics(), transport.DEVICE_SEMANTICS_ENV)
        self.topology = _resolve_agreed(options.topology)
        # Collective over the world: every rank learns every Ulysses group and ring, and creates the
        # same sub-groups in the same order.
        self.layout = Layout.gather(self.topology, group, ring_group)
        groups = [list(g) for g in self.layout.ulysses_groups]
        tapa = HierarchicalAllToAll(self.topology, groups)
        self.levels = tapa.levels(group)
        #: Whether eager exchanges take this exchanger's handles rather than the functional collectives a
        #: graph holds (:mod:`cocodiff_xfuser.ulysses_collectives`): a point-to-point exchange asked for by
        #: name, and fp8 on the slow links only, whose split sizes gloo's all-to-all posts pair after pair.
        self.handles_only = options.a2a in ("flat-p2p", "flat-pxn") or options.compress == "fp8-slow"
        #: A V-First processor's fall-back decisions, agreed over the group once per (processor, input
        #: shapes, local reason): the reason (None: V-First runs).
        self.agreed: dict[tuple, str | None] = {}
        #: The job's padded heads and tokens (:class:`~cocodiff_xfuser.padding.Padding`): a new job starts with none.
        self.padding = padding.Padding()
        slow_only = agree(options.compress, "--cocodiff-compress") == "fp8-slow"
        v_major = agree(options.v_major, "the V-Major settings (--cocodiff-v-major-*)")
        #: Whether the ring's K/V go through this exchanger's host code, compiled or not: V-Major's step
        #: residuals over the ring peers on other nodes under a policy whose counts the data or the step
        #: decides. Else a compiled graph holds the ring: top-k's static exchange
        #: (:mod:`cocodiff_xfuser.vmajor.ring_graph`), or torch's own ring (a functional all-gather, as
        #: stock's graph does), counted when traced; eagerly the same code runs, the gathers through
        #: the transport (:meth:`start_ring`).
        self.ring_on_host = bool(v_major) and bool(self.ring_remote) and not isinstance(v_major.rule, TopK)
        if not self.layout.slow_share and self.rank == 0:
            # The layout put the slow links outside Ulysses (ring or CFG across nodes): one line for the job.
            idle = "V-Major and fp8-slow have" if self.levels else "TAPA, V-Major and fp8-slow have"
            across = ("the ring's K/V cross nodes as V-Major's step residuals, CFG as stock" if v_major and self.ring_remote
                      else "the groups across nodes (ring, CFG) exchange as stock")
            logger.warning("cocodiff: the Ulysses %s stays inside one node (topology %s): %s nothing to do there; %s",
                           self._group_desc, self.topology, idle, across)
        self.slow_level = (_slow_level(self.layout, groups, group, "V-Major" if v_major else "fp8-slow", bool(self.ring_remote))
                           if v_major or slow_only else None)
        self.autotune = AutoAllToAll(Registry(tapa), a2a=options.a2a)
        plan = tapa.plan(group)
        # The groups a traced exchange names: the Ulysses group's, and its levels' (TAPA's) where it has them.
        level_groups = () if plan is None else tuple(g.group_name for g in plan.level_groups)
        #: The routes of every exact exchange, through the handles or traced (:mod:`cocodiff_xfuser.router`).
        self.router = Router(group, self.autotune, self.layout.slow_share, self.levels, level_groups, self._group_desc,
                             self.finish, self._complete_pending)
        #: The router's traced route as traced code calls it: run when a graph is traced, its result a constant.
        self.traced_route = compat.trace_time_method(self.router.traced)
        self._pending: list[Exchange] = []
        self.closed = False
        # What decisions are only valid for (kept: at exit the process groups may be gone).
        provenance = {"topology": str(self.topology), "backend": dist.get_backend(group), "world_size": dist.get_world_size()}
        self.decisions = DecisionsFile(self.autotune, provenance)

    def _complete_pending(self) -> None:
        """Complete the exchanges still in flight (V's, under V-First), at the same program point on
        every rank: a measurement's timings must not share the links with them."""
        for pending in self._pending:
            if not pending.done:
                pending.wait()

    def finish(self, step: Callable[[], T], label: str, algorithm: str, where: str | None = None) -> T:
        """``step()`` (choosing, starting, advancing or waiting for an exchange); a failed or
        timed-out exchange is one line to the process's fault handler (in a job: the rank ends).
        ``where``: the route's own line, where the caller has one."""
        where = where or f"{algorithm} over {self._group_desc}"
        try:
            with faults.inside(label, where):
                return step()
        except RuntimeError as e:
            faults.failed_exchange(self.rank, label, where, self.options.timeout_s, e)

    def _pending_handle(self, handle: Exchange) -> Exchange:
        """``handle``, remembered until it completes (a measurement completes it first)."""
        self._pending = [p for p in self._pending if not p.done]
        self._pending.append(handle)
        return handle

    def _flat_route(self, x: torch.Tensor, label: str) -> tuple[Route, torch.Tensor, Callable[[torch.Tensor], torch.Tensor] | None]:
        """The route of the exchange of ``x``, counted, its flat payload (``x`` packed or not) and how
        to unpack the result (None: nothing to unpack)."""
        packed = _packed(self.options, self.world_size, x)
        flat, unpack = packed if packed is not None else (x.flatten(), None)
        route = self.router.route((label, x.shape, x.dtype, x.device), lambda: flat, lambda: transport.wire_bytes(x))
        return _counted(route, label), flat, unpack

    def slow_fp8(self, dtype: torch.dtype) -> bool:
        """Whether values of ``dtype`` are exchanged as fp8 over the slow level only (``--cocodiff-compress fp8-slow``)."""
        return self.options.compress == "fp8-slow" and self.slow_level is not None and dtype in compress.WIDE

    def _start_slow_fp8(self, x: torch.Tensor, label: str) -> Exchange:
        """Start the exchange of ``x`` (W equal destination-major chunks of rows of its last dim)
        under ``--cocodiff-compress fp8-slow``: node-mates get the values, ranks on other nodes
        every row in fp8 with its scale, through the sparse exchange's routings. The result has the
        shape ``[W, 1, rows, d]``."""
        world, d = self.world_size, x.shape[-1]
        chunks = x.reshape(world, 1, -1, d)
        rows = {j: compress.pack_rows(chunks[j]) for j in range(world) if not self.slow_level.fast(j)}
        every = sparse.Selection.fixed(torch.arange(chunks.shape[2], device=x.device), world)
        return self.start_sparse(chunks, rows, every, torch.empty_like(chunks), label, residual=False,
                                 decode=lambda packed: compress.unpack_rows(packed, x.dtype), kind="fp8-slow")

    # The handles and the buffer pool are Python state that torch.compile cannot trace: these
    # exchanges run only eagerly: in an eager job, or between a compiled job's graphs (the V-First
    # layers that :func:`cocodiff_xfuser.processors.ulysses.start_input_exchange` leaves to the host).
    def start(self, x: torch.Tensor, label: str) -> Exchange:
        """Start the equal-split all-to-all of ``x`` (chunks destination-major along the flattened data;
        the wire's values: the V-First processors, its callers, round them where V-Major reads them)."""
        if self.slow_fp8(x.dtype):
            return self._start_slow_fp8(x, label)
        route, flat, unpack = self._flat_route(x, label)
        started = self.finish(lambda: route.start(flat), label, route.algorithm, route.where)
        return self._pending_handle(Exchange(self, started, x.shape, label, route.algorithm, route.where, unpack))

    def start_heads(self, tensors: tuple[torch.Tensor, ...], label: str) -> Exchange:
        """Start the Ulysses input exchange of same-shaped ``[b, h, s, d]`` tensors; the result is
        source-major ``[W, n, b, h/W, s, d]``. The head blocks are written once, in the order the
        chosen exchange sends (:func:`heads`; the wire's values, as the V-First processors hand them in)."""
        if self.slow_fp8(tensors[0].dtype):
            return self._start_slow_fp8(_written(tensors, (self.world_size,), (0,)), label)
        first = tensors[0]
        b, h, s, d = first.shape
        shape = (self.world_size, len(tensors), b, h // self.world_size, s, d)

        def probe() -> torch.Tensor:
            # What the choice needs is the size, dtype and device; a real buffer only to measure with.
            if self.options.compress != "fp8" or first.dtype not in compress.WIDE:
                numel, dtype = math.prod(shape), first.dtype
            else:
                numel, dtype = self.world_size * compress.packed_bytes(math.prod(shape[1:-1]), d), torch.uint8
            probe = first.new_empty(1, dtype=dtype).expand(numel)
            return first.new_empty(numel, dtype=dtype) if self.autotune.measures(probe, self.group) else probe

        route = self.router.route((label, len(tensors), first.shape, first.dtype, first.device), probe,
                                  lambda: math.prod(shape) * transport.wire_itemsize(first.dtype))
        algorithm = _counted(route, label).algorithm
        if algorithm == "hierarchical" and route.parts == 1:
            sends = self.autotune.registry.tapa.input_layout(self.group)
            data, extra = _written(tensors, self.levels, sends), {"layout": sends}
        else:
            data, extra = _written(tensors, (self.world_size,), (0,)), {}
        packed = _packed(self.options, self.world_size, data)  # chunks in send order, whichever layout
        data, unpack = packed if packed is not None else (data.view(-1), None)
        started = self.finish(lambda: route.start(data, **extra), label, algorithm, route.where)
        return self._pending_handle(Exchange(self, started, shape, label, algorithm, route.where, unpack))

    def start_sparse(
        self, x: torch.Tensor, rows: sparse.Rows, selection: sparse.Selection, into: torch.Tensor, label: str, residual: bool,
        by_receiver: bool = False, learn_peers: bool = False,
        decode: Callable[[torch.Tensor], torch.Tensor] | None = None, kind: str = "v-major",
    ) -> Exchange:
        """Start V-Major's exchange of ``x`` (``[W, P, s, d]``) into ``into``, the previous result:
        other nodes get only ``rows``, the rows ``selection`` marks (as values, or residuals to
        add; ``by_receiver``, ``learn_peers`` and ``decode``: :class:`~cocodiff_xfuser.comm.sparse.SparseHandle`'s;
        ``kind`` names it in what ran: ``fp8-slow`` sends every row packed).
        Routed like the exact exchange of the same size: two phases where the autotune chose TAPA or
        the PXN-like relay (both cross nodes on the destination's lane), the backend's all-to-all with
        split sizes where it chose ``flat``, else one point-to-point batch."""
        # The exact exchange's route for this size, kept like its own (not counted: this one runs).
        exact_algorithm = self.router.route((label, "sparse", x.shape, x.dtype, x.device), x.flatten,
                                            lambda: transport.wire_bytes(x)).algorithm
        two_phase = self.slow_level.regular and exact_algorithm in ("hierarchical", "flat-pxn")
        collective = exact_algorithm == "flat"  # one-phase: the backend's all-to-all, like the exact exchange
        algorithm = f"{kind} {'two-phase' if two_phase else 'one-phase'}"
        where = f"{algorithm} over {self._group_desc}"
        exchange = self.finish(lambda: sparse.SparseHandle(
            x, rows, selection, self.slow_level, self.group, two_phase, into, residual, collective, by_receiver, learn_peers,
            decode,
        ), label, algorithm, where)
        commstats.count_exchange(algorithm, label, slow_link_bytes=exchange.slow_bytes, slow_link_bytes_exact=exchange.exact_bytes)
        return self._pending_handle(Exchange(self, exchange, into.shape, label, algorithm, where, peers=exchange.peers))

    def all_to_all(self, x: torch.Tensor, label: str = "usp") -> torch.Tensor:
        """The blocking exchange (what xfuser's ``_sdpa_all_to_all_single`` does)."""
        x = transport.wire_values(x)
        if self.slow_fp8(x.dtype):
            return self._start_slow_fp8(x, label).wait().reshape(x.shape)
        route, flat, unpack = self._flat_route(x, label)
        out = self.finish(lambda: route.start(flat).wait(), label, route.algorithm, route.where)
        return (out if unpack is None else unpack(out)).reshape(x.shape)

    @property
    def ring_remote(self) -> tuple[int, ...]:
        """The ring ranks on other nodes than this rank's: each receives its K/V over the slow links."""
        return self.layout.ring_remote

    def start_ring(self, buffer: torch.Tensor, group: dist.ProcessGroup, row: int | None = None,
                   v_major: vmajor_ring.RingLayer | None = None) -> Exchange:
        """Start the all-gather of ``buffer`` over the ring ``group``: ``[ring size, n]``
        (:mod:`.comm.ring`); under ``v_major`` (its transformer's V-Major on the ring, this call's
        buffer of K then V, each ``row`` elements per token), peers on other nodes exchange step residuals."""
        label = "ring"
        step = v_major.begin(buffer, row) if v_major is not None and self.ring_remote else None
        remote = None if step is None else step.remote
        algorithm = "ring all-gather" if remote is None else "ring v-major"
        exact = transport.wire_bytes(buffer) * len(self.ring_remote)
        commstats.count_exchange(algorithm, label, slow_link_bytes=exact if step is None else step.slow_bytes, slow_link_bytes_exact=exact)
        where = f"{algorithm} over {self._group_desc}"
        gather = self.finish(lambda: ring.RingGather(buffer, group, remote), label, algorithm, where)
        finish = None if step is None else lambda out: step.finish(out, gather.received)
        return Exchange(self, gather, (dist.get_world_size(group), buffer.numel()), label, algorithm, where, finish)

    def close(self) -> None:
        """The job ended or fell back to stock: nothing starts here any more."""
        self.closed = True

    def describe(self) -> str:
        plan = "x".join(map(str, self.levels)) if self.levels else "flat only"
        # V-Major's settings apply to the exchanges that cross nodes.
        on = [name for name, crosses in (("Ulysses", self.slow_level), ("the ring", self.ring_remote)) if crosses]
        v_major = f"on {' and '.join(on)}: {self.options.v_major.describe()}" if self.options.v_major and on else "off"
        return (
            f"ulysses group of {self.world_size} on topology {self.topology} ({self.topology.describe()}): "
            f"levels {plan}, all-to-all {self.options.a2a}, V-First {'on' if self.options.v_first else 'off'}, "
            f"V-Major {v_major}, "
            f"compression {self.options.compress}, "
            f"timeout {self.options.timeout_s:g} s"
        )


def _packed(options: Options, world: int, x: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]] | None:
    """``x`` (``world`` equal chunks along dim 0, rows of its last dim) packed for ``--cocodiff-compress
    fp8`` (every link), and how to unpack the result; None otherwise (or where ``x`` is already
    narrow: xfuser's own fp8 communication)."""
    if options.compress != "fp8" or x.dtype not in compress.WIDE:
        return None
    d = x.shape[-1]
    rows = x.numel() // (world * d)
    packed = compress.pack(x.reshape(world, rows, d))
    return packed.view(-1), lambda out: compress.unpack(out.view(world, -1), rows, d, x.dtype)


def _counted(route: Route, label: str) -> Route:
    commstats.count_exchange(route.algorithm, label, slow_link_bytes=route.slow_bytes, slow_link_bytes_exact=route.exact_bytes)
    return route


def _slow_level(layout: Layout, groups: list[list[int]], group: dist.ProcessGroup, user: str, ring_crosses: bool
                ) -> sparse.SlowLevel | None:
    """Where the sparse exchanges of ``user`` (V-Major, or fp8-slow) cross nodes (collective:
    builds their sub-groups)."""
    level = sparse.build_slow_levels(groups, layout.nodes_and_lanes)[transport.group_ranks(group)]
    if not level.exists:  # said in one line for the job at activation
        if not (user == "V-Major" and ring_crosses):  # else the ring's K/V carry it across nodes
            commstats.count_fallback(f"{user.lower()}: no slow level")
        return None
    return level


def _written(tensors: tuple[torch.Tensor, ...], levels: tuple[int, ...], layout: tuple[int, ...]) -> torch.Tensor:
    """The input exchange's head blocks of ``tensors`` in the order it sends them (:func:`heads`), the copy counted."""
    data = heads(tensors, levels, layout)
    commstats.count_copy(data.numel() * data.element_size())
    return data


def _resolve_agreed(spec: str | None) -> topo.Topology:
    """The topology, the same on every rank: a failure on some ranks only (their environment, a
    preset missing on their host) is an error on all of them, naming a rank that differs."""
    spec = None if spec in (None, "", "auto") else spec
    try:
        topology, outcome = topo.resolve(spec, dist.get_world_size()), None
    except (ValueError, OSError) as e:
        topology, outcome = None, str(e)
    outcome = agree(outcome or str(topology), "the topology (--cocodiff-topology, LOCAL_WORLD_SIZE, hostnames, XPU tiles)")
    if topology is None:
        raise ValueError(outcome)
    return topology
