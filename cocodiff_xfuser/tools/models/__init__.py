"""Models for tests and benchmarks, registered in xfuser's runner as ``cocodiff/<name>``.

:func:`register` is the ``cocodiff_xfuser.models`` entry point: the plugin calls it the first
time xfuser's runner looks up a model name it does not know.
"""

from __future__ import annotations

from cocodiff_xfuser.tools.models import tiny


def register(base_model) -> None:
    """Add every model of this package to xfuser's runner registry (``base_model`` is that module)."""
    tiny.register(base_model)
