"""The cocodiff sequence-parallel backend of one process: its Ulysses group and exchange plan.

:mod:`cocodiff_xfuser.xfuser` activates it once xfuser has built its process groups and sends
every Ulysses all-to-all here; V-First processors start their exchanges (in and out) through
it. This module knows nothing about how it is wired in.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from cocodiff_xfuser import commstats
from cocodiff_xfuser.comm import compress, faults, layout, order, sparse, transport
from cocodiff_xfuser.comm import topology as topo
from cocodiff_xfuser.comm.agreement import agree, from_first
from cocodiff_xfuser.comm.autotune import AutoAllToAll
from cocodiff_xfuser.comm.flat import AllToAllHandle
from cocodiff_xfuser.comm.registry import Registry
from cocodiff_xfuser.comm.tapa import HierarchicalAllToAll
from cocodiff_xfuser.settings import Options

logger = logging.getLogger("cocodiff_xfuser")
T = TypeVar("T")

# A JSON file of autotune decisions: loaded at activation when it exists, written at exit.
DECISIONS_ENV = "COCODIFF_A2A_DECISIONS"


class _Reshaping:
    """A handle over a flattened exchange that gives the result back in the input's shape
    (``unpack``: what turns the exchanged bytes back into values, for a compressed exchange;
    ``peers``: what a sparse exchange learns of the senders' active tokens, filled by its wait)."""

    def __init__(
        self, backend: CocodiffBackend, handle: AllToAllHandle, shape: torch.Size, label: str, algorithm: str,
        unpack: Callable[[torch.Tensor], torch.Tensor] | None = None, peers: dict[int, torch.Tensor] | None = None,
    ) -> None:
        self._backend, self._handle, self._shape = backend, handle, shape
        self.label, self.algorithm = label, algorithm
        self._unpack = unpack
        self.peers = peers
        self.done = False
        self._out: torch.Tensor | None = None

    def advance(self) -> bool:
        return self._backend.finish(self._handle.advance, self.label, self.algorithm)

    def wait(self) -> torch.Tensor:
        # Idempotent: the autotune completes pending exchanges before it measures, and their
        # owners wait again later (a sparse exchange adds residuals: it must complete once).
        if not self.done:
            out = self._backend.finish(self._handle.wait, self.label, self.algorithm)
            self._out = (out if self._unpack is None else self._unpack(out)).reshape(self._shape)
            self.done = True
        return self._out


class CocodiffBackend:
    """Runs the Ulysses exchanges of one process: flat or hierarchical, chosen per message size."""

    def __init__(self, group: dist.ProcessGroup, options: Options) -> None:
        self.group = group
        self.options = options
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank()
        self._group_desc = f"group {dist.get_process_group_ranks(group)}"  # for the one-line fault report
        faults.set_timeout(options.timeout_s)
        # Collective over the world: every rank learns every Ulysses group, resolves the same
        # topology and creates the same sub-groups in the same order.
        groups: list[list[int]] = [None] * dist.get_world_size()  # type: ignore[list-item]
        order.launched(None, "all_gather_object")
        dist.all_gather_object(groups, dist.get_process_group_ranks(group))
        # Statistics calibrate by waiting for V at once, which changes the launch order; device
        # semantics change the order inside every batch.
        agree(commstats.enabled(), "COCODIFF_COMM_STATS")
        agree(transport.device_semantics(), transport.DEVICE_SEMANTICS_ENV)
        self.topology = _resolve_agreed(options.topology)
        tapa = HierarchicalAllToAll(self.topology, groups)
        self.levels = tapa.levels(group)
        self._slow_share = _slow_link_share(self.topology, dist.get_process_group_ranks(group), self.rank)
        slow_only = agree(options.compress, "--cocodiff-compress") == "fp8-slow"
        v_major = agree(options.v_major, "the V-Major settings (--cocodiff-v-major-*)")
        if not self._slow_share and self.rank == 0:
            # The layout put the slow links outside Ulysses (ring or CFG across nodes): one line for the job.
            idle = "V-Major and fp8-slow have" if self.levels else "TAPA, V-Major and fp8-slow have"
            logger.warning("cocodiff: the Ulysses group %s stays inside one node (topology %s): %s nothing to do "
                           "there; the groups across nodes (ring, CFG) exchange as stock", self._group_desc,
                           self.topology, idle)
        self.slow_level = self._slow_level(groups, "V-Major" if v_major else "fp8-slow") if v_major or slow_only else None
        self.exchange = AutoAllToAll(Registry(tapa), a2a=options.a2a)
        self._pending: list[_Reshaping] = []
        # What decisions are only valid for (kept: at exit the process groups may be gone).
        self._provenance = {"topology": str(self.topology), "backend": dist.get_backend(group), "world_size": dist.get_world_size()}
        self._decisions_file = self._load_decisions()

    def _slow_level(self, groups: list[list[int]], user: str) -> sparse.SlowLevel | None:
        """Where the sparse exchanges of ``user`` (V-Major, or fp8-slow) cross nodes (collective:
        builds their sub-groups)."""
        level = sparse.build_slow_levels(self.topology, groups)[transport.group_ranks(self.group)]
        if not level.exists:  # said in one line for the job at activation
            commstats.count_fallback(f"{user.lower()}: no slow level")
            return None
        return level

    def _load_decisions(self) -> str | None:
        """Rank 0's ``$COCODIFF_A2A_DECISIONS`` and its contents, on every rank (so every rank skips
        the same measurements, even where the file is on storage only some ranks see)."""
        path, data, error = os.environ.get(DECISIONS_ENV) if self.rank == 0 else None, None, None
        if path and os.path.exists(path):
            try:
                with open(path) as f:
                    data = json.load(f)
            except (OSError, ValueError) as e:
                error = f"{DECISIONS_ENV}={path}: cannot read it ({e})"
        path, data, error = from_first((path, data, error))
        if error is not None:
            raise ValueError(error)
        if data is None:
            return path
        measured_on = {key: data.get(key) for key in self._provenance}
        if measured_on != self._provenance:
            raise ValueError(
                f"{DECISIONS_ENV}={path} was measured on {measured_on}, this job is "
                f"{self._provenance}; remove the file or point {DECISIONS_ENV} elsewhere"
            )
        self.exchange.load_dict(data)
        logger.info("cocodiff: all-to-all decisions loaded from %s", path)
        return path

    def save_decisions(self) -> None:
        """Rank 0 writes the autotune decisions to ``$COCODIFF_A2A_DECISIONS`` (a cost model reads them)."""
        if self._decisions_file and self.rank == 0:
            text = json.dumps(self.exchange.to_dict() | self._provenance, indent=2)
            with open(self._decisions_file, "w") as f:
                f.write(text)

    def _choose(self, x: torch.Tensor) -> str:
        if self.exchange.measures(x, self.group):
            self._complete_pending()
        self._pending = [p for p in self._pending if not p.done]
        return self.exchange.choose(x, self.group)

    def _complete_pending(self) -> None:
        """Complete the exchanges still in flight (V's, under V-First), at the same program point on
        every rank: a measurement's timings must not share the links with them."""
        for pending in self._pending:
            if not pending.done:
                pending.wait()

    def _algorithm(self, x: torch.Tensor, label: str, exact_bytes: int | None = None) -> str:
        """Choose the algorithm for ``x`` and count the exchange (``exact_bytes``: what ``x`` would
        be uncompressed)."""
        algorithm = self._choose(x)
        sent = x.numel() * x.element_size()
        slow, exact = int(sent * self._slow_share), int((exact_bytes or sent) * self._slow_share)
        commstats.count_exchange(algorithm, label, slow_link_bytes=slow, slow_link_bytes_exact=exact)
        return algorithm

    def _packed(self, x: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]] | None:
        """``x`` (W equal chunks along dim 0, rows of its last dim) packed for ``--cocodiff-compress
        fp8`` (every link), and how to unpack the result; None otherwise (or where ``x`` is already
        narrow: xfuser's own fp8 communication)."""
        if self.options.compress != "fp8" or x.dtype not in compress.WIDE:
            return None
        d = x.shape[-1]
        rows = x.numel() // (self.world_size * d)
        packed = compress.pack(x.reshape(self.world_size, rows, d))
        return packed.view(-1), lambda out: compress.unpack(out.view(self.world_size, -1), rows, d, x.dtype)

    def finish(self, step: Callable[[], T], label: str, algorithm: str) -> T:
        """``step()`` (choosing, starting, advancing or waiting for an exchange); a failed or
        timed-out exchange is one line to the process's fault handler (in a job: the rank ends)."""
        where = f"{algorithm} over {self._group_desc}"
        try:
            with faults.inside(label, where):
                return step()
        except RuntimeError as e:
            faults.failed_exchange(self.rank, label, where, self.options.timeout_s, e)

    def _pending_handle(self, handle: _Reshaping) -> _Reshaping:
        """``handle``, remembered until it completes (a measurement completes it first)."""
        self._pending.append(handle)
        return handle

    def _slow_fp8(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is exchanged as fp8 over the slow level only (``--cocodiff-compress fp8-slow``)."""
        return self.options.compress == "fp8-slow" and self.slow_level is not None and x.dtype in compress.WIDE

    def _start_slow_fp8(self, x: torch.Tensor, label: str) -> _Reshaping:
        """Start the exchange of ``x`` (W equal destination-major chunks of rows of its last dim):
        node-mates get the values, ranks on other nodes every row in fp8 with its scale, through
        the sparse exchange's routings. The result has the shape ``[W, 1, rows, d]``."""
        world, d = self.world_size, x.shape[-1]
        chunks = x.reshape(world, 1, -1, d)
        rows = {j: compress.pack_rows(chunks[j]) for j in range(world) if not self.slow_level.fast(j)}
        every = sparse.Selection.fixed(torch.arange(chunks.shape[2], device=x.device), world)
        return self.start_sparse(chunks, rows, every, torch.empty_like(chunks), label, residual=False,
                                 decode=lambda packed: compress.unpack_rows(packed, x.dtype), kind="fp8-slow")

    # The handles and the buffer pool are Python state that torch.compile cannot trace; keep
    # the exchange out of compiled graphs (a graph break, as a stock collective wait would be).
    @torch.compiler.disable
    def start(self, x: torch.Tensor, label: str) -> _Reshaping:
        """Start the equal-split all-to-all of ``x`` (chunks destination-major along the flattened data)."""
        if self._slow_fp8(x):
            return self._start_slow_fp8(x, label)
        packed = self._packed(x)
        flat, unpack = packed if packed is not None else (x.flatten(), None)
        algorithm = self.finish(lambda: self._algorithm(flat, label, x.numel() * x.element_size()), label, "autotune")
        started = self.finish(lambda: self.exchange.start(algorithm, flat, self.group), label, algorithm)
        return self._pending_handle(_Reshaping(self, started, x.shape, label, algorithm, unpack))

    @torch.compiler.disable
    def start_heads(self, tensors: tuple[torch.Tensor, ...], label: str) -> _Reshaping:
        """Start the Ulysses input exchange of same-shaped ``[b, h, s, d]`` tensors; the result is
        source-major ``[W, n, b, h/W, s, d]``. The head blocks are written once, in the order the
        chosen exchange sends (:func:`cocodiff_xfuser.comm.layout.heads`)."""
        if self._slow_fp8(tensors[0]):
            return self._start_slow_fp8(layout.heads(tensors, (self.world_size,), (0,)), label)
        b, h, s, d = tensors[0].shape
        shape = (self.world_size, len(tensors), b, h // self.world_size, s, d)
        exact_bytes = math.prod(shape) * tensors[0].element_size()
        # What the choice needs is the size, dtype and device; a real buffer only to measure with.
        if self.options.compress != "fp8" or tensors[0].dtype not in compress.WIDE:
            numel, dtype = math.prod(shape), tensors[0].dtype
        else:
            numel, dtype = self.world_size * compress.packed_bytes(math.prod(shape[1:-1]), d), torch.uint8
        probe = tensors[0].new_empty(1, dtype=dtype).expand(numel)
        if self.exchange.measures(probe, self.group):
            probe = tensors[0].new_empty(numel, dtype=dtype)
        algorithm = self.finish(lambda: self._algorithm(probe, label, exact_bytes), label, "autotune")
        if algorithm == "hierarchical" and self.exchange.parts(probe, self.group) == 1:
            sends = self.exchange.registry.tapa.input_layout(self.group)
            data, extra = layout.heads(tensors, self.levels, sends), {"layout": sends}
        else:
            data, extra = layout.heads(tensors, (self.world_size,), (0,)), {}
        packed = self._packed(data)  # chunks in send order, whichever layout
        data, unpack = packed if packed is not None else (data.view(-1), None)
        started = self.finish(lambda: self.exchange.start(algorithm, data, self.group, **extra), label, algorithm)
        return self._pending_handle(_Reshaping(self, started, shape, label, algorithm, unpack))

    @torch.compiler.disable
    def start_sparse(
        self, x: torch.Tensor, rows: sparse.Rows, selection: sparse.Selection, into: torch.Tensor, label: str, residual: bool,
        by_receiver: bool = False, learn_peers: bool = False,
        decode: Callable[[torch.Tensor], torch.Tensor] | None = None, kind: str = "v-major",
    ) -> _Reshaping:
        """Start V-Major's exchange of ``x`` (``[W, P, s, d]``) into ``into``, the previous result:
        other nodes get only ``rows``, the rows ``selection`` marks (as values, or residuals to
        add; ``by_receiver``, ``learn_peers`` and ``decode``: :class:`~cocodiff_xfuser.comm.sparse.SparseHandle`'s;
        ``kind`` names it in what ran: ``fp8-slow`` sends every row packed).
        Routed like the exact exchange of the same size: two phases where the autotune chose TAPA or
        the PXN-like relay (both cross nodes on the destination's lane), the backend's all-to-all with
        split sizes where it chose ``flat``, else one point-to-point batch."""
        exact_algorithm = self.finish(lambda: self._choose(x.flatten()), label, "autotune")
        two_phase = self.slow_level.regular and exact_algorithm in ("hierarchical", "flat-pxn")
        collective = exact_algorithm == "flat"  # one-phase: the backend's all-to-all, like the exact exchange
        algorithm = f"{kind} {'two-phase' if two_phase else 'one-phase'}"
        exchange = self.finish(lambda: sparse.SparseHandle(
            x, rows, selection, self.slow_level, self.group, two_phase, into, residual, collective, by_receiver, learn_peers,
            decode,
        ), label, algorithm)
        commstats.count_exchange(algorithm, label, slow_link_bytes=exchange.slow_bytes, slow_link_bytes_exact=exchange.exact_bytes)
        return self._pending_handle(_Reshaping(self, exchange, into.shape, label, algorithm, peers=exchange.peers))

    @torch.compiler.disable
    def all_to_all(self, x: torch.Tensor, label: str = "usp") -> torch.Tensor:
        """The blocking exchange (what xfuser's ``_sdpa_all_to_all_single`` does)."""
        if self._slow_fp8(x):
            return self._start_slow_fp8(x, label).wait().reshape(x.shape)
        packed = self._packed(x)
        flat, unpack = packed if packed is not None else (x.flatten(), None)
        algorithm = self.finish(lambda: self._algorithm(flat, label, x.numel() * x.element_size()), label, "autotune")
        out = self.finish(lambda: self.exchange.run(algorithm, flat, self.group), label, algorithm)
        return (out if unpack is None else unpack(out)).reshape(x.shape)

    def describe(self) -> str:
        plan = "x".join(map(str, self.levels)) if self.levels else "flat only"
        return (
            f"ulysses group of {self.world_size} on topology {self.topology} ({self.topology.describe()}): "
            f"levels {plan}, all-to-all {self.options.a2a}, V-First {'on' if self.options.v_first else 'off'}, "
            f"V-Major {self.options.v_major.describe() if self.slow_level and self.options.v_major else 'off'}, "
            f"compression {self.options.compress}, "
            f"timeout {self.options.timeout_s:g} s"
        )


def _slow_link_share(topology: topo.Topology, group_ranks: list[int], rank: int) -> float:
    """The share of an equal-split exchange that ``rank`` sends over the topology's outermost
    level (nodes): to the group members on other nodes."""
    node, _ = topology.nodes_and_lanes(group_ranks)
    mine = node[group_ranks.index(rank)]
    return sum(n != mine for n in node) / len(group_ranks)


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


_ACTIVE: CocodiffBackend | None = None


def activate(group: dist.ProcessGroup, options: Options) -> CocodiffBackend:
    """Make this process's Ulysses exchanges go through cocodiff (collective over the world).

    Re-activating with the same group and options keeps the backend (its sub-groups and tuned
    decisions): xfuser may rebuild its runtime state several times for one model.
    """
    global _ACTIVE
    if _ACTIVE is not None and _ACTIVE.group is group and _ACTIVE.options == options:
        return _ACTIVE
    _ACTIVE = CocodiffBackend(group, options)
    logger.info("cocodiff: %s", _ACTIVE.describe())
    return _ACTIVE


def deactivate() -> None:
    global _ACTIVE
    _ACTIVE = None


def active() -> CocodiffBackend | None:
    return _ACTIVE


@atexit.register
def _save_active_decisions() -> None:
    # The live backend's decisions, once (a backend replaced during the run wrote nothing).
    if _ACTIVE is not None:
        _ACTIVE.save_decisions()
