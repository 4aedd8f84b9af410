"""The platform patches defer to xfuser's own logic wherever it is not CUDA-only, on this host
(no CUDA); the XPU answers are in tests/test_platform.py."""

from __future__ import annotations

import importlib.metadata
import types

import pytest
import torch

from cocodiff_xfuser import platform
from cocodiff_xfuser.xfuser import devices, workarounds

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the platform patches apply on hosts without CUDA")


def test_xfusers_own_device_answers_stand(monkeypatch):
    for name in ("synchronize", "Event"):  # patch_envs shims them (once per process)
        monkeypatch.setattr(torch.cuda, name, getattr(torch.cuda, name))
    envs = types.ModuleType("fake_envs")
    envs.__dict__.update(_is_cuda=lambda: True, _is_hip=lambda: True, get_device=lambda local_rank: torch.device("mps"),
                         get_device_name=lambda: "mps", get_platform=lambda: "mps", get_device_version=lambda: None,
                         get_torch_distributed_backend=lambda: "gloo",
                         PACKAGES_CHECKER=types.SimpleNamespace(packages_info={}))
    devices.patch_envs(envs, cocodiff_requested=False)
    assert (envs.get_device(0), envs.get_device_name(), envs.get_platform()) == (torch.device("mps"), "mps", "mps")
    # torch's build is not the host's device: here there is none.
    assert not envs._is_cuda() and not envs._is_hip()


class _Pipe:
    def __init__(self):
        self.moved_to = []

    def to(self, device):
        self.moved_to.append(device)
        return self


@pytest.mark.parametrize("plat", [platform.Platform("cpu", "gloo"), platform.Platform("xpu", "xccl")], ids=["cpu", "xpu"])
def test_xfusers_placement_runs_with_its_cuda_move_routed(plat, monkeypatch):
    monkeypatch.setattr(devices, "detect", lambda: plat)
    walked = []

    def place_pipeline_components(loader):  # xfuser's: move, then its own quantization walks
        loader.model.pipe = loader.model.pipe.to("cuda:3")
        walked.append(True)

    placement = types.ModuleType("fake_placement")
    placement.place_pipeline_components = place_pipeline_components
    devices.patch_placement(placement)
    pipe = _Pipe()
    placement.place_pipeline_components(types.SimpleNamespace(model=types.SimpleNamespace(pipe=pipe)))
    assert pipe.moved_to == [plat.device(3)] and walked == [True]
    assert "to" not in vars(pipe)  # the pipeline keeps its own method


def test_long_context_attention_builds_with_the_installed_yunchang(monkeypatch):
    """Sana's linear attention and StepVideo, handed to stock by the backend, need it."""
    from yunchang.globals import PROCESS_GROUP

    monkeypatch.setattr(PROCESS_GROUP, "ULYSSES_PG", object(), raising=False)
    monkeypatch.setattr(PROCESS_GROUP, "RING_PG", object(), raising=False)
    from xfuser.core.long_ctx_attention import xFuserLongContextAttention
    from xfuser.core.long_ctx_attention.ring import ring_npu_flash_attn

    assert xFuserLongContextAttention().ring_attn_fn.__name__ == "xdit_ring_flash_attn_func"
    # What xfuser 0.7.0 imports and yunchang lacks refuses in one line, only where it would run (NPU).
    if ring_npu_flash_attn.update_npu_out.__module__ != workarounds.__name__:
        return  # this yunchang has it
    with pytest.raises(NotImplementedError, match=rf"xfuser 0\.7\.0.*yunchang {importlib.metadata.version('yunchang')}"):
        ring_npu_flash_attn.update_npu_out(None, None, None, None, None, None)
