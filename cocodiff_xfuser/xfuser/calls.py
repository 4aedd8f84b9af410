"""Each pipeline call in its own context: V-Major's state opens at the pipeline's entry and is
dropped when the call returns.

xDiT serves one request after another from one process (its HTTP service, ComfyUI-xDiT, the
runner's repeated iterations): a request must give the image a fresh process gives. A pipeline
is called as ``pipe(...)``, whether it is an ``xFuser*Pipeline`` wrapper or the diffusers pipeline
the runner holds, so the class's ``__call__`` is the entry of every call. Bound to the V-Major clocks
of its transformers (:func:`bind`), a pipeline opens a :class:`~cocodiff_xfuser.vmajor.clock.Call` on
each at entry and closes it on the way out, returned or raised: steps count from the call's first
transformer call, and the caches, budget and agreements of one call never reach the next.
Pipelines bound to nothing, and calls nested in a bound call (a wrapper calling its diffusers
pipeline), pass through.
"""

from __future__ import annotations

import weakref
from typing import Any

from cocodiff_xfuser import compat
from cocodiff_xfuser.vmajor.clock import Clock

# pipeline -> the V-Major clocks of its transformers
_clocks: weakref.WeakKeyDictionary[Any, list[Clock]] = weakref.WeakKeyDictionary()


def bind(pipe: Any, clocks: list[Clock]) -> None:
    """Open a call on ``clocks`` whenever ``pipe`` is called (its class's ``__call__`` wrapped once)."""
    if not clocks:
        return
    _clocks[pipe] = clocks
    compat.wrap(type(pipe), "__call__", _in_context)


def _in_context(original):
    def __call__(self, *args, **kwargs):
        clocks = _clocks.get(self)
        if not clocks or any(clock.current is not None for clock in clocks):
            return original(self, *args, **kwargs)
        scheduler = getattr(self, "scheduler", None)
        for clock in clocks:
            clock.open(scheduler)
        try:
            return original(self, *args, **kwargs)
        finally:
            for clock in clocks:
                clock.close()

    return __call__
