"""attention_mass with score modifiers (sinks, softcap, ALiBi) against the dense weights of
the same modules: a sink's share goes to no modality, so rows sum below one."""

from __future__ import annotations

import pytest
import torch

from mmattn import (
    EdgeAttention,
    LocalAttention,
    MultiHeadAttention,
    NeighborhoodAttention,
    Tokens,
)
from mmattn import patterns as P
from mmattn.debug import attention_mass, top_keys
from mmattn.kernels import dense as _kernel
from tests.mmattn.debug.test_mass import (
    EDGES,
    D,
    H,
    LargestTensor,
    check_top,
    dense_weights,
    fused,
    packed_pair,
    real_of,
    reference,
    span_groups,
)

LAYERS = {
    "mha-sinks": lambda: MultiHeadAttention(D, H, sinks=True),
    "mha-softcap": lambda: MultiHeadAttention(D, H, softcap=2.0),
    "mha-alibi": lambda: MultiHeadAttention(D, H, alibi=True),
    "mha-all": lambda: MultiHeadAttention(D, H, sinks=True, softcap=3.0, alibi=True),
    "local-alibi": lambda: LocalAttention(D, H, window_size=2, alibi=True),
    "local-sinks-softcap": lambda: LocalAttention(D, H, window_size=3, sinks=True,
                                                  softcap=2.0, block_size=4),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_mass_with_modifiers_equals_the_dense_weights(name):
    torch.manual_seed(0)
    layer, tokens = LAYERS[name]().eval(), fused()
    if getattr(layer, "sinks", None) is not None:
        with torch.no_grad():
            layer.sinks.normal_()  # a sink with weight: rows sum below one
    w = dense_weights(layer, tokens)
    expected = reference(w, span_groups(tokens), real_of(tokens), 2)
    mass = attention_mass(layer, tokens)
    torch.testing.assert_close(mass.table[0].double(), expected, atol=1e-5, rtol=1e-5)
    rows = mass.table[0].sum(-1)
    if "sinks" in name or "all" in name:
        assert (rows < 0.999).all()
    check_top(top_keys(layer, tokens, k=3), w, real_of(tokens), 3)


def grid_tokens(image=(4, 4)) -> Tokens:
    """text (padded in item 1) then a ``rows x cols`` image, fused by Tokens.cat (padded)."""
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    parts = {"text": Tokens(torch.randn(2, 6, D), mask),
             "image": Tokens(torch.randn(2, image[0] * image[1], D), meta={"grid": image})}
    return Tokens.cat(parts)


def randomize(layer):
    """Sinks and the NAT table away from their initial values, so that they matter."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "sinks" or "relative_position_bias" in name:
                p.normal_()
    return layer.eval()


def check_mass(layer, tokens, w, **kwargs):
    expected = reference(w, span_groups(tokens), real_of(tokens), 2)
    mass = attention_mass(layer, tokens, **kwargs)
    assert mass.modules == [""] and not mass.skipped
    torch.testing.assert_close(mass.table[0].double(), expected, atol=1e-5, rtol=1e-5)
    check_top(top_keys(layer, tokens, k=3, **kwargs), w, real_of(tokens), 3)
    return mass


NAT = {
    "sinks": {"sinks": True},
    "softcap": {"softcap": 1.5},
    "alibi": {"alibi": True},
    "table": {"relative_position_bias": True},
    "all-dilated": {"sinks": True, "softcap": 2.0, "alibi": True, "relative_position_bias": True,
                    "dilation": (1, 2)},
}


@pytest.mark.parametrize("name", list(NAT))
def test_neighborhood_with_modifiers_and_the_table_equals_the_dense_weights(name):
    torch.manual_seed(0)
    layer = randomize(NeighborhoodAttention(D, H, kernel_size=3, num_global_tokens=1,
                                            **NAT[name]))
    tokens = grid_tokens()
    mass = check_mass(layer, tokens, dense_weights(layer, tokens))
    if "sinks" in NAT[name]:
        assert (mass.table[0].sum(-1) < 0.999).all()


def test_packed_neighborhood_with_modifiers_equals_the_padded_dense_weights():
    torch.manual_seed(0)
    layer = randomize(NeighborhoodAttention(D, H, kernel_size=3, num_global_tokens=1,
                                            **NAT["all-dilated"]))
    packed, padded = packed_pair(grids=True)
    kwargs = {"grid": [(2, 2), (2, 3), (3, 3)], "grid_start": [3, 5, 4]}
    w = dense_weights(layer, padded, **kwargs)
    expected = reference(w, span_groups(padded), real_of(padded), 2)
    mass = attention_mass(layer, packed, **kwargs)
    torch.testing.assert_close(mass.table[0].double(), expected, atol=1e-5, rtol=1e-5)
    check_top(top_keys(layer, packed, k=3, **kwargs), w, real_of(padded), 3)


@pytest.mark.parametrize("mods", [{"sinks": True}, {"softcap": 1.5},
                                  {"sinks": True, "softcap": 2.0, "num_kv_heads": 2}],
                         ids=["sinks", "softcap", "both-gqa"])
def test_edge_with_modifiers_equals_the_dense_weights(mods):
    torch.manual_seed(0)
    layer, tokens = randomize(EdgeAttention(D, H, **mods)), fused()
    w = dense_weights(layer, tokens, edge_index=EDGES)
    mass = check_mass(layer, tokens, w, edge_index=EDGES)
    if "sinks" in mods:  # every query with an edge gives its sink a share
        assert (mass.table[0].sum(-1) < 0.999).all()


def sparse_case(length_text=10, image=(4, 4)):
    """Tokens with ``documents`` (a run of -1: rows with no allowed key) and a pattern."""
    mask = torch.ones(2, length_text, dtype=torch.bool)
    mask[1, 7:] = False
    parts = {"text": Tokens(torch.randn(2, length_text, D), mask),
             "image": Tokens(torch.randn(2, image[0] * image[1], D))}
    tokens = Tokens.cat(parts)
    docs = (torch.arange(tokens.length) // 9)[None].repeat(2, 1)
    docs[0, 3:5] = -1
    tokens.meta["documents"] = docs
    return tokens, P.same("documents") & (P.causal() | P.window(3))


@pytest.mark.parametrize("mods", [{}, {"sinks": True}, {"softcap": 2.0}, {"alibi": True},
                                  {"sinks": True, "softcap": 3.0, "alibi": True,
                                   "num_kv_heads": 2}],
                         ids=["plain", "sinks", "softcap", "alibi", "all-gqa"])
def test_block_sparse_with_modifiers_equals_the_dense_mask(mods):
    torch.manual_seed(0)
    layer = randomize(MultiHeadAttention(D, H, **mods))
    tokens, pattern = sparse_case()
    sparse = pattern.compile(tokens, block_size=8)
    dense = (~sparse.dense()).repeat_interleave(H, 0)  # the same mask on the dense kernel
    w = dense_weights(layer, tokens, attn_mask=dense)
    seen = []
    remove = _kernel.add_listener(seen.append)
    try:
        mass = check_mass(layer, tokens, w, attn_mask=sparse)
    finally:
        remove()
    assert {r["path"] for r in seen} == {"block-sparse"}
    assert mass.table[0].isfinite().all()


def test_no_tensor_of_l_by_l_elements_with_grid_terms_and_block_sparse_alibi():
    """The largest tensor of a measured call is the kernel's own (its tiles' terms, its
    buckets): the views add none larger, and none holds as many as one (L, L) map."""
    parts = {"text": Tokens(torch.randn(1, 24, 8)),
             "image": Tokens(torch.randn(1, 24 * 24, 8), meta={"grid": (24, 24)})}
    tokens = Tokens.cat(parts)
    length = tokens.length
    tokens.meta["documents"] = (torch.arange(length) // 200)[None]
    nat = randomize(NeighborhoodAttention(8, 2, kernel_size=5, sinks=True, alibi=True,
                                          relative_position_bias=True))
    mha = randomize(MultiHeadAttention(8, 2, sinks=True, alibi=True))
    sparse = (P.same("documents") & P.window(16)).compile(tokens, block_size=32)
    for layer, kwargs in ((nat, {}), (mha, {"attn_mask": sparse})):
        with torch.no_grad(), LargestTensor() as forward:
            layer(tokens.x, **{**layer.geometry(tokens.meta), **kwargs})
        with torch.no_grad(), LargestTensor() as seen:
            found = [attention_mass(layer, tokens, **kwargs),
                     top_keys(layer, tokens, k=4, **kwargs)]
        assert all(not result.skipped for result in found)
        assert seen.largest <= forward.largest < length * length, (seen.largest,
                                                                     forward.largest)


def test_encoder_with_a_pattern_equals_its_recorded_weights():
    """An Encoder built with pattern= runs every block on the block-sparse kernel; the mass
    of each call equals the weights record_attention gives for the same forward."""
    from mmattn import Encoder
    from mmattn.debug import record_attention

    torch.manual_seed(0)
    tokens, pattern = sparse_case()
    encoder = Encoder(D, depth=2, num_heads=H, pattern=pattern).eval()
    mass = attention_mass(encoder, tokens)
    with torch.no_grad(), record_attention(encoder, average_attn_weights=False) as maps:
        encoder(tokens)
    assert mass.modules == ["blocks.0.attn", "blocks.1.attn"]
    for c, name in enumerate(mass.modules):
        expected = reference(maps[name][0], span_groups(tokens), real_of(tokens), 2)
        torch.testing.assert_close(mass.table[c].double(), expected, atol=1e-5, rtol=1e-5)
