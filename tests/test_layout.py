"""The job's layout without a process group: the share of an exchange over the slow links, ring
peers on other nodes, and an uneven layout refused in one line."""

from __future__ import annotations

import re

import pytest

from cocodiff_xfuser.comm.topology import Topology
from cocodiff_xfuser.layout import Layout


def _layout(spec: str, groups: list[list[int]], rank: int, rings: list[list[int]] | None = None) -> Layout:
    """The layout of Ulysses ``groups`` (and ``rings``) covering the world, seen from ``rank``."""
    def by_rank(gs):
        return tuple(tuple(next(g for g in gs if r in g)) for r in range(sum(map(len, gs))))

    return Layout(Topology.parse(spec), by_rank(groups), None if rings is None else by_rank(rings), rank)


@pytest.mark.parametrize(
    "spec, groups, rank, share",
    [
        ("2x2", [[0, 1, 2, 3]], 0, 0.5),  # ranks 2 and 3 are on the other node
        ("2x2", [[0, 2], [1, 3]], 2, 0.5),
        ("2x2", [[0, 1], [2, 3]], 1, 0.0),  # one node: nothing crosses the slow level
        ("4x2", [list(range(8))], 5, 0.75),
        ("2x2x2", [list(range(8))], 0, 0.5),
        ("1x4", [[0, 1, 2, 3]], 0, 0.0),
    ],
)
def test_share_of_an_exchange_sent_over_the_slowest_level(spec, groups, rank, share):
    assert _layout(spec, groups, rank).slow_share == share


def test_ring_peers_on_other_nodes_and_the_clocks_group():
    layout = _layout("2x2", [[0, 1], [2, 3]], 3, rings=[[0, 2], [1, 3]])
    assert layout.ring_remote == (0,) and not layout.ulysses_crosses and layout.clock_spans_world
    layout.check()


@pytest.mark.parametrize("spec, groups, rings, message", [
    # 3 nodes of 2, Ulysses 2 across ranks (0, 1), (2, 3), (4, 5) but the second pair split: one group crosses.
    ("3x2", [[0, 1], [2, 4], [3, 5]], None, "Ulysses groups [2, 4], [3, 5] span nodes, [0, 1] do not"),
    ("4x1", [[0, 1], [2, 3]], [[0, 1, 2], [3]], "rings [0, 1, 2] span nodes, [3] do not"),
])
def test_an_uneven_layout_is_one_line(spec, groups, rings, message):
    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        _layout(spec, groups, 0, rings).check()
    assert "\n" not in str(refused.value) and str(refused.value).startswith("cocodiff: uneven layout")
