"""Import hook that lets :mod:`cocodiff_xfuser.xfuser.hooks` patch xfuser modules as they load.

Installed from ``cocodiff_xfuser.pth`` in every interpreter, so it must stay cheap and inert:
it imports nothing heavy and does nothing until a module of the ``xfuser`` package is imported.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

DISABLE_ENV = "COCODIFF_XFUSER_DISABLE"


class _Loader(importlib.abc.Loader):
    """Wraps a module's real loader so hooks run before and after the module body executes."""

    def __init__(self, inner, before, after) -> None:
        self._inner, self._before, self._after = inner, before, after

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._before(module)
        try:
            self._inner.exec_module(module)
        except BaseException:
            self._after(module, False)
            raise
        self._after(module, True)

    def __getattr__(self, name):  # get_code, get_source, ... for runpy and inspect
        return getattr(self._inner, name)


class XfuserFinder(importlib.abc.MetaPathFinder):
    """Finds ``xfuser.*`` modules with the finders after itself and wraps the hooked ones."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "xfuser" and not fullname.startswith("xfuser."):
            return None
        from cocodiff_xfuser.xfuser import hooks

        if not hooks.is_hooked(fullname):
            return None
        # Delegating to every finder (itself included) would recurse forever.
        later = sys.meta_path[sys.meta_path.index(self) + 1 :]
        for finder in later:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, hooks.before_exec, hooks.after_exec)
                return spec
        return None


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent; ``COCODIFF_XFUSER_DISABLE=1`` skips it)."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return
    if not any(isinstance(f, XfuserFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, XfuserFinder())
