"""The exchanges a compiled graph holds: functional collectives, which inductor schedules (xDiT's
compute/communication overlap passes move them) and a CUDA graph captures, as stock's exchange.

``flat`` is stock's ``all_to_all_single`` over the group. ``hierarchical`` (TAPA) is one
``all_to_all_single`` per topology level over that level's sub-group, innermost level first
(Tutel's 2DH, generalized to k levels): each replaces one destination coordinate of the data by
the source coordinate. It moves the bytes without arithmetic, so its result is bitwise the flat
exchange's. Groups are passed by name, the form a graph holds (the same name on every rank).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .. import compat
from . import flat

# Looked up once, at import (a graph cannot trace the lookup; eager exchanges use the same name,
# :mod:`.flat`).
_all_to_all_single = compat.torch_private("torch.distributed._functional_collectives", "all_to_all_single")


def all_to_all(x: torch.Tensor, group: str) -> torch.Tensor:
    """The equal-split all-to-all of ``x`` along dim 0 over ``group`` (a group name): chunk d goes
    to group rank d, chunk s of the result came from group rank s. Eagerly the result is waited for
    on first use, traced the graph waits where inductor places the wait."""
    return _all_to_all_single(x.contiguous(), None, None, group)


def aligned(nbytes: int) -> int:
    """``nbytes`` padded to 4 bytes: a piece of :func:`uneven_all_to_all` that takes this many leaves
    whatever follows it aligned for its dtype's view."""
    return -(-nbytes // 4) * 4


def uneven_all_to_all(x: torch.Tensor, sizes: list[int], group: str) -> torch.Tensor:
    """The all-to-all of flat ``x`` over ``group`` in pieces of ``sizes`` both ways (piece j to and
    from group rank j: what every pair sends each other is the same size, fixed by the shapes)."""
    return _all_to_all_single(x, sizes, sizes, group)


def levels_all_to_all(x: torch.Tensor, levels: Sequence[int], groups: Sequence[str]) -> torch.Tensor:
    """:func:`all_to_all` of ``x`` over a group spanning topology ``levels`` (outermost first,
    product W; group rank ``g = ravel(g_0, ...)``) as one exchange per level over ``groups``
    (level i's sub-group: the ranks that differ from this one only in coordinate i, ranked by it)."""
    k = len(levels)
    # [W, ...] -> [s_0, ..., s_{k-1}, c]: the destination's coordinates, then the chunk
    data = x.reshape(*levels, -1)
    for level in reversed(range(k)):
        # [..., s_level, ..., c] -> [s_level, ..., c]: that level's peers' chunks leading, one copy
        # (inductor folds the previous level's inverse permutation into it)
        lead = data.movedim(level, 0).contiguous()
        # chunk i came from the level peer with coordinate i: the coordinate is now the source's
        data = all_to_all(lead, groups[level])
        # eagerly, each level waits for the one before (traced, the graph places the waits)
        data = (data if level == 0 else flat.wait_collective(data)).movedim(0, level)
    # [s_0, ..., s_{k-1}, c] (source coordinates) -> x's shape: chunk s from group rank s
    return data.reshape(x.shape)
