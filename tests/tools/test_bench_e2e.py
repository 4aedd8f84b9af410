"""CI-sized smoke run of ``cocodiff bench e2e`` on an emulated 2x2 rail fabric: correctness and JSON only."""

from __future__ import annotations

import contextlib
import json
import math

import pytest

from cocodiff_xfuser.tools import fabric
from cocodiff_xfuser.tools.bench import e2e as bench_e2e
from cocodiff_xfuser.tools.verify import Run

ok, why = fabric.available()
pytestmark = [pytest.mark.fabric, pytest.mark.skipif(not ok, reason=f"emulated fabric unavailable: {why}")]

CONFIG_KEYS = ("name", "layout", "layout_flags", "step_s", "floor_step_s", "links_share", "comm_s", "slow_link_bytes",
               "max_abs_diff", "psnr_db", "ssim", "speedup_vs_best_stock", "speedup_vs_stock", "speedup_vs_fair",
               "speedup_vs_same_layout", "floor_speedup_vs_best_stock", "lossy", "speedup_vs_best_lossless_stock")


#: The normal tier's smoke: the baselines, the lossless stack and V-Major's auto mode (every
#: mechanism; the full list runs in the slow tier and in the published benchmark).
SMOKE = ("tapa+vfirst", "tapa+vfirst+vmajor-auto")


#: Correctness and the report, not speed: links fast enough that the autotune's measurements and the
#: runs take little time, still shaped (the slow-link byte counters count).
SMOKE_LINKS = {"rail_bps": 1e9}


def _smoke(configs: tuple[str, ...] | None, floor: bool) -> dict:
    # Three steps: warm-up steps of V-Major (the first step's residuals against zeros, then every row as a residual).
    report = bench_e2e.bench_e2e("rail", "tiny-flux", size=64, steps=3, repeat=1, params=SMOKE_LINKS, timeout=600,
                                 mechanisms=configs, floor=floor)
    json.dumps(report)  # serializable
    for key in ("model", "fabric", "configs", "regime", "best_stock", "best_lossless_stock", "best_stock_step_s", "layouts_not_run"):
        assert key in report
    for config in report["configs"]:
        assert all(key in config for key in CONFIG_KEYS), config
        # A stage per rank (U1xPF4) has no exchange of its own: only PipeFusion's sends between stages.
        assert config["step_s"] > 0 and (config["comm_s"] > 0) == (config["exchanges_per_step"] > 0), config
        assert config["comm_s"] > 0 or config["layout"] == "U1xPF4"
        assert (config["floor_step_s"] is not None) == floor
        if not config["lossy"]:
            # Lossless, and cocodiff bitwise the same stock layout; Ulysses x Ring is float rounding away from U4.
            assert config["bitwise_equal"] and config["max_abs_diff"] == 0.0 and config["psnr_db"] > 60, config
            assert config["v_major_active_fraction"] is None
    configs = {c["name"]: c for c in report["configs"]}
    # The headline's denominator is the fastest of the stock layouts (PipeFusion, lossy, included),
    # and names it; beside it the fastest lossless one.
    best = min(("stock U4", "stock U2xR2", "stock U2xPF2", "stock U1xPF4"), key=lambda name: configs[name]["step_s"])
    assert report["best_stock"] == best and configs[best]["speedup_vs_best_stock"] == 1.0
    lossless = min(("stock U4", "stock U2xR2"), key=lambda name: configs[name]["step_s"])
    assert report["best_lossless_stock"] == lossless and configs[lossless]["speedup_vs_best_lossless_stock"] == 1.0
    piped = configs["stock U2xPF2"]  # through xfuser's FLUX pipeline wrapper: stale activations, close to U4
    assert piped["lossy"] and piped["layout_flags"].endswith("--pipefusion_parallel_degree 2") and 20 < piped["psnr_db"] < math.inf
    assert configs["stock U4"]["speedup_vs_stock"] == 1.0 and math.isinf(configs["stock U4"]["psnr_db"])
    # Ulysses over both nodes sends over the spine; inside the node x Ring over the rails, nothing crosses it.
    assert configs["stock U4"]["slow_link_bytes"] > 0
    # The fair baseline on rail is stock's algorithm on the flat exchange routed as NCCL's PXN routes it.
    assert set(configs["fair-flat U4"]["exchanges_by_algorithm"]) == {"flat-pxn"}, configs["fair-flat U4"]
    assert configs["fair-flat U4"]["speedup_vs_fair"] == 1.0
    assert {o["label"] for o in configs["tapa+vfirst U4"]["v_overlap"]} == {"flux.double.v", "flux.single.v"}
    # cocodiff on Ulysses x Ring: its path ran (V-First), with nothing for V-Major or TAPA to do there.
    ring = configs["tapa+vfirst U2xR2"]
    assert ring["layout_flags"] == "--ulysses_degree 2 --ring_degree 2" and ring["v_overlap"] and "stock" not in ring["exchanges_by_algorithm"]
    if "tapa+vfirst+vmajor-auto U4" in configs:
        # Auto: the budget policy from its PSNR target ran sparse exchanges (three steps are too few for
        # its speed check, which times pairs of steps after the warm-up).
        auto = configs["tapa+vfirst+vmajor-auto U4"]
        assert any(name.startswith("v-major") for name in auto["exchanges_by_algorithm"]), auto
        assert auto["psnr_db"] > 20
        # On Ulysses x Ring, V-Major runs on the ring's K/V, which cross the nodes.
        ring_auto = configs["tapa+vfirst+vmajor-auto U2xR2"]
        assert ring_auto["exchanges_by_algorithm"].get("ring v-major", 0) > 0 and ring_auto["psnr_db"] > 20, ring_auto
    return report


@pytest.mark.slow  # a benchmark run (8 jobs on the emulated fabric); the demo's cluster part runs the same path
def test_e2e_smoke_runs_the_stock_layouts_and_every_mechanism():
    report = _smoke(SMOKE, floor=False)
    assert [c["name"] for c in report["configs"]] == [
        "stock U4", "stock U2xR2", "stock U2xPF2", "stock U1xPF4", "fair-flat U4", "tapa+vfirst U4", "tapa+vfirst+vmajor-auto U4", "tapa+vfirst U2xR2",
        "tapa+vfirst+vmajor-auto U2xR2"]
    assert report["layouts_not_run"] and report["regime"] == "not measured (no floor run)"


@pytest.mark.slow
def test_e2e_smoke_is_lossless_and_complete_with_its_floor():
    report = _smoke(None, floor=True)
    configs = {c["name"]: c for c in report["configs"]}
    assert [c["mechanism"] for c in report["configs"]] == ["stock", "stock", "stock", "stock", "fair-flat", *bench_e2e.MECHANISMS, "tapa+vfirst",
                                                         *bench_e2e.LOSSY]
    assert report["best_stock_links_share"] is not None and all(c["floor_speedup_vs_best_stock"] > 0 for c in configs.values())
    # V-Major ran (its rows as int4 residuals, the first step's against zeros: every row where the
    # budget needs nearly all of them), and the fabric's counters saw fewer bytes on the slow links.
    vmajor = configs["tapa+vfirst+vmajor U4"]
    assert 0 < vmajor["v_major_active_fraction"] <= 1 and vmajor["psnr_db"] > 20
    assert vmajor["slow_link_bytes"] < configs["tapa+vfirst U4"]["slow_link_bytes"]
    # On the ring's K/V it ran too; on rail those travel the rails (ring peers share a rail), not the
    # spine uplinks the slow-link counter reads, so its bytes there are the exact ring's, within the
    # counters' few hundred bytes of other traffic.
    ring = configs["tapa+vfirst+vmajor U2xR2"]
    assert ring["exchanges_by_algorithm"].get("ring v-major", 0) > 0 and 0 < ring["v_major_active_fraction"] <= 1, ring
    assert ring["slow_link_bytes"] == pytest.approx(configs["tapa+vfirst U2xR2"]["slow_link_bytes"], rel=0.05), ring


def test_the_series_holds_every_stock_layout_a_user_runs():
    configs, absent = bench_e2e.configs_for("digits-sd3", "aurora-like", 4, 2, ["tapa", "tapa+vfirst"])
    assert [c.name for c in configs] == ["stock U8", "stock U2xR4", "stock U4xCFG2", "fair-flat U8", "tapa U8",
                                         "tapa+vfirst U8", "tapa+vfirst U2xR4", "tapa+vfirst U4xCFG2"]
    assert configs[3].variant == "cocodiff-fair-flat" and next(c for c in bench_e2e.configs_for("digits-flux", "rail", 2, 2, [])[0] if c.mechanism == "fair-flat").variant == "cocodiff-fair-pxn"
    assert len(absent) == 1 and absent[0].startswith("PipeFusion: xfuser 0.7.0's SD3 pipeline wrapper"), absent
    # FLUX runs PipeFusion through xfuser's FLUX pipeline wrapper: a stage per node under Ulysses inside
    # it, and more stages (digits-flux has 6 blocks: not 8), stock only (V-First steps aside under PipeFusion).
    flux, absent = bench_e2e.configs_for("digits-flux", "rail", 2, 4, ["tapa+vfirst"])
    assert [c.name for c in flux] == ["stock U8", "stock U4xR2", "stock U4xPF2", "stock U2xPF4", "fair-flat U8",
                                      "tapa+vfirst U8", "tapa+vfirst U4xR2"] and len(absent) == 1
    assert flux[2].layout.flags() == "--ulysses_degree 4 --ring_degree 1 --pipefusion_parallel_degree 2"
    assert flux[2].layout.run(Run("digits-flux", 8)).world_size == 8
    # V-Major also runs on Ulysses x Ring (on the ring's K/V), not on Ulysses x CFG.
    lossy, _ = bench_e2e.configs_for("digits-sd3", "rail", 2, 2, ["tapa+vfirst+vmajor"])
    assert [c.name for c in lossy][-2:] == ["tapa+vfirst+vmajor U4", "tapa+vfirst+vmajor U2xR2"]


def test_unknown_configuration_is_refused():
    with pytest.raises(ValueError, match="unknown configuration"):
        bench_e2e.bench_e2e("rail", mechanisms=("tapa+nothing",))


def test_rounds_alternate_the_order_and_pair_each_ratio_within_a_round(monkeypatch):
    """With rounds, odd rounds run the series backwards, and a ratio is the median of each round's
    ratio: a host that slows down between rounds moves both configurations of a round alike."""
    order = []

    def run_config(fabric, model, run, config, repeat, work, timeout):
        order.append(config.name)
        slow = 1.0 + (len(order) - 1) // 3  # the host slows down from one round to the next
        return {"seconds": slow * (2.0 if config.mechanism == "stock" else 1.0)}

    monkeypatch.setattr(bench_e2e, "_run_config", run_config)
    configs, _ = bench_e2e.configs_for("digits-flux", "rail", 2, 2, ["tapa"])
    configs = [c for c in configs if c.name in ("stock U4", "stock U2xR2", "tapa U4")]
    reports = bench_e2e._run_series(contextlib.nullcontext(), "digits-flux", None, configs, 1, 1.0, "", 3)
    names = [c.name for c in configs]
    assert order == names + names[::-1] + names
    assert bench_e2e._speedup(reports["stock U4"], reports["tapa U4"]) == 2.0
    assert bench_e2e._seconds(reports["tapa U4"]) == 2.0
    with pytest.raises(ValueError, match="--rounds must be at least 1"):
        bench_e2e.bench_e2e("rail", rounds=0)
