"""A compiled layer's exact Ulysses exchanges, as the graph holds them: functional collectives.

Traced by torch.compile, a layer whose exchanges are exact, fp8 on every link or fp8 on the slow
links only (no V-Major, no padded tokens, no ring: :func:`applies`) holds plain traceable torch:
each exchange is ``all_to_all_single`` over the Ulysses group, or TAPA's one per topology level
(:mod:`cocodiff_xfuser.comm.functional`), or fp8-slow's one with split sizes (values to node-mates,
fp8 rows to other nodes), which inductor schedules and a CUDA graph captures, as it does stock's;
no operator of cocodiff's, no host read, and no Python when the graph runs. V-First
is program order: V's all-to-all is written before Q and K are projected (:func:`start`) and waited
for where attention reads it (:func:`exchange_inputs`); xDiT's overlap passes (``raise_comms``,
``sink_waits``) keep it so. What an exchange needs to know is fixed when the graph is traced: its
route (flat or TAPA's levels, :meth:`~cocodiff_xfuser.exchanger.Exchanger.graph_route`, measured
once per size with real buffers), and what ran, counted then and added per transformer call
(:func:`cocodiff_xfuser.commstats.traced`). Eagerly the processors take the exchanger's handles.
"""

from __future__ import annotations

import torch

from cocodiff_xfuser import commstats, padding
from cocodiff_xfuser.comm import compress, functional, sparse, transport
from cocodiff_xfuser.exchanger import Exchanger


def applies(exchanger: Exchanger, layer: object | None) -> bool:
    """Whether a traced layer's exchanges are functional collectives: no V-Major ``layer``, no padded
    tokens in the running forward (whose trim keeps a host-side index), and no ring. Under a ring the graph breaks at the
    ring attention (in stock too) and dynamo traces the layer's pieces as frames of their own, again
    per block type with dynamic sizes, which a graph cannot name when it is traced: operators there."""
    return (layer is None and exchanger.ring_group is None and exchanger.options.compress in ("none", "fp8", "fp8-slow")
            and not padding.tokens_padded())


def all_to_all(exchanger: Exchanger, x: torch.Tensor, label: str) -> torch.Tensor:
    """The equal-split all-to-all of ``x`` (chunks destination-major along the flattened data, as
    xfuser's ``_sdpa_all_to_all_single``; rows of its last dim) over the Ulysses group, by the route
    fixed for its size; under ``--cocodiff-compress fp8`` packed as the exchanger packs it."""
    if exchanger.options.compress == "fp8-slow" and exchanger.slow_level is not None and x.dtype in compress.WIDE:
        return _slow_fp8(exchanger, x, label)
    world, d = exchanger.world_size, x.shape[-1]
    exact_bytes = x.numel() * transport.wire_itemsize(x.dtype)
    fp8 = exchanger.options.compress == "fp8" and x.dtype in compress.WIDE
    # [W * ..., d] -> [W, c]: chunk j for group rank j; fp8: [W, rows, d] -> [W, rows * (d + 4)] bytes
    payload = compress.pack(transport.wire_values(x).reshape(world, -1, d)) if fp8 else x.reshape(world, -1)
    # Routed once per traced exchange, before the graph runs (collective: every rank traces alike).
    levels, groups = exchanger.traced_route(label, tuple(payload.shape), str(payload.dtype), str(payload.device))
    share = exchanger.layout.slow_share
    commstats.traced("count_exchange", "hierarchical" if levels else "flat", label,
                     int(payload.numel() * transport.wire_itemsize(payload.dtype) * share), int(exact_bytes * share))
    out = functional.all_to_all(payload, groups[0]) if len(groups) == 1 else functional.levels_all_to_all(payload, levels, groups)
    if fp8:
        out = compress.unpack(out, x.numel() // (world * d), d, x.dtype)
    return out.reshape(x.shape)


def _slow_fp8(exchanger: Exchanger, x: torch.Tensor, label: str) -> torch.Tensor:
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
    commstats.traced("count_exchange", "fp8-slow one-phase", label, remote * piece, remote * full)
    received = [part.view(wire).view(rows, d).to(x.dtype) if level.fast(i) else
                compress.unpack_rows(part[:packed].view(rows, compress.packed_bytes(1, d)), x.dtype)
                for i, part in enumerate(out.split(sizes))]
    return torch.stack(received).reshape(x.shape)


class InFlight:
    """Same-shaped ``[b, h, s, d]`` tensors whose input exchange has been issued: ``exchanged`` is
    source-major ``[W, n, b, h/W, s, d]``, which the graph waits for where it is read."""

    def __init__(self, exchanger: Exchanger, exchanged: torch.Tensor) -> None:
        self.exchanger, self.exchanged = exchanger, exchanged


def stack(exchanger: Exchanger, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Same-shaped ``[b, h, s, d]`` tensors (their heads padded to a multiple of W) as the
    destination-major input of their exchange, ``[W, n, b, h/W, s, d]``."""
    world = exchanger.world_size
    heads = tensors[0].shape[1]
    tensors = tuple([padding.pad_heads(t, world) for t in tensors])
    b, h, s, d = tensors[0].shape
    # [b, h, s, d] -> [b, W, h/W, s, d] -> [W, b, h/W, s, d], stacked at dim 1: [W, n, b, h/W, s, d]
    # (head block g for group rank g: destination-major, one copy)
    stacked = torch.stack([t.view(b, world, h // world, s, d).transpose(0, 1) for t in tensors], 1)
    nbytes = stacked.numel() * stacked.element_size()
    commstats.traced("count_copy", nbytes)
    if heads < h:
        commstats.traced("count_padding", round(nbytes * (1 - heads / h)))
    return stacked


def start(exchanger: Exchanger, tensors: tuple[torch.Tensor, ...], label: str) -> InFlight:
    """Issue the Ulysses input exchange of ``tensors`` (their heads padded to a multiple of W)."""
    return InFlight(exchanger, all_to_all(exchanger, stack(exchanger, tensors), label))


def sequence(exchanged: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A source-major exchange result ``[W, n, b, h/W, s, d]`` as n head-sharded ``[b, h/W, W*s, d]``."""
    world, n, b, local_heads, s, d = exchanged.shape
    # [W, b, h/W, s, d] -> [b, h/W, W, s, d] -> [b, h/W, W*s, d], per tensor
    out = tuple([exchanged.select(1, i).permute(1, 2, 0, 3, 4).reshape(b, local_heads, world * s, d) for i in range(n)])
    commstats.traced("count_copy", n * out[0].numel() * out[0].element_size())
    return out


def wait(pending: InFlight) -> tuple[torch.Tensor, ...]:
    """The exchanged tensors, head-sharded ``[b, h/W, W*s, d]``."""
    return sequence(pending.exchanged)


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


def output(exchanger: Exchanger, out: torch.Tensor, heads: int) -> torch.Tensor:
    """The output exchange, head-sharded ``[b, h/W, W*s, d]`` back to ``[b, h, s, d]`` (its first
    ``heads``: the rest are padding), as xfuser's ``_ft_c_output_all_to_all`` lays it out."""
    world = exchanger.world_size
    b, h, s, d = out.shape
    if heads < h * world:
        commstats.traced("count_padding", round(out.numel() * out.element_size() * (1 - heads / (h * world))))
    # [b, h/W, W*s, d] -> [W*s, b, h/W, d]: token block j for group rank j
    exchanged = all_to_all(exchanger, out.permute(2, 0, 1, 3).contiguous(), "out")
    # [W, s, b, h/W, d] -> [b, W, h/W, s, d] -> [b, h, s, d]
    exchanged = exchanged.reshape(world, s // world, b, h, d).permute(2, 0, 3, 1, 4).reshape(b, world * h, s // world, d)
    return exchanged if exchanged.shape[1] == heads else exchanged[:, :heads]
