"""V-Major on the ring's K/V with static shapes: plain torch that a compiled graph holds, and eager runs.

Under top-k (a count the settings fix, :func:`applies`) a ring-attention call's exchange is decided
by the step's phase alone (:attr:`.clock.Clock.phase`, which a graph reads as a constant), as the
Ulysses layers' static path decides theirs (:mod:`.graph`). At an exact phase (the call's first
step, a refresh, a warm-up step without residuals) the buffer is all-gathered over the ring group;
otherwise it is one ``all_to_all_single`` over the ring group with split sizes fixed by the shapes
and that count: ring peers on this rank's node get the whole buffer, ring peers on other nodes the
selected tokens as residuals against the copy they hold, after their mask where some tokens but not
all travel, what :class:`.ring.RingStep` sends them on the per-call path, byte for byte. The copies
each rank attends to and the reference its peers hold of its own are tensors the layer keeps from
call to call (static inputs of its graphs, overwritten by each pipeline call's first step), so a
request served after others gives what a fresh process gives. No host read, no operator of
cocodiff's; what ran is counted when the graph is traced. Eagerly the same code runs, each
collective as cocodiff's point-to-point batch of the same pieces.
"""

from __future__ import annotations

import math

import torch

from cocodiff_xfuser import commstats, compat
from cocodiff_xfuser.comm import functional, residuals, sparse, transport
from cocodiff_xfuser.comm.ring import RingGather
from cocodiff_xfuser.settings import TopK, VMajorSettings
from cocodiff_xfuser.vmajor import graph, policy
from cocodiff_xfuser.vmajor.ring import RingLayer, token_bytes

_all_gather = compat.torch_private("torch.distributed._functional_collectives", "all_gather_single")
_wait_tensor = compat.torch_private("torch.distributed._functional_collectives", "wait_tensor")


def applies(settings: VMajorSettings) -> bool:
    """Whether a ring layer under ``settings`` takes this path: a count the settings fix (top-k)."""
    return isinstance(settings.rule, TopK)


class Gathered:
    """One ring-attention call's gather in flight (what :class:`~cocodiff_xfuser.comm.ring.Rotater`
    waits for): :meth:`wait` gives ``[ring size, n]``, row ``r`` ring rank ``r``'s buffer as this
    rank attends to it, the copies on other nodes' rows updated by what their owners sent."""

    def __init__(self, layer: RingLayer, buffer: torch.Tensor, row: int) -> None:
        self._layer, self._buffer = layer, buffer
        clock, settings = layer.clock, layer.settings
        x = buffer.view(2, -1, row)  # [K|V, T, row]: a token's elements, K's then V's
        tokens = x.shape[1]
        self._caches = None
        if clock.current is None:
            commstats.traced("count_fallback", "v-major: outside a pipeline call")
        else:
            key = (clock.current.branch, tuple(x.shape), str(x.dtype), str(x.device))
            if _kept(layer.number, key):
                self._caches = layer.buffers[key]
            else:
                commstats.traced("count_fallback", "v-major: cache budget")
        phase, residual = clock.phase, settings.residual
        k = tokens if phase != "sparse" else policy.count(settings, clock, layer.index, 0, tokens)
        if residual is not None and sparse.whole_is_smaller(k, tokens, token_bytes(x, residual)):
            k = tokens  # every token, without a mask, is no more bytes
        self._exact = self._caches is None or phase in ("first", "exact") or (k == tokens and residual is None)
        self._x, self._k, self._residual = x, k, residual
        if self._caches is not None:
            commstats.traced("count_v_major", phase, layer.index, tokens if self._exact else k, tokens)
        self._out: torch.Tensor | None = None
        self._pending = _gather(layer, buffer) if self._exact else self._issue()

    def _issue(self) -> tuple[torch.Tensor, list[int]]:
        """The sparse exchange issued: the whole buffer to node-mates (and itself), to each ring peer
        on another node this rank's tokens after their mask (the senders' reference updated here)."""
        layer, x, k, residual = self._layer, self._x, self._k, self._residual
        reference, _ = self._caches
        tokens = x.shape[1]
        active = mask = None
        if k < tokens:
            ranks, _ = policy.rank(policy.token_change(layer.settings.rule.metric, x, reference, 1, (0, 2)))
            active, mask = policy.top(ranks, k)
        rows = torch.arange(tokens, device=x.device) if active is None else active
        data = sparse.as_bytes(residuals.encode(x, reference, rows, 1, residual))  # [2, k, row bytes] as bytes
        with_mask = sparse.index_size(k, tokens) > 0
        sent = data.numel() + (sparse.mask_bytes(tokens) if with_mask else 0)
        piece = functional.aligned(sent)
        whole = sparse.as_bytes(transport.on_wire(self._buffer))  # to node-mates and this rank
        pieces = []
        sizes = []
        for far in layer.far:
            sizes.append(piece if far else whole.numel())
            if not far:
                pieces.append(whole)
                continue
            pieces += [mask, data] if with_mask else [data]
            if piece > sent:
                pieces.append(data.new_zeros(piece - sent))
        commstats.traced("count_exchange", "ring v-major", "ring", len(layer.remote) * piece,
                         len(layer.remote) * whole.numel())
        return graph.uneven_all_to_all(torch.cat(pieces), sizes, layer.group), sizes

    def wait(self) -> torch.Tensor:
        if self._out is None:  # (the ring loop reads it at every step after the first)
            self._out = self._gathered() if self._exact else self._receive()
        return self._out

    def _gathered(self) -> torch.Tensor:
        """The all-gathered ``[ring size, n]``; the copies, where kept, become it (this rank's
        reference: what its peers on other nodes now hold of it)."""
        out = self._pending.wait()
        if self._caches is not None:
            reference, held = self._caches
            reference.copy_(self._x)
            for i, j in enumerate(self._layer.remote):
                held[i].copy_(out[j].view(self._x.shape))
        return out

    def _receive(self) -> torch.Tensor:
        """``[ring size, n]``: node-mates' buffers as they came, other nodes' rows the copies here
        updated by their tokens (counted where ``k`` of every peer's; the mask says which)."""
        exchanged, sizes = self._pending
        exchanged = _wait_tensor(exchanged)
        x, k, residual, layer = self._x, self._k, self._residual, self._layer
        _, held = self._caches
        tokens, width = x.shape[1], x.shape[2]
        with_mask = sparse.index_size(k, tokens) > 0
        index = sparse.mask_bytes(tokens) if with_mask else 0
        wire = transport.wire_dtype(x.dtype)
        # What one token's row travels as: int4 residuals as bytes, others in their dtype (values in x's).
        travels = x.dtype if residual is None else torch.uint8 if residual == torch.int4 else residual
        row = residuals.row_bytes(width, residual) if residual == torch.int4 else width
        data_bytes = 2 * k * row * travels.itemsize
        rows_out = []
        for j, part in enumerate(exchanged.split(sizes)):
            if not layer.far[j]:
                rows_out.append(part.view(wire).to(x.dtype))
                continue
            copy = held[layer.remote.index(j)]
            if k:  # (none sent: the copy stands)
                rows = sparse.rows_of(part[:index], tokens, k) if with_mask else None
                payload = part[index:index + data_bytes].view(travels).view(2, k, row)  # (pieces start 4-aligned)
                residuals.apply(copy, payload, rows, 1, residual is not None)
            rows_out.append(copy.view(-1))
        return torch.stack(rows_out)  # [ring size, n]


def _gather(layer: RingLayer, buffer: torch.Tensor) -> RingGather | _AllGathered:
    """The exact gather of ``buffer`` over the ring: traced, the functional all-gather a graph holds
    (as torch's own rotater); eagerly, the transport's batch (:class:`RingGather`)."""
    exact = transport.wire_bytes(buffer) * len(layer.remote)
    commstats.traced("count_exchange", "ring all-gather", "ring", exact, exact)
    if torch.compiler.is_dynamo_compiling():
        return _AllGathered(_all_gather(transport.on_wire(buffer).contiguous().view(-1), 0, layer.group), buffer)
    return RingGather(buffer, layer.group)


class _AllGathered:
    """A traced all-gather of a buffer's wire values: :meth:`wait` gives ``[ring size, n]`` in its dtype."""

    def __init__(self, out: torch.Tensor, buffer: torch.Tensor) -> None:
        self._out, self._buffer = out, buffer

    def wait(self) -> torch.Tensor:
        return _wait_tensor(self._out).view(-1, self._buffer.numel()).to(self._buffer.dtype)


@compat.trace_time
def _kept(number: int, key: tuple) -> bool:
    """Whether the ring layer numbered ``number`` keeps caches for ``key`` (branch, the buffer's
    ``[2, T, row]`` shape, dtype, device), made here where it has none (its reference and a copy per
    ring peer on another node; static inputs of its graphs). Run when a graph is traced, before the
    graph reads them. False where they would exceed the budget its clock holds the static layers to."""
    layer = policy.numbered(number)
    if key in layer.buffers:
        return True
    _, shape, dtype, device = key
    dtype = getattr(torch, dtype.removeprefix("torch."))
    nbytes = (1 + len(layer.remote)) * math.prod(shape) * dtype.itemsize
    clock = layer.clock
    if clock.cache_bytes + nbytes > layer.settings.budget_mib * 2**20:
        return False
    reference = torch.zeros(shape, dtype=dtype, device=device)
    held = torch.zeros((len(layer.remote), *shape), dtype=dtype, device=device)
    for t in (reference, held):
        compat.mark_static(t)
    layer.buffers[key] = (reference, held)
    clock.cache_bytes += nbytes
    return True
