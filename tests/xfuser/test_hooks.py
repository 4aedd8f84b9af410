"""The xfuser patches: flag on both entry paths, guards, idempotence, bug workarounds."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from cocodiff_xfuser import _finder, compat
from cocodiff_xfuser.settings import Options, error_for
from cocodiff_xfuser.xfuser import flags, hooks


def _parser():
    from xfuser.config import FlexibleArgumentParser

    return FlexibleArgumentParser()


@pytest.mark.parametrize("entry", ["add_cli_args", "add_runner_args"])
def test_sp_backend_flag_on_both_entry_paths(entry):
    from xfuser import xFuserArgs

    parser = getattr(xFuserArgs, entry)(_parser())
    assert parser.parse_args(["--model", "m"]).sp_backend == "ulysses"
    args = parser.parse_args(["--model", "m", "--sp-backend", "cocodiff", "--cocodiff-topology", "2x2"])
    assert (args.sp_backend, args.cocodiff_topology, args.cocodiff_a2a) == ("cocodiff", "2x2", "auto")


def test_unknown_backend_is_rejected_by_the_parser():
    from xfuser import xFuserArgs

    parser = xFuserArgs.add_runner_args(_parser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--sp-backend", "megatron"])


def test_backend_options_are_carried_into_engine_args():
    from xfuser import xFuserArgs

    runner = xFuserArgs.from_runner_args({"model": "m", "sp_backend": "cocodiff", "cocodiff_topology": "2x2"})
    assert (runner.sp_backend, runner.cocodiff_topology) == ("cocodiff", "2x2")
    cli = xFuserArgs.from_cli_args(xFuserArgs.add_cli_args(_parser()).parse_args(["--model", "m", "--sp_backend=cocodiff"]))
    assert cli.sp_backend == "cocodiff"


def test_patches_are_idempotent():
    import xfuser.config.args as args_module
    from xfuser import xFuserArgs

    patched = {name: vars(xFuserArgs)[name] for name in ("add_cli_args", "add_runner_args", "from_cli_args", "create_config")}
    assert all(compat.is_wrapped(getattr(f, "__func__", f)) for f in patched.values())
    flags.patch_args(args_module)
    assert {name: vars(xFuserArgs)[name] for name in patched} == patched  # not wrapped twice
    parser = xFuserArgs.add_runner_args(_parser())
    assert sum(1 for action in parser._actions if "--sp_backend" in action.option_strings) == 1


def test_the_ring_rotater_is_routed_and_stays_torchs_without_an_exchanger():
    """Loading xfuser's Ulysses module wraps torch's rotater factory; with no job's exchanger (stock)
    it returns torch's own rotater, and a torch without the factory leaves the ring's exchange stock
    (one reason, logged when a job with a ring starts)."""
    import importlib

    import torch.distributed as dist
    import xfuser.model_executor.layers.usp as usp  # its load hook routes the rotater

    from cocodiff_xfuser.xfuser import activation, job

    ring_attention = importlib.import_module(compat.RING_ATTENTION)
    assert compat.is_wrapped(ring_attention._create_rotater) and job.exchanger() is None
    assert compat.is_wrapped(usp._templated_ring_attention)  # counts the traced ring
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert type(ring_attention._create_rotater(dist.group.WORLD, 2)).__name__ == "_AllGatherRotater"
    finally:
        dist.destroy_process_group()

    def lacking(module, name):
        raise compat.IncompatibleTorch(f"cocodiff-xfuser: {module}.{name} not found in torch x")

    assert activation.ring_unrouted() is None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compat, "torch_private", lacking)
        mp.setattr(compat, "switch", lambda *args: pytest.fail("a torch without the rotater factory keeps its own"))
        activation.route_ring_exchange(usp)
        assert "_create_rotater not found" in activation.ring_unrouted()


def test_missing_patch_target_is_a_clear_error():
    with pytest.raises(compat.IncompatibleXfuser, match=r"fake\.gone not found"):
        compat.target(types.ModuleType("fake"), "gone")


def test_every_private_xfuser_name_exists():
    assert compat.missing() == []
    with pytest.raises(ValueError, match="PRIVATE_NAMES"):
        compat.private("xfuser.model_executor.layers.usp", "_not_listed")


@pytest.mark.parametrize(
    "argv, env, expected",
    [
        (["x", "--sp-backend", "cocodiff"], "", True),
        (["x", "--sp_backend=cocodiff"], "", True),
        (["x", "--sp-backend", "ulysses"], "", False),
        (["x"], "cocodiff", True),
        (["x"], "", False),
    ],
)
def test_cocodiff_requested(argv, env, expected, monkeypatch):
    monkeypatch.setenv(flags.BACKEND_ENV, env)
    assert flags.cocodiff_requested(argv) is expected


def test_version_guard(monkeypatch):
    monkeypatch.setattr(compat, "xfuser_version", lambda: "0.6.9")
    hooks.enabled.cache_clear()
    try:
        monkeypatch.setattr(sys, "argv", ["xdit"])
        monkeypatch.delenv(flags.BACKEND_ENV, raising=False)
        assert hooks.is_hooked("xfuser.envs") is False  # stock users: silence
        hooks.enabled.cache_clear()
        monkeypatch.setattr(sys, "argv", ["xdit", "--sp-backend", "cocodiff"])
        with pytest.raises(compat.IncompatibleXfuser, match="xfuser==0.7.0"):
            hooks.is_hooked("xfuser.envs")
    finally:
        hooks.enabled.cache_clear()


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ, **env}
    )


@pytest.mark.distributed
def test_pth_installs_the_finder_and_the_switch_disables_it():
    code = "import sys, cocodiff_xfuser._finder as f; print(any(isinstance(x, f.XfuserFinder) for x in sys.meta_path))"
    assert _python(code).stdout.strip() == "True"
    assert _python(code, **{_finder.DISABLE_ENV: "1"}).stdout.strip() == "False"


@pytest.mark.distributed
def test_environment_variable_selects_the_default_backend():
    code = (
        "from xfuser import xFuserArgs; from xfuser.config import FlexibleArgumentParser;"
        "print(xFuserArgs.add_runner_args(FlexibleArgumentParser()).parse_args(['--model', 'm']).sp_backend)"
    )
    result = _python(code, **{flags.BACKEND_ENV: "cocodiff"})
    assert result.stdout.strip().splitlines()[-1] == "cocodiff", result.stderr[-2000:]


@pytest.mark.distributed
def test_sd3_image_only_attention_matches_diffusers(monkeypatch):
    """The SD3.5 attn2 workaround computes what diffusers computes; USP (xfuser's) is plain SDPA here."""
    import torch
    import torch.nn.functional as F
    from diffusers.models.attention_processor import Attention, JointAttnProcessor2_0
    from xfuser.model_executor.layers import usp

    from cocodiff_xfuser.processors.sd3 import image_only_joint_attention

    monkeypatch.setattr(usp, "USP", lambda q, k, v, **_: F.scaled_dot_product_attention(q, k, v))
    torch.manual_seed(0)
    attn = Attention(query_dim=32, dim_head=8, heads=4, out_dim=32, qk_norm="rms_norm", processor=JointAttnProcessor2_0())
    hidden = torch.randn(2, 16, 32)
    torch.testing.assert_close(image_only_joint_attention(attn, hidden), attn(hidden), rtol=1e-5, atol=1e-5)


def _generate_u2(tmp_path, model: str, size: int):
    from cocodiff_xfuser.tools import launcher
    from cocodiff_xfuser.tools.verify import Run

    run = Run(model=model, ulysses_degree=2, height=size, width=size)
    return launcher.torchrun(2, run.argv(("ulysses", "cocodiff"), tmp_path), timeout=600)


@pytest.mark.distributed
def test_flux_odd_token_count_is_refused_by_stock_and_padded_by_cocodiff(tmp_path):
    """36x36 gives 81 image tokens. xfuser 0.7.0 crashed on a misspelled method; calling the real one
    attends to zero padding (5.6e-4 off one process here), so stock gets a clear error, while
    cocodiff pads the tokens and drops them from the keys (cocodiff_xfuser/padding.py)."""
    from cocodiff_xfuser.tools import launcher, verify
    from cocodiff_xfuser.tools.launcher import TorchrunError

    run = verify.Run(model="tiny-flux", ulysses_degree=2, height=36, width=36)
    with pytest.raises(TorchrunError, match="81 image tokens are not divisible by the SP degree 2"):
        launcher.torchrun(2, run.argv(("ulysses",), tmp_path), timeout=600)
    report = verify.verify(run, workdir=tmp_path)
    assert report["within_tolerance"] and report["max_abs_diff_vs_single_process"] <= verify.SINGLE_PROCESS_ATOL, report
    ran = report["ran"]["cocodiff"]
    assert ran["padded_bytes"] > 0 and ran["v_first_calls"] > 0 and ran["fallbacks"] == {}, ran


@pytest.mark.distributed
def test_qwen_padding_that_would_change_the_image_is_refused(tmp_path):
    from cocodiff_xfuser.tools.launcher import TorchrunError

    with pytest.raises(TorchrunError, match="81 image tokens are not divisible by the SP degree 2"):
        _generate_u2(tmp_path, "tiny-qwen-image", 36)


def _transformer_with(*processors):
    import torch

    class Attention(torch.nn.Module):
        def __init__(self, processor):
            super().__init__()
            self.processor = processor

    return torch.nn.Sequential(*(Attention(p) for p in processors))


def test_models_whose_exchange_bypasses_usp_fall_back_to_stock():
    import xfuser.model_executor.layers.usp  # noqa: F401  (a module that imports USP)

    from cocodiff_xfuser.processors import families

    sana = type("xFuserSanaLinearAttnProcessor2_0", (), {})()
    assert "SeqAllToAll4D" in families.unsupported_reason(_transformer_with(sana))
    assert "no attention processor" in families.unsupported_reason(_transformer_with(object()))
    calls_usp = type("xFuserSomeAttnProcessor", (), {"__module__": "xfuser.model_executor.layers.usp"})()
    assert families.unsupported_reason(_transformer_with(calls_usp, object())) is None


def test_stock_usp_processors_that_cannot_carry_padded_heads_are_found():
    import xfuser.model_executor.layers.usp  # noqa: F401  (a module that imports USP)

    from cocodiff_xfuser.processors import families
    from cocodiff_xfuser.processors.flux import FluxVFirstProcessor
    from cocodiff_xfuser.xfuser import padded

    calls_usp = type("xFuserSomeAttnProcessor", (), {"__module__": "xfuser.model_executor.layers.usp"})()
    ours = FluxVFirstProcessor(stock=object())
    assert families.stock_usp(_transformer_with(calls_usp, ours, object())) == {"xFuserSomeAttnProcessor"}
    assert families.stock_usp(_transformer_with(ours)) == set()
    model = type("M", (), {"config": type("C", (), {"num_attention_heads": 38})()})()
    assert padded.uneven_heads([model], 4) == "38 attention heads over ulysses degree 4"
    assert padded.uneven_heads([model], 2) is None


def test_backend_options_reject_unknown_algorithms():
    with pytest.raises(ValueError, match="--cocodiff-a2a"):
        Options(a2a="ring")


@pytest.mark.distributed
@pytest.mark.skipif(__import__("shutil").which("mpiexec") is None, reason="mpiexec not installed (apt-get install mpich)")
def test_mpiexec_launch_matches_stock(tmp_path):
    """No torchrun: ranks come from the MPI launcher's environment."""
    import numpy as np

    from cocodiff_xfuser.tools.generate import output_dir
    from cocodiff_xfuser.tools.launcher import free_port
    from cocodiff_xfuser.tools.verify import Run

    argv = Run(model="tiny-flux", ulysses_degree=2).argv(("ulysses", "cocodiff"), tmp_path)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(["mpiexec", "-n", "2", sys.executable, *argv], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    stock, ours = (np.load(output_dir(tmp_path, "cocodiff/tiny-flux", b) / "images.npy") for b in ("ulysses", "cocodiff"))
    assert stock.tobytes() == ours.tobytes()


@pytest.mark.slow  # the autotune measures every size; refusing a foreign file stays in make test
@pytest.mark.distributed
def test_autotune_decisions_are_exported_and_reloaded(tmp_path):
    """COCODIFF_A2A_DECISIONS: written at exit by one job, loaded by the next (same decisions)."""
    import json

    from cocodiff_xfuser.tools import launcher
    from cocodiff_xfuser.tools.verify import Run

    decisions = tmp_path / "a2a.json"
    argv = Run(model="tiny-flux", ulysses_degree=4, topology="2x2").argv(("cocodiff",), tmp_path / "out")
    launcher.torchrun(4, argv, env={"COCODIFF_A2A_DECISIONS": str(decisions)}, timeout=600)
    first = json.loads(decisions.read_text())
    assert first["topology"] == "2x2" and first["decisions"], first
    second = launcher.torchrun(4, argv, env={"COCODIFF_A2A_DECISIONS": str(decisions)}, timeout=600)
    assert "decisions loaded from" in second.stdout + second.stderr
    assert json.loads(decisions.read_text())["decisions"] == first["decisions"]


@pytest.mark.distributed
def test_user_jobs_load_no_tooling():
    """Importing xfuser's runner with the plugin active loads the plugin, not the tooling (nor
    matplotlib); the tiny models are registered from the entry point on first lookup only."""
    code = (
        "import sys, xfuser.runner as r;"
        "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('cocodiff_xfuser.')}));"
        "print('matplotlib' in sys.modules, any(m.startswith('cocodiff_xfuser.tools') for m in sys.modules));"
        "print(r.MODEL_REGISTRY.get('cocodiff/tiny-flux').__name__)"
    )
    result = _python(code)
    loaded, before, model = result.stdout.strip().splitlines()[-3:]
    assert "xfuser" in loaded and "tools" not in loaded, result.stderr[-2000:]
    assert before == "False False"
    assert model == "TinyFlux"


@pytest.mark.distributed
def test_decisions_measured_elsewhere_are_refused_once(tmp_path):
    """A decisions file from another topology is refused: one line, from rank 0 only, exit 2."""
    import json

    from cocodiff_xfuser.tools import launcher
    from cocodiff_xfuser.tools.verify import Run

    decisions = tmp_path / "a2a.json"
    decisions.write_text(json.dumps({"version": 1, "topology": "4x1", "backend": "gloo", "world_size": 4, "decisions": []}))
    argv = Run(model="tiny-flux", ulysses_degree=4, topology="2x2").argv(("cocodiff",), tmp_path / "out")
    with pytest.raises(launcher.TorchrunError) as failed:
        launcher.torchrun(4, argv, env={"COCODIFF_A2A_DECISIONS": str(decisions)}, timeout=600)
    output = failed.value.result.stdout + failed.value.result.stderr
    assert output.count("was measured on") == 1, output[-3000:]
    assert "]: Traceback" not in output, output[-3000:]  # no rank printed one (torchrun's own report aside)


@pytest.mark.distributed
@pytest.mark.parametrize("given, line", [
    (("--cocodiff-topology", "3x3"), "cocodiff: topology 3x3"),
    (("--cocodiff-v-major", "on", "--cocodiff-v-major-policy", "budget", "--cocodiff-v-major-threshold", "0.3"),
     "cocodiff: --cocodiff-v-major-threshold is not read by policy budget"),
    pytest.param(("--cocodiff-a2a", "fastest"), "invalid choice: 'fastest'", marks=pytest.mark.slow),  # argparse's own check
    (("--use_fp8_comms", "--cocodiff-v-major", "on"), "cocodiff: --use_fp8_comms with --cocodiff-v-major"),
    pytest.param(("--use_fp8_comms", "--cocodiff-compress", "fp8-slow"), "cocodiff: --use_fp8_comms with --cocodiff-compress fp8-slow",
                 marks=pytest.mark.slow),  # the same check as the line above
])
def test_xdit_refuses_a_mistake_before_launch(tmp_path, given, line):
    """A mistake that needs no ranks: one line from the xdit process, exit 2, no worker started."""
    xdit = os.path.join(os.path.dirname(sys.executable), "xdit")
    result = subprocess.run(
        [xdit, "--model", "cocodiff/tiny-flux", "--ulysses_degree", "2", "--sp-backend", "cocodiff", *given,
         "--prompt", "a cat"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    ours = [s for s in result.stderr.splitlines() if s.startswith("cocodiff")]
    assert result.returncode == 2 and len(ours) == 1 and line in ours[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "torch.distributed" not in result.stderr and result.stdout == ""


def test_v_major_auto_takes_its_budget_from_the_calibration():
    config = types.SimpleNamespace(cocodiff_v_major="auto", cocodiff_v_major_min_psnr=40.0)
    settings = flags.v_major_settings(config)
    assert settings.policy == "budget" and settings.min_psnr_db == 40.0
    assert settings.rule.error == pytest.approx(error_for(40.0))
    on = flags.v_major_settings(types.SimpleNamespace(cocodiff_v_major="on"))
    assert on.min_psnr_db is None  # only auto checks its speed against the exact exchange
    with pytest.raises(ValueError, match="sets --cocodiff-v-major-policy itself"):
        flags.v_major_settings(types.SimpleNamespace(cocodiff_v_major="auto", cocodiff_v_major_policy="top-k"))
    with pytest.raises(ValueError, match="needs --cocodiff-v-major auto"):
        flags.v_major_settings(types.SimpleNamespace(cocodiff_v_major="on", cocodiff_v_major_min_psnr=38.0))


def test_a_v_major_knob_its_policy_does_not_read_is_one_line(tmp_path):
    def settings(**flags_given):
        return flags.v_major_settings(types.SimpleNamespace(**{f"cocodiff_{k}": v for k, v in flags_given.items()}))

    with pytest.raises(ValueError, match=r"^--cocodiff-v-major-threshold is not read by policy top-k \(read by threshold\)"):
        settings(v_major="on", v_major_threshold=0.3)  # the shipped policy is top-k
    with pytest.raises(ValueError, match="^--cocodiff-v-major-fraction is not read by policy threshold"):
        settings(v_major="on", v_major_policy="threshold", v_major_fraction=0.3)
    with pytest.raises(ValueError, match="^--cocodiff-v-major-metric is not read by policy budget"):
        settings(v_major="auto", v_major_metric="l1")
    with pytest.raises(ValueError, match="^--cocodiff-v-major-if-slower acts only with --cocodiff-v-major auto"):
        settings(v_major="on", v_major_if_slower="keep")
    config = tmp_path / "v-major.yaml"  # a user's file is held to the same rule
    config.write_text("policy: top-k\nthreshold: 0.2\n")
    with pytest.raises(ValueError, match="^--cocodiff-v-major-threshold is not read by policy top-k"):
        settings(v_major="on", v_major_config=str(config))
    # what each policy reads is accepted
    assert settings(v_major="on", v_major_policy="threshold", v_major_threshold=0.3, v_major_metric="l1").rule.threshold == 0.3
    assert settings(v_major="on", v_major_policy="top-k", v_major_fraction=0.3, v_major_warmup_steps=1).rule.fraction == 0.3
    assert settings(v_major="auto", v_major_if_slower="keep").if_slower == "keep"


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_an_uneven_layout_is_refused_in_one_line(tmp_path):
    """Ulysses 2 x ring 3 on two nodes of three: the Ulysses group of ranks 2 and 3 spans nodes, the
    others do not. Found by the ranks (from xfuser's groups): one line from rank 0, no rank's traceback."""
    xdit = os.path.join(os.path.dirname(sys.executable), "xdit")
    result = subprocess.run(
        [xdit, "--model", "cocodiff/tiny-flux", "--ulysses_degree", "2", "--ring_degree", "3", "--sp-backend", "cocodiff",
         "--cocodiff-topology", "2x3", "--prompt", "a cat", "--master_port", "29531"],
        capture_output=True, text=True, timeout=280, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count("cocodiff: uneven layout on topology 2x3") == 1, output[-3000:]
    assert "Ulysses groups [2, 3] span nodes, [0, 1], [4, 5] do not" in output
    assert "]: Traceback" not in output, output[-3000:]  # torchrun's own report aside
