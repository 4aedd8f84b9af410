"""The cocodiff sequence-parallel backend of one process: its Ulysses group and exchange plan.

:mod:`cocodiff_xfuser.integration` activates it after xfuser has built its process groups and
sends every Ulysses all-to-all here. This module knows nothing about how it is wired in.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

import torch.distributed._functional_collectives as ft_c

logger = logging.getLogger("cocodiff_xfuser")


class CocodiffBackend:
    """Runs the Ulysses exchanges of one process over its Ulysses group."""

    def __init__(self, group: dist.ProcessGroup, topology: str | None = None, algorithm: str = "auto") -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.topology = topology
        self.algorithm = algorithm

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """Equal-split all-to-all of ``x`` (any shape; chunks destination-major along the flattened data)."""
        out = ft_c.all_to_all_single(x.flatten(), None, None, group=self.group)
        return out.wait().reshape(x.shape)


_ACTIVE: CocodiffBackend | None = None


def activate(group: dist.ProcessGroup, topology: str | None = None, algorithm: str = "auto") -> CocodiffBackend:
    """Make this process's Ulysses exchanges go through cocodiff (collective over the world)."""
    global _ACTIVE
    _ACTIVE = CocodiffBackend(group, topology, algorithm)
    logger.info("cocodiff: sp backend active (ulysses group of %d ranks)", _ACTIVE.world_size)
    return _ACTIVE


def deactivate() -> None:
    global _ACTIVE
    _ACTIVE = None


def active() -> CocodiffBackend | None:
    return _ACTIVE
