"""The accelerator this process runs on: CUDA + nccl, Intel XPU + xccl (or oneCCL's ccl), or CPU + gloo.

xfuser 0.7.0 assumes CUDA-like devices in many places; :mod:`cocodiff_xfuser.xfuser.devices`
routes those places through the :class:`Platform` detected here. Nothing in this module
patches anything.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger("cocodiff_xfuser")


@dataclass(frozen=True)
class Platform:
    """A device type and the process-group backend that talks between its devices."""

    name: str  # "cuda", "xpu" or "cpu"
    dist_backend: str  # "nccl", "xccl", "ccl" or "gloo"

    @property
    def is_cuda(self) -> bool:
        return self.name == "cuda"

    def device(self, local_rank: int) -> torch.device:
        if self.name == "cpu":
            return torch.device("cpu")
        return torch.device(self.name, local_rank)

    def current_device(self) -> torch.device:
        """The device this process computes on (``set_device``'s)."""
        return self.device(0 if self.name == "cpu" else getattr(torch, self.name).current_device())

    def set_device(self, local_rank: int) -> None:
        if self.name != "cpu":
            getattr(torch, self.name).set_device(local_rank)

    def synchronize(self, device: torch.device | None = None) -> None:
        """Wait for the queued work of ``device`` (default: the current one); a no-op on CPU."""
        if self.name != "cpu":
            getattr(torch, self.name).synchronize(device if device is not None and device.type == self.name else None)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        if self.name != "cpu":
            getattr(torch, self.name).manual_seed_all(seed)

    def event(self, enable_timing: bool = True):
        """A timing event with the ``record``/``synchronize``/``elapsed_time`` API of ``torch.cuda.Event``."""
        if self.name == "cpu":
            return HostEvent()
        return getattr(torch, self.name).Event(enable_timing=enable_timing)


class HostEvent:
    """``torch.cuda.Event`` stand-in for CPU: records the host clock (CPU ops are synchronous)."""

    def __init__(self, enable_timing: bool = True, **_: object) -> None:
        self._t: float | None = None

    def record(self, stream: object = None) -> None:
        self._t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream: object = None) -> None:
        pass

    def elapsed_time(self, end: "HostEvent") -> float:
        """Milliseconds from this event to ``end``, like ``torch.cuda.Event.elapsed_time``."""
        if self._t is None or end._t is None:
            raise RuntimeError("both events must be recorded before elapsed_time()")
        return (end._t - self._t) * 1000.0


def _xpu_available() -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def _xpu_backend() -> str:
    """torch's native ``xccl`` (torch >= 2.8); oneCCL's legacy ``ccl`` only when xccl is missing."""
    if torch.distributed.is_xccl_available():
        return "xccl"
    if importlib.util.find_spec("oneccl_bindings_for_pytorch") is not None:
        import oneccl_bindings_for_pytorch  # noqa: F401  (registers the "ccl" backend)

        logger.warning("cocodiff: torch has no xccl backend; falling back to legacy oneCCL bindings (ccl)")
        return "ccl"
    raise RuntimeError(
        "Intel XPU found but torch has no 'xccl' process-group backend and oneccl_bindings_for_pytorch "
        "is not installed; install torch>=2.8 built with XPU support"
    )


#: torch.distributed's env:// names, and where MPI launchers (Open MPI, MPICH/PMI, PALS on Aurora)
#: put the same facts.
MPI_ENV = {
    "RANK": ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "PALS_RANKID"),
    "WORLD_SIZE": ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"),
    "LOCAL_RANK": ("OMPI_COMM_WORLD_LOCAL_RANK", "PMI_LOCAL_RANK", "PALS_LOCAL_RANKID", "MPI_LOCALRANKID"),
    "LOCAL_WORLD_SIZE": ("OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_LOCAL_SIZE", "MPI_LOCALNRANKS"),
}


def adopt_mpi_environment(env: dict | None = None) -> bool:
    """Under ``mpiexec`` (no torchrun), fill RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE from the
    MPI launcher's variables so xfuser's ``env://`` initialization works. MASTER_ADDR/MASTER_PORT
    stay the job script's to set (e.g. the first host of the PBS node file). Returns whether it did."""
    env = os.environ if env is None else env
    if "RANK" in env:
        return False
    found = {name: next((env[k] for k in keys if k in env), None) for name, keys in MPI_ENV.items()}
    if found["RANK"] is None or found["WORLD_SIZE"] is None:
        return False
    for name, value in found.items():
        if value is not None:
            env[name] = value
    return True


@functools.lru_cache(maxsize=None)
def detect() -> Platform:
    """The platform of this process, decided once: CUDA (or ROCm) first, then XPU, else CPU."""
    if torch.cuda.is_available():
        return Platform("cuda", "nccl")
    if _xpu_available():
        return Platform("xpu", _xpu_backend())
    return Platform("cpu", "gloo")
