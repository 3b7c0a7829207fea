"""Mask builders and conversions against literal expectations and torch's own helpers."""

from __future__ import annotations

import torch
from torch import nn

from mmattn import Tokens, masks


def test_padding_mask_matches_literal():
    got = masks.padding_mask(torch.tensor([2, 0, 3]), max_len=4)
    assert got.tolist() == [[True, True, False, False], [False] * 4, [True, True, True, False]]


def test_causal_mask_matches_torch_generate_square_subsequent_mask():
    torch_mask = nn.Transformer.generate_square_subsequent_mask(6)  # float, -inf above diag
    assert torch.equal(masks.causal_mask(6), torch_mask == 0)
    assert torch.equal(masks.to_additive(masks.causal_mask(6)), torch_mask)


def test_band_mask_matches_loop():
    for causal in (False, True):
        got = masks.band_mask(7, 2, k_len=9, causal=causal)
        for i in range(7):
            for j in range(9):
                want = abs(i - j) <= 2 and (j <= i or not causal)
                assert bool(got[i, j]) is want


def test_conversions_are_lossless_round_trips():
    allowed = torch.rand(3, 4, 5) > 0.5
    assert torch.equal(masks.to_bool(masks.to_additive(allowed)), allowed)
    assert torch.equal(masks.invert(masks.invert(allowed)), allowed)
    tokens = Tokens(torch.randn(3, 5, 2), allowed[:, 0])
    assert torch.equal(tokens.key_padding_mask, masks.invert(tokens.mask))


def test_to_dense_batch_mask_is_the_tokens_direction():
    """torch_geometric's to_dense_batch returns True at real nodes, like Tokens.mask."""
    from torch_geometric.utils import to_dense_batch

    x = torch.randn(7, 3)
    batch = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    dense, real = to_dense_batch(x, batch)
    assert torch.equal(real, masks.padding_mask(torch.tensor([3, 2, 2])))
    tokens = Tokens(dense, real)
    assert tokens.lengths.tolist() == [3, 2, 2]


def test_merge_masks_equals_torch_merge():
    """Merged SDPA-direction mask equals nn.MultiheadAttention.merge_masks, flipped."""
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    kpm = torch.rand(3, 5) > 0.6
    attn = torch.rand(5, 5) > 0.6  # torch's merge_masks handles self-attention only
    ours = masks.merge_masks(kpm, attn, batch_size=3, num_heads=2, dtype=torch.float32)
    ref, _ = mha.merge_masks(attn, kpm, torch.randn(3, 5, 8))  # additive (b, h, i, j)
    assert torch.equal(ours.expand(3, 2, 5, 5), ref == 0)
    float_attn = torch.randn(4, 5)
    ours = masks.merge_masks(kpm, float_attn, batch_size=3, num_heads=2, dtype=torch.float32)
    expected = float_attn.masked_fill(kpm[:, None, None, :], float("-inf"))
    assert torch.equal(ours.expand(3, 2, 4, 5), expected.expand(3, 2, 4, 5))


def test_expand_heads_matches_torch_3d_layout():
    per_sample = torch.rand(2, 3, 4) > 0.5
    stacked = masks.expand_heads(per_sample, 3)
    assert stacked.shape == (6, 3, 4)
    for b in range(2):
        for h in range(3):
            assert torch.equal(stacked[b * 3 + h], per_sample[b])
