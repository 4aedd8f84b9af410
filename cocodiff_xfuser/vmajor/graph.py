"""V-Major of a Ulysses layer with static shapes: plain torch that a compiled graph holds, and eager runs.

A layer call sends, over slow links, a number of tokens fixed before it runs (top-k's share of
them, :func:`.policy.count`), chosen on the device by a top-k of the integer change keys
(:func:`.policy.token_change`, ranked as a stable sort orders them), the rest carried by error
feedback: a token left out keeps its distance to the value the receivers hold, and is ranked by it
again at the next step. Each exchange is one ``all_to_all_single`` over the Ulysses group with
split sizes fixed by the shapes and that count (node-mates get whole chunks, ranks on other nodes
the rows, after a bitmask of them in V's exchange, whose receivers learn from it which rows Q/K's
and the output's carry), which inductor schedules and a CUDA graph captures as stock's exchange
(eagerly, cocodiff's point-to-point batch of the same pieces: :func:`uneven_all_to_all`).
No operator of cocodiff's, no host read. V's exchange is issued before Q and K are projected and
received after Q/K's is issued; at a sparse step, where V's exchange is its few changed rows and
there is little to hide, V's rows ride in Q/K's exchange instead (one input exchange per layer, its
latency saved on every link), as on the per-call path.

Per-call state is the step's *phase* (:attr:`.clock.Clock.phase`: ``first``, ``whole``, ``exact``,
``sparse``; ``outside`` a pipeline call) and the CFG branch, which a graph reads as constants
(dynamo guards them: a handful of graphs, made in the first pipeline call). The caches (the
senders' references and the receivers' results) are tensors the layer keeps from call to call
(:func:`_kept`), static inputs of its graphs, updated in place and zeroed by each call's first
step, so a request served after others gives the image a fresh process gives. What ran is counted
when the graph is traced (:func:`cocodiff_xfuser.commstats.traced`).

Scopes, residual dtypes, warm-up, refresh and the first step follow
:class:`cocodiff_xfuser.settings.VMajorSettings`. Counts that depend on the data (budget,
threshold) or on the step (schedule) cannot be fixed before a graph is traced without carrying one
request's measurements into the next: those policies, auto, V-Major on the ring's K/V under them
(top-k's ring has a static path of its own, :mod:`.ring_graph`) and fp8 on the wire take the per-call path (:mod:`.policy`, :mod:`cocodiff_xfuser.comm.sparse`), which a compiled job
runs between its graphs (:func:`cocodiff_xfuser.processors.ulysses.start_input_exchange`).
"""

from __future__ import annotations

import logging
import math

import torch

from cocodiff_xfuser import commstats, compat, ulysses_collectives, ulysses_layout
from cocodiff_xfuser.comm import functional, residuals, sparse, transport
from cocodiff_xfuser.settings import TopK
from cocodiff_xfuser.vmajor import policy

logger = logging.getLogger("cocodiff_xfuser")
_wait_tensor = compat.torch_private("torch.distributed._functional_collectives", "wait_tensor")


def applies(exchanger, layer: policy.Layer | None) -> bool:
    """Whether ``layer``'s calls take this path: a Ulysses layer whose group crosses nodes, a count
    fixed by the settings (top-k), no V-Major on the ring's K/V on the host (the per-call policies'),
    values exchanged as they are (no fp8). Padded tokens are zeros that never change: never selected, and
    cut from K and V as the exact path cuts them."""
    return (layer is not None and isinstance(layer.settings.rule, TopK) and not exchanger.ring_on_host
            and exchanger.options.compress == "none" and exchanger.slow_level is not None
            and exchanger.slow_level.exists)


class LayerCall:
    """One layer call's V-Major exchanges: V's (started by :func:`start_v`), then Q/K's and the
    output's, which follow V's selection where the scope says so and their shapes are V's."""

    def __init__(self, exchanger, layer: policy.Layer, v: torch.Tensor) -> None:
        self.exchanger, self.layer, self.settings = exchanger, layer, layer.settings
        clock = layer.clock
        self.phase = clock.phase
        self.shape = v.shape  # [W, 1, b, h/W, s, d]
        #: Exchange name -> (the senders' reference, the receivers' result); None: the exact exchange.
        self.caches = None
        if clock.current is not None:
            key = (clock.current.branch, tuple(v.shape), str(v.dtype), str(v.device))
            if _kept(layer.number, key):
                self.caches = layer.buffers[key]
            else:
                commstats.traced("count_fallback", "v-major: cache budget")
        #: Whether Q/K's exchange (and K's alone) follows V's selection, as the scope says.
        self.follows = self.caches is not None and self.settings.scope in ("qkv", "qkvo")
        level = exchanger.slow_level
        self.remote = level.remote
        self.fast = tuple([level.fast(j) for j in range(exchanger.world_size)])
        tokens = v.shape[4]
        k = tokens if self.phase != "sparse" or self.caches is None else policy.count(self.settings, clock, layer.index, 0, tokens)
        residual = self.settings.residual
        if residual is not None and sparse.whole_is_smaller(k, tokens, policy.token_bytes(v, residual)):
            k = tokens
        self.k = k
        #: Residuals (None: values): values at a refresh, and at the first step unless its residuals are against zeros.
        exact = self.phase == "exact" or (self.phase == "first" and self.settings.first_step != "residual")
        self.residual = None if exact else residual
        self.active: torch.Tensor | None = None  # this rank's rows (ascending), where fewer than every one
        self.mask: torch.Tensor | None = None  # their mask, as V's exchange sends it ahead of them
        self.peers: torch.Tensor | None = None  # [R, k] the rows of each remote group rank, from V's masks
        self.v: _InFlight | None = None  # V's exchange in flight
        #: V (destination-major) and its exchange's label, where its rows wait to ride in Q/K's exchange.
        self.v_waiting: tuple[torch.Tensor, str] | None = None

    #: The layer's V-Major on the ring's K/V (:mod:`.ring_graph`).
    ring = None


def start_v(exchanger, layer: policy.Layer, value: torch.Tensor, label: str) -> LayerCall:
    """V's exchange of a V-First call (``[b, h, s, d]``), issued before its Q/K are projected."""
    commstats.traced("count_v_first_call")
    stacked = _stacked(exchanger, (value,))
    call = LayerCall(exchanger, layer, stacked)
    s = stacked.shape[4]
    if call.caches is not None:
        commstats.traced("count_v_major", call.phase, layer.index, call.k, s)
    if call.k < s:
        keys = policy.token_change(call.settings.rule.metric, layer.crossing(stacked),
                                   layer.crossing(_cache(call, "v")[0]), 4, (0, 1, 3, 5))
        ranks, _ = policy.rank(keys)
        call.active, call.mask = policy.top(ranks, call.k)
    if call.phase == "sparse" and call.follows:
        call.v_waiting = (stacked, label)  # Q/K's exchange carries V's rows where Q and K follow them
    else:
        call.v = _issue(call, "v", stacked, label, by_receiver=False)
    return call


def _v_issued(call: LayerCall) -> _InFlight:
    """V's exchange: in flight since V's start, or issued now where its rows waited for Q/K's."""
    if call.v is None:
        stacked, label = call.v_waiting
        call.v = _issue(call, "v", stacked, label, by_receiver=False)
    return call.v


def exchange_inputs(query: torch.Tensor, key: torch.Tensor, call: LayerCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q's and K's exchanges, then V's result: head-sharded Q, K, V (``[b, h/W, W*s, d]``). Q/K's
    exchange is issued before V's is received, whose masks tell Q/K's receivers the rows."""
    follows, exchanger, tokens = call.follows, call.exchanger, call.shape[4]
    if follows and query.shape[2] == tokens and query.shape == key.shape:
        if call.v is None:  # V's rows ride: one exchange for the three
            qkv = torch.cat((_stacked(exchanger, (query, key)), call.v_waiting[0]), 1)  # [W, 3, b, h/W, s, d]
            query, key, value = ulysses_layout.sequence(_receive(call, _issue(call, "qkv", qkv, "qk", by_receiver=False)))
            return query, key, value
        pending = _issue(call, "qk", _stacked(exchanger, (query, key)), "qk", by_receiver=False)
        (value,) = ulysses_layout.sequence(_receive(call, call.v))
        query, key = ulysses_layout.sequence(_receive(call, pending))
        return query, key, value
    if query.shape == key.shape:
        query, key = ulysses_collectives.wait(ulysses_collectives.start(exchanger, (query, key), "qk"))
    else:  # the query carries joint tokens: exact; K follows V where it can
        _v_issued(call)  # V's rows cannot ride: V's exchange first, as V-First's
        (query,) = ulysses_collectives.wait(ulysses_collectives.start(exchanger, (query,), "q"))
        if follows and key.shape[2] == tokens:
            pending = _issue(call, "k", _stacked(exchanger, (key,)), "k", by_receiver=False)
            (value,) = ulysses_layout.sequence(_receive(call, call.v))
            (key,) = ulysses_layout.sequence(_receive(call, pending))
            return query, key, value
        (key,) = ulysses_collectives.wait(ulysses_collectives.start(exchanger, (key,), "k"))
    (value,) = ulysses_layout.sequence(_receive(call, _v_issued(call)))
    return query, key, value


def output(call: LayerCall, out: torch.Tensor, heads: int) -> torch.Tensor:
    """The output exchange, head-sharded ``[b, h/W, W*s, d]`` back to ``[b, h, s, d]`` (its first
    ``heads``): under scope qkvo each rank on another node gets its own active tokens' rows."""
    world = call.exchanger.world_size
    b, local_heads, tokens, d = out.shape
    s = tokens // world
    if call.settings.scope != "qkvo" or call.caches is None or s != call.shape[4]:
        return ulysses_collectives.output(call, out, heads)
    call.exchanger.padding.count(out.numel() * out.element_size(), heads, local_heads * world)
    x = transport.wire_values(ulysses_layout.output_stacked(out, world))  # [W, 1, b, h/W, s, d]: token block j for rank j
    return ulysses_layout.output_unstacked(_receive(call, _issue(call, "o", x, "out", by_receiver=True)), heads)


#: Shapes a layer keeps caches for at most (the oldest dropped first): a service of many image
#: sizes stays bounded, and a size that comes back after others traces its graphs again.
KEPT_SHAPES = 8
#: The caches each scope keeps, by their planes: Q, K, V in one (V's exchange, Q/K's and the one where
#: V's rows ride in Q/K's read its planes, :func:`_cache`), the output's apart.
_CACHED = {"v": {"v": 1}, "qkv": {"qkv": 3}, "qkvo": {"qkv": 3, "o": 1}}
#: The planes of the Q/K/V caches each exchange reads (K alone: where Q carries joint tokens).
_PLANES = {"qk": slice(0, 2), "k": slice(1, 2), "v": slice(2, 3), "qkv": slice(0, 3)}


@compat.trace_time
def _kept(number: int, key: tuple) -> bool:
    """Whether the layer numbered ``number`` keeps caches for ``key`` (branch, V's shape, dtype,
    device), made here where it has none: tensors the layer keeps from call to call (a graph's
    static inputs, which CUDA graph trees let it update in place), zeroed by each pipeline call's
    first step. Run when a graph is traced, before the graph reads them. False where they would
    exceed ``budget_mib``."""
    layer = policy.numbered(number)
    if key in layer.buffers:
        return True
    _, shape, dtype, device = key
    world, _, b, local_heads, s, d = shape
    shapes = {name: (world, planes, b, local_heads, s, d) for name, planes in _CACHED[layer.settings.scope].items()}
    dtype = getattr(torch, dtype.removeprefix("torch."))
    nbytes = 2 * sum(math.prod(one) for one in shapes.values()) * dtype.itemsize
    clock = layer.clock
    if len(layer.buffers) >= KEPT_SHAPES:
        oldest = next(iter(layer.buffers))
        clock.cache_bytes -= sum(2 * t.numel() * t.element_size() for t, _ in layer.buffers.pop(oldest).values())
    if clock.cache_bytes + nbytes > layer.settings.budget_mib * 2**20:
        if not clock.budget_warned:
            clock.budget_warned = True
            logger.warning("cocodiff: V-Major cache budget (%g MiB, --cocodiff-v-major-budget-mib) reached at layer %d "
                           "of %d; layers beyond it use the exact exchange", layer.settings.budget_mib, layer.index, clock.layers)
        return False
    made = {}
    for name, one in shapes.items():
        made[name] = (torch.zeros(one, dtype=dtype, device=device), torch.zeros(one, dtype=dtype, device=device))
        for t in made[name]:
            compat.mark_static(t)
    layer.buffers[key] = made
    clock.cache_bytes += nbytes
    return True


def _cache(call: LayerCall, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The senders' reference and the receivers' copy that exchange ``name`` reads and updates."""
    if name == "o" or call.settings.scope == "v":
        return call.caches[name]
    reference, received = call.caches["qkv"]
    planes = _PLANES[name]
    return reference[:, planes], received[:, planes]


def _stacked(exchanger, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The destination-major ``[W, n, b, h/W, s, d]`` of ``tensors``, with the values the wire
    carries (what V-Major compares and keeps); counted with the copy it is read back in."""
    stacked = ulysses_collectives.stack(exchanger, tensors)
    commstats.traced("count_copy", 2 * stacked.numel() * stacked.element_size())
    return transport.wire_values(stacked)


class _InFlight:
    """An exchange :func:`_issue` issued, which :func:`_receive` completes: ``out``, what arrived,
    in pieces of ``sizes``; ``received``, the receivers' copy it updates (None: ``out`` is the result)."""

    def __init__(self, name: str, out: torch.Tensor, received: torch.Tensor | None, sizes: list[int], data_bytes: int,
                 by_receiver: bool) -> None:
        self.name, self.out, self.received, self.sizes, self.data_bytes = name, out, received, sizes, data_bytes
        self.by_receiver = by_receiver


def _issue(call: LayerCall, name: str, x: torch.Tensor, label: str, by_receiver: bool) -> _InFlight:
    """Issue the exchange ``name`` ('v', 'qk', 'k', 'qkv': V's rows riding in Q/K's, or 'o') of
    destination-major ``x`` (``[W, n, b, h/W, s, d]``): node-mates get whole chunks; each rank on
    another node the call's rows, as values or residuals against the layer's reference, which the
    senders update here. The rows: this rank's ``active``, its mask ahead in the exchange that
    carries V's (whose receivers learn ``peers``); with ``by_receiver`` (the output) each receiver's
    own active rows, which it knows."""
    if call.caches is None:  # outside a pipeline call, or beyond the budget: the exact exchange
        if call.layer.clock.current is None:
            commstats.traced("count_fallback", "v-major: outside a pipeline call")
        return _InFlight(name, ulysses_collectives.all_to_all(call.exchanger, x, label), None, [], 0, by_receiver)
    _, n, b, local_heads, s, d = x.shape
    reference, received = _cache(call, name)
    if call.phase == "first":  # the receivers hold zeros before anything arrives
        reference.zero_()
        received.zero_()
    residual, k, every = call.residual, call.k, call.k == s
    with_mask = name in ("v", "qkv") and not every
    wire = transport.wire_dtype(x.dtype)
    row = residuals.row_bytes(d, residual) if residual is not None else d * wire.itemsize
    full = n * b * local_heads * s * d * wire.itemsize
    data_bytes = n * b * local_heads * k * row + (sparse.mask_bytes(s) if with_mask else 0)
    piece = functional.aligned(data_bytes)
    padding_bytes = x.new_zeros(piece - data_bytes, dtype=torch.uint8) if piece > data_bytes else None
    sizes = [full if fast else piece for fast in call.fast]
    # The whole chunk to node-mates; to each rank on another node, its rows (after their mask).
    pieces, mask = [], call.mask
    for j, fast in enumerate(call.fast):
        if fast:
            pieces.append(sparse.as_bytes(transport.on_wire(x[j])))
            continue
        rows = _every(s, x) if every else call.peers[call.remote.index(j)] if by_receiver else call.active
        payload = residuals.encode(x[j], reference[j], rows, 3, residual)
        data = sparse.as_bytes(payload if residual is not None else transport.on_wire(payload))
        pieces += [mask, data] if with_mask else [data]
        if padding_bytes is not None:
            pieces.append(padding_bytes)
    payload = torch.cat(pieces)
    if commstats.timings_on and not torch.compiler.is_dynamo_compiling():
        # Eagerly it blocks: timed as stock's exchange is, over the data it stands for.
        out = commstats.timed_exchange(lambda _: uneven_all_to_all(payload, sizes, call.exchanger.group), x)
    else:
        out = uneven_all_to_all(payload, sizes, call.exchanger.group)
    commstats.traced("count_exchange", "v-major one-phase", label, len(call.remote) * piece, len(call.remote) * full)
    if not every:
        commstats.traced("count_v_major_sparse", "qk+v" if name == "qkv" else name)
    return _InFlight(name, out, received, sizes, data_bytes, by_receiver)


def uneven_all_to_all(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """The exchange of flat ``x`` in pieces of ``sizes`` both ways over ``group``: traced, the
    functional collective a graph holds; eagerly, on every backend, cocodiff's point-to-point batch
    of the same pieces (as the per-call path sends its rows, :func:`.sparse.post_uneven`), waited
    for before the layer goes on: gloo's ``all_to_all_single`` with split sizes posts its pairs
    round after round (docs/benchmarks.md, "The static path's exchange on gloo")."""
    if torch.compiler.is_dynamo_compiling():
        return functional.uneven_all_to_all(x, sizes, group.group_name)
    out = torch.empty_like(x)
    sparse.post_uneven(list(out.split(sizes)), list(x.split(sizes)), group, "v-major one-phase").wait()
    return out


def _receive(call: LayerCall, pending: _InFlight) -> torch.Tensor:
    """Complete ``pending`` into the receivers' copy (source-major ``[W, n, b, h/W, s, d]``), which it
    returns: node-mates' chunks replace theirs, other nodes' rows update theirs. Waited for here,
    where its result is first read (eagerly: once, not on every operation on it)."""
    out = _wait_tensor(pending.out)
    received = pending.received
    if received is None:
        return out
    _, n, b, local_heads, s, d = received.shape
    residual, k, every = call.residual, call.k, call.k == s
    with_mask = pending.name in ("v", "qkv") and not every
    wire = transport.wire_dtype(received.dtype)
    travels = wire if residual is None else torch.uint8 if residual == torch.int4 else residual
    index = sparse.mask_bytes(s) if with_mask else 0
    peers = []
    for i, part in enumerate(out.split(pending.sizes)):
        if call.fast[i]:
            received[i].copy_(part.view(wire).view(n, b, local_heads, s, d))
            continue
        if with_mask:
            rows = sparse.rows_of(part[:index], s, k)
            peers.append(rows)
        else:
            rows = None if every else call.active if pending.by_receiver else call.peers[call.remote.index(i)]
        values = part[index:pending.data_bytes].view(travels).view(n, b, local_heads, k, -1)
        residuals.apply(received[i], values.to(received.dtype) if residual is None else values, rows, 3, residual is not None)
    if with_mask:
        call.peers = torch.stack(peers)
    return received


def _every(s: int, like: torch.Tensor) -> torch.Tensor:
    return torch.arange(s, device=like.device)
