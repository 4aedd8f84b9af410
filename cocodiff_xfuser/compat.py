"""The one way cocodiff reaches into xfuser and into torch's private names: the tested versions,
checked patch targets, private names.

Every patch of xfuser goes through :func:`target` / :func:`wrap`, which fail with one clear
:class:`IncompatibleXfuser` line when a target is missing, and every private (underscore) name
that cocodiff reads at run time is listed in :data:`PRIVATE_NAMES` and read with
:func:`private`; torch's private names likewise in :data:`TORCH_PRIVATE_NAMES`, read with
:func:`torch_private` (:class:`IncompatibleTorch`). :func:`missing` checks both lists against
what is installed. A leaf: it imports nothing of cocodiff, so every layer may use it.
"""

from __future__ import annotations

import enum
import functools
import importlib
import importlib.metadata
import sys
from typing import Any, Callable

TESTED_XFUSER_VERSION = "0.7.0"
TESTED_TORCH_VERSION = "2.13.0"

#: xfuser's Ulysses module.
USP = "xfuser.model_executor.layers.usp"
#: torch's ring attention, which xfuser's ``ring_attn`` runs (``_templated_ring_attention``).
RING_ATTENTION = "torch.distributed.tensor.experimental._context_parallel._attention"
_TRANSFORMERS = "xfuser.model_executor.models.transformers"

#: Private xfuser names read by cocodiff at run time, as (module, name).
PRIVATE_NAMES: tuple[tuple[str, str], ...] = (
    (USP, "_concat_joint_tensor"),
    (USP, "_preprocess_joint_tensors"),
    (USP, "_trim_trailing_kv_padding"),
    (USP, "_get_attention_function"),
    ("xfuser.model_executor.layers.attention_processor", "_joint_sp_padding_attention_kwargs"),
    (f"{_TRANSFORMERS}.transformer_flux", "_HAS_FLYDSL"),
    (f"{_TRANSFORMERS}.transformer_flux2", "_HAS_FLYDSL"),
    (f"{_TRANSFORMERS}.transformer_qwen", "_HAS_FLYDSL"),
    (f"{_TRANSFORMERS}.transformer_wan", "_HAS_FLYDSL"),
    ("xfuser.model_executor.models.runner_models.wan", "_build_attention_kwargs"),  # the tiny Wan (tools/)
    # Stock's Ulysses exchanges, timed by ``cocodiff bench host`` (tools/) for stock's host time.
    (USP, "_combined_qkv_all_to_all"),
    (USP, "_ft_c_input_all_to_all"),
    (USP, "_ft_c_output_all_to_all"),
    # The runtime state of a transformer run without a pipeline (tools/xfuser_state.py).
    ("xfuser.core.distributed.runtime_state", "_RUNTIME"),
)


#: Private torch names read by cocodiff at run time, as (module or attribute path, name).
TORCH_PRIVATE_NAMES: tuple[tuple[str, str], ...] = (
    # Functional collectives: the async all-to-all xfuser itself uses, and its result type.
    ("torch.distributed._functional_collectives", "all_to_all_single"),
    ("torch.distributed._functional_collectives", "AsyncCollectiveTensor"),
    # Eagerly, under no_grad, the functional collectives' Python autograd kernels run per call and
    # do nothing; dispatched below autograd the same ops run without them (comm/functional.py).
    ("torch._C", "_AutoDispatchBelowAutograd"),
    # No public setter bounds groups that already exist (xfuser's) with a new timeout.
    ("torch.distributed.distributed_c10d", "_world"),
    ("torch.distributed.distributed_c10d", "_set_pg_timeout"),
    # The rotater ring attention moves K/V with, created per call: under cocodiff, the exchanger's.
    (RING_ATTENTION, "_create_rotater"),
    # Its merge of the blocks' partial results, and its options: V-Major on the ring runs torch's
    # loop over a rotater of its own (comm/ring.py).
    (RING_ATTENTION, "_SDPAMerger"),
    (RING_ATTENTION, "_cp_options"),
    # What else of the functional collectives stock's exchanges call: the emulated clusters' bf16
    # wire rounds stock's payloads too (tools/fabric/wire.py).
    ("torch.distributed._functional_collectives", "all_gather_single"),
    ("torch.distributed._functional_collectives", "wait_tensor"),
    # dynamo's counters (frames converted, graph breaks) and its reset: what a compiled job did, per
    # backend (tools/generate.py).
    ("torch._dynamo.utils", "counters"),
    # V-Major's caches, kept from call to call, and the graphs' run counters: static inputs of the
    # graphs (vmajor/graph.py, commstats.py).
    ("torch._dynamo", "mark_static_address"),
    ("torch._dynamo", "reset"),
    # Where inductor hands each graph's generated code to tests (tools/generate.py keeps it per backend).
    ("torch._inductor.graph", "GraphLowering"),
    # The CPU flash kernel that returns the log-sum-exp ring attention merges with (tests on CPU).
    ("torch.ops.aten", "_scaled_dot_product_flash_attention_for_cpu"),
    # What dynamo runs when it traces a call instead of tracing into it, its result a constant of the
    # graph (:func:`trace_time`).
    ("torch._dynamo", "assume_constant_result"),
    # The graph dynamo is building, which a trace-time count adds itself to (commstats.py).
    ("torch._dynamo.symbolic_convert", "InstructionTranslator"),
)


def trace_time(fn: Callable) -> Callable:
    """``fn``, run by dynamo when it traces a call of it (its arguments constants or objects, which
    it guards by identity) and its result a constant of the graph: host work that a compiled graph
    decides once, when it is traced, and never runs. Called eagerly, ``fn`` runs as it is."""
    return torch_private("torch._dynamo", "assume_constant_result")(fn)


def traced_graph() -> object | None:
    """At trace time (:func:`trace_time`), the graph dynamo is building: one object per attempt at
    a frame (an attempt that restarts builds another), shared by the functions it inlines. None
    where nothing is traced: a graph break (arguments dynamo cannot make constants, such as dynamic
    sizes) left the call to run."""
    translator = torch_private("torch._dynamo.symbolic_convert", "InstructionTranslator")
    try:
        return translator.current_tx().output
    except AttributeError:  # no translator on this thread
        return None


def trace_time_method(method: Callable) -> Callable:
    """:func:`trace_time` of a bound ``method``: a plain function that calls it. Dynamo before torch
    2.13 hands such a call constant arguments only (no objects), so the object is bound here, before
    any trace; make one per object, outside traced code."""

    def call(*args: Any) -> Any:
        return method(*args)

    call.__name__ = call.__qualname__ = method.__name__  # names the graph's constant
    return trace_time(call)


def mark_static(t: Any) -> None:
    """Mark tensor ``t`` as a static input of the graphs that read it (same memory every call: CUDA
    graph trees let a graph update it in place)."""
    torch_private("torch._dynamo", "mark_static_address")(t)


class IncompatibleXfuser(RuntimeError):
    """The installed xfuser is not the one these patches were written against."""


class IncompatibleTorch(RuntimeError):
    """The installed torch lacks a private name cocodiff reads."""


def xfuser_version() -> str | None:
    try:
        return importlib.metadata.version("xfuser")
    except importlib.metadata.PackageNotFoundError:
        return None


def target(owner: object, name: str) -> Any:
    """``owner.name``, or a clear error if this xfuser no longer has it."""
    if not hasattr(owner, name):
        where = getattr(owner, "__name__", type(owner).__name__)
        raise IncompatibleXfuser(
            f"cocodiff-xfuser: {where}.{name} not found; xfuser {xfuser_version()} differs from "
            f"the tested {TESTED_XFUSER_VERSION}"
        )
    return getattr(owner, name)


def wrap(owner: object, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` with ``make(original)``, once (re-wrapping is a no-op).

    Static and class methods are unwrapped, wrapped and re-wrapped as the same kind.
    """
    raw = target(owner, name)
    if isinstance(owner, type):
        raw = vars(owner).get(name, raw)
    kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    original = raw.__func__ if kind else raw
    if is_wrapped(original):
        return
    wrapped = functools.update_wrapper(make(original), original)
    wrapped._cocodiff_wrapped = True  # type: ignore[attr-defined]
    setattr(owner, name, kind(wrapped) if kind else wrapped)


class When(enum.Enum):
    """When a switched patch (:func:`switch`) is installed: always while a cocodiff job runs, and
    in a stock job ..."""

    COCODIFF = "never"
    EAGER = "run eagerly (it counts what ran)"
    ENABLEMENT = "on a host whose stock xfuser needs it (XPU, CPU: the platform enablement)"


_SWITCHES: list[tuple[object, str, Callable, Callable, When]] = []


def switch(owner: object, name: str, make: Callable[[Callable], Callable], when: When) -> None:
    """Patch ``owner.name`` with ``make(original)`` only while :func:`use_switches` says ``when``
    holds; xfuser's own otherwise. Code that a compiled transformer runs is patched this way, so a
    compiled stock job traces xfuser's functions, not cocodiff's (nothing of ours to guard on)."""
    original = target(owner, name)
    if any(o is owner and n == name for o, n, *_ in _SWITCHES):
        return
    wrapped = functools.update_wrapper(make(original), original)
    wrapped._cocodiff_wrapped = True  # type: ignore[attr-defined]
    _SWITCHES.append((owner, name, original, wrapped, when))
    setattr(owner, name, wrapped)  # until a job says otherwise: each patch checks at run time too


def use_switches(cocodiff: bool, compiled: bool, enablement: bool) -> None:
    """Install each switched patch whose condition holds (a job ``cocodiff`` or stock, ``compiled``
    or eager, on a host that needs the platform ``enablement``), xfuser's own function elsewhere."""
    holds = {When.COCODIFF: cocodiff, When.EAGER: cocodiff or not compiled, When.ENABLEMENT: cocodiff or enablement}
    for owner, name, original, wrapped, when in _SWITCHES:
        setattr(owner, name, wrapped if holds[when] else original)


def is_wrapped(function: object) -> bool:
    return getattr(function, "_cocodiff_wrapped", False)


_MISSING = object()


def private(module: str, name: str) -> Any:
    """The private xfuser name ``module.name`` (one of :data:`PRIVATE_NAMES`), checked."""
    if (module, name) not in PRIVATE_NAMES:
        raise ValueError(f"{module}.{name} is not in compat.PRIVATE_NAMES; add it there")
    # Read on every call (a switch may have replaced it); the module is imported once.
    owner = sys.modules.get(module) or importlib.import_module(module)
    found = getattr(owner, name, _MISSING)
    return target(owner, name) if found is _MISSING else found  # (target: the clear error)


def set_private(module: str, name: str, value: Any) -> None:
    """Set the private xfuser name ``module.name`` (one of :data:`PRIVATE_NAMES`, checked as :func:`private` checks it)."""
    private(module, name)
    setattr(sys.modules[module], name, value)


def usp(name: str) -> Any:
    """A private helper of xfuser's Ulysses module (``usp._concat_joint_tensor``...)."""
    return private(USP, name)


#: The families whose xfuser modules may fuse QK-norm and RoPE (FlyDSL).
FUSED_QK_FAMILIES = ("flux", "flux2", "qwen", "wan")


def fused_kernels() -> tuple[str, ...]:
    """The families of :func:`fused_qk_kernel_reason` whose xfuser module, loaded, found its fused kernel
    (what the installation decides on each rank)."""
    return tuple(f for f in FUSED_QK_FAMILIES if f"{_TRANSFORMERS}.transformer_{f}" in sys.modules and fused_qk_kernel_reason(f))


def fused_qk_kernel_reason(family: str) -> str | None:
    """Why a V-First processor of ``family`` (``flux``, ``flux2``, ``qwen``, ``wan``) must not run:
    xfuser then uses its fused FlyDSL QK-norm/RoPE kernel, which V-First does not reproduce."""
    if private(f"{_TRANSFORMERS}.transformer_{family}", "_HAS_FLYDSL"):
        return "the fused FlyDSL QK-norm/RoPE kernel"
    return None


def _module(path: str) -> Any:
    """The module or attribute ``path`` names (``torch.ops.aten`` is an attribute, not a module)."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        owner, _, name = path.rpartition(".")
        if not owner:
            raise
        return getattr(_module(owner), name)


@functools.cache
def torch_private(module: str, name: str) -> Any:
    """The private torch name ``module.name`` (one of :data:`TORCH_PRIVATE_NAMES`), checked (once:
    callers look it up where they use it, so a torch without it fails only where cocodiff runs)."""
    if (module, name) not in TORCH_PRIVATE_NAMES:
        raise ValueError(f"{module}.{name} is not in compat.TORCH_PRIVATE_NAMES; add it there")
    try:
        return getattr(_module(module), name)
    except (AttributeError, ImportError):
        version = importlib.metadata.version("torch")
        raise IncompatibleTorch(
            f"cocodiff-xfuser: {module}.{name} not found in torch {version} (tested with {TESTED_TORCH_VERSION})"
        ) from None


def missing() -> list[str]:
    """The private names this xfuser and this torch lack (empty for the tested versions)."""
    found = []
    for module, name in PRIVATE_NAMES:
        try:
            private(module, name)
        except (IncompatibleXfuser, ImportError) as e:
            found.append(f"{module}.{name}: {e}")
    for module, name in TORCH_PRIVATE_NAMES:
        try:
            torch_private(module, name)
        except IncompatibleTorch as e:
            found.append(f"{module}.{name}: {e}")
    return found
