"""Run one of xDiT's example scripts, unmodified, on a host without CUDA; record what it made.

``torchrun ... cuda_shim.py SCRIPT [its arguments]``. The examples hard-code CUDA
(``pipe.to(f"cuda:{local_rank}")``, ``torch.Generator(device="cuda")``, CUDA memory statistics):
here the first two go to the CPU and the statistics read 0; nothing else of the script changes.
Each rank then writes to ``$XDIT_EXAMPLE_OUT/rank{RANK}.pt`` the images its pipeline decoded, as
floats before they became 8-bit PNGs (the pipeline outputs on the last rank), and what cocodiff
ran on it (``commstats.ran()``), for the test to compare and to assert on.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import torch


def _cpu(device):
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _Generator(torch.Generator):
    """``torch.Generator(device="cuda")`` as a CPU generator (the same numbers as on the CPU)."""

    def __new__(cls, device="cpu"):
        return super().__new__(cls, device=_cpu(device))

    def __init__(self, device="cpu") -> None:
        pass


def main() -> None:
    from diffusers import DiffusionPipeline
    from diffusers.image_processor import VaeImageProcessor

    from cocodiff_xfuser import commstats

    script, *argv = sys.argv[1:]
    torch.Generator = _Generator
    torch.cuda.max_memory_allocated = lambda *args, **kwargs: 0
    torch.cuda.reset_peak_memory_stats = lambda *args, **kwargs: None
    to = DiffusionPipeline.to
    DiffusionPipeline.to = lambda self, *args, **kwargs: to(self, *map(_cpu, args), **{k: _cpu(v) for k, v in kwargs.items()})
    decoded = []
    postprocess = VaeImageProcessor.postprocess

    def recorded(self, image, *args, **kwargs):
        decoded.append(image.detach().float().cpu().clone())
        return postprocess(self, image, *args, **kwargs)

    VaeImageProcessor.postprocess = recorded
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")
    out = Path(os.environ["XDIT_EXAMPLE_OUT"])
    torch.save({"images": decoded, "ran": commstats.ran()}, out / f"rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main()
