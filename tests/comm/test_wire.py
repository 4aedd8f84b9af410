"""bf16 on the emulated wire (``COCODIFF_WIRE_DTYPE``): what a GPU job sends, stock's exchanges and
cocodiff's alike, so images stay bitwise comparable and the bytes counted are a GPU's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cocodiff_xfuser.comm import transport
from cocodiff_xfuser.tools import launcher
from cocodiff_xfuser.tools.fabric import wire
from cocodiff_xfuser.tools.generate import output_dir
from cocodiff_xfuser.tools.models import tiny as tiny_models
from cocodiff_xfuser.tools.verify import Run

# Exact V-Major (every changed token, as values): its sparse exchanges run, its image is stock's.
V_MAJOR_EXACT = {
    "sp_backend": "cocodiff", "cocodiff_v_major": "on", "cocodiff_v_major_policy": "threshold",
    "cocodiff_v_major_threshold": 0.0, "cocodiff_v_major_warmup_steps": 0, "cocodiff_v_major_residual_dtype": "none",
    "cocodiff_v_major_scope": "qkvo",
}
# id -> (ulysses, ring, topology, flags): Ulysses over both nodes (TAPA), and the ring across them.
LAYOUTS = {"u4r1": (4, 1, "2x2", ("--cocodiff_a2a", "hierarchical")), "u2r2": (2, 2, "2x2", ("--cocodiff_a2a", "flat-p2p"))}
MODELS = ("tiny-flux", "tiny-sd3")
BACKENDS = ("ulysses", "cocodiff", "cocodiff+vfirst", "vmajor0")


@pytest.mark.unit
def test_float32_payloads_cross_as_bf16_and_are_counted_so(monkeypatch):
    monkeypatch.setattr(transport, "_wire_float", torch.bfloat16)
    x = torch.tensor([1.0 + 2**-10, 3.0], dtype=torch.float32)
    assert transport.wire_values(x).tolist() == [1.0, 3.0] and transport.wire_values(x).dtype == torch.float32
    assert transport.on_wire(x).dtype == torch.bfloat16 and transport.wire_bytes(x) == 4
    codes = torch.zeros(4, dtype=torch.uint8)  # bytes (fp8 residuals, indices) travel as they are
    assert transport.on_wire(codes) is codes and transport.wire_bytes(codes) == 4
    monkeypatch.setattr(transport, "_wire_float", None)
    assert transport.wire_values(x) is x and transport.wire_bytes(x) == 8


class _Sent:
    """A point-to-point handle: complete, its buffer filled with what a peer sent."""

    def __init__(self, buffer: torch.Tensor, sent: torch.Tensor) -> None:
        self.buffer, self.sent = buffer, sent

    def wait(self) -> bool:
        self.buffer.copy_(self.sent)
        return True

    def is_completed(self) -> bool:
        return True


@pytest.mark.unit
def test_pipefusion_activations_cross_as_bf16_and_arrive_widened():
    """xfuser's pipeline sends narrowed to the wire's dtype, and its receives widened when waited for:
    what a float32 stage receives is the bf16 of what the previous stage sent; shapes (int64) pass as they are."""
    sent = []

    def send(self, tensor):
        sent.append(tensor)
        return _Sent(tensor, tensor)

    def receive(self, tensor):
        return _Sent(tensor, sent[-1])

    x = torch.tensor([1.0 + 2**-10, 3.0], dtype=torch.float32)
    wire._send_on_wire(send, torch.bfloat16)(None, x)
    assert sent[-1].dtype == torch.bfloat16
    into = torch.zeros(2, dtype=torch.float32)
    work = wire._receive_on_wire(receive, torch.bfloat16)(None, into)
    assert into.tolist() == [0.0, 0.0] and work.is_completed()
    assert work.wait() and into.tolist() == [1.0, 3.0] and into.dtype == torch.float32
    shape = torch.tensor([2, 3], dtype=torch.int64)
    wire._send_on_wire(send, torch.bfloat16)(None, shape)
    assert sent[-1] is shape


def _generate(layout: str, out: Path) -> Path:
    ulysses, ring, topology, flags = LAYOUTS[layout]
    run = Run(model=MODELS[0], ulysses_degree=ulysses, ring_degree=ring, topology=topology, seed=3, steps=3, extra=flags)
    (out / "variants.json").write_text(json.dumps({"vmajor0": V_MAJOR_EXACT}))
    argv = run.argv(BACKENDS, out) + ["--variants", str(out / "variants.json")]
    argv[argv.index("--model") + 1] = ",".join(tiny_models.SPECS[m].model_id for m in MODELS)
    launcher.torchrun(run.world_size, argv, env=wire.GPU_WIRE, timeout=900)
    return out


@pytest.fixture(scope="module")
def generated(at_first_use):
    for model in MODELS:
        tiny_models.ensure_fixture(model)
    return at_first_use(_generate)


def _read(out: Path, model: str, backend: str) -> tuple[np.ndarray, dict]:
    where = output_dir(out, tiny_models.SPECS[model].model_id, backend)
    return np.load(where / "images.npy"), json.loads((where / "result.json").read_text())["ran"]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [pytest.param("u4r1"), pytest.param("u2r2", marks=pytest.mark.slow)])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("backend", BACKENDS[1:])
def test_on_a_bf16_wire_cocodiff_is_still_bitwise_stock(generated, layout, model, backend):
    stock, stock_ran = _read(generated(layout), model, "ulysses")
    images, ran = _read(generated(layout), model, backend)
    assert np.array_equal(images, stock)
    assert set(stock_ran["exchanges"]) == {"stock"} and ran["exchanges"] and "stock" not in ran["exchanges"], ran
    assert ran["fallbacks"] == {} and ran["slow_link_bytes_exact"] > 0, ran
    if backend == "vmajor0":
        assert ran["v_major"]["tokens"] > 0 or ran["exchanges"].get("ring v-major"), ran
    else:  # lossless: what crosses the nodes is the exact exchange's bytes, counted at bf16's width
        assert ran["slow_link_bytes"] == ran["slow_link_bytes_exact"], ran
    if LAYOUTS[layout][1] > 1:
        assert ran["exchanges"].get("ring all-gather", 0) + ran["exchanges"].get("ring v-major", 0) > 0, ran
