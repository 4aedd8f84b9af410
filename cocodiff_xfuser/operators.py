"""cocodiff's operators: how its exchanges enter a compiled graph without breaking it.

Each is an opaque operator of the ``cocodiff`` namespace that runs the exchange's host code when the
graph runs, with a fake that gives its outputs' shapes when the graph is traced. They are defined
through torch.library's registration API rather than ``torch.library.custom_op``, whose Python
wrapper (an autograd layer and aliasing checks around every call) costs several times the operator's
own dispatch per call (docs/benchmarks.md, "Host time"): host time that every compiled layer would
carry. The operators serve inference only (no autograd formula, as before) and their kernels return
fresh tensors that alias neither their inputs nor each other, which the wrapper checked.
"""

from __future__ import annotations

from typing import Callable

import torch

_LIBRARY = torch.library.Library("cocodiff", "FRAGMENT")
# The operators run host code and collectives, which a CUDA graph's replay would skip.
_TAGS = (torch.Tag.cudagraph_unsafe,)


def define(name: str, kernel: Callable, fake: Callable, mutates: tuple[str, ...] = ()) -> None:
    """``torch.ops.cocodiff.<name>``: ``kernel`` when a graph runs, ``fake`` when one is traced (the
    schema from ``kernel``'s annotations, as ``custom_op`` infers it; ``mutates``: the arguments it
    declares written)."""
    _LIBRARY.define(name + torch.library.infer_schema(kernel, mutates_args=mutates), tags=_TAGS)
    _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"cocodiff::{name}", fake, lib=_LIBRARY)
