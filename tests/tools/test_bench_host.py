"""``cocodiff bench host``: the entry points' timer, and the report from real jobs (slow tier)."""

from __future__ import annotations

import json
import time

import pytest
import torch
import tqdm

from cocodiff_xfuser.settings import Budget
from cocodiff_xfuser.tools import cli
from cocodiff_xfuser.tools.bench import host


@pytest.mark.unit
def test_the_timer_counts_outermost_calls_only():
    timer = host._Timer()
    inner = timer.wrap(lambda: time.sleep(0.01), "exchange_s")
    outer = timer.wrap(lambda: (time.sleep(0.01), inner()), "decision_s")
    outer()
    inner()
    assert 0.02 <= timer.seconds["decision_s"] < 0.05  # the nested call is inside the outer one's time
    assert 0.01 <= timer.seconds["exchange_s"] < 0.03  # only the call made from outside


@pytest.mark.unit
def test_the_time_standing_for_the_collectives_is_not_counted():
    timer = host._Timer()

    def exchange():
        time.sleep(0.01)  # the entry point's own work
        started = time.perf_counter()
        time.sleep(0.03)  # the batch posted as nothing, echoing bytes
        timer.exclude(time.perf_counter() - started)

    timer.wrap(exchange, "exchange_s")()
    assert 0.01 <= timer.seconds["exchange_s"] < 0.025


@pytest.mark.unit
def test_the_kernels_stand_ins_compute_what_the_torch_reference_does(monkeypatch):
    # The host job runs V-Major's GPU path with each Triton launch stood in for: its decisions
    # (which tokens, what travels) must be those the reference makes, and the launches' time is not counted.
    pytest.importorskip("triton")
    from cocodiff_xfuser.comm import mask_kernels, residual_kernels, residuals, sparse
    from cocodiff_xfuser.vmajor import change_kernels, policy, rank_kernels

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, 64, generator=gen)
    reference = x + 0.01 * torch.randn(x.shape, generator=gen)
    held = torch.randn(x.shape, generator=gen)
    rows = torch.tensor([1, 5, 7, 30])

    def run() -> list[torch.Tensor]:
        ref, into, whole = reference.clone(), held.clone(), held[:, :, :4].contiguous()
        payload = residuals.encode(x, ref, rows, 2, torch.int4)
        residuals.apply(into, payload, rows, 2, True)
        residuals.apply(whole, payload, None, 2, True)
        sums = [t for dims, kinds in (((0, 3), ("squared change", "squared value")), ((1, 3), ("absolute change", "squared reference")))
                for pair in policy._sums(kinds, x, reference, dims) for t in pair]
        masks = torch.stack([sparse.Selection.fixed(rows, 1).mask(40), sparse.Selection.fixed(rows + 2, 1).mask(40)])
        _, share, ranks = policy.measure(Budget(error=0.005), x, reference, 2, (0, 1, 3))
        by_change, _ = policy.rank(sums[0].double().amax(0))  # float64 keys, as threshold ranks
        return [payload, ref, into, whole, *sums, sparse.rows_of(masks, 40, 4), sparse.rows_of(masks[1], 40, 4),
                share, ranks, by_change, *policy.top(ranks, 9)]

    expected = run()
    timer = host._Timer()
    for module, name in ((residual_kernels, "_DEVICES"), (residual_kernels, "_encode"), (residual_kernels, "_apply"),
                         (change_kernels, "_sums"), (change_kernels, "_common"), (mask_kernels, "_rows"),
                         (rank_kernels, "_rank"), (rank_kernels, "_top")):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    host._kernels_stood_in(timer)
    assert residual_kernels.usable(x, reference) and mask_kernels.usable(torch.zeros(2, 8, dtype=torch.uint8))
    stood_in = run()
    assert all(torch.equal(a, b) for a, b in zip(expected, stood_in))
    assert timer._excluded > 0


def _leaf() -> None:
    pass


def _branch() -> None:
    _leaf()
    _leaf()


@pytest.fixture(scope="module")
def operators():
    """Two operator namespaces of Python kernels: one as cocodiff's exchange operators (host code),
    one as its kernel operators (a CPU kernel standing for a launch)."""
    libraries = []
    for namespace in ("cocodiff_bench_ops", "cocodiff_bench_kernels"):
        library = torch.library.Library(namespace, "DEF")
        library.define("twice(Tensor x) -> Tensor")

        def twice(x):
            _leaf()
            return x * 2

        library.impl("twice", twice, "CPU")
        libraries.append(library)
    yield torch.ops.cocodiff_bench_ops.twice, torch.ops.cocodiff_bench_kernels.twice
    del libraries


@pytest.mark.unit
def test_python_calls_are_counted_to_the_call(operators, monkeypatch):
    from cocodiff_xfuser.comm import residuals

    monkeypatch.setattr(host, "KERNEL_OPS", "cocodiff_bench_kernels")
    monkeypatch.setattr(host, "COLLECTIVE_OPS", "cocodiff_bench_ops")  # as torch's functional collectives
    collective, kernel = operators
    x = torch.ones(2)
    stood_in = host._StandIn(lambda t: _branch(), host._Timer())
    kernel(x), kernel.default(x), collective.default(x)  # the operator objects made before counting
    bar = tqdm.tqdm(range(2), mininterval=0, disable=False)
    with host._PythonCalls() as python:
        _branch()  # 3 calls
        residuals.group_size(64)  # 1, cocodiff's own
        stood_in[(1,)](x)  # a launch: the device's work, none of its calls
        bar.update()  # a progress bar redraws by the clock: none
        kernel(x)  # 1 (the operator's Python wrapper) and, apart, its CPU kernel's 2
        kernel.default(x)  # the same through the overload
        collective.default(x)  # 1, and its Python kernel's 2, counted among all and apart
    assert python.counts == {"all": 9, "cocodiff": 1, "in_kernel_ops": 4, "in_collectives": 2}


@pytest.mark.unit
def test_operators_dispatched_from_host_code_are_counted(operators, monkeypatch):
    monkeypatch.setattr(host, "OPERATORS", "cocodiff_bench_ops")
    monkeypatch.setattr(host, "KERNEL_OPS", "cocodiff_bench_kernels")
    ops, kernel = operators
    x = torch.ones(2, 2)
    stood_in = host._StandIn(lambda t: (t + 1).sum(), host._Timer())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        y = torch.nn.functional.linear(x, x)  # 1: its transpose and mm are its C++ kernel's
        ops(y + 1)  # add, the operator and the mul its Python kernel dispatches
        kernel(y)  # the operator; its kernel's mul apart
        stood_in[(1,)](y)  # none
    assert host._dispatches(profile.events()) == {
        "torch_ops": {"aten": 3, "cocodiff_bench_ops": 1, "cocodiff_bench_kernels": 1}, "in_kernel_ops": 1, "inductor_kernels": 0}


@pytest.mark.unit
def test_an_unknown_mode_is_one_line(capsys):
    assert cli.main(["bench", "host", "--modes", "eager,graph"]) == 2
    assert capsys.readouterr().err.strip() == "cocodiff bench host: --modes: graph not among eager, compiled"


def _integers(counted: dict) -> bool:
    return all(_integers(v) if isinstance(v, dict) else isinstance(v, int) for v in counted.values())


@pytest.mark.slow
@pytest.mark.distributed
def test_the_report_gives_every_configuration_eager_and_compiled(capsys):
    # 4 steps: V-Major's exchanges go sparse after its 2 warm-up steps (the batches taken out, the
    # masks that arrive must still mark the rows that do).
    assert cli.main(["bench", "host", "--steps", "4", "--repeat", "1", "--rounds", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {row["name"]: row for row in report["configs"]}
    assert list(rows) == ["ulysses", *host.CONFIGS]
    for mode in host.MODES:
        stock = rows["ulysses"][mode]
        assert stock["step_ratio"] == 1.0
        # Stock's own exchange functions, timed eager only (compiled, they are traced into the graph).
        assert ("host_s_per_exchange" in stock) == (mode == "eager"), stock
        if mode == "eager":
            assert stock["host_s_per_exchange"] > 0 and stock["layers_per_step"] == 4 and stock["exchanges_per_step"] == 8, stock
        for name in host.CONFIGS:
            m = rows[name][mode]
            assert m["step_s"] > 0 and m["host_s_per_layer"] >= m["host_s_per_exchange"] >= 0
            # Eager, every exchange runs the timed entry points; compiled, one traced into the graph none.
            assert m["host_s_per_exchange"] > 0 or mode == "compiled", (name, mode, m)
            # tiny-flux: 2 double and 2 single blocks per step on each rank; stock's processors
            # exchange twice per layer, V-First's at least twice (V rides with Q/K at sparse steps).
            assert m["layers_per_step"] == 4 and m["exchanges_per_step"] >= 8, (name, mode, m)
            # V-Major's layers launch its kernels (stood in for), the exact ones none.
            assert (m["kernel_launches_per_layer"] > 0) == (name == "cocodiff+vfirst+vmajor"), (name, mode, m)
            # Eager, beside stock's host time per layer in the same round.
            assert ("host_layer_vs_stock" in m) == (mode == "eager"), (name, mode, m)
        for name in ("ulysses", *host.CONFIGS):
            counts = rows[name][mode]["counts"]
            assert counts["layers_per_step"] == 4 and counts["python_calls_per_layer"] > 0 and counts["torch_ops_per_layer"] > 0
            assert all(_integers(rank) for ranks in counts["calls"].values() for rank in ranks), (name, mode)
            # Compiled, inductor's own kernels are counted, and stock's layer is traced whole.
            assert (counts["inductor_kernels_per_layer"] > 0) == (mode == "compiled"), (name, mode)
            if name == "ulysses" and mode == "compiled":
                assert counts["python_calls_cocodiff_per_layer"] == 0
            assert (counts["kernel_launches_per_layer"] > 0) == (name == "cocodiff+vfirst+vmajor"), (name, mode)
    targets = {(t["mode"], t["config"], t["target"]): t["met"] for t in report["count_targets_met"]}
    assert len(targets) == 8 and all(isinstance(met, bool) for met in targets.values())  # 3 eager, 2 + 3 compiled


@pytest.mark.slow
@pytest.mark.distributed
def test_the_counts_are_the_same_in_two_runs(tmp_path):
    first, second = (host._counts("cocodiff/tiny-flux", False, tmp_path / run, host.TIMEOUT_S) for run in ("first", "second"))
    assert {name: c["calls"] for name, c in first.items()} == {name: c["calls"] for name, c in second.items()}
