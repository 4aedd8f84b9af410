"""Choose the all-to-all algorithm per (group, message size), by measuring on first use.

Candidates on a group: ``flat`` (stock: ``all_to_all_single`` through functional collectives,
what xfuser does), ``flat-p2p`` (the same exchange with every receive posted before any send;
gloo groups only, see :mod:`cocodiff_xfuser.collectives`) and ``hierarchical`` (TAPA; groups with
a plan of two or more levels; its phases are receives-first on gloo). Which wins depends on the
links, the backend and the message size (Tutel: hierarchical loses for large messages at small
scale; on a shared node uplink it always loses), so ``auto`` mode times the candidates on the
real group the first time a size bucket (next power of two of the bytes per rank) is seen, then
caches the decision. On a tie (within ``margin``) the simpler algorithm wins.

Collective safety: a measurement is a sequence of collectives over the group, so every rank of
the group must reach ``choose`` for the same bucket at the same point, which SPMD model code
does. The timings are reduced with MAX over the group so that all ranks compute the same
decision from the same numbers; a disagreement would hang the job. For the same reason, an
imported cache must be imported on every rank.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from .collectives import (
    AllToAllHandle,
    HierarchicalAllToAll,
    flat_all_to_all,
    p2p_all_to_all,
    start_flat_all_to_all,
    start_p2p_all_to_all,
    uses_receives_first,
)

logger = logging.getLogger("cocodiff_xfuser")

#: Values of ``--cocodiff_a2a``: ``auto`` or a forced algorithm (ALGORITHMS).
MODES = ("auto", "flat", "hierarchical", "flat-p2p")
#: Algorithms, simplest first (on a tie within ``margin`` the simpler one wins).
ALGORITHMS = ("flat", "flat-p2p", "hierarchical")


@dataclass(frozen=True)
class Decision:
    group: tuple[int, ...]
    bucket_bytes: int
    algorithm: str
    # Per candidate, the ``statistic`` (median by default, see AutoAllToAll) over repetitions of
    # the max over ranks. None: not measured (not a candidate on that group).
    flat_s: float | None = None
    hierarchical_s: float | None = None
    flat_p2p_s: float | None = None


def _ms(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:.3g} ms"


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
    """All-to-all that picks ``flat``, ``flat-p2p`` or ``hierarchical`` per (group, size bucket).

    ``mode``: ``"auto"`` (measure the candidates on first use), or a forced algorithm:
    ``"flat"`` (stock), ``"flat-p2p"`` (non-gloo groups use flat), ``"hierarchical"`` (groups
    without a hierarchical plan use flat). The simplest candidate whose time is within ``margin``
    (relative) of the fastest one is chosen: on a tie the simpler exchange wins.
    """

    def __init__(
        self,
        hierarchical: HierarchicalAllToAll | None,
        mode: str = "auto",
        reps: int = 7,
        margin: float = 0.03,
        statistic: str = "median",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown all-to-all mode {mode!r}; expected one of {MODES}")
        if statistic not in ("median", "min"):
            raise ValueError(f"statistic {statistic!r}: expected 'median' or 'min'")
        # The median, not the best repetition: gloo's stock exchange has a bimodal time (its
        # send-before-receive order serializes a pair's two directions in some repetitions and not
        # in others; measured on an emulated 2x2 shared uplink at 16 MiB: min 65 ms, median 104 ms,
        # while flat-p2p was 66 / 75 ms), so its minimum is not what a run gets. Candidates run
        # interleaved, so background bursts hit them alike; ``reps`` is odd so the median is one run.
        self.statistic = statistic
        self.hierarchical = hierarchical
        self.mode = mode
        self.reps = reps
        self.margin = margin
        self.decisions: dict[tuple[tuple[int, ...], int], Decision] = {}
        self._group_ranks: dict[Any, tuple[int, ...]] = {}

    def candidates(self, x: torch.Tensor, group: Any = None) -> tuple[str, ...]:
        """Algorithms available for ``x`` over ``group``, simplest first (the same on every rank)."""
        group = group if group is not None else dist.group.WORLD
        found = ["flat"]
        if uses_receives_first(group, x.device):
            found.append("flat-p2p")
        if self.hierarchical is not None and self.hierarchical.levels(group):
            found.append("hierarchical")
        return tuple(found)

    def choose(self, x: torch.Tensor, group: Any = None) -> str:
        """The algorithm (one of ``ALGORITHMS``) for exchanging ``x`` over ``group``.

        Collective over ``group`` in auto mode when the (group, size bucket) is new.
        """
        group = group if group is not None else dist.group.WORLD
        if self.mode == "flat":
            return "flat"
        candidates = self.candidates(x, group)
        if self.mode != "auto":
            return self.mode if self.mode in candidates else "flat"
        if len(candidates) == 1:
            return "flat"
        key = (self._ranks(group), size_bucket(x.numel() * x.element_size()))
        if key not in self.decisions:
            self.decisions[key] = self._measure(x, group, *key, candidates)
            d = self.decisions[key]
            logger.info(
                "all-to-all over group %s, %d-byte bucket: %s (flat %s, flat-p2p %s, hierarchical %s)",
                list(d.group), d.bucket_bytes, d.algorithm, _ms(d.flat_s), _ms(d.flat_p2p_s), _ms(d.hierarchical_s),
            )
        return self.decisions[key].algorithm

    def start(self, x: torch.Tensor, group: Any = None) -> AllToAllHandle:
        algorithm = self.choose(x, group)
        if algorithm == "hierarchical":
            return self.hierarchical.start(x, group)
        if algorithm == "flat-p2p":
            return start_p2p_all_to_all(x, group)
        return start_flat_all_to_all(x, group)

    def __call__(self, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        algorithm = self.choose(x, group)
        if algorithm == "hierarchical":
            return self.hierarchical(x, group)
        if algorithm == "flat-p2p":
            return p2p_all_to_all(x, group)
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
            known = {f.name for f in dataclasses.fields(Decision)}
            d = Decision(**{k: v for k, v in raw.items() if k in known} | {"group": tuple(raw["group"])})
            if d.algorithm not in ALGORITHMS:
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

    def _measure(
        self, x: torch.Tensor, group: Any, ranks: tuple[int, ...], bucket: int, candidates: tuple[str, ...]
    ) -> Decision:
        # Module-level names are looked up at call time (tests substitute them).
        ops = {
            "flat": lambda: flat_all_to_all(x, group),
            "flat-p2p": lambda: p2p_all_to_all(x, group),
            "hierarchical": lambda: self.hierarchical(x, group),
        }
        times = time_interleaved({name: ops[name] for name in candidates}, group, x.device, self.reps)
        reduce = statistics.median if self.statistic == "median" else min
        best = {name: float(reduce(t)) for name, t in times.items()}
        algorithm = pick(best, self.margin)
        return Decision(
            ranks, bucket, algorithm, best.get("flat"), best.get("hierarchical"), best.get("flat-p2p")
        )


def pick(times: Mapping[str, float], margin: float) -> str:
    """The algorithm to use given each candidate's time: the fastest, unless a simpler candidate
    (earlier in ``ALGORITHMS``) is within ``margin`` of it. Deterministic: equal inputs give the
    same answer on every rank."""
    fastest = min(times.values())
    for name in ALGORITHMS:
        if name in times and fastest >= times[name] * (1 - margin):
            return name
    raise ValueError(f"no known algorithm in {sorted(times)}")
