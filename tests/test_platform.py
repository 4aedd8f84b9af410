"""Platform detection and the XPU code paths, with the device mocked (no XPU here)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from cocodiff_xfuser import compat, platform
from cocodiff_xfuser.xfuser import devices


@pytest.fixture
def fresh_detect():
    platform.detect.cache_clear()
    yield
    platform.detect.cache_clear()


@pytest.fixture
def fake_xpu(monkeypatch, fresh_detect):
    calls = []
    xpu = types.SimpleNamespace(
        is_available=lambda: True,
        _is_in_bad_fork=lambda: True,  # keeps torch.manual_seed from seeding the fake device itself
        set_device=lambda i: calls.append(("set_device", i)),
        synchronize=lambda device=None: calls.append(("synchronize",)),
        manual_seed_all=lambda s: calls.append(("seed", s)),
        Event=lambda enable_timing=True: ("xpu-event", enable_timing),
    )
    monkeypatch.setattr(torch, "xpu", xpu, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.distributed, "is_xccl_available", lambda: True)
    return calls


def test_cpu_uses_gloo(fresh_detect):
    plat = platform.detect()
    assert (plat.name, plat.dist_backend) == ("cpu", "gloo")
    assert plat.device(3) == torch.device("cpu")


def test_xpu_uses_native_xccl(fake_xpu):
    plat = platform.detect()
    assert (plat.name, plat.dist_backend) == ("xpu", "xccl")
    assert plat.device(1) == torch.device("xpu", 1)
    plat.set_device(1)
    plat.synchronize()
    plat.manual_seed(7)
    assert fake_xpu == [("set_device", 1), ("synchronize",), ("seed", 7)]
    assert plat.event() == ("xpu-event", True)


def test_xpu_falls_back_to_oneccl_bindings(fake_xpu, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_xccl_available", lambda: False)
    monkeypatch.setitem(sys.modules, "oneccl_bindings_for_pytorch", types.ModuleType("oneccl_bindings_for_pytorch"))
    monkeypatch.setattr(platform.importlib.util, "find_spec", lambda name: object())
    assert platform.detect().dist_backend == "ccl"


def test_xpu_without_any_collective_backend_is_a_clear_error(fake_xpu, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_xccl_available", lambda: False)
    monkeypatch.setattr(platform.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="xccl"):
        platform.detect()


def test_host_event_times_like_a_cuda_event():
    start, end = platform.HostEvent(), platform.HostEvent()
    start.record()
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0.0
    with pytest.raises(RuntimeError):
        platform.HostEvent().elapsed_time(end)


def test_xfuser_envs_report_the_xpu(fake_xpu):
    def no_answer():
        raise NotImplementedError("No Accelerators")

    # xfuser's answers on a host it knows no device of: it falls through to the CPU, or has none.
    envs = types.ModuleType("fake_envs")
    envs.__dict__.update(_is_cuda=lambda: True, _is_hip=lambda: False, get_device=lambda local_rank: torch.device("cpu"),
                         get_device_name=lambda: "cpu", get_platform=lambda: "cpu",
                         get_device_version=no_answer, get_torch_distributed_backend=no_answer)
    envs.PACKAGES_CHECKER = types.SimpleNamespace(packages_info={"has_long_ctx_attn": False})
    saved = (torch.cuda.synchronize, torch.cuda.Event)
    try:
        devices.patch_envs(envs, cocodiff_requested=False)
        assert envs.get_torch_distributed_backend() == "xccl"
        assert envs.get_device(2) == torch.device("xpu", 2)
        assert envs.get_device_name() == envs.get_platform() == "xpu"
        assert envs.get_device_version() is None and envs._is_cuda() is False
        assert envs.PACKAGES_CHECKER.packages_info["has_long_ctx_attn"] is True
        torch.cuda.synchronize()
        assert fake_xpu[-1] == ("synchronize",)
        assert torch.cuda.Event(enable_timing=True) == ("xpu-event", True)
    finally:
        torch.cuda.synchronize, torch.cuda.Event = saved


def test_xpu_device_is_bound_before_the_process_group_starts(fake_xpu, monkeypatch):
    ps = types.ModuleType("fake_parallel_state")
    ps.set_device = None
    ps.init_distributed_environment = lambda *a, **k: fake_xpu.append(("init",))
    monkeypatch.setenv("LOCAL_RANK", "3")
    devices.patch_parallel_state(ps)
    ps.init_distributed_environment()
    assert fake_xpu == [("set_device", 3), ("init",)]


def test_xpu_seeding_and_synchronize_go_to_the_device(fake_xpu):
    rs = types.ModuleType("fake_runtime_state")
    rs.device_manual_seed = rs.device_manual_seed_all = None

    class RuntimeState:
        def _check_distributed_env(self, parallel_config):
            pass

        def _select_attention_backend(self, engine_config=None):
            pass

    rs.RuntimeState = RuntimeState
    devices.patch_runtime_state(rs)
    rs.device_manual_seed(5)
    gc = types.ModuleType("fake_group_coordinator")
    gc.synchronize = None

    class PipelineGroupCoordinator:  # PipeFusion's sends (the gloo workaround wraps them on hosts without CUDA)
        def _communicate_shapes(self, tensor_send_to_next=None, recv_prev=False):
            pass

        def _pipeline_isend(self, tensor):
            pass

        def _pipeline_isend_skip(self, tensor):
            pass

    gc.PipelineGroupCoordinator = PipelineGroupCoordinator
    devices.patch_group_coordinator(gc)
    gc.synchronize()
    assert fake_xpu == [("seed", 5), ("synchronize",)]
    assert all(compat.is_wrapped(getattr(PipelineGroupCoordinator, name)) for name in
               ("_communicate_shapes", "_pipeline_isend", "_pipeline_isend_skip"))


def test_mpiexec_environment_is_adopted():
    env = {"PMI_RANK": "5", "PMI_SIZE": "24", "PALS_LOCAL_RANKID": "5", "PMI_LOCAL_SIZE": "12"}
    assert platform.adopt_mpi_environment(env) is True
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("5", "24", "5", "12")
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "7"}
    assert platform.adopt_mpi_environment(torchrun) is False and torchrun["RANK"] == "1"
    assert platform.adopt_mpi_environment({}) is False
