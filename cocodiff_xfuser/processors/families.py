"""Which V-First processor replaces which of xfuser's, per model family, and their installation.

``install`` swaps xfuser's processor of each attention module for ours where a family module
provides one, and gives each of ours the job's exchanger; other processors stay stock, which is
always correct because every exchange still goes through the exchanger.
"""

from __future__ import annotations

import logging
import sys

import torch

from cocodiff_xfuser import compat
from cocodiff_xfuser.comm.agreement import Disagreement, agree
from cocodiff_xfuser.exchanger import Exchanger
from cocodiff_xfuser.vmajor import clock as vmajor_clock
from cocodiff_xfuser.vmajor import policy, ring
from cocodiff_xfuser.processors import flux, flux2, hunyuan_video, pixart, qwen_image, sd3, wan
from cocodiff_xfuser.settings import VMajorSettings
from cocodiff_xfuser.xfuser import fault_policy

logger = logging.getLogger("cocodiff_xfuser")


def replacements() -> dict[str, type]:
    """xfuser processor class name -> our V-First processor class."""
    return {
        "xFuserFluxAttnProcessor": flux.FluxVFirstProcessor,
        "xFuserFlux2AttnProcessor": flux2.Flux2VFirstProcessor,
        "xFuserFlux2ParallelSelfAttnProcessor": flux2.Flux2SingleVFirstProcessor,
        "xFuserJointAttnProcessor2_0": sd3.SD3VFirstProcessor,
        "xFuserQwenDoubleStreamAttnProcessor": qwen_image.QwenImageVFirstProcessor,
        "xFuserWanAttnProcessor": wan.WanVFirstProcessor,
        "xFuserAttnProcessor2_0": pixart.PixArtVFirstProcessor,
        "xFuserHunyuanVideoAttnProcessor": hunyuan_video.HunyuanVideoVFirstProcessor,
    }


# xfuser processors whose Ulysses exchange goes through yunchang's SeqAllToAll4D instead of USP,
# where the cocodiff backend cannot route it.
BYPASS_USP = frozenset({"xFuserSanaLinearAttnProcessor2_0"})


def _processors(transformer: torch.nn.Module) -> list:
    """The attention processors of ``transformer``; for a V-First one, the stock one it keeps."""
    ours = tuple(replacements().values())
    found = [m.processor for m in transformer.modules() if getattr(m, "processor", None) is not None]
    return [p.stock if isinstance(p, ours) else p for p in found]


def unsupported_reason(transformer: torch.nn.Module) -> str | None:
    """Why the cocodiff backend cannot carry this model's exchanges (None: it can)."""
    found = _processors(transformer)
    bypass = sorted({type(p).__name__ for p in found} & BYPASS_USP)
    if bypass:
        return f"{type(transformer).__name__} exchanges through yunchang's SeqAllToAll4D ({', '.join(bypass)}), not USP"
    # A processor that calls USP lives in a module that imported it.
    if not any(getattr(sys.modules.get(type(p).__module__), "USP", None) is not None for p in found):
        return f"no attention processor of {type(transformer).__name__} exchanges through xfuser's USP"
    return None


def stock_usp(transformer: torch.nn.Module) -> set[str]:
    """Stock processors left in ``transformer`` (not ours, not unused) whose module calls ``USP``:
    what cannot carry padded heads."""
    ours = tuple(replacements().values())
    unused = _unused_processors(transformer)
    return {
        type(m.processor).__name__
        for m in transformer.modules()
        if getattr(m, "processor", None) is not None and id(m) not in unused and not isinstance(m.processor, ours)
        and getattr(sys.modules.get(type(m.processor).__module__), "USP", None) is not None
    }


def _unused_processors(transformer: torch.nn.Module) -> set[int]:
    """Modules wrapped by an xfuser layer wrapper: the wrapper's processor runs, theirs never does."""
    from xfuser.model_executor.layers.base_layer import xFuserLayerBaseWrapper

    return {id(m.module) for m in transformer.modules() if isinstance(m, xFuserLayerBaseWrapper)}


def install(transformer: torch.nn.Module, exchanger: Exchanger, v_major: VMajorSettings | None = None) -> int:
    """Swap processors in ``transformer``; returns how many V-First processors it now has.

    Each V-First processor keeps the stock processor it replaces (with its settings) and
    delegates to it for whatever it does not reproduce; its exchanges go through ``exchanger``.
    With ``v_major``, each also gets its layer's V-Major state, on one step clock per transformer.
    Installing again in the same job keeps the processors and their V-Major state; a new job's
    exchanger is handed to the processors, and nothing of the last job's V-Major stays.
    """
    table = replacements()
    ours = tuple(table.values())
    unused = _unused_processors(transformer)
    kept: set[str] = set()
    processors = []
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if processor is None or id(module) in unused:
            continue
        if isinstance(processor, ours):
            processors.append(processor)
            continue
        name = type(processor).__name__
        replacement = table.get(name)
        if replacement is None:
            kept.add(name)
            continue
        if not getattr(replacement, "accepts", lambda _: True)(processor):
            continue  # no Ulysses exchange in this module (e.g. Wan's cross-attention)
        module.processor = replacement(processor)
        processors.append(module.processor)
    _leave_other_job(transformer, exchanger, processors)
    for processor in processors:
        processor.exchanger = exchanger
    if v_major is not None:
        _attach_v_major(transformer, exchanger, v_major, processors)
    installed = len(processors)
    logger.info("cocodiff: V-First processors installed in %d attention modules", installed)
    if kept:
        logger.warning("cocodiff: no V-First processor for %s; stock processor kept", ", ".join(sorted(kept)))
    return installed


def agree_fused_kernels() -> None:
    """Agree, over the world, on the one rank-local fact a V-First decision reads: xfuser's fused
    FlyDSL QK-norm/RoPE kernels (a compiled graph decides without a collective). Collective; where
    ranks differ, the job ends with one line naming a rank that differs."""
    try:
        agree(compat.fused_kernels(), "xfuser's fused FlyDSL QK-norm/RoPE kernels (the transformers' modules)")
    except Disagreement as e:
        fault_policy.end_job(str(e))


class _Attached:
    """V-Major on one transformer for one job (``exchanger``'s): its step clock and the hooks that
    drive it. Kept on the transformer for the job, and dropped, hooks removed, when another job's
    exchanger is installed there."""

    def __init__(self, exchanger: Exchanger, clock: vmajor_clock.Clock, hooks: list) -> None:
        self.exchanger, self.clock, self.hooks = exchanger, clock, hooks


def _leave_other_job(transformer: torch.nn.Module, exchanger: Exchanger, processors: list) -> None:
    """Nothing of another job's V-Major stays on ``transformer``: its hooks removed, its processors'
    layers and clock dropped (V-Major, if on, is attached anew with this job's settings and groups)."""
    attached = transformer.__dict__.get("_cocodiff_v_major")
    if attached is None or attached.exchanger is exchanger:
        return
    for hook in attached.hooks:
        hook.remove()
    del transformer._cocodiff_v_major
    for processor in processors:
        processor.v_major = processor.clock = processor.ring = None


def _attach_v_major(transformer: torch.nn.Module, exchanger: Exchanger, settings: VMajorSettings, processors: list) -> None:
    """V-Major on the exchanges of ``transformer`` that cross nodes: each V-First processor's (the
    Ulysses group spans nodes) and the ring's K/V (the ring group does), on one step clock."""
    attached = transformer.__dict__.get("_cocodiff_v_major")
    if attached is None:
        # The ring's counts must be known to ring peers in every Ulysses group: agreed over the world.
        group = None if exchanger.layout.clock_spans_world else exchanger.group
        # Auto may hand steps to xfuser's processors, unless heads padded to the degree need ours.
        stock = exchanger.padding.required() is None
        clock, hooks = vmajor_clock.attach_clock(transformer, group, settings, stock, exchanger.padding)
        attached = transformer._cocodiff_v_major = _Attached(exchanger, clock, hooks)
    clock = attached.clock
    clock.processors = len(processors)
    for processor in processors:
        processor.clock = clock
        if exchanger.slow_level is not None and processor.v_major is None:
            processor.v_major = policy.Layer(clock, settings, exchanger.slow_level.remote)
    if exchanger.slow_level is not None:
        logger.info("cocodiff: V-Major on %d attention layers: %s", clock.layers, settings.describe())
    if exchanger.ring_remote:
        # After the Ulysses layers, in the processors' order (their calls' order): each processor's
        # ring attention hands its layer its calls.
        for processor in processors:
            if processor.ring is None:
                processor.ring = ring.RingLayer(clock, settings, exchanger.ring_group, exchanger.layout.ring_far)
        logger.info("cocodiff: V-Major on the ring's K/V across nodes: %s", settings.describe())


def clocks(transformers: list[torch.nn.Module]) -> list[vmajor_clock.Clock]:
    """The V-Major clocks of ``transformers`` (none where V-Major is off)."""
    return [t.__dict__["_cocodiff_v_major"].clock for t in transformers if "_cocodiff_v_major" in t.__dict__]
