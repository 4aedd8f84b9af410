"""The Ulysses layouts: the input exchange's head blocks written once, in the order the chosen
exchange sends them (:func:`heads`), and its result read back as attention reads it
(:func:`sequence`). Both copies are counted (:func:`cocodiff_xfuser.commstats.ran`, ``copied_bytes``)."""

from __future__ import annotations

from typing import Sequence

import torch

from cocodiff_xfuser import commstats


def heads(tensors: Sequence[torch.Tensor], levels: Sequence[int], layout: Sequence[int]) -> torch.Tensor:
    """Same-shaped ``[b, h, s, d]`` tensors as one contiguous ``[*levels in layout order, n, b, h/W, s, d]``.

    The Ulysses input exchange sends head block g of every tensor to group rank g. xfuser builds its
    destination-major input with ``torch.stack`` and ``permute(...).contiguous()`` (two passes over
    the data), and TAPA's first phase would then re-block it by the innermost topology level (a
    third); this writes each tensor once, straight into the order the chosen exchange sends.
    ``levels``: the group's topology levels (outermost first, product W; ``(W,)`` for a flat
    exchange), the destination rank ``g = ravel(g_0, ...)`` owning head block g; ``layout``: the
    memory order of the level dims (``0, 1, ...`` is destination-major, xfuser's order; TAPA's
    first phase: :meth:`~cocodiff_xfuser.comm.tapa.HierarchicalAllToAll.input_layout`). The copy is
    counted (:func:`cocodiff_xfuser.commstats.ran`, ``copied_bytes``).
    """
    b, h, s, d = tensors[0].shape
    world, k = int(torch.Size(levels).numel()), len(levels)
    order = (*(1 + j for j in layout), 0, k + 1, k + 2, k + 3)
    # [b, h, s, d] -> [b, *levels, h/W, s, d] -> [*levels in layout order, b, h/W, s, d], each
    # tensor a view; stacked at dim k in one new tensor (one operation, however many tensors).
    out = torch.stack([t.view(b, *levels, h // world, s, d).permute(order) for t in tensors], k)
    commstats.count_copy(out.numel() * out.element_size())
    return out


def sequence(exchanged: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """The source-major exchange result ``[W, n, b, h/W, s, d]`` as ``n`` tensors ``[b, h/W, W*s, d]``
    (what attention reads; the copy is counted). Each its own tensor, none a view of another: a
    compiled graph's operator may not return outputs that alias."""
    world, _, b, local_heads, s, d = exchanged.shape
    # [W, b, h/W, s, d] -> [b, h/W, W, s, d] -> [b, h/W, W*s, d], per tensor
    # (A list, not a generator: a generator's every step is a Python call per layer.)
    out = tuple([exchanged.select(1, i).permute(1, 2, 0, 3, 4).reshape(b, local_heads, world * s, d) for i in range(n)])
    commstats.count_copy(n * out[0].numel() * out[0].element_size())
    return out
