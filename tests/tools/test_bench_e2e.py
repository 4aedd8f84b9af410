"""CI-sized smoke run of ``cocodiff bench e2e`` on an emulated 2x2 rail fabric: correctness and JSON only."""

from __future__ import annotations

import json
import math

import pytest

from cocodiff_xfuser.tools import fabric
from cocodiff_xfuser.tools.bench import e2e as bench_e2e

ok, why = fabric.available()
pytestmark = [pytest.mark.fabric, pytest.mark.skipif(not ok, reason=f"emulated fabric unavailable: {why}")]

CONFIG_KEYS = ("name", "step_s", "comm_s", "slow_link_bytes", "max_abs_diff", "psnr_db", "ssim", "speedup_vs_stock", "speedup_vs_fair")


#: The normal tier's smoke: the baselines, the lossless stack and V-Major's auto mode (every
#: mechanism; the full list runs in the slow tier and in the published benchmark).
SMOKE = ("tapa+vfirst", "tapa+vfirst+vmajor-auto")


#: Correctness and the report, not speed: links fast enough that the autotune's measurements and the
#: runs take little time, still shaped (the slow-link byte counters count).
SMOKE_LINKS = {"rail_bps": 1e9}


def _smoke(configs: tuple[str, ...] | None) -> dict:
    # Three steps: V-Major's exact first step, its second warm-up step (every row as a residual), one budget step.
    report = bench_e2e.bench_e2e("rail", "tiny-flux", size=64, steps=3, repeat=1, params=SMOKE_LINKS, timeout=600,
                                 configs=configs)
    json.dumps(report)  # serializable
    for key in ("model", "fabric", "configs", "regime"):
        assert key in report
    for config in report["configs"]:
        assert all(key in config for key in CONFIG_KEYS), config
        assert config["step_s"] > 0 and config["comm_s"] > 0 and config["slow_link_bytes"] > 0
        if config["name"] not in bench_e2e.LOSSY:  # TAPA and V-First are lossless
            assert config["bitwise_equal"] and config["max_abs_diff"] == 0.0 and math.isinf(config["psnr_db"])
            assert config["v_major_active_fraction"] is None
    configs = {c["name"]: c for c in report["configs"]}
    # The fair baseline is stock's algorithm on the fair flat exchange: it ran, and only it.
    assert set(configs["fair-flat"]["exchanges_by_algorithm"]) == {"flat-p2p"}, configs["fair-flat"]
    assert configs["fair-flat"]["speedup_vs_fair"] == 1.0
    assert {o["label"] for o in configs["tapa+vfirst"]["v_overlap"]} == {"flux.double.v", "flux.single.v"}
    # Auto: the budget policy from its PSNR target ran sparse exchanges (three steps are too few for
    # its speed check, which times pairs of steps after the warm-up).
    auto = configs["tapa+vfirst+vmajor-auto"]
    assert any(name.startswith("v-major") for name in auto["exchanges_by_algorithm"]), auto
    assert auto["psnr_db"] > 20
    return configs


def test_e2e_smoke_runs_the_baselines_and_every_mechanism():
    configs = _smoke(SMOKE)
    assert list(configs) == [*bench_e2e.BASELINES, *SMOKE]


@pytest.mark.slow
def test_e2e_smoke_is_lossless_and_complete():
    configs = _smoke(None)
    assert list(configs) == list(bench_e2e.CONFIGS)
    # V-Major ran (after the first, exact step, its rows as fp8 residuals: every row where the
    # budget needs nearly all of them), and the fabric's counters saw fewer bytes on the slow links.
    vmajor = configs["tapa+vfirst+vmajor"]
    assert 0 < vmajor["v_major_active_fraction"] <= 1 and vmajor["psnr_db"] > 20
    assert vmajor["slow_link_bytes"] < configs["tapa+vfirst"]["slow_link_bytes"]


def test_unknown_configuration_is_refused():
    with pytest.raises(ValueError, match="unknown configuration"):
        bench_e2e.bench_e2e("rail", configs=("tapa+nothing",))
