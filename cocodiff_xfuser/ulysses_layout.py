"""The Ulysses layouts, each written once: the input exchange's head blocks in the order the chosen
exchange sends them (:func:`heads`) and read back as attention reads them (:func:`sequence`), and the
output exchange's token blocks (:func:`output_blocks`, or V-Major's destination-major
:func:`output_stacked`) and their result read back as heads (:func:`output_heads`,
:func:`output_unstacked`). ``W`` is the Ulysses degree; a shape comment on every reshape. Each is a
copy or a view and counts nothing: its callers count the copies they make, eagerly or in traced
code as their path counts."""

from __future__ import annotations

import math
from typing import Sequence

import torch


def heads(tensors: Sequence[torch.Tensor], levels: Sequence[int], layout: Sequence[int]) -> torch.Tensor:
    """Same-shaped ``[b, h, s, d]`` tensors as one contiguous ``[*levels in layout order, n, b, h/W, s, d]``.

    The Ulysses input exchange sends head block g of every tensor to group rank g. xfuser builds its
    destination-major input with ``torch.stack`` and ``permute(...).contiguous()`` (two passes over
    the data), and TAPA's first phase would then re-block it by the innermost topology level (a
    third); this writes each tensor once, straight into the order the chosen exchange sends.
    ``levels``: the group's topology levels (outermost first, product W; ``(W,)`` for a flat
    exchange, whose result is destination-major ``[W, n, b, h/W, s, d]``), the destination rank
    ``g = ravel(g_0, ...)`` owning head block g; ``layout``: the memory order of the level dims
    (``0, 1, ...`` is destination-major, xfuser's order; TAPA's first phase:
    :meth:`~cocodiff_xfuser.comm.tapa.HierarchicalAllToAll.input_layout`).
    """
    b, h, s, d = tensors[0].shape
    world, k = math.prod(levels), len(levels)
    order = (*map((1).__add__, layout), 0, k + 1, k + 2, k + 3)  # (no generator: a Python call per item)
    views = []
    for t in tensors:
        # [b, h, s, d] -> [b, *levels, h/W, s, d] -> [*levels in layout order, b, h/W, s, d], a view
        views.append(t.view(b, *levels, h // world, s, d).permute(order))
    # stacked at dim k in one new tensor (one operation, however many tensors)
    return torch.stack(views, k)


def sequence(exchanged: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The source-major exchange result ``[W, n, b, h/W, s, d]`` as ``n`` tensors ``[b, h/W, W*s, d]``
    (what attention reads), one copy each. Each its own tensor, none a view of another: a compiled
    graph's operator may not return outputs that alias."""
    world, n, b, local_heads, s, d = exchanged.shape
    out = []  # (a loop, not a comprehension or generator: each is a Python call per layer)
    for i in range(n):
        # [W, b, h/W, s, d] -> [b, h/W, W, s, d] -> [b, h/W, W*s, d]
        out.append(exchanged.select(1, i).permute(1, 2, 0, 3, 4).reshape(b, local_heads, world * s, d))
    return tuple(out)


def output_blocks(out: torch.Tensor) -> torch.Tensor:
    """The output exchange's input, as xfuser's ``_ft_c_output_all_to_all`` lays it out: head-sharded
    ``[b, h/W, W*s, d]`` as ``[W*s, b, h/W, d]``, token block j for group rank j (one copy)."""
    # [b, h/W, W*s, d] -> [W*s, b, h/W, d]
    return out.permute(2, 0, 1, 3).contiguous()


def output_heads(exchanged: torch.Tensor, world: int, heads: int) -> torch.Tensor:
    """The output exchange's result ``[W*s, b, h/W, d]`` (token block i from group rank i: its heads)
    as sequence-sharded ``[b, h, s, d]``, its first ``heads`` (the rest are padding)."""
    tokens, b, local_heads, d = exchanged.shape
    # [W*s, b, h/W, d] -> [W, s, b, h/W, d] -> [b, W, h/W, s, d] -> [b, h, s, d]
    out = exchanged.reshape(world, tokens // world, b, local_heads, d).permute(2, 0, 3, 1, 4).reshape(
        b, world * local_heads, tokens // world, d)
    return out if out.shape[1] == heads else out[:, :heads]


def output_stacked(out: torch.Tensor, world: int) -> torch.Tensor:
    """V-Major's output exchange input: head-sharded ``[b, h/W, W*s, d]`` as destination-major
    ``[W, 1, b, h/W, s, d]``, the input exchange's layout, whose caches it shares (one copy)."""
    b, local_heads, tokens, d = out.shape
    # [b, h/W, W*s, d] -> [b, h/W, W, s, d] -> [W, b, h/W, s, d] -> [W, 1, b, h/W, s, d]
    return out.reshape(b, local_heads, world, tokens // world, d).permute(2, 0, 1, 3, 4).unsqueeze(1).contiguous()


def output_unstacked(exchanged: torch.Tensor, heads: int) -> torch.Tensor:
    """V-Major's output exchange result ``[W, 1, b, h/W, s, d]`` (head block i from group rank i) as
    sequence-sharded ``[b, h, s, d]``, its first ``heads`` (the rest are padding)."""
    world, _, b, local_heads, s, d = exchanged.shape
    # [W, 1, b, h/W, s, d] -> [b, W, h/W, s, d] -> [b, h, s, d]
    out = exchanged.squeeze(1).transpose(0, 1).reshape(b, world * local_heads, s, d)
    return out if out.shape[1] == heads else out[:, :heads]
