"""The fp8 exchange formats of ``--cocodiff-compress``: one scale per row, W equal chunks (``fp8``),
each row packed with its scale (``fp8-slow``, over the slow level only)."""

import pytest
import torch

from cocodiff_xfuser.comm import compress
from cocodiff_xfuser.settings import Options, VMajorSettings


def test_pack_keeps_equal_chunks_and_bounds_the_error_per_row():
    # Rows spanning six orders of magnitude: a per-row scale keeps each within fp8's relative step.
    x = torch.randn(4, 12, 16) * torch.logspace(-3, 3, 12)[None, :, None]
    packed = compress.pack(x)
    assert packed.dtype == torch.uint8 and packed.shape == (4, compress.packed_bytes(12, 16))
    y = compress.unpack(packed, 12, 16, torch.float32)
    row_error = (y - x).abs().amax(-1) / x.abs().amax(-1)
    assert float(row_error.max()) <= 2**-4  # e4m3: 3 mantissa bits, half a step of rounding
    assert torch.equal(compress.unpack(compress.pack(torch.zeros(2, 3, 8)), 3, 8, torch.bfloat16), torch.zeros(2, 3, 8, dtype=torch.bfloat16))


def test_each_chunk_is_packed_on_its_own():
    # Moving packed chunks moves their values: what an all-to-all does to them.
    x = torch.randn(3, 5, 8)
    packed = compress.pack(x)
    assert torch.equal(compress.unpack(packed.flip(0), 5, 8, torch.float32), compress.unpack(packed, 5, 8, torch.float32).flip(0))


def test_pack_rows_keeps_each_row_with_its_scale():
    x = torch.randn(2, 7, 16) * torch.logspace(-3, 3, 7)[None, :, None]
    packed = compress.pack_rows(x)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 7, 16 + 4)
    y = compress.unpack_rows(packed, torch.float32)
    assert float(((y - x).abs().amax(-1) / x.abs().amax(-1)).max()) <= 2**-4
    # Rows moved with their bytes keep their values: what a sparse exchange does to them.
    assert torch.equal(compress.unpack_rows(packed[:, [3, 1]], torch.float32), y[:, [3, 1]])


def test_compression_and_v_major_exclude_each_other():
    with pytest.raises(ValueError, match="choose one"):
        Options(compress="fp8", v_major=VMajorSettings.load())
    with pytest.raises(ValueError, match="--cocodiff-compress 'int4'"):
        Options(compress="int4")


@pytest.mark.slow  # a job of both options: their codecs are tested above, fp8-slow's routings in tests/comm/test_exchanges.py
@pytest.mark.distributed
def test_fp8_exchanges_run_in_a_job_and_cut_the_bytes(tmp_path):
    """tiny-flux on 4 ranks (2x2) with V-First and --cocodiff-compress fp8 and fp8-slow against stock
    in one job: every cocodiff exchange ran packed over the slow level (a quarter of fp32's bytes,
    plus the scales; fp8-slow through the sparse exchange's routings) and the images stay close to
    stock's, closer where node-mates get exact values."""
    import json

    import numpy as np
    from skimage.metrics import peak_signal_noise_ratio

    from cocodiff_xfuser.tools import launcher
    from cocodiff_xfuser.tools.generate import output_dir
    from cocodiff_xfuser.tools.models import tiny as tiny_models
    from cocodiff_xfuser.tools.verify import Run

    model = "tiny-flux"
    tiny_models.ensure_fixture(model)
    settings = ("fp8", "fp8-slow")
    variants = tmp_path / "variants.json"
    variants.write_text(json.dumps({s: {"sp_backend": "cocodiff", "cocodiff_v_first": True, "cocodiff_compress": s} for s in settings}))
    run = Run(model=model, ulysses_degree=4, topology="2x2", v_first=True)
    launcher.torchrun(4, run.argv(("ulysses", *settings), tmp_path) + ["--variants", str(variants)], timeout=600)
    where = {b: output_dir(tmp_path, tiny_models.SPECS[model].model_id, b) for b in ("ulysses", *settings)}
    stock = np.load(where["ulysses"] / "images.npy")
    psnr = {}
    for setting in settings:
        ran = json.loads((where[setting] / "result.json").read_text())["ran"]
        assert ran["v_first_calls"] > 0 and not ran["fallbacks"], ran
        if setting == "fp8-slow":
            assert ran["exchanges"] and all(name.startswith("fp8-slow ") for name in ran["exchanges"]), ran
        saved = 1 - ran["slow_link_bytes"] / ran["slow_link_bytes_exact"]
        assert 0.65 < saved < 0.75, ran  # fp32 -> fp8 with a 4-byte scale per 16-channel row: 1 - 20/64
        ours = np.load(where[setting] / "images.npy")
        assert not np.array_equal(stock, ours)
        psnr[setting] = peak_signal_noise_ratio(stock, ours, data_range=1.0)
    assert psnr["fp8"] > 25 and psnr["fp8-slow"] > psnr["fp8"], psnr


def test_scales_round_the_same_on_every_device():
    # CUDA divides by a scalar through its reciprocal; the scales multiply by it on every device.
    x = torch.randn(4, 64, 128).bfloat16()
    amax = x.abs().amax(-1, keepdim=True).float()
    assert torch.equal(compress.pack(x)[:, 64 * 128 :].view(torch.float32).view(4, 64, 1), amax * torch.tensor(1 / 448))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_packs_the_cpus_bytes():
    x = torch.randn(4, 1, 1, 6, 576, 128, generator=torch.Generator().manual_seed(1)).bfloat16().reshape(4, -1, 128)
    assert torch.equal(compress.pack(x.cuda()).cpu(), compress.pack(x))
