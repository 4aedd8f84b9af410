"""cocodiff attention processors (V-First), one module per model family, and their installation.

``install`` swaps xfuser's processor of each attention module for ours where a family module
provides one; other processors stay stock, which is always correct because every exchange
still goes through the backend.
"""

from __future__ import annotations

import logging
import sys

import torch

logger = logging.getLogger("cocodiff_xfuser")



def replacements() -> dict[str, type]:
    """xfuser processor class name -> our V-First processor class."""
    from cocodiff_xfuser.processors import flux

    return {"xFuserFluxAttnProcessor": flux.FluxVFirstProcessor}


# xfuser processors whose Ulysses exchange goes through yunchang's SeqAllToAll4D instead of USP,
# where the cocodiff backend cannot route it.
BYPASS_USP = frozenset({"xFuserSanaLinearAttnProcessor2_0"})


def _processors(transformer: torch.nn.Module) -> list:
    return [m.processor for m in transformer.modules() if getattr(m, "processor", None) is not None]


def unsupported_reason(transformer: torch.nn.Module) -> str | None:
    """Why the cocodiff backend cannot carry this model's exchanges (None: it can)."""
    found = _processors(transformer)
    bypass = sorted({type(p).__name__ for p in found} & BYPASS_USP)
    if bypass:
        return f"{type(transformer).__name__} exchanges through yunchang's SeqAllToAll4D ({', '.join(bypass)}), not USP"
    # A processor that calls USP lives in a module that imported it.
    if not any(getattr(sys.modules.get(type(p).__module__), "USP", None) is not None for p in found):
        return f"no attention processor of {type(transformer).__name__} exchanges through xfuser's USP"
    return None


def install(transformer: torch.nn.Module) -> int:
    """Swap processors in ``transformer``; returns how many were replaced."""
    table = replacements()
    swapped = 0
    kept: set[str] = set()
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if processor is None:
            continue
        name = type(processor).__name__
        if isinstance(processor, tuple(table.values())):
            continue  # installed by an earlier load hook of the same model
        replacement = table.get(name)
        if replacement is None:
            kept.add(name)
            continue
        module.processor = replacement()
        swapped += 1
    logger.info("cocodiff: V-First processors installed in %d attention modules", swapped)
    if kept:
        logger.warning("cocodiff: no V-First processor for %s; stock processor kept", ", ".join(sorted(kept)))
    return swapped
