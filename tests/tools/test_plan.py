"""`cocodiff plan`: the cost model's byte accounting, its validation on the shipped results, the
planner's recommendation and its errors (no torch, no processes: fast)."""

from __future__ import annotations

import json

import pytest

from cocodiff_xfuser.tools import cli, plan
from cocodiff_xfuser.tools.fabric import Fabric

MiB = 2**20


def _two_level(nodes: int, local: int) -> plan.Cluster:
    return plan.Cluster([plan.LinkLevel("node", nodes, 1e9), plan.LinkLevel("gpu", local, 1e10)])


def test_flat_and_tapa_link_times_2x2_by_hand():
    cl, x = _two_level(2, 2), 8 * MiB
    # flat: half of a rank's data leaves the node (1 GB/s), a quarter goes to the node-mate (10 GB/s)
    assert cl.flat_link(x) == pytest.approx(max(x / 2 / 1e9, x / 4 / 1e10))
    # TAPA: inner phase x/2 over the fast level, then x/2 over the slow one, one after the other
    assert cl.phases(x) == pytest.approx([x / 2 / 1e10, x / 2 / 1e9])
    ideal = plan.Coeffs()
    assert cl.time("hierarchical", x, ideal) == pytest.approx(x / 2 / 1e10 + x / 2 / 1e9)
    assert cl.time("flat", x, ideal) == pytest.approx(x / 2 / 1e9)
    # pipelined in 2 parts: the shorter phase overlaps half
    assert cl.time("hierarchical_x2", x, ideal) == pytest.approx(x / 2 / 1e9 + x / 2 / 1e10 / 2)


def test_flat_and_tapa_link_times_2x4_by_hand():
    cl, x = _two_level(2, 4), 8 * MiB
    assert cl.flat_link(x) == pytest.approx(max(x / 2 / 1e9, x * 3 / 8 / 1e10))
    assert cl.phases(x) == pytest.approx([x * 3 / 4 / 1e10, x / 2 / 1e9])
    # latency: one per phase for TAPA, the slowest crossed level's for flat
    lat = plan.Cluster([plan.LinkLevel("node", 2, 1e9, 5e-6), plan.LinkLevel("gpu", 4, 1e10, 2e-6)])
    assert lat.time("flat", x, plan.Coeffs()) == pytest.approx(x / 2 / 1e9 + 5e-6)
    assert lat.time("hierarchical", x, plan.Coeffs()) == pytest.approx(x * 3 / 4 / 1e10 + x / 2 / 1e9 + 7e-6)


def test_emulated_rail_flat_crosses_the_spine_tapa_does_not():
    fab = Fabric("rail", 2, 2)
    cl, x = plan.Cluster.from_fabric(fab), 16 * MiB
    assert cl.flat_link(x) == pytest.approx(fab.bound_s("flat", x))  # spine-bound: 2x the rails
    assert sum(cl.phases(x)) == pytest.approx(fab.bound_s("all_to_all", x))
    assert cl.flat_link(x) == pytest.approx(2 * sum(cl.phases(x)))


def test_step_bytes_match_the_shipped_e2e_runs():
    # digits-flux 64 px: 6 layers x (QKV + out) of 8 heads x 16, 256 + 16 tokens, fp32, 4 ranks
    msgs = plan.step_messages(plan.MODELS["digits-flux"], 64, ulysses=4)
    assert sum(b * n for _, b, n in msgs) == 835584
    assert sum(n for _, _, n in msgs) == 12
    # tiny-sd3 128 px, CFG batch 2: 2 image-only + 3 joint attentions, Q, K, V and out sent apart
    msgs = plan.step_messages(plan.MODELS["tiny-sd3"], 128, ulysses=4)
    assert sum(b * n for _, b, n in msgs) == 5341184
    assert sum(n for _, _, n in msgs) == 20
    assert sum(n for _, _, n in plan.step_messages(plan.MODELS["tiny-sd3"], 128, ulysses=4, v_first=True)) == 15


def test_fit_recovers_known_coefficients():
    truth = plan.Coeffs(1.2, 0.1, 0.003, 2e-9, 2.0)
    samples = []
    for preset in ("rail", "shared-uplink"):
        for nodes, local in ((2, 2), (2, 4), (4, 2)):
            cl = plan.Cluster.from_fabric(Fabric(preset, nodes, local))
            for mib in (0.25, 0.5, 1, 4, 16):
                for a in ("flat", "hierarchical"):
                    samples.append(plan.Sample(cl, a, mib * MiB, cl.time(a, mib * MiB, truth)))
    got = plan.fit(samples)
    for k in ("e0", "e1", "h_phase", "h_byte"):
        assert getattr(got, k) == pytest.approx(getattr(truth, k), rel=0.02), k


def test_validate_on_the_shipped_results_meets_the_target(capsys):
    rep = plan.validate()
    assert rep["points"] >= 150
    assert rep["median_abs_rel_error"] <= 0.15
    assert "leave-one-fabric-out" in rep["method"] and "v_major_active_fraction" in rep["method"]
    assert {"a2a/rail/flat", "a2a/rail/flat_p2p", "a2a/rail/hierarchical", "e2e/tiny-flux-rail"} <= set(rep["groups"])
    # a chosen exchange that is flat, flat_p2p or hierarchical is already a point of its own group
    chosen = [p["point"] for p in rep["per_point"] if p["group"].endswith("/chosen")]
    assert chosen and not any(p.endswith(("(flat)", "(flat_p2p)", "(hierarchical)")) for p in chosen)
    assert cli.main(["plan", "--validate", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["points"] == rep["points"] and out["median_abs_rel_error"] == pytest.approx(rep["median_abs_rel_error"])


def test_sd35_on_two_dgx_h100_nodes_lists_padded_ulysses():
    rep = plan.plan("sd3.5-large", 1024, cluster="dgx-h100", nodes=2)
    assert rep["world"] == 16
    by = {(r["ulysses"], r["ring"], r["cfg"]): r for r in rep["ranked"]}
    padded = by[(16, 1, 1)]  # 38 heads on 16 ranks: padded to 48
    assert padded["head_padding"] == pytest.approx(48 / 38)
    assert padded["bytes_per_step"] == pytest.approx(by[(2, 8, 1)]["bytes_per_step"] * 48 / 38)
    assert by[(8, 1, 2)]["pad_bytes_overhead"] == pytest.approx(40 / 38 - 1)
    assert ("--sp-backend cocodiff" in rep["recommended"]["flags"]) == (rep["recommended"]["backend"] == "cocodiff")
    assert "--ulysses_degree" in rep["recommended"]["flags"]
    assert all(r["ulysses"] * r["ring"] * r["cfg"] == 16 for r in rep["ranked"])
    # without padding only divisors of 38 remain
    rep = plan.plan("sd3.5-large", 1024, cluster="dgx-h100", nodes=2, pad_heads=False)
    assert all(38 % r["ulysses"] == 0 for r in rep["ranked"])


def _preset(tmp_path, gpus: int, extra: str = "") -> str:
    f = tmp_path / "cluster.yaml"
    f.write_text(f"levels:\n  - name: node\n    bandwidth_gbps: 10\n{extra}"
                 f"  - name: gpu\n    size: {gpus}\n    bandwidth_gbps: 100\n")
    return str(f)


def test_a_preset_file_is_sized_by_its_ranks_per_node_and_its_schema_errors_propagate(tmp_path):
    rep = plan.plan("flux-dev", 1024, cluster=_preset(tmp_path, 4), nodes=3)
    assert rep["world"] == 12 and rep["levels"].startswith("3 node")
    bad = _preset(tmp_path, 4, extra="    bandwidth: 10\n")
    with pytest.raises(ValueError, match=r"cluster\.yaml: levels\[0\]: unknown key 'bandwidth'"):
        plan.plan("flux-dev", 1024, cluster=bad, nodes=3)


def test_an_odd_world_gets_no_cfg_parallel(tmp_path):
    rep = plan.plan("sd3.5-large", 1024, cluster=_preset(tmp_path, 3), nodes=1)
    assert rep["world"] == 3 and rep["ranked"]
    assert all(r["cfg"] == 1 and r["ulysses"] * r["ring"] == 3 for r in rep["ranked"])


def test_head_padding_scales_only_the_attention_flops():
    rep = plan.plan("sd3.5-large", 1024, cluster="dgx-h100", nodes=2)
    padded = next(r for r in rep["ranked"] if (r["ulysses"], r["ring"], r["cfg"]) == (16, 1, 1))
    s, D = 64 * 64 + 333, 38 * 64  # 38 heads padded to 48 on 16 ranks; CFG: batch 2
    per_rank = s / 16 * (24 * D * D + 4 * s * D * 48 / 38)
    assert padded["compute_s"] == pytest.approx(2 * 38 * per_rank / 400e12)


def test_flux_with_uneven_tokens_gets_no_ring():
    # 1040 px: 65 x 65 = 4225 image tokens, odd: only Ulysses (cocodiff pads tokens) splits them
    rep = plan.plan("flux-dev", 1040, cluster="dgx-h100", nodes=2)
    assert [(r["ulysses"], r["ring"]) for r in rep["ranked"]] == [(16, 1)]
    assert rep["recommended"]["ring"] == 1 and "--ring_degree 1" in rep["recommended"]["flags"]
    # 1024 px: 4096 + 512 tokens split over 16 ranks, ring allowed
    assert any(r["ring"] > 1 for r in plan.plan("flux-dev", 1024, cluster="dgx-h100", nodes=2)["ranked"])


def test_plan_cli_prints_a_table(capsys):
    assert cli.main(["plan", "--model", "flux-dev", "--size", "1024", "--cluster", "dgx-h100", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "recommended: --ulysses_degree" in out and "dgx-h100 x2 = 16 ranks" in out


@pytest.mark.parametrize("argv", [
    ["plan", "--model", "flux-dev", "--cluster", "no-such-cluster"],
    ["plan", "--model", "flux-dev", "--size", "1000"],
    ["plan", "--model", "flux-dev", "--nodes", "0"],
    ["plan"],
])
def test_bad_input_is_one_line_and_exit_2(argv, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cocodiff plan: ") and "\n" not in err


def test_bad_inputs_raise_value_error(tmp_path):
    with pytest.raises(ValueError, match="unknown model"):
        plan.plan("no-model", 1024, cluster="dgx-h100", nodes=2)
    with pytest.raises(ValueError, match="no a2a results"):
        plan.validate(tmp_path)
    bad = tmp_path / "a2a.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        plan.calibrate_file(bad)


def test_calibrate_a_real_cluster_json_fits_the_node_level(tmp_path):
    d = json.loads((plan.RESULTS_DIR / "a2a-rail-2x4.json").read_text())
    d["fabric"] = None  # as `python -m ...bench.a2a` writes it on a real cluster: levels only
    assert plan.a2a_samples(d, floor=True) == []  # host floors exist on emulated fabrics only
    f = tmp_path / "a2a.json"
    f.write_text(json.dumps(d))
    c, cl = plan.calibrate_file(f)
    node = cl.levels[0]
    assert node.name == "node" and 0.75 * 125e6 < node.Bps <= 1.0 * 125e6  # 1 Gbit/s rails
    assert c.flat_factor > 2  # stock flat crosses the oversubscribed spine


@pytest.mark.parametrize("cluster, first", [
    (["--cluster", "rail"], "calibrated: fitted on the shipped a2a results"),
    (["--cluster", "dgx-h100", "--nodes", "2"], "UNCALIBRATED: links priced at the dgx-h100 preset's line rates"),
    (["--cluster", "aurora", "--nodes", "1"], "UNCALIBRATED: links priced at the aurora preset's line rates"),
])
def test_the_first_line_says_whether_the_plan_is_calibrated(cluster, first, capsys):
    assert cli.main(["plan", "--model", "flux-dev", "--size", "1024", *cluster]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith(first), line
    if line.startswith("UNCALIBRATED"):
        assert "--calibrate" in line and "cocodiff_xfuser.tools.bench.a2a" in line
    if "aurora" in cluster:  # what real collectives achieved there, as its source measured it
        assert "25.5 ms with oneCCL" in line


def test_the_planner_reads_the_shipped_measurements():
    from cocodiff_xfuser import shipped

    assert plan.RESULTS_DIR == shipped.RESULTS
    assert len(list(shipped.RESULTS.glob("a2a-*-*x*.json"))) == 9
    fixed, per_byte = plan.v_major_layer_cost("H200")  # bench kernels on one H200, fitted
    assert fixed > 0 and per_byte > 0 and plan.v_major_layer_cost("no such GPU") is None
    assert plan.v_major_layer_cost("H100") is None  # its runs were of the previous release's kernels


def _no_host_time(monkeypatch) -> None:
    monkeypatch.setattr(plan, "host_costs", lambda: dict.fromkeys(plan.HOST_CONFIGS, 0.0))


def test_the_host_costs_per_call_are_the_h200_runs():
    cost = json.loads((plan.RESULTS_DIR / plan.HOST_COSTS).read_text())
    measured = {k: v * 1e-6 for k, v in json.loads((plan.RESULTS_DIR / "launch-host-h200.json").read_text()).items()
                if isinstance(v, float)}
    assert cost["torch_op_s"] == measured["torch add_"] and cost["triton_launch_s"] == measured["bare triton launch (1 arg)"]
    # A Python call: the V-Major wrappers' host time less their operators' and launches', over their calls.
    wrappers = cost["python_call_derivation"]
    python = {name: measured[name] - w["allocations_and_views"] * measured["torch empty"] - w["other_operators"] * measured["torch add_"]
              - w["triton_launches"] * measured["bare triton launch (1 arg)"] for name, w in wrappers.items()}
    assert cost["python_call_s"] == pytest.approx(sum(python.values()) / sum(w["python_calls"] for w in wrappers.values()))
    assert all(0 < python[name] / w["python_calls"] < 1e-6 for name, w in wrappers.items())


def test_host_time_is_priced_for_stock_and_cocodiff_and_can_make_stock_the_recommendation(monkeypatch):
    measured = plan.host_costs()
    cost = json.loads((plan.RESULTS_DIR / plan.HOST_COSTS).read_text())
    counts = {r["name"]: r["eager"]["counts"] for r in json.loads((plan.RESULTS_DIR / plan.HOST_RUN).read_text())["configs"]}
    for key, name in plan.HOST_CONFIGS.items():  # counted per layer, at a GPU host's cost of each
        c = counts[name]
        assert measured[key] == pytest.approx(c["python_calls_per_layer"] * cost["python_call_s"] + c["torch_ops_per_layer"]
                                              * cost["torch_op_s"] + c["kernel_launches_per_layer"] * cost["triton_launch_s"])
    assert 0 < measured["stock"] and measured["v_first"] < measured["v_major"]
    rep = plan.plan("flux-dev", 1024, cluster="dgx-h100", nodes=2)
    layers = sum(n for n, _ in plan.MODELS["flux-dev"].attn)
    for row in rep["ranked"]:
        assert row["host_s"] == pytest.approx(layers * measured["v_first" if row["v_first"] else "cocodiff"])
        assert row["stock_host_s"] == pytest.approx(layers * measured["stock"])
        assert row["step_s"] == pytest.approx(row["compute_s"] + row["cocodiff_comm_s"] + row["host_s"])
        assert row["stock_step_s"] == pytest.approx(row["compute_s"] + row["stock_comm_s"] + row["stock_host_s"])
    if rep["recommended"]["backend"] == "stock":
        assert "--sp-backend" not in rep["recommended"]["flags"] and rep["speedup_vs_best_stock"] == 1.0
        assert rep["ranked"][0]["step_s"] >= rep["best_stock"]["stock_step_s"]
    _no_host_time(monkeypatch)
    free = plan.plan("flux-dev", 1024, cluster="dgx-h100", nodes=2)
    assert free["recommended"]["backend"] == "cocodiff" and "--sp-backend cocodiff" in free["recommended"]["flags"]


def test_v_major_is_suggested_only_where_it_saves_more_than_its_work_costs(monkeypatch):
    # On four H100 nodes at U32, V-Major's bytes saved are worth its kernels' GPU time (priced from
    # one H200's graph replays, scaled by memory bandwidth) but not its host time; kernels of a
    # millisecond per layer, as the previous release's launched one by one, would not be either.
    vm = plan.plan("flux-dev", 1024, cluster="dgx-h100", nodes=4)["v_major"]
    assert not vm["recommended"] and vm["note"].startswith("not recommended: ")  # its host time
    _no_host_time(monkeypatch)
    assert plan.plan("flux-dev", 1024, cluster="dgx-h100", nodes=4)["v_major"]["recommended"]
    monkeypatch.setattr(plan, "v_major_kernel_cost", lambda cluster: ((1e-3, 0.0), "a millisecond per layer"))
    assert not plan.plan("flux-dev", 1024, cluster="dgx-h100", nodes=4)["v_major"]["recommended"]


@pytest.mark.parametrize("preset", ["dgx-h100", "dgx-h200", "aurora", "pcie-8gpu"])
def test_v_major_is_priced_on_every_preset_with_its_break_even_link_speed(preset, capsys):
    vm = plan.plan("flux-dev", 1024, cluster=preset, nodes=2)["v_major"]
    assert vm["v_major_kernel_s"] > 0 and vm["v_major_break_even_gbps"] > 0 and vm["compute_s"] > 0
    assert vm["v_major_break_even_gbps"] == pytest.approx(vm["slow_link_bytes_saved_per_layer"] / vm["v_major_kernel_s"] / 1e9)
    how = "measured on one H200" if preset == "dgx-h200" else "scaled from one H200 by memory bandwidth, 4.8 -> "
    assert vm["kernels_priced"].startswith(how) and "not priced" not in vm["note"]
    assert cli.main(["plan", "--model", "flux-dev", "--cluster", preset, "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "not priced" not in out
    assert f"V-Major pays below {vm['v_major_break_even_gbps']:.1f} GB/s per GPU link (its kernels: " in out
    assert cli.main(["plan", "--model", "flux-dev", "--cluster", preset, "--nodes", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["v_major"]["v_major_kernel_s"] == pytest.approx(vm["v_major_kernel_s"])


def test_v_major_kernels_scale_with_memory_bandwidth():
    h100, h200, aurora = (plan.plan("flux-dev", 1024, cluster=p, nodes=2)["v_major"] for p in ("dgx-h100", "dgx-h200", "aurora"))
    assert h100["on"] == h200["on"] and h100["slow_link_bytes_saved_per_layer"] == h200["slow_link_bytes_saved_per_layer"]
    assert h100["v_major_kernel_s"] == pytest.approx(h200["v_major_kernel_s"] * 4.8 / 3.35)
    assert h200["v_major_break_even_gbps"] > h100["v_major_break_even_gbps"]
    assert "4.8 -> 1.64 TB/s" in aurora["kernels_priced"]
    # no V-Major section where no layout crosses nodes
    assert plan.plan("flux-dev", 1024, cluster="dgx-h100", nodes=1)["v_major"] is None


@pytest.mark.parametrize("fabric, emulated", [("rail", "dgx-h100"), ("shared-uplink", "dgx-h100"), ("aurora-like", "aurora")])
def test_an_emulated_fabric_prices_v_major_as_the_cluster_it_emulates(fabric, emulated):
    cost, how = plan.v_major_kernel_cost(fabric)
    assert cost == plan.v_major_kernel_cost(emulated)[0]
    assert how.startswith(plan.v_major_kernel_cost(emulated)[1]) and f"{fabric} is emulated on this CPU host" in how
    vm = plan.plan("flux-dev", 1024, cluster=fabric, nodes=2)["v_major"]
    assert vm["v_major_kernel_s"] > 0 and vm["v_major_break_even_gbps"] > 0 and vm["kernels_priced"] == how


def test_every_preset_has_a_memory_bandwidth_and_devices_are_found_by_name(tmp_path):
    from cocodiff_xfuser.comm.topology import presets
    from cocodiff_xfuser.tools.fabric import PRESETS as FABRICS

    assert set(presets()) <= set(plan.MEMORY_BPS) and set(FABRICS) <= set(plan.EMULATES)
    assert set(plan.EMULATES.values()) <= set(plan.MEMORY_BPS)
    assert plan.device_memory_bps("NVIDIA H100 80GB HBM3") == 3.35e12
    assert plan.device_memory_bps("NVIDIA H100 PCIe") == 2.0e12  # the longest name that matches
    assert plan.device_memory_bps("NVIDIA H200") == 4.8e12
    assert plan.device_memory_bps("Intel(R) Data Center GPU Max 1550") == pytest.approx(1.6384e12)  # one stack
    assert plan.device_memory_bps("NVIDIA A100-SXM4-80GB") == 2.039e12
    assert plan.device_memory_bps("no such GPU") is None
    # a cluster of its own (no known GPU) is priced as the GPU the runs measured, and says so
    cost, how = plan.v_major_kernel_cost(_preset(tmp_path, 4))
    assert cost == plan.v_major_layer_cost(plan.KERNEL_GPU) and "not known" in how


@pytest.mark.slow  # builds and installs a wheel: a packaging check (make test runs the editable install)
@pytest.mark.distributed
def test_the_wheel_ships_the_configs_and_the_planner_measurements(tmp_path):
    """Built and unpacked away from the checkout, the wheel plans on its own files."""
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    root = Path(plan.__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(root)], check=True,
                   capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "cocodiff_xfuser/configs/dgx-h100.yaml" in names and "cocodiff_xfuser/configs/policies/v-major.yaml" in names
    assert sum(n.startswith("cocodiff_xfuser/results/a2a-") for n in names) == 9
    assert f"cocodiff_xfuser/results/{plan.V_MAJOR_DEFAULTS_RUN}" in names and f"cocodiff_xfuser/results/{plan.HOST_RUN}" in names
    assert f"cocodiff_xfuser/results/{plan.HOST_COSTS}" in names and f"cocodiff_xfuser/results/{plan.PIPEFUSION_RUN}" in names
    assert sum(n.startswith("cocodiff_xfuser/results/kernels-") for n in names) == 3
    assert "cocodiff_xfuser/results/xdit-published.yaml" in names and "cocodiff_xfuser/configs/gpus/classes.yaml" in names
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    code = ("import sys, cocodiff_xfuser; assert cocodiff_xfuser.__file__.startswith(sys.argv[1]); "
            "from cocodiff_xfuser.tools.cli import main; sys.exit(main(sys.argv[2:]))")
    for cluster in (["--cluster", "rail"], ["--cluster", "dgx-h100", "--nodes", "2"], ["--gpu", "h20", "--nodes", "1"]):
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "site"), "plan", "--model", "flux-dev", "--size",
                              "1024", *cluster], cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines()[0].startswith(("calibrated:", "UNCALIBRATED:", "flux-dev 1024x1024")), out.stdout


def test_the_ranking_marks_the_best_stock_layout(capsys):
    rep = plan.plan("flux-dev", 1024, cluster="dgx-h100", nodes=2)
    assert rep["best_stock"] == min(rep["ranked"], key=lambda r: r["stock_step_s"])
    best = min(rep["ranked"][0]["step_s"], rep["best_stock"]["stock_step_s"])
    assert rep["speedup_vs_best_stock"] == rep["best_stock"]["stock_step_s"] / best
    assert cli.main(["plan", "--model", "flux-dev"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sum(line.endswith("<- best stock layout") for line in out) == 1
    assert any(line.startswith("best stock layout: --ulysses_degree") for line in out)


def test_pipefusion_layouts_are_priced_beside_the_exact_ones_with_their_measured_quality(capsys):
    """On an emulated 2x2 cluster (links slow enough that sends matter), stock PipeFusion's layouts are
    listed, fastest first, each at the PSNR the shipped sweep measured for its stage count; a stage's
    compute is 1/P of the layers, and its sends cross nodes where the stages span them."""
    rep = plan.plan("digits-flux", 64, cluster="aurora-like", nodes=2, local=2, steps=16)
    rows = {r["name"]: r for r in rep["pipefusion"]}
    assert set(rows) == {"U2xPF2", "U1xPF4"}
    assert [r["step_s"] for r in rep["pipefusion"]] == sorted(r["step_s"] for r in rep["pipefusion"])
    measured = plan.pipefusion_measured()
    assert all(r["psnr_db"] == measured.get(r["pipefusion"]) for r in rows.values()) and rows["U2xPF2"]["psnr_db"] > 30
    u4 = next(r for r in rep["ranked"] if (r["ulysses"], r["ring"]) == (4, 1))
    assert rows["U1xPF4"]["compute_s"] == pytest.approx(u4["compute_s"])  # 1/4 of the layers at all the tokens
    assert rows["U2xPF2"]["send_link"] == rows["U1xPF4"]["send_link"] == "node" and rows["U1xPF4"]["comm_s"] == 0
    assert plan.plan("wan2.1-14b", 720, cluster="dgx-h100", nodes=2)["pipefusion"] == []  # not xfuser's for Wan
    cli.main(["plan", "--model", "digits-flux", "--size", "64", "--cluster", "aurora-like", "--nodes", "2", "--local", "2"])
    out = capsys.readouterr().out
    assert "stock PipeFusion U2xPF2" in out and "stock PipeFusion U1xPF4" in out
