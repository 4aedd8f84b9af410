"""V-First processors: registration and installation, and bitwise equality with xfuser's own.

Families with a tiny pipeline (FLUX.1, SD3.5, Qwen-Image, Wan, PixArt) are compared end to end
by tests/test_equivalence.py (variant ``cocodiff+vfirst``). FLUX.2 and HunyuanVideo have none:
tests/workers/processors_worker.py runs their transformers under torchrun (gloo, CPU), once per
parallel layout. SD3's whole-text (``"rear"``) joint path needs an SP degree that does not
divide the text length, so it gets its own end-to-end run here.
"""

from __future__ import annotations

import importlib
import inspect
import os
from pathlib import Path

import pytest
import torch

from cocodiff_xfuser.processors import families
from cocodiff_xfuser.tools.launcher import torchrun

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "workers" / "processors_worker.py"
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
CASES = ["flux2", "flux2_fused", "hunyuan_video_split_text", "hunyuan_video_rear_text"]
LAYOUTS = {"u2": (2, 2, 1), "u2r2": (4, 2, 2)}  # id -> (ranks, ulysses, ring)

# Where xfuser 0.7.0 defines each processor we replace.
_XFUSER = "xfuser.model_executor"
STOCK_MODULES = {
    "xFuserFluxAttnProcessor": f"{_XFUSER}.models.transformers.transformer_flux",
    "xFuserFlux2AttnProcessor": f"{_XFUSER}.models.transformers.transformer_flux2",
    "xFuserFlux2ParallelSelfAttnProcessor": f"{_XFUSER}.models.transformers.transformer_flux2",
    "xFuserJointAttnProcessor2_0": f"{_XFUSER}.layers.attention_processor",
    "xFuserQwenDoubleStreamAttnProcessor": f"{_XFUSER}.models.transformers.transformer_qwen",
    "xFuserWanAttnProcessor": f"{_XFUSER}.models.transformers.transformer_wan",
    "xFuserAttnProcessor2_0": f"{_XFUSER}.layers.attention_processor",
    "xFuserHunyuanVideoAttnProcessor": f"{_XFUSER}.models.transformers.transformer_hunyuan_video",
}


# ------------------------------------------------------------------------------ registration


def test_every_family_is_registered():
    assert set(families.replacements()) == set(STOCK_MODULES)


@pytest.mark.parametrize("name", sorted(STOCK_MODULES))
def test_call_signature_matches_stock(name):
    """diffusers passes a processor only the keyword arguments its ``__call__`` names."""
    stock = getattr(importlib.import_module(STOCK_MODULES[name]), name)
    ours = families.replacements()[name]

    def params(cls):
        return [(p.name, p.kind, p.default) for p in inspect.signature(cls.__call__).parameters.values()]

    assert params(ours) == params(stock)


def _model(*processor_objects) -> torch.nn.Module:
    model = torch.nn.Module()
    for i, processor in enumerate(processor_objects):
        attention = torch.nn.Module()
        attention.processor = processor
        model.add_module(f"attn{i}", attention)
    return model


def test_install_swaps_known_processors_and_keeps_the_stock_one():
    stock = type("xFuserQwenDoubleStreamAttnProcessor", (), {})()
    other = type("SomeOtherProcessor", (), {})()
    model = _model(stock, other)
    first, second = object(), object()  # stand-ins for two jobs' exchangers
    assert families.install(model, first) == 1
    assert type(model.attn0.processor).__name__ == "QwenImageVFirstProcessor"
    assert model.attn0.processor.stock is stock and model.attn0.processor.exchanger is first
    assert model.attn1.processor is other
    installed = model.attn0.processor
    assert families.install(model, second) == 1  # a second load hook keeps the processor, with the new exchanger
    assert model.attn0.processor is installed and installed.exchanger is second


def _job(ring: bool = False):
    """A stand-in for a job's exchanger whose Ulysses group (else its ring) crosses nodes."""
    from types import SimpleNamespace

    from cocodiff_xfuser import padding

    slow = None if ring else SimpleNamespace(remote=(2, 3))
    layout = SimpleNamespace(clock_spans_world=ring, ring_far=(False, True) if ring else ())
    return SimpleNamespace(layout=layout, group=None, slow_level=slow, ring_remote=(1,) if ring else (), ring_group=None,
                           padding=padding.Padding())


def test_a_new_job_keeps_nothing_of_the_last_ones_v_major():
    """V-Major's clock, layers and hooks belong to the job that attached them: installing the same
    job again keeps them, another job's exchanger drops them (and attaches its own settings)."""
    from cocodiff_xfuser.settings import VMajorSettings

    model = _model(type("xFuserQwenDoubleStreamAttnProcessor", (), {})())
    first, second, third = _job(), _job(), _job(ring=True)
    families.install(model, first, VMajorSettings.load())
    processor = model.attn0.processor
    clock, layer = processor.clock, processor.v_major
    assert layer is not None and families.clocks([model]) == [clock]
    assert len(model._forward_pre_hooks) == len(model._forward_hooks) == 1  # the clock's tick and settle
    families.install(model, first)  # the same job again (padding's processors): its V-Major stays
    assert processor.clock is clock and processor.v_major is layer and len(model._forward_pre_hooks) == 1
    families.install(model, second)  # a new job without V-Major
    assert processor.exchanger is second and processor.clock is None and processor.v_major is None and processor.ring is None
    assert families.clocks([model]) == [] and not model._forward_pre_hooks and not model._forward_hooks
    families.install(model, third, VMajorSettings.load(warmup_steps=2))  # a new job with its own settings, on the ring
    assert processor.clock is not clock and processor.clock.settings.warmup_steps == 2 and processor.v_major is None
    assert len(model._forward_pre_hooks) == 1  # the clock's: the processors hand the ring its calls
    assert processor.ring.clock is processor.clock and processor.ring.remote == (1,)  # the processor's ring layer
    assert processor.clock.padding is third.padding  # the job's padding, which its stock steps read


def test_wan_cross_attention_keeps_the_stock_processor():
    from xfuser.model_executor.models.transformers import transformer_wan

    def wan(cross: bool):
        stock = type("xFuserWanAttnProcessor", (), {})()
        stock.is_cross_attention = cross
        stock.attention_function = transformer_wan.attention if cross else transformer_wan.USP
        return stock

    model = _model(wan(cross=False), wan(cross=True))
    assert families.install(model, object()) == 1
    assert type(model.attn0.processor).__name__ == "WanVFirstProcessor"
    assert type(model.attn1.processor).__name__ == "xFuserWanAttnProcessor"


def test_processors_of_wrapped_modules_are_ignored():
    """xfuser's layer wrappers run their own processor; the wrapped module's is never called."""
    from xfuser.model_executor.layers.base_layer import xFuserLayerBaseWrapper

    class Wrapper(xFuserLayerBaseWrapper):
        def forward(self, *args):
            raise NotImplementedError

    inner = _model(type("AttnProcessor2_0", (), {})()).attn0
    wrapper = Wrapper(inner)
    wrapper.processor = type("xFuserAttnProcessor2_0", (), {})()
    model = torch.nn.Module()
    model.attn = wrapper
    assert families.install(model, object()) == 1
    assert type(wrapper.processor).__name__ == "PixArtVFirstProcessor"
    assert type(inner.processor).__name__ == "AttnProcessor2_0"


def test_linear_slice_is_the_fused_projection_rows():
    from cocodiff_xfuser.processors import ulysses

    torch.manual_seed(0)
    fused = torch.nn.Linear(48, 3 * 32 + 80)
    x = torch.randn(2, 10, 48)
    full = fused(x)
    for start, stop in ((0, 32), (32, 64), (64, 96), (0, 64), (96, 176)):
        assert torch.equal(ulysses.linear_slice(fused, x, start, stop), full[..., start:stop])


# ------------------------------------------------------------ FLUX.2 / HunyuanVideo (torchrun)


@pytest.fixture(scope="module")
def reports() -> dict[str, str]:
    out = {}
    for layout, (ranks, ulysses, ring) in LAYOUTS.items():
        compiled = ["hunyuan_video_rear_text_compiled"] if ring == 1 else []  # a ring breaks stock's graph too
        argv = [str(WORKER), "--ulysses", str(ulysses), "--ring", str(ring), "--cases", ",".join([*CASES, "exchange_modules", *compiled])]
        out[layout] = torchrun(ranks, argv, env=ENV, timeout=600).stdout
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("case", CASES)
def test_v_first_is_bitwise_equal_to_stock(reports, layout, case):
    assert f"CASE {case} ok" in reports[layout], reports[layout]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_an_exchange_runs_code_in_at_most_six_product_modules(reports, layout):
    """From its start to its result, an exchange of a V-First layer (the worker records the modules
    with ``sys.setprofile`` over a FLUX.2 forward, on each algorithm the group can run)."""
    assert "CASE exchange_modules ok" in reports[layout], reports[layout]


@pytest.mark.slow  # a 4-rank job of its own; make test keeps the rule for flat and flat-p2p (above)
@pytest.mark.distributed
def test_an_exchange_across_nodes_runs_code_in_at_most_six_product_modules():
    """The same on Ulysses 4 over two emulated nodes, for TAPA and the PXN-like relay."""
    argv = [str(WORKER), "--ulysses", "4", "--cases", "exchange_modules"]
    out = torchrun(4, argv, env=ENV, timeout=300).stdout
    assert "CASE exchange_modules ok" in out and "EXCHANGE MODULES flat-pxn" in out, out


@pytest.mark.distributed
def test_compiled_joint_path_keeps_one_graph_and_stocks_bits(reports):
    """HunyuanVideo's whole-text (``"rear"``) joint attention compiled with xDiT's overlap passes,
    Ulysses 2: V-First's exchanges are functional collectives of the graph (the joint tokens' layout
    traced around them), so it breaks the graph nowhere compiled stock does not, runs no host work,
    and gives compiled stock's output bitwise (SD3 at a text length the degree does not divide takes
    this path); the graph projects every Q and K while V's exchange is in flight, as the eager layer does."""
    assert "CASE hunyuan_video_rear_text_compiled ok" in reports["u2"], reports["u2"]


# ------------------------------------------------------------------ SD3 whole-text joint path


@pytest.mark.distributed
def test_sd3_whole_text_joint_attention_is_bitwise_equal():
    """Ulysses 2 x ring 3: 32 text tokens do not split over 6 ranks, so every rank keeps the
    text and attends it with the ``"rear"`` joint strategy (across the ring steps)."""
    from cocodiff_xfuser.tools import verify

    run = verify.Run(model="tiny-sd3", ulysses_degree=2, ring_degree=3, topology="3x2", height=48, width=48, v_first=True)
    report = verify.verify(run, timeout=600)
    assert report["bitwise_equal"], report
