"""cocodiff attention processors, one module per model family, and their installation.

``install`` swaps xfuser's processor of each attention module for ours where a family module
provides one (``REPLACEMENTS``: xfuser processor class name -> our class); other processors
stay stock, which is always correct because every exchange still goes through the backend.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("cocodiff_xfuser")

REPLACEMENTS: dict[str, type] = {}


def install(transformer: torch.nn.Module) -> int:
    """Swap processors in ``transformer``; returns how many were replaced."""
    swapped = 0
    kept: set[str] = set()
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if processor is None:
            continue
        name = type(processor).__name__
        replacement = REPLACEMENTS.get(name)
        if replacement is None:
            kept.add(name)
            continue
        module.set_processor(replacement()) if hasattr(module, "set_processor") else setattr(module, "processor", replacement())
        swapped += 1
    if kept:
        logger.info("cocodiff: stock processors kept for %s", ", ".join(sorted(kept)))
    return swapped
