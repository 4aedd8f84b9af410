"""xDiT's step caching beside cocodiff: every configuration runs under TeaCache and cache-dit's
DBCache (skipping steps, every rank deciding alike), the lossless ones bitwise equal to the same
stock run, V-Major with its PSNR against it; xfuser's fp8 communication beside a cocodiff setting
that cannot run with it is refused before launch (tests/xfuser/test_hooks.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from cocodiff_xfuser.comm.transport import DEVICE_SEMANTICS_ENV
from cocodiff_xfuser.tools import launcher
from cocodiff_xfuser.tools.generate import output_dir
from cocodiff_xfuser.tools.verify import Run

BACKENDS = ("ulysses", "cocodiff", "cocodiff+vfirst", "cocodiff+vfirst+vmajor")
STEPS = 8
# Thresholds high enough that the tiny model skips some of its 8 steps (the presets are for 50).
CACHES = {
    "teacache": ("--cache_method", "teacache", "--cache_config", '{"residual_diff_threshold": 0.3}'),
    "dbcache": ("--cache_method", "dbcache", "--cache_config",
                '{"Fn_compute_blocks": 1, "max_warmup_steps": 2, "residual_diff_threshold": 0.5, "scm_policy": null}'),
}


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cache", sorted(CACHES))
def test_step_caching_beside_every_configuration(tmp_path, cache):
    run = Run(model="tiny-flux", ulysses_degree=2, topology="2x1", steps=STEPS, height=64, width=64, extra=CACHES[cache])
    launcher.torchrun(2, run.argv(BACKENDS, tmp_path), env={DEVICE_SEMANTICS_ENV: "1"}, timeout=540)
    found = {}
    for backend in BACKENDS:
        where = output_dir(tmp_path, "cocodiff/tiny-flux", backend)
        found[backend] = json.loads((where / "result.json").read_text()), np.load(where / "images.npy")
    stock, stock_images = found["ulysses"]
    layers, ranks = 4, 2
    assert 0 < stock["ran"]["exchanges"]["stock"] < STEPS * layers * ranks * 2, stock["ran"]  # some steps skipped
    for backend in BACKENDS[1:]:
        result, images = found[backend]
        ran = result["ran"]
        assert not ran["fallbacks"] and "stock" not in ran["exchanges"], (backend, ran)
        assert all(sequence == result["launches"][0] for sequence in result["launches"][1:]), f"{backend}: ranks launched apart"
        if backend.endswith("vmajor"):
            assert ran["v_major_sparse"].get("qk+v", 0) > 0, ran
            mse = float(np.mean((images.astype(np.float64) - stock_images) ** 2))  # images in [0, 1]
            psnr = math.inf if mse == 0 else 10 * math.log10(1.0 / mse)
            print(f"{cache}: V-Major {psnr:.1f} dB PSNR against stock with the same cache")
            assert 30.0 <= psnr < math.inf  # lossy, close (a random-weight model: not a quality claim)
        else:
            assert np.array_equal(images, stock_images), backend
            assert backend == "cocodiff" or ran["v_first_calls"] > 0, ran
