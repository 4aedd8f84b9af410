"""Every tiny model: stock Ulysses matches one diffusers process; cocodiff matches stock bitwise.

One torchrun job per parallel layout generates every model with both backends (process
start-up dominates on two cores), then the assertions compare the saved images and check, from
what each job counted (``ran``, summed over its ranks), that the path under test really ran.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cocodiff_xfuser.comm.transport import DEVICE_SEMANTICS_ENV
from cocodiff_xfuser.tools import launcher
from cocodiff_xfuser.tools.models import digits
from cocodiff_xfuser.tools.models import tiny as tiny_models
from cocodiff_xfuser.tools.generate import output_dir
from cocodiff_xfuser.tools.verify import PROMPT, Run, compare

pytestmark = pytest.mark.distributed

MODELS = sorted(tiny_models.SPECS)
# Models with classifier-free guidance (two batch halves) can split them over CFG ranks; the
# FLUX ones are guidance-distilled or unguided.
CFG_MODELS = [m for m in MODELS if tiny_models.SPECS[m].pipeline != "FluxPipeline"]
# id -> (ulysses, ring, CFG parallel, emulated topology, cocodiff flags). On 2x2, ulysses 4 spans
# two levels, so the hierarchical exchange is forced there (on loopback the autotune would pick
# flat); ulysses 2 groups span one level: one layout lets the autotune choose in a real pipeline,
# the others force each flat exchange (every candidate is exact; the autotune's own measurements,
# two thirds of a layout's job, are tested in tests/comm/test_autotune.py).
LAYOUTS = {
    "u2r1": (2, 1, False, "2x1", ()),
    "u4r1": (4, 1, False, "2x2", ("--cocodiff_a2a", "hierarchical")),
    "u2r2": (2, 2, False, "2x2", ("--cocodiff_a2a", "flat-p2p")),
    "u2cfg2": (2, 1, True, "2x2", ("--cocodiff_a2a", "flat")),
}
# The hierarchical layout and the ring across nodes again with gloo made to follow a device
# backend's rules (COCODIFF_DEVICE_SEMANTICS=1: XCCL's order inside every batch, each receive
# completing in order, the order audit on), as NCCL/XCCL would run them: bitwise stock still.
DEVICE_SEMANTICS = {"u4r1-device": "u4r1", "u2r2-device": "u2r2", "u2r4-device": "u2r4"}
# The ring over four nodes (every rank's K/V to three other nodes, 8 ranks): every model, with and
# without device semantics, in the slow tier (8 ranks on two cores take minutes per layout).
EIGHT_RANKS = {"u2r4": (2, 4, False, "4x2", ("--cocodiff_a2a", "flat-p2p"))}
LAYOUTS |= EIGHT_RANKS
LAYOUTS |= {name: LAYOUTS[base] for name, base in DEVICE_SEMANTICS.items()}
SLOW_LAYOUTS = {"u2r4", "u2r4-device"}
# The order rules concern the exchanges, which every model drives alike: under device semantics,
# one model of each attention family (joint FLUX, joint SD3 with true CFG, video cross-attention).
DEVICE_MODELS = ["digits-flux", "digits-sd3", "tiny-wan"]


# Ulysses 2 over two nodes of one (the autotune's choice in a real pipeline, V-Major's one-phase
# sparse exchange) on the random-weight models; the trained ones take the same code on every other
# layout (every variant on Ulysses 4 over 2x2).
RANDOM_WEIGHT_MODELS = [m for m in MODELS if m not in digits.TRAINED]


def _models(layout: str) -> list[str]:
    if layout in SLOW_LAYOUTS:
        return MODELS
    if layout == "u2r1":
        return RANDOM_WEIGHT_MODELS
    return DEVICE_MODELS if layout in DEVICE_SEMANTICS else CFG_MODELS if LAYOUTS[layout][2] else MODELS


def _case(*values: str) -> object:
    return pytest.param(*values, marks=pytest.mark.slow) if values[1] in SLOW_LAYOUTS else values


CASES = [(model, name) for name in LAYOUTS for model in _models(name)]
# Stock Ulysses vs one process: same weights and seed, different reduction orders (sharded
# attention, ring merges). Images are in [0, 1].
SINGLE_PROCESS_ATOL = 2e-3
SEED = 42
# Steps per image: three, for every model (the trained digits models run 16 by default): the first
# step exact, then two sparse steps under exact V-Major, so its caches carry across steps; every
# mechanism runs from the first step.
STEPS = 3
# V-Major with a zero threshold (and no warm-up) sends every token that changed at all, as values,
# so it must be bitwise equal too. Its count is the share of changed tokens measured at an earlier
# step and agreed (the largest over the ranks): on these models every token changes on some rank,
# so every step's decision is the exact exchange. The sparse exchanges' bits are checked where
# the data leaves tokens out (tests/comm: the sparse and V-Major layer cases; tests/test_vmajor.py).
V_MAJOR_EXACT = {
    "cocodiff+vmajor0": {
        "sp_backend": "cocodiff", "cocodiff_v_major": "on", "cocodiff_v_major_policy": "threshold",
        "cocodiff_v_major_threshold": 0.0, "cocodiff_v_major_warmup_steps": 0, "cocodiff_v_major_residual_dtype": "none",
        "cocodiff_v_major_scope": "qkvo",
    }
}
BACKENDS = ("ulysses", "cocodiff", "cocodiff+vfirst", *V_MAJOR_EXACT)
#: What the ring attention's K/V exchange counts as (:meth:`cocodiff_xfuser.exchanger.Exchanger.start_ring`):
#: exact, or with V-Major's sparse messages to peers on other nodes.
RING, RING_V_MAJOR = "ring all-gather", "ring v-major"


def _spans_nodes(layout: str) -> bool:
    ulysses, _, _, topology, _ = LAYOUTS[layout]
    return ulysses == 4 or topology == "2x1"


def _backends(layout: str) -> tuple[str, ...]:
    """Where the Ulysses groups span the nodes, every variant; TAPA alone (stock processors over the
    routed exchange) only where it has two levels to exchange over (on Ulysses 2 over 2 nodes of 1 it
    is the flat exchange that every other variant routes too). Where the Ulysses groups stay inside a
    node (Ulysses x Ring and Ulysses x CFG across nodes), TAPA and V-Major have nothing to do on them
    (V-Major falls back and says so: tests/tools/test_check.py), and cocodiff there is V-First's
    processors over the forced flat exchange and the ring's K/V through cocodiff; where the ring
    crosses the nodes, exact V-Major runs on the ring's K/V under device semantics (its lossy
    defaults: tests/comm/test_order.py)."""
    if _spans_nodes(layout):
        return BACKENDS if LAYOUTS[layout][0] == 4 else tuple(b for b in BACKENDS if b != "cocodiff")
    exact_v_major = LAYOUTS[layout][1] > 1 and (layout in DEVICE_SEMANTICS or layout in SLOW_LAYOUTS)
    return ("ulysses", "cocodiff+vfirst", *(V_MAJOR_EXACT if exact_v_major else ()))


VARIANT_CASES = [_case(model, layout, variant) for model, layout in CASES for variant in _backends(layout)[1:]]


def _generate(layout: str, out: Path) -> Path:
    """One job on ``layout``: every model of it with every backend variant of it."""
    ulysses, ring, cfg, topology, flags = LAYOUTS[layout]
    models = _models(layout)
    run = Run(model=models[0], ulysses_degree=ulysses, ring_degree=ring, cfg=cfg, topology=topology, seed=SEED,
              steps=STEPS, extra=flags)
    (out / "variants.json").write_text(json.dumps(V_MAJOR_EXACT))
    argv = run.argv(_backends(layout), out) + ["--variants", str(out / "variants.json")]
    argv[argv.index("--model") + 1] = ",".join(tiny_models.SPECS[m].model_id for m in models)
    env = {DEVICE_SEMANTICS_ENV: "1"} if layout in DEVICE_SEMANTICS else {}
    (out / "stderr.txt").write_text(launcher.torchrun(run.world_size, argv, env=env, timeout=1800 if layout in SLOW_LAYOUTS else 900).stderr)
    return out


@pytest.fixture(scope="module")
def generated(at_first_use):
    """``generated(layout)``: the directory of the layout's job, run at its first use (the slow tier's
    layouts only run where their tests are selected)."""
    for model in MODELS:
        tiny_models.ensure_fixture(model)
    return at_first_use(_generate)


def _images(out: Path, model: str, backend: str) -> np.ndarray:
    return np.load(output_dir(out, tiny_models.SPECS[model].model_id, backend) / "images.npy")


def _result(out: Path, model: str, backend: str) -> dict:
    return json.loads((output_dir(out, tiny_models.SPECS[model].model_id, backend) / "result.json").read_text())


def _ran(out: Path, model: str, backend: str) -> dict:
    return _result(out, model, backend)["ran"]


@pytest.mark.parametrize("model, layout, variant", VARIANT_CASES)
def test_cocodiff_is_bitwise_equal_to_stock_ulysses(generated, model, layout, variant):
    report = compare(_images(generated(layout), model, "ulysses"), _images(generated(layout), model, variant))
    assert report["bitwise_equal"], report
    stock, ran = _ran(generated(layout), model, "ulysses"), _ran(generated(layout), model, variant)
    assert set(stock["exchanges"]) == {"stock"} and stock["v_first_calls"] == 0, stock
    # The cocodiff path ran: every exchange through the backend, no fall-back of any kind.
    assert ran["exchanges"] and "stock" not in ran["exchanges"], ran
    if variant in V_MAJOR_EXACT:
        _assert_v_major_ran(ran, layout)
        _assert_ring_ran(ran, layout)
        return
    assert ran["fallbacks"] == {}, ran
    _assert_ring_ran(ran, layout)
    flags = LAYOUTS[layout][4]
    if "--cocodiff_a2a" in flags:  # the forced exchange ran on the Ulysses group, and only it
        assert set(ran["exchanges"]) - {RING} == {flags[flags.index("--cocodiff_a2a") + 1]}, ran
    if layout in DEVICE_SEMANTICS:  # the mode was on: the audit recorded this rank's launches
        assert _result(generated(layout), model, variant)["launches"][0], layout
    # Lossless: the slow level carries what the exact exchange carries (half of it on 2 nodes).
    assert ran["slow_link_bytes"] == ran["slow_link_bytes_exact"], ran
    if layout in ("u4r1", "u2r2", "u2r4"):  # Ulysses' exchange, or the ring's, crosses the nodes
        assert ran["slow_link_bytes"] > 0, ran
    v_exchanges = sum(n for label, n in ran["labels"].items() if label.endswith(".v"))
    if variant == "cocodiff+vfirst":
        # Every V-First call exchanged its V first, and only V-First processors ran attention.
        assert ran["v_first_calls"] > 0 and v_exchanges == ran["v_first_calls"], ran
        assert "usp" not in ran["labels"], ran
    else:
        assert ran["v_first_calls"] == 0 and v_exchanges == 0, ran
    if (model, layout) == ("tiny-flux", "u4r1") and variant == "cocodiff+vfirst":
        # 4 ranks x 4 attention modules (2 double + 2 single blocks) x 3 steps.
        assert ran["v_first_calls"] == 4 * 4 * STEPS, ran


def _assert_ring_ran(ran: dict, layout: str) -> None:
    """With a ring, the ring attention's K/V went through cocodiff's exchange (one per ring attention call)."""
    if LAYOUTS[layout][1] > 1:
        ring = ran["exchanges"].get(RING, 0) + ran["exchanges"].get(RING_V_MAJOR, 0)
        assert ran["exchanges"].get(RING, 0) > 0 and ran["labels"].get("ring") == ring, ran
    else:
        assert RING not in ran["exchanges"] and RING_V_MAJOR not in ran["exchanges"], ran


def _assert_v_major_ran(ran: dict, layout: str) -> None:
    """V-Major decided every step of every layer, and every decision was every token (the exact
    exchange): on the Ulysses exchanges where their groups span both nodes, else on the ring's K/V."""
    assert ran["fallbacks"] == {} and ran["v_first_calls"] > 0 and ran["v_major"]["tokens"] > 0, ran
    assert ran["v_major"]["active"] == ran["v_major"]["tokens"] and not ran["v_major_sparse"], ran
    assert len(ran["v_major"]["per_step"]) == STEPS, ran
    assert RING_V_MAJOR not in ran["exchanges"] and not set(ran["exchanges"]) & {"v-major one-phase", "v-major two-phase"}, ran


@pytest.mark.parametrize("model, layout", [_case(*case) for case in CASES if case[1] not in DEVICE_SEMANTICS])
def test_stock_ulysses_matches_one_diffusers_process(generated, model, layout):
    reference = tiny_models.reference_images(model, PROMPT, seed=SEED, steps=STEPS)
    stock = _images(generated(layout), model, "ulysses")
    assert stock.shape == reference.shape
    assert compare(reference, stock)["max_abs_diff"] <= SINGLE_PROCESS_ATOL


@pytest.mark.parametrize("layout", ["u2r2", "u2cfg2", "u4r1"])
def test_where_ulysses_stays_inside_a_node_one_line_says_tapa_and_v_major_have_nothing_to_do(generated, layout):
    lines = [line for line in (generated(layout) / "stderr.txt").read_text().splitlines() if "stays inside one node" in line]
    if layout == "u4r1":  # Ulysses spans both nodes
        assert lines == []
        return
    # Rank 0 says it once per activation (every cocodiff variant and model of the job activates anew).
    assert lines and all("TAPA, V-Major and fp8-slow have nothing to do there" in line for line in lines), lines
    assert len(lines) <= len(_backends(layout)[1:]) * len(_models(layout)), lines
