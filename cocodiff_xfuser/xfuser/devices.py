"""Platform enablement: xfuser 0.7.0's CUDA-only spots routed to the detected platform.

On hosts without CUDA (Intel XPU with xccl, CPU with gloo) stock xfuser cannot run at all; these
patches make it run there, for stock Ulysses and cocodiff alike. On a CUDA host none of them
applies. The MPI launcher's rank variables are adopted where xfuser could not start otherwise:
on every platform under ``--sp-backend cocodiff``, and on XPU/CPU always.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import types

from cocodiff_xfuser.platform import adopt_mpi_environment, detect
from cocodiff_xfuser.xfuser import compat

logger = logging.getLogger("cocodiff_xfuser")

#: Modules whose body reads ``torch.cuda.is_available() or envs._is_npu()`` to decide whether to
#: import yunchang (PROCESS_GROUP, ring kernels, ...). On XPU/CPU the gate must be open while the
#: body runs.
YUNCHANG_GATED = (
    "xfuser.model_executor.layers.usp",
    "xfuser.core.distributed.fp8_comms",
    "xfuser.core.long_ctx_attention.hybrid.attn_layer",
    "xfuser.core.long_ctx_attention.ring.ring_flash_attn",
    "xfuser.core.sparge_attention.head_balance",
)


def patch_envs(envs: types.ModuleType, cocodiff_requested: bool) -> None:
    """xfuser's device queries answer for the platform; mpiexec's rank variables are adopted."""
    plat = detect()
    if (cocodiff_requested or not plat.is_cuda) and adopt_mpi_environment():
        logger.info("cocodiff: rank %s of %s from the MPI launcher's environment", os.environ["RANK"], os.environ["WORLD_SIZE"])
    if plat.is_cuda:
        return
    for name, value in (
        ("get_device_version", lambda: None),
        ("get_torch_distributed_backend", lambda: plat.dist_backend),
        ("get_device", lambda local_rank: plat.device(local_rank)),
        ("get_device_name", lambda: plat.name),
        ("get_platform", lambda: plat.name),
    ):
        compat.target(envs, name)
        setattr(envs, name, value)
    # xfuser only enables USP when yunchang's long-context attention is importable, which it
    # checks with a CUDA gate; yunchang's all-to-all and ring code are device-agnostic.
    if importlib.util.find_spec("yunchang") is not None:
        compat.target(envs, "PACKAGES_CHECKER").packages_info["has_long_ctx_attn"] = True
    _shim_torch_cuda()


def _shim_torch_cuda() -> None:
    """Route ``torch.cuda.{synchronize,Event}`` to the platform where CUDA is absent.

    The ``xdit`` runner times runs with them (``runner.py`` runs as ``__main__`` and cannot be
    patched as a module); without CUDA they can only raise.
    """
    import torch

    if compat.is_wrapped(torch.cuda.synchronize):
        return

    def synchronize(device=None):
        detect().synchronize()

    def event(enable_timing=True, **_):
        return detect().event(enable_timing)

    synchronize._cocodiff_wrapped = True  # type: ignore[attr-defined]
    torch.cuda.synchronize = synchronize
    torch.cuda.Event = event


def open_yunchang_gate(module: types.ModuleType) -> None:
    if detect().is_cuda:
        return
    import xfuser.envs as envs

    module.__dict__["_cocodiff_saved_is_npu"] = compat.target(envs, "_is_npu")
    envs._is_npu = lambda: True


def close_yunchang_gate(module: types.ModuleType) -> None:
    saved = module.__dict__.pop("_cocodiff_saved_is_npu", None)
    if saved is not None:
        import xfuser.envs as envs

        envs._is_npu = saved


def patch_parallel_state(ps: types.ModuleType) -> None:
    plat = detect()
    if plat.is_cuda:
        return
    compat.target(ps, "set_device")
    ps.set_device = plat.set_device

    def make(original):
        def init_distributed_environment(*args, **kwargs):
            # xfuser binds the device only for cuda/musa/npu; XPU needs it before xccl starts.
            if plat.name == "xpu":
                plat.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            return original(*args, **kwargs)

        return init_distributed_environment

    compat.wrap(ps, "init_distributed_environment", make)


def patch_group_coordinator(gc: types.ModuleType) -> None:
    plat = detect()
    if not plat.is_cuda:
        compat.target(gc, "synchronize")
        gc.synchronize = plat.synchronize


def patch_runtime_state(rs: types.ModuleType) -> None:
    plat = detect()
    if not plat.is_cuda:
        for name in ("device_manual_seed", "device_manual_seed_all"):
            compat.target(rs, name)
            setattr(rs, name, plat.manual_seed)
    if plat.name == "cpu":
        compat.wrap(rs.RuntimeState, "_select_attention_backend", _cpu_default_attention)


def _cpu_default_attention(original):
    def _select_attention_backend(self, engine_config=None):
        backend = original(self, engine_config)
        explicit = engine_config is not None and engine_config.runtime_config.attention_backend
        # xfuser's CPU default, SDPA, returns no LSE and so cannot run ring attention.
        if not explicit and backend.name == "SDPA":
            return type(backend).SDPA_FLASH
        return backend

    return _select_attention_backend


def patch_placement(placement: types.ModuleType) -> None:
    plat = detect()
    if plat.is_cuda:
        return

    def make(original):
        def place_pipeline_components(loader):
            model = loader.model
            config = model.config
            unsupported = [
                flag
                for flag in ("use_fp4_gemms", "use_fp6_gemms", "use_fp8_gemms")
                if getattr(config, flag, False)
            ]
            if unsupported:
                raise NotImplementedError(f"{', '.join(unsupported)} need CUDA; not available on {plat.name}")
            from xfuser.core.distributed import get_world_group

            model.pipe = model.pipe.to(plat.device(get_world_group().local_rank))

        return place_pipeline_components

    compat.wrap(placement, "place_pipeline_components", make)


def patch_attention_backends(ab: types.ModuleType) -> None:
    """On CPU, back ``SDPA_FLASH`` (CUDA-only in xfuser) with torch's CPU flash kernel.

    It returns the log-sum-exp that ring attention merges with; plain ``SDPA`` does not, so
    xfuser refuses it under ring parallelism.
    """
    if detect().name != "cpu":
        return
    import torch

    def cpu_flash_attention(query, key, value, dropout_p=0.0, is_causal=False, attention_kwargs=None):
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p=dropout_p, is_causal=is_causal
        )
        return out, lse

    compat.target(ab, "ATTENTION_FUNCTION_REGISTRY")[compat.target(ab.AttentionBackendType, "SDPA_FLASH")] = cpu_flash_attention


def patch_generator_devices(pipeline_module: types.ModuleType) -> None:
    """The example-script warm-up (``prepare_run``) builds a CUDA generator; use the platform's device."""
    plat = detect()
    if plat.is_cuda:
        return
    import torch

    cls = next(
        obj
        for obj in vars(pipeline_module).values()
        if isinstance(obj, type) and obj.__module__ == pipeline_module.__name__ and "prepare_run" in vars(obj)
    )

    def make(original):
        def prepare_run(self, input_config, steps: int = 3, sync_steps: int = 1):
            from xfuser.core.distributed import get_runtime_state

            runtime_config = get_runtime_state().runtime_config
            warmup_steps, runtime_config.warmup_steps = runtime_config.warmup_steps, sync_steps
            try:
                self.__call__(
                    height=input_config.height,
                    width=input_config.width,
                    prompt=[""] * input_config.batch_size if input_config.batch_size > 1 else "",
                    num_inference_steps=steps,
                    generator=torch.Generator(device=plat.device(0).type).manual_seed(42),
                    output_type=input_config.output_type,
                )
            finally:
                runtime_config.warmup_steps = warmup_steps

        return prepare_run

    compat.wrap(cls, "prepare_run", make)
