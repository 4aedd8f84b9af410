"""What ran in this process (always counted), and communication timings (``COCODIFF_COMM_STATS=1``).

Always counted, at the cost of a dictionary update per exchange (:func:`ran`): exchanges per
algorithm (``stock`` when xfuser's own exchange ran) and per label (layer type: ``usp`` for
exchanges routed from xfuser's ``USP``, ``*.v``, ``qk``, ``out`` for V-First's), V-First
processor calls, fall-backs by reason, and the bytes this rank's cocodiff exchanges send over
the topology's slowest level (to ranks on other nodes), next to what the exact exchange of
the same tensors sends there (a lossy mechanism sends less). Tests assert on these that the
path under test ran.

Timings, off by default:

* every Ulysses exchange: bytes sent by this rank and the time the caller was blocked in it,
  for stock Ulysses and cocodiff alike (the routed ``_sdpa_all_to_all_single`` and V-First's
  output exchange time the blocking ones; V-First's asynchronous exchanges record the time their ``wait`` blocked);
* V-First overlap, per label (layer type) and size: the first ``CALIBRATION_CALLS`` exchanges
  are waited for at once, which measures the exchange time ``T`` with nothing to hide it;
  afterwards each wait records its exposed part. Hidden share = ``1 - exposed / T``.

Timings synchronize the device first, so they are real on GPUs too (and cost a sync each).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, fields
from typing import Callable

import torch

from cocodiff_xfuser import compat
from cocodiff_xfuser.platform import detect

CALIBRATION_CALLS = 3
#: Whether timings are on (:func:`enabled`; an attribute for code where a call per exchange would count).
timings_on = os.environ.get("COCODIFF_COMM_STATS", "") not in ("", "0")


@dataclass
class _Overlap:
    calibration_s: list[float] = field(default_factory=list)
    exposed_s: list[float] = field(default_factory=list)


@dataclass
class _Totals:
    exchanges: int = 0
    bytes: int = 0
    blocked_s: float = 0.0


@dataclass
class _Ran:
    exchanges: Counter = field(default_factory=Counter)  # algorithm -> count
    labels: Counter = field(default_factory=Counter)  # label -> count
    v_first_calls: int = 0
    fallbacks: Counter = field(default_factory=Counter)  # reason -> count
    reverted: Counter = field(default_factory=Counter)  # autotune choice reverted to its reference mid-run -> count
    slow_link_bytes: int = 0
    slow_link_bytes_exact: int = 0
    copied_bytes: int = 0  # local copies made around and inside cocodiff's exchanges
    padded_bytes: int = 0  # zero heads and tokens exchanged so that any count splits (padding.py)
    # V-Major: (step, layer) -> [active tokens, tokens] summed over the layer's calls at that step.
    v_major: dict = field(default_factory=dict)
    v_major_s: float = 0.0  # host time in V-Major's bookkeeping: selection, references, residuals
    v_major_sparse: Counter = field(default_factory=Counter)  # exchange ('v', 'qk', 'qk+v', 'o') -> sparse exchanges
    kernels: Counter = field(default_factory=Counter)  # Triton kernel (V-Major's) -> launches


_totals = _Totals()
_overlap: dict[tuple[str, int], _Overlap] = defaultdict(_Overlap)
_ran = _Ran()


# A compiled graph counts nothing on the host when it runs: what it runs is counted when it is traced
# (:func:`traced`), once per graph, and how often the graph ran it counts itself on the device.
#: Per counting graph (its slot of :data:`_graph_calls`): what one of its runs counts.
_tallies: list[_Ran] = []
#: The graph being traced (:func:`cocodiff_xfuser.compat.traced_graph`; the object, not its id, which
#: a later graph could reuse) and its slot, where it counts.
_tracing: tuple[object, int] | None = None
#: Per counting graph, its runs: a device tensor the graphs update in place (static: CUDA graph
#: trees let them), read where the counts are (:func:`ran`). None until a graph counts.
_graph_calls: torch.Tensor | None = None
#: Counting graphs a process holds at most (a few per transformer, step phase and input shapes).
GRAPH_SLOTS = 256


def traced(name: str, *args: object) -> None:
    """Count ``name(*args)`` (a counting function of this module): in code dynamo traces, each time
    the graph being traced runs (the graph's first count also adds one to its runs, on the device:
    no host work when it runs); called eagerly, once, now. Call it from traced code itself, not
    from a function run at trace time (:func:`compat.trace_time`), where torch before 2.13 does not
    say it is compiling."""
    if torch.compiler.is_dynamo_compiling():  # dynamo reads this as true in the code it traces (one Python call eagerly)
        slot = _record(name, args)
        if slot >= 0:
            _graph_calls[slot].add_(1)
    else:
        globals()[name](*args)


@compat.trace_time
def _record(name: str, args: tuple) -> int:
    """Count ``name(*args)`` in the tally of the graph being traced; its slot where this is the
    graph's first count (the graph then counts its runs), else -1 (and where a graph break left
    this call to run, not traced: counted now)."""
    global _tracing, _graph_calls, _ran
    graph = compat.traced_graph()
    if graph is None:  # run after a graph break, not traced: counted now
        globals()[name](*args)
        return -1
    first = _tracing is None or _tracing[0] is not graph
    if first:
        if _graph_calls is None:
            _graph_calls = torch.zeros(GRAPH_SLOTS, dtype=torch.int64, device=detect().current_device())
            compat.mark_static(_graph_calls)
        if len(_tallies) == GRAPH_SLOTS:
            logging.getLogger("cocodiff_xfuser").warning("cocodiff: more than %d compiled graphs count what they run: "
                                                         "the newest replaces the last one's counts", GRAPH_SLOTS)
            _tallies[-1] = _Ran()
        else:
            _tallies.append(_Ran())
        _tracing = (graph, len(_tallies) - 1)
    total, _ran = _ran, _tallies[_tracing[1]]
    try:
        globals()[name](*args)
    finally:
        _ran = total
    return _tracing[1] if first else -1


def _graph_counts() -> _Ran:
    """What the compiled graphs ran since the last :func:`reset_ran`: each one's counts per run
    times its runs (one read of the device's counters)."""
    counted = _Ran()
    runs = [] if _graph_calls is None else _graph_calls[:len(_tallies)].tolist()
    for tally, n in zip(_tallies, runs):
        for f in fields(_Ran) if n else ():
            counts = getattr(tally, f.name)
            if isinstance(counts, Counter):
                getattr(counted, f.name).update({key: value * n for key, value in counts.items()})
            elif isinstance(counts, dict):  # V-Major's rows: (step or phase, layer) -> [active, tokens]
                for key, (active, tokens) in counts.items():
                    total = counted.v_major.setdefault(key, [0, 0])
                    total[0], total[1] = total[0] + active * n, total[1] + tokens * n
            else:
                setattr(counted, f.name, getattr(counted, f.name) + counts * n)
    return counted


def count_exchange(algorithm: str, label: str, slow_link_bytes: int = 0, slow_link_bytes_exact: int = 0, copied_bytes: int = 0) -> None:
    """An exchange, with the bytes its layouts copied (one count, not two: its host time counts)."""
    _ran.copied_bytes += copied_bytes
    _ran.exchanges[algorithm] += 1
    _ran.labels[label] += 1
    _ran.slow_link_bytes += slow_link_bytes
    _ran.slow_link_bytes_exact += slow_link_bytes_exact


def count_copy(nbytes: int) -> None:
    _ran.copied_bytes += nbytes


def count_padding(nbytes: int) -> None:
    _ran.padded_bytes += nbytes


def count_revert(choice: str) -> None:
    _ran.reverted[choice] += 1


def count_v_first_call() -> None:
    _ran.v_first_calls += 1


def count_fallback(reason: str, calls: int = 1) -> None:
    _ran.fallbacks[reason] += calls


def count_v_major_time(seconds: float) -> None:
    _ran.v_major_s += seconds


def count_v_major_sparse(name: str) -> None:
    """A sparse exchange of a layer's ``name`` ('v', 'qk' or 'o': which of them follow V's decision;
    'qk+v': V riding with Q/K)."""
    _ran.v_major_sparse[name] += 1


def count_kernel(name: str) -> None:
    """A launch of V-Major's Triton kernels ``name`` (where they run in place of the torch reference)."""
    _ran.kernels[name] += 1


def count_v_major(step: int | str, layer: int, active: int, tokens: int) -> None:
    """V-Major's rows sent over slow links at ``step`` (or, counted where a graph is traced, its phase)."""
    counts = _ran.v_major.setdefault((step, layer), [0, 0])
    counts[0] += active
    counts[1] += tokens


def ran() -> dict:
    """This rank's counts since the last :func:`reset_ran`: ``exchanges`` (per algorithm), ``labels``,
    ``v_first_calls``, ``fallbacks`` (per reason), ``reverted`` (autotune choices the run-time
    re-check found slower than their reference, the fair flat exchange, per choice; the reference
    ran afterwards), ``slow_link_bytes`` and ``slow_link_bytes_exact``, ``copied_bytes`` (local
    copies around and inside the exchanges: layout changes, re-blocking), ``padded_bytes`` (zero
    heads and tokens sent so that counts not divisible by the degree split), ``v_major``: the tokens
    V-Major sent over slow links, ``active``, of ``tokens``, in total, per step and per layer,
    ``v_major_sparse``: its sparse exchanges per exchange of a layer ('v', 'qk', 'o'; 'qk+v' where V
    rode with Q/K), ``kernels``: launches of V-Major's Triton kernels by name, and
    ``v_major_s``: the host time of V-Major's bookkeeping (selection, references, residuals; on a
    GPU the time to queue that work, which the device runs asynchronously)."""
    if not _tallies:  # no compiled graph counts: no device counters to read
        return _report(_ran)
    return sum_ran([_report(_ran), _report(_graph_counts())])


def _report(counts: _Ran) -> dict:
    return {
        "exchanges": dict(counts.exchanges),
        "labels": dict(counts.labels),
        "v_first_calls": counts.v_first_calls,
        "fallbacks": dict(counts.fallbacks),
        "reverted": dict(counts.reverted),
        "slow_link_bytes": counts.slow_link_bytes,
        "slow_link_bytes_exact": counts.slow_link_bytes_exact,
        "copied_bytes": counts.copied_bytes,
        "padded_bytes": counts.padded_bytes,
        "v_major": _v_major_report(counts.v_major),
        "v_major_s": counts.v_major_s,
        "v_major_sparse": dict(counts.v_major_sparse),
        "kernels": dict(counts.kernels),
    }


def _v_major_report(counts: dict) -> dict:
    def share(items) -> dict:
        active, tokens = (sum(c[i] for c in items) for i in (0, 1))
        return {"active": active, "tokens": tokens}

    steps = sorted({s for s, _ in counts}, key=lambda s: (isinstance(s, str), s))  # steps, then phases (V-Major's graph path)
    layers = sorted({layer for _, layer in counts})
    return {
        **share(counts.values()),
        "per_step": {str(s): share([c for (t, _), c in counts.items() if t == s]) for s in steps},
        "per_layer": {str(l): share([c for (_, m), c in counts.items() if m == l]) for l in layers},
    }


def sum_ran(reports: list[dict]) -> dict:
    """The :func:`ran` reports of several ranks, summed."""
    numbers = ("v_first_calls", "slow_link_bytes", "slow_link_bytes_exact", "copied_bytes", "padded_bytes", "v_major_s")
    counters = ("exchanges", "labels", "fallbacks", "reverted", "v_major_sparse", "kernels")
    total = {**{key: Counter() for key in counters}, **dict.fromkeys(numbers, 0)}
    for report in reports:
        for key in counters:
            total[key].update(report.get(key, {}))
        for key in numbers:
            total[key] += report.get(key, 0)
    summed = {key: dict(value) if isinstance(value, Counter) else value for key, value in total.items()}
    summed["v_major"] = _sum_shares([r["v_major"] for r in reports if "v_major" in r])
    return summed


def _sum_shares(reports: list[dict]) -> dict:
    """V-Major reports of several ranks, summed (the same nesting of active/tokens counts)."""
    total: dict = {}
    for report in reports:
        for key, value in report.items():
            if isinstance(value, dict):
                total[key] = _sum_shares([total.get(key, {}), value])
            else:
                total[key] = total.get(key, 0) + value
    return total


def reset_ran() -> None:
    global _ran
    _ran = _Ran()
    if _graph_calls is not None:
        _graph_calls.zero_()


def enabled() -> bool:
    return timings_on


def enable() -> None:
    """Turn the timings on in this process, as ``COCODIFF_COMM_STATS=1`` does at start-up."""
    global timings_on
    timings_on = True


def timed_exchange(exchange: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``exchange(x)``, blocking; with statistics on, its bytes and the time it blocked are recorded."""
    if not timings_on:
        return exchange(x)
    # Synchronized at both ends (as comm.timing's samples are; imported there, timing would import the
    # transport, which counts here): the device's time on GPUs, not the host's launch time.
    detect().synchronize(x.device)
    started = time.perf_counter()
    out = exchange(x)
    detect().synchronize(x.device)
    record_exchange(x.numel() * x.element_size(), time.perf_counter() - started)
    return out


def record_exchange(nbytes: int, blocked_s: float) -> None:
    _totals.exchanges += 1
    _totals.bytes += nbytes
    _totals.blocked_s += blocked_s


def calibrating(label: str, nbytes: int) -> bool:
    """True while this (label, size) still needs exchanges waited for at once, to measure their time."""
    return timings_on and len(_overlap[(label, nbytes)].calibration_s) < CALIBRATION_CALLS


def record_async(label: str, nbytes: int, started: float, waited: float, finished: float, calibration: bool) -> None:
    """An asynchronous exchange: started, waited for, finished (``perf_counter`` seconds)."""
    if not timings_on:
        return
    stats = _overlap[(label, nbytes)]
    if calibration:
        stats.calibration_s.append(finished - started)
        record_exchange(nbytes, finished - started)
    else:
        stats.exposed_s.append(finished - waited)
        record_exchange(nbytes, finished - waited)


def report() -> dict:
    """Totals, and per (label, bytes) V-First overlap: exchange time, exposed time, hidden share (medians)."""
    overlap = []
    for (label, nbytes), stats in sorted(_overlap.items()):
        if not stats.calibration_s or not stats.exposed_s:
            continue
        exchange = statistics.median(stats.calibration_s)
        exposed = statistics.median(stats.exposed_s)
        overlap.append(
            {
                "label": label,
                "bytes": nbytes,
                "calls": len(stats.exposed_s),
                "exchange_s": exchange,
                "exposed_s": exposed,
                "hidden_share": max(0.0, 1.0 - exposed / exchange) if exchange > 0 else 0.0,
            }
        )
    return {"exchanges": _totals.exchanges, "bytes": _totals.bytes, "blocked_s": _totals.blocked_s, "overlap": overlap}


def reset() -> None:
    """Zero the totals and the exposed times; calibrations survive."""
    _totals.exchanges, _totals.bytes, _totals.blocked_s = 0, 0, 0.0
    for stats in _overlap.values():
        stats.exposed_s.clear()
