"""How much of V's exchange V-First hides: optional instrumentation, off by default.

Enable with ``COCODIFF_OVERLAP_STATS=1`` (or :func:`enable`). Per label (layer type) the first
``CALIBRATION_CALLS`` exchanges of each size are waited for at once, which measures the
exchange time ``T`` with nothing to hide it; afterwards each exchange records how long its
``wait`` blocked (the exposed part). Hidden share = ``1 - exposed / T``.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

CALIBRATION_CALLS = 3
_enabled = os.environ.get("COCODIFF_OVERLAP_STATS", "") not in ("", "0")


@dataclass
class _Stats:
    calibration_s: list[float] = field(default_factory=list)
    exposed_s: list[float] = field(default_factory=list)


_stats: dict[tuple[str, int], _Stats] = defaultdict(_Stats)


def enable(on: bool = True) -> None:
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled


def calibrating(label: str, nbytes: int) -> bool:
    """True while this (label, size) still needs blocking exchanges to measure its time."""
    return _enabled and len(_stats[(label, nbytes)].calibration_s) < CALIBRATION_CALLS


def record(label: str, nbytes: int, started: float, waited: float, finished: float, calibration: bool) -> None:
    if not _enabled:
        return
    stats = _stats[(label, nbytes)]
    if calibration:
        stats.calibration_s.append(finished - started)
    else:
        stats.exposed_s.append(finished - waited)


def report() -> list[dict]:
    """Per (label, bytes): exchange time, exposed time, hidden share (medians over calls)."""
    rows = []
    for (label, nbytes), stats in sorted(_stats.items()):
        if not stats.calibration_s or not stats.exposed_s:
            continue
        exchange = statistics.median(stats.calibration_s)
        exposed = statistics.median(stats.exposed_s)
        rows.append(
            {
                "label": label,
                "bytes": nbytes,
                "calls": len(stats.exposed_s),
                "exchange_s": exchange,
                "exposed_s": exposed,
                "hidden_share": max(0.0, 1.0 - exposed / exchange) if exchange > 0 else 0.0,
            }
        )
    return rows


def reset() -> None:
    _stats.clear()


def dumps() -> str:
    return json.dumps(report())
