"""One program order: with the order audit on, every rank launches the same collectives, on the
same communicators, in the same order, for every tiny model under V-First, TAPA and V-Major (4
ranks, 2 nodes x 2, the hierarchical exchange forced so that phases on sub-groups are in flight,
V-Major's sparse exchanges in two phases from the second step on, with rank-local masks), with a
device backend's rules (``COCODIFF_DEVICE_SEMANTICS=1``, which turns the audit on; with gloo's own
rules in the slow tier), and with V-Major on the ring's K/V under Ulysses 2 x Ring 2."""

from __future__ import annotations

import json

import pytest

from cocodiff_xfuser.comm.transport import AUDIT_ENV
from cocodiff_xfuser.comm.transport import DEVICE_SEMANTICS_ENV
from cocodiff_xfuser.tools import launcher
from cocodiff_xfuser.tools.generate import output_dir
from cocodiff_xfuser.tools.models import tiny as tiny_models
from cocodiff_xfuser.tools.verify import Run

pytestmark = pytest.mark.distributed

MODELS = sorted(tiny_models.SPECS)


MODES = {"audit": {AUDIT_ENV: "1"}, "device-semantics": {DEVICE_SEMANTICS_ENV: "1"}}


# Device semantics turn the audit on too, and stricter: the audit alone (gloo's own order inside a
# batch, which does not change what is launched) runs in the slow tier.
@pytest.fixture(scope="module", params=[pytest.param("audit", marks=pytest.mark.slow), "device-semantics"])
def audited(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("order")
    flags = ("--cocodiff_a2a", "hierarchical", "--cocodiff_v_major", "on", "--cocodiff_v_major_policy", "budget",
             "--cocodiff_v_major_warmup_steps", "0", "--cocodiff_v_major_first_step", "exact")
    # 4 steps: the first exact (hierarchical exchanges); V-Major's budget policy (per call: TAPA's
    # two phases for the sparse rows) measures at step 1 and runs sparse from step 2 on.
    run = Run(model=MODELS[0], ulysses_degree=4, topology="2x2", v_first=True, steps=4, extra=flags)
    argv = run.argv(("cocodiff",), out)
    argv[argv.index("--model") + 1] = ",".join(tiny_models.SPECS[m].model_id for m in MODELS)
    launcher.torchrun(run.world_size, argv, env=MODES[request.param], timeout=900)
    return out


@pytest.mark.parametrize("model", MODELS)
def test_every_rank_launches_in_one_order(audited, model):
    result = json.loads((output_dir(audited, tiny_models.SPECS[model].model_id, "cocodiff") / "result.json").read_text())
    launches = result["launches"]
    assert len(launches) == 4 and launches[0], result
    for rank, sequence in enumerate(launches[1:], start=1):
        first = next((i for i, (a, b) in enumerate(zip(launches[0], sequence)) if a != b), None)
        assert sequence == launches[0], f"rank {rank} differs from rank 0 at launch {first}: {sequence[first:first + 3]}"
    roles = {role for role, _ in launches[0]}
    assert {"level 0 of (2, 2)", "level 1 of (2, 2)"} <= roles, roles
    assert {"sparse phase 1 (node)", "sparse phase 2 (across nodes)"} <= roles, roles
    # The path under test ran: V-First calls, hierarchical exchanges and V-Major's two-phase ones.
    ran = result["ran"]
    assert ran["v_first_calls"] > 0 and set(ran["exchanges"]) == {"hierarchical", "v-major two-phase"}, ran
    assert ran["fallbacks"] == {} and 0 < ran["v_major"]["active"] <= ran["v_major"]["tokens"], ran


#: Ulysses 2 inside the node x Ring 2 across nodes: V-Major under auto on the ring's K/V (the budget
#: policy's counts agreed over the world, residuals to the peers on the other node), its trial's three
#: arms in turn (V-Major, V-First alone, xfuser's processors over cocodiff's exchange); FLUX's joint
#: attention and SD3's true CFG (two transformer calls per step), under a device backend's rules.
RING_MODELS = ["digits-flux", "digits-sd3"]


@pytest.fixture(scope="module")
def audited_ring(tmp_path_factory):
    out = tmp_path_factory.mktemp("order-ring")
    flags = ("--cocodiff_a2a", "flat-p2p", "--cocodiff_v_major", "auto", "--cocodiff_v_major_warmup_steps", "0")
    # 7 steps: step 0 exact, then the trial's first two rounds from step 1 (V-Major at steps 1 and 6,
    # with counts agreed at 6; V-First alone at 2 and 4; stock processors at 3 and 5), undecided.
    run = Run(model=RING_MODELS[0], ulysses_degree=2, ring_degree=2, topology="2x2", v_first=True, steps=7, extra=flags)
    argv = run.argv(("cocodiff",), out)
    argv[argv.index("--model") + 1] = ",".join(tiny_models.SPECS[m].model_id for m in RING_MODELS)
    launcher.torchrun(run.world_size, argv, env=MODES["device-semantics"], timeout=900)
    return out


@pytest.mark.parametrize("model", RING_MODELS)
def test_every_rank_launches_in_one_order_with_v_major_on_the_ring(audited_ring, model):
    result = json.loads((output_dir(audited_ring, tiny_models.SPECS[model].model_id, "cocodiff") / "result.json").read_text())
    launches = result["launches"]
    assert len(launches) == 4 and all(sequence == launches[0] for sequence in launches[1:]), launches
    assert ["ring", "ring K/V"] in launches[0] and ["group of 4", "all_reduce"] in launches[0], launches[0]
    ran = result["ran"]
    assert ran["exchanges"].get("ring v-major", 0) > 0 and ran["slow_link_bytes"] < ran["slow_link_bytes_exact"], ran
    # Two of the seven steps on xfuser's processors, every attention layer (and SD3's two branches).
    assert set(ran["fallbacks"]) == {"v-first: stock processors' step (auto)"} and ran["v_first_calls"] > 0, ran
    assert ran["fallbacks"]["v-first: stock processors' step (auto)"] * 5 == ran["v_first_calls"] * 2, ran
