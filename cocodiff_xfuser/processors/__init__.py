"""cocodiff attention processors (V-First), one module per model family, and their installation.

``install`` swaps xfuser's processor of each attention module for ours where a family module
provides one; other processors stay stock, which is always correct because every exchange
still goes through the backend.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("cocodiff_xfuser")



def replacements() -> dict[str, type]:
    """xfuser processor class name -> our V-First processor class."""
    from cocodiff_xfuser.processors import flux

    return {"xFuserFluxAttnProcessor": flux.FluxVFirstProcessor}


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
