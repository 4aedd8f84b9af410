"""The trained ``cocodiff/digits-flux`` and ``cocodiff/digits-sd3``: each draws the digit its prompt
asks for, through plain diffusers and through ``xdit`` with the cocodiff backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cocodiff_xfuser.tools.models import digits
from cocodiff_xfuser.tools.models import tiny as tiny_models
from cocodiff_xfuser.tools.models.pixel_shuffle import PixelShuffleAutoencoder


@pytest.fixture(scope="module")
def classifier() -> digits.Classifier:
    return digits.Classifier()


@pytest.mark.parametrize("model", digits.TRAINED)
def test_checkpoint_is_small_and_complete(model):
    checkpoint = tiny_models.SPECS[model].checkpoint
    files = [p for p in checkpoint.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 20 * 2**20
    log = json.loads((checkpoint / "train_log.json").read_text())
    assert log["final_classifier_agreement"] >= 0.9 and log["minutes"] <= 30, log


def test_pixel_shuffle_autoencoder_is_exact():
    gray = torch.rand(3, 1, 8, 8) * 2 - 1
    ae = PixelShuffleAutoencoder()
    decoded = ae.decode(ae.encode(gray.repeat(1, 3, 1, 1)), return_dict=False)[0]
    assert decoded.shape == (3, 3, 8, 8) and torch.equal(decoded, gray.repeat(1, 3, 1, 1))
    with pytest.raises(ValueError, match="4 latent channels"):
        PixelShuffleAutoencoder(latent_channels=16)


def test_classifier_reads_the_real_digits(classifier):
    assert classifier.held_out_accuracy >= 0.97


@pytest.mark.slow  # the trained models' quality (30 samples each), not the code's
@pytest.mark.parametrize("model", digits.TRAINED)
def test_generated_images_show_the_prompted_digit(classifier, model):
    """A few dozen one-process samples (plain diffusers, the shipped checkpoint; digits-sd3 with its
    classifier-free guidance) are labelled as their prompt's digit by a classifier fitted on the
    real digits."""
    cases = [(d, seed) for d in range(10) for seed in (100, 101, 102)]
    images = np.concatenate([tiny_models.reference_images(model, f"digit {d}", seed) for d, seed in cases])
    assert images.shape == (30, digits.SIZE, digits.SIZE, 3)
    agreement = float((classifier.predict(images) == np.array([d for d, _ in cases])).mean())
    assert agreement >= 0.9, agreement


@pytest.mark.distributed
# digits-sd3's images under cocodiff are checked bitwise in the equivalence suite; drawing its digit
# through xdit runs with the slow tier.
@pytest.mark.parametrize("model", [pytest.param(m, marks=pytest.mark.slow) if m == digits.SD3_NAME else m for m in digits.TRAINED])
def test_xdit_with_cocodiff_draws_the_digit(tmp_path, classifier, model):
    """The issue's command, with the trained size, step count (and guidance) as defaults."""
    from PIL import Image

    xdit = os.path.join(os.path.dirname(sys.executable), "xdit")
    result = subprocess.run(
        [xdit, "--model", f"cocodiff/{model}", "--ulysses_degree", "2", "--sp-backend", "cocodiff",
         "--prompt", "digit 3"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "cocodiff: ulysses group of 2" in output, output[-3000:]  # the backend ran, not stock
    pngs = sorted(Path(tmp_path).rglob("*.png"))
    assert len(pngs) == 1, (pngs, output[-2000:])
    image = np.asarray(Image.open(pngs[0]).convert("RGB"), dtype=np.float64) / 255
    assert image.shape == (digits.SIZE, digits.SIZE, 3)
    assert classifier.predict(image[None])[0] == 3
