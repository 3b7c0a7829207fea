"""Packed multi-modal Tokens are a tested path (issue 36): every pattern primitive and
combinator, and ``attention_mass``, on ``tokens.pack()`` equal the padded run of the same
tokens, with padding inside the spans (fused parts, per-item image grids) and inside the runs of
interleaved rows (``modality_ids``, ``segments``).

The comparison: the padded run's (B, L, L) mask restricted to each item's real tokens, in
order, is the packed run's (B, max lᵢ, max lᵢ) mask (``pattern.dense`` of packed Tokens is
that of their ``unpack()`` layout). Positions are counted in the layout given, so
``P.window`` across padding is the one rule that differs; its packed reading is checked
against the real tokens' ranks (docs/edge_cases.md).
"""

from __future__ import annotations

import pytest
import torch

from mmattn import Encoder, MultiHeadAttention, NeighborhoodAttention, Tokens
from mmattn import patterns as P
from mmattn.debug import attention_mass
from tests.mmattn._pattern_cases import fused_tokens, interleaved_tokens, patterns

D = 8


def image_grids_tokens() -> Tokens:
    """text (4, item 1: 2 real) | images of per-item grids (3 x 4 and 2 x 3, the second
    padded after its cells) | audio (5, item 1: 3 real): padding inside every span."""
    gen = torch.Generator().manual_seed(1)

    def part(length, real, meta=None):
        mask = torch.arange(length)[None] < torch.tensor(real)[:, None]
        return Tokens(torch.randn(2, length, D, generator=gen), mask, meta or {})

    fused = Tokens.cat({
        "text": part(4, [4, 2]),
        "image": part(12, [12, 6], {"grids": torch.tensor([[3, 4], [2, 3]])}),
        "audio": part(5, [5, 3]),
    })
    fused.meta["documents"] = torch.tensor([[0] * 9 + [1] * 12, [0] * 3 + [-1] * 3 + [2] * 15])
    return fused


def interleaved_padded_tokens() -> Tokens:
    """Gemma-3-like rows (modality_ids, segments) with padding at the tail of a run inside
    each item, so packing moves every later token."""
    tokens = interleaved_tokens(D)
    mask = tokens.mask.clone()
    mask[0, 4] = False  # the last token of item 0's first image run
    mask[1, 2] = False  # the last token of item 1's first image run
    meta = {**tokens.meta, "documents": tokens.meta["segments"] // 2}
    return Tokens(tokens.x, mask, meta)


CASES = {"fused": fused_tokens, "grids": image_grids_tokens,
         "interleaved": interleaved_padded_tokens}


def real_view(dense: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, L, L) of the padded layout → (B, j, j) on each item's real tokens, left-aligned."""
    lengths = mask.sum(1)
    longest = int(lengths.max())
    out = torch.zeros(dense.shape[0], longest, longest, dtype=dense.dtype)
    for b in range(dense.shape[0]):
        idx = [i for i, real in enumerate(mask[b].tolist()) if real]
        out[b, : len(idx), : len(idx)] = dense[b][idx][:, idx]
    return out


def layout_free_patterns(case: str) -> dict:
    """Every primitive and combinator but ``P.window`` (positions across padding move)."""
    cases = {k: v for k, v in patterns().items() if k != "window"}
    if case != "fused":  # no edges; text/image(/audio) modalities
        cases = {k: v for k, v in cases.items() if not k.startswith("edges")}
        cases["modality"] = P.modality(query="text", key=("image", "audio"))
        cases["modality-any"] = P.modality(key="image")
    if case == "interleaved":  # no grid
        cases = {k: v for k, v in cases.items() if not k.startswith("neighborhood")}
    image = P.full() if case == "interleaved" else P.neighborhood(3)
    within = {"text": P.causal(), "image": image}
    if case == "fused":
        within["graph"] = P.edges()
    across = P.modality(query="text") | P.modality(key="text")
    cases.update({
        "causal&same": P.causal() & P.same("documents"),
        "chunked|modality": P.chunked(3, left=1) | cases["modality"],
        "~image-or-same": ~P.same("documents") if case == "interleaved" else ~image,
        "~causal&modality": ~P.causal() & cases["modality-any"],
        "per_modality": P.per_modality(within=within, across=across),
        "per_modality-causal": P.per_modality(within={"image": P.full()}, across=P.causal()),
        "per_modality-empty": P.per_modality({}),
    })
    return cases


PAIRS = [(case, name) for case in CASES for name in layout_free_patterns(case)]


@pytest.mark.parametrize("case, name", PAIRS)
def test_pattern_on_packed_tokens_equals_the_padded_run(case, name):
    padded = CASES[case]()
    packed = padded.pack()
    pattern = layout_free_patterns(case)[name]
    expected = real_view(pattern.dense(padded), padded.full_mask())
    assert expected.any() or name == "~causal&modality"  # the check is not vacuous
    assert torch.equal(pattern.dense(packed), expected)
    assert torch.equal(pattern.compile(packed, 4).dense(), expected)


@pytest.mark.parametrize("case", list(CASES))
def test_window_on_packed_tokens_counts_the_real_tokens(case):
    """Packed, a window is |rank(q) - rank(k)| <= w among the item's real tokens; padded,
    among the positions (padding included). Equal when no padding sits between them."""
    padded = CASES[case]()
    mask = padded.full_mask()
    got = P.window(2).dense(padded.pack())
    lengths = mask.sum(1).tolist()
    for b, n in enumerate(lengths):
        ranks = torch.arange(n)
        expected = (ranks[:, None] - ranks[None, :]).abs() <= 2
        assert torch.equal(got[b, :n, :n], expected)
        assert not got[b, n:].any() and not got[b, :, n:].any()


LAYERS = {
    "mha": lambda: MultiHeadAttention(D, 2),
    "neighborhood": lambda: NeighborhoodAttention(D, 2, kernel_size=3),
}


def encoder(case: str) -> Encoder:
    image = P.full() if case == "interleaved" else P.neighborhood(3)
    within = {"text": P.causal(), "image": image}
    pattern = P.per_modality(within=within, across=P.modality(key="text"))
    return Encoder(D, depth=2, num_heads=2, pattern=pattern)


@pytest.mark.parametrize("by", ["modality", "segment"])
@pytest.mark.parametrize("model", ["mha", "neighborhood", "encoder"])
@pytest.mark.parametrize("case", list(CASES))
def test_attention_mass_on_packed_tokens_equals_the_padded_run(case, model, by):
    if model == "neighborhood" and case == "interleaved":
        pytest.skip("interleaved rows hold no grid")
    torch.manual_seed(0)
    module = (encoder(case) if model == "encoder" else LAYERS[model]()).eval()
    padded = CASES[case]()
    padded.meta.pop("edge_index", None)  # the mass layers here read spans and grids only
    mass = attention_mass(module, padded, by=by)
    packed_mass = attention_mass(module, padded.pack(), by=by)
    assert packed_mass.modalities == mass.modalities
    assert torch.equal(packed_mass.counts, mass.counts)
    torch.testing.assert_close(packed_mass.table, mass.table, rtol=1e-5, atol=1e-6)
    assert mass.table.sum() > 0
