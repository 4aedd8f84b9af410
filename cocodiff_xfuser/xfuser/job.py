"""The running job's exchanger, for xfuser's entry points.

xfuser calls cocodiff's hooks (its routed all-to-all, model loading, the FLUX wrapper's forward,
its runtime checks) with nothing of cocodiff's in hand: they find the job's exchanger here. Below
them it is passed explicitly: the V-First processors are given it when they are installed, and
the exchanges start from it. :mod:`.activation` starts and ends it.
"""

from __future__ import annotations

import atexit
import logging

import torch.distributed as dist

from cocodiff_xfuser.exchanger import Exchanger
from cocodiff_xfuser.settings import Options

logger = logging.getLogger("cocodiff_xfuser")

_EXCHANGER: Exchanger | None = None


def start(group: dist.ProcessGroup, options: Options, ring_group: dist.ProcessGroup | None = None) -> Exchanger:
    """The job's exchanger over the Ulysses ``group`` and, where the ring degree is above 1, the
    ring attention's ``ring_group`` (collective over the world when it is new).

    Starting again with the same groups and options keeps it (its sub-groups and tuned decisions):
    xfuser may rebuild its runtime state several times for one model.
    """
    global _EXCHANGER
    current = _EXCHANGER
    if current is not None and current.group is group and current.ring_group is ring_group and current.options == options:
        return current
    end()
    _EXCHANGER = Exchanger(group, options, ring_group)
    logger.info("cocodiff: %s", _EXCHANGER.describe())
    return _EXCHANGER


def end() -> None:
    """No exchanger from now on (stock Ulysses): processors that hold the last one take the stock path."""
    global _EXCHANGER
    if _EXCHANGER is not None:
        _EXCHANGER.close()
    _EXCHANGER = None


def exchanger() -> Exchanger | None:
    """The job's exchanger; None where xfuser runs stock."""
    return _EXCHANGER


@atexit.register
def _save_decisions() -> None:
    # The live exchanger's decisions, once (one replaced during the run wrote nothing).
    if _EXCHANGER is not None:
        _EXCHANGER.decisions.save()
