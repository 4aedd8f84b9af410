"""``cocodiff verify``: stock xfuser Ulysses vs the cocodiff backend, same seeds, compared."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from cocodiff_xfuser.comm.topology import Topology
from cocodiff_xfuser.tools import launcher
from cocodiff_xfuser.tools.generate import output_dir
from cocodiff_xfuser.tools.models import tiny as tiny_models

REFERENCE = "stock-ulysses"
TIMEOUT_S = 600.0  # seconds per torchrun job
PROMPT = "a lighthouse on a cliff at dawn"


@dataclass
class Run:
    """What to generate: a tiny model under a parallel layout."""

    model: str
    ulysses_degree: int
    ring_degree: int = 1
    cfg: bool = False  # CFG parallel: the two guidance halves on two rank groups
    topology: str | None = None
    steps: int | None = None
    height: int | None = None
    width: int | None = None
    seed: int = 42
    v_first: bool = False
    extra: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.ulysses_degree * self.ring_degree * (2 if self.cfg else 1)

    def check(self) -> None:
        """Clear errors for bad input, before any process starts (and so before anything can hang)."""
        if self.model not in tiny_models.SPECS:
            raise ValueError(f"unknown model {self.model!r}; choose from {', '.join(tiny_models.SPECS)}")
        if self.ulysses_degree < 1 or self.ring_degree < 1:
            raise ValueError("--ulysses-degree and --ring-degree must be >= 1")
        tiny_models.check_heads(self.model, self.ulysses_degree)
        for name, value in (("--steps", self.steps), ("--size/--height", self.height), ("--width", self.width)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.topology is not None:
            Topology.parse(self.topology).validate(self.world_size)

    def argv(self, backends: Sequence[str], out: Path, save_png: bool = False) -> list[str]:
        argv = ["-m", "cocodiff_xfuser.tools.generate", "--out", str(out), "--backends", ",".join(backends)]
        argv += ["--save-png"] if save_png else []
        argv += [
            "--model", tiny_models.SPECS[self.model].model_id,
            "--ulysses_degree", str(self.ulysses_degree),
            "--ring_degree", str(self.ring_degree),
            *(["--use_cfg_parallel"] if self.cfg else []),
            "--prompt", PROMPT,
            "--seed", str(self.seed),
        ]
        for flag, value in (("--num_inference_steps", self.steps), ("--height", self.height), ("--width", self.width)):
            if value is not None:
                argv += [flag, str(value)]
        if self.v_first:
            argv += ["--cocodiff_v_first"]
        if self.topology:
            argv += ["--cocodiff_topology", self.topology]
        return argv + list(self.extra)


def generate(
    run: Run, backends: Sequence[str], out: Path, timeout: float = TIMEOUT_S, save_png: bool = False
) -> dict[str, dict]:
    """One torchrun job generating with each backend in turn; backend -> result.json plus images."""
    launcher.torchrun(run.world_size, run.argv(backends, out, save_png), timeout=timeout)
    results = {}
    for backend in backends:
        where = output_dir(out, tiny_models.SPECS[run.model].model_id, backend)
        results[backend] = {**json.loads((where / "result.json").read_text()), "images": np.load(where / "images.npy")}
    return results


def compare(reference: np.ndarray, candidate: np.ndarray) -> dict:
    return {
        "max_abs_diff": float(np.abs(reference.astype(np.float64) - candidate.astype(np.float64)).max()),
        "bitwise_equal": reference.dtype == candidate.dtype
        and reference.shape == candidate.shape
        and reference.tobytes() == candidate.tobytes(),
    }


def verify(run: Run, timeout: float = TIMEOUT_S, workdir: Path | None = None) -> dict:
    """Stock Ulysses, then cocodiff, on the same layout and seed; the comparison as a dict."""
    run.check()
    tiny_models.ensure_fixture(run.model)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        results = generate(run, ("ulysses", "cocodiff"), Path(tmp), timeout)
    stock, ours = results["ulysses"], results["cocodiff"]
    return {
        "model": run.model,
        "ulysses_degree": run.ulysses_degree,
        "ring_degree": run.ring_degree,
        "cfg_parallel": run.cfg,
        "topology": run.topology,
        "v_first": run.v_first,
        "world_size": run.world_size,
        "reference": REFERENCE,
        **compare(stock["images"], ours["images"]),
        "seconds_stock": stock["seconds"],
        "seconds_cocodiff": ours["seconds"],
        "image_shape": list(stock["images"].shape),
        # What ran, summed over the ranks: proof that the cocodiff path under test ran.
        "ran": {"ulysses": stock["ran"], "cocodiff": ours["ran"]},
    }


def format_report(report: dict) -> str:
    ran = report["ran"]["cocodiff"]
    verdict = "BITWISE EQUAL" if report["bitwise_equal"] else f"DIFFERENT (max abs diff {report['max_abs_diff']:.3g})"
    return (
        f"{report['model']}: ulysses {report['ulysses_degree']} x ring {report['ring_degree']}"
        f" (topology {report['topology'] or 'detected'}), images {report['image_shape']}\n"
        f"  {REFERENCE}: {report['seconds_stock']:.3f} s   cocodiff: {report['seconds_cocodiff']:.3f} s\n"
        f"  cocodiff vs {REFERENCE}: {verdict}\n"
        f"  cocodiff ran: exchanges {ran['exchanges']}, V-First calls {ran['v_first_calls']}, fall-backs {ran['fallbacks'] or 'none'}"
    )


def main(args, extra: Sequence[str] = ()) -> int:
    run = Run(
        model=args.model,
        ulysses_degree=args.ulysses_degree,
        ring_degree=args.ring_degree,
        cfg=args.cfg_parallel,
        topology=args.topology,
        steps=args.steps,
        v_first=args.v_first,
        extra=tuple(extra),
    )
    report = verify(run, timeout=args.timeout)
    print(json.dumps(report) if args.json else format_report(report))
    return 0 if report["bitwise_equal"] else 1

