"""Wiring of cocodiff into xfuser: the job's exchanger started with the process groups, every
Ulysses exchange routed to it, per model a fall-back to stock or the V-First processors, and external models."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import types

import torch

from cocodiff_xfuser import commstats, compat, ulysses_collectives
from cocodiff_xfuser.comm import ring, subgroups, transport
from cocodiff_xfuser.comm.agreement import Disagreement
from cocodiff_xfuser.xfuser import calls, fault_policy, flags, job, padded
from cocodiff_xfuser.xfuser.flags import SP_BACKENDS, env_backend

logger = logging.getLogger("cocodiff_xfuser")

#: Entry-point group of model registrations for xfuser's runner: ``register(base_model_module)``.
#: Loaded on the first lookup of a name xfuser does not know, so user jobs load none of them.
MODELS_ENTRY_POINTS = "cocodiff_xfuser.models"


def _activating_backend(original):
    def _check_distributed_env(self, parallel_config):
        original(self, parallel_config)
        config = self.runtime_config
        name = getattr(config, "sp_backend", None) or env_backend()
        if name not in SP_BACKENDS:
            raise ValueError(f"unknown sp backend {name!r}: expected one of {', '.join(SP_BACKENDS)}")
        if name == "cocodiff" and parallel_config.tp_degree > 1:
            # xfuser 0.7.0 builds SP groups that do not line up with yunchang's Ulysses groups
            # under tensor parallelism.
            logger.warning("cocodiff: tensor parallelism is not supported; falling back to stock Ulysses")
            commstats.count_fallback("model: tensor parallelism")
            job.end()
        elif name == "cocodiff":
            from xfuser.core.distributed import get_sp_group

            try:
                options = flags.options(config)
                fault_policy.install(options.timeout_s)
                ring = get_sp_group().ring_group if parallel_config.ring_degree > 1 else None
                unrouted = ring_unrouted() if ring is not None else None
                if unrouted is not None:
                    logger.warning("cocodiff: %s; the ring attention's K/V exchange as stock", unrouted)
                    ring = None
                job.start(get_sp_group().ulysses_group, options, ring)
            except (ValueError, Disagreement) as e:
                fault_policy.end_job(str(e))
        else:
            job.end()
        use_patches(config.use_torch_compile)

    return _check_distributed_env


def use_patches(compiled: bool) -> None:
    """The switched patches for the job as it now stands (cocodiff or stock, ``compiled`` or not)."""
    from cocodiff_xfuser.platform import detect

    compat.use_switches(job.exchanger() is not None, compiled, not detect().is_cuda)


def release() -> None:
    """Let go of cocodiff's process groups before xfuser destroys its own (collective: every user
    job ends in xfuser's clean-up on every rank): the job's exchanger, its decisions written as they
    would be at exit, and the sub-groups (:func:`subgroups.release`)."""
    exchanger = job.exchanger()
    if exchanger is not None:
        exchanger.decisions.save()
        job.end()
    subgroups.release()


def _releasing_first(original):
    def destroy_distributed_env(self):
        release()
        return original(self)

    return destroy_distributed_env


def patch_runtime_state(rs: types.ModuleType) -> None:
    compat.wrap(rs.RuntimeState, "_check_distributed_env", _activating_backend)
    compat.wrap(rs.RuntimeState, "destroy_distributed_env", _releasing_first)


def _routed_all_to_all(original):
    @torch.compiler.disable  # under V-Major on the ring: between graphs, as the ring attention runs
    def on_host(x):
        return _sdpa_all_to_all_single(x)

    def _sdpa_all_to_all_single(x):
        exchanger = job.exchanger()
        if exchanger is None:
            commstats.count_exchange("stock", "usp")
            return commstats.timed_exchange(original, x)
        if torch.compiler.is_dynamo_compiling() and exchanger.ring_on_host:
            return on_host(x)  # (a frame between the ring's breaks, whose sizes dynamo makes dynamic)
        if ulysses_collectives.applies(exchanger, None):
            # Functional collectives, traced or not: the same code (routed when traced, or on first use).
            if commstats.timings_on and not torch.compiler.is_dynamo_compiling():
                return commstats.timed_exchange(lambda t: ulysses_collectives.all_to_all(exchanger, t, "usp"), x)
            return ulysses_collectives.all_to_all(exchanger, x, "usp")
        return commstats.timed_exchange(exchanger.all_to_all, x)

    return _sdpa_all_to_all_single


def route_all_to_all(usp: types.ModuleType) -> None:
    """Every Ulysses exchange of every model goes through ``usp._sdpa_all_to_all_single``."""
    compat.switch(usp, "_sdpa_all_to_all_single", _routed_all_to_all, compat.When.EAGER)




def _routed_rotater(original):
    def _create_rotater(pg, seq_dim, method=None):
        exchanger = job.exchanger()
        # A method named by the caller is torch's backward pass (gradients move between steps): stock.
        if (exchanger is None or exchanger.ring_group is None or pg is not exchanger.ring_group or method is not None
                or torch.compiler.is_dynamo_compiling()):  # traced: torch's own (:func:`_counted_ring`)
            return original(pg, seq_dim, method)
        return ring.Rotater(pg, lambda buffer: exchanger.start_ring(buffer, pg))  # the exact gather, through the exchanger

    return _create_rotater


def _counted_ring(original):
    """xfuser's ring attention, where it runs torch's (its processors', and ours without V-Major on
    the ring: :func:`cocodiff_xfuser.processors.ulysses.attention` runs that one over its own
    rotater). Traced, the graph holds torch's ring as stock's graph does, counted when traced;
    under V-Major on the ring (:attr:`~cocodiff_xfuser.exchanger.Exchanger.ring_on_host`), where the
    layers around it run between graphs, it runs there too."""

    @torch.compiler.disable
    def on_host(*args, **kwargs):
        return original(*args, **kwargs)

    def _templated_ring_attention(*args, **kwargs):
        exchanger = job.exchanger()
        if torch.compiler.is_dynamo_compiling() and exchanger is not None:
            if exchanger.ring_on_host:
                return on_host(*args, **kwargs)
            if len(args) >= 6:  # torch's (group, seq_dim, op, query, key, value)
                _count_traced_ring(exchanger, args[4], args[5])
        return original(*args, **kwargs)

    return _templated_ring_attention


def _count_traced_ring(exchanger, key: torch.Tensor, value: torch.Tensor) -> None:
    """Count, in traced code, torch's all-gather of ``key`` and ``value`` over the ring (its buffer
    holds both, flattened), as :meth:`~cocodiff_xfuser.exchanger.Exchanger.start_ring` counts its own."""
    exact = (key.numel() + value.numel()) * transport.wire_itemsize(key.dtype) * len(exchanger.ring_remote)
    commstats.traced("count_exchange", "ring all-gather", "ring", exact, exact)


def ring_unrouted() -> str | None:
    """Why the ring's K/V cannot go through cocodiff with this torch (None: they do, under cocodiff):
    its rotater factory, and the merge and options of its ring loop (V-Major on the ring runs it)."""
    try:
        for name in ("_create_rotater", "_SDPAMerger", "_cp_options"):
            compat.torch_private(compat.RING_ATTENTION, name)
    except compat.IncompatibleTorch as e:
        return str(e)
    return None


def route_ring_exchange(usp: types.ModuleType) -> None:
    """xfuser's ring attention (``usp``'s ``_templated_ring_attention``, torch's, on the ring group)
    moves K/V through a rotater torch creates per call; under cocodiff, the ring group's is the
    exchanger's. A torch without what that needs keeps its own rotater (said once, when a job with a
    ring starts: :func:`ring_unrouted`)."""
    if ring_unrouted() is not None:
        return
    compat.switch(importlib.import_module(compat.RING_ATTENTION), "_create_rotater", _routed_rotater, compat.When.COCODIFF)
    compat.switch(usp, "_templated_ring_attention", _counted_ring, compat.When.COCODIFF)


def _adapting_model_after(original, get_transformers):
    """After a model loads: fall back to stock for unsupported models, else install V-First."""

    def wrapper(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        _adapt(*get_transformers(self, result))
        return result

    return wrapper


def _adapt(pipe, transformers: list) -> None:
    """The loaded model's transformers under the job's exchanger, if any: stock for unsupported models,
    else V-First and V-Major where asked for (each call of ``pipe`` in its own V-Major context)."""
    exchanger = job.exchanger()
    if exchanger is None:
        return
    from cocodiff_xfuser.processors import families

    padded.mark_padded_tokens(transformers)
    reason = next(filter(None, map(families.unsupported_reason, transformers)), None)
    uneven = padded.uneven_heads(transformers, exchanger.world_size)
    exchanger.padding.uneven_heads = uneven
    if reason is not None and uneven is not None:
        fault_policy.end_job(f"cocodiff: {uneven} need cocodiff's padded exchange, but {reason}")
    if reason is not None:
        # Which stock takes over: these models run xfuser's long-context attention, built on yunchang.
        logger.warning("cocodiff: %s; falling back to stock Ulysses (xfuser %s, yunchang %s)",
                       reason, compat.xfuser_version(), importlib.metadata.version("yunchang"))
        commstats.count_fallback(f"model: {reason}")
        job.end()
        use_patches(_compiled())
        return
    if exchanger.options.v_first or uneven is not None:
        if uneven is not None:
            _check_padding_possible(uneven)
            logger.warning("cocodiff: %s: zero heads padded up to a multiple (cocodiff's processors)", uneven)
        # V-Major applies to whichever exchanges cross nodes: the Ulysses one, the ring's, or both.
        v_major = exchanger.options.v_major if exchanger.slow_level is not None or exchanger.ring_remote else None
        for transformer in transformers:
            families.install(transformer, exchanger, v_major)
        if v_major is not None and _compiled():
            _say_host_layers(exchanger, v_major)
        calls.bind(pipe, families.clocks(transformers))
        families.agree_fused_kernels()
        stock = sorted({name for t in transformers for name in families.stock_usp(t)})
        if uneven is not None and stock:
            fault_policy.end_job(f"cocodiff: {uneven} need cocodiff's padded exchange, but {', '.join(stock)} has no cocodiff processor")


def _say_host_layers(exchanger, v_major) -> None:
    """One line where a compiled job's V-Major layers run their exchanges between graphs
    (:func:`cocodiff_xfuser.processors.ulysses.start_input_exchange`)."""
    if exchanger.ring_on_host:
        what = "V-Major on the ring's K/V runs host code per ring attention"
    elif v_major.policy != "top-k":
        what = f"V-Major's {v_major.policy} policy decides its counts per call"
    else:
        return
    logger.warning("cocodiff: %s: under torch.compile its layers' exchanges run between graphs "
                   "(top-k keeps them in the graph)", what)


def _compiled() -> bool:
    from xfuser.core.distributed import get_runtime_state

    return get_runtime_state().runtime_config.use_torch_compile


def _check_padding_possible(uneven: str) -> None:
    """Padded heads need cocodiff's processors on every call; settings that send them to stock
    (which asserts divisible heads) are the user's to change."""
    from cocodiff_xfuser.processors import ulysses

    reason = ulysses.stock_reason()
    if reason is not None:
        fault_policy.end_job(f"cocodiff: {uneven} need cocodiff's padded exchange, which {reason} rules out")


class _ModelRegistry(dict):
    """xfuser's ``MODEL_REGISTRY``, completed by the ``cocodiff_xfuser.models`` entry points the
    first time a name it lacks is looked up (the runner's only lookup is ``get``)."""

    def __init__(self, base_model: types.ModuleType, models: dict) -> None:
        super().__init__(models)
        self._base_model = base_model
        self._loaded = False

    def get(self, name, default=None):
        if name not in self and not self._loaded:
            self._loaded = True
            for entry in importlib.metadata.entry_points(group=MODELS_ENTRY_POINTS):
                entry.load()(self._base_model)
        return super().get(name, default)


def _transformers(pipe) -> list:
    return [getattr(pipe, name) for name in ("transformer", "transformer_2") if getattr(pipe, name, None) is not None]


def _eager_transformers(model, _) -> tuple:
    return model.pipe, [] if model.config.use_torch_compile else _transformers(model.pipe)


def _adapting_before_compile(original):
    def _compile_model(self, *args, **kwargs):
        _adapt(self.pipe, _transformers(self.pipe))
        return original(self, *args, **kwargs)

    return _compile_model


def patch_runner_base_model(module: types.ModuleType) -> None:
    cls = compat.target(module, "xFuserModel")
    # A compiled model is adapted before its compile warm-up (which would trace xfuser's processors
    # only for the first call to trace ours again); an eager one once initialized.
    compat.wrap(cls, "_compile_model", _adapting_before_compile)
    compat.wrap(cls, "initialize", lambda original: _adapting_model_after(original, _eager_transformers))
    registry = compat.target(module, "MODEL_REGISTRY")
    if not isinstance(registry, _ModelRegistry):
        # register_model writes to the module global at call time, so later registrations land here too.
        module.MODEL_REGISTRY = _ModelRegistry(module, registry)


def patch_base_pipeline(module: types.ModuleType) -> None:
    cls = compat.target(module, "xFuserPipelineBaseWrapper")
    compat.wrap(cls, "_convert_transformer_backbone", lambda original: _adapting_model_after(original, lambda wrapper, t: (wrapper, [t])))
