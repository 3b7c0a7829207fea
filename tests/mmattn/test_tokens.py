"""Tokens: properties, device moves, concatenation, and the meta that pack() moves."""

from __future__ import annotations

import torch

from mmattn import Tokens
from mmattn import patterns as P


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


def issue_tokens() -> Tokens:
    text = Tokens(torch.randn(2, 3, 8), torch.tensor([[1, 1, 1], [1, 0, 0]]).bool())
    return Tokens.cat({"text": text, "image": Tokens(torch.randn(2, 2, 8))})


def test_pack_moves_spans_around_the_real_tokens():
    """Item 1 of issue 36: after packing, item 1 is text, image, image (no padding between)."""
    packed = issue_tokens().pack()
    spans = {name: [b.tolist() for b in bounds] for name, bounds in packed.meta["spans"].items()}
    assert spans == {"text": [[0, 0], [3, 1]], "image": [[3, 1], [5, 3]]}
    # the issue's example: only the text token of item 1 is text (it sees the 3 real ones)
    rows = P.modality("text").dense(packed)[1].int().tolist()
    assert rows == [[1, 1, 1, 0, 0]] + [[0] * 5] * 4
    # spans already per item (a packed cat, unpacked) are moved the same way
    again = packed.unpack().pack()
    assert {k: [b.tolist() for b in v] for k, v in again.meta["spans"].items()} == spans


def test_pack_moves_per_token_tensors_to_the_unpacked_positions():
    mask = torch.tensor([[1, 0, 1, 1], [0, 1, 0, 0]]).bool()
    ids = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    flags = torch.tensor([[True, False, False, True], [False, True, True, True]])
    edges = torch.tensor([[0], [3]])  # (2, E): not per token, whatever its shape
    t = Tokens(torch.randn(2, 4, 3), mask, {"documents": ids, "flags": flags,
                                             "edge_index": edges, "hop": 160})
    packed = t.pack()
    assert packed.meta["documents"].tolist() == [[5, 7, 8], [2, -1, -1]]
    assert packed.meta["flags"].tolist() == [[True, False, True], [True, False, False]]
    assert packed.meta["hop"] == 160 and packed.meta["edge_index"].tolist() == [[0], [2]]
    real = packed.unpack().mask
    assert torch.equal(packed.meta["documents"][real], ids[mask])
    # without padding nothing moves
    whole = Tokens(torch.randn(2, 4, 3), None, {"documents": ids, "spans": {"a": (1, 3)}})
    assert whole.pack().meta["documents"] is ids and whole.pack().meta["spans"] == {"a": (1, 3)}
