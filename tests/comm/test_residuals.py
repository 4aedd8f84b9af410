"""Step residuals: the receiver's copy is the sender's reference, and error feedback keeps it close."""

import pytest
import torch

from cocodiff_xfuser.comm.residuals import apply, encode, row_bytes
from cocodiff_xfuser.tools import kernel_check


def test_the_receiver_holds_the_reference_and_rounding_errors_are_sent_later():
    torch.manual_seed(0)
    x = torch.randn(3, 8, 16)
    reference, held = x.clone(), x.clone()  # a full step: both hold the values
    every = torch.arange(8)
    for _ in range(6):  # adjacent steps: small changes, sent as fp8 residuals
        x = x + 0.05 * torch.randn_like(x)
        payload = encode(x, reference, every, 1, torch.float8_e4m3fn)
        assert payload.dtype == torch.float8_e4m3fn
        apply(held, payload, None, 1, is_residual=True)
        assert torch.equal(held, reference)
    # What fp8 rounds away at one step is sent at the next: the copy does not drift.
    assert (held - x).abs().max() < 0.01


def test_selected_rows_travel_alone_as_values_or_residuals():
    x, reference = torch.randn(2, 6, 4), torch.zeros(2, 6, 4)
    held = reference.clone()
    rows = torch.tensor([1, 4])
    payload = encode(x, reference, rows, 1, torch.bfloat16)
    assert payload.shape == (2, 2, 4)
    apply(held, payload, rows, 1, is_residual=True)
    assert torch.equal(held, reference) and torch.equal(held[:, [0, 2, 3, 5]], torch.zeros(2, 4, 4))
    values = encode(x, reference, rows, 1, None)  # values: the reference takes them
    apply(held, values, rows, 1, is_residual=False)
    assert torch.equal(held[:, rows], x[:, rows]) and torch.equal(reference, held)


def test_out_of_range_changes_are_clamped_not_nan():
    x, reference = torch.full((1, 2, 2), 1e6), torch.zeros(1, 2, 2)
    payload = encode(x, reference, torch.arange(2), 1, torch.float8_e4m3fn)
    assert not payload.float().isnan().any() and payload.float().max() == torch.finfo(torch.float8_e4m3fn).max


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_encodes_and_applies_the_cpus_bits():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 1, 1, 6, 576, 128, generator=g).bfloat16()
    reference = x + 0.02 * torch.randn(x.shape, generator=g).bfloat16()
    rows = torch.arange(100, 400)
    out = {}
    for device in ("cpu", "cuda"):
        ref, held = reference.clone().to(device), reference.clone().to(device)
        payload = encode(x.to(device), ref, rows.to(device), 4, torch.float8_e4m3fn)
        apply(held, payload, rows.to(device), 4, is_residual=True)
        out[device] = [t.cpu() for t in (payload.view(torch.uint8), ref, held)]
    assert all(torch.equal(a, b) for a, b in zip(out["cpu"], out["cuda"]))


def test_int4_residuals_keep_the_copies_equal_and_send_rounding_errors_later():
    torch.manual_seed(0)
    x = torch.randn(3, 8, 64)
    reference, held = x.clone(), x.clone()
    every = torch.arange(8)
    for _ in range(8):
        x = x + 0.05 * torch.randn_like(x)
        payload = encode(x, reference, every, 1, torch.int4)
        assert payload.dtype == torch.uint8 and payload.shape == (3, 8, row_bytes(64, torch.int4)) == (3, 8, 34)
        apply(held, payload, None, 1, is_residual=True)
        assert torch.equal(held, reference)
    assert (held - x).abs().max() < 0.02  # half a scale step: at most 1/8 of a group's largest change


@pytest.mark.distributed
def test_triton_kernels_write_the_references_bytes():
    """One launch encodes every plane's selected rows and updates the reference, one applies them
    (and the change sums, and the masks' decode): under the Triton interpreter, byte for byte what
    the torch reference does."""
    pytest.importorskip("triton")
    report = kernel_check.interpreted()
    assert report["triton_matches_reference"] is True, report
    assert report["interpreted"] and report["cases"] >= 10
