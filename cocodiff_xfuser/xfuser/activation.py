"""Wiring of the backend into xfuser: activation with the process groups, every Ulysses exchange
routed to it, per model a fall-back to stock or the V-First processors, and external models."""

from __future__ import annotations

import importlib.metadata
import logging
import types

from cocodiff_xfuser import backend, commstats, compat, padding
from cocodiff_xfuser.comm import subgroups
from cocodiff_xfuser.comm.agreement import Disagreement
from cocodiff_xfuser.xfuser import fault_policy, flags, padded
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
            backend.deactivate()
        elif name == "cocodiff":
            from xfuser.core.distributed import get_sp_group

            try:
                options = flags.options(config)
                fault_policy.install(options.timeout_s)
                backend.activate(get_sp_group().ulysses_group, options)
            except (ValueError, Disagreement) as e:
                fault_policy.end_job(str(e))
        else:
            backend.deactivate()

    return _check_distributed_env


def release() -> None:
    """Let go of cocodiff's process groups before xfuser destroys its own (collective: every user
    job ends in xfuser's clean-up on every rank): the active backend, its decisions written as they
    would be at exit, and the sub-groups (:func:`subgroups.release`)."""
    active = backend.active()
    if active is not None:
        active.save_decisions()
        backend.deactivate()
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
    def _sdpa_all_to_all_single(x):
        active = backend.active()
        if active is None:
            commstats.count_exchange("stock", "usp")
            return commstats.timed_exchange(original, x)
        return commstats.timed_exchange(active.all_to_all, x)

    return _sdpa_all_to_all_single


def route_all_to_all(usp: types.ModuleType) -> None:
    """Every Ulysses exchange of every model goes through ``usp._sdpa_all_to_all_single``."""
    compat.wrap(usp, "_sdpa_all_to_all_single", _routed_all_to_all)


def _adapting_model_after(original, get_transformers):
    """After a model loads: fall back to stock for unsupported models, else install V-First."""

    def wrapper(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        active = backend.active()
        if active is None:
            return result
        from cocodiff_xfuser.processors import families

        transformers = get_transformers(self, result)
        padded.mark_padded_tokens(transformers)
        reason = next(filter(None, map(families.unsupported_reason, transformers)), None)
        uneven = padded.uneven_heads(transformers, active.world_size)
        padding.set_uneven_heads(uneven)
        if reason is not None and uneven is not None:
            fault_policy.end_job(f"cocodiff: {uneven} need cocodiff's padded exchange, but {reason}")
        if reason is not None:
            # Which stock takes over: these models run xfuser's long-context attention, built on yunchang.
            logger.warning("cocodiff: %s; falling back to stock Ulysses (xfuser %s, yunchang %s)",
                           reason, compat.xfuser_version(), importlib.metadata.version("yunchang"))
            commstats.count_fallback(f"model: {reason}")
            backend.deactivate()
        elif active.options.v_first or uneven is not None:
            if uneven is not None:
                _check_padding_possible(uneven)
                logger.warning("cocodiff: %s: zero heads padded up to a multiple (cocodiff's processors)", uneven)
            v_major = active.options.v_major if active.slow_level is not None else None
            for transformer in transformers:
                families.install(transformer, v_major)
            stock = sorted({name for t in transformers for name in families.stock_usp(t)})
            if uneven is not None and stock:
                fault_policy.end_job(f"cocodiff: {uneven} need cocodiff's padded exchange, but {', '.join(stock)} has no cocodiff processor")
        return result

    return wrapper


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


def patch_runner_base_model(module: types.ModuleType) -> None:
    def transformers(model, pipe):
        return [getattr(pipe, name) for name in ("transformer", "transformer_2") if getattr(pipe, name, None) is not None]

    cls = compat.target(module, "xFuserModel")
    compat.wrap(cls, "initialize", lambda original: _adapting_model_after(original, lambda m, _: transformers(m, m.pipe)))
    registry = compat.target(module, "MODEL_REGISTRY")
    if not isinstance(registry, _ModelRegistry):
        # register_model writes to the module global at call time, so later registrations land here too.
        module.MODEL_REGISTRY = _ModelRegistry(module, registry)


def patch_base_pipeline(module: types.ModuleType) -> None:
    cls = compat.target(module, "xFuserPipelineBaseWrapper")
    compat.wrap(cls, "_convert_transformer_backbone", lambda original: _adapting_model_after(original, lambda _, t: [t]))
