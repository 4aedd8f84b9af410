"""Backend helpers that need no process group."""

from __future__ import annotations

import pytest

from cocodiff_xfuser.backend import _slow_link_share
from cocodiff_xfuser.comm.topology import Topology


@pytest.mark.parametrize(
    "spec, group, rank, share",
    [
        ("2x2", [0, 1, 2, 3], 0, 0.5),  # ranks 2 and 3 are on the other node
        ("2x2", [0, 2], 2, 0.5),
        ("2x2", [0, 1], 1, 0.0),  # one node: nothing crosses the slow level
        ("4x2", list(range(8)), 5, 0.75),
        ("2x2x2", list(range(8)), 0, 0.5),
        ("1x4", [0, 1, 2, 3], 0, 0.0),
    ],
)
def test_share_of_an_exchange_sent_over_the_slowest_level(spec, group, rank, share):
    assert _slow_link_share(Topology.parse(spec), group, rank) == share
