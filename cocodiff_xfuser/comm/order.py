"""One program order for collectives and point-to-point batches, and an audit that records it.

The rule: NCCL and XCCL need every rank to submit the operations of every communicator in one
consistent order, or ranks can deadlock, and NCCL matches a pair's messages by issue order (it has
no tags). So every exchange here launches its operations at points of the program that are the
same on every rank (SPMD model code): at ``start``, in ``advance`` and in ``wait``. Nothing is ever
launched because a local operation happened to complete first, on any backend.

The audit (``COCODIFF_ORDER_AUDIT=1``, and on under ``COCODIFF_DEVICE_SEMANTICS=1``) records each
rank's launches as ``(communicator role, operation)``; a distributed test asserts that the
sequences agree across ranks.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

AUDIT_ENV = "COCODIFF_ORDER_AUDIT"
_ON = (AUDIT_ENV, "COCODIFF_DEVICE_SEMANTICS")  # the latter is transport.DEVICE_SEMANTICS_ENV

_launches: list[tuple[str, str]] | None = [] if any(os.environ.get(v, "") not in ("", "0") for v in _ON) else None


def auditing() -> bool:
    return _launches is not None


def launched(group: Any, op: str, role: str | None = None) -> None:
    """Record that this rank launched ``op`` on ``group`` (no-op outside an audit).

    ``role`` names the communicator the same way on every rank (``"level 1 of (2, 2)"``); by
    default the group's size, since a rank only sees the groups it belongs to.
    """
    if _launches is not None:
        size = dist.get_world_size(group if group is not None else dist.group.WORLD)
        _launches.append((role or f"group of {size}", op))


def launches() -> list[tuple[str, str]]:
    """This rank's launches so far (empty outside an audit)."""
    return list(_launches or [])
