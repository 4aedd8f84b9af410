"""The tooling around the plugin: benchmarks, the emulated fabric, tiny models, verify, demo,
launchers and the ``cocodiff`` command. Nothing here runs inside a user's xDiT job, and the
plugin never imports it. Importing this package is torch-free (``emulate_cluster.sh`` runs
``tools.fabric`` with any python3)."""

from __future__ import annotations


def same_bits(a, b) -> bool:
    """Whether two tensors hold the same bytes in the same dtype and shape (NaNs and signed zeros included)."""
    import torch

    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
    )
