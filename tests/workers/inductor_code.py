"""What the code inductor generated for a compiled model runs, read from its source: the order of a
V-First layer's work around its exchanges (the workers' compiled cases)."""

from __future__ import annotations

import re
from typing import Iterable

_MATMUL = re.compile(r"\b(?:addmm|mm|bmm|_linear_pointwise|linear)\(")
_START, _INPUTS = "cocodiff.v_first_start.default(", "cocodiff.v_first_inputs.default("


def projections_in_flight(sources: Iterable[str]) -> set[tuple[str, int]]:
    """Per V-First layer call in the generated ``sources``: its V exchange's label and the matrix
    products it runs between the start of V's exchange and Q/K's exchange (where Q and K are
    projected while V's exchange is in flight)."""
    return {(re.search(r"'([^']+)'", part).group(1), len(_MATMUL.findall(part.split(_INPUTS)[0])))
            for source in sources for part in source.split(_START)[1:]}
