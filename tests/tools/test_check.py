"""`cocodiff check`: the message sizes it times, the calibrated compute, its report; the whole
command on the emulated rail (slow tier: about 2.5 minutes)."""

from __future__ import annotations

import json
import math

import pytest

from cocodiff_xfuser.tools import check, cli, fabric, plan


def test_it_times_the_sizes_of_the_models_exchanges():
    spec = plan.MODELS["digits-flux"]
    sizes = check.message_sizes_mib("digits-flux", 64, 4)
    # 256 image + 16 text tokens over 4 ranks, 8 heads x 16 channels, fp32: one tensor is 17 KiB
    # per rank; Q/K/V stacked (3), V alone (1), Q/K (2) and the output (1).
    unit = 272 / 4 * spec.heads * spec.head_dim * spec.dtype_bytes / 2**20
    assert sizes == pytest.approx([unit, 2 * unit, 3 * unit])


def test_the_planner_given_the_effective_rate_prices_the_measured_compute():
    compute_s = 0.029
    tflops = check.effective_tflops("digits-flux", 64, 4, compute_s)
    planned = plan.plan("digits-flux", 64, cluster="rail", nodes=2, local=2, steps=4, tflops=tflops)
    row = next(r for r in planned["ranked"] if (r["ulysses"], r["ring"]) == (4, 1))
    assert row["compute_s"] == pytest.approx(compute_s)


def test_without_an_emulated_fabric_it_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(fabric, "available", lambda: (False, "not root"))
    assert cli.main(["check", "--fabric", "rail"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["cocodiff check: cannot build the rail fabric here: not root"]


ok, why = fabric.available()


@pytest.mark.slow
@pytest.mark.fabric
@pytest.mark.skipif(not ok, reason=f"emulated fabric unavailable: {why}")
def test_check_on_the_emulated_rail(tmp_path, capsys):
    assert cli.main(["check", "--fabric", "rail", "--model", "digits-flux", "--out", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["equivalent"] and {row["name"] for row in report["equivalence"]} >= {"tapa", "tapa+vfirst"}
    calibration = plan.calibrate_file(tmp_path / "check-calibration.json")  # what plan --calibrate reads
    assert calibration[0].source.startswith("fitted on")
    assert report["predicted_step_s"] > 0 and report["measured_step_s"] > 0
    assert math.isfinite(report["prediction_error"])
