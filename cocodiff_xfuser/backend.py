"""The cocodiff sequence-parallel backend of one process: its Ulysses group and exchange plan.

:mod:`cocodiff_xfuser.xfuser` activates it once xfuser has built its process groups and sends
every Ulysses all-to-all here; V-First processors start their exchanges (in and out) through
it. This module knows nothing about how it is wired in.
"""

from __future__ import annotations

import atexit
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cocodiff_xfuser.comm import topology as topo
from cocodiff_xfuser.comm.autotune import AutoAllToAll
from cocodiff_xfuser.comm.flat import AllToAllHandle
from cocodiff_xfuser.comm.registry import A2A_SETTINGS, Registry
from cocodiff_xfuser.comm.tapa import HierarchicalAllToAll

logger = logging.getLogger("cocodiff_xfuser")

# A JSON file of autotune decisions: loaded at activation when it exists, written at exit.
DECISIONS_ENV = "COCODIFF_A2A_DECISIONS"


@dataclass(frozen=True)
class Options:
    """What a user chose on the command line (``--cocodiff_*`` flags)."""

    topology: str | None = None  # NxL[xT], a preset name/path, or None/"auto" to detect
    a2a: str = "auto"  # all-to-all: one of A2A_SETTINGS
    v_first: bool = False

    def __post_init__(self) -> None:
        if self.a2a not in A2A_SETTINGS:
            raise ValueError(f"--cocodiff-a2a {self.a2a!r}: expected one of {', '.join(A2A_SETTINGS)}")


class _Reshaping:
    """A handle over a flattened exchange that gives the result back in the input's shape."""

    def __init__(self, handle: AllToAllHandle, shape: torch.Size) -> None:
        self._handle, self._shape = handle, shape

    def progress(self) -> bool:
        return self._handle.progress()

    def wait(self) -> torch.Tensor:
        return self._handle.wait().reshape(self._shape)


class CocodiffBackend:
    """Runs the Ulysses exchanges of one process: flat or hierarchical, chosen per message size."""

    def __init__(self, group: dist.ProcessGroup, options: Options) -> None:
        self.group = group
        self.options = options
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank()
        # Collective over the world: every rank learns every Ulysses group, resolves the same
        # topology and creates the same sub-groups in the same order.
        groups: list[list[int]] = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(groups, dist.get_process_group_ranks(group))
        spec = None if options.topology in (None, "", "auto") else options.topology
        self.topology = topo.resolve(spec, dist.get_world_size())
        tapa = HierarchicalAllToAll(self.topology, groups)
        self.levels = tapa.levels(group)
        self.exchange = AutoAllToAll(Registry(tapa), a2a=options.a2a)
        self._decisions_file = os.environ.get(DECISIONS_ENV)
        if self._decisions_file and os.path.exists(self._decisions_file):
            # Every rank reads the same file, so every rank skips the same measurements.
            self.exchange.import_json(self._decisions_file)
            logger.info("cocodiff: all-to-all decisions loaded from %s", self._decisions_file)

    def save_decisions(self) -> None:
        """Rank 0 writes the autotune decisions to ``$COCODIFF_A2A_DECISIONS`` (a cost model reads them)."""
        if self._decisions_file and self.rank == 0:
            self.exchange.export_json(self._decisions_file)

    # The handles and the buffer pool are Python state that torch.compile cannot trace; keep
    # the exchange out of compiled graphs (a graph break, as a stock collective wait would be).
    @torch.compiler.disable
    def start(self, x: torch.Tensor) -> _Reshaping:
        """Start the equal-split all-to-all of ``x`` (chunks destination-major along the flattened data)."""
        return _Reshaping(self.exchange.start(x.flatten(), self.group), x.shape)

    @torch.compiler.disable
    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        return self.exchange(x.flatten(), self.group).reshape(x.shape)

    def describe(self) -> str:
        plan = "x".join(map(str, self.levels)) if self.levels else "flat only"
        return (
            f"ulysses group of {self.world_size} on topology {self.topology} ({self.topology.describe()}): "
            f"levels {plan}, all-to-all {self.options.a2a}, V-First {'on' if self.options.v_first else 'off'}"
        )


_ACTIVE: CocodiffBackend | None = None


def activate(group: dist.ProcessGroup, options: Options) -> CocodiffBackend:
    """Make this process's Ulysses exchanges go through cocodiff (collective over the world).

    Re-activating with the same group and options keeps the backend (its sub-groups and tuned
    decisions): xfuser may rebuild its runtime state several times for one model.
    """
    global _ACTIVE
    if _ACTIVE is not None and _ACTIVE.group is group and _ACTIVE.options == options:
        return _ACTIVE
    _ACTIVE = CocodiffBackend(group, options)
    atexit.register(_ACTIVE.save_decisions)
    logger.info("cocodiff: %s", _ACTIVE.describe())
    return _ACTIVE


def deactivate() -> None:
    global _ACTIVE
    _ACTIVE = None


def active() -> CocodiffBackend | None:
    return _ACTIVE
