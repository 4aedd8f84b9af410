"""The patches of xfuser 0.7.0, applied while its modules load.

:mod:`cocodiff_xfuser._finder` calls :func:`before_exec` / :func:`after_exec` around the body of
each module named in :data:`HOOKS`. The patches, by concern:

* :mod:`.devices`: platform enablement, on hosts without CUDA only (XPU, CPU);
* :mod:`.flags`: ``--sp-backend`` and cocodiff's options on both entry paths;
* :mod:`.launch`: the ``xdit`` CLI checks them before torchrun starts a worker;
* :mod:`.activation`: the job's exchanger (:mod:`.job`) started with xfuser's process groups, every
  Ulysses exchange routed to it, per model a fall-back to stock or V-First processors; external models
  (``cocodiff/...``) registered on first lookup;
* :mod:`.padded`: head and token counts the Ulysses degree does not divide, padded (under cocodiff);
* :mod:`.workarounds`: xfuser 0.7.0 bugs, under cocodiff (and on XPU/CPU hosts);
* :mod:`.compat`: the version, checked patch targets and every private xfuser name.

With an xfuser other than the tested version nothing is patched: silently for stock users, with
one clear error when cocodiff was requested.
"""

from __future__ import annotations

import functools
import types
from typing import Callable

from cocodiff_xfuser import compat
from cocodiff_xfuser.xfuser import activation, devices, flags, launch, padded, workarounds

Hook = Callable[[types.ModuleType], None]


@functools.lru_cache(maxsize=None)
def enabled() -> bool:
    """Whether to patch: the tested xfuser is installed (else a clear error if cocodiff was asked for)."""
    version = compat.xfuser_version()
    if version == compat.TESTED_XFUSER_VERSION:
        return True
    if flags.cocodiff_requested():
        raise compat.IncompatibleXfuser(
            f"cocodiff-xfuser supports xfuser=={compat.TESTED_XFUSER_VERSION}, found xfuser=={version}; "
            f"install xfuser=={compat.TESTED_XFUSER_VERSION} or drop --sp-backend cocodiff"
        )
    return False


_RING_NPU = "xfuser.core.long_ctx_attention.ring.ring_npu_flash_attn"


def _before_ring_npu(module: types.ModuleType) -> None:
    devices.open_yunchang_gate(module)
    workarounds.supply_update_npu_out(module)


def _after_usp(usp: types.ModuleType) -> None:
    devices.close_yunchang_gate(usp)
    activation.route_all_to_all(usp)
    activation.route_ring_exchange(usp)


#: module -> (before its body runs, after it ran). The yunchang gate is closed after a failed body too.
HOOKS: dict[str, tuple[Hook | None, Hook | None]] = {
    "xfuser.envs": (None, lambda envs: devices.patch_envs(envs, flags.cocodiff_requested())),
    **{name: (devices.open_yunchang_gate, devices.close_yunchang_gate) for name in devices.YUNCHANG_GATED},
    # Two gated modules take more than the gate (these entries replace theirs above).
    devices.YUNCHANG_GATED[0]: (devices.open_yunchang_gate, _after_usp),
    _RING_NPU: (_before_ring_npu, devices.close_yunchang_gate),
    "xfuser.config.args": (None, flags.patch_args),
    "xfuser.cli": (None, launch.patch_cli),
    "xfuser.core.distributed.parallel_state": (None, devices.patch_parallel_state),
    "xfuser.core.distributed.group_coordinator": (None, devices.patch_group_coordinator),
    "xfuser.core.distributed.runtime_state": (None, lambda rs: (devices.patch_runtime_state(rs), activation.patch_runtime_state(rs), padded.patch_runtime_state(rs))),
    "xfuser.core.distributed.attention_backend": (None, devices.patch_attention_backends),
    "xfuser.model_executor.models.runner_models.loading.placement": (None, devices.patch_placement),
    "xfuser.model_executor.models.runner_models.base_model": (
        None, lambda bm: (devices.patch_runner_base_model(bm), activation.patch_runner_base_model(bm))
    ),
    "xfuser.model_executor.pipelines.base_pipeline": (None, activation.patch_base_pipeline),
    **{name: (None, devices.patch_cuda_calls) for name in devices.CUDA_GENERATORS},
    "xfuser.model_executor.models.transformers.transformer_flux": (
        None, lambda flux: (workarounds.patch_transformer_flux(flux), padded.patch_transformer_flux(flux))
    ),
    "xfuser.model_executor.layers.attention_processor": (None, workarounds.patch_attention_processor),
    "xfuser.model_executor.models.transformers.transformer_qwen": (None, workarounds.patch_transformer_qwen),
}


def is_hooked(module_name: str) -> bool:
    return module_name in HOOKS and enabled()


def before_exec(module: types.ModuleType) -> None:
    hook = HOOKS.get(module.__name__, (None, None))[0]
    if hook is not None:
        hook(module)


def after_exec(module: types.ModuleType, succeeded: bool) -> None:
    after = HOOKS.get(module.__name__, (None, None))[1]
    if succeeded and after is not None:
        after(module)
    elif not succeeded and module.__name__ in devices.YUNCHANG_GATED:
        devices.close_yunchang_gate(module)
