"""A user's mistake, found alike on every rank, ended in one line: a leaf, so that any module can
report one without importing the xfuser wiring."""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def user_error(message: str) -> NoReturn:
    """One line from rank 0, then every rank exits with 2."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message if message.startswith("cocodiff") else f"cocodiff: {message}", file=sys.stderr, flush=True)
    # No tracebacks, and no clean-up that could wait on ranks that already left.
    os._exit(2)
