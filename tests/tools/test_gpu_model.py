"""The GPU model against xDiT's published runs, and `cocodiff plan --gpu` for every class and model."""

from __future__ import annotations

import json

import pytest

from cocodiff_xfuser.tools import cli, gpu_model, payoff_map, plan

MODELS = ("flux-dev", "flux-schnell", "flux2-dev", "sd3.5-large", "qwen-image", "wan2.1-14b", "wan2.2-a14b",
          "hunyuan-video", "cogvideox-5b", "cogvideox-2b")
GPUS = ("a100", "l40s", "l20", "h20", "h100", "h100-pcie", "h200", "b200", "pvc")


def test_the_published_rows_are_predicted_within_the_targets():
    rep = gpu_model.validate()
    assert rep["rows"] >= 40 and all(rep["met"].values()), {k: rep[k] for k in gpu_model.TARGETS}
    # Every row is either predicted or said why not; the held-out check ran over every layout group.
    assert rep["rows"] + len(rep["not_expressible"]) == len(gpu_model.published_rows()[0]) + len(rep["not_expressible"])
    assert all(row["why"] for row in rep["not_expressible"])
    assert len(rep["held_out"]["groups"]) == len(rep["groups"]) >= 8
    # xDiT's FLUX table (4 H100s): Ulysses 4 is the fastest layout, eager and compiled.
    flux4 = [g for g in rep["groups"] if g["group"].startswith("flux-dev h100 4 ")]
    assert len(flux4) == 2 and all(g["predicted_fastest"] == g["published_fastest"] == "U4" for g in flux4)


def test_a_class_without_published_runs_takes_its_likes_shares():
    c = gpu_model.fitted()
    h100, h200, b200 = (gpu_model.gpu(k) for k in ("h100", "h200", "b200"))
    assert ("h200", "eager") not in c.share and c.rate_share(h200, "compiled") == c.rate_share(h100, "compiled")
    run = lambda g: gpu_model.Run(plan.MODELS["flux-dev"], 1024, 1024, 1, 28, g, "compiled", 8)  # noqa: E731
    # The same layout computes faster on the faster class.
    assert gpu_model.step(run(b200), gpu_model.Layout(8), c)["compute_s"] < gpu_model.step(run(h100), gpu_model.Layout(8), c)["compute_s"]


@pytest.mark.parametrize("gpu", GPUS)
def test_plan_answers_for_every_class_and_model(gpu):
    for model in MODELS:
        frames = {"wan": 81, "hun": 129, "cog": 49}.get(model[:3], 1)
        for nodes in (1, 2):
            rep = plan.plan_gpu(model, 1280, height=720, frames=frames, gpu=gpu, mode="eager", gpus_per_node=8,
                                nodes=nodes, steps=30)
            assert rep["world"] == 8 * nodes and rep["best_stock"] is not None
            for row in rep["ranked"]:
                assert row["total_s"] == pytest.approx(30 * row["step_s"] + rep["fixed_s"])
                assert row["name"] == "x".join(f"{k}{row[n]}" for k, n in (("U", "ulysses"), ("R", "ring"), ("P", "pipefusion"),
                                                                           ("C", "cfg")) if row[n] > 1) or row["name"] == "1"


def test_plan_gpu_cli_names_each_layout_with_its_step_and_total(capsys):
    assert cli.main(["plan", "--model", "flux-dev", "--gpu", "h100", "--mode", "compiled", "--gpus-per-node", "4",
                     "--nodes", "1", "--steps", "28", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    stock = {r["name"]: r for r in rep["ranked"] if r["backend"] == "stock"}
    assert {"U4", "U2xR2", "R4"} <= set(stock) and all(stock[n]["step_s"] > 0 and stock[n]["total_s"] > 0 for n in stock)
    # xDiT's published compiled runs on 4 H100s: 1.63 s (U4), 1.80 s (U2xR2), 1.98 s (R4).
    assert stock["U4"]["total_s"] < stock["U2xR2"]["total_s"] < stock["R4"]["total_s"]
    assert cli.main(["plan", "--model", "flux-dev", "--gpu", "h100", "--gpus-per-node", "4", "--nodes", "1"]) == 0
    assert "<- best stock layout" in capsys.readouterr().out


def test_a_stock_layout_needs_ulysses_to_divide_the_heads():
    run = gpu_model.Run(plan.MODELS["wan2.1-14b"], 1280, 720, 81, 50, gpu_model.gpu("h100"), "compiled", 8, 2)
    assert {lay.ulysses for lay in gpu_model.layouts(run)} == {1, 2, 4, 8}  # 40 heads
    assert 16 in {lay.ulysses for lay in gpu_model.layouts(run, stock=False)}  # cocodiff pads them


def test_pipefusion_is_planned_where_xfusers_runner_takes_it_at_its_measured_quality(capsys):
    run = lambda model: gpu_model.Run(plan.MODELS[model], 1024, 1024, 1, 28, gpu_model.gpu("h100"), "compiled", 8, 2)  # noqa: E731
    assert {lay.pipefusion for lay in gpu_model.layouts(run("wan2.1-14b"))} == {1}  # xfuser 0.7.0: USP only
    assert {lay.pipefusion for lay in gpu_model.layouts(run("flux-dev"))} == {1, 2, 4, 8, 16}
    rep = plan.plan_gpu("flux-dev", 1024, gpu="h100", mode="compiled", gpus_per_node=8, nodes=2, steps=28, inter_node_gbps=1.25)
    piped = [r for r in rep["ranked"] if r["pipefusion"] > 1]
    assert piped and all(r["lossy"] and not r["validated"] for r in piped)
    measured = plan.pipefusion_measured()  # the shipped frontier sweep's PipeFusion points: 2 and 4 stages on 2x2
    assert set(measured) == {2, 4} and 20 < measured[4] < measured[2] < 80  # more stages, staler activations
    assert all(r["psnr_db"] == (measured.get(r["pipefusion"]) if r["backend"] == "stock" else None) for r in piped)
    best = rep["best_pipefusion"]
    assert best["pipefusion"] in measured and best["backend"] == "stock" and best is min(
        (r for r in piped if r["psnr_db"] is not None), key=lambda r: r["total_s"])
    assert not rep["best"]["lossy"] and not rep["best_stock"]["lossy"]  # the lossless ranking leaves PipeFusion out
    plan._print_gpu_plan(rep)
    assert f"lossy: {best['name']} (stock)" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--gpu", "x100"], ["--gpu", "h100", "--mode", "fast"]])
def test_bad_gpu_input_is_one_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["plan", "--model", "flux-dev", *argv])
    assert exit_.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()[-1]) > 0


def test_the_map_writes_a_png_and_its_json(tmp_path, capsys):
    assert cli.main(["plan", "--map", "--model", "flux-dev", "--gpu", "h100", "--steps", "28", "--out", str(tmp_path),
                     "--json"]) == 0
    written = json.loads(capsys.readouterr().out)
    report = json.loads(open(written["json"]).read())
    assert len(report["cells"]) == len(report["gbps"]) * len(report["nodes"]) and min(report["gbps"]) == 1
    assert max(report["gbps"]) == 400 and report["nodes"] == [1, 2, 4, 8, 16]
    assert open(written["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    for cell in report["cells"]:
        best = cell["best"]
        assert cell["speedup_vs_best_stock"] == pytest.approx(cell["best_stock"]["total_s"] / best["total_s"])
        assert cell["speedup_vs_best_stock"] >= 1 - 1e-9 and best.get("psnr_db", 99) >= report["min_psnr_db"]
        assert cell["best_stock"].get("psnr_db", 99) >= report["min_psnr_db"]
        lossless, stock = cell["best_lossless"], cell["best_lossless_stock"]
        assert "psnr_db" not in lossless and "psnr_db" not in stock and stock["validated"]
        assert cell["lossless_speedup_vs_best_lossless_stock"] == pytest.approx(stock["total_s"] / lossless["total_s"])
    # Within one node nothing crosses a slow link: V-Major is not chosen there.
    assert all(c["best"]["backend"] != "cocodiff+v-major" for c in report["cells"] if c["nodes"] == 1)
    # A PSNR floor above every measured one leaves only lossless configurations, stock's and ours.
    strict = payoff_map.build("flux-dev", 1024, gpu="h100", steps=28, min_psnr=99)
    assert all("psnr_db" not in c["best"] and c["best_stock"] == c["best_lossless_stock"] for c in strict["cells"])


def test_a_floor_between_two_stage_counts_keeps_the_one_above_it():
    """PipeFusion's more stages are faster and further from the exact image: with a floor between two
    measured stage counts, the cells take the stage count above the floor, not no PipeFusion at all."""
    measured = plan.pipefusion_measured()
    above, below = max(measured, key=measured.get), min(measured, key=measured.get)
    floor = (measured[above] + measured[below]) / 2
    cells = payoff_map.build("flux-dev", 1024, gpu="h100", steps=28, min_psnr=floor)["cells"]
    stages = {c["best_stock"]["pipefusion"] for c in cells}
    assert above in stages and below not in stages


def test_the_map_needs_a_gpu_class(capsys):
    assert cli.main(["plan", "--map", "--model", "flux-dev"]) == 2
    assert "--map needs --model and --gpu" in capsys.readouterr().err
