"""mmattn.patterns: every primitive and combinator against a naive loop over the spec's words.

The reference (tests/mmattn/_pattern_cases.py) walks every (b, q, k) with Python ints; the
fused case has padding inside the parts, a grid, edges and documents.
"""

from __future__ import annotations

import pytest
import torch

from mmattn import Tokens
from mmattn import patterns as P
from tests._features import needs
from tests.mmattn._pattern_cases import (
    Naive,
    fused_tokens,
    interleaved_tokens,
    naive_rules,
    patterns,
)

#: No attention runs here: the MMATTN_FUSED_ATTN=0 pass would repeat these unchanged.
pytestmark = pytest.mark.pins_path

FUSED = fused_tokens()
NAIVE = Naive(FUSED)
RULES = naive_rules(NAIVE)
PATTERNS = patterns()


@pytest.mark.parametrize("name", list(PATTERNS))
def test_primitive_equals_naive_loop(name):
    expected = NAIVE.mask(RULES[name])
    assert torch.equal(PATTERNS[name].dense(FUSED), expected)


@pytest.mark.parametrize("a, b", [("causal", "same"), ("window", "edges"), ("chunked", "modality")])
def test_combinators_equal_naive_loop(a, b):
    pa, pb, ra, rb = PATTERNS[a], PATTERNS[b], RULES[a], RULES[b]
    assert torch.equal((pa & pb).dense(FUSED), NAIVE.mask(lambda *i: ra(*i) and rb(*i)))
    assert torch.equal((pa | pb).dense(FUSED), NAIVE.mask(lambda *i: ra(*i) or rb(*i)))
    assert torch.equal((~pa).dense(FUSED), NAIVE.mask(lambda *i: not ra(*i)))
    # ~ never lets padding attend: a padded key or query row stays False
    assert not (~pa).dense(FUSED)[~FUSED.full_mask()].any()


def test_per_modality_equals_naive_loop():
    within = {"text": P.causal(), "image": P.neighborhood(3), "graph": P.edges()}
    across = P.modality(query="text") | P.modality(key="text")
    rules = {"text": RULES["causal"], "image": RULES["neighborhood"], "graph": RULES["edges"]}

    def rule(b, q, k):
        seg_q, seg_k = NAIVE.segment[b][q], NAIVE.segment[b][k]
        if seg_q == seg_k and seg_q >= 0:  # same segment: its modality's pattern, else full
            return rules.get(NAIVE.modality[b][q], RULES["full"])(b, q, k)
        return NAIVE.modality[b][q] == "text" or NAIVE.modality[b][k] == "text"

    pattern = P.per_modality(within=within, across=across)
    assert torch.equal(pattern.dense(FUSED), NAIVE.mask(rule))
    assert torch.equal(P.per_modality({}).dense(FUSED), NAIVE.mask(RULES["full"]))


def test_per_modality_ignores_modalities_the_tokens_lack():
    """A modality left out of the call: its pattern (and the meta it needs) is not read."""
    text = Tokens.cat({"text": Tokens(torch.zeros(1, 5, 2))})
    pattern = P.per_modality(within={"text": P.causal(), "graph": P.edges(),
                                     "image": P.neighborhood(3)})
    assert torch.equal(pattern.dense(text), P.causal().dense(text))
    assert torch.equal(pattern.compile(text, 2).dense(), P.causal().dense(text))
    with pytest.raises(ValueError, match="edge_index"):
        P.edges().dense(text)  # alone, a missing key is still an error


def test_interleaved_gemma3_style():
    """token_type_ids → runs: causal text, bidirectional inside each image, causal across."""
    tokens = interleaved_tokens()
    naive = Naive(tokens)

    def rule(b, q, k):
        if naive.segment[b][q] == naive.segment[b][k] and naive.modality[b][q] == "image":
            return True
        return k <= q

    pattern = P.per_modality(within={"text": P.causal(), "image": P.full()}, across=P.causal())
    assert torch.equal(pattern.dense(tokens), naive.mask(rule))
    image_then_later_image = pattern.dense(tokens)[0, 2, 7]  # first image must not see a later one
    assert not image_then_later_image


def test_outside_segments_count_as_different():
    ids = torch.tensor([[-1, -1, 0, 0]])
    tokens = Tokens(torch.zeros(1, 4, 2), meta={"segments": ids, "modality_ids": ids.clamp(0),
                                                 "modalities": ["a"]})
    dense = P.per_modality({}, across=~P.full()).dense(tokens)[0]
    assert dense.int().tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]


def test_chunked_without_segments_counts_from_zero():
    tokens = Tokens(torch.zeros(1, 6, 2))
    naive = Naive(tokens)
    rule = naive_rules(naive)["chunked"]
    assert torch.equal(P.chunked(3, left=1).dense(tokens), naive.mask(rule))


def test_grid_sources():
    """meta["grid"], per-item meta["grids"] (image tokens alone) and a span's grid agree."""
    x = torch.zeros(2, 12, 4)
    alone = P.neighborhood(3).dense(Tokens(x, meta={"grid": (3, 4)}))
    per_item = P.neighborhood(3).dense(Tokens(x, meta={"grids": [(3, 4), (2, 6)]}))
    assert torch.equal(per_item[0], alone[0])
    assert not torch.equal(per_item[1], alone[1])
    image = Tokens(x, meta={"grid": (3, 4)})
    fused = Tokens.cat({"text": Tokens(torch.zeros(2, 2, 4)), "image": image})
    assert torch.equal(P.neighborhood(3).dense(fused)[:, 2:, 2:], alone)
    assert not P.neighborhood(3).dense(fused)[:, :2].any()
    only = P.neighborhood(3, modality="text").dense(fused)
    assert not only.any()


def test_runs():
    ids = torch.tensor([[0, 0, 1, 1, 0, 2, 2, -1]])
    assert P.runs(ids).tolist() == [[0, 0, 1, 1, 2, 3, 3, -1]]
    assert P.runs(torch.tensor([5, 5])).tolist() == [0, 0]


@needs("vmap_index")
def test_mask_mod_matches_dense():
    pattern = P.per_modality(within={"image": P.neighborhood(3), "graph": P.edges()},
                             across=P.causal()) & ~P.window(0)
    mask_mod = pattern.mask_mod(FUSED)
    b, q, k = torch.meshgrid(*(torch.arange(n) for n in FUSED_SHAPE()), indexing="ij")
    flat = torch.vmap(mask_mod)(b.flatten(), torch.zeros_like(b.flatten()), q.flatten(),
                                k.flatten())
    assert torch.equal(flat.view(b.shape), pattern.dense(FUSED))


def FUSED_SHAPE():
    return FUSED.batch_size, FUSED.length, FUSED.length


def test_packed_tokens_use_their_padded_layout():
    packed = FUSED.pack()
    pattern = P.causal() & P.edges()
    assert torch.equal(pattern.dense(packed), pattern.dense(packed.unpack()))


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize("build, error, match", [
    (lambda: P.window(-1), ValueError, "w must be >= 0, got -1"),
    (lambda: P.window(1.5), TypeError, "w must be an int"),
    (lambda: P.chunked(0), ValueError, "chunk must be >= 1, got 0"),
    (lambda: P.chunked(2, left=-1), ValueError, "left must be >= 0"),
    (lambda: P.neighborhood(4), ValueError, "kernel_size must be odd"),
    (lambda: P.neighborhood(3, dilation=0), ValueError, r"dilation\[0\] must be >= 1"),
    (lambda: P.causal() & 3, TypeError, "Pattern & expects a Pattern on both sides.*got int"),
    (lambda: 3 | P.causal(), TypeError, r"Pattern \| expects a Pattern.*got int"),
    (lambda: P.causal() and P.full(), TypeError, "combine patterns with & | ~"),
    (lambda: P.same(3), TypeError, "key must be a meta key"),
    (lambda: P.modality(query=3), TypeError, "query must be a modality name"),
    (lambda: P.per_modality({"text": "causal"}), TypeError, "within must map modality names"),
    (lambda: P.per_modality({}, across=1), TypeError, "across must be a Pattern"),
    (lambda: P.edges(self_loops=1), TypeError, "self_loops must be a bool"),
    (lambda: P.runs(torch.zeros(3)), TypeError, "ids must have an integer dtype"),
])
def test_bad_arguments(build, error, match):
    with pytest.raises(error, match=match):
        build()


PLAIN = Tokens(torch.zeros(1, 4, 2))


@pytest.mark.parametrize("pattern, match", [
    (P.same("docs"), r"P.same\('docs'\) needs meta\['docs'\]"),
    (P.neighborhood(3), "needs a grid: meta\\['grid'\\]"),
    (P.edges(), r"needs meta\['edge_index'\]"),
    (P.modality(query="text"), r"need meta\['spans'\]"),
    (P.per_modality({"a": P.causal()}), r"need meta\['spans'\]"),
])
def test_missing_meta_key_is_named(pattern, match):
    with pytest.raises(ValueError, match=match):
        pattern.dense(PLAIN)
    with pytest.raises(ValueError, match=match):
        pattern.compile(PLAIN)


def test_bad_meta_values():
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"needs meta\['modalities'\]"):
        P.modality("a").dense(Tokens(torch.zeros(1, 4, 2), meta={"modality_ids": ids}))
    with pytest.raises(ValueError, match=r"needs meta\['spans'\] or meta\['segments'\]"):
        P.per_modality({}).dense(Tokens(torch.zeros(1, 4, 2), meta={
            "modality_ids": ids, "modalities": ["a"]}))
    with pytest.raises(ValueError, match=r"meta\['docs'\] must have shape \(1, 4\)"):
        P.same("docs").dense(Tokens(torch.zeros(1, 4, 2), meta={"docs": torch.zeros(4).long()}))
    with pytest.raises(TypeError, match=r"meta\['docs'\] must have an integer dtype"):
        P.same("docs").dense(Tokens(torch.zeros(1, 4, 2), meta={"docs": torch.zeros(1, 4)}))
    with pytest.raises(ValueError, match="grid .* has more cells than"):
        P.neighborhood(3).dense(Tokens(torch.zeros(1, 4, 2), meta={"grid": (3, 3)}))
    with pytest.raises(ValueError, match=r"meta\['edge_index'\] must lie in \[0, B \* L=4\)"):
        P.edges().dense(Tokens(torch.zeros(1, 4, 2), meta={"edge_index": torch.tensor([[0], [9]])}))
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        P.causal().compile(PLAIN, block_size=0)
    with pytest.raises(TypeError, match="tokens must be mmattn.Tokens"):
        P.causal().dense(torch.zeros(1, 4, 2))
