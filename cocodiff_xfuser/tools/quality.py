"""``cocodiff quality``: a plugin configuration's images against exact references, measured.

One torchrun job generates every case (prompts x seeds) with stock xfuser Ulysses and then
with the cocodiff configuration given by the flags; the cases are also generated in this
process with plain diffusers (one process, no xfuser). The candidate is compared with stock
Ulysses on the same layout (the reference of the metrics) and with the one-process images.

Metrics come from maintained libraries: PSNR and SSIM from scikit-image, MS-SSIM from
pytorch-msssim (3x3 windows: five scales of a 64 px image need windows under 5 px; images under
33 px have no MS-SSIM, reported as None). PSNR of
identical images is infinite (JSON ``Infinity``, as Python's json writes it). On the trained
digits models (``digits-flux``, ``digits-sd3``) a classifier fitted on the real digits labels every
image, and the share labelled as its prompt's digit is reported for the reference and the candidate.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

from cocodiff_xfuser.comm.topology import Topology
from cocodiff_xfuser.settings import CALIBRATION
from cocodiff_xfuser.tools import launcher
from cocodiff_xfuser.tools.fabric import wire
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
    return list(digits.CLASSES) if model in digits.TRAINED else [PROMPT]


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
        "psnr_low_db": _pooled_psnr_low(per_image),
        "min_psnr_db": min(m["psnr_db"] for m in per_image),
        "ssim": float(np.mean([m["ssim"] for m in per_image])),
        "ms_ssim": None if per_image[0]["ms_ssim"] is None else float(np.mean([m["ms_ssim"] for m in per_image])),
        "max_abs_diff": max(m["max_abs_diff"] for m in per_image),
    }


#: One-sided 95% normal quantile: the pooled PSNR's lower prediction bound.
_Z95 = 1.645
#: The images of a default ``cocodiff quality`` run (the ten digits x DEFAULT_SEEDS): the fresh
#: check the prediction bound is for.
CHECK_IMAGES = 20


def _pooled_psnr_low(per_image: list[dict]) -> float:
    """The pooled PSNR (images in [0, 1]) that a fresh set of ``CHECK_IMAGES`` images of the same kind
    keeps with 95% probability: its mean MSE at the one-sided prediction bound from these images'
    mean and spread, ``mean + z * std * sqrt(1/n + 1/CHECK_IMAGES)`` (its own PSNR for one image)."""
    mse = np.array([10 ** (-m["psnr_db"] / 10) for m in per_image])  # 0 where identical (psnr inf)
    n = len(mse)
    spread = _Z95 * mse.std(ddof=1) * math.sqrt(1 / n + 1 / CHECK_IMAGES) if n > 1 else 0.0
    bound = mse.mean() + spread
    return math.inf if bound == 0 else float(-10 * math.log10(bound))


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


def _generate(run: Run, cases: list, variants: dict[str, dict], timeout: float, progress: bool) -> dict[str, dict]:
    """One torchrun job: every case with stock Ulysses, then with each variant (name -> runner args)."""
    spec = tiny_models.SPECS[run.model]
    backends = ("ulysses", *variants)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "cases.json").write_text(json.dumps(cases))
        (work / "variants.json").write_text(json.dumps(variants))
        argv = run.argv(backends, work) + ["--cases", str(work / "cases.json"), "--variants", str(work / "variants.json")]
        bar, update = _progress_bar(work, len(cases) * len(backends)) if progress else (None, None)
        try:
            launcher.torchrun(run.world_size, argv, env=wire.GPU_WIRE, timeout=timeout, while_running=update)
        finally:
            if bar is not None:
                bar.close()
        results = {}
        for backend in backends:
            where = output_dir(work, spec.model_id, backend)
            results[backend] = {**json.loads((where / "result.json").read_text()), "images": np.load(where / "images.npy")}
    return results


def _report(run: Run, flags: list[str], cases: list, stock: dict, ours: dict, single: np.ndarray | None,
            exact: int | None = None) -> dict:
    """The candidate ``ours`` against ``stock`` (and the one-process images, when given); its slow-link
    bytes against ``exact``, the exact exchange's (default: what ``ours`` counted as exact)."""
    per_image, summary = measure_images(stock["images"], ours["images"])
    ran = ours["ran"]
    exact = ran["slow_link_bytes_exact"] if exact is None else exact
    v_major = ran.get("v_major") or {}
    report = {
        "model": run.model,
        "ulysses_degree": run.ulysses_degree,
        "ring_degree": run.ring_degree,
        "topology": run.topology,
        "flags": flags,
        "reference": REFERENCE,
        "cases": len(cases),
        "image_shape": list(ours["images"].shape[1:]),
        "steps": ours["steps"],
        **summary,
        "vs_single_process": None if single is None else {
            "stock_max_abs_diff": compare(single, stock["images"])["max_abs_diff"],
            "candidate_max_abs_diff": compare(single, ours["images"])["max_abs_diff"],
        },
        "classifier_agreement": None,
        "reference_classifier_agreement": None,
        # Counted by the senders: bytes over the slowest topology level against the exact exchange's.
        "slow_link_bytes": ran["slow_link_bytes"],
        "slow_link_bytes_exact": exact,
        "slow_link_bytes_saved_fraction": 1 - ran["slow_link_bytes"] / exact if exact else None,
        # V-Major: the share of (token, layer, step) rows sent over slow links.
        "v_major_active_fraction": v_major["active"] / v_major["tokens"] if v_major.get("tokens") else None,
        # The first case includes start-up work (the autotune); the rest are steady state.
        "step_s": _step_s(ours),
        "reference_step_s": _step_s(stock),
        "ran": {"ulysses": stock["ran"], "cocodiff": ran},
        "images": [{"prompt": p, "seed": s, **m} for (p, s), m in zip(cases, per_image)],
    }
    if run.model in digits.TRAINED:
        classifier = digits.Classifier()
        asked = [digits.label(prompt) for prompt, _ in cases]
        rows = [i for i, label in enumerate(asked) if label is not None]
        if rows:
            wanted = [asked[i] for i in rows]
            for key, images in (("classifier_agreement", ours["images"]), ("reference_classifier_agreement", stock["images"])):
                report[key] = float((classifier.predict(images[rows]) == np.array(wanted)).mean())
        for entry, predicted in zip(report["images"], classifier.predict(ours["images"])):
            entry["classified_as"] = int(predicted)
    return report


def measure(run: Run, prompts: Sequence[str], seeds: Sequence[int], out: Path, timeout: float = TIMEOUT_S,
            progress: bool = True) -> dict:
    """Generate every case with stock Ulysses, cocodiff (``run``) and one process; the report as a dict."""
    run.check()
    uneven = run.uneven()
    if uneven:
        raise ValueError(f"{uneven}: stock Ulysses cannot run this layout to compare with "
                         f"(`cocodiff verify` compares cocodiff's padding with one process)")
    tiny_models.ensure_fixture(run.model)
    cases = [[prompt, seed] for prompt in prompts for seed in seeds]
    out.mkdir(parents=True, exist_ok=True)
    variants = {"cocodiff": {"sp_backend": "cocodiff"}}
    if _v_major(run):  # its cost is stated against V-First alone, timed in the same job
        variants[V_FIRST] = {"sp_backend": "cocodiff", "cocodiff_v_first": True, "cocodiff_v_major": "off",
                             "cocodiff_v_major_min_psnr": None}
    results = _generate(run, cases, variants, timeout, progress)
    single = np.concatenate([
        tiny_models.reference_images(run.model, prompt, seed, run.height, run.width, run.steps)
        for prompt, seed in _maybe_bar(cases, progress, "one process")
    ])
    flags = list(run.extra) + (["--cocodiff-v-first"] if run.v_first else [])
    report = _report(run, flags, cases, results["ulysses"], results["cocodiff"], single)
    if V_FIRST in results:
        report["v_first_step_s"] = _step_s(results[V_FIRST])
        report["step_vs_v_first"] = report["step_s"] / report["v_first_step_s"]
    save_grid(results["ulysses"]["images"], results["cocodiff"]["images"], out / "quality.png")
    (out / "quality.json").write_text(json.dumps(report, indent=1))
    return report


#: The variant that times V-First alone beside a V-Major run.
V_FIRST = "cocodiff+vfirst"


def _v_major(run: Run) -> bool:
    flags = list(run.extra)
    return any(f == "--cocodiff-v-major" and i + 1 < len(flags) and flags[i + 1] != "off" for i, f in enumerate(flags))


#: ``--sweep v-major``: name -> V-Major settings, each measured against stock in one job.
V_MAJOR_SWEEP = {
    **{f"threshold {t:g}": {"policy": "threshold", "threshold": t} for t in (0.1, 0.2, 0.3, 0.5)},
    **{f"top-k {f:g}": {"policy": "top-k", "fraction": f} for f in (0.5, 0.3)},
    "schedule 0.8": {"policy": "schedule", "final_cached": 0.8},
    "threshold 0.2 scope v": {"policy": "threshold", "threshold": 0.2, "scope": "v"},
    "top-k 0.3 scope v": {"policy": "top-k", "fraction": 0.3, "scope": "v"},
    "threshold 0.3 l1": {"policy": "threshold", "threshold": 0.3, "metric": "l1"},
    **{f"threshold {t:g} bf16": {"policy": "threshold", "threshold": t, "residual_dtype": "bfloat16"} for t in (0.1, 0.2)},
    "top-k 0.5 bf16": {"policy": "top-k", "fraction": 0.5, "residual_dtype": "bfloat16"},
    "threshold 0.1 fp8": {"policy": "threshold", "threshold": 0.1, "residual_dtype": "float8_e4m3fn"},
}
#: ``--sweep v-major-budget``: the ``budget`` policy as ``--cocodiff-v-major auto`` runs it (the shipped
#: defaults otherwise) at several errors: the points of ``configs/policies/v-major-calibration.yaml``.
BUDGET_SWEEP = {f"budget {e:g}": {"policy": "budget", "error": e, "residual_dtype": "int4"}
                for e in (0.01, 0.02, 0.03, 0.04, 0.05, 0.07, 0.1, 0.2)}
#: The first step exact instead of int4 residuals against zeros (in ``--sweep frontier``).
FIRST_STEP_EXACT = {
    "all tokens int4 residuals qkvo first step exact": {"policy": "top-k", "fraction": 1.0, "scope": "qkvo",
                                                         "residual_dtype": "int4", "first_step": "exact"},
    **{f"budget {e:g} qkvo int4 first step exact": {"policy": "budget", "error": e, "scope": "qkvo", "residual_dtype": "int4",
                                                     "first_step": "exact"} for e in (0.02, 0.03)},
}
#: ``--sweep frontier``: V-Major against the peers' compression of the same traffic, one byte counter:
#: fp8 with a scale per token and head on every link (xDiT's and cache-dit's fp8 Ulysses traffic,
#: ``--cocodiff-compress fp8``) and on the slow level only (``fp8-slow``), and every token's change
#: since the receivers' copy with error feedback on the slow level (CompactFusion's idea: V-Major
#: sending every token as residuals).
FRONTIER_SWEEP = {
    "fp8 every link": {"compress": "fp8"},
    "fp8 slow level": {"compress": "fp8-slow"},
    **{f"all tokens {dtype} residuals{'' if scope == 'qkv' else ' ' + scope}": {
        "policy": "top-k", "fraction": 1.0, "scope": scope, "residual_dtype": full}
       for dtype, full in (("int4", "int4"), ("fp8", "float8_e4m3fn"), ("bf16", "bfloat16")) for scope in ("qkv", "qkvo")},
    **{f"budget {e:g} qkvo int4": {"policy": "budget", "error": e, "scope": "qkvo", "residual_dtype": "int4"}
       for e in (0.02, 0.03, 0.04, 0.05)},
    **FIRST_STEP_EXACT,
    "budget 0.05 fp8": {"policy": "budget", "error": 0.05, "scope": "qkv", "residual_dtype": "float8_e4m3fn"},
    **{f"budget {e:g} qkvo fp8": {"policy": "budget", "error": e, "scope": "qkvo", "residual_dtype": "float8_e4m3fn"}
       for e in (0.02, 0.03, 0.05)},
    "budget 0.05 values": {"policy": "budget", "error": 0.05, "scope": "qkv"},
    "budget 0.05 scope v": {"policy": "budget", "error": 0.05, "scope": "v", "residual_dtype": "float8_e4m3fn"},
    "threshold 0.1 fp8": {"policy": "threshold", "threshold": 0.1, "scope": "qkv", "residual_dtype": "float8_e4m3fn"},
}
SWEEPS = {"v-major": V_MAJOR_SWEEP, "v-major-budget": BUDGET_SWEEP, "frontier": FRONTIER_SWEEP}


def _variant(knobs: dict) -> tuple[dict, list[str]]:
    """A sweep point's runner args and the flags a user would give: ``compress`` for the fp8
    exchange, else V-Major knobs (without a residual dtype, active rows travel as values)."""
    if "compress" in knobs:
        return ({"sp_backend": "cocodiff", "cocodiff_v_first": True, "cocodiff_compress": knobs["compress"]},
                ["--cocodiff-v-first", f"--cocodiff-compress={knobs['compress']}"])
    knobs = {"residual_dtype": "none", **knobs}
    args = {"sp_backend": "cocodiff", "cocodiff_v_first": True, "cocodiff_v_major": "on",
            **{f"cocodiff_v_major_{key}": value for key, value in knobs.items()}}
    return args, ["--cocodiff-v-major", "on"] + [f"--cocodiff-v-major-{k.replace('_', '-')}={v}" for k, v in knobs.items()]


#: What a sweep keeps of each point's report.
_KEPT = ("psnr_db", "psnr_low_db", "min_psnr_db", "ssim", "ms_ssim", "classifier_agreement", "reference_classifier_agreement",
         "slow_link_bytes_saved_fraction", "v_major_active_fraction", "step_s", "reference_step_s")


def sweep_v_major(run: Run, prompts: Sequence[str], seeds: Sequence[int], out: Path, timeout: float = TIMEOUT_S,
                  progress: bool = True, points: dict[str, dict] | None = None, name: str = "v-major") -> dict:
    """Every setting of ``points`` (default: the sweep ``name`` of :data:`SWEEPS`) against stock,
    and V-First alone (the step time the others are compared with), in one job;
    ``sweep-<name>.json`` and ``.png`` in ``out`` (the budget sweep also writes the model's
    calibration points, ``v-major-calibration.yaml``). A point's knobs not given are the shipped
    defaults (:func:`_variant`).
    """
    run.check()
    tiny_models.ensure_fixture(run.model)
    sweep = name
    points = SWEEPS[sweep] if points is None else points
    cases = [[prompt, seed] for prompt in prompts for seed in seeds]
    out.mkdir(parents=True, exist_ok=True)
    variants = {name: _variant(knobs)[0] for name, knobs in points.items()}
    variants[V_FIRST] = {"sp_backend": "cocodiff", "cocodiff_v_first": True}
    results = _generate(run, cases, variants, timeout, progress)
    rows = []
    for name, knobs in points.items():
        report = _report(run, list(run.extra) + _variant(knobs)[1], cases, results["ulysses"], results[name], None)
        rows.append({"name": name, "settings": knobs, **{key: report[key] for key in _KEPT},
                     "image_psnr_db": [image["psnr_db"] for image in report["images"]]})
    not_run = None
    if sweep == "frontier":
        not_run = tiny_models.SPECS[run.model].pipefusion_absent
        exact = results[V_FIRST]["ran"]["slow_link_bytes_exact"]
        rows += [_pipefusion_point(piped, cases, results["ulysses"], exact, timeout, progress) for piped in pipefusion_runs(run)]
    for row in rows:
        row["on_frontier"] = not any(_dominates(other, row) for other in rows)
    summary = {"model": run.model, "ulysses_degree": run.ulysses_degree, "topology": run.topology,
               "cases": len(cases), "steps": results["ulysses"]["steps"], "v_first_step_s": _step_s(results[V_FIRST]),
               "points": rows, **({"pipefusion_not_run": not_run} if not_run else {})}
    (out / f"sweep-{sweep}-{run.model}.json").write_text(json.dumps(summary, indent=1))
    _plot_sweep(summary, out / f"sweep-{sweep}-{run.model}.png")
    if sweep == "v-major-budget":
        write_calibration(summary, out / CALIBRATION.name)
    return summary


def pipefusion_runs(run: Run) -> list[Run]:
    """Stock PipeFusion on ``run``'s ranks at every stage count xDiT would place there
    (:func:`~cocodiff_xfuser.tools.models.tiny.pipefusion_stages`): its quality depends on the stage
    count, which a planner of more nodes needs."""
    nodes = Topology.parse(run.topology).validate(run.world_size).sizes[0]
    return [dataclasses.replace(run, ulysses_degree=run.world_size // p, ring_degree=1, cfg=False, pipefusion=p)
            for p in tiny_models.pipefusion_stages(run.model, nodes, run.world_size)]


def _pipefusion_point(run: Run, cases: list, stock: dict, exact: int, timeout: float, progress: bool) -> dict:
    """A frontier point of stock PipeFusion (``run``): its images against ``stock``'s, its bytes over
    the slow links (its stages' sends that cross nodes, bf16 on the wire) against ``exact``, the
    exact Ulysses exchange's of the same cases."""
    ours = _generate(run, cases, {}, timeout, progress)["ulysses"]
    layout = f"U{run.ulysses_degree}xPF{run.pipefusion}"
    report = _report(run, [f"--ulysses_degree={run.ulysses_degree}", f"--pipefusion_parallel_degree={run.pipefusion}"],
                     cases, stock, ours, None, exact)
    return {"name": f"stock PipeFusion {layout}", "settings": {"layout": layout}, **{key: report[key] for key in _KEPT},
            "slow_link_bytes": report["slow_link_bytes"], "image_psnr_db": [image["psnr_db"] for image in report["images"]]}


def _dominates(a: dict, b: dict) -> bool:
    """Whether point ``a`` saves at least ``b``'s slow-link bytes at at least its PSNR, and beats it
    in one of the two (the quality-per-byte frontier is the points nothing dominates)."""
    ka, kb = (a["slow_link_bytes_saved_fraction"] or 0.0, a["psnr_db"]), (b["slow_link_bytes_saved_fraction"] or 0.0, b["psnr_db"])
    return ka[0] >= kb[0] and ka[1] >= kb[1] and ka != kb


def write_calibration(summary: dict, path: Path) -> None:
    """Merge the budget sweep's (error, PSNR) points of its model into the calibration file at
    ``path`` (the format of ``configs/policies/v-major-calibration.yaml``)."""
    import yaml

    text = path.read_text() if path.exists() else ""
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    data = yaml.safe_load(text) or {"models": {}}
    data["models"][summary["model"]] = {
        "measured": f"cocodiff quality --model {summary['model']} --sweep v-major-budget: ulysses "
                    f"{summary['ulysses_degree']} on {summary['topology']}, {summary['cases']} images, {summary['steps']} steps",
        "points": [{"error": r["settings"]["error"], "psnr_db": round(r["psnr_db"], 2), "psnr_low_db": round(r["psnr_low_db"], 2),
                    "min_psnr_db": round(r["min_psnr_db"], 2)}
                   for r in summary["points"]],
    }
    path.write_text(header + yaml.safe_dump(data, sort_keys=False))


def _plot_sweep(summary: dict, path: Path) -> None:
    """Quality against slow-link bytes saved, one marker per setting (the paper's Figure 10, ours)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for row in summary["points"]:
        saved = 100 * (row["slow_link_bytes_saved_fraction"] or 0.0)
        psnr = min(row["psnr_db"], 80.0)
        peer = row["settings"].get("compress") or row["settings"].get("fraction") == 1.0
        stock = "layout" in row["settings"]  # stock PipeFusion's point
        marker = "*" if stock else "D" if peer else "s" if "scope v" in row["name"] else ("^" if row["name"].startswith("top-k") else "o")
        for ax, y in ((axes[0], psnr), (axes[1], row["classifier_agreement"])):
            if y is None:
                continue
            ax.plot(saved, y, marker, label=row["name"], **({"color": "black", "markersize": 12} if stock else {}))
            ax.annotate(row["name"], (saved, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    front = sorted((100 * (r["slow_link_bytes_saved_fraction"] or 0.0), min(r["psnr_db"], 80.0))
                   for r in summary["points"] if r.get("on_frontier"))
    if front:
        axes[0].plot(*zip(*front), "-", color="grey", linewidth=0.8, zorder=0, label="frontier")
    axes[0].axhline(35, color="grey", linestyle=":", linewidth=1)
    axes[0].set(xlabel="slow-link bytes saved (%)", ylabel="PSNR vs stock Ulysses (dB)")
    reference = summary["points"][0]["reference_classifier_agreement"]
    if reference is not None:
        axes[1].axhline(reference, color="grey", linestyle=":", linewidth=1)
    axes[1].set(xlabel="slow-link bytes saved (%)", ylabel="classifier agreement with the prompt")
    fig.suptitle(f"V-Major on {summary['model']}: ulysses {summary['ulysses_degree']} on {summary['topology']}, "
                 f"{summary['cases']} images, {summary['steps']} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_sweep(summary: dict, out: Path) -> str:
    nan = float("nan")
    lines = [f"{'setting':<31} {'PSNR dB':>8} {'worst':>7} {'SSIM':>7} {'MS-SSIM':>8} {'class.':>7} {'saved':>7} "
             f"{'active':>7} {'step ms':>8}  frontier"]
    for r in summary["points"]:
        lines.append(
            f"{r['name']:<31} {r['psnr_db']:8.2f} {r['min_psnr_db']:7.2f} {r['ssim']:7.4f} "
            f"{(r['ms_ssim'] or nan):8.4f} {(r['classifier_agreement'] or nan):7.2f} "
            f"{r['slow_link_bytes_saved_fraction']:7.1%} {(r['v_major_active_fraction'] or nan):7.1%} {r['step_s'] * 1e3:8.1f}"
            f"  {'yes' if r.get('on_frontier') else ''}"
        )
    lines.append(f"V-First alone {summary['v_first_step_s'] * 1e3:.1f} ms per step; stock classifier agreement "
                 f"{summary['points'][0]['reference_classifier_agreement']}; JSON and plot in {out.resolve()}")
    return "\n".join(lines)


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
    if report.get("v_first_step_s"):
        lines.append(f"  V-First alone in the same job: {report['v_first_step_s'] * 1e3:.1f} ms; "
                     f"V-Major's step is {report['step_vs_v_first']:.2f}x it")
    lines.append(f"  grid (reference | candidate | {DIFF_GAIN}x |diff|) and JSON in {out.resolve()}")
    return "\n".join(lines)


def _keep(args, extra: Sequence[str]) -> tuple[str, ...]:
    """Auto keeps V-Major on here: this command measures the images and bytes V-Major gives; whether
    its steps are faster than exact ones is a property of the job's links (loopback here), which
    the auto mode checks in the job itself (``cocodiff bench e2e`` runs it on emulated clusters)."""
    if args.v_major != "auto" or any(flag.replace("_", "-").startswith("--cocodiff-v-major-if-slower") for flag in extra):
        return ()
    return ("--cocodiff-v-major-if-slower", "keep")


def main(args, extra: Sequence[str] = ()) -> int:
    world_size = args.ulysses_degree * args.ring_degree
    run = Run(
        model=args.model,
        ulysses_degree=args.ulysses_degree,
        ring_degree=args.ring_degree,
        topology=args.topology or default_topology(world_size),
        steps=args.steps,
        v_first=args.v_first,
        extra=tuple(extra) + (("--cocodiff-v-major", args.v_major) if args.v_major != "off" else ()) + _keep(args, extra),
    )
    prompts = [p.strip() for p in args.prompts.split(",")] if args.prompts else default_prompts(args.model)
    seeds = list(range(args.seed, args.seed + args.seeds))
    out = Path(args.out)
    if args.sweep:
        summary = sweep_v_major(run, prompts, seeds, out, timeout=args.timeout, progress=not args.json, name=args.sweep)
        print(json.dumps(summary) if args.json else format_sweep(summary, out))
        return 0
    report = measure(run, prompts, seeds, out, timeout=args.timeout, progress=not args.json)
    print(json.dumps(report) if args.json else format_report(report, out))
    return 0
