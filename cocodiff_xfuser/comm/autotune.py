"""Choose the all-to-all algorithm per (group, message size), by measuring on first use.

Candidates are the algorithms of :mod:`.registry` that can exchange the message over the group:
``flat`` (stock: ``all_to_all_single`` through functional collectives, what xfuser does),
``flat-p2p`` (the same exchange with every receive posted before any send; gloo groups only)
and ``hierarchical`` (TAPA; groups with a plan of two or more levels). Which wins depends on the
links, the backend and the message size (Tutel: hierarchical loses for large messages at small
scale; on a shared node uplink it always loses), so the ``auto`` setting times the candidates on
the real group the first time a size bucket (next power of two of the bytes per rank) is seen,
then caches the decision. On a tie (within ``margin``) the simpler algorithm wins.

Collective safety: a measurement is a sequence of collectives over the group, so every rank of
the group must reach ``choose`` for the same bucket at the same point, which SPMD model code
does. The timings are reduced with MAX over the group so that all ranks compute the same
decision from the same numbers; a disagreement would hang the job. For the same reason, an
imported cache must be imported on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from .. import commstats
from ..platform import detect
from . import order
from .registry import A2A_SETTINGS, ALGORITHMS, Registry

logger = logging.getLogger("cocodiff_xfuser")


@dataclass(frozen=True)
class Decision:
    group: tuple[int, ...]
    bucket_bytes: int
    algorithm: str
    # Per candidate, the median over repetitions of the max over ranks. None: not measured (not a candidate on that group).
    flat_s: float | None = None
    hierarchical_s: float | None = None
    flat_p2p_s: float | None = None


def _ms(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:.3g} ms"


def size_bucket(nbytes: int) -> int:
    """Smallest power of two >= nbytes."""
    return 1 << max(nbytes - 1, 0).bit_length()


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
            order.launched(group, "barrier")
            dist.barrier(group=group)
            detect().synchronize(device)
            t0 = time.perf_counter()
            ops[name]()
            detect().synchronize(device)
            if rep >= warmup:
                times[i, rep - warmup] = time.perf_counter() - t0
    # The reduction must run on the device the backend serves (NCCL/XCCL need device tensors).
    times = times.to(device)
    order.launched(group, "all_reduce")
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return {name: times[i].tolist() for i, name in enumerate(names)}


class AutoAllToAll:
    """All-to-all that picks an algorithm of ``registry`` per (group, size bucket).

    ``a2a``: ``"auto"`` (measure the eligible algorithms on first use) or one algorithm, used
    wherever it can run; where it cannot (``hierarchical`` on a group within one level, ``flat-p2p``
    off gloo), ``flat`` runs and the fall-back is counted (:func:`cocodiff_xfuser.commstats.ran`). The simplest candidate whose
    time is within ``margin`` (relative) of the fastest one is chosen: on a tie the simpler
    exchange wins.
    """

    def __init__(self, registry: Registry, a2a: str = "auto", reps: int = 7, margin: float = 0.03) -> None:
        if a2a not in A2A_SETTINGS:
            raise ValueError(f"all-to-all {a2a!r}: expected one of {', '.join(A2A_SETTINGS)}")
        # The median, not the best repetition: gloo's stock exchange has a bimodal time (its
        # send-before-receive order serializes a pair's two directions in some repetitions and not
        # in others; measured on an emulated 2x2 shared uplink at 16 MiB: min 65 ms, median 104 ms,
        # while flat-p2p was 66 / 75 ms), so its minimum is not what a run gets. Candidates run
        # interleaved, so background bursts hit them alike; ``reps`` is odd so the median is one run.
        self.registry = registry
        self.a2a = a2a
        self.reps = reps
        self.margin = margin
        self.decisions: dict[tuple[tuple[int, ...], int], Decision] = {}
        self._warned: set[str] = set()
        self._group_ranks: dict[Any, tuple[int, ...]] = {}

    def choose(self, x: torch.Tensor, group: Any = None) -> str:
        """The algorithm (one of ``ALGORITHMS``) for exchanging ``x`` over ``group``.

        Collective over ``group`` with the ``auto`` setting when the (group, size bucket) is new.
        """
        group = group if group is not None else dist.group.WORLD
        if self.a2a != "auto":
            reason = self.registry.reason(self.a2a, x, group)
            if reason is None:
                return self.a2a
            key = f"--cocodiff-a2a {self.a2a}: {reason}"
            if key not in self._warned:
                self._warned.add(key)
                logger.warning("cocodiff: %s; using flat", key)
            commstats.count_fallback(key)
            return "flat"
        candidates = self.registry.eligible(x, group)
        if len(candidates) == 1:
            return candidates[0]
        key = (self._ranks(group), size_bucket(x.numel() * x.element_size()))
        if key not in self.decisions:
            self.decisions[key] = self._measure(x, group, *key, candidates)
            d = self.decisions[key]
            logger.info(
                "all-to-all over group %s, %d-byte bucket: %s (flat %s, flat-p2p %s, hierarchical %s)",
                list(d.group), d.bucket_bytes, d.algorithm, _ms(d.flat_s), _ms(d.flat_p2p_s), _ms(d.hierarchical_s),
            )
        return self.decisions[key].algorithm

    def measures(self, x: torch.Tensor, group: Any = None) -> bool:
        """Whether :meth:`choose` will measure (collectively) for ``x`` over ``group``."""
        group = group if group is not None else dist.group.WORLD
        if self.a2a != "auto" or len(self.registry.eligible(x, group)) == 1:
            return False
        return (self._ranks(group), size_bucket(x.numel() * x.element_size())) not in self.decisions

    def to_dict(self) -> dict[str, Any]:
        topology = self.registry.tapa.topology if self.registry.tapa is not None else None
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

    def _ranks(self, group: Any) -> tuple[int, ...]:
        if group not in self._group_ranks:
            self._group_ranks[group] = tuple(sorted(dist.get_process_group_ranks(group)))
        return self._group_ranks[group]

    def _measure(
        self, x: torch.Tensor, group: Any, ranks: tuple[int, ...], bucket: int, candidates: tuple[str, ...]
    ) -> Decision:
        ops = {name: (lambda run=self.registry[name].run: run(x, group)) for name in candidates}
        times = time_interleaved(ops, group, x.device, self.reps)
        best = {name: float(statistics.median(t)) for name, t in times.items()}
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
