"""One program order for collectives, and an audit that records it.

The rule: NCCL and XCCL need every rank to submit the operations of every communicator in one
consistent order, or ranks can deadlock. So every exchange here launches its operations at
points of the program that are the same on every rank (SPMD model code): at ``start``, in
``wait``, and in a TAPA handle's ``wait`` also the pending phases of the handles of the same
group started before it, in start order. Nothing is launched because a local operation happened
to complete first, with one exception: on gloo (CPU) a TAPA handle's ``progress`` (and a two-phase
V-Major handle's, :mod:`.sparse`) launches its next phase once the previous one completed locally, which gloo tolerates (its collectives match
by order within one communicator, and a pair of ranks never waits on a third) and which keeps
V-First's slow phases moving on the emulated clusters.

The audit (``COCODIFF_ORDER_AUDIT=1``) records each rank's launches as ``(communicator role,
operation)`` and turns the gloo exception off, so that the program order itself is what the
recording shows; a distributed test asserts that the sequences agree across ranks.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

AUDIT_ENV = "COCODIFF_ORDER_AUDIT"

_launches: list[tuple[str, str]] | None = [] if os.environ.get(AUDIT_ENV, "") not in ("", "0") else None


def auditing() -> bool:
    return _launches is not None


def completion_driven(backend: str) -> bool:
    """Whether a phase may launch when the previous one completed locally (gloo, outside an audit)."""
    return backend == "gloo" and _launches is None


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
