"""The all-to-all algorithms, by name: the one place that says which can run, starts it, and times it.

Every algorithm moves the same bytes to the same places (bitwise the output of ``flat``). The
functions behind an entry refuse an input they cannot exchange instead of substituting another
algorithm, so what a counter or a decision says ran is what ran. The autotune
(:mod:`.autotune`), the backend and the benchmarks choose and start algorithms through here.

``flat`` (stock) and ``flat-p2p`` (:mod:`.flat`) run on any group; ``flat-pxn`` (:mod:`.pxn`, the
flat exchange routed as NCCL's PXN routes it on rails) and ``hierarchical`` (TAPA, :mod:`.tapa`)
where the topology gives the group levels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .flat import AllToAllHandle, flat_all_to_all, p2p_all_to_all, p2p_reason, start_flat_all_to_all, start_p2p_all_to_all
from .pxn import PxnAllToAll
from .tapa import HierarchicalAllToAll

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


class Registry:
    """The algorithms available to one process; ``flat-pxn`` and ``hierarchical`` exist where TAPA has plans."""

    def __init__(self, tapa: HierarchicalAllToAll | None = None) -> None:
        self.tapa = tapa
        entries = [
            Algorithm("flat", lambda x, group: None, start_flat_all_to_all, flat_all_to_all),
            Algorithm("flat-p2p", p2p_reason, start_p2p_all_to_all, p2p_all_to_all),
        ]
        if tapa is not None:
            pxn = PxnAllToAll(tapa)
            entries.append(Algorithm("flat-pxn", pxn.reason, pxn.start, pxn))
            entries.append(Algorithm("hierarchical", tapa.reason, tapa.start, tapa))
        self._entries = {a.name: a for a in entries}

    def __getitem__(self, name: str) -> Algorithm:
        if name not in ALGORITHMS:
            raise ValueError(f"unknown all-to-all algorithm {name!r}: expected one of {', '.join(ALGORITHMS)}")
        if name not in self._entries:
            raise ValueError(f"all-to-all algorithm {name!r} needs a topology (no plan of levels)")
        return self._entries[name]

    def reason(self, name: str, x: torch.Tensor, group: Any) -> str | None:
        """Why ``name`` cannot exchange ``x`` over ``group`` (None: it can)."""
        if name not in self._entries:
            return "no topology levels to exchange over" if name in ALGORITHMS else f"unknown algorithm {name!r}"
        return self._entries[name].reason(x, group)

    def eligible(self, x: torch.Tensor, group: Any) -> tuple[str, ...]:
        """The algorithms that can exchange ``x`` over ``group``, simplest first (the same on every rank)."""
        return tuple(name for name in ALGORITHMS if self.reason(name, x, group) is None)
