"""V-First processors vs xfuser's own, on models with no tiny pipeline (FLUX.2, HunyuanVideo).

Usage: torchrun --nproc-per-node N processors_worker.py --ulysses U --ring R [--cases a,b]

Each case builds a small diffusers transformer from a seeded config, wrapped the way xfuser's
runner does (its transformer wrapper installs xfuser's processors), and runs one forward with
xfuser's processors and stock Ulysses exchanges, then one with the V-First processors installed
over the active cocodiff backend. The outputs must be bitwise equal, and the V-First path must
actually have run (its V exchanges are counted). Rank 0 prints ``CASE <name> ok`` per case.
"""

from __future__ import annotations

import argparse
import collections
import logging

import torch
import torch.distributed as dist

from cocodiff_xfuser.tools import same_bits
from inductor_code import exchanges_in_flight, host_work  # beside this script

RANK = 0
V_EXCHANGES: collections.Counter = collections.Counter()


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(f"rank {RANK}: {msg}")


def setup(ulysses: int, ring: int) -> None:
    """xfuser's distributed and model-parallel state, as the runner builds it (gloo on CPU)."""
    global RANK
    from xfuser import xFuserArgs
    from xfuser.core.distributed import init_distributed_environment, initialize_model_parallel

    from cocodiff_xfuser.tools import xfuser_state

    init_distributed_environment()
    RANK = dist.get_rank()
    initialize_model_parallel(sequence_parallel_degree=ulysses * ring, ulysses_degree=ulysses, ring_degree=ring)
    engine_config, _ = xFuserArgs(model="tiny", ulysses_degree=ulysses, ring_degree=ring).create_config()
    xfuser_state.install(engine_config)

    from cocodiff_xfuser.processors import ulysses as core

    start = core.start_input_exchange

    def counting(*args, label, **kwargs):
        V_EXCHANGES[label] += 1
        return start(*args, label=label, **kwargs)

    core.start_input_exchange = counting


def use_backend(v_first: bool, a2a: str = "flat-p2p", topology: str | None = None) -> None:
    """Stock Ulysses (xfuser's own exchanges), or cocodiff with V-First (on the fair flat exchange by
    default: what is compared is the processors, and every exchange is exact; with a ring, its K/V
    through cocodiff too)."""
    from xfuser.core.distributed import get_ring_parallel_world_size, get_sp_group

    from cocodiff_xfuser.settings import Options
    from cocodiff_xfuser.xfuser import job

    if v_first:
        ring = get_sp_group().ring_group if get_ring_parallel_world_size() > 1 else None
        job.start(get_sp_group().ulysses_group, Options(v_first=True, a2a=a2a, topology=topology), ring)
    else:
        job.end()


def compare(name: str, build, inputs, expected_v: set[str]) -> None:
    """Forward ``build()`` on ``inputs`` with xfuser's processors, then with V-First ones."""
    from xfuser.core.distributed import get_ring_parallel_world_size

    from cocodiff_xfuser import commstats
    from cocodiff_xfuser.processors import families
    from cocodiff_xfuser.xfuser import job

    outputs = []
    for v_first in (False, True):
        use_backend(v_first)
        torch.manual_seed(0)  # same weights on every rank and in both runs
        model = build().eval()
        if v_first:
            installed = families.install(model, job.exchanger())
            check(installed > 0, f"{name}: no V-First processor installed")
        V_EXCHANGES.clear()
        rings = commstats.ran()["exchanges"].get("ring all-gather", 0)
        with torch.no_grad():
            outputs.append(model(**inputs)[0])
        rings = commstats.ran()["exchanges"].get("ring all-gather", 0) - rings
        if v_first:
            check(set(V_EXCHANGES) == expected_v, f"{name}: V exchanges {dict(V_EXCHANGES)}, expected {expected_v}")
            check((rings > 0) == (get_ring_parallel_world_size() > 1), f"{name}: {rings} ring K/V exchanges through cocodiff")
        else:
            check(not V_EXCHANGES, f"{name}: stock run went through V-First: {dict(V_EXCHANGES)}")
    stock, ours = outputs
    check(same_bits(stock, ours), f"{name}: V-First differs from stock, max abs diff {(stock - ours).abs().max()}")
    check(bool(torch.isfinite(stock).all()) and stock.abs().max() > 0, f"{name}: degenerate output")
    use_backend(False)


# ------------------------------------------------------------------------------------- FLUX.2


def flux2(fused: bool = False):
    from xfuser.model_executor.models.transformers.transformer_flux2 import xFuserFlux2Transformer2DWrapper

    def build():
        model = xFuserFlux2Transformer2DWrapper(
            patch_size=1,
            in_channels=16,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=24,
            timestep_guidance_channels=32,
            # mlp_hidden_dim 176: the SwiGLU halves are not a multiple of the vector width, so
            # an elementwise kernel would show a different memory layout than stock's.
            mlp_ratio=2.75,
            axes_dims_rope=(4, 4, 4, 4),
        )
        if fused:
            for block in model.transformer_blocks:
                block.attn.fuse_projections()
        return model

    gen = torch.Generator().manual_seed(1)
    height, width, text = 4, 6, 8  # token counts divisible by the SP degree (2 or 4)
    img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(height), torch.arange(width), torch.arange(1))
    txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(text))
    inputs = {
        "hidden_states": torch.randn(1, height * width, 16, generator=gen),
        "encoder_hidden_states": torch.randn(1, text, 24, generator=gen),
        "timestep": torch.tensor([0.7]),
        "img_ids": img_ids.unsqueeze(0).float(),
        "txt_ids": txt_ids.unsqueeze(0).float(),
        "guidance": torch.tensor([3.5]),
        "return_dict": False,
    }
    return build, inputs, {"flux2.double.v", "flux2.single.v"}


def case_flux2() -> None:
    compare("flux2", *flux2())


def case_flux2_fused() -> None:
    compare("flux2 fused QKV", *flux2(fused=True))


# ------------------------------------------------------------------------------- HunyuanVideo


def hunyuan_video(valid_text: int):
    """``valid_text`` unmasked text tokens: divisible by the SP degree, the text is split over
    the ranks; otherwise every rank keeps it whole (``"rear"`` joint attention)."""
    from xfuser.model_executor.models.transformers.transformer_hunyuan_video import (
        xFuserHunyuanVideoTransformer3DWrapper,
    )

    config = {
        "in_channels": 4,
        "out_channels": 4,
        "num_attention_heads": 4,
        "attention_head_dim": 16,
        "num_layers": 1,
        "num_single_layers": 1,
        "num_refiner_layers": 1,
        "mlp_ratio": 2.0,
        "patch_size": 1,
        "patch_size_t": 1,
        "text_embed_dim": 24,
        "pooled_projection_dim": 16,
        "rope_axes_dim": (4, 6, 6),
    }

    def build():
        return xFuserHunyuanVideoTransformer3DWrapper.from_config(config)

    gen = torch.Generator().manual_seed(2)
    text = 12
    mask = torch.zeros(1, text, dtype=torch.long)
    mask[:, :valid_text] = 1
    inputs = {
        "hidden_states": torch.randn(1, 4, 2, 4, 4, generator=gen),
        "timestep": torch.tensor([700]),
        "encoder_hidden_states": torch.randn(1, text, 24, generator=gen),
        "encoder_attention_mask": mask,
        "pooled_projections": torch.randn(1, 16, generator=gen),
        "guidance": torch.tensor([6000.0]),
        "return_dict": False,
    }
    return build, inputs, {"hunyuan_video.dual.v", "hunyuan_video.single.v"}


def case_hunyuan_video_split_text() -> None:
    from xfuser.core.distributed import get_sequence_parallel_world_size

    compare("hunyuan_video split text", *hunyuan_video(valid_text=2 * get_sequence_parallel_world_size()))


def case_hunyuan_video_rear_text() -> None:
    from xfuser.core.distributed import get_runtime_state, get_sequence_parallel_world_size

    compare("hunyuan_video whole text", *hunyuan_video(valid_text=2 * get_sequence_parallel_world_size() + 1))
    check(not get_runtime_state().split_text_embed_in_sp, "the text was split: the joint path did not run")


def case_hunyuan_video_rear_text_compiled() -> None:
    """The whole-text joint path under ``torch.compile``, with xDiT's compute/communication overlap
    passes: V-First's exchanges are functional collectives of the graph (the joint tokens' layout
    traced around them), so V-First breaks the graph nowhere that compiled stock does not, holds no
    host work, and gives compiled stock's output; Q and K are projected while V's exchange is in flight."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code
    from xfuser.core.distributed import get_runtime_state, get_sequence_parallel_world_size
    from xfuser.model_executor.models.runner_models.base_model import xFuserModel

    from cocodiff_xfuser import commstats, compat
    from cocodiff_xfuser.platform import detect
    from cocodiff_xfuser.processors import families
    from cocodiff_xfuser.xfuser import job

    build, inputs, _ = hunyuan_video(valid_text=2 * get_sequence_parallel_world_size() + 1)
    xFuserModel._enable_compute_comm_overlap(None)  # the inductor passes xDiT's runner turns on (it reads no state)
    outputs, breaks = [], []
    for v_first in (False, True):
        use_backend(v_first)
        compat.use_switches(v_first, True, not detect().is_cuda)  # what a compiled job of this backend installs
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = build().eval()
        if v_first:
            check(families.install(model, job.exchanger()) > 0, "compiled hunyuan_video: no V-First processor installed")
        calls = commstats.ran()["v_first_calls"]
        with torch.no_grad():
            out, code = run_and_get_code(torch.compile(model), **inputs)
        outputs.append(out[0])
        breaks.append(set(counters["graph_break"]))
        check(host_work(code) == [], f"compiled hunyuan_video: host work in the graph: {host_work(code)}")
        if v_first:
            # Per layer V's, Q's, K's and the output's exchange (the query carries the text); while V's is
            # in flight, the dual-stream layer projects at least four (the latent's and the text's Q and
            # K), the single-stream layer two.
            in_flight = exchanges_in_flight(code)
            check(len(in_flight) == 8 and in_flight[0] >= 4 and in_flight[4] >= 2,
                  f"compiled hunyuan_video: matrix products while each exchange is in flight: {in_flight}")
        ran = commstats.ran()["v_first_calls"] - calls
        check((ran > 0) == v_first, f"compiled hunyuan_video: {ran} V-First calls")
    compat.use_switches(True, False, not detect().is_cuda)  # every patch checks at run time again, as before
    use_backend(False)
    check(not get_runtime_state().split_text_embed_in_sp, "the text was split: the joint path did not run")
    check(breaks[1] <= breaks[0], f"compiled hunyuan_video: V-First's graph breaks {breaks[1] - breaks[0]}")
    stock, ours = outputs
    check(same_bits(stock, ours), f"compiled hunyuan_video: V-First differs from stock, max abs diff {(stock - ours).abs().max()}")


# ------------------------------------------------------------------------- one exchange's reach

#: The most product modules one exchange may run code in, from its start to its result (the
#: exchanger, the autotune, the algorithm, the transport, faults, the counters, and for an input
#: exchange the head-block layout it writes in send order).
MAX_EXCHANGE_MODULES = 7


def exchange_modules(run) -> dict[str, set[str]]:
    """Per exchange started while ``run()`` runs, the product modules it ran code in from its start
    to its result (every call into the exchanger that starts, advances or waits for it), as paths
    inside the package; keyed by the exchange's label and algorithm (several of one kind: their union)."""
    import os
    import sys

    import cocodiff_xfuser
    from cocodiff_xfuser.exchanger import Exchange

    root = os.path.dirname(cocodiff_xfuser.__file__) + os.sep
    exchanger = os.path.join(root, "exchanger.py")
    # The functional collectives' path (what a graph holds, and eager runs): one call, the whole
    # exchange but for its wait where it is read, in the same module.
    functional = (os.path.join(root, "ulysses_collectives.py"), "all_to_all")
    # Keyed by the exchange object itself (kept alive, so that no later one reuses its identity).
    per_exchange: dict[object, set[str]] = {}
    names: dict[object, str] = {}
    entry: list = [None, set()]  # the outermost exchanger frame running now, and the modules it reached

    def profile(frame, event, arg) -> None:
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(root):
            if entry[0] is None and (name == exchanger or (name, frame.f_code.co_name) == functional):
                entry[0], entry[1] = frame, set()
            if entry[0] is not None:
                entry[1].add(name[len(root):])
        elif event == "return" and frame is entry[0]:
            entry[0] = None
            owner = frame.f_locals.get("self")
            key = arg if isinstance(arg, Exchange) else owner if isinstance(owner, Exchange) else None
            if key is None and frame.f_code.co_name == "all_to_all":
                key = ("blocking", len(per_exchange))  # one call is the whole exchange
            if key is None:
                return  # not an exchange (the layouts, a rotater's creation)
            per_exchange.setdefault(key, set()).update(entry[1])
            if isinstance(key, Exchange):
                names[key] = f"{key.label} ({key.algorithm})"
            names.setdefault(key, f"{frame.f_locals.get('label')} (blocking)")

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    by_kind: dict[str, set[str]] = {}
    for key, modules in per_exchange.items():
        by_kind.setdefault(names[key], set()).update(modules)
    return by_kind


def case_exchange_modules() -> None:
    """Each exchange of a FLUX.2 forward under V-First (V's early exchange, Q/K's, the output's, the
    ring's K/V with a ring), on each algorithm the Ulysses group can run (2 ranks: the flat ones; 4
    ranks over two emulated nodes: TAPA and the PXN-like relay), runs code in at most
    MAX_EXCHANGE_MODULES product modules."""
    from xfuser.core.distributed import get_ulysses_parallel_world_size

    from cocodiff_xfuser.processors import families
    from cocodiff_xfuser.xfuser import job

    build, inputs, expected_v = flux2()
    across = get_ulysses_parallel_world_size() == 4
    for a2a in ("hierarchical", "flat-pxn") if across else ("flat-p2p", "flat"):
        use_backend(True, a2a, "2x2" if across else None)
        torch.manual_seed(0)
        model = build().eval()
        families.install(model, job.exchanger())
        with torch.no_grad():
            model(**inputs)  # first use: sub-groups and the like
            V_EXCHANGES.clear()
            kinds = exchange_modules(lambda: model(**inputs))
        check(set(V_EXCHANGES) == expected_v, f"{a2a}: V exchanges {dict(V_EXCHANGES)}, expected {expected_v}")
        widest = max(kinds.values(), key=len)
        check(len(widest) <= MAX_EXCHANGE_MODULES, f"{a2a}: an exchange ran code in {len(widest)} modules: {kinds}")
        if RANK == 0:
            for kind, modules in sorted(kinds.items()):
                print(f"EXCHANGE MODULES {a2a}: {kind}: {len(modules)}: {' '.join(sorted(modules))}", flush=True)
    use_backend(False)


CASES = {
    "flux2": case_flux2,
    "flux2_fused": case_flux2_fused,
    "hunyuan_video_split_text": case_hunyuan_video_split_text,
    "hunyuan_video_rear_text": case_hunyuan_video_rear_text,
    "hunyuan_video_rear_text_compiled": case_hunyuan_video_rear_text_compiled,
    "exchange_modules": case_exchange_modules,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ulysses", type=int, required=True)
    parser.add_argument("--ring", type=int, default=1)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    setup(args.ulysses, args.ring)
    for name in args.cases.split(","):
        CASES[name]()
        dist.barrier()
        if RANK == 0:
            print(f"CASE {name} ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
