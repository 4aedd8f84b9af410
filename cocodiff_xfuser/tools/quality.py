"""``cocodiff quality``: a plugin configuration's images against exact references, measured.

One torchrun job generates every case (prompts x seeds) with stock xfuser Ulysses and then
with the cocodiff configuration given by the flags; the cases are also generated in this
process with plain diffusers (one process, no xfuser). The candidate is compared with stock
Ulysses on the same layout (the reference of the metrics) and with the one-process images.

Metrics come from maintained libraries: PSNR and SSIM from scikit-image, MS-SSIM from
pytorch-msssim (3x3 windows: five scales of a 64 px image need windows under 5 px; images under
33 px have no MS-SSIM, reported as None). PSNR of
identical images is infinite (JSON ``Infinity``, as Python's json writes it). On
``digits-flux`` a classifier fitted on the real digits labels every image, and the share
labelled as its prompt's digit is reported for the reference and the candidate.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

from cocodiff_xfuser.tools import launcher
from cocodiff_xfuser.tools.generate import output_dir
from cocodiff_xfuser.tools.models import digits
from cocodiff_xfuser.tools.models import tiny as tiny_models
from cocodiff_xfuser.tools.verify import PROMPT, REFERENCE, Run, compare

DEFAULT_SEEDS = 2
DEFAULT_ULYSSES = 4
TIMEOUT_S = 1800.0
DIFF_GAIN = 10  # the grid's third row: 10x the absolute difference
MS_SSIM_WINDOW = 3
MS_SSIM_MIN_SIDE = (MS_SSIM_WINDOW - 1) * 2**4 + 1  # five scales, each at least one window


def default_topology(world_size: int) -> str | None:
    """Two emulated nodes (half of each exchange crosses the slow level), where the ranks split evenly."""
    return f"2x{world_size // 2}" if world_size % 2 == 0 else None


def default_prompts(model: str) -> list[str]:
    """Every class of the digits model; the verify prompt for the random-weight models."""
    return list(digits.CLASSES) if model == digits.NAME else [PROMPT]


def image_metrics(reference: np.ndarray, candidate: np.ndarray) -> dict:
    """PSNR (dB), SSIM and MS-SSIM of one (H, W, 3) image in [0, 1] against its reference."""
    import torch
    from pytorch_msssim import ms_ssim
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    diff = compare(reference, candidate)
    identical = diff["bitwise_equal"]
    ref, cand = reference.astype(np.float64), candidate.astype(np.float64)
    as_batch = [torch.from_numpy(a).permute(2, 0, 1)[None] for a in (ref, cand)]
    multiscale = min(ref.shape[:2]) >= MS_SSIM_MIN_SIDE
    return {
        "identical": identical,
        "max_abs_diff": diff["max_abs_diff"],
        "psnr_db": math.inf if identical else float(peak_signal_noise_ratio(ref, cand, data_range=1.0)),
        "ssim": float(structural_similarity(ref, cand, channel_axis=-1, data_range=1.0)),
        "ms_ssim": float(ms_ssim(*as_batch, data_range=1.0, win_size=MS_SSIM_WINDOW)) if multiscale else None,
    }


def aggregate(reference: np.ndarray, candidate: np.ndarray, per_image: list[dict]) -> dict:
    """PSNR over all pixels of all images (one MSE), mean SSIM and MS-SSIM, the worst image's PSNR."""
    from skimage.metrics import peak_signal_noise_ratio

    identical = all(m["identical"] for m in per_image)
    pooled = math.inf if identical else float(
        peak_signal_noise_ratio(reference.astype(np.float64), candidate.astype(np.float64), data_range=1.0)
    )
    return {
        "identical": identical,
        "psnr_db": pooled,
        "min_psnr_db": min(m["psnr_db"] for m in per_image),
        "ssim": float(np.mean([m["ssim"] for m in per_image])),
        "ms_ssim": None if per_image[0]["ms_ssim"] is None else float(np.mean([m["ms_ssim"] for m in per_image])),
        "max_abs_diff": max(m["max_abs_diff"] for m in per_image),
    }


def measure_images(reference: np.ndarray, candidate: np.ndarray) -> tuple[list[dict], dict]:
    """:func:`image_metrics` of every image, and their :func:`aggregate`."""
    per_image = [image_metrics(r, c) for r, c in zip(reference, candidate)]
    return per_image, aggregate(reference, candidate, per_image)


def save_grid(reference: np.ndarray, candidate: np.ndarray, path: Path) -> None:
    """Columns are cases; rows are reference | candidate | 10x absolute difference."""
    from PIL import Image

    diff = np.clip(DIFF_GAIN * np.abs(reference.astype(np.float64) - candidate.astype(np.float64)), 0, 1)
    rows = [np.concatenate(list(images), axis=1) for images in (reference, candidate, diff)]
    Image.fromarray((np.concatenate(rows, axis=0) * 255).round().astype(np.uint8)).save(path)


def _progress_bar(out: Path, total: int):
    """A ``while_running`` callback drawing the job's progress (pipeline calls done) with tqdm."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc="pipeline calls", unit="call", leave=False)

    def update() -> None:
        try:
            done = json.loads((out / "progress.json").read_text())["done"]
        except (OSError, ValueError, KeyError):
            return
        bar.update(done - bar.n)

    return bar, update


def _maybe_bar(items: list, progress: bool, desc: str):
    if not progress:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="call", leave=False)


def measure(run: Run, prompts: Sequence[str], seeds: Sequence[int], out: Path, timeout: float = TIMEOUT_S,
            progress: bool = True) -> dict:
    """Generate every case with stock Ulysses, cocodiff (``run``) and one process; the report as a dict."""
    run.check()
    tiny_models.ensure_fixture(run.model)
    spec = tiny_models.SPECS[run.model]
    cases = [[prompt, seed] for prompt in prompts for seed in seeds]
    out.mkdir(parents=True, exist_ok=True)
    backends = ("ulysses", "cocodiff")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "cases.json").write_text(json.dumps(cases))
        bar, update = _progress_bar(work, len(cases) * len(backends)) if progress else (None, None)
        try:
            launcher.torchrun(run.world_size, run.argv(backends, work) + ["--cases", str(work / "cases.json")],
                              timeout=timeout, while_running=update)
        finally:
            if bar is not None:
                bar.close()
        results = {}
        for backend in backends:
            where = output_dir(work, spec.model_id, backend)
            results[backend] = {**json.loads((where / "result.json").read_text()), "images": np.load(where / "images.npy")}
    single = np.concatenate([
        tiny_models.reference_images(run.model, prompt, seed, run.height, run.width, run.steps)
        for prompt, seed in _maybe_bar(cases, progress, "one process")
    ])
    stock, ours = results["ulysses"], results["cocodiff"]
    per_image, summary = measure_images(stock["images"], ours["images"])
    ran = ours["ran"]
    exact = ran["slow_link_bytes_exact"]
    report = {
        "model": run.model,
        "ulysses_degree": run.ulysses_degree,
        "ring_degree": run.ring_degree,
        "topology": run.topology,
        "flags": list(run.extra) + (["--cocodiff-v-first"] if run.v_first else []),
        "reference": REFERENCE,
        "cases": len(cases),
        "image_shape": list(ours["images"].shape[1:]),
        "steps": ours["steps"],
        **summary,
        "vs_single_process": {
            "stock_max_abs_diff": compare(single, stock["images"])["max_abs_diff"],
            "candidate_max_abs_diff": compare(single, ours["images"])["max_abs_diff"],
        },
        "classifier_agreement": None,
        "reference_classifier_agreement": None,
        # Counted by the senders: bytes over the slowest topology level against the exact exchange's.
        "slow_link_bytes": ran["slow_link_bytes"],
        "slow_link_bytes_exact": exact,
        "slow_link_bytes_saved_fraction": 1 - ran["slow_link_bytes"] / exact if exact else None,
        # The first case includes start-up work (the autotune); the rest are steady state.
        "step_s": _step_s(ours),
        "reference_step_s": _step_s(stock),
        "ran": {"ulysses": stock["ran"], "cocodiff": ran},
        "images": [{"prompt": p, "seed": s, **m} for (p, s), m in zip(cases, per_image)],
    }
    if run.model == digits.NAME:
        classifier = digits.Classifier()
        asked = [digits.label(prompt) for prompt, _ in cases]
        rows = [i for i, label in enumerate(asked) if label is not None]
        if rows:
            wanted = [asked[i] for i in rows]
            for key, images in (("classifier_agreement", ours["images"]), ("reference_classifier_agreement", stock["images"])):
                report[key] = float((classifier.predict(images[rows]) == np.array(wanted)).mean())
        for entry, predicted in zip(report["images"], classifier.predict(ours["images"])):
            entry["classified_as"] = int(predicted)
    save_grid(stock["images"], ours["images"], out / "quality.png")
    (out / "quality.json").write_text(json.dumps(report, indent=1))
    return report


def _step_s(result: dict) -> float | None:
    timings, steps = result["timings"], result["steps"]
    steady = timings[1:] or timings
    return float(np.median(steady)) / steps if steady and steps else None


def format_report(report: dict, out: Path) -> str:
    def db(value: float) -> str:
        return "inf (identical)" if math.isinf(value) else f"{value:.2f} dB"

    saved = report["slow_link_bytes_saved_fraction"]
    lines = [
        f"{report['model']}: {report['cases']} images {report['image_shape']}, {report['steps']} steps, "
        f"ulysses {report['ulysses_degree']} (topology {report['topology'] or 'detected'}), flags {' '.join(report['flags']) or 'none'}",
        f"  vs {REFERENCE}: PSNR {db(report['psnr_db'])} (worst image {db(report['min_psnr_db'])}), "
        f"SSIM {report['ssim']:.4f}, MS-SSIM "
        + ("n/a" if report["ms_ssim"] is None else f"{report['ms_ssim']:.4f}")
        + f", max |diff| {report['max_abs_diff']:.3g}",
        f"  vs one process: stock max |diff| {report['vs_single_process']['stock_max_abs_diff']:.3g}, "
        f"cocodiff {report['vs_single_process']['candidate_max_abs_diff']:.3g}",
    ]
    if report["classifier_agreement"] is not None:
        lines.append(
            f"  classifier agreement with the prompt: cocodiff {report['classifier_agreement']:.2f}, "
            f"{REFERENCE} {report['reference_classifier_agreement']:.2f}"
        )
    lines.append(
        f"  step time: cocodiff {report['step_s'] * 1e3:.1f} ms, {REFERENCE} {report['reference_step_s'] * 1e3:.1f} ms; "
        f"slow-link bytes saved: " + ("n/a (no slow level)" if saved is None else f"{saved:.1%}")
    )
    lines.append(f"  grid (reference | candidate | {DIFF_GAIN}x |diff|) and JSON in {out.resolve()}")
    return "\n".join(lines)


def main(args, extra: Sequence[str] = ()) -> int:
    world_size = args.ulysses_degree * args.ring_degree
    run = Run(
        model=args.model,
        ulysses_degree=args.ulysses_degree,
        ring_degree=args.ring_degree,
        topology=args.topology or default_topology(world_size),
        steps=args.steps,
        v_first=args.v_first,
        extra=tuple(extra),
    )
    prompts = [p.strip() for p in args.prompts.split(",")] if args.prompts else default_prompts(args.model)
    seeds = list(range(args.seed, args.seed + args.seeds))
    out = Path(args.out)
    report = measure(run, prompts, seeds, out, timeout=args.timeout, progress=not args.json)
    print(json.dumps(report) if args.json else format_report(report, out))
    return 0
