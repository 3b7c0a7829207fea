"""Pluggable attention in blocks: names, classes and callables through the registry.

Every registered variant builds inside a ``TransformerBlock`` by name, trains (gradients
reach every parameter), and ``causal=True`` means the same for each: a token's output never
depends on later tokens and equals the attention module called with ``is_causal=True``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mmattn
from mmattn import (
    Encoder,
    LocalAttention,
    MultiHeadAttention,
    MultiModalEncoder,
    Tokens,
    TransformerBlock,
)
from mmattn.registry import available_attention, build_attention, register_attention

D, H, L = 16, 4, 9

#: Arguments each built-in name needs; a variant registered by a test needs none.
NEEDS = {
    "local": {"window_size": 2},
    "linformer": {"seq_len": 12, "proj_len": 4},
    "neighborhood": {"kernel_size": 3},
}
#: Variants without a causal order (the causal test skips them; each raises instead).
NOT_CAUSAL = ("linformer", "edge", "neighborhood")


class Scaled(MultiHeadAttention):
    """A test variant: dot-product attention with a sharper temperature (scores × 2)."""

    def _attention(self, q, k, v, mask, *, is_causal, dropout_p, need_weights):
        return super()._attention(
            q * 2.0, k, v, mask, is_causal=is_causal, dropout_p=dropout_p,
            need_weights=need_weights,
        )


register_attention("test-scaled", Scaled)


def _tokens(batch=2, length=L):
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[0, 6:] = False
    # a path through each item's tokens, in the flat order b * L + i (for "edge"), and a
    # (1, L) grid (for "neighborhood")
    rows = torch.arange(batch * length).view(batch, length)[:, :-1].reshape(-1)
    meta = {"edge_index": torch.stack([rows, rows + 1]), "grid": (1, length)}
    return Tokens(torch.randn(batch, length, D), mask, meta)


def test_builtin_names_are_registered():
    assert {"full", "local", "additive", "linformer", "edge"} <= set(available_attention())
    assert mmattn.available_attention is available_attention


@pytest.mark.parametrize("name", available_attention())
def test_every_variant_by_name_trains(name):
    block = TransformerBlock(D, H, attention=name, attention_kwargs=NEEDS.get(name))
    assert block.attention == name and f"attention={name!r}" in repr(block)
    tokens = _tokens()
    out = block(tokens)
    assert out.x.shape == tokens.x.shape and (out.x[0, 6:] == 0).all()
    out.x.square().sum().backward()
    for pname, param in block.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, pname


# EdgeAttention takes no is_causal: its edges are the mask (keep edges with source <= target)
@pytest.mark.parametrize("name", [n for n in available_attention() if n not in NOT_CAUSAL])
def test_causal_means_the_same_for_every_variant(name):
    block = TransformerBlock(D, H, attention=name, causal=True, attention_kwargs=NEEDS.get(name))
    x = torch.randn(1, L, D)
    out = block(Tokens(x)).x
    changed = x.clone()
    changed[:, 5:] = torch.randn(1, L - 5, D)  # the future of token 4
    torch.testing.assert_close(block(Tokens(changed)).x[:, :5], out[:, :5], atol=1e-6, rtol=1e-6)
    h = block.norm1(x)
    want = x + block.attn(h, h, h, is_causal=True)[0]
    want = want + block.mlp(block.norm2(want))
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


def test_linformer_cannot_be_causal_in_a_block():
    block = TransformerBlock(D, H, attention="linformer", causal=True,
                             attention_kwargs=NEEDS["linformer"])
    with pytest.raises(ValueError, match="is_causal=True is not supported by LinformerAttention"):
        block(_tokens())


def test_class_and_callable_and_kwargs():
    by_class = TransformerBlock(D, H, attention=LocalAttention, window_size=1)
    assert isinstance(by_class.attn, LocalAttention) and by_class.attention == "LocalAttention"
    seen = {}

    def factory(embed_dim, num_heads, **kwargs):
        seen.update(kwargs)
        return MultiHeadAttention(embed_dim, num_heads, num_kv_heads=1, **kwargs)

    block = TransformerBlock(D, H, dropout=0.1, attention=factory)
    assert block.attn.num_kv_heads == 1 and seen["dropout"] == 0.1
    gqa = TransformerBlock(D, H, attention_kwargs={"num_kv_heads": 2, "position": "rotary"})
    assert gqa.attn.k_proj.out_features == 8 and gqa.attn.position is not None
    assert isinstance(TransformerBlock(D, H, attention="test-scaled").attn, Scaled)


def test_block_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"registered names \[.*'test-scaled'.*got 'nope'"):
        TransformerBlock(D, H, attention="nope")
    with pytest.raises(ValueError, match="seq_len, proj_len must be given for "
                                         "attention='linformer'"):
        TransformerBlock(D, H, attention="linformer")
    with pytest.raises(ValueError, match=r"windo is not an argument of attention='local'"):
        TransformerBlock(D, H, attention="local", attention_kwargs={"windo": 2})
    with pytest.raises(TypeError, match="attention must be a registered name, a class or a "
                                        "callable, got int"):
        TransformerBlock(D, H, attention=3)
    with pytest.raises(TypeError, match="must build an nn.Module, got str"):
        build_attention(lambda *a, **k: "no", D, H)
    with pytest.raises(ValueError, match="already registered for "
                                         "mmattn.attention.mha.MultiHeadAttention"):
        register_attention("full", LocalAttention)


def test_encoder_and_multimodal_encoder_pass_attention_through():
    enc = Encoder(D, 2, H, attention="additive", attention_kwargs={"num_kv_heads": 2})
    assert all(type(b.attn).__name__ == "AdditiveAttention" for b in enc.blocks)
    assert all(b.attn.num_kv_heads == 2 for b in enc.blocks)
    assert enc(_tokens()).x.shape == (2, L, D)

    class Vectors(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(3, D)

        def forward(self, v):
            return Tokens(self.proj(v))

    for fusion in ("concat", "latent"):
        mm = MultiModalEncoder(
            {"a": Vectors()}, D, 1, H, fusion, num_latents=4, attention="local",
            attention_kwargs={"window_size": 1},
        )
        blocks = mm.encoder.blocks if fusion == "concat" else mm.self_blocks
        assert isinstance(blocks[0].attn, LocalAttention) and blocks[0].attn.window_size == 1
        assert mm({"a": torch.randn(2, 5, 3)}).x.shape[0] == 2


def test_block_decodes_with_a_cache():
    block = TransformerBlock(D, H, causal=True, attention_kwargs={"position": "rotary"}).eval()
    x = torch.randn(2, 6, D)
    want = block(Tokens(x)).x
    cache = block.attn.make_cache(2, 6)
    got = torch.cat([block(Tokens(x[:, i:i + 1]), cache=cache).x for i in range(6)], dim=1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
