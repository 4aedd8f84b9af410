"""The Ulysses core shared by the V-First processors: split exchanges, then xfuser's attention.

Stock xfuser exchanges Q, K and V together (``USP``) after Q/K normalization and RoPE. A
V-First processor instead starts V's exchange as soon as V is projected
(:func:`start_input_exchange`), computes Q/K while it is in flight, and hands everything to
:func:`attention`, which exchanges Q and K, waits for V and runs the same attention function,
ring merge and output exchange as ``USP``. The exchanges move the same bytes to the same
places, so the output is bitwise that of stock Ulysses. Under V-Major, at a sparse step whose Q and
K follow V's selection, V's few changed rows ride in Q/K's exchange instead: one input exchange
per layer, not two (:attr:`cocodiff_xfuser.vmajor.policy.Step.v_rides`). Head and token counts that the Ulysses
degree does not divide, which stock refuses (or, for FLUX text, attends once per rank), are padded
here (:mod:`cocodiff_xfuser.padding`): attention stays exact, the bits are no longer stock's.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import torch

from cocodiff_xfuser import commstats, compat, padding, ulysses_collectives
from cocodiff_xfuser.comm import timing, transport
from cocodiff_xfuser.comm.agreement import any_rank
from cocodiff_xfuser.errors import user_error
from cocodiff_xfuser.exchanger import Exchanger
from cocodiff_xfuser.ulysses_layout import heads, sequence
from cocodiff_xfuser.vmajor import clock as vmajor_clock
from cocodiff_xfuser.vmajor import graph as vmajor_graph
from cocodiff_xfuser.vmajor import policy

logger = logging.getLogger("cocodiff_xfuser")
_warned: set[str] = set()


class VFirst:
    """Base of the V-First processors: ``exchanger`` is the job's (given at installation; without
    one, or once it is closed, every call takes the stock path), ``v_major`` the layer's V-Major
    state, when it is on, and ``clock`` its transformer's step clock under V-Major (auto's speed
    check may send a step's calls to the stock processor: :meth:`.Clock.stock_step`)."""

    exchanger: Exchanger | None = None
    v_major: policy.Layer | None = None
    clock: vmajor_clock.Clock | None = None


class PendingExchange:
    """Sequence-sharded ``[b, h, s, d]`` tensors on their way to head-sharded ``[b, h/W, W*s, d]``.

    With V-Major (``layer`` for V's exchange, then V's decision ``v_major`` for Q/K's), the
    exchange may be sparse over slow links and lands in the layer's cache of its previous result.
    At a sparse step whose Q and K follow V's selection, V's exchange waits to ride with Q/K's
    (``carrying``): its rows then travel in Q/K's messages, and the layer posts one input exchange,
    not two (:attr:`cocodiff_xfuser.vmajor.policy.Step.v_rides`).
    """

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
        padding.count(self._nbytes, head_count, h)
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
        return sequence(exchanged, self._n)


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


def start_input_exchange(
    exchanger: Exchanger,
    value: torch.Tensor,
    *,
    label: str,
    layer: policy.Layer | None = None,
) -> PendingExchange | ulysses_collectives.InFlight | vmajor_graph.LayerCall | OnHost:
    """Start the Ulysses input exchange of a V-First call's V (``[b, h, s, d]``) through ``exchanger``,
    asynchronously (counted as the call); ``layer``: its V-Major layer.

    An exact layer's exchange is a functional collective (:mod:`cocodiff_xfuser.ulysses_collectives`),
    issued here, before Q and K are projected, traced or not; a top-k V-Major layer's likewise
    (:mod:`cocodiff_xfuser.vmajor.graph`). Eagerly, the others take the exchanger's handles. Traced,
    the others (:func:`in_graph`) start between graphs, on the host: the graph breaks here and at
    :func:`attention`, and the Q/K projections between run as a graph of their own while V's
    exchange is in flight.
    """
    if torch.compiler.is_dynamo_compiling() and not in_graph(exchanger, layer):
        return OnHost(_start_on_host(exchanger, value, label, layer))
    return _start(exchanger, value, label, layer)


def in_graph(exchanger: Exchanger, layer: policy.Layer | None) -> bool:
    """Whether a compiled graph holds a V-First layer's exchanges: exact ones, fp8 on the wire and
    top-k V-Major's (static shapes), unless V-Major runs on the ring's K/V. There the graph breaks at
    the ring attention and dynamo traces the layer's pieces as frames of their own, with dynamic
    sizes after the second block type, which an exchange's route cannot be fixed for; and V-Major's
    other policies choose their counts from the data or the step, which a graph cannot fix when it
    is traced without carrying one request's measurements into the next."""
    if exchanger.ring_on_host:
        return False
    return vmajor_graph.applies(exchanger, layer) if layer is not None else ulysses_collectives.applies(exchanger, None)


class OnHost:
    """A compiled layer's exchange started between graphs (``pending``, the eager path's), which
    :func:`attention` finishes between graphs too."""

    def __init__(self, pending: PendingExchange | ulysses_collectives.InFlight | vmajor_graph.LayerCall) -> None:
        self.pending = pending


def _start(exchanger: Exchanger, value: torch.Tensor, label: str, layer: policy.Layer | None
           ) -> PendingExchange | ulysses_collectives.InFlight | vmajor_graph.LayerCall:
    if layer is not None and vmajor_graph.applies(exchanger, layer):  # eagerly too: the same code
        return vmajor_graph.start_v(exchanger, layer, value, label)
    if ulysses_collectives.applies(exchanger, layer):  # eagerly too: the same code
        return ulysses_collectives.start_v(exchanger, value, label)
    commstats.count_v_first_call()  # V's exchange: one per V-First call
    return PendingExchange(exchanger, (value,), label, layer)


_start_on_host = torch.compiler.disable(_start)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: PendingExchange | ulysses_collectives.InFlight | vmajor_graph.LayerCall | OnHost,
    *,
    joint_query: torch.Tensor | None = None,
    joint_key: torch.Tensor | None = None,
    joint_value: torch.Tensor | None = None,
    joint_strategy: str | None = None,
    attention_kwargs: dict | None = None,
) -> torch.Tensor:
    """Ulysses attention with V already in flight; ``[b, h, s, d]`` in and out, like ``USP``.

    The joint arguments are ``USP``'s (text kept whole on every rank and attended ``"rear"``):
    ``joint_query`` joins the query before its exchange, ``joint_key``/``joint_value`` are
    narrowed to this rank's heads and joined by the attention function. ``attention_kwargs``
    go to the attention function as in ``USP``, after its K/V padding trim
    (:func:`attention_kwargs_reason` says which ones this does not handle).

    Under torch.compile, with V's exchange issued as a functional collective, so are the others; with
    V's exchange started on the host (:class:`OnHost`), the rest of the layer's attention runs there
    too, between graphs.
    """
    joint = {"joint_query": joint_query, "joint_key": joint_key, "joint_value": joint_value,
             "joint_strategy": joint_strategy, "attention_kwargs": attention_kwargs}
    if isinstance(value, OnHost):
        return _attention_on_host(query, key, value.pending, **joint)
    return _attention(query, key, value, **joint)


def _attention(query, key, value, *, joint_query, joint_key, joint_value, joint_strategy, attention_kwargs) -> torch.Tensor:
    head_count = query.shape[1]
    joint_attn_kwargs = None
    if joint_strategy:
        query, joint_attn_kwargs = _joined(query, joint_query, joint_key, joint_value, joint_strategy)
    pending = value
    if isinstance(pending, vmajor_graph.LayerCall):
        query, key, value = vmajor_graph.exchange_inputs(query, key, pending)
        key, value = padding.keep_keys(key, value)  # the running forward's padded tokens, if any
    elif isinstance(pending, ulysses_collectives.InFlight):
        query, key, value = ulysses_collectives.exchange_inputs(query, key, pending)
        key, value = padding.keep_keys(key, value)
    else:
        exchanger, query, key, value, v_major = exchange_inputs(query, key, pending)
    if attention_kwargs:  # (without them stock's trim returns K and V as they are)
        key, value = compat.usp("_trim_trailing_kv_padding")(key, value, attention_kwargs)
    out = _attend(compat.usp("_get_attention_function")(), query, key, value, joint_attn_kwargs, attention_kwargs)
    if isinstance(pending, vmajor_graph.LayerCall):
        return vmajor_graph.output(pending, out, head_count)
    if isinstance(pending, ulysses_collectives.InFlight):
        return ulysses_collectives.output(pending.exchanger, out, head_count)
    return output_exchange(exchanger, out, v_major, head_count)


_attention_on_host = torch.compiler.disable(_attention)


def _joined(query, joint_query, joint_key, joint_value, joint_strategy) -> tuple[torch.Tensor, dict | None]:
    """``USP``'s joint tokens: the query with ``joint_query`` joined, and the joint arguments of its
    attention function (``joint_key``/``joint_value`` narrowed to this rank's heads)."""
    from xfuser.core.distributed import get_ring_parallel_world_size, get_ulysses_parallel_world_size

    world = get_ulysses_parallel_world_size()
    query = compat.usp("_concat_joint_tensor")(query, joint_query, joint_strategy, dim=2)
    joint_key, joint_value = compat.usp("_preprocess_joint_tensors")(
        padding.pad_heads(joint_key, world), padding.pad_heads(joint_value, world)
    )
    return query, {
        "joint_value": joint_value,
        "joint_key": joint_key,
        "joint_strategy": joint_strategy,
        "step": 0,
        "total_steps": get_ring_parallel_world_size(),
    }


def _attend(attention_function, query, key, value, joint_attn_kwargs, attention_kwargs) -> torch.Tensor:
    """``USP``'s attention of head-sharded Q, K, V, over the ring where there is one."""
    from xfuser.core.distributed import get_ring_parallel_world_size
    from xfuser.model_executor.layers.usp import ring_attn

    kwargs = {"dropout_p": 0.0, "is_causal": False, "joint_attn_kwargs": joint_attn_kwargs, "attention_kwargs": attention_kwargs}
    if get_ring_parallel_world_size() == 1:
        out, _ = attention_function(query, key, value, **kwargs)
        return out
    return ring_attn(attention_function, query, key, value, **kwargs)


def exchange_inputs(query: torch.Tensor, key: torch.Tensor, value: PendingExchange):
    """:func:`attention`'s exchanges of Q and K (the query with any joint tokens), and the wait for
    V's exchange ``value``: the exchanger, head-sharded Q, K, V (without the running forward's padded
    tokens) and V's V-Major step (or None)."""
    value.advance()
    exchanger = value.exchanger
    if query.shape == key.shape:
        query, key = PendingExchange(exchanger, (query, key), "qk", v_major=value.v_major, carrying=value).wait()
    else:  # the query carries the joint tokens: two exchanges, both in flight together
        value.start_alone()
        pending_q, pending_k = PendingExchange(exchanger, (query,), "q"), PendingExchange(exchanger, (key,), "k")
        (query,), (key,) = pending_q.wait(), pending_k.wait()
    v_major = value.v_major
    (value,) = value.wait()
    key, value = padding.keep_keys(key, value)
    return exchanger, query, key, value, v_major


def output_exchange(exchanger: Exchanger, out: torch.Tensor, v_major: policy.Step | None = None, heads: int | None = None) -> torch.Tensor:
    """The Ulysses output exchange, head-sharded ``[b, h/W, W*s, d]`` back to ``[b, h, s, d]``
    (the first ``heads`` of them, all by default: the rest are padding, :mod:`cocodiff_xfuser.padding`).

    The layout changes of xfuser's ``_ft_c_output_all_to_all``; the exchange goes to
    ``exchanger`` directly, like the input exchanges. Under V-Major's scope qkvo, the layer's decision
    ``v_major`` covers it: rows are then destination-major ``[W, 1, b, h/W, s, d]``.
    """
    world = exchanger.world_size
    b, h, s, d = out.shape
    heads = h * world if heads is None else heads
    padding.count(out.numel() * out.element_size(), heads, h * world)
    if v_major is not None:
        # The wire's values, which V-Major's residuals are taken of (the exact exchange rounds its own).
        stacked = transport.wire_values(out.reshape(b, h, world, s // world, d).permute(2, 0, 1, 3, 4).unsqueeze(1).contiguous())
        covered = _Covered.start(exchanger, ("o",), stacked, "out", v_major)
        if covered is not None:
            exchanged = commstats.timed_exchange(lambda _: covered.wait("o"), stacked)
            return _real_heads(exchanged.squeeze(1).transpose(0, 1).reshape(b, -1, s // world, d), heads)
    exchanged = commstats.timed_exchange(lambda t: exchanger.all_to_all(t, "out"), out.permute(2, 0, 1, 3).contiguous())
    return _real_heads(exchanged.reshape(world, s // world, b, -1, d).permute(2, 0, 3, 1, 4).reshape(b, -1, s // world, d), heads)


def _real_heads(out: torch.Tensor, heads: int) -> torch.Tensor:
    """``[b, h, s, d]`` without the padded heads past ``heads`` (``out`` itself where there are none)."""
    return out if out.shape[1] == heads else out[:, :heads]


def attention_kwargs_reason(attention_kwargs: dict | None) -> str | None:
    """Why :func:`attention` cannot reproduce ``USP`` with these ``attention_kwargs`` (None: it can)."""
    from xfuser.model_executor.layers.usp import ULYSSES_EXTRA_INPUTS_KEY

    if attention_kwargs and attention_kwargs.get(ULYSSES_EXTRA_INPUTS_KEY):
        return "extra per-head attention inputs (ulysses_extra_inputs)"
    return None


def fallback_reason(
    processor: object, extra: Callable[[], str | None] | None = None, inputs: Sequence[torch.Tensor | None] = ()
) -> str | None:
    """Why this call of ``processor`` must take the stock path (None: V-First applies), agreed.

    The reasons depend on settings, module attributes and input shapes, which SPMD code shares;
    the first call of a processor with given input shapes and local reason checks it with one
    small all-reduce over the Ulysses group (any rank's fall-back is everyone's), later ones reuse
    the answer. Counted (``commstats.ran()``: fall-backs here, V-First calls as V's exchange
    starts) and logged once per reason.

    Traced by torch.compile, V-First is decided in the graph from the local reasons alone, which
    dynamo guards (a change traces again): they read settings, module attributes and the call's
    arguments, the same on every rank, and what a rank's installation decides (fused kernels) was
    agreed when the processors were installed (:func:`cocodiff_xfuser.compat.fused_kernels`); under
    auto, the step's choice of processors, fixed for the transformer call
    (:attr:`~cocodiff_xfuser.vmajor.clock.Clock.to_stock`: two graphs at most, both traced in the
    trial's first call). A graph break inside a layer would send the model's whole forward to eager
    (its loop over blocks cannot resume), so only a fall-back breaks it, at the layer's entry.
    """
    if torch.compiler.is_dynamo_compiling() and _v_first_in_graph(processor, extra):
        return _stock_step(processor)
    return _decide(processor, extra, inputs)


def _v_first_in_graph(processor: object, extra: Callable[[], str | None] | None) -> bool:
    from xfuser.core.distributed import get_ulysses_parallel_world_size

    exchanger = getattr(processor, "exchanger", None)
    return (exchanger is not None and not exchanger.closed and get_ulysses_parallel_world_size() > 1
            and _local_reason(extra) is None)


def _stock_step(processor: object) -> str | None:
    """Auto's reason to hand this call to xfuser's processors where its step runs them (the clock
    counts the call), else None: also where the running forward padded tokens, which only cocodiff's
    split (padded heads leave the trial without stock steps: :func:`.families._attach_v_major`).
    The same on every rank: the step, agreed times and shapes decide it."""
    clock = getattr(processor, "clock", None)
    return vmajor_clock.STOCK_STEP if clock is not None and clock.to_stock and not padding.tokens_padded() else None


@torch.compiler.disable  # compiled: a graph break at the layer's entry, the decision on the host
def _decide(processor: object, extra: Callable[[], str | None] | None, inputs: Sequence[torch.Tensor | None]) -> str | None:
    from xfuser.core.distributed import get_ulysses_parallel_world_size

    exchanger = getattr(processor, "exchanger", None)
    if exchanger is None or exchanger.closed or get_ulysses_parallel_world_size() == 1:
        return _counted("no Ulysses exchange")
    local = _local_reason(extra)
    # Kept by the job's exchanger, never on the model: a new job agrees again.
    agreed = exchanger.agreed
    key = [id(processor), local]  # and the inputs' shapes and dtypes (a loop: a comprehension is a call per layer)
    for t in inputs:
        key.append(None if t is None else (t.shape, t.dtype))
    key = tuple(key)
    if key not in agreed:
        device = next((t.device for t in inputs if t is not None), torch.device("cpu"))
        anyone = any_rank(local is not None, exchanger.group, device)
        agreed[key] = local if local is not None or not anyone else "a fall-back on another rank"
    if agreed[key] is None:
        return _stock_step(processor)
    return _counted(agreed[key])


def stock_reason() -> str | None:
    """A job-wide setting that sends every call to the stock processor (None: there is none)."""
    return _local_reason(None)


def _counted(reason: str | None) -> str | None:
    if reason is None:
        return None
    needed = padding.required()
    if needed is not None:  # stock cannot split these: one clear line, not stock's assertion
        user_error(f"cocodiff: {needed} need cocodiff's processors, but {reason} sends a layer to stock")
    commstats.count_fallback(f"v-first: {reason}")
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("cocodiff: V-First off for %s; using the stock processor", reason)
    return reason


def _local_reason(extra: Callable[[], str | None] | None) -> str | None:
    from xfuser.core.distributed import get_runtime_state

    state = get_runtime_state()
    reason = None
    if state.fp8_comms is not None:
        reason = "fp8 communication"
    elif state.runtime_config.use_spargeattn_head_balance:
        reason = "Sparge head balancing"
    elif state.num_pipeline_patch > 1:
        reason = "PipeFusion"
    elif extra is not None:
        reason = extra()
    return reason


def linear_slice(layer: torch.nn.Linear, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Output features ``start:stop`` of ``layer(x)``, computed alone (rows of a fused projection)."""
    bias = None if layer.bias is None else layer.bias[start:stop]
    return torch.nn.functional.linear(x, layer.weight[start:stop], bias)


def linear_rows(layer: torch.nn.Linear, x: torch.Tensor, part: int, parts: int = 3) -> torch.Tensor:
    """One of ``parts`` equal output blocks of a fused projection (e.g. V of ``to_qkv``), computed alone."""
    rows = layer.out_features // parts
    return linear_slice(layer, x, part * rows, (part + 1) * rows)


def norm_qk(attn, query: torch.Tensor, key: torch.Tensor, added: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention module's optional QK-norm of the image stream or, with ``added``, the text stream."""
    norm_q, norm_k = (attn.norm_added_q, attn.norm_added_k) if added else (attn.norm_q, attn.norm_k)
    return (query if norm_q is None else norm_q(query)), (key if norm_k is None else norm_k(key))


def project(attn, x: torch.Tensor, which: str, added: bool = False) -> torch.Tensor:
    """Q, K or V (``which`` in 'qkv') of the image stream or, with ``added``, the text stream.

    Separate projections (``to_q``/``add_q_proj``...) or the rows of the fused ``to_qkv`` /
    ``to_added_qkv`` (diffusers' ``fuse_projections``), as the attention module has them.
    """
    part = "qkv".index(which)
    if getattr(attn, "fused_projections", False):
        return linear_rows(attn.to_added_qkv if added else attn.to_qkv, x, part)
    return getattr(attn, f"add_{which}_proj" if added else f"to_{which}")(x)
