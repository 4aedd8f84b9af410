"""Choose flat or hierarchical all-to-all per (group, message size), by measuring on first use.

Which exchange wins depends on the links and the message size (Tutel: hierarchical loses for
large messages at small scale; on a shared node uplink it always loses), so ``auto`` mode times
both on the real group the first time a size bucket (next power of two of the bytes per rank)
is seen, then caches the decision.

Collective safety: a measurement is a sequence of collectives over the group, so every rank of
the group must reach ``choose`` for the same bucket at the same point, which SPMD model code
does. The timings are reduced with MAX over the group so that all ranks compute the same
decision from the same numbers; a disagreement would hang the job. For the same reason, an
imported cache must be imported on every rank.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from .collectives import AllToAllHandle, HierarchicalAllToAll, flat_all_to_all, start_flat_all_to_all

logger = logging.getLogger("cocodiff_xfuser")

MODES = ("auto", "flat", "hierarchical")


@dataclass(frozen=True)
class Decision:
    group: tuple[int, ...]
    bucket_bytes: int
    algorithm: str
    # Best repetition of the max over ranks: background noise only ever adds time, and a
    # median of a handful of repetitions let one noisy burst flip decisions on a busy machine.
    flat_s: float | None = None
    hierarchical_s: float | None = None


def size_bucket(nbytes: int) -> int:
    """Smallest power of two >= nbytes."""
    return 1 << max(nbytes - 1, 0).bit_length()


def synchronize(device: torch.device) -> None:
    if device.type in ("cuda", "xpu"):
        getattr(torch, device.type).synchronize(device)


def time_interleaved(
    ops: Mapping[str, Callable[[], Any]],
    group: Any,
    device: torch.device,
    reps: int,
    warmup: int = 1,
) -> dict[str, list[float]]:
    """Seconds per repetition of each op, max over the ranks of ``group`` (collective).

    The ops run interleaved (A B A B ...) so that drifts hit them alike; each run is
    barrier -> op -> device sync. Warm-up runs (connection setup, allocation) are dropped.
    """
    names = list(ops)
    times = torch.zeros(len(names), reps, dtype=torch.float64)
    for rep in range(warmup + reps):
        for i, name in enumerate(names):
            dist.barrier(group=group)
            synchronize(device)
            t0 = time.perf_counter()
            ops[name]()
            synchronize(device)
            if rep >= warmup:
                times[i, rep - warmup] = time.perf_counter() - t0
    # The reduction must run on the device the backend serves (NCCL/XCCL need device tensors).
    times = times.to(device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return {name: times[i].tolist() for i, name in enumerate(names)}


class AutoAllToAll:
    """All-to-all that picks flat or hierarchical per (group, size bucket).

    ``mode``: ``"auto"`` (measure on first use), ``"flat"`` or ``"hierarchical"`` (forced;
    groups without a hierarchical plan always use flat). Hierarchical must beat flat by
    ``margin`` (relative) to be chosen: on a tie the simpler exchange wins.
    """

    def __init__(
        self,
        hierarchical: HierarchicalAllToAll | None,
        mode: str = "auto",
        reps: int = 5,
        margin: float = 0.03,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown all-to-all mode {mode!r}; expected one of {MODES}")
        self.hierarchical = hierarchical
        self.mode = mode
        self.reps = reps
        self.margin = margin
        self.decisions: dict[tuple[tuple[int, ...], int], Decision] = {}
        self._group_ranks: dict[Any, tuple[int, ...]] = {}

    def choose(self, x: torch.Tensor, group: Any = None) -> str:
        """``"flat"`` or ``"hierarchical"`` for exchanging ``x`` over ``group`` (collective in auto mode)."""
        group = group if group is not None else dist.group.WORLD
        if self.mode == "flat" or self.hierarchical is None or not self.hierarchical.levels(group):
            return "flat"
        if self.mode == "hierarchical":
            return "hierarchical"
        key = (self._ranks(group), size_bucket(x.numel() * x.element_size()))
        if key not in self.decisions:
            self.decisions[key] = self._measure(x, group, *key)
            d = self.decisions[key]
            logger.info(
                "all-to-all over group %s, %d-byte bucket: %s (flat %.3g ms, hierarchical %.3g ms)",
                list(d.group), d.bucket_bytes, d.algorithm, d.flat_s * 1e3, d.hierarchical_s * 1e3,
            )
        return self.decisions[key].algorithm

    def start(self, x: torch.Tensor, group: Any = None) -> AllToAllHandle:
        if self.choose(x, group) == "hierarchical":
            return self.hierarchical.start(x, group)
        return start_flat_all_to_all(x, group)

    def __call__(self, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        if self.choose(x, group) == "hierarchical":
            return self.hierarchical(x, group)
        return flat_all_to_all(x, group)

    def to_dict(self) -> dict[str, Any]:
        topology = self.hierarchical.topology if self.hierarchical is not None else None
        return {
            "version": 1,
            "topology": None if topology is None else str(topology),
            "decisions": [asdict(d) | {"group": list(d.group)} for d in self.decisions.values()],
        }

    def load_dict(self, data: Mapping[str, Any]) -> None:
        """Add decisions from ``to_dict`` output; every rank must load the same data."""
        for raw in data.get("decisions", []):
            d = Decision(**{**raw, "group": tuple(raw["group"])})
            if d.algorithm not in MODES[1:]:
                raise ValueError(f"invalid algorithm {d.algorithm!r} in decision {raw}")
            self.decisions[(d.group, d.bucket_bytes)] = d

    def export_json(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    def import_json(self, path: str | os.PathLike) -> None:
        with open(path) as f:
            self.load_dict(json.load(f))

    def _ranks(self, group: Any) -> tuple[int, ...]:
        if group not in self._group_ranks:
            self._group_ranks[group] = tuple(sorted(dist.get_process_group_ranks(group)))
        return self._group_ranks[group]

    def _measure(self, x: torch.Tensor, group: Any, ranks: tuple[int, ...], bucket: int) -> Decision:
        times = time_interleaved(
            {"flat": lambda: flat_all_to_all(x, group), "hierarchical": lambda: self.hierarchical(x, group)},
            group,
            x.device,
            self.reps,
        )
        flat_s, hier_s = min(times["flat"]), min(times["hierarchical"])
        algorithm = "hierarchical" if hier_s < flat_s * (1 - self.margin) else "flat"
        return Decision(ranks, bucket, algorithm, flat_s, hier_s)
