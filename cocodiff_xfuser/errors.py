"""A user's mistake, found alike on every rank, as one line: a leaf, so that any module can report
one without importing the xfuser wiring. What it does to the process is the process's fault
policy: by default the line is raised (:class:`UserError`); in a job run with ``--sp-backend
cocodiff`` every rank ends with exit status 2 (:mod:`cocodiff_xfuser.xfuser.fault_policy`)."""

from __future__ import annotations

from typing import Callable, NoReturn


class UserError(ValueError):
    """A user's mistake, in one line that starts with ``cocodiff:``."""


def _raise(line: str) -> NoReturn:
    raise UserError(line)


_handler: Callable[[str], NoReturn] = _raise


def set_handler(handler: Callable[[str], NoReturn]) -> None:
    """What a user's mistake does with its one line (the process's fault policy; default: raise it)."""
    global _handler
    _handler = handler


def as_line(message: str) -> str:
    """``message`` as the one line a user reads: it says it is cocodiff's."""
    return message if message.startswith("cocodiff") else f"cocodiff: {message}"


def user_error(message: str) -> NoReturn:
    """The mistake ``message`` as one line, to the handler."""
    _handler(as_line(message))
