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

import torch

from cocodiff_xfuser import compat
from cocodiff_xfuser.platform import adopt_mpi_environment, detect

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
    "xfuser.core.long_ctx_attention.ring.ring_npu_flash_attn",
)


def patch_envs(envs: types.ModuleType, cocodiff_requested: bool) -> None:
    """xfuser's device queries answer for the platform where xfuser has no answer; mpiexec's rank
    variables are adopted."""
    plat = detect()
    if (cocodiff_requested or not plat.is_cuda) and adopt_mpi_environment():
        logger.info("cocodiff: rank %s of %s from the MPI launcher's environment", os.environ["RANK"], os.environ["WORLD_SIZE"])
    if plat.is_cuda:
        return
    # xfuser reads "torch was built for CUDA / ROCm" as "this host has such a device"; here it has none.
    for name in ("_is_cuda", "_is_hip"):
        compat.target(envs, name)
        setattr(envs, name, lambda: False)
    # Otherwise xfuser's own answers stand (its tests mock the device it sees): it only lacks an XPU
    # branch (it falls through to "cpu") and a version and backend for a host without accelerators.
    compat.wrap(envs, "get_device", lambda original: lambda local_rank: _platform_for_cpu(original(local_rank), detect().device(local_rank)))
    for name in ("get_device_name", "get_platform"):
        compat.wrap(envs, name, lambda original: lambda: _platform_for_cpu(original(), detect().name))
    compat.wrap(envs, "get_device_version", _or_else(lambda: None))
    compat.wrap(envs, "get_torch_distributed_backend", _or_else(lambda: detect().dist_backend))
    # xfuser only enables USP when yunchang's long-context attention is importable, which it
    # checks with a CUDA gate; yunchang's all-to-all and ring code are device-agnostic.
    if importlib.util.find_spec("yunchang") is not None:
        compat.target(envs, "PACKAGES_CHECKER").packages_info["has_long_ctx_attn"] = True
    _shim_torch_cuda()


def _platform_for_cpu(answer, platform_answer):
    """xfuser's answer, unless it is its fall-through "cpu" (on XPU it is wrong)."""
    return platform_answer if str(answer) == "cpu" else answer


def _or_else(fallback):
    """xfuser's answer, or ``fallback()`` where it has none (it raises NotImplementedError)."""

    def make(original):
        def answer():
            try:
                return original()
            except NotImplementedError:
                return fallback()

        return answer

    return make


def _shim_torch_cuda() -> None:
    """Route ``torch.cuda.{synchronize,Event}`` to the platform where CUDA is absent.

    The ``xdit`` runner times runs with them (``runner.py`` runs as ``__main__`` and cannot be
    patched as a module); without CUDA they can only raise.
    """
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
        pipeline = compat.target(gc, "PipelineGroupCoordinator")
        compat.wrap(pipeline, "_communicate_shapes", _unwaited_shape_sends)
        for name in ("_pipeline_isend", "_pipeline_isend_skip"):
            compat.wrap(pipeline, name, _kept_sends)


# PipeFusion's stages pass activations with point-to-point sends that xfuser 0.7.0 issues as NCCL
# runs them: it drops a send's handle without waiting (NCCL orders the send on the GPU stream, a
# dropped gloo send never arrives), and before a tensor's first send it sends its shape and waits
# for that (NCCL completes a send this small before its receiver asks for it, and the next stage
# receives the tensor in flight first and asks for the new shape after; a gloo send completes only
# once received, so both stages waited for each other). On gloo, each send is kept until it
# completes and shapes are sent without waiting: the messages, their groups and their order stay
# xfuser's.


def _keep(coordinator, work, tensor) -> None:
    kept = [(w, t) for w, t in coordinator.__dict__.get("_cocodiff_sends", ()) if not w.is_completed()]
    kept.append((work, tensor))
    coordinator._cocodiff_sends = kept


def _on_gloo(coordinator) -> bool:
    return torch.distributed.get_backend(coordinator.device_group) == "gloo"


def _kept_sends(original):
    def send(self, tensor):
        work = original(self, tensor)
        if _on_gloo(self):
            _keep(self, work, tensor)
        return work

    return send


def _unwaited_shape_sends(original):
    def _communicate_shapes(self, tensor_send_to_next=None, recv_prev=False):
        if tensor_send_to_next is None or not _on_gloo(self):
            return original(self, tensor_send_to_next, recv_prev)
        for t in (torch.tensor(tensor_send_to_next.dim(), device=self.device, dtype=torch.int64),
                  torch.tensor(tensor_send_to_next.size(), device=self.device, dtype=torch.int64)):
            _keep(self, torch.distributed.isend(t, self.next_rank, self.device_group), t)
        return original(self, None, recv_prev)  # the receives, as xfuser makes them

    return _communicate_shapes


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
    """xfuser's placement runs as it is, but its move of the pipeline to ``cuda:{local_rank}``
    (hard-coded) goes to this rank's device. Its quantized-GEMM walks need no routing: on a host
    without CUDA xfuser's own preflight refuses those formats before anything is loaded."""
    if detect().is_cuda:
        return

    def make(original):
        def place_pipeline_components(loader):
            pipe = loader.model.pipe
            own = vars(pipe).get("to")  # a pipeline stand-in may carry its own ``to``
            move = pipe.to
            pipe.to = lambda device, *args, **kwargs: move(_on_platform(detect(), device), *args, **kwargs)
            try:
                return original(loader)
            finally:
                if own is None:
                    del pipe.to
                else:
                    pipe.to = own

        return place_pipeline_components

    compat.wrap(placement, "place_pipeline_components", make)


def patch_runner_base_model(base_model: types.ModuleType) -> None:
    """The runner's CPU offload brings components back to ``cuda:{local_rank}`` (hard-coded): to
    this rank's device instead."""
    if detect().is_cuda:
        return
    model = compat.target(base_model, "xFuserModel")
    compat.wrap(model, "_local_onload_device", lambda original: lambda self: _on_platform(detect(), original(self)))


def _on_platform(plat, device):
    """``device``, or the platform's device of the same index where it names CUDA."""
    device = torch.device(device) if isinstance(device, str) else device
    if isinstance(device, torch.device) and device.type == "cuda":
        return plat.device(device.index or 0)
    return device


def patch_attention_backends(ab: types.ModuleType) -> None:
    """On CPU, back ``SDPA_FLASH`` (CUDA-only in xfuser) with torch's CPU flash kernel.

    It returns the log-sum-exp that ring attention merges with; plain ``SDPA`` does not, so
    xfuser refuses it under ring parallelism.
    """
    if detect().name != "cpu":
        return
    # Looked up here, not in the call: a compiled transformer traces the call (no lookup to trace).
    flash = compat.torch_private("torch.ops.aten", "_scaled_dot_product_flash_attention_for_cpu")

    def cpu_flash_attention(query, key, value, dropout_p=0.0, is_causal=False, attention_kwargs=None):
        out, lse, *_ = flash(query, key, value, dropout_p=dropout_p, is_causal=is_causal)
        return out, lse

    compat.target(ab, "ATTENTION_FUNCTION_REGISTRY")[compat.target(ab.AttentionBackendType, "SDPA_FLASH")] = cpu_flash_attention


#: xfuser 0.7.0 modules whose run builds its random generator on "cuda" (the example pipelines'
#: warm-up, ``prepare_run``, and the runner models' ``_run_pipe``) or a tensor on CUDA's current
#: device (the step cache's agreement on skipping a step, ``--cache_method dbcache``).
CUDA_GENERATORS = (
    "xfuser.model_executor.cache.adapters.cache_dit",
    "xfuser.model_executor.pipelines.pipeline_flux",
    "xfuser.model_executor.pipelines.pipeline_flux2",
    "xfuser.model_executor.pipelines.pipeline_flux_control",
    "xfuser.model_executor.pipelines.pipeline_sana",
    "xfuser.model_executor.pipelines.pipeline_sana_sprint",
    "xfuser.model_executor.pipelines.pipeline_stable_diffusion_3",
    "xfuser.model_executor.models.runner_models.ideogram4",
    "xfuser.model_executor.models.runner_models.krea2",
    "xfuser.model_executor.models.runner_models.lingbot_video",
    "xfuser.model_executor.models.runner_models.ltx",
    "xfuser.model_executor.models.runner_models.minimax_h3",
)


#: Runner models that place their own components on "cuda:{rank}", past what can be routed:
#: module -> (class, the method that does it, what it does). On a host without CUDA that method
#: refuses in one line; ``__init__``: the whole model.
CUDA_ONLY_RUNNERS = {
    "xfuser.model_executor.models.runner_models.lingbot_video": (
        "xFuserLingBotVideoMoEModel", "__init__", "moves its refiner, and under FSDP its other components, to CUDA itself"
    ),
    "xfuser.model_executor.models.runner_models.minimax_h3": (
        "xFuserMiniMaxH3Model", "_parallelize_text_encoder", "builds its text encoder's tensor-parallel mesh on CUDA itself"
    ),
}


class _PlatformCuda(types.ModuleType):
    """``torch.cuda`` as a module of :data:`CUDA_GENERATORS` sees it: the current device is the
    platform's; every other name is torch's own."""

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        plat = detect()
        return plat.device(getattr(torch, plat.name).current_device() if plat.name != "cpu" else 0)


class _PlatformTorch(types.ModuleType):
    """``torch`` as a module of :data:`CUDA_GENERATORS` sees it: a generator asked for on "cuda" is
    built on the platform's device, and CUDA's current device is the platform's; every other name is
    torch's own. The module's code runs as xfuser wrote it (a copy of each caller would drift from
    xfuser's arguments)."""

    cuda = _PlatformCuda("torch.cuda")

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def Generator(device="cpu"):
        return torch.Generator(device=_on_platform(detect(), device))


def patch_cuda_calls(module: types.ModuleType) -> None:
    """A module of :data:`CUDA_GENERATORS`: its generators routed, and a runner's CUDA-only method
    (:data:`CUDA_ONLY_RUNNERS`) refused."""
    if detect().is_cuda:
        return
    compat.target(module, "torch")
    module.torch = _PlatformTorch("torch")
    if module.__name__ in CUDA_ONLY_RUNNERS:
        name, method, reason = CUDA_ONLY_RUNNERS[module.__name__]

        def make(original):
            def refused(self, *args, **kwargs):
                raise NotImplementedError(f"xfuser {compat.xfuser_version()}'s {type(self).__name__} {reason}; it cannot run on {detect().name}")

            return refused

        compat.wrap(compat.target(module, name), method, make)
