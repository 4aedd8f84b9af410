"""Timing across ranks: synchronized samples, the slowest rank's, paired ratios and their bound.

One way to time, for the autotune, V-Major auto's speed check, the benchmarks and the statistics:

* a sample runs between two device synchronizations (:func:`now`), so it is the device's time on
  GPUs too, not the host's launch time;
* a collective takes as long as its slowest rank, so samples are reduced with MAX over the group
  (:func:`slowest`: one all-reduce for a whole series, never one per sample), which also gives
  every rank the same numbers, and so the same decision;
* candidates are compared pair by pair (:func:`paired`: adjacent in time, the order rotating and
  alternating, so drifts and background bursts hit both alike), and a median of paired ratios is
  trusted only through its distribution-free upper bound (:func:`median_upper_bound`).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ..platform import detect
from . import transport


def now(device: torch.device) -> float:
    """``perf_counter`` seconds once the work queued on ``device`` has completed."""
    detect().synchronize(device)
    return time.perf_counter()


def elapsed(fn: Callable[[], Any], device: torch.device, burst: int = 1) -> float:
    """Seconds per call of ``burst`` back-to-back calls of ``fn``, the device synchronized at both ends."""
    started = now(device)
    for _ in range(burst):
        fn()
    return (now(device) - started) / burst


def slowest(samples: Sequence[float], group: Any, device: torch.device) -> list[float]:
    """Each of ``samples`` (seconds on this rank) as the slowest rank of ``group`` measured it
    (collective: one all-reduce, on ``device``, as NCCL and XCCL need device tensors)."""
    times = torch.tensor(list(samples), dtype=torch.float64, device=device)
    transport.launched(group, "all_reduce")
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return times.tolist()


def paired(
    ops: Mapping[str, Callable[[], Any]],
    group: Any,
    device: torch.device,
    reps: int,
    burst: int = 1,
    warmup: int = 1,
) -> dict[str, list[float]]:
    """Seconds per call of each op, one sample per op and repetition, the slowest rank's
    (collective over ``group``).

    Each repetition runs every op once (rotating and alternating the order, so that each op
    follows each other op and adjacent samples pair up); a sample is barrier -> :func:`elapsed`
    of ``burst`` calls. Warm-up repetitions are dropped.
    """
    names = list(ops)
    local: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(warmup + reps):
        k = rep % len(names)
        rotated = names[k:] + names[:k]
        for name in rotated if rep % 2 else rotated[::-1]:
            transport.launched(group, "barrier")
            dist.barrier(group=group)
            seconds = elapsed(ops[name], device, burst)
            if rep >= warmup:
                local[name].append(seconds)
    flat = slowest([t for name in names for t in local[name]], group, device)
    return {name: flat[i * reps:(i + 1) * reps] for i, name in enumerate(names)}


def paired_ratios(times: Mapping[str, Sequence[float]], reference: str) -> dict[str, list[float]]:
    """Per candidate other than ``reference``: its time / the reference's, repetition by repetition."""
    ref = times[reference]
    return {name: [t / r for t, r in zip(ts, ref)] for name, ts in times.items() if name != reference}


def median_upper_bound(ratios: Sequence[float], confidence: float = 0.95) -> float:
    """One-sided upper confidence bound of the median of ``ratios`` (distribution-free).

    The k-th smallest of n samples exceeds the true median with probability P(Bin(n, 1/2) <= k-1);
    this returns the smallest order statistic for which that reaches ``confidence`` (the maximum
    when n is too small for any other)."""
    xs = sorted(ratios)
    n = len(xs)
    cdf = 0.0
    for k in range(1, n + 1):
        cdf += math.comb(n, k - 1) / 2**n
        if cdf >= confidence:
            return xs[k - 1]
    return xs[-1]
