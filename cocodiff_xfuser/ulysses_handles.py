"""A V-First layer's Ulysses exchanges through the exchanger's handles: the per-call path.

What neither a functional collective (:mod:`cocodiff_xfuser.ulysses_collectives`) nor V-Major's
static path (:mod:`cocodiff_xfuser.vmajor.graph`) runs takes the exchanger's handles, eagerly (in a
compiled job, between its graphs): V-Major's per-call policies, whose counts the data or the step
decides, V-Major on the ring's K/V, and what only the handles do (``--cocodiff-a2a flat-p2p`` /
``flat-pxn`` asked for by name, fp8 on the slow links only:
:attr:`~cocodiff_xfuser.exchanger.Exchanger.handles_only`). The roles are those of the other two
paths: V's exchange started (:func:`start_v`), Q/K's exchange and V's wait (:func:`exchange_inputs`),
the output exchange (:func:`output`); the V-Major step V's decision made travels on V's exchange to
the two others.
"""

from __future__ import annotations

import time

import torch

from cocodiff_xfuser import commstats, padding
from cocodiff_xfuser.comm import timing, transport
from cocodiff_xfuser.exchanger import Exchanger
from cocodiff_xfuser.ulysses_layout import heads, output_blocks, output_heads, output_stacked, output_unstacked, sequence
from cocodiff_xfuser.vmajor import policy
from cocodiff_xfuser.vmajor import ring as vmajor_ring


def start_v(exchanger: Exchanger, value: torch.Tensor, label: str, layer: policy.Layer | None) -> PendingExchange:
    """V's input exchange of a V-First call (``[b, h, s, d]``), under its V-Major ``layer`` if any,
    started before its Q/K are projected (counted as the call)."""
    commstats.count_v_first_call()
    return PendingExchange(exchanger, (value,), label, layer)


class PendingExchange:
    """Sequence-sharded ``[b, h, s, d]`` tensors on their way to head-sharded ``[b, h/W, W*s, d]``.

    With V-Major (``layer`` for V's exchange, then V's decision ``v_major`` for Q/K's), the
    exchange may be sparse over slow links and lands in the layer's cache of its previous result.
    At a sparse step whose Q and K follow V's selection, V's exchange waits to ride with Q/K's
    (``carrying``): its rows then travel in Q/K's messages, and the layer posts one input exchange,
    not two (:attr:`cocodiff_xfuser.vmajor.policy.Step.v_rides`).
    """

    #: V's exchange: its layer's V-Major on the ring's K/V, which the layer's ring attention runs.
    ring: vmajor_ring.RingLayer | None = None

    def __init__(
        self,
        exchanger: Exchanger,
        tensors: tuple[torch.Tensor, ...],
        label: str,
        layer: policy.Layer | None = None,
        v_major: policy.Step | None = None,
        carrying: PendingExchange | None = None,
    ) -> None:
        self.exchanger = exchanger
        world = exchanger.world_size
        head_count = tensors[0].shape[1]
        # As they cross the wire (bf16 values in the emulated clusters): V-Major compares and caches those.
        # (Lists, not generators, here and below: a generator's every step is a Python call per layer.)
        tensors = tuple([transport.wire_values(padding.pad_heads(t, world)) for t in tensors])
        b, h, s, d = tensors[0].shape
        self._n = len(tensors)
        self._label = label
        self._nbytes = len(tensors) * tensors[0].numel() * tensors[0].element_size()  # alike in shape
        exchanger.padding.count(self._nbytes, head_count, h)
        self._stacked_shape = (world, len(tensors), b, h // world, s, d)
        self._started = time.perf_counter()
        self._name = "v" if layer is not None else "qk"
        self._covered: _Covered | None = None
        # V waiting for Q/K's exchange to carry it: destination-major, and as given ([b, h, s, d]).
        self._riding: tuple[torch.Tensor, torch.Tensor] | None = None
        self._carried = False
        self._exchanged = None
        if v_major is None and (layer is None or exchanger.slow_level is None or layer.stopped()):
            # Exact: the head blocks are written once, in the order the chosen exchange sends.
            self._handle = exchanger.start_heads(tensors, label)
            if carrying is not None:
                carrying.start_alone()
        else:
            names = (self._name,)
            if carrying is not None and carrying._rides_with(self._stacked_shape, v_major):
                # Q, K and V written once, side by side (the layout of xfuser's combined exchange).
                names, tensors = (self._name, "v"), (*tensors, carrying._riding[1])
                self._nbytes += carrying._nbytes
            elif carrying is not None:
                carrying.start_alone()
            # V-Major compares and caches destination-major data, like xfuser's _combined_qkv_all_to_all.
            stacked = heads(tensors, (world,), (0,))
            commstats.count_copy(stacked.numel() * stacked.element_size())
            if layer is not None:
                bookkeeping = time.perf_counter()
                v_major = layer.begin(stacked)
                commstats.count_v_major_time(time.perf_counter() - bookkeeping)
                if v_major.v_rides:
                    self.v_major, self._riding, self._handle, self._calibration = v_major, (stacked, tensors[0]), None, False
                    return
            self._covered = _Covered.start(exchanger, names, stacked, label, v_major)
            self._handle = exchanger.start(stacked, label) if self._covered is None else self._covered.handle
            if len(names) == 2:
                carrying._carried_by(self._covered)
        self.v_major = None if self._covered is None else v_major
        self._calibration = commstats.calibrating(label, self._nbytes)
        self._exchanged = self._result() if self._calibration else None

    def _rides_with(self, shape: tuple[int, ...], step: policy.Step) -> bool:
        """Whether this waiting V can travel in the exchange of destination-major Q/K of ``shape``:
        V's shape but for the number of tensors, and ``step`` covers Q/K of that shape."""
        return self._riding is not None and self._riding[0].shape[2:] == shape[2:] and step.covers("qk", self._riding[0])

    def _carried_by(self, covered: _Covered) -> None:
        """V's rows left with Q/K's exchange ``covered``, which holds V's result."""
        self._riding, self._covered, self._handle, self._carried = None, covered, covered.handle, True

    def start_alone(self) -> None:
        """Start V's exchange where it waited to ride with Q/K's and they cannot carry it."""
        if self._riding is not None:
            (stacked, _), self._riding = self._riding, None
            self._covered = _Covered.start(self.exchanger, ("v",), stacked, self._label, self.v_major)
            self._handle = self._covered.handle

    def _result(self) -> torch.Tensor:
        return self._handle.wait() if self._covered is None else self._covered.wait(self._name)

    def advance(self) -> None:
        """Launch the exchange's next phase (the slow links; on NCCL/XCCL without blocking the host)."""
        if self._exchanged is None and self._handle is not None:
            self._handle.advance()

    def wait(self) -> tuple[torch.Tensor, ...]:
        waited = time.perf_counter()
        self.start_alone()  # a V that nothing carried
        exchanged = self._result() if self._exchanged is None else self._exchanged
        if commstats.enabled() and not self._carried:  # a carried V's bytes and time are Q/K's
            finished = timing.now(exchanged.device)
            commstats.record_async(self._label, self._nbytes, self._started, waited, finished, self._calibration)
        if exchanged.shape != self._stacked_shape:  # fp8 on the slow links only: rows of its own layout
            exchanged = exchanged.reshape(self._stacked_shape)
        commstats.count_copy(exchanged.numel() * exchanged.element_size())
        return sequence(exchanged)


class _Covered:
    """An exchange that a V-Major decision covers: ``names`` ('v', 'qk' or 'o'; 'qk' and 'v'
    together where V rides with Q/K at a sparse step) of destination-major ``[W, n, b, h/W, s, d]``
    data (theirs along dim 1, in that order), exact at a full step, else sparse over slow links into
    the layer's cache of its previous result, which its result becomes."""

    @classmethod
    def start(
        cls, exchanger: Exchanger, names: tuple[str, ...], stacked: torch.Tensor, label: str, step: policy.Step | None
    ) -> _Covered | None:
        """The exchange started, or None where ``step`` does not cover it (the caller's exact exchange)."""
        if step is None or not all(step.covers(name, stacked) for name in names):
            return None
        return cls(exchanger, names, stacked, label, step)

    def __init__(self, exchanger: Exchanger, names: tuple[str, ...], stacked: torch.Tensor, label: str, step: policy.Step) -> None:
        self._step = step
        self._names = names
        self._results: dict[str, torch.Tensor] | None = None
        self._shape = stacked.shape
        bookkeeping = time.perf_counter()
        if step.active is None:
            step.rows(names, stacked)
            commstats.count_v_major_time(time.perf_counter() - bookkeeping)
            self.handle = exchanger.start(stacked, label)
            return
        world, n, b, local_heads, s, d = stacked.shape
        rows, residual = step.rows(names, stacked)
        commstats.count_v_major_time(time.perf_counter() - bookkeeping)
        commstats.count_v_major_sparse("+".join(names))
        planes = n * b * local_heads  # [W, n, b, h/W, s, d] as [W, planes, s, d]
        # The rows for each rank on another node: [n, b, h/W, k, d'] (d' = d, or int4's bytes) as [planes, k, d'].
        rows = {j: r.reshape(planes, r.shape[3], r.shape[4]) for j, r in rows.items()}
        received = step.caches.received[names[0]] if len(names) == 1 else step.caches.joined("received", names)
        self.handle = exchanger.start_sparse(
            stacked.view(world, planes, s, d), rows, step.selection, received.reshape(world, planes, s, d), label, residual,
            by_receiver=names == ("o",), learn_peers="v" in names,
        )

    def wait(self, name: str) -> torch.Tensor:
        """The exchanged ``name`` part (``[W, n, b, h/W, s, d]``), also kept as the receivers' copy."""
        if self._results is None:
            exchanged = self.handle.wait().view(self._shape)
            caches = self._step.caches
            if "v" in self._names and self.handle.peers is not None:  # what V's sparse exchange learned
                caches.peers = self.handle.peers
            if len(self._names) == 1:
                caches.received[self._names[0]] = exchanged
            else:
                caches.split("received", self._names, exchanged)
            self._results = {part: caches.received[part] for part in self._names}
        return self._results[name]


def exchange_inputs(query: torch.Tensor, key: torch.Tensor, value: PendingExchange
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exchanges of Q and K (the query with any joint tokens), and the wait for V's exchange
    ``value``: head-sharded Q, K, V."""
    value.advance()
    exchanger = value.exchanger
    if query.shape == key.shape:
        query, key = PendingExchange(exchanger, (query, key), "qk", v_major=value.v_major, carrying=value).wait()
    else:  # the query carries the joint tokens: two exchanges, both in flight together
        value.start_alone()
        pending_q, pending_k = PendingExchange(exchanger, (query,), "q"), PendingExchange(exchanger, (key,), "k")
        (query,), (key,) = pending_q.wait(), pending_k.wait()
    (value,) = value.wait()
    return query, key, value


def output(value: PendingExchange, out: torch.Tensor, heads: int) -> torch.Tensor:
    """The Ulysses output exchange of the layer whose V's exchange was ``value``, head-sharded
    ``[b, h/W, W*s, d]`` back to ``[b, h, s, d]`` (the first ``heads`` of them: the rest are
    padding, :mod:`cocodiff_xfuser.padding`).

    The layout changes of xfuser's ``_ft_c_output_all_to_all``. Under V-Major's scope qkvo, the
    layer's decision covers it: rows are then destination-major ``[W, 1, b, h/W, s, d]``.
    """
    exchanger, v_major = value.exchanger, value.v_major
    world = exchanger.world_size
    b, h, s, d = out.shape
    exchanger.padding.count(out.numel() * out.element_size(), heads, h * world)
    if v_major is not None:
        # The wire's values, which V-Major's residuals are taken of (the exact exchange rounds its own).
        stacked = transport.wire_values(output_stacked(out, world))
        covered = _Covered.start(exchanger, ("o",), stacked, "out", v_major)
        if covered is not None:
            return output_unstacked(commstats.timed_exchange(lambda _: covered.wait("o"), stacked), heads)
    return output_heads(commstats.timed_exchange(lambda t: exchanger.all_to_all(t, "out"), output_blocks(out)), world, heads)
