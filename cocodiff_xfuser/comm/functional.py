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


def _issue(x: torch.Tensor, out_sizes: list[int] | None, in_sizes: list[int] | None, group: str) -> torch.Tensor:
    """torch's functional ``all_to_all_single``. Eagerly dispatched below autograd: a pipeline call
    runs under no_grad, where the Python autograd kernels torch registers for the collective and its
    result's wrapper would run per exchange (a few tens of Python calls) and do nothing; the same
    ops run. Traced, as it is (a graph holds the ops alone)."""
    if torch.compiler.is_dynamo_compiling():
        return _all_to_all_single(x, out_sizes, in_sizes, group)
    with flat.BELOW_AUTOGRAD():
        return _all_to_all_single(x, out_sizes, in_sizes, group)


def all_to_all(x: torch.Tensor, group: str) -> torch.Tensor:
    """The equal-split all-to-all of ``x`` along dim 0 over ``group`` (a group name): chunk d goes
    to group rank d, chunk s of the result came from group rank s. Eagerly the result is waited for
    on first use (:func:`.flat.wait_collective`), traced the graph waits where inductor places the wait."""
    return _issue(x.contiguous(), None, None, group)


def aligned(nbytes: int) -> int:
    """``nbytes`` padded to 4 bytes: a piece of :func:`uneven_all_to_all` that takes this many leaves
    whatever follows it aligned for its dtype's view."""
    return -(-nbytes // 4) * 4


def uneven_all_to_all(x: torch.Tensor, sizes: list[int], group: str) -> torch.Tensor:
    """The all-to-all of flat ``x`` over ``group`` in pieces of ``sizes`` both ways (piece j to and
    from group rank j: what every pair sends each other is the same size, fixed by the shapes)."""
    return _issue(x, sizes, sizes, group)


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
