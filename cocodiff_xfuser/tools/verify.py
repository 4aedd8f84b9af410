"""``cocodiff verify``: stock xfuser Ulysses vs the cocodiff backend, same seeds, compared; with
``--requests``, cocodiff serving requests one after another vs each in a fresh process."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from cocodiff_xfuser.comm.topology import Topology
from cocodiff_xfuser.tools import launcher
from cocodiff_xfuser.tools.generate import case_args, output_dir
from cocodiff_xfuser.tools.models import tiny as tiny_models

REFERENCE = "stock-ulysses"
TIMEOUT_S = 600.0  # seconds per torchrun job
# Against one process (same weights and seed), sharded attention and ring merges reduce in other
# orders; images are in [0, 1]. Stock Ulysses stays within this on every tiny model and layout.
SINGLE_PROCESS_ATOL = 2e-3
PROMPT = "a lighthouse on a cliff at dawn"


@dataclass
class Run:
    """What to generate: a tiny model under a parallel layout."""

    model: str
    ulysses_degree: int
    ring_degree: int = 1
    cfg: bool = False  # CFG parallel: the two guidance halves on two rank groups
    pipefusion: int = 1  # PipeFusion stages (xfuser's --pipefusion_parallel_degree)
    topology: str | None = None
    steps: int | None = None
    height: int | None = None
    width: int | None = None
    seed: int = 42
    v_first: bool = False
    extra: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.ulysses_degree * self.ring_degree * self.pipefusion * (2 if self.cfg else 1)

    def check(self) -> None:
        """Clear errors for bad input, before any process starts (and so before anything can hang)."""
        if self.model not in tiny_models.SPECS:
            raise ValueError(f"unknown model {self.model!r}; choose from {', '.join(tiny_models.SPECS)}")
        if self.ulysses_degree < 1 or self.ring_degree < 1 or self.pipefusion < 1:
            raise ValueError("--ulysses-degree, --ring-degree and the PipeFusion degree must be >= 1")
        if self.pipefusion > 1 and tiny_models.SPECS[self.model].pipefusion_absent:
            raise ValueError(f"PipeFusion with {self.model}: {tiny_models.SPECS[self.model].pipefusion_absent}")
        self.uneven()
        for name, value in (("--steps", self.steps), ("--size/--height", self.height), ("--width", self.width)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.topology is not None:
            Topology.parse(self.topology).validate(self.world_size)

    def uneven(self) -> str | None:
        """What stock Ulysses cannot split on this layout (cocodiff pads it), or None."""
        return tiny_models.uneven(self.model, self.ulysses_degree, self.ring_degree, self.height, self.width)

    def argv(self, backends: Sequence[str], out: Path, save_png: bool = False) -> list[str]:
        argv = ["-m", "cocodiff_xfuser.tools.generate", "--out", str(out), "--backends", ",".join(backends)]
        argv += ["--save-png"] if save_png else []
        return argv + self.runner_argv()

    def runner_argv(self) -> list[str]:
        """The ``xdit`` flags of this run."""
        argv = [
            "--model", tiny_models.SPECS[self.model].model_id,
            "--ulysses_degree", str(self.ulysses_degree),
            "--ring_degree", str(self.ring_degree),
            *(["--use_cfg_parallel"] if self.cfg else []),
            *(["--pipefusion_parallel_degree", str(self.pipefusion)] if self.pipefusion > 1 else []),
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
    """Stock Ulysses, then cocodiff, on the same layout and seed; the comparison as a dict.

    On a layout stock cannot split (heads or tokens not divisible by the degree), cocodiff pads;
    it is then compared with the same model in one process instead.
    """
    run.check()
    tiny_models.ensure_fixture(run.model)
    uneven = run.uneven()
    backends = ("cocodiff",) if uneven else ("ulysses", "cocodiff")
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        results = generate(run, backends, Path(tmp), timeout)
    ours = results["cocodiff"]
    report = {
        "model": run.model,
        "ulysses_degree": run.ulysses_degree,
        "ring_degree": run.ring_degree,
        "cfg_parallel": run.cfg,
        "topology": run.topology,
        "v_first": run.v_first,
        "world_size": run.world_size,
        "image_shape": list(ours["images"].shape),
        "seconds_cocodiff": ours["seconds"],
    }
    if uneven:
        single = tiny_models.reference_images(run.model, PROMPT, run.seed, run.height, run.width, run.steps)
        diff = compare(single, ours["images"])["max_abs_diff"]
        return {
            **report,
            "reference": "single-process",
            "stock": f"cannot run: {uneven}",
            "max_abs_diff_vs_single_process": diff,
            "tolerance": SINGLE_PROCESS_ATOL,
            "within_tolerance": diff <= SINGLE_PROCESS_ATOL,
            "padded_bytes": ours["ran"]["padded_bytes"],
            "ran": {"cocodiff": ours["ran"]},
        }
    stock = results["ulysses"]
    return {
        **report,
        "reference": REFERENCE,
        **compare(stock["images"], ours["images"]),
        "seconds_stock": stock["seconds"],
        # What ran, summed over the ranks: proof that the cocodiff path under test ran.
        "ran": {"ulysses": stock["ran"], "cocodiff": ours["ran"]},
    }


def _served(run: Run, requests: list[dict], out: Path, timeout: float) -> tuple[list[np.ndarray], dict]:
    """``requests`` served by cocodiff in one job, in order: each one's images and what ran (summed
    over the ranks)."""
    out.mkdir(parents=True)
    (out / "requests.json").write_text(json.dumps(requests))
    launcher.torchrun(run.world_size, run.argv(("cocodiff",), out) + ["--cases", str(out / "requests.json")], timeout=timeout)
    where = output_dir(out, tiny_models.SPECS[run.model].model_id, "cocodiff")
    result = json.loads((where / "result.json").read_text())
    if (where / "images.npy").exists():  # every request's images of one size: one array, in order
        images = np.load(where / "images.npy")
        bounds = np.cumsum([0] + [int(r.get("batch_size", 1)) for r in requests])
        return [images[a:b] for a, b in zip(bounds, bounds[1:])], result["ran"]
    return [np.load(where / f"case-{i}.npy") for i in range(len(requests))], result["ran"]


def verify_requests(run: Run, requests: list[dict], timeout: float = TIMEOUT_S, workdir: Path | None = None) -> dict:
    """cocodiff serving ``requests`` one after another in one job against each request alone in a
    fresh job: what a request gives must not depend on what was served before it (every V-Major
    cache, step count and agreement belongs to its own pipeline call)."""
    run.check()
    for request in requests:
        case_args(request)
    tiny_models.ensure_fixture(run.model)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        together, ran = _served(run, requests, Path(tmp) / "together", timeout)
        alone = [_served(run, [request], Path(tmp) / f"alone-{i}", timeout) for i, request in enumerate(requests)]
    rows = [{"request": request, **compare(fresh[0], served), "image_shape": list(served.shape), "ran": fresh_ran}
            for request, served, (fresh, fresh_ran) in zip(requests, together, alone)]
    return {
        "model": run.model,
        "ulysses_degree": run.ulysses_degree,
        "ring_degree": run.ring_degree,
        "topology": run.topology,
        "world_size": run.world_size,
        "flags": list(run.extra) + (["--cocodiff_v_first"] if run.v_first else []),
        "requests": rows,
        "bitwise_equal": all(row["bitwise_equal"] for row in rows),
        "ran": ran,  # the job that served them all, summed over the ranks
    }


def format_requests(report: dict) -> str:
    lines = [f"{report['model']}: ulysses {report['ulysses_degree']} x ring {report['ring_degree']} (topology "
             f"{report['topology'] or 'detected'}), {' '.join(report['flags']) or 'cocodiff'}: {len(report['requests'])} "
             f"requests served in one job vs each in a fresh job"]
    for i, row in enumerate(report["requests"]):
        verdict = "bitwise equal" if row["bitwise_equal"] else f"DIFFERENT (max abs diff {row['max_abs_diff']:.3g})"
        lines.append(f"  {i}: {json.dumps(row['request'])} -> images {row['image_shape']}: {verdict}")
    ran = report["ran"]
    lines.append(f"  ran: exchanges {ran['exchanges']}, V-Major sparse exchanges {ran['v_major_sparse'] or 'none'}, "
                 f"fall-backs {ran['fallbacks'] or 'none'}")
    return "\n".join(lines)


def format_report(report: dict) -> str:
    ran = report["ran"]["cocodiff"]
    if report["reference"] != REFERENCE:
        verdict = "within" if report["within_tolerance"] else "OUTSIDE"
        return (
            f"{report['model']}: ulysses {report['ulysses_degree']} x ring {report['ring_degree']}, images {report['image_shape']}\n"
            f"  stock Ulysses {report['stock']}; cocodiff padded ({ran['padded_bytes'] / 2**20:.2f} MiB of zeros exchanged)\n"
            f"  cocodiff vs one process: max abs diff {report['max_abs_diff_vs_single_process']:.3g}, "
            f"{verdict} the tolerance {report['tolerance']:g}\n"
            f"  cocodiff ran: exchanges {ran['exchanges']}, V-First calls {ran['v_first_calls']}, fall-backs {ran['fallbacks'] or 'none'}"
        )
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
    if args.requests is not None:
        try:
            requests = json.loads(args.requests.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"--requests {args.requests}: {e}") from None
        if not isinstance(requests, list) or not all(isinstance(r, dict) for r in requests):
            raise ValueError(f"--requests {args.requests}: expected a JSON list of request objects")
        report = verify_requests(run, requests, timeout=args.timeout)
        print(json.dumps(report) if args.json else format_requests(report))
        return 0 if report["bitwise_equal"] else 1
    report = verify(run, timeout=args.timeout)
    print(json.dumps(report) if args.json else format_report(report))
    return 0 if report.get("bitwise_equal") or report.get("within_tolerance") else 1

