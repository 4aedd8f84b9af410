"""Agreement across ranks on rank-local facts that decide which collectives run.

A fact that one rank reads from its own environment, disk or device (the detected topology, a
decisions file, a fall-back) can differ between ranks; if it changes the collectives a rank
launches, the job hangs. Such facts are either taken from one rank (:func:`from_first`) or
compared (:func:`agree`), with an error that names the rank that differs.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist

from . import transport

T = TypeVar("T")


class Disagreement(RuntimeError):
    """Ranks hold different values of a fact that must be the same on all of them."""


def agree(value: T, what: str, group: Any = None) -> T:
    """``value`` if every rank of ``group`` (default: world) holds the same; else a clear error (collective)."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    transport.launched(group, "all_gather_object")
    dist.all_gather_object(everyone, value, group=group)
    for rank, other in enumerate(everyone):
        if other != everyone[0]:
            ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
            raise Disagreement(
                f"cocodiff: ranks disagree on {what}: rank {ranks[rank]} has {other!r}, rank {ranks[0]} has "
                f"{everyone[0]!r}; every rank must see the same (launch all ranks with the same flags and environment)"
            )
    return value


def from_first(value: T, group: Any = None) -> T:
    """The first rank's ``value`` of ``group`` (default: world) on every rank (collective)."""
    holder = [value]
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    transport.launched(group, "broadcast_object_list")
    dist.broadcast_object_list(holder, src=ranks[0], group=group)
    return holder[0]


def any_rank(flag: bool, group: Any, device: torch.device) -> bool:
    """True on every rank if ``flag`` is True on any rank of ``group`` (collective, one small all-reduce)."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    transport.launched(group, "all_reduce")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())
