"""The Ulysses layouts, each written once: one pass into the order an exchange sends, back to
attention's layout, and the output's both ways (xfuser's, and V-Major's destination-major one)."""

from __future__ import annotations

import torch

from cocodiff_xfuser.ulysses_layout import heads, output_blocks, output_heads, output_stacked, output_unstacked, sequence


def _qk(b=2, h=12, s=5, d=4):
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(b, h, s, d, generator=gen).to(torch.bfloat16) for _ in range(2))


def test_heads_destination_major_is_xfusers_layout_in_one_pass():
    q, k = _qk()
    world = 4
    want = torch.stack((q, k)).view(2, 2, world, 3, 5, 4).permute(2, 0, 1, 3, 4, 5).contiguous()
    got = heads((q, k), (world,), (0,))
    assert torch.equal(got, want) and got.is_contiguous()


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
    got = sequence(exchanged)
    assert len(got) == 2 and all(torch.equal(g, w) for g, w in zip(got, want))
    assert got[0].untyped_storage().data_ptr() != got[1].untyped_storage().data_ptr()  # none a view of another


def test_the_output_layouts_are_xfusers_and_v_majors():
    world, b, local_heads, s, d = 4, 2, 3, 5, 4
    out = torch.randn(b, local_heads, world * s, d, generator=torch.Generator().manual_seed(1))  # head-sharded
    blocks = output_blocks(out)
    assert torch.equal(blocks, out.permute(2, 0, 1, 3).contiguous()) and blocks.is_contiguous()
    # xfuser's _ft_c_output_all_to_all read back, its padded heads past `heads` cut.
    want = blocks.reshape(world, s, b, local_heads, d).permute(2, 0, 3, 1, 4).reshape(b, world * local_heads, s, d)
    assert torch.equal(output_heads(blocks, world, world * local_heads), want)
    assert torch.equal(output_heads(blocks, world, 10), want[:, :10])
    stacked = output_stacked(out, world)  # [W, 1, b, h/W, s, d]: token block j for rank j
    assert stacked.shape == (world, 1, b, local_heads, s, d) and stacked.is_contiguous()
    assert torch.equal(stacked[1, 0], out[:, :, s:2 * s])
    assert torch.equal(output_unstacked(stacked, 11), stacked.squeeze(1).transpose(0, 1).reshape(b, -1, s, d)[:, :11])
