"""What the code inductor generated for a compiled model runs, read from its source: the order of a
layer's work around its exchanges, and what a graph must not hold (the workers' and the compiled
jobs' cases)."""

from __future__ import annotations

import re
from typing import Iterable

_MATMUL = re.compile(r"\b(?:addmm|mm|bmm|_linear_pointwise|linear)\(")
_A2A = re.compile(r"^\s*(\w+) = torch\.ops\._c10d_functional\.all_to_all_single\.default\(")
#: What runs host code when a graph runs: cocodiff's opaque operators, host reads of device values.
_HOST = re.compile(r"torch\.ops\.cocodiff\.|_local_scalar_dense|\.item\(\)|\.tolist\(\)")


def exchanges_in_flight(sources: Iterable[str]) -> list[int]:
    """Per all-to-all of the generated ``sources``, in the order the graphs issue them: the matrix
    products run between its issue and its wait (the compute that hides it)."""
    counts = []
    for source in sources:
        lines = source.splitlines()
        for i, line in enumerate(lines):
            issued = _A2A.match(line)
            if issued:
                wait = f"wait_tensor.default({issued.group(1)})"
                end = next(j for j in range(i + 1, len(lines)) if wait in lines[j])
                counts.append(sum(len(_MATMUL.findall(x)) for x in lines[i + 1:end]))
    return counts


def host_work(sources: Iterable[str]) -> list[str]:
    """The lines of the generated ``sources`` that run host code of cocodiff's or read a device value."""
    return [line.strip() for source in sources for line in source.splitlines() if _HOST.search(line)]
