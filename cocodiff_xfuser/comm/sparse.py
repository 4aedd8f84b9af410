"""Sparse exchange over the slow level: node-mates get every row, ranks on other nodes only active rows.

The data is the destination-major input of a Ulysses exchange viewed as ``[W, P, s, d]``: chunk
``j`` goes to group rank ``j`` and is ``P`` planes (tensors x batch x heads) of ``s`` rows
(tokens). Over slow links only *active* rows travel, and the receivers update those rows of the
previous exchange's result, which they keep, and reuse the others. Who chose the rows decides
what travels with them:

* chosen by the sender (the input exchanges: each rank selects among its own tokens, the same set
  for every destination): the rows travel in ascending order after a bitmask of them (one bit per
  row, padded to 4 bytes), which the receivers may record; a sender that sends every row or none
  sends no mask;
* chosen by the receiver (the output exchange: its rows are the receiver's tokens): each sender
  sends a receiver the rows at that receiver's active tokens, learned from the input exchange, and
  the receiver places them at its own active tokens; no index travels. What every rank of
the group sends is sized by the :class:`Selection`'s counts, which every rank knows before the
exchange (V-Major's counts are fixed by its policy and step, or by shares agreed at earlier steps:
nothing to agree here, no host synchronization; the exchange also carries counts that differ per
rank), so every rank launches the same batches (the rule of one program order, :mod:`.transport`).

Two routings, like the exact exchange:

* ``one-phase``: one uneven exchange over the whole group (full chunks to node-mates, active rows
  to the other nodes), like the flat exchanges: the backend's own all-to-all with split sizes where
  the exact exchange of that size is ``flat``, else one batch of point-to-point operations;
* ``two-phase``: composed with TAPA. Phase 1, inside the node: every chunk goes to the node-mate
  on the destination's rail, full for node-mates and active rows only for other nodes; phase 2,
  across nodes between ranks of one rail: each rank forwards the active rows it relays. The slow
  phase carries only active rows, and no cross-rail traffic.

Which of these runs follows the exact exchange the autotune chose (an agreed decision), so every
rank runs the same code on every backend. Uneven sizes need no split-size agreement: both sides
of every message know its size. The two-phase routing's batches are point-to-point
(:mod:`.transport`); its slow phase is posted in ``advance`` or ``wait``, at the same program point
on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from cocodiff_xfuser import commstats

from . import flat, mask_kernels, residuals, subgroups, transport

#: Rows for destination ``j`` at ``rows[j]`` (``[P, k_j, d]``): a ``[W, P, k, d]`` tensor, or a
#: mapping with the destinations on other nodes.
Rows = Any


@dataclass
class SlowLevel:
    """One Ulysses group split by nodes: who shares this rank's node, and the groups of the two phases.

    Group rank ``j`` sits at ``(node[j], lane[j])``: its node's position among the group's nodes
    and its position among the group's ranks on that node (its rail). ``local_group`` holds this
    rank's node-mates, ``cross_group`` the ranks of its lane on the other nodes.
    """

    node: list[int]
    lane: list[int]
    me: int
    local_group: Any = None
    cross_group: Any = None

    @property
    def exists(self) -> bool:
        """Whether the group has ranks on other nodes (else there is no slow link to spare)."""
        return len(set(self.node)) > 1

    @property
    def regular(self) -> bool:
        """Whether every node holds the same number of the group's ranks (the two-phase routing)."""
        per_node = [self.node.count(n) for n in set(self.node)]
        return len(set(per_node)) == 1

    def __post_init__(self) -> None:
        # Plain attributes, made here: a compiled graph reads them (a cached property's lock it cannot trace).
        self._fast = tuple(n == self.node[self.me] for n in self.node)
        #: The group ranks on other nodes than this rank's.
        self.remote = tuple(j for j in range(len(self.node)) if not self._fast[j])

    def fast(self, j: int) -> bool:
        return self._fast[j]

    def at(self, node: int, lane: int) -> int:
        return next(j for j in range(len(self.node)) if self.node[j] == node and self.lane[j] == lane)


def build_slow_levels(
    groups: Sequence[Sequence[int]], nodes_and_lanes: Callable[[Sequence[int]], tuple[list[int], list[int]]]
) -> dict[tuple[int, ...], SlowLevel]:
    """The :class:`SlowLevel` of every Ulysses group this rank belongs to, keyed by its sorted ranks;
    ``nodes_and_lanes``: where a group's members sit (the job's layout, or a topology's).

    Collective over the world: every rank creates the same sub-groups in the same order (a
    two-level group's are TAPA's level sub-groups, :mod:`.subgroups`).
    """
    rank = dist.get_rank()
    levels: dict[tuple[int, ...], SlowLevel] = {}
    for ranks in sorted({tuple(sorted(g)) for g in groups}):
        node, lane = nodes_and_lanes(ranks)
        level = SlowLevel(node, lane, ranks.index(rank) if rank in ranks else -1)
        if level.exists and level.regular:
            level.cross_group = subgroups.member_of([[ranks[j] for j in range(len(ranks)) if lane[j] == l] for l in range(max(lane) + 1)])
            level.local_group = subgroups.member_of([[ranks[j] for j in range(len(ranks)) if node[j] == n] for n in range(max(node) + 1)])
        if rank in ranks:
            levels[ranks] = level
    return levels


@dataclass(frozen=True)
class Selection:
    """This rank's active rows and how many rows every rank of the group sends over slow links."""

    active: torch.Tensor  # [k] this rank's rows (int64, on the device, ascending)
    counts: tuple[int, ...]  # k of every group rank, the same on every rank
    built: torch.Tensor | None = None  # their mask, where whoever chose them built it

    @classmethod
    def fixed(cls, active: torch.Tensor, world: int, mask: torch.Tensor | None = None) -> Selection:
        """Every rank sends ``len(active)`` rows: a count the settings fix, known everywhere."""
        return cls(active, (active.numel(),) * world, mask)

    def mask(self, s: int) -> torch.Tensor:
        """The rows as they travel ahead of them, of ``s`` (uint8, :func:`mask_bytes` of them): bit
        ``t % 8`` of byte ``t // 8`` set for an active row ``t``; built on the device."""
        return self.built if self.built is not None else mask_of(self.active, s)


def mask_of(active: torch.Tensor, s: int) -> torch.Tensor:
    """The mask of rows ``active`` of ``s`` (:meth:`Selection.mask`), built on the device."""
    bits = torch.zeros(mask_bytes(s) * 8, dtype=torch.uint8, device=active.device).index_fill_(0, active, 1)
    return (bits.view(-1, 8) << _bit_positions(bits.device)).sum(1, dtype=torch.uint8)


def rows_of(mask: torch.Tensor, s: int, k: int) -> torch.Tensor:
    """The ``k`` rows (int64, ascending) a mask (``[..., mask_bytes(s)]`` uint8) marks, per mask,
    on the device without reading it: one kernel where it runs (:mod:`.mask_kernels`), else the
    torch reference."""
    if mask_kernels.usable(mask):
        commstats.traced("count_kernel", "mask decode")
    return torch.ops.cocodiff_kernels.mask_rows(mask, s, k)


@torch.library.triton_op("cocodiff_kernels::mask_rows", mutates_args=())
def _mask_rows(mask: torch.Tensor, s: int, k: int) -> torch.Tensor:
    """:func:`rows_of`: the Triton kernel where it runs, traced into a compiled graph as its launch;
    elsewhere (the CPU's kernel) the torch reference."""
    if mask_kernels.usable(mask):
        return mask_kernels.rows(mask, s, k)
    return reference_rows_of(mask, s, k)


def reference_rows_of(mask: torch.Tensor, s: int, k: int) -> torch.Tensor:
    """:func:`rows_of` as torch computes it: each set bit's rank among the set bits is its slot (bits
    past the k-th, which a well-formed mask has none of, to the spare slot too: nothing is written
    out of range, whatever the bytes)."""
    bits = ((mask.unsqueeze(-1) >> _bit_positions(mask.device)) & 1).flatten(-2)[..., :s]  # [..., s]
    slot = torch.where(bits.bool(), (bits.long().cumsum(-1) - 1).clamp(max=k), k)  # unset rows to a spare slot
    every = torch.arange(s, device=mask.device).expand_as(slot)
    return torch.empty(*slot.shape[:-1], k + 1, dtype=torch.long, device=mask.device).scatter_(-1, slot, every)[..., :k]


def mask_bytes(s: int) -> int:
    """The bytes of a mask of ``s`` rows: a bit each, padded to 4 bytes so the rows after it keep
    their alignment."""
    return (s + 31) // 32 * 4


def whole_is_smaller(k: int, s: int, row_bytes: int) -> bool:
    """Whether sending all ``s`` rows (in order, no mask) takes no more bytes than ``k`` rows
    after their mask."""
    return k * row_bytes + mask_bytes(s) >= s * row_bytes


def index_size(k: int, s: int, by_receiver: bool = False) -> int:
    """The mask ahead of ``k`` sender-chosen rows of ``s``; none where the receiver knows them:
    it chose them, or every row or none is sent."""
    return 0 if by_receiver or k in (0, s) else mask_bytes(s)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as flat bytes (a view where it is contiguous)."""
    flat = t.contiguous().view(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _bit_positions(device: torch.device) -> torch.Tensor:
    """A byte's bit positions, low first, made on the device (no copy from the host; made per call,
    as the operators' CPU kernels trace it into a graph)."""
    return torch.arange(8, dtype=torch.uint8, device=device)


def view_bytes(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Received bytes (a piece, or pieces ``[n, bytes]``) as ``dtype``, copied first where they start
    off its alignment (relayed pieces, pieces of sizes it does not divide)."""
    if dtype == torch.uint8:
        return data
    aligned = data.storage_offset() % dtype.itemsize == 0 and (data.dim() == 1 or data.stride(0) % dtype.itemsize == 0)
    return (data if aligned else data.clone()).view(dtype)


def runs(ranks: Sequence[int]) -> list[tuple[int, ...]]:
    """``ranks`` (increasing) as runs of consecutive ranks."""
    found: list[list[int]] = []
    for j in ranks:
        if found and found[-1][-1] == j - 1:
            found[-1].append(j)
        else:
            found.append([j])
    return [tuple(run) for run in found]


@lru_cache(maxsize=64)
def _plane_rows(sources: tuple[int, ...], planes: int, s: int, device: torch.device) -> torch.Tensor:
    """``(j * planes + plane) * s`` for each source j and plane: ``[len(sources), planes, 1]``."""
    j = torch.tensor(sources, device=device).view(-1, 1, 1)
    return (j * planes + torch.arange(planes, device=device).view(1, -1, 1)) * s


def _payload(rows: torch.Tensor, mask: torch.Tensor | None) -> list[torch.Tensor]:
    """What goes over a slow link to one destination, in order: the mask of the rows (None: the
    receiver knows them), then the rows (the caller joins them with what travels beside them)."""
    return [as_bytes(rows)] if mask is None else [mask, as_bytes(rows)]


def _joined(pieces: list[torch.Tensor]) -> torch.Tensor:
    """``pieces`` as one message (no copy where there is one piece)."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def post_uneven(out: list[torch.Tensor], inp: list[torch.Tensor], group: Any, role: str) -> transport.Completion:
    """Send ``inp[j]`` to group rank j and receive ``out[i]`` from group rank i (sizes known on both
    sides) as one batch; the own piece is copied."""
    done = transport.post([[t] for t in out], [[t] for t in inp], group, role, "rows", (*out, *inp))
    me = transport.group_info(group)[0]
    transport.copy_own(out[me], inp[me])
    return done


class SparseHandle:
    """A sparse exchange in flight; :meth:`wait` writes it into the receiver's previous result.

    ``x`` (``[W, P, s, d]``) goes whole to node-mates; ``rows[j]`` (``[P, k, d]``) to each rank
    ``j`` on another node, as values, or with ``residual`` as the change since the receivers'
    copy, which they add (any dtype: everything travels as bytes). Chosen by the sender (the
    default), the rows are this rank's ``selection.active`` (ascending) and travel after their
    mask, which the receiver learns (``learn_peers``: :attr:`peers`, group rank -> int64 indices);
    with ``by_receiver``, ``rows[j]`` are the rows at rank ``j``'s active tokens and are placed at
    this rank's ``selection.active``. ``decode`` turns received rows (``[P, k, *]`` in their
    dtype) into values (``[P, k, d]``) before they are placed (packed fp8 rows, for example).
    """

    def __init__(
        self,
        x: torch.Tensor,
        rows: Rows,
        selection: Selection,
        level: SlowLevel,
        group: Any,
        two_phase: bool,
        into: torch.Tensor,
        residual: bool = False,
        collective: bool = False,
        by_receiver: bool = False,
        learn_peers: bool = False,
        decode: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        w, p, s, d = x.shape
        self._level, self._into = level, into
        self._residual = residual
        self._by_receiver, self._active = by_receiver, selection.active
        self._full_bytes = p * s * d * x.element_size()
        remote = level.remote
        sample = rows[remote[0]] if remote else x  # rows as they travel: [P, k, d'] in their dtype
        self._rows_dtype = sample.dtype
        self._width = sample.shape[-1]  # d, or what an encoded row takes
        self._row_bytes = p * self._width * sample.element_size()
        self._tokens = s
        self._counts = selection.counts
        self._decode = decode
        #: After :meth:`wait`, with ``learn_peers``: the active tokens of every rank on another node.
        self.peers: dict[int, torch.Tensor] | None = {} if learn_peers else None
        self._phase2 = None
        self._two_phase = two_phase
        self._placed = False  # wait() places the received rows once
        self._in_place = False  # node-mates' chunks received straight into ``into``
        self._every: torch.Tensor | None = None  # arange(s), once
        #: What this rank sends to other nodes, and what the exact exchange would (bytes).
        self.slow_bytes = sum(self._size(level.me, j) for j in remote)
        # (The messages here are bytes: float32 rows travel at their width even where the wire is bf16.)
        self.exact_bytes = len(remote) * p * s * d * transport.wire_itemsize(x.dtype)
        mask = selection.mask(s) if index_size(selection.active.numel(), s, by_receiver) else None
        chunks = as_bytes(x).view(w, -1).unbind(0)  # [W] x [P*s*d bytes]
        if two_phase:
            self._post_phase1(chunks, rows, mask)
        elif collective:
            self._post_collective(chunks, rows, mask, group)
        else:
            self._post_one_phase(chunks, rows, mask, group)

    def _post_collective(self, chunks: Sequence[torch.Tensor], rows: Rows, mask: torch.Tensor | None, group: Any) -> None:
        """The backend's own all-to-all, with the split sizes both sides know."""
        level, w = self._level, len(chunks)
        # Other nodes' pieces, placed together per run of consecutive group ranks (back to back).
        self._runs, self._sizes = runs(level.remote), [self._bytes_from(j) for j in range(w)]
        pieces = []
        for j in range(w):
            pieces += [chunks[j]] if level.fast(j) else _payload(rows[j], mask)
        sent = [self._full_bytes if level.fast(j) else self._size(level.me, j) for j in range(w)]
        self._pending = flat.start_flat_all_to_all(torch.cat(pieces), group, self._sizes, sent)
        self._received = self._run_buffers = None

    def _post_one_phase(self, chunks: Sequence[torch.Tensor], rows: Rows, mask: torch.Tensor | None, group: Any) -> None:
        """Point-to-point to every rank at once: node-mates' chunks land in place (all their rows are
        replaced), other nodes' pieces back to back per run of ranks."""
        level, w, into, device = self._level, len(chunks), self._into, self._into.device
        self._runs, self._sizes = runs(level.remote), [self._bytes_from(j) for j in range(w)]
        sizes = self._sizes
        inp = [chunks[j] if level.fast(j) else _joined(_payload(rows[j], mask)) for j in range(w)]
        self._in_place = into.is_contiguous()
        placed = into.view(w, -1).view(torch.uint8).unbind(0) if self._in_place else None
        self._run_buffers = {run: torch.empty(sum(sizes[j] for j in run), dtype=torch.uint8, device=device) for run in self._runs}
        remote_pieces = {j: piece for run, buffer in self._run_buffers.items()
                         for j, piece in zip(run, buffer.split([sizes[j] for j in run]))}
        self._received = [remote_pieces[j] if j in remote_pieces else placed[j] if self._in_place
                          else torch.empty(sizes[j], dtype=torch.uint8, device=device) for j in range(w)]
        self._pending = post_uneven(self._received, inp, group, "sparse one-phase")

    def _post_phase1(self, chunks: Sequence[torch.Tensor], rows: Rows, mask: torch.Tensor | None) -> None:
        """Phase 1 to the node-mate on each destination's lane: its own chunk, then the active rows
        (after their mask) for that lane on every other node (node order)."""
        level, device = self._level, self._into.device
        nodes, lanes = max(level.node) + 1, max(level.lane) + 1
        me_node = level.node[level.me]
        self._others = [n for n in range(nodes) if n != me_node]
        self._mates = [level.at(me_node, l) for l in range(lanes)]
        inp = [
            torch.cat([chunks[self._mates[l]]] + [piece for n in self._others for piece in _payload(rows[level.at(n, l)], mask)])
            for l in range(lanes)
        ]
        lane = level.lane[level.me]
        self._phase1_out = [
            torch.empty(self._full_bytes + sum(self._size(m, level.at(n, lane)) for n in self._others), dtype=torch.uint8, device=device)
            for m in self._mates
        ]
        self._pending = post_uneven(self._phase1_out, inp, level.local_group, "sparse phase 1 (node)")

    def _rows(self, src: int, dst: int) -> int:
        """How many rows group rank ``src`` sends ``dst`` over slow links (known on every rank)."""
        return self._counts[dst if self._by_receiver else src]

    def _size(self, src: int, dst: int) -> int:
        """The bytes of what ``src`` sends ``dst`` over slow links: the rows, their mask ahead."""
        k = self._rows(src, dst)
        return k * self._row_bytes + index_size(k, self._tokens, self._by_receiver)

    def _bytes_from(self, j: int) -> int:
        return self._full_bytes if self._level.fast(j) else self._size(j, self._level.me)

    def advance(self) -> bool:
        """Post the slow phase once the node phase is in (a stream wait on NCCL/XCCL)."""
        if self._two_phase and self._phase2 is None:
            self._launch_phase2()
        return True

    def _launch_phase2(self) -> None:
        self._pending.wait()
        level, full = self._level, self._full_bytes
        # From each node-mate: its chunk for me, then its active rows for my lane on each other node.
        self._full = {}
        forward: dict[int, list[torch.Tensor]] = {n: [] for n in self._others}
        lane = level.lane[level.me]
        for mate, buf in zip(self._mates, self._phase1_out):
            self._full[mate] = buf[:full]
            sizes = [self._size(mate, level.at(n, lane)) for n in self._others]
            for n, piece in zip(self._others, buf[full:].split(sizes)):
                forward[n].append(piece)
        empty = self._phase1_out[0][:0]
        inp, out, self._sources = [], [], []
        for n in range(len(self._others) + 1):
            if n not in forward:
                inp.append(empty)
                out.append(empty)
                continue
            srcs = [level.at(n, level.lane[m]) for m in self._mates]
            self._sources.append((srcs, len(out)))
            inp.append(torch.cat(forward[n]))
            out.append(torch.empty(sum(self._size(j, level.me) for j in srcs), dtype=torch.uint8, device=empty.device))
        self._phase2_out = out
        self._phase2 = post_uneven(out, inp, level.cross_group, "sparse phase 2 (across nodes)")

    def wait(self) -> torch.Tensor:
        """Complete the exchange into ``into`` (``[W, P, s, d]``, the previous result): rows from
        node-mates are replaced, rows from other nodes only where their sender sent them.
        Idempotent: the rows (or residuals) are placed once."""
        into = self._into
        if self._placed:
            return into
        self._placed = True
        if not self._two_phase:
            received = self._pending.wait()
            if self._received is None:
                self._received = received.split(self._sizes)
            for j, piece in enumerate(self._received):
                if self._level.fast(j):
                    self._place(into, j, piece)
            for run in self._runs:
                if self._run_buffers is not None:
                    self._place_run(into, run, self._run_buffers[run])
                else:  # the collective's output: source after source
                    start = sum(self._sizes[: run[0]])
                    self._place_run(into, run, received[start : start + sum(self._sizes[j] for j in run)])
            return into
        self.advance()
        self._phase2.wait()
        for j, piece in self._full.items():
            self._place(into, j, piece)
        for srcs, slot in self._sources:
            self._place_run(into, srcs, self._phase2_out[slot])
        return into

    def _place_run(self, into: torch.Tensor, sources: Sequence[int], pieces: torch.Tensor) -> None:
        """Place the pieces from ``sources`` (ranks on other nodes), back to back in ``pieces``: with
        one index for all of them where they are alike (the same count, nothing to decode)."""
        me = self._level.me
        sizes = [self._size(j, me) for j in sources]
        k = self._rows(sources[0], me)
        if len(sources) == 1 or k == 0 or len(set(sizes)) > 1 or self._decode is not None or not into.is_contiguous():
            for j, piece in zip(sources, pieces.split(sizes)):
                self._place(into, j, piece)
            return
        n, (_, p, s, d) = len(sources), into.shape
        pieces = pieces.view(n, sizes[0])
        every = k == s and not self._by_receiver  # every row, in order: no index travels
        index = index_size(k, s, self._by_receiver)
        if self._by_receiver:
            active = self._active.view(1, k)
        elif every:
            active = self._in_order().view(1, k)
        else:
            active = rows_of(pieces[:, :index], s, k)
        if self.peers is not None:  # one row of indices per source, or one that all share
            for i, j in enumerate(sources):
                self.peers[j] = active[i if active.shape[0] > 1 else 0]
        rows = view_bytes(pieces[:, index:], self._rows_dtype).view(n, p, k, self._width)
        # Row (j, plane, token) of ``into`` as one index: (j * P + plane) * s + token.
        at = (_plane_rows(tuple(sources), p, s, into.device) + active.view(-1, 1, k)).view(-1)
        residuals.apply(into.view(-1, d), rows.reshape(-1, self._width), at, 0, self._residual)

    def _place(self, into: torch.Tensor, j: int, piece: torch.Tensor) -> None:
        if self._level.fast(j):
            if not self._in_place:
                into[j].view(-1).view(torch.uint8).copy_(piece)
            return
        k = self._rows(j, self._level.me)
        s = self._tokens
        every = k == s and not self._by_receiver  # every row, in order: no index travels
        if self._by_receiver:
            active, index = self._active, 0
        elif every:
            active, index = None, 0
        elif k == 0:  # no row, no mask
            active, index = self._in_order()[:0], 0
        else:
            index = index_size(k, s)
            active = rows_of(piece[:index], s, k)
        if self.peers is not None:
            self.peers[j] = self._in_order() if every else active
        rows = view_bytes(piece[index:], self._rows_dtype).view(into.shape[1], k, self._width)
        if self._decode is not None:
            rows = self._decode(rows)
        residuals.apply(into[j], rows, None if every else active, 1, self._residual)

    def _in_order(self) -> torch.Tensor:
        """Every row's index, in order (what a sender that sends every row sent)."""
        if self._every is None:
            self._every = torch.arange(self._tokens, device=self._into.device)
        return self._every
