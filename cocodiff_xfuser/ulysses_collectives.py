"""An exact layer's Ulysses exchanges, as a compiled graph holds them and eager runs them: functional collectives.

Traced by torch.compile, a layer whose exchanges are exact, fp8 on every link or fp8 on the slow
links only (no V-Major: :func:`applies`; padded heads and tokens included; a ring's K/V as stock's graph holds them) holds plain traceable torch:
each exchange is ``all_to_all_single`` over the Ulysses group, or TAPA's one per topology level
(:mod:`cocodiff_xfuser.comm.functional`), or fp8-slow's one with split sizes (values to node-mates,
fp8 rows to other nodes), which inductor schedules and a CUDA graph captures, as it does stock's;
no operator of cocodiff's, no host read, and no Python when the graph runs. V-First
is program order: V's all-to-all is written before Q and K are projected (:func:`start`) and waited
for where attention reads it (:func:`exchange_inputs`); xDiT's overlap passes (``raise_comms``,
``sink_waits``) keep it so. What an exchange needs to know is fixed when the graph is traced: its
route (flat or TAPA's levels, :meth:`~cocodiff_xfuser.router.Router.traced`, measured
once per size with real buffers), and what ran, counted then and added per transformer call
(:func:`cocodiff_xfuser.commstats.traced`).

Eagerly the same code runs (the route looked up per call, measured on a size's first use, and the
counts made as it runs), so that eager and compiled jobs exchange alike and an eager layer's host
work is the traced code's; only what the exchanger's handles alone do keeps them
(:attr:`~cocodiff_xfuser.exchanger.Exchanger.handles_only`). An eager input exchange is waited for
where it is read, and with statistics on it is timed as the handles are.
"""

from __future__ import annotations

import time

import torch

from cocodiff_xfuser import commstats, padding
from cocodiff_xfuser.comm import compress, functional, sparse, timing, transport
from cocodiff_xfuser.comm.flat import ASYNC_COLLECTIVE, BELOW_AUTOGRAD
from cocodiff_xfuser.exchanger import Exchanger
from cocodiff_xfuser.ulysses_layout import heads as head_blocks
from cocodiff_xfuser.ulysses_layout import output_blocks, output_heads, sequence


def applies(exchanger: Exchanger, layer: object | None) -> bool:
    """Whether a layer's exchanges are functional collectives: no V-Major ``layer`` (padded heads and
    tokens are static slices and zeros, :mod:`cocodiff_xfuser.padding`; a ring's K/V are torch's,
    as in stock's graph, or, under V-Major on the ring, run between graphs with the layer's
    exchanges: :func:`cocodiff_xfuser.processors.ulysses.start_input_exchange`). Eagerly the same code runs, but
    where the exchanger was asked for what only its handles do
    (:attr:`~cocodiff_xfuser.exchanger.Exchanger.handles_only`)."""
    return (layer is None and exchanger.options.compress in ("none", "fp8", "fp8-slow")
            and (not exchanger.handles_only or torch.compiler.is_dynamo_compiling() or exchanger.world_size == 1))


def all_to_all(exchanger: Exchanger, x: torch.Tensor, label: str, copied: int = 0, widen: bool = True) -> torch.Tensor:
    """The equal-split all-to-all of ``x`` (chunks destination-major along the flattened data, as
    xfuser's ``_sdpa_all_to_all_single``; rows of its last dim) over the Ulysses group, by the route
    fixed for its size; under ``--cocodiff-compress fp8`` packed as the exchanger packs it.
    ``copied``: the bytes its caller's layouts copy, counted with it. Without ``widen``, values
    that crossed the emulated wire narrower (:func:`.transport.on_wire`) stay so: eagerly, widening
    waits for the exchange, which its reader does (:func:`wait`)."""
    if exchanger.world_size == 1:  # a Ulysses group of one (V-First for its ring's V-Major): nothing to send
        return x
    if exchanger.options.compress == "fp8-slow" and exchanger.slow_fp8(x.dtype):  # (no call per exchange otherwise)
        return _slow_fp8(exchanger, x, label, copied)
    world, d = exchanger.world_size, x.shape[-1]
    fp8 = exchanger.options.compress == "fp8" and x.dtype in compress.WIDE
    if fp8:
        exact_bytes = x.numel() * transport.wire_itemsize(x.dtype)
        # [W * ..., d] -> [W, rows, d] -> [W, rows * (d + 4)] bytes: chunk j for group rank j
        payload = compress.pack(transport.wire_values(x).reshape(world, -1, d))
    else:
        # [W * ..., d] -> [W, c]: chunk j for group rank j, in the wire's dtype
        payload = transport.on_wire(x).reshape(world, -1)
        exact_bytes = payload.numel() * payload.element_size()
    # Routed once per traced exchange, before the graph runs (collective: every rank traces alike).
    algorithm, levels, groups, sent, exact = exchanger.traced_route(
        label, tuple(payload.shape), str(payload.dtype), str(payload.device), exact_bytes)
    commstats.traced("count_exchange", algorithm, label, sent, exact, copied)
    out = functional.all_to_all(payload, groups[0]) if len(groups) == 1 else functional.levels_all_to_all(payload, levels, groups)
    if fp8:
        return compress.unpack(out, x.numel() // (world * d), d, x.dtype).reshape(x.shape)
    out = out.reshape(x.shape)
    return _widened(out, x.dtype) if widen else out


def _widened(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out`` waited for, in ``dtype`` where it crossed the wire narrower."""
    if isinstance(out, ASYNC_COLLECTIVE):  # eagerly (wait_collective, inlined: this runs per exchange)
        with BELOW_AUTOGRAD():
            out = out.wait()
    return out if out.dtype == dtype else out.to(dtype)


def _slow_fp8(exchanger: Exchanger, x: torch.Tensor, label: str, copied: int) -> torch.Tensor:
    """:func:`all_to_all` under ``--cocodiff-compress fp8-slow``: node-mates get the values, ranks on
    other nodes every row in fp8 with its scale, in one exchange with split sizes fixed by the shape."""
    world, d, level = exchanger.world_size, x.shape[-1], exchanger.slow_level
    # [W * ..., d] -> [W, rows, d]: chunk j for group rank j
    chunks = transport.wire_values(x).reshape(world, -1, d)
    rows = chunks.shape[1]
    wire = transport.wire_dtype(x.dtype)
    full, packed = rows * d * wire.itemsize, compress.packed_bytes(rows, d)
    piece = functional.aligned(packed)
    sizes = [full if level.fast(j) else piece for j in range(world)]
    pieces = []
    for j in range(world):
        if level.fast(j):
            pieces.append(sparse.as_bytes(transport.on_wire(chunks[j])))
            continue
        pieces.append(compress.pack_rows(chunks[j]).view(-1))  # [rows, d + 4] bytes
        if piece > packed:
            pieces.append(x.new_zeros(piece - packed, dtype=torch.uint8))
    out = functional.uneven_all_to_all(torch.cat(pieces), sizes, exchanger.group.group_name)
    remote = len(level.remote)
    commstats.traced("count_exchange", "fp8-slow one-phase", label, remote * piece, remote * full, copied)
    received = [part.view(wire).view(rows, d).to(x.dtype) if level.fast(i) else
                compress.unpack_rows(part[:packed].view(rows, compress.packed_bytes(1, d)), x.dtype)
                for i, part in enumerate(out.split(sizes))]
    return torch.stack(received).reshape(x.shape)


class InFlight:
    """Same-shaped ``[b, h, s, d]`` tensors of ``dtype`` whose input exchange has been issued:
    ``exchanged`` is source-major ``[W, n, b, h/W, s, d]``, which is waited for where it is read.
    ``timed``: with statistics on, eagerly, its label, bytes, start and whether it calibrates
    (waited for at once: :func:`cocodiff_xfuser.commstats.calibrating`)."""

    def __init__(self, exchanger: Exchanger, exchanged: torch.Tensor, dtype: torch.dtype,
                 timed: tuple[str, int, float, bool] | None = None) -> None:
        self.exchanger, self.exchanged, self.dtype, self.timed = exchanger, exchanged, dtype, timed

    #: V's exchange: its layer's V-Major on the ring's K/V (:mod:`cocodiff_xfuser.vmajor.ring_graph`).
    ring = None


def stack(exchanger: Exchanger, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Same-shaped ``[b, h, s, d]`` tensors (their heads padded to a multiple of W) as the
    destination-major input of their exchange, ``[W, n, b, h/W, s, d]``."""
    world = exchanger.world_size
    heads = tensors[0].shape[1]
    if heads % world:
        padded = []  # (a loop, not a comprehension: each is a Python call per layer)
        for t in tensors:
            padded.append(padding.pad_heads(t, world))
        tensors = tuple(padded)
    h = tensors[0].shape[1]
    stacked = head_blocks(tensors, (world,), (0,))  # [W, n, b, h/W, s, d], destination-major, one copy
    if h != heads or exchanger.padding.running is not None:
        exchanger.padding.count(stacked.numel() * stacked.element_size(), heads, h)
    return stacked


def start(exchanger: Exchanger, tensors: tuple[torch.Tensor, ...], label: str) -> InFlight:
    """Issue the Ulysses input exchange of ``tensors`` (their heads padded to a multiple of W),
    counted with its two copies: the stack, and the layout it is read in (:func:`sequence`)."""
    stacked = stack(exchanger, tensors)
    copied = 2 * stacked.numel() * stacked.element_size()
    if commstats.timings_on and not torch.compiler.is_dynamo_compiling():
        return _timed_start(exchanger, stacked, label, copied)
    return InFlight(exchanger, all_to_all(exchanger, stacked, label, copied, widen=False), stacked.dtype)


def _timed_start(exchanger: Exchanger, stacked: torch.Tensor, label: str, copied: int) -> InFlight:
    """:func:`start` with statistics on (eagerly): timed from here to where it is read (:func:`wait`);
    one that calibrates completes here, its own time measured."""
    nbytes = stacked.numel() * stacked.element_size()  # as the handles and stock count: the data, not the wire
    started = timing.now(stacked.device)
    pending = InFlight(exchanger, all_to_all(exchanger, stacked, label, copied, widen=False), stacked.dtype,
                       (label, nbytes, started, commstats.calibrating(label, nbytes)))
    if pending.timed[3]:
        pending.exchanged = _widened(pending.exchanged, pending.dtype)
        commstats.record_async(label, nbytes, started, started, timing.now(stacked.device), True)
    return pending


def wait(pending: InFlight) -> tuple[torch.Tensor, ...]:
    """The exchanged tensors, head-sharded ``[b, h/W, W*s, d]``."""
    if pending.timed is None or pending.timed[3]:
        return sequence(_widened(pending.exchanged, pending.dtype))
    label, nbytes, started, _ = pending.timed
    waited = time.perf_counter()
    exchanged = _widened(pending.exchanged, pending.dtype)
    commstats.record_async(label, nbytes, started, waited, timing.now(exchanged.device), False)
    return sequence(exchanged)


def start_v(exchanger: Exchanger, value: torch.Tensor, label: str) -> InFlight:
    """V's input exchange of a V-First call, issued before its Q/K are projected (counted as the call)."""
    commstats.traced("count_v_first_call")
    return start(exchanger, (value,), label)


def exchange_inputs(query: torch.Tensor, key: torch.Tensor, value: InFlight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q's and K's exchanges (the query with any joint tokens: two exchanges), then V's: head-sharded Q, K, V."""
    exchanger = value.exchanger
    if query.shape == key.shape:
        query, key = wait(start(exchanger, (query, key), "qk"))
    else:
        pending_q, pending_k = start(exchanger, (query,), "q"), start(exchanger, (key,), "k")
        (query,), (key,) = wait(pending_q), wait(pending_k)
    (value,) = wait(value)
    return query, key, value


def output(value: InFlight, out: torch.Tensor, heads: int) -> torch.Tensor:
    """The output exchange of the layer whose V's exchange was ``value`` (through its exchanger; V-Major's
    static path hands its own), head-sharded ``[b, h/W, W*s, d]`` back to ``[b, h, s, d]`` (its first
    ``heads``: the rest are padding), as xfuser's ``_ft_c_output_all_to_all`` lays it out."""
    exchanger = value.exchanger
    world = exchanger.world_size
    b, h, s, d = out.shape
    if h * world != heads or exchanger.padding.running is not None:
        exchanger.padding.count(out.numel() * out.element_size(), heads, h * world)
    blocks = output_blocks(out)  # [W*s, b, h/W, d]: token block j for group rank j
    if commstats.timings_on and not torch.compiler.is_dynamo_compiling():
        exchanged = commstats.timed_exchange(lambda t: all_to_all(exchanger, t, "out"), blocks)
    else:
        exchanged = all_to_all(exchanger, blocks, "out")
    return output_heads(exchanged, world, heads)
