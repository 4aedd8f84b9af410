"""``cocodiff quality``: metrics from the maintained libraries, and a lossless run reported as such."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from skimage.metrics import peak_signal_noise_ratio

from cocodiff_xfuser.tools import quality


def test_identical_images_have_infinite_psnr_and_unit_similarity():
    image = np.random.default_rng(0).random((64, 64, 3)).astype(np.float32)
    metrics = quality.image_metrics(image, image.copy())
    assert metrics["identical"] and math.isinf(metrics["psnr_db"]) and metrics["max_abs_diff"] == 0
    assert metrics["ssim"] == pytest.approx(1.0) and metrics["ms_ssim"] == pytest.approx(1.0)


def test_different_images_are_measured_by_the_libraries():
    rng = np.random.default_rng(1)
    reference = rng.random((2, 64, 64, 3))
    candidate = np.clip(reference + rng.normal(0, 0.01, reference.shape), 0, 1)
    per_image = [quality.image_metrics(r, c) for r, c in zip(reference, candidate)]
    assert per_image[0]["psnr_db"] == pytest.approx(peak_signal_noise_ratio(reference[0], candidate[0], data_range=1.0))
    summary = quality.aggregate(reference, candidate, per_image)
    assert not summary["identical"] and 35 < summary["psnr_db"] < 45 and summary["min_psnr_db"] <= summary["psnr_db"] + 0.1
    assert 0.9 < summary["ssim"] < 1 and 0.9 < summary["ms_ssim"] < 1


def test_grid_has_a_column_per_case_and_three_rows(tmp_path):
    from PIL import Image

    images = np.zeros((3, 64, 64, 3))
    quality.save_grid(images, images + 0.5, tmp_path / "grid.png")
    grid = np.asarray(Image.open(tmp_path / "grid.png"))
    assert grid.shape == (3 * 64, 3 * 64, 3)
    assert (grid[64:128] == 128).all() and (grid[128:] == 255).all()  # candidate; 10x |diff| clipped


def test_sweep_points_are_backend_names():
    # Every point is a backend of one generate job, whose --backends is a comma-separated list.
    names = [name for sweep in quality.SWEEPS.values() for name in sweep]
    assert names and not any("," in name for name in names)
    fp8, exact = quality._variant({"compress": "fp8"}), quality._variant({"policy": "budget", "error": 0.05})
    assert fp8[0]["cocodiff_compress"] == "fp8" and "cocodiff_v_major" not in fp8[0]
    assert exact[0]["cocodiff_v_major_residual_dtype"] == "none" and "--cocodiff-v-major-error=0.05" in exact[1]


def test_the_pooled_psnr_has_a_lower_confidence_bound():
    same = [{"psnr_db": 40.0}] * 5
    assert quality._pooled_psnr_low(same) == pytest.approx(40.0)  # no spread, no margin
    spread = [{"psnr_db": 35.0}, {"psnr_db": 45.0}, {"psnr_db": 40.0}, {"psnr_db": 38.0}]
    mean_mse = sum(10 ** (-m["psnr_db"] / 10) for m in spread) / len(spread)
    assert quality._pooled_psnr_low(spread) < -10 * math.log10(mean_mse)  # below the pooled PSNR
    assert quality._pooled_psnr_low([{"psnr_db": math.inf}] * 3) == math.inf  # identical images


def test_the_frontier_is_the_points_nothing_dominates():
    def point(saved, psnr):
        return {"slow_link_bytes_saved_fraction": saved, "psnr_db": psnr}

    fp8, residuals, budget, worse = point(0.69, 43.8), point(0.70, 70.7), point(0.72, 46.5), point(0.58, 42.2)
    assert quality._dominates(residuals, fp8) and quality._dominates(budget, worse)
    assert not quality._dominates(budget, residuals) and not quality._dominates(residuals, budget)
    assert not quality._dominates(fp8, fp8)  # a point does not dominate itself


def test_pipefusion_runs_from_a_stage_per_node_to_a_stage_per_rank():
    run = quality.Run("digits-flux", 4, topology="2x2", steps=16, extra=("--cocodiff-v-major", "on"))
    per_node, per_rank = quality.pipefusion_runs(run)
    assert (per_node.ulysses_degree, per_node.pipefusion, per_node.world_size, per_node.topology) == (2, 2, 4, "2x2")
    assert (per_rank.ulysses_degree, per_rank.pipefusion, per_rank.world_size) == (1, 4, 4)
    assert per_node.extra == run.extra and per_node.steps == 16  # the same images, as the sweep's other points
    assert quality.pipefusion_runs(quality.Run("digits-flux", 4, topology="1x4")) == []
    # digits-flux has 6 transformer blocks: no more stages than that
    assert [r.pipefusion for r in quality.pipefusion_runs(quality.Run("digits-flux", 8, topology="4x2"))] == [4]


@pytest.mark.distributed
@pytest.mark.slow  # two jobs; the frontier sweep runs the same point
def test_a_pipefusion_point_is_measured_against_the_exact_exchange(tmp_path):
    """Stock PipeFusion's frontier point: its stages' sends counted where they cross nodes (bf16 on the
    wire), against the exact Ulysses exchange's bytes of the same cases, its images against stock U4's."""
    run = quality.Run("digits-flux", 4, topology="2x2", steps=4)
    quality.tiny_models.ensure_fixture(run.model)
    cases = [["digit 3", 0], ["digit 7", 0]]
    results = quality._generate(run, cases, {quality.V_FIRST: {"sp_backend": "cocodiff", "cocodiff_v_first": True}}, 600, False)
    exact = results[quality.V_FIRST]["ran"]["slow_link_bytes_exact"]
    point = quality._pipefusion_point(quality.pipefusion_runs(run)[0], cases, results["ulysses"], exact, 600, False)
    assert point["name"] == "stock PipeFusion U2xPF2" and point["settings"] == {"layout": "U2xPF2"}
    assert 0 < point["slow_link_bytes"] < exact and point["slow_link_bytes_saved_fraction"] == 1 - point["slow_link_bytes"] / exact
    assert 20 < point["psnr_db"] < math.inf and len(point["image_psnr_db"]) == 2


def _quality_json(tmp_path, prompts: str, *flags: str) -> dict:
    """``cocodiff quality --json`` on digits-flux, one seed per prompt, as a user runs it."""
    cocodiff = os.path.join(os.path.dirname(sys.executable), "cocodiff")
    result = subprocess.run(
        [cocodiff, "quality", "--model", "digits-flux", "--prompts", prompts, "--seeds", "1",
         "--out", str(tmp_path), "--json", *flags],
        capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.distributed
@pytest.mark.slow  # make test's demo test runs the same measurement (10 digits, identical, what ran)
def test_lossless_configuration_reports_identical_images(tmp_path):
    """The CLI on the trained model, TAPA forced through a passed-on xdit flag: identical images,
    nothing saved on the slow link, and proof that the forced exchange ran."""
    report = _quality_json(tmp_path, "digit 3,digit 7", "--cocodiff_a2a", "hierarchical")
    assert report["identical"] is True and math.isinf(report["psnr_db"]) and report["ssim"] == pytest.approx(1.0)
    assert report["slow_link_bytes"] > 0 and report["slow_link_bytes_saved_fraction"] == 0.0
    assert report["classifier_agreement"] == report["reference_classifier_agreement"] is not None
    assert report["step_s"] > 0 and report["reference_step_s"] > 0
    assert set(report["ran"]["cocodiff"]["exchanges"]) == {"hierarchical"}, report["ran"]
    assert report["ran"]["cocodiff"]["fallbacks"] == {} and set(report["ran"]["ulysses"]["exchanges"]) == {"stock"}
    assert [image["prompt"] for image in report["images"]] == ["digit 3", "digit 7"]
    assert json.loads((tmp_path / "quality.json").read_text())["cases"] == 2
    assert (tmp_path / "quality.png").stat().st_size > 0


@pytest.mark.distributed
@pytest.mark.slow  # a quality measurement; make test runs V-Major's paths bitwise (equivalence) and sparse (vmajor, exchanges)
def test_v_major_default_meets_its_quality_and_bytes_target(tmp_path):
    """``--v-major on`` at the shipped defaults on the trained model: within 35 dB of stock Ulysses,
    at least 70% of the slow-link bytes saved, and the sparse exchanges really ran."""
    report = _quality_json(tmp_path, "digit 2,digit 5,digit 8", "--v-major", "on")
    assert report["psnr_db"] >= 35 and not report["identical"], report["psnr_db"]
    assert report["slow_link_bytes_saved_fraction"] >= 0.7, report["slow_link_bytes_saved_fraction"]
    ran = report["ran"]["cocodiff"]
    assert any(name.startswith("v-major") for name in ran["exchanges"]) and ran["fallbacks"] == {}, ran
    assert 0 < report["v_major_active_fraction"] < 1
    # Every step and layer is counted: 16 steps, by the static path's step phases (the first, 3 more
    # warm-up steps whole, 12 sparse), and 6 attention layers.
    phases = ran["v_major"]["per_step"]
    assert set(phases) == {"first", "whole", "sparse"} and len(ran["v_major"]["per_layer"]) == 6, phases
    per_step = phases["first"]["tokens"]
    assert phases["whole"]["tokens"] == 3 * per_step and phases["sparse"]["tokens"] == 12 * per_step
    assert phases["sparse"]["active"] < phases["sparse"]["tokens"]
