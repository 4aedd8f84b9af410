"""The process-wide fault policy of a job run with ``--sp-backend cocodiff``.

cocodiff's own exchanges are bounded and name a failure in one line (:mod:`cocodiff_xfuser.comm.faults`);
here that line ends the rank: printed, then exit status :data:`EXIT_CODE`, which makes the launcher
(torchrun, mpiexec) end the other ranks. A rank stalled outside them must not leave its peers
waiting for gloo's 30 minutes either, so at activation the job's process gets, once:

* the handlers of failed exchanges (:func:`end_rank`) and of a user's mistake found while the
  job runs (:func:`end_job`);

* every existing process group (xfuser's: its barriers, its per-step gathers of the output) bounded
  by ``--cocodiff-timeout``;
* an excepthook: a collective of xfuser's own that failed (a peer died or timed out while this rank
  waited outside cocodiff's exchanges) ends the rank with the same one line;
* a SIGTERM handler: the launcher's SIGTERM after another rank failed ends this one with that line,
  naming the exchange it waited in.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from datetime import timedelta
from typing import NoReturn

import torch.distributed as dist

from cocodiff_xfuser import compat, errors
from cocodiff_xfuser.comm import faults

_C10D = "torch.distributed.distributed_c10d"
EXIT_CODE = 3


def end_rank(line: str) -> NoReturn:
    """Print ``line`` and end this rank with :data:`EXIT_CODE`."""
    print(line, file=sys.stderr, flush=True)
    logging.shutdown()
    # A normal exit would run destructors that wait on the failed collectives again.
    os._exit(EXIT_CODE)


def end_job(message: str) -> NoReturn:
    """A user's mistake, found alike on every rank: one line from rank 0, then every rank exits with 2."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(errors.as_line(message), file=sys.stderr, flush=True)
    # No tracebacks, and no clean-up that could wait on ranks that already left.
    os._exit(2)


def install(timeout_s: float) -> None:
    """Bound this process's groups by ``timeout_s`` and end it with one line on failures."""
    faults.set_handler(end_rank)
    errors.set_handler(end_job)
    # torch has no public setter for existing groups; groups cocodiff creates later get the
    # timeout at creation (``dist.new_group(timeout=faults.timeout())``).
    set_pg_timeout = compat.torch_private(_C10D, "_set_pg_timeout")
    for pg in list(compat.torch_private(_C10D, "_world").pg_map):
        set_pg_timeout(timedelta(seconds=timeout_s), pg)
    if not getattr(sys.excepthook, "_cocodiff", False):
        sys.excepthook = _ending_on_collective_failures(sys.excepthook, timeout_s)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: faults.failed_exchange(
            dist.get_rank(), *(faults.waiting_in() or ("-", "between exchanges")), timeout_s,
            faults.ExchangeFailed("the launcher ended this rank (SIGTERM), another rank having failed"),
        ))


def _ending_on_collective_failures(previous, timeout_s: float):
    def hook(kind, error, tb):
        text = str(error).lower()
        # A compiler's error names what it traced (c10d's functions, process groups) but failed no exchange.
        compiler = kind.__module__.startswith(("torch._dynamo", "torch._inductor"))
        if issubclass(kind, RuntimeError) and not compiler and any(word in text for word in ("gloo", "nccl", "ccl", "c10d", "processgroup")):
            faults.failed_exchange(dist.get_rank() if dist.is_initialized() else -1, "xfuser",
                                   "one of xfuser's own collectives", timeout_s, error)
        previous(kind, error, tb)

    hook._cocodiff = True  # type: ignore[attr-defined]
    return hook
