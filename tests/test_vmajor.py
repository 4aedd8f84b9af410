"""V-Major's settings, step clock and token selection in one process; caches across pipeline calls
and the budget on 4 ranks (the exchanges themselves: tests/comm)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Callable

import numpy as np
import pytest
import torch

from cocodiff_xfuser.vmajor import clock as vmajor_clock
from cocodiff_xfuser.vmajor import policy, state
from cocodiff_xfuser.comm import timing
from cocodiff_xfuser.comm.transport import DEVICE_SEMANTICS_ENV
from cocodiff_xfuser.settings import DEFAULT_MIN_PSNR_DB, POLICIES, SCOPES, VMajorSettings, error_for
from cocodiff_xfuser.tools import launcher
from cocodiff_xfuser.tools.generate import output_dir
from cocodiff_xfuser.tools.models import digits
from cocodiff_xfuser.tools.models import tiny as tiny_models
from cocodiff_xfuser.tools.verify import Run


def test_every_row_goes_without_a_mask_where_that_is_no_more_bytes():
    from cocodiff_xfuser.comm import sparse

    # 2-byte rows after a 16-byte mask of 100 rows: 92 of them take 200 bytes, all 100 take 200.
    assert sparse.whole_is_smaller(92, 100, 2) and not sparse.whole_is_smaller(91, 100, 2)
    assert sparse.whole_is_smaller(100, 100, 2) and not sparse.whole_is_smaller(0, 100, 2)


def test_shipped_defaults_load_and_flags_override(tmp_path):
    settings = VMajorSettings.load()
    assert settings.policy in POLICIES and settings.scope in SCOPES
    assert VMajorSettings.load(policy="threshold", threshold=0.3, scope="v").rule.threshold == 0.3
    # A user's file may set some knobs; the rest come from the shipped defaults.
    partial = tmp_path / "mine.yaml"
    partial.write_text("policy: top-k\nfraction: 0.25\n")
    mine = VMajorSettings.load(partial)
    assert (mine.policy, mine.rule.fraction, mine.rule.metric) == ("top-k", 0.25, "rel-l2")
    assert "top 25% per step" in mine.describe()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"policy": "random"}, "--cocodiff-v-major-policy 'random'"),
        ({"policy": "top-k", "fraction": 1.5}, "--cocodiff-v-major-fraction"),
        ({"residual_dtype": "int2"}, "--cocodiff-v-major-residual-dtype"),
        ({"policy": "threshold", "threshold": -1.0}, "must be >= 0"),
        ({"first_step": "skip"}, "--cocodiff-v-major-first-step 'skip'"),
        ({"residual_dtype": "none", "first_step": "exact"}, "--cocodiff-v-major-first-step acts only with a residual dtype"),
    ],
)
def test_bad_settings_are_one_clear_error(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        VMajorSettings.load(strict=True, **overrides)


def test_unknown_or_unreadable_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("thresold: 0.1\n")
    with pytest.raises(ValueError, match="unknown V-Major setting"):
        VMajorSettings.load(bad)
    with pytest.raises(ValueError, match="cannot read it"):
        VMajorSettings.load(tmp_path / "missing.yaml")


def test_clock_counts_steps_and_branches_within_each_pipeline_call():
    clock = vmajor_clock.Clock()
    clock.tick(1.0)  # outside a pipeline call: nothing counts
    assert clock.current is None
    seen = []
    # A 3-step call with a second branch at step 1, then a call that starts below the last one's
    # last timestep (img2img at low strength, a resumed schedule): its own step 0, not step 3.
    for call in ((1.0, 0.5, 0.5, 0.2), (0.15, 0.1)):
        clock.open()
        for t in call:
            clock.tick(torch.tensor([t, t]))
            seen.append((clock.calls, clock.current.step, clock.current.branch))
        clock.close()
    assert seen == [(1, 0, 0), (1, 1, 0), (1, 1, 1), (1, 2, 0), (2, 0, 0), (2, 1, 0)]
    assert clock.current is None


def test_the_clock_tells_steps_by_the_schedulers_index_without_reading_the_timestep():
    # A GPU's timestep is a device tensor: read per transformer call, it would hold the host until the
    # device caught up. The scheduler's step index (a host integer, None until its first step) tells
    # the steps apart instead; a timestep with no value to read (meta) shows that none is read.
    scheduler = SimpleNamespace(step_index=None)
    clock = vmajor_clock.Clock()
    clock.open(scheduler)
    seen = []
    for index in (None, None, 1, 2, 2, 3):  # a second branch at steps 0 and 2
        scheduler.step_index = index
        clock.tick(torch.empty(2, device="meta"))
        seen.append((clock.current.step, clock.current.branch))
    clock.close()
    assert seen == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (3, 0)]


def test_the_clock_names_each_steps_phase_for_static_shapes():
    # All a compiled graph of V-Major's static path reads of the step: a handful of values.
    clock = vmajor_clock.Clock(settings=VMajorSettings.load(policy="top-k", warmup_steps=2, refresh_every=4))
    clock.tick(1.0)
    phases = [clock.phase]
    clock.open()
    for t in range(7):
        clock.tick(1.0 - t / 8)
        phases.append(clock.phase)
    clock.close()
    clock.tick(0.5)
    assert phases + [clock.phase] == ["outside", "first", "whole", "sparse", "sparse", "exact", "sparse", "sparse", "outside"]


def test_a_layer_outside_a_pipeline_call_exchanges_exactly(caplog):
    from cocodiff_xfuser import commstats

    layer = _layer()
    layer.clock.close()
    before = commstats.ran()["fallbacks"].get("v-major: outside a pipeline call", 0)
    v = torch.randn(2, 1, 1, 2, 8, 4)
    with caplog.at_level("WARNING", logger="cocodiff_xfuser"):
        steps = [layer.begin(v) for _ in range(2)]
    assert all(step.caches is None and step.active is None for step in steps)
    assert commstats.ran()["fallbacks"]["v-major: outside a pipeline call"] == before + 2
    assert sum("outside one" in r.message for r in caplog.records) == 1


def test_a_call_frees_its_caches_when_it_ends():
    layer = _layer()
    v = torch.randn(2, 1, 1, 2, 8, 4)
    assert layer.begin(v).caches is not None and layer.clock.current.caches
    call = layer.clock.current
    layer.clock.close()
    assert layer.clock.current is None and call.settle() is None
    layer.clock.open()
    assert not layer.clock.current.caches and not layer.clock.current.budget.held  # the next call starts empty


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_auto_trial_rotates_its_arms_round_by_round():
    trial = vmajor_clock.Trial(first=2)
    # Rounds (v-major, v-first, stock), (v-first, stock, v-major), (stock, v-major, v-first) from step 2.
    assert [trial.arm(s) for s in range(12)] == [
        None, None, "v-major", "v-first", "stock", "v-first", "stock", "v-major", "stock", "v-major", "v-first", None,
    ]
    assert vmajor_clock.TRIAL_ROUNDS == 3
    two = vmajor_clock.Trial(first=1, arms=("v-major", "v-first"))  # heads padded: no stock arm
    assert [two.arm(s) for s in range(8)] == [None, "v-major", "v-first", "v-first", "v-major", "v-major", "v-first", None]


# Each arm's seconds per step in each of the three rounds; the arm the job runs after the trial.
@pytest.mark.parametrize("seconds, runs", [
    ({"v-major": [1.0, 1.0, 1.0], "v-first": [2.0] * 3, "stock": [2.0] * 3}, "v-major"),
    ({"v-major": [2.0, 2.0, 2.0], "v-first": [1.5] * 3, "stock": [1.5] * 3}, "v-first"),
    # Faster in two rounds of three, slower in one: a median below 1 without evidence; off.
    ({"v-major": [1.0, 1.0, 2.0], "v-first": [1.5] * 3, "stock": [1.6] * 3}, "v-first"),
    # Faster than V-First in every round but not than the stock processors: off, and V-First too.
    ({"v-major": [1.0, 1.0, 1.0], "v-first": [1.2] * 3, "stock": [0.9] * 3}, "stock"),
    # V-First slower than stock in two rounds of three: the median picks stock (both exact).
    ({"v-major": [2.0] * 3, "v-first": [1.1, 1.1, 0.9], "stock": [1.0] * 3}, "stock"),
    # A tie keeps V-First.
    ({"v-major": [2.0] * 3, "v-first": [1.0] * 3, "stock": [1.0] * 3}, "v-first"),
])
def test_auto_trial_times_whole_steps_and_keeps_the_fastest_arm(one_rank_group, monkeypatch, seconds, runs):
    from cocodiff_xfuser import commstats

    commstats.reset_ran()
    clock = vmajor_clock.Clock(trial_from=2)
    clock.open()
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])  # what every timing reads
    arms = []
    for step in range(13):
        clock.tick(torch.tensor([1.0 - step / 20]))
        arm = None if clock.trial is None else clock.trial.arm(step)
        arms.append(arm)
        assert clock.exact_step() == (arm in ("v-first", "stock"))
        assert clock.stock_step() == (arm == "stock" or clock.stock)
        now[0] += seconds[arm][arms.count(arm) - 1] if arm else 1.0
    assert clock.trial is None and (clock.off, clock.stock) == (runs != "v-major", runs == "stock")  # decided at step 11
    fallbacks = commstats.ran()["fallbacks"]
    assert fallbacks.get("v-major: steps not faster than exact steps", 0) == (runs != "v-major")
    assert fallbacks.get("v-first: steps not faster than stock processors' steps", 0) == (runs == "stock")
    # A new pipeline call keeps the decision; a trial cut short by a new call starts over.
    short = vmajor_clock.Clock(trial_from=1)
    short.open()
    for t in (1.0, 0.9, 0.8):
        short.tick(t)
    short.open()
    short.tick(1.0)
    assert short.trial is not None and short.trial.times == [] and not short.off and not short.stock


def _layer(**overrides) -> policy.Layer:
    clock = vmajor_clock.Clock()
    clock.open()
    clock.tick(1.0)
    return policy.Layer(clock, VMajorSettings.load(warmup_steps=1, **overrides), (1,))


def _count(layer: policy.Layer, step: int, s: int) -> int | None:
    return policy.count(layer.settings, layer.clock, layer.index, step, s)


def _select(layer: policy.Layer, v: torch.Tensor, reference: torch.Tensor, k: int) -> list[int]:
    change = policy.token_change(layer.settings.rule.metric, v, reference, 4, (0, 1, 3, 5))
    return sorted(torch.sort(change, stable=True).indices[change.numel() - k:].tolist())


def test_selection_policies():
    # [W, n, b, h/W, s, d] with token i changed by i/10 relative to the reference.
    reference = torch.ones(2, 1, 1, 2, 10, 4)
    v = reference * (1 + torch.arange(10.0) / 10)[:, None]
    threshold = _layer(policy="threshold", threshold=0.45)
    assert _count(threshold, 1, 10) is None  # measured at an earlier step: nothing agreed yet
    change, share, _ = policy.measure(threshold.settings.rule, v, reference, 4, (0, 1, 3, 5))
    assert float(share) == pytest.approx(0.5) and _select(threshold, v, reference, 5) == [5, 6, 7, 8, 9]
    top = _layer(policy="top-k", fraction=0.3)
    assert _select(top, v, reference, _count(top, 1, 10)) == [7, 8, 9]
    l1 = _layer(policy="threshold", metric="l1", threshold=0.25)
    assert float(policy.measure(l1.settings.rule, v, reference, 4, (0, 1, 3, 5))[1]) == pytest.approx(0.7)
    # The ring's K/V ([K|V, tokens, row]) rank their tokens by the same metrics.
    ring = reference[0, 0, 0].expand(2, 10, 4)  # [2, 10, 4]
    changed = ring * (1 + torch.arange(10.0) / 10)[:, None]
    change = policy.token_change("rel-l2", changed, ring, 1, (0, 2))
    assert torch.sort(change, stable=True).indices[7:].tolist() == [7, 8, 9]


def test_the_selection_is_the_same_whatever_order_changes_are_summed_in():
    """Integer sums: a token's change does not depend on the order its elements are added in (the
    order differs between CPU and GPU reductions), and ties go to the lower token index."""
    g = torch.Generator().manual_seed(3)
    reference = torch.randn(2, 1, 1, 3, 16, 8, generator=g)
    v = reference + 0.1 * torch.randn(reference.shape, generator=g)
    reference[..., 9, :], v[..., 9, :] = reference[..., 5, :], v[..., 5, :]  # a tie
    flipped = policy.token_change("rel-l2", v.flip(0, 3, 5), reference.flip(0, 3, 5), 4, (0, 1, 3, 5))
    assert torch.equal(policy.token_change("rel-l2", v, reference, 4, (0, 1, 3, 5)), flipped)
    budget = VMajorSettings.load(policy="budget", error=0.05).rule
    squared, share, _ = policy.measure(budget, v, reference, 4, (0, 1, 3, 5))
    assert squared.dtype == torch.int64 and squared[5] == squared[9]
    assert torch.equal(squared, policy.measure(budget, v.flip(0, 3, 5), reference.flip(0, 3, 5), 4, (0, 1, 3, 5))[0])
    ranked = torch.sort(squared, stable=True).indices.tolist()
    assert ranked.index(5) == ranked.index(9) - 1  # equal changes: the lower index ranks first (left out first)


def test_budget_share_is_the_fewest_tokens_meeting_the_error():
    # Token i of 10 changed by i in one of 1000 elements (squared change i^2); V's squared norm 1000.
    budget = lambda e: VMajorSettings.load(policy="budget", error=e).rule  # noqa: E731
    v = torch.ones(10, 100) * (1000 / 990) ** 0.5
    v[:, 0] = 0.0
    reference = v.clone()
    reference[:, 0] = -torch.arange(10.0)
    change = torch.arange(10.0) ** 2
    norm2 = float(v.square().sum())
    for error in (0.05, 0.1, 0.2, 0.5):
        squared, share, _ = policy.measure(budget(error), v, reference, 0, (1,))
        assert torch.sort(squared, stable=True).indices.tolist() == list(range(10))  # smallest change first
        k = round(float(share) * 10)
        left = sorted(change.tolist(), reverse=True)[k:]
        assert sum(left) <= error**2 * norm2  # sending the k largest meets the budget ...
        assert k == 0 or sum(left) + sorted(change.tolist(), reverse=True)[k - 1] > error**2 * norm2  # ... k-1 would not
    assert float(policy.measure(budget(0.1), v, v, 0, (1,))[1]) == 0.0


def test_joined_caches_are_views_of_one_tensor_until_an_entry_is_replaced():
    """V riding with Q/K: their references and results kept as views of one tensor, so a layer
    that rides at every step joins them without copying; an exact step's new entry joins anew."""
    caches = state.Caches((4, 1, 1, 2, 8, 4))
    caches.reference["qk"], caches.reference["v"] = torch.randn(4, 2, 1, 2, 8, 4), torch.randn(4, 1, 1, 2, 8, 4)
    qk, v = caches.reference["qk"].clone(), caches.reference["v"].clone()
    joined = caches.joined("reference", ("qk", "v"))
    assert torch.equal(joined, torch.cat([qk, v], dim=1))
    joined.add_(1.0)  # what a sparse step's residuals do: the entries see it
    assert torch.equal(caches.reference["qk"], qk + 1) and torch.equal(caches.reference["v"], v + 1)
    assert caches.joined("reference", ("qk", "v")) is joined  # no copy
    caches.reference["v"] = v  # an exact step's V
    again = caches.joined("reference", ("qk", "v"))
    assert again is not joined and torch.equal(again, torch.cat([qk + 1, v], dim=1))


def test_auto_maps_the_psnr_target_through_the_calibration(tmp_path):
    cal = tmp_path / "cal.yaml"
    cal.write_text("models:\n  a: {points: [{error: 0.1, psnr_db: 40.0}, {error: 0.2, psnr_db: 30.0}, {error: 0.4, psnr_db: 31.0}]}\n"
                   "  b: {points: [{error: 0.05, psnr_db: 45.0}, {error: 0.1, psnr_db: 41.0}, {error: 0.2, psnr_db: 37.0}]}\n")
    # a: 35 dB halfway (in log error) between 0.1 and 0.2; b meets it at every calibrated error: a decides.
    assert error_for(35.0, cal) == pytest.approx(0.1 * 2**0.5)
    # 42 dB: above a's measurements (its smallest error, logged); b: 3/4 of the way from 0.05 to 0.1.
    assert error_for(42.0, cal) == pytest.approx(0.05 * 2**0.75)
    assert error_for(20.0, cal) == pytest.approx(0.2)  # b's largest calibrated error bounds it
    # a alone: 30.5 dB is met at 0.4 only if its curve may rise again; it may not.
    (tmp_path / "a.yaml").write_text("models:\n  a: {points: [{error: 0.1, psnr_db: 40.0}, {error: 0.2, psnr_db: 30.0}, {error: 0.4, psnr_db: 31.0}]}\n")
    assert error_for(30.5, tmp_path / "a.yaml") == pytest.approx(0.1 * 2**0.95)
    assert 0 < error_for(DEFAULT_MIN_PSNR_DB) < 1  # the shipped calibration
    # Where a point gives its lower confidence bound, that is what must meet the target.
    (tmp_path / "low.yaml").write_text("models:\n  a: {points: [{error: 0.1, psnr_db: 40.0, psnr_low_db: 38.0}, "
                                       "{error: 0.2, psnr_db: 32.0, psnr_low_db: 30.0}]}\n")
    assert error_for(34.0, tmp_path / "low.yaml") == pytest.approx(0.1 * 2**0.5)
    (tmp_path / "none.yaml").write_text("models: {}\n")
    with pytest.raises(ValueError, match="no calibrated model"):
        error_for(38.0, tmp_path / "none.yaml")


def _three_calls(tmp_path, variants: dict, steps: int, env: dict | None = None) -> Callable[[str], tuple[np.ndarray, dict]]:
    """One torchrun job on digits-flux (2x2): V-Major on, and each variant, generating digit 7,
    digit 3, digit 7 (every variant builds its own pipeline, so its first call starts fresh); the
    images and the result of a backend."""
    tiny_models.ensure_fixture(digits.NAME)
    (tmp_path / "cases.json").write_text(json.dumps([["digit 7", 1], ["digit 3", 0], ["digit 7", 1]]))
    (tmp_path / "variants.json").write_text(json.dumps(variants))
    # Two warm-up steps: short jobs reach sparse steps.
    run = Run(model=digits.NAME, ulysses_degree=4, topology="2x2", steps=steps,
              extra=("--cocodiff_v_major", "on", "--cocodiff_v_major_warmup_steps", "2"))
    argv = run.argv(("cocodiff", *variants), tmp_path) + ["--cases", str(tmp_path / "cases.json"), "--variants", str(tmp_path / "variants.json")]
    launcher.torchrun(4, argv, env=env, timeout=600)

    def generated(backend: str) -> tuple[np.ndarray, dict]:
        where = output_dir(tmp_path, tiny_models.SPECS[digits.NAME].model_id, backend)
        return np.load(where / "images.npy"), json.loads((where / "result.json").read_text())

    return generated


@pytest.mark.slow  # make test serves requests after others bitwise (tools/test_cli.py) and counts the budget's fall-back (comm/test_exchanges.py)
@pytest.mark.distributed
def test_no_cache_leaks_across_pipeline_calls_and_budget_falls_back(tmp_path):
    """An image generated after others in the same job is bitwise the image of the first call (the
    caches start over at every pipeline call); a budget no layer fits gives the exact exchange."""
    static = {"sp_backend": "cocodiff", "cocodiff_v_major_policy": "top-k"}  # caches kept from call to call
    generated = _three_calls(tmp_path, {"budget": {"sp_backend": "cocodiff", "cocodiff_v_major_policy": "budget",
                                                   "cocodiff_v_major_budget_mib": 0.01},
                                        "static": static, "static-budget": {**static, "cocodiff_v_major_budget_mib": 0.01}}, steps=4)
    for backend in ("static", "static-budget"):
        images, result = generated(backend)
        assert np.array_equal(images[2], images[0])
        ran = result["ran"]
        if backend == "static":  # zeroed by each call's first step: nothing of the call before remains
            assert set(ran["exchanges"]) == {"v-major one-phase"} and ran["v_major_sparse"] and not ran["fallbacks"], ran
        else:
            assert ran["fallbacks"].get("v-major: cache budget", 0) > 0 and "v-major one-phase" not in ran["exchanges"], ran
    images, result = generated("cocodiff")
    assert np.array_equal(images[2], images[0])
    assert any(name.startswith("v-major") for name in result["ran"]["exchanges"]), result["ran"]
    # Steps 1 to 3 sent residuals against what the receivers on the other node held.
    assert sum(result["ran"]["v_major_sparse"].values()) > 0, result["ran"]
    exact, over = generated("budget")
    assert over["ran"]["fallbacks"].get("v-major: cache budget", 0) > 0, over["ran"]
    assert not any(name.startswith("v-major") for name in over["ran"]["exchanges"]), over["ran"]
    assert over["ran"]["slow_link_bytes"] == over["ran"]["slow_link_bytes_exact"]
    assert not np.array_equal(exact[0], images[0])  # V-Major is lossy; the budget fall-back is exact


#: Six image sizes of tiny-flux (tokens even for Ulysses 2), ten rounds of them.
SIZES = ((32, 32), (32, 64), (64, 32), (64, 64), (48, 64), (64, 48))


@pytest.mark.slow  # make test stays under 20 minutes
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_service_of_many_sizes_holds_its_memory(tmp_path):
    """One job serving 60 requests of 6 sizes with V-Major on (per call and with static shapes)
    ends each round of the 6 sizes within 5% of the resident memory it had after the first round:
    what cocodiff keeps per size (V-Major's static caches) is bounded."""
    tiny_models.ensure_fixture("tiny-flux")
    requests = [{"prompt": "a cat", "seed": 1, "height": h, "width": w, "steps": 3} for _ in range(10) for h, w in SIZES]
    (tmp_path / "cases.json").write_text(json.dumps(requests))
    (tmp_path / "variants.json").write_text(json.dumps({"static": {"sp_backend": "cocodiff", "cocodiff_v_major_policy": "top-k"}}))
    # The job's own backend per call (budget), the variant with static shapes; step 3 sparse.
    run = Run(model="tiny-flux", ulysses_degree=2, topology="2x1", steps=3,
              extra=("--cocodiff_v_major", "on", "--cocodiff_v_major_policy", "budget", "--cocodiff_v_major_warmup_steps", "2"))
    argv = run.argv(("cocodiff", "static"), tmp_path) + ["--cases", str(tmp_path / "cases.json"), "--variants", str(tmp_path / "variants.json")]
    launcher.torchrun(2, argv, timeout=540)
    for backend in ("cocodiff", "static"):
        result = json.loads((output_dir(tmp_path, tiny_models.SPECS["tiny-flux"].model_id, backend) / "result.json").read_text())
        assert result["ran"]["v_major_sparse"], result["ran"]
        for resident in result["resident_bytes"]:  # per rank, after each request
            rounds = [resident[i + len(SIZES) - 1] for i in range(0, len(resident), len(SIZES))]
            assert max(rounds) <= 1.05 * rounds[0], (backend, [r / 2**20 for r in rounds])


@pytest.mark.slow  # auto's trial needs 12 steps per call
@pytest.mark.distributed
def test_auto_decides_in_the_first_call_and_keeps_its_decision(tmp_path):
    """Auto's speed check (timed steps in the first call, three arms) keeps V-Major on or turns it
    off for the job (and V-First with it where xfuser's processors were faster), counted either way;
    turned off, the later images are V-First's, bitwise."""
    variants = {
        "auto": {"sp_backend": "cocodiff", "cocodiff_v_major": "auto", "cocodiff_v_major_if_slower": "stop"},
        "vfirst": {"sp_backend": "cocodiff", "cocodiff_v_first": True, "cocodiff_v_major": "off"},
    }
    # 12 steps: auto's trial (steps 2 to 10) decides at step 11 of the first call. Under a device
    # backend's rules, with the order audit.
    generated = _three_calls(tmp_path, variants, steps=12, env={DEVICE_SEMANTICS_ENV: "1"})
    launches = generated("auto")[1]["launches"]
    assert len(launches) == 4 and all(sequence == launches[0] for sequence in launches[1:]), "ranks launched apart"
    # Auto, first call: its trial ran steps 3, 5, 10 as V-First alone (exact, no selection) and 4, 6, 8
    # on xfuser's processors over cocodiff's exchange.
    first, later = generated("auto")[1]["ran"], generated("vfirst")[0]
    layers, ranks = 6, 4
    trial_exact = 3 * layers * ranks * (3 + 2)  # steps x layers x ranks x exchanges (v, qk, out; stock: qkv, out)
    off = first["fallbacks"].get("v-major: steps not faster than exact steps", 0)
    stock = first["fallbacks"].get("v-first: steps not faster than stock processors' steps", 0)
    stock_calls = first["fallbacks"]["v-first: stock processors' step (auto)"]
    assert stock in (0, ranks), first
    assert sum(first["exchanges"].get(a, 0) for a in ("flat", "flat-p2p", "flat-pxn")) >= trial_exact, first
    if off:  # after the trial, every exchange exact: the later images are V-First's, bitwise
        # Sparse at steps 0 (the residuals against zeros), 1, 2, 7 and 9 (the trial's V-Major steps).
        assert off == ranks and first["v_major_sparse"]["qk+v"] == 5 * layers * ranks, first
        assert np.array_equal(generated("auto")[0][1:], later[1:])
        # Stock from step 11 on (the rest of the first call, every later call), or the trial's steps only.
        assert stock_calls == (3 + 1 + 2 * 12) * layers * ranks if stock else 3 * layers * ranks, first
    else:
        assert first["v_major_sparse"]["qk+v"] > 5 * layers * ranks, first  # sparse in the later calls too
        assert not stock and stock_calls == 3 * layers * ranks, first


def test_ring_peers_hold_what_the_sender_references():
    """V-Major on the ring's K/V: after an exact step, a sparse step's message (the selected
    tokens' change as fp8, behind their mask) turns the receiver's copy into exactly the
    sender's reference, the error left for the next step (error feedback)."""
    from cocodiff_xfuser.comm import residuals, sparse, transport
    from cocodiff_xfuser.vmajor import ring

    torch.manual_seed(0)
    x0 = torch.randn(2, 6, 4)  # [K|V, tokens, row]
    sender, receiver = ring._Caches(), ring._Caches()
    ring.RingStep(sender, x0.clone(), (1,), None, None, None)  # exact: the sender's reference is (a copy of) x0
    out = torch.stack([torch.zeros(48), x0.flatten()])  # what the receiver (ring rank 0) gathered
    ring.RingStep(receiver, torch.zeros_like(x0), (1,), None, None, None).finish(out, {})
    assert torch.equal(sender.reference, x0) and torch.equal(receiver.held[1], x0)

    x1 = x0 + 0.1 * torch.randn_like(x0)
    active = torch.tensor([1, 4])
    fp8 = torch.float8_e4m3fn
    sent = residuals.encode(x1, sender.reference, active, 1, fp8)
    step = ring.RingStep(sender, x1, (0,), sparse.Selection.fixed(active, 2), sent, fp8)
    assert step.slow_bytes == 4 + 2 * 2 * 4  # a mask of 6 bits in 4 bytes, then 2 tokens' K and V rows in fp8
    message = [transport.comm_view(p).view(-1).view(torch.uint8).clone() for p in step.remote.pieces]
    assert [len(m) for m in message] == list(step.remote.sizes[0])
    got = ring.RingStep(receiver, torch.zeros_like(x0), (1,), sparse.Selection.fixed(active, 2), None, fp8).finish(
        torch.stack([torch.zeros(48), torch.zeros(48)]), {1: message})
    assert torch.equal(receiver.held[1], sender.reference) and torch.equal(got[1].view(2, 6, 4), sender.reference)
    untouched = [0, 2, 3, 5]
    assert torch.equal(receiver.held[1][:, untouched], x0[:, untouched])
    assert (sender.reference - x1)[:, [1, 4]].norm() < 0.1 * (x1 - x0)[:, [1, 4]].norm()  # fp8's rounding is left


@pytest.mark.parametrize("residual", [torch.int4, torch.float8_e4m3fn, None])
@pytest.mark.parametrize("k", [0, 6])
def test_ring_steps_of_no_token_or_every_token_travel_without_a_mask(residual, k):
    """A sparse ring step that selects none of its 6 tokens (threshold or budget, where nothing
    changed enough) or all of them sends no mask; the receiver's copy stays as it was, or takes
    every token, either way exactly the sender's reference."""
    from cocodiff_xfuser.comm import residuals, sparse, transport
    from cocodiff_xfuser.vmajor import ring

    torch.manual_seed(0)
    x0 = torch.randn(2, 6, 4)  # [K|V, tokens, row]
    sender, receiver = ring._Caches(), ring._Caches()
    ring.RingStep(sender, x0.clone(), (1,), None, None, None)
    ring.RingStep(receiver, torch.zeros_like(x0), (1,), None, None, None).finish(torch.stack([torch.zeros(48), x0.flatten()]), {})

    x1 = x0 + 0.1 * torch.randn_like(x0)
    selection = sparse.Selection.fixed(torch.arange(k), 2)
    sent = residuals.encode(x1, sender.reference, selection.active, 1, residual)
    step = ring.RingStep(sender, x1, (0,), selection, sent, residual)
    message = [transport.comm_view(p).view(-1).view(torch.uint8).clone() for p in step.remote.pieces]
    assert [len(m) for m in message] == list(step.remote.sizes[0]) and len(message) == 1  # the rows alone
    got = ring.RingStep(receiver, torch.zeros_like(x0), (1,), selection, None, residual).finish(torch.zeros(2, 48), {1: message})
    assert torch.equal(receiver.held[1], sender.reference) and torch.equal(got[1].view(2, 6, 4), sender.reference)
    assert torch.equal(sender.reference, x0) == (k == 0)


@pytest.mark.distributed
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("policies, residual, steps", [
    # The two whose counts the data decides, agreed over the world (the ring's peers sit in other
    # Ulysses groups): a step may select no token. At 8 steps threshold's ring selected none, and
    # its receivers took the empty message for every token.
    # In the slow tier beside every policy: make test stays under 20 minutes.
    pytest.param(("threshold", "budget"), "int4", (8,), marks=pytest.mark.slow),
    pytest.param(POLICIES, "int4", (4, 8, 16), marks=pytest.mark.slow),
    pytest.param(POLICIES, "float8_e4m3fn", (4, 8, 16), marks=pytest.mark.slow),
], ids=["threshold+budget-int4-8", "every-policy-int4", "every-policy-fp8"])
def test_every_policy_runs_where_ulysses_and_ring_cross_nodes(tmp_path, policies, residual, steps):
    """U4 x R2 over 4x2 (four nodes of two: on 2x4 the Ulysses groups stay in a node): the Ulysses
    groups and the ring both cross nodes, so V-Major runs on both, under every policy given, at each
    number of steps (a variant each, one job), under a device backend's rules, every rank launching
    the same collectives."""
    cells = {f"{p}-{residual}-{n}": (p, n) for p in policies for n in steps}
    variants = {name: {"sp_backend": "cocodiff", "cocodiff_v_major": "on", "cocodiff_v_major_policy": p,
                       "cocodiff_v_major_residual_dtype": residual, "cocodiff_v_major_warmup_steps": 2, "num_inference_steps": n}
                for name, (p, n) in cells.items()}
    (tmp_path / "variants.json").write_text(json.dumps(variants))
    run = Run(model="tiny-flux", ulysses_degree=4, ring_degree=2, topology="4x2", height=64, width=64)
    argv = run.argv(tuple(cells), tmp_path) + ["--variants", str(tmp_path / "variants.json")]
    launcher.torchrun(8, argv, env={DEVICE_SEMANTICS_ENV: "1"}, timeout=1440)
    for name, (policy_name, n) in cells.items():
        where = output_dir(tmp_path, tiny_models.SPECS["tiny-flux"].model_id, name)
        result = json.loads((where / "result.json").read_text())
        ran = result["ran"]
        if policy_name == "top-k":  # the static paths (Ulysses and ring) count by the step's phase
            assert set(ran["v_major"]["per_step"]) == {"first", "whole", "sparse"}, (name, ran["v_major"])
        else:
            assert len(ran["v_major"]["per_step"]) == n, (name, ran["v_major"])
        assert np.isfinite(np.load(where / "images.npy")).all(), name
        # Each Ulysses group runs its own autotune decisions; the communicators they share (the ring's,
        # the world's) see one order on every rank.
        launches = result["launches"]
        for group in (launches[:4], launches[4:]):
            assert all(sequence == group[0] for sequence in group[1:]), f"{name}: ranks of a Ulysses group launched apart"
        shared = [[op for op in sequence if op[0] in ("ring", "group of 8")] for sequence in launches]
        assert shared[0] and all(sequence == shared[0] for sequence in shared[1:]), f"{name}: ranks launched apart on the ring"
        assert not ran["fallbacks"], (name, ran)
        assert ran["exchanges"].get("ring v-major", 0) > 0, (name, ran)
        assert sum(k for a, k in ran["exchanges"].items() if a.startswith("v-major")) > 0 and ran["v_major_sparse"], (name, ran)
        assert ran["slow_link_bytes"] < ran["slow_link_bytes_exact"], (name, ran)


@pytest.mark.distributed
@pytest.mark.slow  # two jobs, the kernels interpreted in every layer; make test checks them byte for byte (tests/comm)
@pytest.mark.timeout(600)
def test_the_triton_kernels_in_a_job_give_the_torch_references_images(tmp_path):
    """V-Major with int4 residuals on the Ulysses exchanges and the ring's K/V: a job whose layers
    run the Triton kernels (interpreted on the CPU: the change sums, the ranking, the choice of
    tokens, the encode, the apply) makes the images of a job that runs the torch reference, bit for
    bit, and the kernels ran."""
    # Over 4x1 both the Ulysses groups and the ring cross nodes; step 2 is sparse (the first two warm up).
    run = Run(model="tiny-flux", ulysses_degree=2, ring_degree=2, topology="4x1", steps=3, height=64, width=64,
              extra=("--cocodiff_v_major", "on", "--cocodiff_v_major_residual_dtype", "int4", "--cocodiff_v_major_warmup_steps", "2"))
    images, ran = {}, {}
    for interpreted in ("0", "1"):
        out = tmp_path / interpreted
        launcher.torchrun(4, run.argv(("cocodiff",), out), env={"TRITON_INTERPRET": interpreted}, timeout=540)
        where = output_dir(out, tiny_models.SPECS["tiny-flux"].model_id, "cocodiff")
        images[interpreted] = np.load(where / "images.npy")
        ran[interpreted] = json.loads((where / "result.json").read_text())["ran"]
    assert np.array_equal(images["0"], images["1"])
    assert not ran["0"]["kernels"] and not ran["1"]["fallbacks"], ran
    kernels = {"change sums", "change sums' one scale", "rank", "top", "int4 encode", "int4 apply"}
    assert kernels <= set(ran["1"]["kernels"]), ran["1"]["kernels"]
    assert ran["1"]["exchanges"].get("ring v-major", 0) > 0 and ran["1"]["v_major_sparse"], ran["1"]


def test_a_gpu_graph_holds_the_kernels_launches():
    """A layer's selection, int4 exchange and mask decode, traced as inductor traces a graph for a
    GPU (fake CUDA tensors, functionalized as AOT does): each of V-Major's kernels is a launch in
    the graph, and no ``cocodiff_kernels`` operator or reference code (a sort, an index copy) is left."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    from cocodiff_xfuser.comm import residual_kernels, residuals, sparse

    if residual_kernels.triton is None:
        pytest.skip("no triton")

    def layer(v, reference, held):  # V's chunks for another node: [W', 1, b, h/W, s, d]
        keys = policy.token_change("rel-l2", v, reference, 4, (0, 1, 3, 5))
        active, mask = policy.top(policy.rank(keys)[0], 5)
        payload = residuals.encode(v, reference, active, 4, torch.int4)
        residuals.apply(held, payload, sparse.rows_of(mask, 20, 5), 4, True)
        return payload

    with FakeTensorMode(allow_non_fake_inputs=True):
        v = torch.empty(2, 1, 1, 3, 20, 64, device="cuda")
        graph = make_fx(dispatch_functionalize(layer), tracing_mode="fake")(v, torch.empty_like(v), torch.empty_like(v))
    called = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    # change sums and their one scale, ranks, top, int4 encode, mask decode, int4 apply
    assert called.count("triton_kernel_wrapper_functional") == 7
    assert not [c for c in called if "cocodiff_kernels" in c or "sort" in c or "index" in c]
