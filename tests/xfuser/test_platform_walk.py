"""Every xfuser 0.7.0 pipeline on a host without CUDA, with the device mocked as XPU: whatever its
run builds on "cuda" is built on the platform's device, or the pipeline refuses in one line.

Two registries: the example scripts' pipeline wrappers, whose warm-up (``prepare_run``) is run
against a stand-in pipeline, and the ``xdit`` runner's models, whose own modules are read for
"cuda" devices (running them needs their checkpoints).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import sys
import types

import pytest
import torch

from cocodiff_xfuser import compat, platform
from cocodiff_xfuser.xfuser import devices

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the platform patches apply on hosts without CUDA")


@pytest.fixture
def xpu(monkeypatch) -> list[str]:
    """The platform is XPU; returns the device types every ``torch.Generator`` is built on."""
    built: list[str] = []

    class Generator:  # this host has no XPU to build a real one on
        def __init__(self, device="cpu"):
            built.append(torch.device(device).type)

        def manual_seed(self, seed):
            return self

    monkeypatch.setattr(devices, "detect", lambda: platform.Platform("xpu", "xccl"))
    monkeypatch.setattr(torch, "Generator", Generator)
    return built


def _import_all(package: types.ModuleType, prefix: str = "") -> None:
    """Import every module of ``package`` whose name starts with ``prefix``: registration happens on import."""
    for module in pkgutil.iter_modules(package.__path__):
        if not module.ispkg and module.name.startswith(prefix):
            importlib.import_module(f"{package.__name__}.{module.name}")


def _pipeline_wrappers() -> list[type]:
    import xfuser.model_executor.pipelines as pipelines
    from xfuser.model_executor.pipelines.register import xFuserPipelineWrapperRegister

    _import_all(pipelines, "pipeline_")
    return sorted(set(compat.target(xFuserPipelineWrapperRegister, "_XFUSER_PIPE_MAPPING").values()), key=lambda c: c.__name__)


def test_every_example_pipeline_warms_up_on_the_platform_device(xpu, monkeypatch):
    wrappers = _pipeline_wrappers()
    assert len(wrappers) >= 15, [c.__name__ for c in wrappers]
    state = types.SimpleNamespace(runtime_config=types.SimpleNamespace(warmup_steps=1))
    for cls in wrappers:
        module = sys.modules[cls.prepare_run.__module__]
        monkeypatch.setattr(module, "get_runtime_state", lambda: state)
        if hasattr(module, "get_fast_attn_enable"):
            monkeypatch.setattr(module, "get_fast_attn_enable", lambda: False)
        calls = []
        pipe = types.SimpleNamespace(__call__=lambda **kwargs: calls.append(kwargs))
        config = types.SimpleNamespace(height=64, width=64, batch_size=1, output_type="latent", max_sequence_length=32,
                                       use_resolution_binning=False, guidance_scale=1.0)
        xpu.clear()
        cls.prepare_run(pipe, config)
        assert len(calls) == 1 and xpu == ["xpu"], f"{cls.__name__}: generators built on {xpu}"


def _cuda_devices(module: types.ModuleType) -> list[tuple[str, bool]]:
    """Each "cuda" device in the module's functions: (function, whether it is a generator's)."""
    found = set()
    for function in ast.walk(ast.parse(inspect.getsource(module))):
        if not isinstance(function, ast.FunctionDef):
            continue
        generators = {
            id(keyword.value)
            for call in ast.walk(function)
            if isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "Generator"
            for keyword in call.keywords
            if keyword.arg == "device"
        }
        for node in ast.walk(function):
            text = node.values[0] if isinstance(node, ast.JoinedStr) and node.values else node
            if isinstance(text, ast.Constant) and isinstance(text.value, str) and text.value.split(":")[0] == "cuda":
                found.add((function.name, id(node) in generators))
    return sorted(found)


def test_every_runner_model_builds_on_the_platform_device_or_refuses(xpu, monkeypatch):
    import xfuser.model_executor.models.runner_models as runner_models
    from xfuser.model_executor.models.runner_models import base_model

    _import_all(runner_models)
    registry = dict(base_model.MODEL_REGISTRY)
    assert len(registry) >= 90
    checked = set()
    for cls in registry.values():
        module = sys.modules[cls.__module__]
        found = _cuda_devices(module)
        if not found or module.__name__ in checked:
            continue
        checked.add(module.__name__)
        assert module.__name__ in devices.CUDA_GENERATORS, f"{module.__name__} builds on cuda in {found}"
        module.torch.Generator(device="cuda")
        assert xpu[-1] == "xpu", f"{module.__name__} builds its generator on {xpu[-1]}"
        refused = devices.CUDA_ONLY_RUNNERS.get(module.__name__)
        placements = {name for name, generator in found if not generator}
        if not placements:
            assert refused is None
            continue
        assert refused is not None, f"{module.__name__} places on cuda in {sorted(placements)}"
        owner, method, _ = refused
        assert method == "__init__" or placements == {method}, f"{module.__name__} also places on cuda in {sorted(placements - {method})}"
        with pytest.raises(NotImplementedError, match=f"{owner}.*cannot run on xpu"):
            getattr(compat.target(module, owner), method)(object.__new__(compat.target(module, owner)))
    assert len(checked) == 5, sorted(checked)
    # Every runner's CPU offload brings its components back to this rank's device.
    monkeypatch.setattr(base_model, "get_world_group", lambda: types.SimpleNamespace(local_rank=3))
    assert base_model.xFuserModel._local_onload_device(None) == torch.device("xpu", 3)
