"""Tokens: properties, device moves and concatenation."""

from __future__ import annotations

import torch

from mmattn import Tokens


def test_properties():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    t = Tokens(torch.randn(2, 3, 4), mask, {"grid": (1, 3)})
    assert (t.batch_size, t.length, t.dim) == (2, 3, 4)
    assert t.lengths.tolist() == [2, 3]
    assert torch.equal(t.key_padding_mask, ~mask)
    assert Tokens(torch.randn(2, 3, 4)).lengths.tolist() == [3, 3]
    assert Tokens(torch.randn(2, 3, 4)).key_padding_mask is None


def test_to_casts_x_but_not_mask(device):
    t = Tokens(torch.randn(2, 3, 4), torch.ones(2, 3, dtype=torch.bool), {"a": 1})
    moved = t.to(device, torch.float64)
    assert moved.x.dtype == torch.float64 and moved.mask.dtype == torch.bool
    assert moved.x.device.type == device and moved.mask.device.type == device
    assert moved.meta == {"a": 1}


def test_cat_concatenates_masks_and_records_spans():
    a = Tokens(torch.randn(2, 3, 4), torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool))
    b = Tokens(torch.randn(2, 2, 4), meta={"hop": 160})
    both = Tokens.cat({"text": a, "audio": b})
    assert torch.equal(both.x, torch.cat([a.x, b.x], dim=1))
    assert both.mask.tolist() == [[1, 1, 0, 1, 1], [1, 1, 1, 1, 1]]
    assert both.meta["spans"] == {"text": (0, 3), "audio": (3, 5)}
    assert both.meta["audio"] == {"hop": 160}
    assert Tokens.cat([b, b]).mask is None


def test_replace_keeps_mask():
    t = Tokens(torch.randn(1, 2, 3), torch.tensor([[True, False]]))
    r = t.replace(torch.zeros(1, 2, 3), note="x")
    assert r.mask is t.mask and r.meta["note"] == "x" and (r.x == 0).all()
