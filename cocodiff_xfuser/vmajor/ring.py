"""V-Major on the ring's K/V: ring peers on other nodes receive each K/V block as its change since
the copy they hold.

Under Ulysses inside the node and Ring across nodes, the ring attention's K/V are the only per-layer
traffic over the slow links, and adjacent denoising steps produce similar K and V as they do V. Each
V-First processor's ring attention is a layer (:class:`RingLayer`, the processor's, handed to each
of its calls explicitly). The buffer a rank gathers over the ring (its K, then its V, flattened) is read
as tokens ``[2, T, row]`` (K|V, the tokens of the call in order, one token's elements); the policy
selects tokens as it does for V (:mod:`.policy`, the counts on the transformer's clock), and the
tokens travel to peers on other nodes through :mod:`cocodiff_xfuser.comm.residuals` (their change,
in the residual dtype, with error feedback), node-mates getting the exact buffer. Every rank holds,
per layer and per peer on another node, the copy of that peer's K/V it attends to, and, as a
sender, the reference its peers on other nodes hold of its own.

The counts every ring peer sends must be known to its receivers: the policies that fix them do so
from the step and the clock's agreed shares (agreed over the world, which holds every ring group);
``threshold`` agrees them per call over the ring group. This is the per-call path, run on the host
(between a compiled job's graphs); top-k's counts are fixed by the settings, and its ring layers
take the static path a graph holds (:mod:`.ring_graph`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from cocodiff_xfuser import commstats
from cocodiff_xfuser.comm import residuals, sparse, transport
from cocodiff_xfuser.comm.ring import Remote
from cocodiff_xfuser.settings import VMajorSettings
from cocodiff_xfuser.vmajor.clock import Clock
from cocodiff_xfuser.vmajor.policy import decide, register


@dataclass
class _Caches:
    """One ring layer's copies for one branch of a pipeline call, all ``[2, T, row]``."""

    reference: torch.Tensor | None = None  # this rank's K/V as the peers on other nodes hold it
    held: dict[int, torch.Tensor] = field(default_factory=dict)  # ring rank on another node -> its K/V here


class RingLayer:
    """V-Major on one V-First processor's ring attention, on its transformer's ``clock``: ``group``,
    the ring group; ``far``, per ring rank, whether it is on another node than this rank's (what it
    receives crosses slow links: :attr:`remote`)."""

    def __init__(self, clock: Clock, settings: VMajorSettings, group: Any, far: tuple[bool, ...]) -> None:
        self.clock, self.settings, self.group, self.far = clock, settings, group, far
        self.remote = tuple([j for j, crosses in enumerate(far) if crosses])
        self.index = clock.layers  # on the clock, beside the Ulysses layers
        clock.layers += 1
        #: (branch, the buffer's [2, T, row] shape, dtype, device) -> (reference, copies): the caches of
        #: the static path (:mod:`.ring_graph`), kept from call to call.
        self.buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.number = register(self)

    def begin(self, buffer: torch.Tensor, row: int | None) -> RingStep | None:
        """This call's step for ``buffer`` (K then V, each ``row`` elements per token), in the
        pipeline call in progress; None: the exact gather, nothing kept (V-Major off, a timed exact
        step, over the cache budget, or a buffer that is not two equal halves of whole tokens)."""
        clock, settings, call = self.clock, self.settings, self.clock.current
        if call is None:  # the transformer called outside a pipeline call: nothing to keep
            clock.outside_call()
            return None
        if row is None or buffer.numel() % (2 * row):
            commstats.count_fallback("v-major ring: K and V of different shapes")
            return None
        x = buffer.view(2, -1, row)  # [K|V, T, row]
        if clock.off:
            call.drop(self.index)
        if clock.off or clock.exact_step():  # auto's exact steps keep the caches: they still match
            return None
        key = (self.index, call.branch)
        caches = call.caches.get(key)
        if caches is None or caches.reference is None or caches.reference.shape != x.shape:
            nbytes = x.numel() * x.element_size() * (1 + len(self.remote))
            if not call.budget.admit(key, nbytes, settings.budget_mib):
                commstats.count_fallback("v-major: cache budget")
                return None
            caches = call.caches[key] = _Caches()
        reference, residual = caches.reference, settings.residual
        selection = decide(self, x, reference, 1, (0, 2), token_bytes(x, residual) if residual else 0, len(self.far))
        if selection is None:
            return RingStep(caches, x, self.remote, None, None, residual)
        return RingStep(caches, x, self.remote, selection, residuals.encode(x, reference, selection.active, 1, residual), residual)


class RingStep:
    """One ring layer call's exchange: exact (``selection`` None: every peer gets ``x``, and the
    copies become what was gathered) or sparse (the peers on other nodes, ``peers``, get ``sent``:
    the selected tokens as residuals in ``residual`` or as values, after their mask where some
    tokens but not all travel)."""

    def __init__(self, caches: _Caches, x: torch.Tensor, peers: tuple[int, ...], selection: sparse.Selection | None,
                 sent: torch.Tensor | None, residual: torch.dtype | None) -> None:
        self._caches, self._x, self._peers, self._selection, self._residual = caches, x, peers, selection, residual
        self.remote: Remote | None = None  # what the gather sends the peers instead of the buffer
        if selection is None:
            caches.reference = x  # what the peers will hold (torch builds the buffer anew per call)
            return
        tokens, row_bytes = x.shape[1], token_bytes(x, residual)
        # The mask ahead of the rows, where some tokens but not all travel.
        sizes = {j: ((sparse.index_size(k, tokens),) if sparse.index_size(k, tokens) else ()) + (k * row_bytes,)
                 for j in peers for k in [selection.counts[j]]}
        masked = sparse.index_size(selection.active.numel(), tokens) > 0
        self.remote = Remote(peers, (selection.mask(tokens), sent) if masked else (sent,), sizes)

    @property
    def slow_bytes(self) -> int:
        """The bytes this rank sends over the slow links (to its ring peers on other nodes)."""
        pieces = (self._x,) if self.remote is None else self.remote.pieces
        return sum(transport.wire_bytes(p) for p in pieces) * len(self._peers)

    def finish(self, out: torch.Tensor, received: dict[int, list[torch.Tensor]]) -> torch.Tensor:
        """The gathered ``[ring size, n]`` with each peer's row: at an exact step, as gathered (the
        copy this rank holds becomes it); at a sparse one, the copy updated by what the peer sent."""
        held, shape = self._caches.held, self._x.shape
        if self._selection is None:
            for j in self._peers:
                held[j] = out[j].view(shape).clone()
            return out
        # What one token's row travels as: int4 residuals as bytes, others in their dtype.
        dtype = {None: self._x.dtype, torch.int4: torch.uint8}.get(self._residual, self._residual)
        width = residuals.row_bytes(shape[2], self._residual) if self._residual == torch.int4 else shape[2]
        for j, pieces in received.items():
            # The peer's count, not the message, says which tokens came: no mask travels with none
            # of them (an empty message, the copy stands) nor with every one (all of them, in order).
            k = self._selection.counts[j]
            if k:
                rows = None if k == shape[1] else sparse.rows_of(pieces[0], shape[1], k)
                payload = sparse.view_bytes(pieces[-1], dtype).view(2, k, width)
                residuals.apply(held[j], payload, rows, 1, self._residual is not None)
            out[j].copy_(held[j].view(-1))
        return out


def token_bytes(x: torch.Tensor, residual: torch.dtype | None) -> int:
    """One token's K and V (``x``: ``[2, T, row]``) as they travel: in the residual dtype, or as values."""
    return 2 * (x.shape[2] * x.element_size() if residual is None else residuals.row_bytes(x.shape[2], residual))
