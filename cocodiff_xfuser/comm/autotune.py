"""The all-to-all algorithms by name, and the choice among them per (group, message size), measured on first use.

The registry (:class:`Registry`) is the one place that says which algorithm can run, starts it and
times it. Every algorithm moves the same bytes to the same places (bitwise the output of ``flat``).
The functions behind an entry refuse an input they cannot exchange instead of substituting another
algorithm, so what a counter or a decision says ran is what ran.

Candidates are the algorithms of the registry that can exchange the message over the group, and
say whether a compiled graph can hold them (:attr:`Algorithm.traced`): a traced exchange (and the
same code run eagerly) chooses among those only, timed as the graph runs them:
``flat`` (stock: ``all_to_all_single`` through functional collectives, what xfuser does; traces),
``flat-p2p`` (the same messages as one batch of point-to-point operations, :mod:`.transport`),
``flat-pxn`` (the flat exchange routed as NCCL's PXN routes it on rails, :mod:`.pxn`; groups
whose plan is node x local) and ``hierarchical`` (TAPA; groups with a plan of two or more levels;
traced, one functional ``all_to_all_single`` per level), the latter also pipelined in 2 or 4 parts
for messages of at least ``PIPELINE_MIN_BYTES`` (not traced).
Which wins depends on the links, the backend and the message size (Tutel: hierarchical loses for
large messages at small scale; on a shared node uplink it always loses), so the ``auto`` setting
times the candidates on the real group the first time a size bucket (next power of two of the
bytes per rank) is seen, then caches the decision.

Never slower than the fair flat exchange. The reference is the backend's fair flat exchange
(:func:`.transport.fair_flat`: stock ``flat`` on NCCL and XCCL, whose own all-to-all it is;
``flat-p2p`` on gloo, whose ``all_to_all_single`` pays a posting-order artefact NCCL does not), or
``flat`` where ``flat-p2p`` cannot run. The reference is left only on evidence: every candidate is
timed against it in pairs (adjacent in time, order alternating, so drifts and background bursts
hit both alike), each sample a burst of back-to-back calls (the steady state of a denoising
loop, where an exchange follows the previous one's tail; small messages get longer bursts and
more pairs, they are cheap), and a candidate qualifies only if the median of its paired ratios
to the reference is below ``1 - margin`` and a one-sided 95% upper confidence bound of that median
(distribution-free, from the order statistics of the ratios) is below 1. Among qualifying
candidates the fastest wins, a simpler one on a tie within ``margin``. After ``RECHECK_USES``
uses of a decision that left the reference, the choice is timed against it once more, during
the run; if it is slower by the median, the bucket reverts to the reference for good (logged, and
counted in :func:`cocodiff_xfuser.commstats.ran` as ``reverted``). A traced exchange's reference is
``flat`` (the only flat exchange a graph holds), and its decision is final once made: the graph
that reads it is traced once.

Collective safety: a measurement is a sequence of collectives over the group, so every rank of
the group must reach ``choose`` for the same bucket at the same point, which SPMD model code
does; the re-check is tied to use counts, which are equal on every rank, never to timing. The
timings are reduced with MAX over the group so that all ranks compute the same decision from
the same numbers; a disagreement would hang the job. For the same reason, an imported cache
must be imported on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from .. import commstats
from . import timing, transport
from .agreement import from_first
from . import functional
from .flat import (AllToAllHandle, flat_all_to_all, p2p_all_to_all, p2p_reason, start_flat_all_to_all, start_p2p_all_to_all,
                   wait_collective)
from .pxn import PxnAllToAll
from .tapa import HierarchicalAllToAll

logger = logging.getLogger("cocodiff_xfuser")

#: The algorithms, simplest first (on a measured tie the simpler one wins).
ALGORITHMS = ("flat", "flat-p2p", "flat-pxn", "hierarchical")
#: Values of the ``a2a`` setting (``--cocodiff-a2a``): measured per message size, or one algorithm.
A2A_SETTINGS = ("auto", *ALGORITHMS)


@dataclass(frozen=True)
class Algorithm:
    """One exchange algorithm over a group: equal splits along dim 0 of a tensor."""

    name: str
    reason: Callable[[torch.Tensor, Any], str | None]  # why it cannot exchange (x, group); None: it can
    start: Callable[..., AllToAllHandle]  # (x, group), asynchronous, advanced with ``advance``
    run: Callable[..., torch.Tensor]  # (x, group), blocking; what the autotune measures
    # ``hierarchical`` also takes ``parts=`` (pipelining, see :mod:`.tapa`).
    #: (x, group), blocking: the exchange as a compiled graph holds it (functional collectives),
    #: what the autotune measures for a traced exchange; None: no graph can hold it.
    traced: Callable[..., torch.Tensor] | None = None


class Registry:
    """The algorithms available to one process; ``flat-pxn`` and ``hierarchical`` exist where TAPA has plans."""

    def __init__(self, tapa: HierarchicalAllToAll | None = None) -> None:
        self.tapa = tapa
        entries = [
            Algorithm("flat", lambda x, group: None, start_flat_all_to_all, flat_all_to_all, _traced_flat),
            Algorithm("flat-p2p", p2p_reason, start_p2p_all_to_all, p2p_all_to_all),
        ]
        if tapa is not None:
            pxn = PxnAllToAll(tapa)
            entries.append(Algorithm("flat-pxn", pxn.reason, pxn.start, pxn))
            entries.append(Algorithm("hierarchical", tapa.reason, tapa.start, tapa, functools.partial(_traced_levels, tapa)))
        self._entries = {a.name: a for a in entries}

    def __getitem__(self, name: str) -> Algorithm:
        if name not in ALGORITHMS:
            raise ValueError(f"unknown all-to-all algorithm {name!r}: expected one of {', '.join(ALGORITHMS)}")
        if name not in self._entries:
            raise ValueError(f"all-to-all algorithm {name!r} needs a topology (no plan of levels)")
        return self._entries[name]

    def reason(self, name: str, x: torch.Tensor, group: Any, traced: bool = False) -> str | None:
        """Why ``name`` cannot exchange ``x`` over ``group`` (None: it can), in a compiled graph where ``traced``."""
        if name not in self._entries:
            return "no topology levels to exchange over" if name in ALGORITHMS else f"unknown algorithm {name!r}"
        if traced and self._entries[name].traced is None:
            return "point-to-point messages cannot be traced by torch.compile"
        if traced and name == "hierarchical":
            return self.tapa.traced_reason(x, group)
        return self._entries[name].reason(x, group)

    def eligible(self, x: torch.Tensor, group: Any, traced: bool = False) -> tuple[str, ...]:
        """The algorithms that can exchange ``x`` over ``group`` (in a graph, where ``traced``),
        simplest first (the same on every rank)."""
        return tuple(name for name in ALGORITHMS if self.reason(name, x, group, traced) is None)


def _traced_flat(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The flat exchange as a graph holds it: one functional ``all_to_all_single``, waited for."""
    return wait_collective(functional.all_to_all(x.view(transport.group_info(group)[1], -1), group.group_name))


def _traced_levels(tapa: HierarchicalAllToAll, x: torch.Tensor, group: Any) -> torch.Tensor:
    """TAPA as a graph holds it: one functional ``all_to_all_single`` per level, waited for."""
    plan = tapa.plan(group)
    names = tuple(g.group_name for g in plan.level_groups)
    return wait_collective(functional.levels_all_to_all(x.view(len(plan.ranks), -1), plan.levels, names))


#: Parts a pipelined hierarchical exchange is measured with (1 is the plain one).
PIPELINE_PARTS = (2, 4)
#: Below this many bytes per rank pipelining is not measured: per-message overhead dominates.
PIPELINE_MIN_BYTES = 1 << 20
#: Uses of a decision after which it is timed against its reference again (once): a second, independent
#: measurement under run conditions, early enough to fall in a job's first pipeline call (its
#: warm-up) for any model with a few layers.
RECHECK_USES = 4
#: At and above this many bytes per rank a sample is a burst of 2 calls and ``reps`` pairs are taken.
LARGE_BYTES = 4 << 20
#: Most pairs / calls per sample for the smallest messages.
MAX_REPS = 31
MAX_BURST = 8


@dataclass(frozen=True)
class Decision:
    group: tuple[int, ...]
    bucket_bytes: int
    algorithm: str
    # Per algorithm, the median over pairs of the max over ranks (seconds per call); None: not a
    # candidate. ``hierarchical_s`` is its fastest part count's.
    flat_s: float | None = None
    hierarchical_s: float | None = None
    flat_p2p_s: float | None = None
    flat_pxn_s: float | None = None
    parts: int = 1  # pipeline parts of the hierarchical exchange
    traced: bool = False  # among the exchanges a compiled graph holds (:attr:`Algorithm.traced`)
    ratio: float | None = None  # chosen / reference: median of the paired ratios (1 for the reference)
    ratio_upper: float | None = None  # its one-sided 95% upper confidence bound
    pairs: int | None = None
    # Every other candidate's (median, upper bound) of the paired ratio to the reference, by key.
    ratios: dict[str, list[float]] = field(default_factory=dict, compare=False)
    reverted_from: str | None = None  # the choice the run-time re-check found slower than the reference
    reference: str = "flat"  # the fair flat exchange the candidates were timed against


def _ms(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:.3g} ms"


def size_bucket(nbytes: int) -> int:
    """Smallest power of two >= nbytes."""
    return 1 << max(nbytes - 1, 0).bit_length()


def candidate_key(algorithm: str, parts: int = 1) -> str:
    """``hierarchical`` pipelined in 4 parts is ``hierarchical/4``."""
    return algorithm if parts == 1 else f"{algorithm}/{parts}"


def split_key(key: str) -> tuple[str, int]:
    name, _, parts = key.partition("/")
    return name, int(parts or 1)


def sampling(nbytes: int, reps: int) -> tuple[int, int]:
    """(pairs, calls per sample) for a message of ``nbytes`` per rank: ``reps`` pairs of 2-call
    bursts at ``LARGE_BYTES`` and above; below, both grow with the square root of the size
    ratio, so the measured time per candidate stays bounded while small, noisy samples get more
    averaging."""
    scale = math.sqrt(LARGE_BYTES / max(nbytes, 1))
    if scale <= 1:
        return reps, 2
    return min(MAX_REPS, round(reps * scale) | 1), min(MAX_BURST, max(2, round(2 * scale)))


class AutoAllToAll:
    """All-to-all that picks an algorithm of ``registry`` per (group, size bucket).

    ``a2a``: ``"auto"`` (measure the eligible algorithms on first use) or one algorithm, used
    wherever it can run; where it cannot (``hierarchical`` on a group within one level, an input
    that does not split), ``flat`` runs and the fall-back is counted (:func:`cocodiff_xfuser.commstats.ran`).
    ``reps``: pairs per candidate for large messages (more for small ones, see :func:`sampling`);
    ``margin``: how much faster than the reference (relative) a candidate must measure to be chosen.
    """

    def __init__(self, registry: Registry, a2a: str = "auto", reps: int = 9, margin: float = 0.03) -> None:
        self.registry = registry
        self.a2a = a2a
        self.reps = reps
        self.margin = margin
        self.decisions: dict[tuple[tuple[int, ...], int, bool], Decision] = {}
        self._uses: dict[tuple[tuple[int, ...], int, bool], int] = {}
        self._candidates: dict[tuple, tuple[str, ...]] = {}
        self._warned: set[str] = set()

    def choose(self, x: torch.Tensor, group: Any = None, traced: bool = False) -> str:
        """The algorithm (one of ``ALGORITHMS``) for exchanging ``x`` over ``group``; ``traced``: as a
        compiled graph holds it (what :attr:`Algorithm.traced` runs).

        Collective over ``group`` with the ``auto`` setting when the (group, size bucket) is new,
        and once more at its ``RECHECK_USES``-th use when the decision left its reference (not traced).
        """
        group = group if group is not None else dist.group.WORLD
        if self.a2a != "auto":
            reason = self.registry.reason(self.a2a, x, group, traced)
            if reason is None:
                return self.a2a
            key = f"--cocodiff-a2a {self.a2a}: {reason}"
            if key not in self._warned:
                self._warned.add(key)
                logger.warning("cocodiff: %s; using flat", key)
            commstats.count_fallback(key)
            return "flat"
        candidates = self.candidates(x, group, traced)
        if len(candidates) == 1:
            return candidates[0]
        key = self._key(x, group, traced)
        if key not in self.decisions:
            self.decisions[key] = self._measure(x, group, key, candidates)
            d = self.decisions[key]
            logger.info(
                "all-to-all%s over group %s, %d-byte bucket: %s (flat %s, flat-p2p %s, flat-pxn %s, hierarchical %s;"
                " %s of %s's time)", " (traced)" if traced else "",
                list(d.group), d.bucket_bytes, candidate_key(d.algorithm, d.parts), _ms(d.flat_s), _ms(d.flat_p2p_s),
                _ms(d.flat_pxn_s), _ms(d.hierarchical_s), _ratios_text(d.ratios), d.reference,
            )
        self._uses[key] = self._uses.get(key, 0) + 1
        if not traced and self._uses[key] == RECHECK_USES and self.decisions[key].algorithm != self.decisions[key].reference:
            self._recheck(x, group, key)
        return self.decisions[key].algorithm

    def parts(self, x: torch.Tensor, group: Any = None) -> int:
        """Pipeline parts for the hierarchical exchange of ``x`` (after :meth:`choose`); 1 where the
        bucket's decision does not split this size (a bucket spans sizes)."""
        group = group if group is not None else dist.group.WORLD
        d = self.decisions.get(self._key(x, group, False))
        if d is None or d.algorithm != "hierarchical" or d.parts == 1:
            return 1
        return d.parts if self.registry.tapa.reason(x, group, d.parts) is None else 1

    def start(self, algorithm: str, x: torch.Tensor, group: Any = None, **layout: Any):
        """Start ``algorithm`` (what :meth:`choose` returned) on ``x``, with the decided parts;
        ``layout=`` goes to the hierarchical exchange (see :func:`.layout.heads`)."""
        return self.registry[algorithm].start(x, group, **self._options(algorithm, x, group), **layout)

    def run(self, algorithm: str, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        """Blocking :meth:`start`."""
        return self.registry[algorithm].run(x, group, **self._options(algorithm, x, group))

    def starter(self, algorithm: str, x: torch.Tensor, group: Any = None) -> Callable[..., AllToAllHandle]:
        """:meth:`start` of ``algorithm`` for inputs of ``x``'s size over ``group``, bound once: a
        caller that keeps a settled choice per shape starts each exchange without deciding again
        (``layout=`` still goes to the hierarchical exchange)."""
        group = group if group is not None else dist.group.WORLD
        return functools.partial(self.registry[algorithm].start, group=group, **self._options(algorithm, x, group))

    def _options(self, algorithm: str, x: torch.Tensor, group: Any) -> dict[str, int]:
        parts = self.parts(x, group) if algorithm == "hierarchical" else 1
        return {"parts": parts} if parts > 1 else {}

    def measures(self, x: torch.Tensor, group: Any = None, traced: bool = False) -> bool:
        """Whether :meth:`choose` will measure (collectively) for ``x`` over ``group``."""
        group = group if group is not None else dist.group.WORLD
        if self.a2a != "auto" or len(self.candidates(x, group, traced)) == 1:
            return False
        key = self._key(x, group, traced)
        if key not in self.decisions:
            return True
        d = self.decisions[key]
        return not traced and self._uses.get(key, 0) + 1 == RECHECK_USES and d.algorithm != d.reference

    def settled(self, x: torch.Tensor, group: Any = None, traced: bool = False) -> bool:
        """Whether :meth:`choose`'s answer for ``x`` over ``group`` is final: it will neither measure,
        re-check nor count a fall-back again (a caller may then keep the answer for the shape)."""
        group = group if group is not None else dist.group.WORLD
        if self.a2a != "auto":
            return self.registry.reason(self.a2a, x, group, traced) is None
        if len(self.candidates(x, group, traced)) == 1:
            return True
        key = self._key(x, group, traced)
        d = self.decisions.get(key)
        return d is not None and (traced or d.algorithm == d.reference or self._uses.get(key, 0) >= RECHECK_USES)

    def _key(self, x: torch.Tensor, group: Any, traced: bool) -> tuple[tuple[int, ...], int, bool]:
        return transport.group_ranks(group), size_bucket(x.numel() * x.element_size()), traced

    def candidates(self, x: torch.Tensor, group: Any, traced: bool = False) -> tuple[str, ...]:
        """What ``auto`` measures for ``x`` over ``group``: the eligible algorithms (those a graph
        holds, where ``traced``), and from ``PIPELINE_MIN_BYTES`` the hierarchical exchange in
        ``PIPELINE_PARTS`` (``hierarchical/2``; not traced)."""
        # Eligibility reads the group, the shape and the dtype only: decided once per such key, not per exchange.
        key = (transport.group_ranks(group), tuple(x.shape), x.dtype, torch.compiler.is_compiling(), traced)
        names = self._candidates.get(key)
        if names is None:
            names = self.registry.eligible(x, group, traced)
            if not traced and "hierarchical" in names and x.numel() * x.element_size() >= PIPELINE_MIN_BYTES:
                tapa = self.registry.tapa
                names += tuple(candidate_key("hierarchical", p) for p in PIPELINE_PARTS if tapa.reason(x, group, p) is None)
            self._candidates[key] = names
        return names

    def reference(self, x: torch.Tensor, group: Any, traced: bool = False) -> str:
        """The exchange ``auto`` must not be slower than: the backend's fair flat exchange where it
        can run (in a graph, where ``traced``), else ``flat`` (the same on every rank: the backend
        and the input are)."""
        fair = transport.fair_flat(group, x.device)
        return fair if self.registry.reason(fair, x, group, traced) is None else "flat"

    def _time(self, x: torch.Tensor, group: Any, keys: Sequence[str], reps: int, traced: bool = False) -> dict[str, list[float]]:
        def op(key: str) -> Callable[[], Any]:
            name, parts = split_key(key)
            if traced:
                return lambda: self.registry[name].traced(x, group)
            options = {"parts": parts} if parts > 1 else {}
            return lambda: self.registry[name].run(x, group, **options)

        pairs, burst = sampling(x.numel() * x.element_size(), reps)
        return timing.paired({key: op(key) for key in keys}, group, x.device, pairs, burst)

    def _measure(self, x: torch.Tensor, group: Any, key: tuple[tuple[int, ...], int, bool], candidates: tuple[str, ...]) -> Decision:
        ranks, bucket, traced = key
        reference = self.reference(x, group, traced)
        times = self._time(x, group, candidates, self.reps, traced)
        ratios = {key: [statistics.median(r), timing.median_upper_bound(r)] for key, r in timing.paired_ratios(times, reference).items()}
        chosen = pick(ratios, self.margin, reference)
        median = {key: float(statistics.median(t)) for key, t in times.items()}
        hier = min((k for k in median if k.startswith("hierarchical")), key=median.get, default=None)
        name, parts = split_key(chosen)
        ratio, upper = ratios.get(chosen, [1.0, 1.0])
        return Decision(
            ranks, bucket, name, median["flat"], None if hier is None else median[hier], median.get("flat-p2p"),
            median.get("flat-pxn"), parts=parts, traced=traced, ratio=ratio, ratio_upper=upper, pairs=len(times["flat"]),
            ratios=ratios, reference=reference,
        )

    def _recheck(self, x: torch.Tensor, group: Any, key: tuple[tuple[int, ...], int, bool]) -> None:
        """Time the decision against its reference again, mid-run; revert to the reference if it is slower."""
        d = self.decisions[key]
        chosen = candidate_key(d.algorithm, d.parts)
        ratios = timing.paired_ratios(self._time(x, group, (d.reference, chosen), self.reps), d.reference)[chosen]
        ratio = statistics.median(ratios)
        if ratio <= 1.0:
            logger.info(
                "all-to-all over group %s, %d-byte bucket: %s re-checked at %.2fx of %s's time",
                list(d.group), d.bucket_bytes, chosen, ratio, d.reference,
            )
            return
        self.decisions[key] = dataclasses.replace(
            d, algorithm=d.reference, parts=1, ratio=1.0, ratio_upper=1.0, reverted_from=chosen
        )
        logger.warning(
            "cocodiff: all-to-all over group %s, %d-byte bucket: %s took %.2fx %s's time when re-checked; using %s",
            list(d.group), d.bucket_bytes, chosen, ratio, d.reference, d.reference,
        )
        commstats.count_revert(chosen)


def _ratios_text(ratios: Mapping[str, Sequence[float]]) -> str:
    return ", ".join(f"{k} {m:.2f}x (<= {u:.2f}x)" for k, (m, u) in ratios.items())


def pick(ratios: Mapping[str, Sequence[float]], margin: float, reference: str = "flat") -> str:
    """The candidate to use given each other candidate's (median, upper bound) of its paired
    time ratio to ``reference``: ``reference`` unless some candidate is faster by more than
    ``margin`` at the median and faster at the upper bound; then the fastest such candidate, or a
    simpler one (earlier in ``ALGORITHMS``, fewer parts) within ``margin`` of it. Deterministic:
    equal inputs give the same answer on every rank."""
    qualified = {k: m for k, (m, u) in ratios.items() if m <= 1 - margin and u < 1}
    if not qualified:
        return reference
    fastest = min(qualified.values())
    for key in sorted(qualified, key=lambda k: (ALGORITHMS.index(split_key(k)[0]), split_key(k)[1])):
        if fastest >= qualified[key] * (1 - margin):
            return key
    raise AssertionError("unreachable: the fastest candidate qualifies")


# A JSON file of autotune decisions: loaded at activation when it exists, written at exit.
DECISIONS_ENV = "COCODIFF_A2A_DECISIONS"


def dump_decisions(autotune: AutoAllToAll) -> dict[str, Any]:
    """``autotune``'s decisions as JSON-ready data (what :func:`load_decisions` reads)."""
    topology = autotune.registry.tapa.topology if autotune.registry.tapa is not None else None
    return {
        "version": 1,
        "topology": None if topology is None else str(topology),
        "decisions": [asdict(d) | {"group": list(d.group)} for d in autotune.decisions.values()],
    }


def load_decisions(autotune: AutoAllToAll, data: Mapping[str, Any]) -> None:
    """Add decisions from :func:`dump_decisions` output to ``autotune``; every rank must load the same data."""
    known = {f.name for f in dataclasses.fields(Decision)}
    for raw in data.get("decisions", []):
        d = Decision(**{k: v for k, v in raw.items() if k in known} | {"group": tuple(raw["group"])})
        if d.algorithm not in ALGORITHMS:
            raise ValueError(f"invalid algorithm {d.algorithm!r} in decision {raw}")
        if d.reference not in ("flat", "flat-p2p"):
            raise ValueError(f"invalid reference {d.reference!r} in decision {raw}")
        if not isinstance(d.parts, int) or d.parts < 1:
            raise ValueError(f"invalid parts {d.parts!r} in decision {raw}")
        autotune.decisions[(d.group, d.bucket_bytes, d.traced)] = d


class DecisionsFile:
    """``$COCODIFF_A2A_DECISIONS``: rank 0's file of decisions, loaded into ``autotune`` on every rank
    (so every rank skips the same measurements, even where the file is on storage only some ranks
    see; collective over the world) and written by rank 0 at :meth:`save`. A file measured elsewhere
    than ``provenance`` (topology, backend, world size) is refused."""

    def __init__(self, autotune: AutoAllToAll, provenance: dict[str, Any]) -> None:
        self._autotune, self._provenance = autotune, provenance
        self._rank = dist.get_rank()
        path, data, error = os.environ.get(DECISIONS_ENV) if self._rank == 0 else None, None, None
        if path and os.path.exists(path):
            try:
                with open(path) as f:
                    data = json.load(f)
            except (OSError, ValueError) as e:
                error = f"{DECISIONS_ENV}={path}: cannot read it ({e})"
        self.path, data, error = from_first((path, data, error))
        if error is not None:
            raise ValueError(error)
        if data is None:
            return
        measured_on = {key: data.get(key) for key in provenance}
        if measured_on != provenance:
            raise ValueError(
                f"{DECISIONS_ENV}={self.path} was measured on {measured_on}, this job is "
                f"{provenance}; remove the file or point {DECISIONS_ENV} elsewhere"
            )
        load_decisions(autotune, data)
        logger.info("cocodiff: all-to-all decisions loaded from %s", self.path)

    def save(self) -> None:
        """Rank 0 writes the decisions (a cost model reads them)."""
        if self.path and self._rank == 0:
            text = json.dumps(dump_decisions(self._autotune) | self._provenance, indent=2)
            with open(self.path, "w") as f:
                f.write(text)
