"""Pattern meta at the boundary (issue 36): spans, modality names and grids are checked by
name, never clipped or split; empty sizes give empty masks through every pattern.

References are written from the docs' words (neighborhood_mask for a grid, Python loops),
not from mmattn.patterns' own tables.
"""

from __future__ import annotations

import pytest
import torch

from mmattn import MultiHeadAttention, NeighborhoodAttention, Tokens
from mmattn import patterns as P
from mmattn.debug import attention_mass
from mmattn.masks import neighborhood_mask
from tests.mmattn._pattern_cases import patterns

#: No attention runs in most tests here (one checks the layer's grid reading).
pytestmark = pytest.mark.pins_path


def spans_tokens(spans, batch: int = 2, length: int = 6) -> Tokens:
    return Tokens(torch.zeros(batch, length, 4), meta={"spans": spans})


# ---------------------------------------------------------------------- meta on the meta device


@pytest.mark.parametrize("key, pattern, value", [
    ("documents", P.same("documents"), torch.zeros(2, 6, dtype=torch.long, device="meta")),
    ("edge_index", P.edges(), torch.zeros(2, 3, dtype=torch.long, device="meta")),
], ids=["same_ids", "edge_index"])
def test_meta_device_values_are_refused_naming_the_key(key, pattern, value):
    """Ids or edges without data (the meta device) cannot be read: a ValueError naming the
    key, from compile and dense alike (issue 41)."""
    tokens = Tokens(torch.randn(2, 6, 8), meta={key: value})
    match = rf"meta\['{key}'\] is on the meta device and holds no data"
    with pytest.raises(ValueError, match=match):
        pattern.compile(tokens, 8)
    with pytest.raises(ValueError, match=match):
        pattern.dense(tokens)


# ---------------------------------------------------------------------- modalities (item 2)


def test_modalities_as_one_string_is_refused_by_patterns_and_attention_mass():
    ids = torch.zeros(1, 4, dtype=torch.long)
    tokens = Tokens(torch.randn(1, 4, 8), meta={"modality_ids": ids, "modalities": "text"})
    match = r"meta\['modalities'\] must be a list or tuple of names \(str\), got str 'text'"
    with pytest.raises(TypeError, match=match):
        P.modality("text").dense(tokens)
    with pytest.raises(TypeError, match=match):
        P.per_modality({"text": P.causal()}).compile(tokens)
    with pytest.raises(TypeError, match=match):
        attention_mass(MultiHeadAttention(8, 2), tokens)
    with pytest.raises(TypeError, match=r"meta\['modalities'\]\[1\] must be a str, got int"):
        P.modality("text").dense(tokens.replace(modalities=["text", 3]))
    # a list or a tuple of names is what the docs give: text allowed, as the ids say
    for names in (["text"], ("text",)):
        allowed = P.modality("text").dense(tokens.replace(modalities=names))
        assert allowed.all()


# ---------------------------------------------------------------------- spans (items 4, 8)


@pytest.mark.parametrize("spans, error, match", [
    ({"text": (-3, 3)}, ValueError,
     r"meta\['spans'\]\['text'\] must satisfy 0 <= start <= stop <= length=6, got \(-3, 3\)"),
    ({"text": (0, 9)}, ValueError,
     r"meta\['spans'\]\['text'\] must satisfy 0 <= start <= stop <= length=6, got \(0, 9\)"),
    ({"text": (4, 2)}, ValueError, r"meta\['spans'\]\['text'\] must satisfy 0 <= start <= stop"),
    ({"a": (0, 3), "text": (torch.tensor([0, -1]), torch.tensor([3, 3]))}, ValueError,
     r"meta\['spans'\]\['text'\] must satisfy 0 <= start <= stop <= length=6 in every item, "
     r"got start \[0, -1\] and stop \[3, 3\]"),
    ({"text": (torch.tensor([0, 4]), torch.tensor([3, 7]))}, ValueError,
     r"meta\['spans'\]\['text'\] must satisfy .* got start \[0, 4\] and stop \[3, 7\]"),
    ({"text": (0, 2, 4)}, TypeError,
     r"meta\['spans'\]\['text'\] must be a \(start, stop\) pair, got \(0, 2, 4\)"),
    ({"text": 3}, TypeError, r"meta\['spans'\]\['text'\] must be a \(start, stop\) pair"),
    ({"text": (torch.tensor([0, 0, 0]), torch.tensor([2, 2, 2]))}, ValueError,
     r"meta\['spans'\]\['text'\]\[0\] must be an int or a per-item \(batch,\)=\(2,\) tensor, "
     r"got shape \(3,\)"),
    ({"text": (0.0, 3)}, TypeError, r"meta\['spans'\]\['text'\]\[0\] must be an int"),
    ({"text": (torch.tensor([0.0, 0.0]), 3)}, TypeError,
     r"meta\['spans'\]\['text'\]\[0\] must be an int or an integer tensor, got torch.float32"),
    ([(0, 3)], TypeError, r"meta\['spans'\] must map names to \(start, stop\), got list"),
])
def test_malformed_spans_are_refused_by_name(spans, error, match):
    tokens = spans_tokens(spans)
    for use in (lambda: P.modality("text").dense(tokens),
                lambda: P.per_modality({}).compile(tokens, 4),
                lambda: P.chunked(2).dense(tokens)):
        with pytest.raises(error, match=match):
            use()


def test_masked_tokens_with_bad_spans_are_refused_by_pack():
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    tokens = Tokens(torch.zeros(2, 6, 4), mask, {"spans": {"text": (-3, 3)}})
    with pytest.raises(ValueError, match=r"meta\['spans'\]\['text'\] must satisfy 0 <= start"):
        tokens.pack()


def test_valid_spans_edge_cases():
    """Empty spans, spans reaching L, per-item 0-D tensors: read as written."""
    tokens = spans_tokens({"a": (0, 0), "b": (torch.tensor(0), 6), "c": (6, 6)})
    ids = P.modality("b").dense(tokens)
    assert ids.all()
    assert not P.modality("a").dense(tokens).any() and not P.modality("c").dense(tokens).any()
    per_item = spans_tokens({"a": (torch.tensor([0, 2]), torch.tensor([3, 6]))})
    dense = P.modality("a", "a").dense(per_item)
    inside = [[i < 3 for i in range(6)], [2 <= i < 6 for i in range(6)]]
    expected = torch.tensor([[[q and k for k in row] for q in row] for row in inside])
    assert torch.equal(dense, expected)


# ---------------------------------------------------------------------- grids (item 11)


def test_grids_as_a_tensor_equal_grids_as_a_list_and_the_layer():
    x = torch.randn(2, 12, 8)
    pairs = [(3, 4), (2, 5)]
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 10:] = False
    as_list = Tokens(x, mask, {"grids": pairs})
    as_tensor = Tokens(x, mask, {"grids": torch.tensor(pairs)})
    dense = P.neighborhood(3).dense(as_tensor)
    expected = torch.zeros(2, 12, 12, dtype=torch.bool)
    for b, (rows, cols) in enumerate(pairs):
        cells = rows * cols
        expected[b, :cells, :cells] = neighborhood_mask((rows, cols), 3)
    assert torch.equal(dense, expected)
    assert torch.equal(dense, P.neighborhood(3).dense(as_list))
    assert torch.equal(P.neighborhood(3).compile(as_tensor, 4).dense(), expected)
    # the layer reads the same tensor (the consistency item 11 asks for)
    layer = NeighborhoodAttention(8, 2, kernel_size=3).eval()
    with torch.no_grad():
        out, _ = layer(x, key_padding_mask=~mask, **layer.geometry(as_tensor.meta))
        ref, _ = layer(x, key_padding_mask=~mask, **layer.geometry(as_list.meta))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
    # and inside a span (a part's own meta)
    fused = Tokens.cat({"text": Tokens(torch.randn(2, 2, 8)), "image": as_tensor})
    assert torch.equal(P.neighborhood(3).dense(fused)[:, 2:, 2:], expected)


@pytest.mark.parametrize("grids, error, match", [
    (torch.tensor([[3.0, 4.0], [2.0, 5.0]]), TypeError,
     r"meta\['grids'\] must have an integer dtype"),
    (torch.tensor([[3, 4]]), ValueError, r"meta\['grids'\] must have shape \(2, 2\)"),
    (torch.tensor([3, 4]), ValueError, r"meta\['grids'\] must have shape \(2, 2\)"),
    (torch.tensor([[3, 4], [0, 5]]), ValueError, r"meta\['grids'\] must hold sides >= 1"),
])
def test_bad_grids_tensor_is_refused_by_name(grids, error, match):
    with pytest.raises(error, match=match):
        P.neighborhood(3).dense(Tokens(torch.zeros(2, 12, 4), meta={"grids": grids}))


# ---------------------------------------------------------------------- empty sizes (item 7)


def empty_tokens(batch: int, length: int) -> Tokens:
    half = length // 2
    meta = {
        "spans": {"text": (0, half), "image": (half, length)},
        "image": {"grid": (1, max(length - half, 1))},
        "documents": torch.zeros(batch, length, dtype=torch.long),
        "edge_index": torch.zeros(2, 0, dtype=torch.long),
    }
    return Tokens(torch.zeros(batch, length, 8), None, meta)


def every_pattern() -> dict:
    cases = dict(patterns())
    cases["and"] = P.causal() & P.same("documents")
    cases["or"] = P.window(1) | P.edges()
    cases["not"] = ~P.chunked(2)
    cases["per_modality"] = P.per_modality(
        within={"text": P.causal(), "image": P.neighborhood(3)},
        across=P.modality(query="text") | P.modality(key="text"))
    return cases


@pytest.mark.parametrize("batch, length", [(0, 4), (2, 0), (0, 0)])
@pytest.mark.parametrize("name", list(every_pattern()))
def test_empty_sizes_give_empty_masks(name, batch, length):
    pattern, tokens = every_pattern()[name], empty_tokens(batch, length)
    empty = torch.zeros(batch, length, length, dtype=torch.bool)
    assert torch.equal(pattern.dense(tokens), empty)
    assert torch.equal(pattern.compile(tokens, 2).dense(), empty)


def test_neighborhood_on_an_empty_batch_the_issue_example():
    tokens = Tokens(torch.zeros(0, 4, 8), None, {"grid": (2, 2)})
    assert P.neighborhood(3).dense(tokens).shape == (0, 4, 4)
    assert P.neighborhood(3).compile(tokens).dense().shape == (0, 4, 4)
    grids = Tokens(torch.zeros(0, 4, 8), None, {"grids": []})
    assert P.neighborhood(3).dense(grids).shape == (0, 4, 4)
