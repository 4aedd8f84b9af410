"""The Ulysses layouts: one pass into the order an exchange sends, and back to attention's layout."""

from __future__ import annotations

import torch

from cocodiff_xfuser import commstats
from cocodiff_xfuser.ulysses_layout import heads, sequence


def _qk(b=2, h=12, s=5, d=4):
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(b, h, s, d, generator=gen).to(torch.bfloat16) for _ in range(2))


def test_heads_destination_major_is_xfusers_layout_in_one_pass():
    q, k = _qk()
    world = 4
    want = torch.stack((q, k)).view(2, 2, world, 3, 5, 4).permute(2, 0, 1, 3, 4, 5).contiguous()
    before = commstats.ran()["copied_bytes"]
    got = heads((q, k), (world,), (0,))
    assert torch.equal(got, want) and got.is_contiguous()
    assert commstats.ran()["copied_bytes"] - before == want.numel() * want.element_size()


def test_heads_in_level_order_is_the_destination_major_layout_permuted():
    q, k = _qk()
    canonical = heads((q, k), (2, 2), (0, 1))
    inner_first = heads((q, k), (2, 2), (1, 0))
    assert torch.equal(inner_first, canonical.permute(1, 0, 2, 3, 4, 5, 6))
    three = heads((q, k), (2, 1, 2), (2, 0, 1))
    assert torch.equal(three.reshape(-1), canonical.view(2, 1, 2, -1).permute(2, 0, 1, 3).reshape(-1))


def test_sequence_is_xfusers_output_layout():
    q, k = _qk()
    exchanged = heads((q, k), (4,), (0,))  # any [W, n, b, h/W, s, d] tensor
    want = exchanged.permute(1, 2, 3, 0, 4, 5).reshape(2, 2, 3, 4 * 5, 4)
    got = sequence(exchanged, 2)
    assert len(got) == 2 and all(torch.equal(g, w) for g, w in zip(got, want))
