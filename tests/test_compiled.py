"""Under ``--use_torch_compile``: stock is stock, and cocodiff compiles without recompiling.

One torchrun job per layout runs every backend of it compiled (dynamo reset between backends, as
in a process of its own), two pipeline calls each, and records dynamo's counters after model set-up
and after each call (``tools/generate.py``: frames converted, graph breaks by reason). A recompile
converts a frame again, so "no recompile after the first call" is "as many frames after the
second call as after the first". An exact layer's exchanges (xfuser's routed one, V-First's) are
functional collectives of the graph, as stock's are, read in the code inductor generated, and so
are fp8-slow's and V-Major's with static shapes (top-k), a ring's K/V being torch's as in stock's
graph; no graph holds an operator of cocodiff's. V-Major's other policies and V-Major on the ring run
their layers' exchanges between graphs: the only graph breaks cocodiff may add are there (V's start,
and the rest of the layer's attention), decided in the graph, auto's steps included (a step's
hand-off to stock is one bool the graphs guard: two of them, made in the first call).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cocodiff_xfuser import compat
from cocodiff_xfuser.tools import launcher
from cocodiff_xfuser.tools.generate import output_dir
from cocodiff_xfuser.tools.models import tiny as tiny_models
from cocodiff_xfuser.tools.verify import Run
from workers.inductor_code import exchanges_in_flight, host_work

pytestmark = pytest.mark.distributed

DISABLED = "Skip calling `torch.compiler.disable()`d function: "
#: Where a compiled cocodiff layer whose exchanges run on the host breaks its graph: V's start, and the
#: rest of its attention (the ring's K/V included); xfuser's routed exchange and torch's ring attention,
#: where xfuser's processors run (auto's stock steps) under V-Major on the ring.
EXCHANGE_POINTS = {"start_input_exchange", "attention", "_routed_all_to_all.<locals>.on_host", "_counted_ring.<locals>.on_host"}
#: The backends whose layers' exchanges all are in the graphs.
IN_GRAPH = ("cocodiff", "cocodiff+vfirst", "topk", "fp8", "fp8-slow")
#: V-Major's per-call path (budget: counts the data decides), a sparse step at step 2.
V_MAJOR = {"sp_backend": "cocodiff", "cocodiff_v_first": True, "cocodiff_v_major": "on", "cocodiff_v_major_policy": "budget",
           "cocodiff_v_major_warmup_steps": 1}
# Auto's speed check decides within the first call (its warm-up step, then three rounds of three arms).
V_MAJOR_AUTO = {**V_MAJOR, "cocodiff_v_major": "auto", "cocodiff_v_major_policy": None}
FP8 = {"sp_backend": "cocodiff", "cocodiff_v_first": True, "cocodiff_compress": "fp8"}
FP8_SLOW = {**FP8, "cocodiff_compress": "fp8-slow"}
#: V-Major with static shapes (top-k: a count fixed by the settings), plain torch in the graph.
STATIC = {**V_MAJOR, "cocodiff_v_major_policy": "top-k"}
#: The same path sending every token as values over every link: bitwise the exact exchange.
STATIC_EXACT = {**STATIC, "cocodiff_v_major_fraction": 1.0, "cocodiff_v_major_residual_dtype": "none"}
#: V-Major's other per-call policies (budget is "vmajor"): a sparse step at step 2 for each.
POLICIES = {p: {**V_MAJOR, "cocodiff_v_major_policy": p} for p in ("threshold", "schedule")}
# id -> (model, ulysses, ring, topology, backends, extra flags, steps); every cocodiff backend is checked.
JOBS = {
    "flux-u2": ("tiny-flux", 2, 1, "2x1", ("ulysses", "cocodiff", "cocodiff+vfirst", "topk"), (), 3),
    # fp8 on every link and on the slow links only (make test keeps their codecs, comm/test_compress.py,
    # and fp8-slow's routings, comm/test_exchanges.py).
    "flux-u2-fp8": ("tiny-flux", 2, 1, "2x1", ("ulysses", "fp8", "fp8-slow"), (), 3),
    "sd3-u2-fp8": ("tiny-sd3", 2, 1, "2x1", ("ulysses", "cocodiff+vfirst"), ("--cocodiff-compress", "fp8"), 3),
    # V-Major on the ring's K/V (Ulysses inside the node x Ring across nodes), and auto's three arms.
    "flux-u2r2": ("tiny-flux", 2, 2, "2x2", ("ulysses", "cocodiff+vfirst", "vmajor"), (), 3),
    "flux-u2-auto": ("tiny-flux", 2, 1, "2x1", ("ulysses", "auto"), (), 11),
    "flux-u2-policies": ("tiny-flux", 2, 1, "2x1", ("ulysses", "vmajor", *POLICIES), (), 3),
    # Wan hands its attention function settings (attention_kwargs): still one graph.
    "wan-u2": ("tiny-wan", 2, 1, "2x1", ("ulysses", "cocodiff+vfirst"), (), 3),
    # The ring across nodes, the only exchange there (Ulysses of one): top-k's V-Major on its K/V in the graph.
    "flux-r2": ("tiny-flux", 1, 2, "2x1", ("ulysses", "topk"), (), 3),
}
#: Token counts the degree does not divide, which stock cannot split (no stock run beside them): 32
#: text and 256 image tokens over 3 ranks, each on a node of its own.
PADDED_JOBS = {"flux-u3-padded": ("tiny-flux", 3, 1, "3x1", ("cocodiff+vfirst", "topk"), (), 3)}
# make test keeps FLUX under xDiT's reduce-overhead mode (flux-u2) and, under the default mode,
# HunyuanVideo's joint path (processors/test_processors.py).
SLOW_JOBS = {"flux-u2-fp8", "sd3-u2-fp8", "flux-u2r2", "flux-u2-auto", "flux-u2-policies", "wan-u2", "flux-r2"}
CASES = [["a cat", 1], ["a dog", 2]]


#: Jobs run again eagerly ("<job> eager"), for these of their backends.
EAGER_TWINS = {"flux-u2": ("topk", "topk-exact", "cocodiff+vfirst"), "flux-u2-fp8": ("fp8-slow",), "flux-u3-padded": ("cocodiff+vfirst",),
               "flux-r2": ("topk",)}


def _generate(job: str, out: Path) -> Path:
    name, _, mode = job.partition(" ")
    model, ulysses, ring, topology, backends, extra, steps = _spec(name)
    if mode == "eager":
        backends = EAGER_TWINS[name]
    compiled = ("--use_torch_compile",) if mode != "eager" else ()
    run = Run(model=model, ulysses_degree=ulysses, ring_degree=ring, topology=topology, seed=1, steps=steps,
              extra=(*compiled, *extra))
    (out / "cases.json").write_text(json.dumps(CASES))
    (out / "variants.json").write_text(json.dumps({"vmajor": V_MAJOR, "topk": STATIC, "topk-exact": STATIC_EXACT, "auto": V_MAJOR_AUTO, "fp8": FP8, "fp8-slow": FP8_SLOW, **POLICIES}))
    argv = run.argv(backends, out) + ["--cases", str(out / "cases.json"), "--variants", str(out / "variants.json")]
    (out / "stderr.txt").write_text(launcher.torchrun(run.world_size, argv, timeout=900).stderr)
    return out


@pytest.fixture(scope="module")
def generated(at_first_use):
    tiny_models.ensure_fixture("tiny-flux")
    tiny_models.ensure_fixture("tiny-sd3")
    tiny_models.ensure_fixture("tiny-wan")
    return at_first_use(_generate)


def _spec(job: str) -> tuple:
    return JOBS[job] if job in JOBS else PADDED_JOBS[job]


def _result(out: Path, job: str, backend: str) -> dict:
    model = tiny_models.SPECS[_spec(job)[0]].model_id
    return json.loads((output_dir(out, model, backend) / "result.json").read_text())


def _images(out: Path, job: str, backend: str) -> np.ndarray:
    return np.load(output_dir(out, tiny_models.SPECS[_spec(job)[0]].model_id, backend) / "images.npy")


def _psnr(a: np.ndarray, b: np.ndarray) -> list[float]:
    return [10 * np.log10(1 / np.mean((x.astype(np.float64) - y) ** 2)) for x, y in zip(a, b)]


def _case(job: str, *rest: str) -> object:
    return pytest.param(job, *rest, marks=pytest.mark.slow) if job in SLOW_JOBS else (job, *rest) if rest else job


@pytest.mark.parametrize("job", [_case(job) for job in JOBS])
def test_compiled_stock_traces_nothing_of_cocodiff(generated, job):
    out = generated(job)
    result = _result(out, job, "ulysses")
    for rank in result["dynamo"]:
        setup, first, second = rank
        assert first["frames"] == second["frames"], rank  # no recompile after the first call
        assert not any("cocodiff" in reason for reason in second["graph_breaks"]), rank
        assert not any(reason.startswith(DISABLED) for reason in second["graph_breaks"]), rank
    # xfuser's own exchange ran, not cocodiff's counting route (compiled stock is uncounted).
    assert result["ran"]["exchanges"] == {} and result["ran"]["v_first_calls"] == 0, result["ran"]
    assert "recompile_limit" not in (out / "stderr.txt").read_text()


@pytest.mark.parametrize("job, backend", [_case(job, b) for job, spec in JOBS.items() for b in spec[4] if b != "ulysses"])
def test_compiled_cocodiff_breaks_only_at_exchanges_and_never_recompiles(generated, job, backend):
    out = generated(job)
    stock_breaks = {r for rank in _result(out, job, "ulysses")["dynamo"] for r in rank[-1]["graph_breaks"]}
    result = _result(out, job, backend)
    for rank in result["dynamo"]:
        setup, first, second = rank
        assert first["frames"] == second["frames"], rank
        ours = {r.removeprefix(DISABLED) for r in second["graph_breaks"] if r not in stock_breaks}
        if backend == "cocodiff":  # stock's processors: the exchange is a functional collective of the graph
            assert not ours, ours
        if backend in IN_GRAPH:
            assert not ours, (ours, rank)  # one graph per forward, the ring's K/V included
        assert ours <= EXCHANGE_POINTS, ours
    assert "recompile_limit" not in (out / "stderr.txt").read_text()
    # The path under test ran, compiled.
    ran = result["ran"]
    assert ran["exchanges"] and "stock" not in ran["exchanges"], ran
    if backend != "cocodiff":
        assert ran["v_first_calls"] > 0, ran
    if backend == "auto":  # its trial ran every arm: V-Major's sparse exchanges, and stock processors' steps
        assert ran["v_major_sparse"] and ran["fallbacks"].get("v-first: stock processors' step (auto)"), ran
        return
    assert ran["fallbacks"] == {}, ran
    if backend in ("vmajor", "topk") and JOBS[job][2] > 1:
        assert ran["exchanges"].get("ring v-major"), ran
    elif backend in ("vmajor", "topk") or backend in POLICIES:
        assert ran["v_major_sparse"] and ran["v_major"]["tokens"] > 0, ran
    if backend == "cocodiff+vfirst" and "--cocodiff-compress" not in JOBS[job][5]:
        # Exact: the compiled V-First image is the compiled stock one (the same graphs around the exchanges).
        assert np.array_equal(_images(out, job, backend), _images(out, job, "ulysses"))


#: The backends whose every exchange is a functional collective of their graphs: exact, fp8 on every
#: link, fp8 on the slow links only.
TRACED = ("cocodiff", "cocodiff+vfirst", "fp8", "fp8-slow")


@pytest.mark.parametrize("job, backend", [_case(job, b) for job, spec in JOBS.items() for b in spec[4] if b != "ulysses"])
def test_compiled_graphs_hold_no_operator_of_cocodiff_and_no_host_read(generated, job, backend):
    # Whatever runs on the host (V-Major's per-call policies, V-Major on the ring) runs between graphs.
    out = generated(job)
    code = json.loads((output_dir(out, tiny_models.SPECS[JOBS[job][0]].model_id, backend) / "inductor_code.json").read_text())
    assert code and host_work(code) == [], host_work(code)


@pytest.mark.parametrize("job, backend", [_case(job, b) for job, spec in JOBS.items() for b in spec[4] if b in TRACED])
def test_compiled_exact_layers_hold_functional_collectives_with_v_first_in_flight(generated, job, backend):
    # The generated code (FLUX under xDiT's reduce-overhead mode, Wan under the default one, with
    # xDiT's compute/communication overlap passes): no operator of cocodiff's, no host read, every
    # exchange an all_to_all_single (fp8's packed and unpacked around it); under V-First each layer
    # issues V's, Q/K's and the output's, in that order, and projects Q and K (two matrix products,
    # four with FLUX's text) while V's is in flight.
    out = generated(job)
    code = json.loads((output_dir(out, tiny_models.SPECS[JOBS[job][0]].model_id, backend) / "inductor_code.json").read_text())
    assert code and host_work(code) == [], host_work(code)
    in_flight = exchanges_in_flight(code)
    stock = exchanges_in_flight(json.loads((output_dir(out, tiny_models.SPECS[JOBS[job][0]].model_id, "ulysses")
                                            / "inductor_code.json").read_text()))
    ran = _result(out, job, backend)["ran"]
    assert set(ran["exchanges"]) - {"ring all-gather"} <= {"flat", "hierarchical", "fp8-slow one-phase"}, ran  # the ring's K/V stay eager
    if backend == "fp8-slow":
        assert set(ran["exchanges"]) == {"fp8-slow one-phase"}, ran
        assert ran["slow_link_bytes"] < 0.6 * ran["slow_link_bytes_exact"], ran
    if backend == "cocodiff":
        assert in_flight == stock, (in_flight, stock)  # stock's graph, cocodiff's route
        return
    assert len(in_flight) % 3 == 0 and min(in_flight[0::3]) >= 2, in_flight


def test_a_compiled_exact_job_counts_what_its_eager_twin_runs(generated):
    # Its graphs count nothing when they run: what each one runs, counted when it was traced, is
    # added after every transformer call; the eager twin counts every exchange as it runs. The
    # compiled job also ran xDiT's compile warm-up: the same counts per transformer call, more calls.
    compiled = _result(generated("flux-u2"), "flux-u2", "cocodiff+vfirst")["ran"]
    eager = _result(generated("flux-u2 eager"), "flux-u2", "cocodiff+vfirst")["ran"]
    calls = compiled["v_first_calls"] / eager["v_first_calls"]
    assert eager["v_first_calls"] > 0 and calls >= 1, (compiled, eager)
    assert {k: v / calls for k, v in compiled["labels"].items()} == eager["labels"], (compiled, eager)
    assert compiled["slow_link_bytes_exact"] == eager["slow_link_bytes_exact"] * calls, (compiled, eager)
    # Eager runs the code the graph holds: the same exchanges by route, the same copies, per call.
    assert {k: v / calls for k, v in compiled["exchanges"].items()} == eager["exchanges"], (compiled, eager)
    assert compiled["copied_bytes"] == eager["copied_bytes"] * calls, (compiled, eager)


@pytest.mark.parametrize("job, backend", [("flux-u2", "topk"), _case("flux-u2-fp8", "fp8-slow")])
def test_compiled_lossy_exchanges_give_the_eager_images(generated, job, backend):
    # Compiled arithmetic differs from eager in the last bits, which may move a token across
    # V-Major's selection threshold or a value across fp8's rounding: close, not bitwise.
    eager_out = generated(f"{job} eager")
    ran = _result(eager_out, job, backend)["ran"]  # the eager twin ran the lossy exchanges too
    assert ran["fallbacks"] == {} and ran["slow_link_bytes"] < ran["slow_link_bytes_exact"], ran
    if backend == "topk":  # the same code, eager and compiled
        assert ran["v_major_sparse"] and set(ran["exchanges"]) == {"v-major one-phase"}, ran
    psnr = _psnr(_images(generated(job), job, backend), _images(eager_out, job, backend))
    assert min(psnr) >= 80, psnr


def test_v_major_with_static_shapes_sending_every_token_as_values_is_exact(generated):
    # Every exchange through V-Major's static path (caches, rows, split sizes), every token as its
    # value: the images are V-First's exact ones, bitwise.
    out = generated("flux-u2 eager")
    ran = _result(out, "flux-u2", "topk-exact")["ran"]
    assert set(ran["exchanges"]) == {"v-major one-phase"} and ran["fallbacks"] == {}, ran
    assert ran["v_major"]["active"] == ran["v_major"]["tokens"] > 0 and ran["slow_link_bytes"] == ran["slow_link_bytes_exact"], ran
    assert np.array_equal(_images(out, "flux-u2", "topk-exact"), _images(out, "flux-u2", "cocodiff+vfirst"))


def test_compiled_v_major_holds_functional_collectives_and_no_host_read(generated):
    # V-Major with static shapes in the generated code (FLUX under xDiT's reduce-overhead mode, with
    # its overlap passes): no operator of cocodiff's, no host read; every exchange, sparse or not,
    # one all_to_all_single with split sizes fixed when traced; V's issued before Q and K are projected.
    out = generated("flux-u2")
    code = json.loads((output_dir(out, tiny_models.SPECS["tiny-flux"].model_id, "topk") / "inductor_code.json").read_text())
    assert code and host_work(code) == [], host_work(code)
    result = _result(out, "flux-u2", "topk")
    ran = result["ran"]
    assert set(ran["exchanges"]) == {"v-major one-phase"} and ran["v_major_sparse"], ran
    assert set(ran["v_major"]["per_step"]) == {"first", "sparse"}, ran["v_major"]  # one warm-up step
    assert ran["slow_link_bytes"] < ran["slow_link_bytes_exact"] / 2, ran
    assert max(exchanges_in_flight(code)) >= 2, exchanges_in_flight(code)
    for rank in result["dynamo"]:  # its graphs: the first step's and the sparse steps', made in the first call
        assert rank[1]["frames"] == rank[2]["frames"] and not rank[2]["graph_breaks"], rank


@pytest.mark.slow  # two jobs (compiled, eager twin); make test runs top-k's ring eagerly (tools/test_cli.py, requests)
def test_compiled_v_major_on_the_ring_stays_in_the_graph(generated):
    # Ulysses of one x Ring 2 over two nodes: the ring's K/V are the only exchange across nodes, top-k's
    # V-Major on them a collective of the graph with split sizes fixed when traced (an all-gather at the
    # first step). No graph break that stock's ring job has not, no recompile, no host read; the eager
    # twin runs the same code: the same images but for compiled arithmetic's last bits.
    out = generated("flux-r2")
    stock_breaks = {r for rank in _result(out, "flux-r2", "ulysses")["dynamo"] for r in rank[-1]["graph_breaks"]}
    result = _result(out, "flux-r2", "topk")
    for rank in result["dynamo"]:
        setup, first, second = rank
        assert first["frames"] == second["frames"] and set(second["graph_breaks"]) <= stock_breaks, rank
    ran = result["ran"]
    assert set(ran["exchanges"]) == {"ring all-gather", "ring v-major"} and ran["fallbacks"] == {}, ran
    assert ran["slow_link_bytes"] < ran["slow_link_bytes_exact"] / 2, ran
    code = json.loads((output_dir(out, tiny_models.SPECS["tiny-flux"].model_id, "topk") / "inductor_code.json").read_text())
    assert code and host_work(code) == [], host_work(code)
    eager = _result(generated("flux-r2 eager"), "flux-r2", "topk")["ran"]
    assert {k: v > 0 for k, v in eager["exchanges"].items()} == {k: v > 0 for k, v in ran["exchanges"].items()}, eager
    assert min(_psnr(_images(out, "flux-r2", "topk"), _images(generated("flux-r2 eager"), "flux-r2", "topk"))) >= 80


@pytest.mark.slow  # two jobs (compiled, eager twin); make test's padded tokens run eagerly (test_padding.py, xfuser/test_hooks.py)
def test_compiled_padded_tokens_hold_functional_collectives_and_never_recompile(generated):
    # Padded with zeros and cut from K and V by static slices: no operator of cocodiff's and no host
    # read in the graphs, exact or V-Major; no recompile after the first call, whose first forward
    # (off the graph) says the layout and installs the processors that padding needs.
    out = generated("flux-u3-padded")
    for backend in PADDED_JOBS["flux-u3-padded"][4]:
        code = json.loads((output_dir(out, tiny_models.SPECS["tiny-flux"].model_id, backend) / "inductor_code.json").read_text())
        assert code and host_work(code) == [] and exchanges_in_flight(code), host_work(code)
        result = _result(out, "flux-u3-padded", backend)
        ran = result["ran"]
        assert ran["padded_bytes"] > 0 and ran["v_first_calls"] > 0 and ran["fallbacks"] == {}, ran
        assert set(ran["exchanges"]) == ({"flat"} if backend == "cocodiff+vfirst" else {"v-major one-phase"}), ran
        if backend == "topk":
            assert ran["v_major_sparse"] and ran["slow_link_bytes"] < ran["slow_link_bytes_exact"] / 2, ran
        for rank in result["dynamo"]:
            setup, first, second = rank
            assert first["frames"] == second["frames"], rank
            assert set(second["graph_breaks"]) <= {DISABLED + "_first_use"}, rank
    # The same images as the same code run eagerly, but for compiled arithmetic's last bits.
    eager = _images(generated("flux-u3-padded eager"), "flux-u3-padded", "cocodiff+vfirst")
    assert min(_psnr(_images(out, "flux-u3-padded", "cocodiff+vfirst"), eager)) >= 80


@pytest.mark.unit
def test_a_compiled_stock_job_runs_xfusers_own_functions():
    from xfuser.model_executor.layers import usp  # noqa: F401 (loads the switched patches)

    from cocodiff_xfuser.xfuser import activation

    try:
        activation.use_patches(compiled=True)
        assert not compat.is_wrapped(usp._sdpa_all_to_all_single)
        activation.use_patches(compiled=False)  # eager stock counts its exchanges
        assert compat.is_wrapped(usp._sdpa_all_to_all_single)
    finally:
        compat.use_switches(cocodiff=True, compiled=False, enablement=True)  # as loaded: every patch in
