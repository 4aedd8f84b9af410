"""Faults end the job: every exchange is bounded in time, and a failed one ends its rank with one line.

Without a bound, a rank that stalls (a stopped process, a lost link) leaves its peers waiting in
a collective for the process group's default timeout (30 minutes for gloo) or for ever. The
cocodiff groups get ``--cocodiff-timeout`` seconds (``COCODIFF_TIMEOUT``; default
:data:`DEFAULT_TIMEOUT_S`); when an exchange times out or a peer dies, the rank prints one line
that names itself, the exchange (layer label, phase, sub-group) and the timeout, and exits with
:data:`EXIT_CODE`, which makes the launcher (torchrun, mpiexec) end the other ranks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from datetime import timedelta
from typing import Iterator, NoReturn

TIMEOUT_ENV = "COCODIFF_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
EXIT_CODE = 3


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


_timeout = timedelta(seconds=DEFAULT_TIMEOUT_S)


def set_timeout(timeout_s: float) -> None:
    """Bound every wait of cocodiff's exchanges and every sub-group cocodiff creates from now on.
    (xfuser's own groups, the excepthook and SIGTERM are process-wide policy, set by
    :mod:`cocodiff_xfuser.xfuser.fault_policy`.)"""
    global _timeout
    _timeout = timedelta(seconds=timeout_s)


_inside: tuple[str, str] | None = None  # (label, where) of the exchange this rank waits in


@contextlib.contextmanager
def inside(label: str, where: str) -> Iterator[None]:
    """Mark the exchange this rank waits in, for the line a SIGTERM prints."""
    global _inside
    outer, _inside = _inside, (label, where)
    try:
        yield
    finally:
        _inside = outer  # nested: a measurement completes the exchanges still in flight first


def waiting_in() -> tuple[str, str] | None:
    """(label, where) of the exchange this rank waits in; None between exchanges."""
    return _inside


def timeout() -> timedelta:
    """The bound on every wait (``work.wait(timeout())``) and on the sub-groups cocodiff creates."""
    return _timeout


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def failed(where: str, error: BaseException) -> ExchangeFailed:
    """``error`` (the backend's) as an :class:`ExchangeFailed` that says ``where`` it happened."""
    return ExchangeFailed(f"{where}: {_first_line(error)}")


def abort(rank: int, label: str, where: str, timeout_s: float, error: BaseException) -> NoReturn:
    """End this rank: one line naming it, the exchange (``label``, ``where``: algorithm and group,
    and the phase and sub-group the error names) and the timeout; then exit with :data:`EXIT_CODE`."""
    line = (
        f"cocodiff: rank {rank}: exchange '{label}' ({where}) did not complete: {_first_line(error)}; "
        f"timeout {timeout_s:g} s (--cocodiff-timeout / ${TIMEOUT_ENV}); ending the job"
    )
    print(line, file=sys.stderr, flush=True)
    logging.shutdown()
    # A normal exit would run destructors that wait on the failed collectives again.
    os._exit(EXIT_CODE)
