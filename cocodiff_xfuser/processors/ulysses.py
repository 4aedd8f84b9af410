"""The Ulysses core shared by the V-First processors: split exchanges, then xfuser's attention.

Stock xfuser exchanges Q, K and V together (``USP``) after Q/K normalization and RoPE. A
V-First processor instead starts V's exchange as soon as V is projected
(:func:`start_input_exchange`), computes Q/K while it is in flight, and hands everything to
:func:`attention`, which exchanges Q and K, waits for V and runs the same attention function,
ring merge and output exchange as ``USP``. The exchanges move the same bytes to the same
places, so the output is bitwise that of stock Ulysses. Under V-Major, at a sparse step whose Q and
K follow V's selection, V's few changed rows ride in Q/K's exchange instead: one input exchange
per layer, not two (:attr:`cocodiff_xfuser.vmajor.policy.Step.v_rides`). Head and token counts that the Ulysses
degree does not divide, which stock refuses (or, for FLUX text, attends once per rank), are padded
here (:mod:`cocodiff_xfuser.padding`): attention stays exact, the bits are no longer stock's.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from cocodiff_xfuser import commstats, compat, padding, ulysses_collectives, ulysses_handles
from cocodiff_xfuser.comm import ring as comm_ring
from cocodiff_xfuser.comm.agreement import any_rank
from cocodiff_xfuser.errors import user_error
from cocodiff_xfuser.exchanger import Exchanger
from cocodiff_xfuser.vmajor import clock as vmajor_clock
from cocodiff_xfuser.vmajor import graph as vmajor_graph
from cocodiff_xfuser.vmajor import policy
from cocodiff_xfuser.vmajor import ring as vmajor_ring
from cocodiff_xfuser.vmajor import ring_graph

logger = logging.getLogger("cocodiff_xfuser")
_warned: set[str] = set()
try:  # torch's ring merge and its options, looked up once (a lookup in traced code breaks its graph)
    _RING_MERGE = (compat.torch_private(compat.RING_ATTENTION, "_SDPAMerger"),
                   compat.torch_private(compat.RING_ATTENTION, "_cp_options"))
except compat.IncompatibleTorch:  # the ring's K/V then stay stock's (activation.ring_unrouted): never read
    _RING_MERGE = None


class VFirst:
    """Base of the V-First processors: ``exchanger`` is the job's (given at installation; without
    one, or once it is closed, every call takes the stock path), ``v_major`` the layer's V-Major
    state, when it is on, ``ring`` its ring attention's V-Major layer (on the ring's K/V, where the
    ring crosses nodes), and ``clock`` its transformer's step clock under V-Major (auto's speed check may
    send a step's calls to the stock processor: :meth:`.Clock.stock_step`)."""

    exchanger: Exchanger | None = None
    v_major: policy.Layer | None = None
    ring: vmajor_ring.RingLayer | None = None
    clock: vmajor_clock.Clock | None = None


def start_input_exchange(
    processor: VFirst, value: torch.Tensor, *, label: str
) -> ulysses_handles.PendingExchange | ulysses_collectives.InFlight | vmajor_graph.LayerCall | OnHost:
    """Start the Ulysses input exchange of a V-First call's V (``[b, h, s, d]``) through ``processor``'s
    exchanger, asynchronously (counted as the call), under its V-Major layer and ring where they are on.

    An exact layer's exchange is a functional collective (:mod:`cocodiff_xfuser.ulysses_collectives`),
    issued here, before Q and K are projected, traced or not; a top-k V-Major layer's likewise
    (:mod:`cocodiff_xfuser.vmajor.graph`); the others take the exchanger's handles
    (:mod:`cocodiff_xfuser.ulysses_handles`): V-Major's other policies, which choose their counts
    from the data or the step (a graph cannot fix them when it is traced without carrying one
    request's measurements into the next), and V-Major on the ring's K/V (there the graph breaks at
    the ring attention and dynamo traces the layer's pieces as frames of their own, with dynamic
    sizes after the second block type, which an exchange's route cannot be fixed for). Traced, those
    start between graphs, on the host: the graph breaks here and at :func:`attention`, and the Q/K
    projections between run as a graph of their own while V's exchange is in flight.
    """
    exchanger, layer = processor.exchanger, processor.v_major
    pending = None
    # (A Ulysses group of one, V-First for its ring's V-Major, exchanges nothing: eagerly, the same path.)
    if not exchanger.ring_on_host or (exchanger.world_size == 1 and not torch.compiler.is_dynamo_compiling()):
        if layer is not None and vmajor_graph.applies(exchanger, layer):  # eagerly too: the same code
            pending = vmajor_graph.start_v(exchanger, layer, value, label)
        elif ulysses_collectives.applies(exchanger, layer):  # eagerly too: the same code
            pending = ulysses_collectives.start_v(exchanger, value, label)
    if pending is None:
        if torch.compiler.is_dynamo_compiling():
            return OnHost(_start_on_host(processor, value, label=label))
        pending = ulysses_handles.start_v(exchanger, value, label, layer)
    pending.ring = processor.ring  # its ring attention's V-Major, handed to it explicitly
    return pending


_start_on_host = torch.compiler.disable(start_input_exchange)


class OnHost:
    """A compiled layer's exchange started between graphs (``pending``, the eager path's), which
    :func:`attention` finishes between graphs too."""

    def __init__(self, pending: ulysses_handles.PendingExchange | ulysses_collectives.InFlight | vmajor_graph.LayerCall) -> None:
        self.pending = pending


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: ulysses_handles.PendingExchange | ulysses_collectives.InFlight | vmajor_graph.LayerCall | OnHost,
    *,
    joint_query: torch.Tensor | None = None,
    joint_key: torch.Tensor | None = None,
    joint_value: torch.Tensor | None = None,
    joint_strategy: str | None = None,
    attention_kwargs: dict | None = None,
) -> torch.Tensor:
    """Ulysses attention with V already in flight; ``[b, h, s, d]`` in and out, like ``USP``.

    The joint arguments are ``USP``'s (text kept whole on every rank and attended ``"rear"``):
    ``joint_query`` joins the query before its exchange, ``joint_key``/``joint_value`` are
    narrowed to this rank's heads and joined by the attention function. ``attention_kwargs``
    go to the attention function as in ``USP``, after its K/V padding trim
    (:func:`attention_kwargs_reason` says which ones this does not handle).

    The exchanges are those of the path V's started on (a module with the same three roles: V's
    start, Q/K's exchange with V's wait, the output). Under torch.compile, with V's exchange started
    on the host (:class:`OnHost`), the rest of the layer's attention runs there too, between graphs.
    """
    if isinstance(value, OnHost):
        return _attention_on_host(query, key, value.pending, joint_query=joint_query, joint_key=joint_key,
                                  joint_value=joint_value, joint_strategy=joint_strategy, attention_kwargs=attention_kwargs)
    head_count = query.shape[1]
    joint_attn_kwargs = None
    if joint_strategy:
        query, joint_attn_kwargs = _joined(query, joint_query, joint_key, joint_value, joint_strategy)
    pending = value
    if isinstance(pending, vmajor_graph.LayerCall):
        path = vmajor_graph
    elif isinstance(pending, ulysses_collectives.InFlight):
        path = ulysses_collectives
    else:
        path = ulysses_handles
    query, key, value = path.exchange_inputs(query, key, pending)
    key, value = pending.exchanger.padding.keep_keys(key, value)  # the running forward's padded tokens, if any
    if attention_kwargs:  # (without them stock's trim returns K and V as they are)
        key, value = compat.usp("_trim_trailing_kv_padding")(key, value, attention_kwargs)
    out = _attend(compat.private(compat.USP, "_get_attention_function")(), query, key, value, joint_attn_kwargs, attention_kwargs,
                  pending.exchanger, pending.ring)
    return path.output(pending, out, head_count)


_attention_on_host = torch.compiler.disable(attention)


def _joined(query, joint_query, joint_key, joint_value, joint_strategy) -> tuple[torch.Tensor, dict | None]:
    """``USP``'s joint tokens: the query with ``joint_query`` joined, and the joint arguments of its
    attention function (``joint_key``/``joint_value`` narrowed to this rank's heads)."""
    from xfuser.core.distributed import get_ring_parallel_world_size, get_ulysses_parallel_world_size

    world = get_ulysses_parallel_world_size()
    query = compat.usp("_concat_joint_tensor")(query, joint_query, joint_strategy, dim=2)
    joint_key, joint_value = compat.usp("_preprocess_joint_tensors")(
        padding.pad_heads(joint_key, world), padding.pad_heads(joint_value, world)
    )
    return query, {
        "joint_value": joint_value,
        "joint_key": joint_key,
        "joint_strategy": joint_strategy,
        "step": 0,
        "total_steps": get_ring_parallel_world_size(),
    }


def _attend(attention_function, query, key, value, joint_attn_kwargs, attention_kwargs, exchanger: Exchanger,
            ring: vmajor_ring.RingLayer | None) -> torch.Tensor:
    """``USP``'s attention of head-sharded Q, K, V, over the ring where there is one: xfuser's
    ``ring_attn``, or under V-Major on the ring (``ring``, the layer's) torch's loop over a gather
    of this call's that hands ``ring`` its K/V: top-k's static exchange (:mod:`.ring_graph`), the
    others' through the exchanger (:meth:`~cocodiff_xfuser.exchanger.Exchanger.start_ring`)."""
    from xfuser.core.distributed import get_ring_parallel_world_size
    from xfuser.model_executor.layers.usp import ring_attn

    if get_ring_parallel_world_size() == 1:
        out, _ = attention_function(query, key, value, dropout_p=0.0, is_causal=False, joint_attn_kwargs=joint_attn_kwargs,
                                    attention_kwargs=attention_kwargs)
        return out
    if ring is None:
        return ring_attn(attention_function, query, key, value, dropout_p=0.0, is_causal=False,
                         joint_attn_kwargs=joint_attn_kwargs, attention_kwargs=attention_kwargs)
    group = exchanger.ring_group
    # What V-Major ranks, a row of K and of V: one head's vector at one position (``[b, h, s, d]``,
    # so the buffer reads as [K|V, b*h*s, d]), where K and V are alike (None: the exact gather). The
    # sequence dimension xfuser names to torch's ring (1) is the heads' here: rows of it would be
    # whole [s, d] planes, a handful per call, which top-k could not choose among.
    row = key.shape[-1] if key.shape == value.shape else None
    if row is not None and ring_graph.applies(ring.settings):
        def start(buffer):
            return ring_graph.Gathered(ring, buffer, row)
    else:
        def start(buffer):
            return exchanger.start_ring(buffer, group, row, ring)
    merger, options = _RING_MERGE
    return comm_ring.attend(attention_function, query, key, value, group, start, merger(options.convert_to_f32, seq_dim=1),
                            dropout_p=0.0, joint_attn_kwargs=joint_attn_kwargs, attention_kwargs=attention_kwargs)


def attention_kwargs_reason(attention_kwargs: dict | None) -> str | None:
    """Why :func:`attention` cannot reproduce ``USP`` with these ``attention_kwargs`` (None: it can)."""
    from xfuser.model_executor.layers.usp import ULYSSES_EXTRA_INPUTS_KEY

    if attention_kwargs and attention_kwargs.get(ULYSSES_EXTRA_INPUTS_KEY):
        return "extra per-head attention inputs (ulysses_extra_inputs)"
    return None


def fallback_reason(
    processor: object, extra: Callable[[], str | None] | None = None, inputs: Sequence[torch.Tensor | None] = ()
) -> str | None:
    """Why this call of ``processor`` must take the stock path (None: V-First applies), agreed.

    The reasons depend on settings, module attributes and input shapes, which SPMD code shares;
    the first call of a processor with given input shapes and local reason checks it with one
    small all-reduce over the Ulysses group (any rank's fall-back is everyone's), later ones reuse
    the answer. Counted (``commstats.ran()``: fall-backs here, V-First calls as V's exchange
    starts) and logged once per reason.

    Traced by torch.compile, V-First is decided in the graph from the local reasons alone, which
    dynamo guards (a change traces again): they read settings, module attributes and the call's
    arguments, the same on every rank, and what a rank's installation decides (fused kernels) was
    agreed when the processors were installed (:func:`cocodiff_xfuser.compat.fused_kernels`); under
    auto, the step's choice of processors, fixed for the transformer call
    (:attr:`~cocodiff_xfuser.vmajor.clock.Clock.to_stock`: two graphs at most, both traced in the
    trial's first call). A graph break inside a layer would send the model's whole forward to eager
    (its loop over blocks cannot resume), so only a fall-back breaks it, at the layer's entry; where
    the layer has no exchange of cocodiff's (a Ulysses group of one, no V-Major on its ring), the
    graph takes the stock processor without a break (a setting, the same on every rank).
    """
    if torch.compiler.is_dynamo_compiling():
        if _v_first_in_graph(processor, extra):
            return _stock_step(processor)
        exchanger = getattr(processor, "exchanger", None)
        if exchanger is not None and not exchanger.closed and not _exchanges(processor):
            commstats.traced("count_fallback", "v-first: no Ulysses exchange")
            return "no Ulysses exchange"
    return _decide(processor, extra, inputs)


def _v_first_in_graph(processor: object, extra: Callable[[], str | None] | None) -> bool:
    exchanger = getattr(processor, "exchanger", None)
    return exchanger is not None and not exchanger.closed and _exchanges(processor) and _local_reason(extra) is None


def _exchanges(processor: object) -> bool:
    """Whether ``processor`` has an exchange of cocodiff's to run: its Ulysses group's (of more than
    one rank), or V-Major on its ring's K/V (which the stock processor's ring attention would not run)."""
    from xfuser.core.distributed import get_ulysses_parallel_world_size

    return get_ulysses_parallel_world_size() > 1 or getattr(processor, "ring", None) is not None


def _stock_step(processor: object) -> str | None:
    """Auto's reason to hand this call to xfuser's processors where its step runs them (the clock
    counts the call), else None: also where the running forward padded tokens, which only cocodiff's
    split (padded heads leave the trial without stock steps: :func:`.families._attach_v_major`).
    The same on every rank: the step, agreed times and shapes decide it."""
    clock = getattr(processor, "clock", None)
    return (vmajor_clock.STOCK_STEP if clock is not None and clock.to_stock and processor.exchanger.padding.running is None
            else None)


@torch.compiler.disable  # compiled: a graph break at the layer's entry, the decision on the host
def _decide(processor: object, extra: Callable[[], str | None] | None, inputs: Sequence[torch.Tensor | None]) -> str | None:

    exchanger = getattr(processor, "exchanger", None)
    if exchanger is None or exchanger.closed or not _exchanges(processor):
        return _counted("no Ulysses exchange", None)
    local = _local_reason(extra)
    # Kept by the job's exchanger, never on the model: a new job agrees again.
    agreed = exchanger.agreed
    key = [id(processor), local]  # and the inputs' shapes and dtypes (a loop: a comprehension is a call per layer)
    for t in inputs:
        key.append(None if t is None else (t.shape, t.dtype))
    key = tuple(key)
    if key not in agreed:
        device = next((t.device for t in inputs if t is not None), torch.device("cpu"))
        anyone = any_rank(local is not None, exchanger.group, device)
        agreed[key] = local if local is not None or not anyone else "a fall-back on another rank"
    if agreed[key] is None:
        return _stock_step(processor)
    return _counted(agreed[key], exchanger)


def stock_reason() -> str | None:
    """A job-wide setting that sends every call to the stock processor (None: there is none)."""
    return _local_reason(None)


def _counted(reason: str | None, exchanger: Exchanger | None) -> str | None:
    """``reason`` counted and said once (None: none); where ``exchanger``'s job pads heads or
    tokens, a user's mistake instead."""
    if reason is None:
        return None
    needed = None if exchanger is None else exchanger.padding.required()
    if needed is not None:  # stock cannot split these: one clear line, not stock's assertion
        user_error(f"cocodiff: {needed} need cocodiff's processors, but {reason} sends a layer to stock")
    commstats.count_fallback(f"v-first: {reason}")
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("cocodiff: V-First off for %s; using the stock processor", reason)
    return reason


def _local_reason(extra: Callable[[], str | None] | None) -> str | None:
    from xfuser.core.distributed import get_runtime_state

    state = get_runtime_state()
    reason = None
    if state.fp8_comms is not None:
        reason = "fp8 communication"
    elif state.runtime_config.use_spargeattn_head_balance:
        reason = "Sparge head balancing"
    elif state.num_pipeline_patch > 1:
        reason = "PipeFusion"
    elif extra is not None:
        reason = extra()
    return reason


def linear_slice(layer: torch.nn.Linear, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Output features ``start:stop`` of ``layer(x)``, computed alone (rows of a fused projection)."""
    bias = None if layer.bias is None else layer.bias[start:stop]
    return torch.nn.functional.linear(x, layer.weight[start:stop], bias)


def linear_rows(layer: torch.nn.Linear, x: torch.Tensor, part: int, parts: int = 3) -> torch.Tensor:
    """One of ``parts`` equal output blocks of a fused projection (e.g. V of ``to_qkv``), computed alone."""
    rows = layer.out_features // parts
    return linear_slice(layer, x, part * rows, (part + 1) * rows)


def norm_qk(attn, query: torch.Tensor, key: torch.Tensor, added: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention module's optional QK-norm of the image stream or, with ``added``, the text stream."""
    norm_q, norm_k = (attn.norm_added_q, attn.norm_added_k) if added else (attn.norm_q, attn.norm_k)
    return (query if norm_q is None else norm_q(query)), (key if norm_k is None else norm_k(key))


def project(attn, x: torch.Tensor, which: str, added: bool = False) -> torch.Tensor:
    """Q, K or V (``which`` in 'qkv') of the image stream or, with ``added``, the text stream.

    Separate projections (``to_q``/``add_q_proj``...) or the rows of the fused ``to_qkv`` /
    ``to_added_qkv`` (diffusers' ``fuse_projections``), as the attention module has them.
    """
    part = "qkv".index(which)
    if getattr(attn, "fused_projections", False):
        return linear_rows(attn.to_added_qkv if added else attn.to_qkv, x, part)
    return getattr(attn, f"add_{which}_proj" if added else f"to_{which}")(x)
