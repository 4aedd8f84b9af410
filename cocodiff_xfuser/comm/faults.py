"""Faults are bounded and named: every exchange waits at most the timeout, and a failed one is one line.

Without a bound, a rank that stalls (a stopped process, a lost link) leaves its peers waiting in
a collective for the process group's default timeout (30 minutes for gloo) or for ever. The
cocodiff groups get ``--cocodiff-timeout`` seconds (``COCODIFF_TIMEOUT``; default
:data:`DEFAULT_TIMEOUT_S`); when an exchange times out or a peer dies, :func:`failed_exchange`
makes the one line that names the rank, the exchange (layer label, phase, sub-group) and the
timeout, and hands it to the process's fault handler. What a failure does to the process is not
this module's to decide: by default the line is raised (:class:`ExchangeFailed`); a job run with
``--sp-backend cocodiff`` installs a handler that ends the rank
(:mod:`cocodiff_xfuser.xfuser.fault_policy`).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Callable, NoReturn

TIMEOUT_ENV = "COCODIFF_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0


class ExchangeFailed(RuntimeError):
    """An exchange did not complete: its phase and sub-group, and the backend's own error."""


def default_timeout_s() -> float:
    """``$COCODIFF_TIMEOUT`` seconds, else :data:`DEFAULT_TIMEOUT_S`."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: expected seconds") from None
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: expected a positive number of seconds")
    return value


def _raise(line: str) -> NoReturn:
    raise ExchangeFailed(line)


class _Policy:
    """What this process does about a failed exchange: the bound on every wait, and the handler of
    its one line (set once per job: :func:`set_timeout`, :func:`set_handler`)."""

    timeout = timedelta(seconds=DEFAULT_TIMEOUT_S)
    handler: Callable[[str], NoReturn] = staticmethod(_raise)


_policy = _Policy()


def set_timeout(timeout_s: float) -> None:
    """Bound every wait of cocodiff's exchanges and every sub-group cocodiff creates from now on.
    (xfuser's own groups, the excepthook and SIGTERM are process-wide policy, set by
    :mod:`cocodiff_xfuser.xfuser.fault_policy`.)"""
    _policy.timeout = timedelta(seconds=timeout_s)


# (label, where) of the exchanges this rank is inside, innermost last: nested where a measurement
# completes the exchanges still in flight first.
_inside: list[tuple[str, str]] = []


class inside:
    """Mark the exchange this rank waits in, for the line a SIGTERM prints (a plain class: entered
    on every step of every exchange, where a generator-based context manager costs microseconds)."""

    __slots__ = ("_mark",)

    def __init__(self, label: str, where: str) -> None:
        self._mark = (label, where)

    def __enter__(self) -> None:
        _inside.append(self._mark)

    def __exit__(self, *exc: object) -> None:
        _inside.pop()


def waiting_in() -> tuple[str, str] | None:
    """(label, where) of the exchange this rank waits in; None between exchanges."""
    return _inside[-1] if _inside else None


def timeout() -> timedelta:
    """The bound on every wait (``work.wait(timeout())``) and on the sub-groups cocodiff creates."""
    return _policy.timeout


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def failed(where: str, error: BaseException) -> ExchangeFailed:
    """``error`` (the backend's) as an :class:`ExchangeFailed` that says ``where`` it happened."""
    return ExchangeFailed(f"{where}: {_first_line(error)}")


def set_handler(handler: Callable[[str], NoReturn]) -> None:
    """What a failed exchange does with its one line (the process's fault policy; default: raise it)."""
    _policy.handler = handler


def failed_exchange(rank: int, label: str, where: str, timeout_s: float, error: BaseException) -> NoReturn:
    """A failed exchange: one line naming the rank, the exchange (``label``, ``where``: algorithm
    and group, and the phase and sub-group the error names) and the timeout, to the fault handler."""
    _policy.handler(
        f"cocodiff: rank {rank}: exchange '{label}' ({where}) did not complete: {_first_line(error)}; "
        f"timeout {timeout_s:g} s (--cocodiff-timeout / ${TIMEOUT_ENV}); ending the job"
    )
