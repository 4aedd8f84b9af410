"""Everything cocodiff-xfuser changes in xfuser 0.7.0, in one place.

:mod:`cocodiff_xfuser._finder` calls :func:`before_exec` / :func:`after_exec` around the body of
each module named in ``_HOOKS``. Three kinds of change are made:

* platform: on hosts without CUDA, xfuser's CUDA-only spots are routed to the detected
  :class:`~cocodiff_xfuser.platform.Platform` (XPU or CPU); on CUDA hosts nothing changes;
* bug workarounds for xfuser 0.7.0 (SD3.5 dual attention; FLUX and Qwen-Image sequence padding,
  which crashes or silently changes the image, refused with a clear error);
* the ``--sp-backend`` flag and, when it is ``cocodiff``, the backend: every Ulysses exchange
  goes through :func:`cocodiff_xfuser.backend.all_to_all` and attention processors are swapped
  per model family.

Every patch checks that its target exists. With an xfuser other than the tested version the
hooks stay off: silently for stock users, with one clear error when cocodiff was requested.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import sys
import time
import types
from typing import Callable

logger = logging.getLogger("cocodiff_xfuser")

TESTED_XFUSER_VERSION = "0.7.0"
BACKEND_ENV = "XFUSER_SP_BACKEND"
SP_BACKENDS = ("ulysses", "cocodiff")

# Modules whose body reads `torch.cuda.is_available() or envs._is_npu()` to decide whether to
# import yunchang (PROCESS_GROUP, ring kernels, ...). On XPU/CPU the gate must be open while
# the body runs.
_YUNCHANG_GATED = (
    "xfuser.model_executor.layers.usp",  # its after-hook also routes the all-to-all
    "xfuser.core.distributed.fp8_comms",
    "xfuser.core.long_ctx_attention.hybrid.attn_layer",
    "xfuser.core.long_ctx_attention.ring.ring_flash_attn",
    "xfuser.core.sparge_attention.head_balance",
)


class IncompatibleXfuser(RuntimeError):
    """The installed xfuser is not the one these patches were written against."""


def _xfuser_version() -> str | None:
    try:
        return importlib.metadata.version("xfuser")
    except importlib.metadata.PackageNotFoundError:
        return None


def cocodiff_requested(argv: list[str] | None = None) -> bool:
    """Whether this process asked for the cocodiff backend (flag or environment)."""
    argv = sys.argv if argv is None else argv
    if os.environ.get(BACKEND_ENV, "").strip().lower() == "cocodiff":
        return True
    for i, arg in enumerate(argv):
        key, _, value = arg.partition("=")
        if key in ("--sp-backend", "--sp_backend") and (value or (argv[i + 1] if i + 1 < len(argv) else "")) == "cocodiff":
            return True
    return False


@functools.lru_cache(maxsize=None)
def _enabled() -> bool:
    version = _xfuser_version()
    if version == TESTED_XFUSER_VERSION:
        return True
    if cocodiff_requested():
        raise IncompatibleXfuser(
            f"cocodiff-xfuser supports xfuser=={TESTED_XFUSER_VERSION}, found xfuser=={version}; "
            f"install xfuser=={TESTED_XFUSER_VERSION} or drop --sp-backend cocodiff"
        )
    return False


def is_hooked(module_name: str) -> bool:
    return module_name in _HOOKS and _enabled()


def before_exec(module: types.ModuleType) -> None:
    hook = _HOOKS.get(module.__name__, (None, None))[0]
    if hook is not None:
        hook(module)


def after_exec(module: types.ModuleType, succeeded: bool) -> None:
    hook = _HOOKS.get(module.__name__, (None, None))[1]
    if hook is None:
        return
    if succeeded:
        hook(module)
    elif hook is _close_yunchang_gate or hook is _after_usp:
        _close_yunchang_gate(module)


def _target(owner: object, name: str) -> object:
    """The attribute to patch, or a clear error if this xfuser no longer has it."""
    if not hasattr(owner, name):
        where = getattr(owner, "__name__", type(owner).__name__)
        raise IncompatibleXfuser(
            f"cocodiff-xfuser: {where}.{name} not found; xfuser {_xfuser_version()} differs from "
            f"the tested {TESTED_XFUSER_VERSION}"
        )
    return getattr(owner, name)


def _wrap(owner: object, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` with ``make(original)``, once (re-wrapping is a no-op).

    Static and class methods are unwrapped, wrapped and re-wrapped as the same kind.
    """
    raw = _target(owner, name)
    if isinstance(owner, type):
        raw = vars(owner).get(name, raw)
    kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    original = raw.__func__ if kind else raw
    if getattr(original, "_cocodiff_wrapped", False):
        return
    wrapped = functools.update_wrapper(make(original), original)
    wrapped._cocodiff_wrapped = True  # type: ignore[attr-defined]
    setattr(owner, name, kind(wrapped) if kind else wrapped)


def _platform():
    from cocodiff_xfuser.platform import detect

    return detect()


# --------------------------------------------------------------------------------- platform


def _patch_envs(envs: types.ModuleType) -> None:
    from cocodiff_xfuser.platform import adopt_mpi_environment

    if adopt_mpi_environment():
        logger.info("cocodiff: rank %s of %s from the MPI launcher's environment", os.environ["RANK"], os.environ["WORLD_SIZE"])
    plat = _platform()
    if plat.is_cuda:
        return
    for name, value in (
        ("get_device_version", lambda: None),
        ("get_torch_distributed_backend", lambda: plat.dist_backend),
        ("get_device", lambda local_rank: plat.device(local_rank)),
        ("get_device_name", lambda: plat.name),
        ("get_platform", lambda: plat.name),
    ):
        _target(envs, name)
        setattr(envs, name, value)
    # xfuser only enables USP when yunchang's long-context attention is importable, which it
    # checks with a CUDA gate; yunchang's all-to-all and ring code are device-agnostic.
    import importlib.util

    if importlib.util.find_spec("yunchang") is not None:
        _target(envs, "PACKAGES_CHECKER").packages_info["has_long_ctx_attn"] = True
    _shim_torch_cuda()


def _shim_torch_cuda() -> None:
    """Route ``torch.cuda.{synchronize,Event}`` to the platform where CUDA is absent.

    The ``xdit`` runner times runs with them (``runner.py`` runs as ``__main__`` and cannot be
    patched as a module); without CUDA they can only raise.
    """
    import torch

    if getattr(torch.cuda.synchronize, "_cocodiff_wrapped", False):
        return

    def synchronize(device=None):
        _platform().synchronize()

    def event(enable_timing=True, **_):
        return _platform().event(enable_timing)

    synchronize._cocodiff_wrapped = True  # type: ignore[attr-defined]
    torch.cuda.synchronize = synchronize
    torch.cuda.Event = event


def _open_yunchang_gate(module: types.ModuleType) -> None:
    if _platform().is_cuda:
        return
    import xfuser.envs as envs

    module.__dict__["_cocodiff_saved_is_npu"] = envs._is_npu
    envs._is_npu = lambda: True


def _close_yunchang_gate(module: types.ModuleType) -> None:
    saved = module.__dict__.pop("_cocodiff_saved_is_npu", None)
    if saved is not None:
        import xfuser.envs as envs

        envs._is_npu = saved


def _after_usp(usp: types.ModuleType) -> None:
    _close_yunchang_gate(usp)
    _wrap(usp, "_sdpa_all_to_all_single", _routed_all_to_all)


def _patch_parallel_state(ps: types.ModuleType) -> None:
    plat = _platform()
    if plat.is_cuda:
        return
    _target(ps, "set_device")
    ps.set_device = plat.set_device

    def make(original):
        def init_distributed_environment(*args, **kwargs):
            # xfuser binds the device only for cuda/musa/npu; XPU needs it before xccl starts.
            if plat.name == "xpu":
                plat.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            return original(*args, **kwargs)

        return init_distributed_environment

    _wrap(ps, "init_distributed_environment", make)


def _patch_group_coordinator(gc: types.ModuleType) -> None:
    plat = _platform()
    if not plat.is_cuda:
        _target(gc, "synchronize")
        gc.synchronize = plat.synchronize


def _patch_runtime_state(rs: types.ModuleType) -> None:
    plat = _platform()
    if not plat.is_cuda:
        for name in ("device_manual_seed", "device_manual_seed_all"):
            _target(rs, name)
            setattr(rs, name, plat.manual_seed)
    _wrap(rs.RuntimeState, "_check_distributed_env", _activating_backend)
    if plat.name == "cpu":
        _wrap(rs.RuntimeState, "_select_attention_backend", _cpu_default_attention)


def _cpu_default_attention(original):
    def _select_attention_backend(self, engine_config=None):
        backend = original(self, engine_config)
        explicit = engine_config is not None and engine_config.runtime_config.attention_backend
        # xfuser's CPU default, SDPA, returns no LSE and so cannot run ring attention.
        if not explicit and backend.name == "SDPA":
            return type(backend).SDPA_FLASH
        return backend

    return _select_attention_backend


def _patch_placement(placement: types.ModuleType) -> None:
    plat = _platform()
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

    _wrap(placement, "place_pipeline_components", make)


def _patch_attention_backends(ab: types.ModuleType) -> None:
    """On CPU, back ``SDPA_FLASH`` (CUDA-only in xfuser) with torch's CPU flash kernel.

    It returns the log-sum-exp that ring attention merges with; plain ``SDPA`` does not, so
    xfuser refuses it under ring parallelism.
    """
    if _platform().name != "cpu":
        return
    import torch

    def cpu_flash_attention(query, key, value, dropout_p=0.0, is_causal=False, attention_kwargs=None):
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p=dropout_p, is_causal=is_causal
        )
        return out, lse

    _target(ab, "ATTENTION_FUNCTION_REGISTRY")[_target(ab.AttentionBackendType, "SDPA_FLASH")] = cpu_flash_attention


def _patch_generator_devices(pipeline_module: types.ModuleType) -> None:
    """The example-script warm-up (``prepare_run``) builds a CUDA generator; use the platform's device."""
    plat = _platform()
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

    _wrap(cls, "prepare_run", make)


# ---------------------------------------------------------------------------- bug workarounds


def _patch_transformer_flux(module: types.ModuleType) -> None:
    """xfuser 0.7.0 calls ``self._pad_to_sp_divisible`` (an AttributeError: the method is
    ``pad_to_sp_divisible``) when image tokens % SP != 0. Calling the real method is no fix:
    the zero padding is attended and the image changes, so say so clearly instead."""
    cls = _target(module, "xFuserFlux1Transformer2DWrapper")
    _target(cls, "pad_to_sp_divisible")
    if getattr(cls, "_pad_to_sp_divisible", None) is not None:
        return

    def _pad_to_sp_divisible(self, tensor, padding_length: int, dim: int):
        from xfuser.core.distributed import get_sequence_parallel_world_size

        raise ValueError(
            f"FLUX under sequence parallelism: {tensor.shape[dim]} image tokens are not divisible by the SP degree "
            f"{get_sequence_parallel_world_size()}; xfuser 0.7.0 would attend to its zero padding and change the "
            f"image. Choose a resolution whose image token count is divisible by the SP degree."
        )

    cls._pad_to_sp_divisible = _pad_to_sp_divisible


def _patch_attention_processor(module: types.ModuleType) -> None:
    """SD3.5's ``attn2`` (no text stream) hits ``UnboundLocalError: joint_strategy`` under SP."""
    cls = _target(module, "xFuserJointAttnProcessor2_0")

    def make(original):
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
            if encoder_hidden_states is None:
                from cocodiff_xfuser.processors.sd3 import image_only_joint_attention

                return image_only_joint_attention(attn, hidden_states)
            return original(self, attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)

        return __call__

    _wrap(cls, "__call__", make)


def _patch_transformer_qwen(module: types.ModuleType) -> None:
    """xfuser 0.7.0 pads Qwen-Image sequences to the SP degree but its attention ignores the mask,
    so the padding is attended and the image silently changes: refuse those lengths instead."""
    cls = _target(module, "xFuserQwenImageTransformerWrapper")

    def make(original):
        def forward(self, hidden_states, encoder_hidden_states=None, *args, **kwargs):
            from xfuser.core.distributed import get_sequence_parallel_world_size

            sp = get_sequence_parallel_world_size()
            for stream, tensor in (("image", hidden_states), ("text", encoder_hidden_states)):
                if sp > 1 and tensor is not None and tensor.shape[1] % sp:
                    raise ValueError(
                        f"Qwen-Image under sequence parallelism: {tensor.shape[1]} {stream} tokens are not divisible "
                        f"by the SP degree {sp}; xfuser 0.7.0 would attend to its zero padding and change the image. "
                        f"Choose a resolution / max_sequence_length divisible by {sp}."
                    )
            return original(self, hidden_states, encoder_hidden_states, *args, **kwargs)

        return forward

    _wrap(cls, "forward", make)


# --------------------------------------------------------------------------- the sp backend


def _add_backend_args(parser) -> None:
    from cocodiff_xfuser.autotune import MODES

    group = parser.add_argument_group("cocodiff-xfuser")
    default = os.environ.get(BACKEND_ENV, "ulysses").strip().lower() or "ulysses"
    if default not in SP_BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={default!r}: expected one of {', '.join(SP_BACKENDS)}")
    group.add_argument(
        "--sp_backend",
        "--sp-backend",
        choices=SP_BACKENDS,
        default=default,
        help=f"Sequence-parallel backend: stock 'ulysses' or 'cocodiff' (default from ${BACKEND_ENV}, else ulysses).",
    )
    group.add_argument(
        "--cocodiff_topology",
        "--cocodiff-topology",
        default=None,
        help="cocodiff: hardware levels as NxL[xT] (nodes x ranks per node [x tiles]), a preset in configs/ "
        "(aurora, dgx-h100) or 'auto' (detected from hostnames and LOCAL_WORLD_SIZE; the default).",
    )
    group.add_argument(
        "--cocodiff_a2a",
        "--cocodiff-a2a",
        choices=MODES,
        default="auto",
        help="cocodiff: all-to-all algorithm; 'auto' measures flat vs hierarchical per message size.",
    )
    group.add_argument(
        "--cocodiff_v_first",
        "--cocodiff-v-first",
        action="store_true",
        help="cocodiff: V-First attention processors (V's exchange overlaps Q/K projection, norm and RoPE).",
    )


_BACKEND_KEYS = ("sp_backend", "cocodiff_topology", "cocodiff_a2a", "cocodiff_v_first")


def _patch_args(args_module: types.ModuleType) -> None:
    cls = _target(args_module, "xFuserArgs")

    def adding_flags(original):
        def add_args(parser):
            parser = original(parser)
            if "--sp_backend" not in parser._option_string_actions:
                _add_backend_args(parser)
            return parser

        return add_args

    _wrap(cls, "add_cli_args", adding_flags)
    _wrap(cls, "add_runner_args", adding_flags)

    # from_*_args keep only dataclass fields; carry ours across as plain attributes.
    def carrying(get):
        def make(original):
            def from_args(klass, args):
                engine_args = original(klass, args)
                for key in _BACKEND_KEYS:
                    setattr(engine_args, key, get(args, key))
                return engine_args

            return from_args

        return make

    _wrap(cls, "from_cli_args", carrying(lambda args, key: getattr(args, key, None)))
    _wrap(cls, "from_runner_args", carrying(lambda args, key: args.get(key)))

    def make(original):
        def create_config(self):
            engine_config, input_config = original(self)
            for key in _BACKEND_KEYS:
                setattr(engine_config.runtime_config, key, getattr(self, key, None))
            return engine_config, input_config

        return create_config

    _wrap(cls, "create_config", make)


def _activating_backend(original):
    def _check_distributed_env(self, parallel_config):
        original(self, parallel_config)
        from cocodiff_xfuser import backend

        config = self.runtime_config
        name = getattr(config, "sp_backend", None) or os.environ.get(BACKEND_ENV, "ulysses")
        if name not in SP_BACKENDS:
            raise ValueError(f"unknown sp backend {name!r}: expected one of {', '.join(SP_BACKENDS)}")
        if name == "cocodiff" and parallel_config.tp_degree > 1:
            # xfuser 0.7.0 builds SP groups that do not line up with yunchang's Ulysses groups
            # under tensor parallelism.
            logger.warning("cocodiff: tensor parallelism is not supported; falling back to stock Ulysses")
            backend.deactivate()
        elif name == "cocodiff":
            from xfuser.core.distributed import get_sp_group

            options = backend.Options(
                topology=getattr(config, "cocodiff_topology", None),
                algorithm=getattr(config, "cocodiff_a2a", None) or "auto",
                v_first=bool(getattr(config, "cocodiff_v_first", False)),
            )
            backend.activate(get_sp_group().ulysses_group, options)
        else:
            backend.deactivate()

    return _check_distributed_env


def _routed_all_to_all(original):
    def _sdpa_all_to_all_single(x):
        from cocodiff_xfuser import backend, commstats

        active = backend.active()
        exchange = original if active is None else active.all_to_all
        if not commstats.enabled():
            return exchange(x)
        commstats.synchronize()
        started = time.perf_counter()
        out = exchange(x)
        commstats.synchronize()
        commstats.record_exchange(x.numel() * x.element_size(), time.perf_counter() - started)
        return out

    return _sdpa_all_to_all_single


def _adapting_model_after(original, get_transformers):
    """After a model loads: fall back to stock for unsupported models, else install V-First."""

    def wrapper(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        from cocodiff_xfuser import backend, processors

        active = backend.active()
        if active is None:
            return result
        transformers = get_transformers(self, result)
        reason = next(filter(None, map(processors.unsupported_reason, transformers)), None)
        if reason is not None:
            logger.warning("cocodiff: %s; falling back to stock Ulysses", reason)
            backend.deactivate()
        elif active.options.v_first:
            for transformer in transformers:
                processors.install(transformer)
        return result

    return wrapper


def _patch_runner_base_model(module: types.ModuleType) -> None:
    def transformers(model, pipe):
        return [getattr(pipe, name) for name in ("transformer", "transformer_2") if getattr(pipe, name, None) is not None]

    cls = _target(module, "xFuserModel")
    _wrap(cls, "initialize", lambda original: _adapting_model_after(original, lambda m, _: transformers(m, m.pipe)))
    from cocodiff_xfuser import tiny_models

    tiny_models.register(module)


def _patch_base_pipeline(module: types.ModuleType) -> None:
    cls = _target(module, "xFuserPipelineBaseWrapper")
    _wrap(cls, "_convert_transformer_backbone", lambda original: _adapting_model_after(original, lambda _, t: [t]))


_HOOKS: dict[str, tuple[Callable | None, Callable | None]] = {
    "xfuser.envs": (None, _patch_envs),
    **{name: (_open_yunchang_gate, _close_yunchang_gate) for name in _YUNCHANG_GATED[1:]},
    _YUNCHANG_GATED[0]: (_open_yunchang_gate, _after_usp),
    "xfuser.config.args": (None, _patch_args),
    "xfuser.core.distributed.parallel_state": (None, _patch_parallel_state),
    "xfuser.core.distributed.group_coordinator": (None, _patch_group_coordinator),
    "xfuser.core.distributed.runtime_state": (None, _patch_runtime_state),
    "xfuser.core.distributed.attention_backend": (None, _patch_attention_backends),
    "xfuser.model_executor.models.runner_models.loading.placement": (None, _patch_placement),
    "xfuser.model_executor.models.runner_models.base_model": (None, _patch_runner_base_model),
    "xfuser.model_executor.pipelines.base_pipeline": (None, _patch_base_pipeline),
    "xfuser.model_executor.pipelines.pipeline_flux": (None, _patch_generator_devices),
    "xfuser.model_executor.pipelines.pipeline_stable_diffusion_3": (None, _patch_generator_devices),
    "xfuser.model_executor.models.transformers.transformer_flux": (None, _patch_transformer_flux),
    "xfuser.model_executor.layers.attention_processor": (None, _patch_attention_processor),
    "xfuser.model_executor.models.transformers.transformer_qwen": (None, _patch_transformer_qwen),
}
