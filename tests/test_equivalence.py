"""Every tiny model: stock Ulysses matches one diffusers process; cocodiff matches stock bitwise.

One torchrun job per parallel layout generates every model with both backends (process
start-up dominates on two cores), then the assertions compare the saved images.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cocodiff_xfuser import launcher, tiny_models
from cocodiff_xfuser.generate import output_dir
from cocodiff_xfuser.verify import PROMPT, Run, compare

MODELS = sorted(tiny_models.SPECS)
# (ulysses, ring, emulated topology, cocodiff flags). 2x2 with ulysses 4 has two levels, so the
# hierarchical exchange is forced there (on loopback the autotune would pick flat); ulysses 2
# groups span one level and always use the flat exchange.
LAYOUTS = [
    (2, 1, "2x1", ()),
    (4, 1, "2x2", ("--cocodiff_a2a", "hierarchical")),
    (2, 2, "2x2", ()),
]
LAYOUT_IDS = [f"u{u}r{r}" for u, r, _, _ in LAYOUTS]
# Stock Ulysses vs one process: same weights and seed, different reduction orders (sharded
# attention, ring merges). Images are in [0, 1].
SINGLE_PROCESS_ATOL = 2e-3
SEED = 42
BACKENDS = ("ulysses", "cocodiff", "cocodiff+vfirst")


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> dict[tuple[int, int], Path]:
    for model in MODELS:
        tiny_models.ensure_fixture(model)
    outputs = {}
    for ulysses, ring, topology, flags in LAYOUTS:
        out = tmp_path_factory.mktemp(f"u{ulysses}r{ring}")
        run = Run(model=MODELS[0], ulysses_degree=ulysses, ring_degree=ring, topology=topology, seed=SEED, extra=flags)
        argv = run.argv(BACKENDS, out)
        argv[argv.index("--model") + 1] = ",".join(tiny_models.SPECS[m].model_id for m in MODELS)
        launcher.torchrun(run.world_size, argv, timeout=900)
        outputs[(ulysses, ring)] = out
    return outputs


def _images(out: Path, model: str, backend: str) -> np.ndarray:
    return np.load(output_dir(out, tiny_models.SPECS[model].model_id, backend) / "images.npy")


@pytest.mark.parametrize("variant", BACKENDS[1:])
@pytest.mark.parametrize("layout", [(u, r) for u, r, _, _ in LAYOUTS], ids=LAYOUT_IDS)
@pytest.mark.parametrize("model", MODELS)
def test_cocodiff_is_bitwise_equal_to_stock_ulysses(generated, model, layout, variant):
    report = compare(_images(generated[layout], model, "ulysses"), _images(generated[layout], model, variant))
    assert report["bitwise_equal"], report


@pytest.mark.parametrize("layout", [(u, r) for u, r, _, _ in LAYOUTS], ids=LAYOUT_IDS)
@pytest.mark.parametrize("model", MODELS)
def test_stock_ulysses_matches_one_diffusers_process(generated, model, layout):
    reference = tiny_models.reference_images(model, PROMPT, seed=SEED)
    stock = _images(generated[layout], model, "ulysses")
    assert stock.shape == reference.shape
    assert compare(reference, stock)["max_abs_diff"] <= SINGLE_PROCESS_ATOL
