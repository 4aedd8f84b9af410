"""What ran, counted (cocodiff_xfuser/commstats.py): a compiled graph counts what it runs when it is
traced, and its runs on the device, with no host work per run."""

from __future__ import annotations

import torch

from cocodiff_xfuser import commstats


class _Phase:
    phase = "first"


def test_a_compiled_graph_counts_its_runs_per_graph_across_recompiles():
    # Two graphs of one function (a guard on the phase, as V-Major's step phases have): each counts
    # what it traced, times its own runs; eager code counts as it runs.
    state = _Phase()

    def layer(x: torch.Tensor) -> torch.Tensor:
        commstats.traced("count_exchange", "flat", state.phase, 10, 20)
        if state.phase == "first":
            commstats.traced("count_v_first_call")
            return x + 1
        return x * 2

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)  # (inductor compiles in worker processes)
    torch._dynamo.reset()
    commstats.reset_ran()
    try:
        x = torch.ones(4)
        for phase, runs in (("first", 3), ("sparse", 5), ("first", 2)):
            state.phase = phase
            for _ in range(runs):
                compiled(x)
        state.phase = "sparse"
        layer(x)  # eagerly: counted now
        ran = commstats.ran()
        assert ran["labels"] == {"first": 5, "sparse": 6}, ran
        assert ran["exchanges"] == {"flat": 11} and ran["v_first_calls"] == 5, ran
        assert ran["slow_link_bytes"] == 110 and ran["slow_link_bytes_exact"] == 220, ran
        commstats.reset_ran()  # the graphs' runs too
        compiled(x)
        assert commstats.ran()["labels"] == {"sparse": 1}
    finally:
        torch._dynamo.reset()
        commstats.reset_ran()


def test_a_count_that_a_graph_break_leaves_to_run_is_counted_then():
    # Sizes dynamo makes dynamic cannot be a trace-time constant: the count breaks the graph, and the
    # call runs, counted as eager code counts.
    def layer(x: torch.Tensor) -> torch.Tensor:
        commstats.traced("count_exchange", "flat", "dynamic", x.shape[0], x.shape[0])
        return x + 1

    compiled = torch.compile(layer, backend="aot_eager", dynamic=True)
    torch._dynamo.reset()
    commstats.reset_ran()
    try:
        for n in (3, 4, 5):
            compiled(torch.ones(n))
        ran = commstats.ran()
        assert ran["labels"] == {"dynamic": 3} and ran["slow_link_bytes"] == 12, ran
    finally:
        torch._dynamo.reset()
        commstats.reset_ran()
