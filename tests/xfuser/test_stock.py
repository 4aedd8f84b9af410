"""Stock is stock: on a CUDA host, without ``--sp-backend cocodiff``, the patches change nothing.

The host is a CUDA one as far as the plugin can tell (``platform.detect``); the xfuser modules
are stand-ins holding the attributes each patch targets, so that any replacement shows.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

from cocodiff_xfuser import platform
from cocodiff_xfuser.xfuser import devices, job, workarounds


@pytest.fixture
def cuda_host(monkeypatch):
    cuda = platform.Platform("cuda", "nccl")
    for module in (platform, devices, workarounds):
        monkeypatch.setattr(module, "detect", lambda: cuda)
    monkeypatch.setattr(job, "_EXCHANGER", None)


def _module(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    for key, value in attributes.items():
        setattr(module, key, value)
    return module


def _stock(*_a, **_k):
    return "stock"


def test_no_environment_rewrite_and_no_replaced_torch_functions(cuda_host, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "2")
    names = ("get_device_version", "get_torch_distributed_backend", "get_device", "get_device_name", "get_platform")
    envs = _module("envs", **{name: _stock for name in names},
                   PACKAGES_CHECKER=types.SimpleNamespace(packages_info={"has_long_ctx_attn": False}))
    saved = torch.cuda.synchronize, torch.cuda.Event
    devices.patch_envs(envs, cocodiff_requested=False)
    assert "RANK" not in os.environ
    assert all(getattr(envs, name) is _stock for name in names)
    assert envs.PACKAGES_CHECKER.packages_info["has_long_ctx_attn"] is False
    assert (torch.cuda.synchronize, torch.cuda.Event) == saved
    devices.patch_envs(envs, cocodiff_requested=True)  # with the flag, mpiexec's ranks are adopted
    assert os.environ["RANK"] == "1"


def test_no_device_patch_on_cuda(cuda_host):
    class RuntimeState:
        _select_attention_backend = _stock

    state = _module("runtime_state", device_manual_seed=_stock, device_manual_seed_all=_stock, RuntimeState=RuntimeState)
    parallel = _module("parallel_state", set_device=_stock, init_distributed_environment=_stock)
    coordinator = _module("group_coordinator", synchronize=_stock)
    placement = _module("placement", place_pipeline_components=_stock)
    registry = {}
    backends = _module("attention_backend", ATTENTION_FUNCTION_REGISTRY=registry,
                       AttentionBackendType=types.SimpleNamespace(SDPA_FLASH="flash"))
    before = {m: dict(vars(m)) for m in (state, parallel, coordinator, placement, backends)}
    devices.patch_runtime_state(state)
    devices.patch_parallel_state(parallel)
    devices.patch_group_coordinator(coordinator)
    devices.patch_placement(placement)
    devices.patch_attention_backends(backends)
    assert {m: dict(vars(m)) for m in before} == before and registry == {}
    assert RuntimeState._select_attention_backend is _stock
    gate = _module("usp")
    devices.open_yunchang_gate(gate)
    assert "_cocodiff_saved_is_npu" not in vars(gate)


def test_workarounds_keep_stock_behaviour(cuda_host):
    class Flux:
        def pad_to_sp_divisible(self, *a):
            pass

    class Joint:
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
            return "stock"

    class Qwen:
        def forward(self, hidden_states, encoder_hidden_states=None, *args, **kwargs):
            return "stock"

    workarounds.patch_transformer_flux(_module("transformer_flux", xFuserFlux1Transformer2DWrapper=Flux))
    workarounds.patch_attention_processor(_module("attention_processor", xFuserJointAttnProcessor2_0=Joint))
    workarounds.patch_transformer_qwen(_module("transformer_qwen", xFuserQwenImageTransformerWrapper=Qwen))
    with pytest.raises(AttributeError, match="_pad_to_sp_divisible"):  # stock xfuser 0.7.0's crash
        Flux()._pad_to_sp_divisible(torch.zeros(3), 1, 0)
    assert Joint()(None, torch.zeros(1, 4, 8)) == "stock"  # attn2 goes to the stock processor
    assert Qwen().forward(torch.zeros(1, 3, 8), torch.zeros(1, 5, 8)) == "stock"  # no refusal
