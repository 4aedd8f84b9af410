"""Benchmarks, side by side in one run: the all-to-all (``a2a``) and a pipeline end to end (``e2e``)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from pathlib import Path
from typing import Iterator

LOCK = Path(tempfile.gettempdir()) / "cocodiff-bench.lock"


@contextlib.contextmanager
def one_at_a_time() -> Iterator[None]:
    """Hold this machine's benchmark lock; a second benchmark stops at once with a clear error.

    Two benchmarks at once share the cores and the emulated links, so neither measures anything.
    """
    with open(LOCK, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise ValueError(f"another cocodiff benchmark is running ({holder}); run benchmarks one at a time") from None
        f.truncate(0)
        f.write(f"pid {os.getpid()}")
        f.flush()
        try:
            yield
        finally:
            f.truncate(0)
            fcntl.flock(f, fcntl.LOCK_UN)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``--shapes``: ``NODESxLOCAL,...`` (e.g. ``2x2,2x4,4x2``) as (nodes, ranks per node) pairs."""
    shapes = []
    for item in text.split(","):
        try:
            nodes, local = (int(v) for v in item.strip().lower().split("x"))
        except ValueError:
            raise ValueError(f"--shapes: {item!r} is not NODESxLOCAL (e.g. 2x4)") from None
        if nodes < 1 or local < 1:
            raise ValueError(f"--shapes: {item!r} needs at least one node and one rank per node")
        shapes.append((nodes, local))
    return shapes
