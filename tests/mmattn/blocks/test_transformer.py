"""Tests for mmattn/blocks.py and mmattn/blocks/pooling.py against independent references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmattn import Tokens
from mmattn.blocks import CrossAttentionBlock, Encoder, TransformerBlock
from mmattn.blocks.pooling import AttentionPool, MaskedPool, masked_max, masked_mean
from mmattn.masks import band_mask, padding_mask

ATOL = 1e-5


def _tokens(lengths, length=7, dim=16, device="cpu") -> Tokens:
    mask = padding_mask(torch.tensor(lengths, device=device), length)
    return Tokens(torch.randn(len(lengths), length, dim, device=device), mask)


def _scramble_padding(tokens: Tokens) -> Tokens:
    """The same tokens with large random values at every padded position."""
    noise = 100 * torch.randn_like(tokens.x)
    x = torch.where(tokens.mask[..., None], tokens.x, noise)
    return Tokens(x, tokens.mask, tokens.meta)


def _ln(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def _mlp(x: torch.Tensor, mlp: nn.Sequential) -> torch.Tensor:
    return F.linear(F.gelu(F.linear(x, mlp[0].weight, mlp[0].bias)), mlp[3].weight, mlp[3].bias)


def _reference_block(block: TransformerBlock, x: torch.Tensor, attn_mask=None) -> torch.Tensor:
    """Pre-norm block with torch's own nn.MultiheadAttention, on one unpadded batch."""
    torch_attn = block.attn.to_torch()
    h = _ln(x, block.norm1)
    x = x + torch_attn(h, h, h, attn_mask=attn_mask, need_weights=False)[0]
    return x + _mlp(_ln(x, block.norm2), block.mlp)


# ---------------------------------------------------------------- TransformerBlock


def test_transformer_block_matches_torch_reference(device):
    block = TransformerBlock(16, 4).to(device)
    x = torch.randn(3, 6, 16, device=device)
    out = block(Tokens(x))
    torch.testing.assert_close(out.x, _reference_block(block, x), atol=ATOL, rtol=1e-4)


def test_transformer_block_padded_equals_each_sequence_alone(device):
    block = TransformerBlock(16, 2, mlp_ratio=2.0).to(device)
    tokens = _tokens([7, 4, 1], device=device)
    out = block(tokens)
    for b, n in enumerate([7, 4, 1]):
        alone = _reference_block(block, tokens.x[b : b + 1, :n])
        torch.testing.assert_close(out.x[b : b + 1, :n], alone, atol=ATOL, rtol=1e-4)
        assert out.x[b, n:].abs().max().item() == 0.0 if n < 7 else True
    assert torch.equal(out.mask, tokens.mask)


def test_transformer_block_padding_invariance():
    block = TransformerBlock(16, 4)
    tokens = _tokens([5, 2, 7])
    a = block(tokens).x
    b = block(_scramble_padding(tokens)).x
    assert torch.equal(a, b)
    assert a[1, 2:].abs().sum().item() == 0.0


def test_transformer_block_causal_matches_torch_causal_mask():
    block = TransformerBlock(16, 2, causal=True)
    x = torch.randn(2, 5, 16)
    hidden = torch.ones(5, 5, dtype=torch.bool).triu(1)  # True = not allowed
    expected = _reference_block(block, x, attn_mask=hidden)
    torch.testing.assert_close(block(Tokens(x)).x, expected, atol=ATOL, rtol=1e-4)


def test_transformer_block_per_sample_attn_mask_is_repeated_per_head():
    block = TransformerBlock(16, 4)
    x = torch.randn(2, 5, 16)
    per_sample = torch.rand(2, 5, 5) > 0.6
    per_sample[:, torch.arange(5), torch.arange(5)] = False  # keep the diagonal allowed
    per_head = per_sample.repeat_interleave(4, dim=0)
    a = block(Tokens(x), attn_mask=per_sample).x
    b = block(Tokens(x), attn_mask=per_head).x
    torch.testing.assert_close(a, b)
    ref = torch.cat([_reference_block(block, x[i : i + 1], per_sample[i]) for i in range(2)])
    torch.testing.assert_close(a, ref, atol=ATOL, rtol=1e-4)


def test_transformer_block_local_equals_full_with_band_mask():
    torch.manual_seed(1)
    local = TransformerBlock(16, 2, attention="local", window_size=2)
    full = TransformerBlock(16, 2)
    full.load_state_dict(local.state_dict())
    tokens = _tokens([9, 6], length=9)
    band = ~band_mask(9, 2)  # module direction: True = not allowed
    torch.testing.assert_close(
        local(tokens).x, full(tokens, attn_mask=band).x, atol=ATOL, rtol=1e-4
    )


def test_transformer_block_gradients_finite_with_empty_sequence():
    block = TransformerBlock(16, 2)
    tokens = _tokens([3, 0])
    x = tokens.x.requires_grad_()
    out = block(Tokens(x, tokens.mask))
    out.x.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert x.grad[1].abs().sum().item() == 0.0
    assert all(torch.isfinite(p.grad).all() for p in block.parameters() if p.grad is not None)


def test_transformer_block_errors():
    block = TransformerBlock(16, 2)
    with pytest.raises(TypeError, match="tokens must be mmattn.Tokens"):
        block(torch.randn(2, 3, 16))
    with pytest.raises(ValueError, match="embed_dim=16"):
        block(Tokens(torch.randn(2, 3, 8)))
    with pytest.raises(ValueError, match="attn_mask must have shape"):
        block(Tokens(torch.randn(2, 3, 16)), attn_mask=torch.zeros(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attention must be one of the registered names \["
                                         r"'additive', .*'full', 'linformer', 'local'.*'sparse'"):
        TransformerBlock(16, 2, attention="sparse")
    with pytest.raises(ValueError, match="window_size must be given for attention='local'"):
        TransformerBlock(16, 2, attention="local")
    with pytest.raises(TypeError, match=r"causal must be a bool, got NoneType"):
        TransformerBlock(16, 2, causal=None)
    with pytest.raises(ValueError, match="window_size is not an argument of attention='full'"):
        TransformerBlock(16, 2, window_size=3)
    with pytest.raises(ValueError, match="mlp_ratio"):
        TransformerBlock(16, 2, mlp_ratio=0)
    with pytest.raises(ValueError, match="num_heads must divide"):
        TransformerBlock(16, 3)


def test_transformer_block_repr_and_reset():
    block = TransformerBlock(16, 2, mlp_ratio=2.0)
    assert "embed_dim=16, num_heads=2, mlp_ratio=2.0, attention='full'" in repr(block)
    with torch.no_grad():
        block.mlp[0].weight.zero_()
        block.norm1.weight.zero_()
    block.reset_parameters()
    assert block.mlp[0].weight.abs().sum() > 0
    assert torch.equal(block.norm1.weight, torch.ones(16))


# ---------------------------------------------------------------- CrossAttentionBlock


def _reference_cross(block: CrossAttentionBlock, q: torch.Tensor, c: torch.Tensor):
    torch_attn = block.attn.to_torch()
    cn = _ln(c, block.norm_context)
    x = q + torch_attn(_ln(q, block.norm_query), cn, cn, need_weights=False)[0]
    return x + _mlp(_ln(x, block.norm2), block.mlp)


def test_cross_block_matches_reference_per_sequence(device):
    block = CrossAttentionBlock(16, 4, kdim=8).to(device)
    query = _tokens([5, 3], length=5, device=device)
    context = _tokens([2, 9], length=9, dim=8, device=device)
    out = block(query, context)
    for b, (nq, nc) in enumerate([(5, 2), (3, 9)]):
        ref = _reference_cross(block, query.x[b : b + 1, :nq], context.x[b : b + 1, :nc])
        torch.testing.assert_close(out.x[b : b + 1, :nq], ref, atol=ATOL, rtol=1e-4)
    assert out.x[1, 3:].abs().sum().item() == 0.0
    assert torch.equal(out.mask, query.mask)


def test_cross_block_context_padding_invariance():
    block = CrossAttentionBlock(16, 2)
    query, context = _tokens([4, 6], length=6), _tokens([3, 1], length=5)
    a = block(query, context).x
    b = block(_scramble_padding(query), _scramble_padding(context)).x
    assert torch.equal(a, b)


def test_cross_block_fully_padded_context_gives_finite_output():
    block = CrossAttentionBlock(16, 2)
    query, context = _tokens([4, 4], length=4), _tokens([3, 0], length=5)
    out = block(query, context).x
    assert torch.isfinite(out).all()
    # no context: attention adds only out_proj's bias
    x = query.x[1:2]
    x = x + block.attn.out_proj.bias
    torch.testing.assert_close(out[1:2], x + _mlp(_ln(x, block.norm2), block.mlp))


def test_cross_block_errors():
    block = CrossAttentionBlock(16, 2, kdim=8)
    with pytest.raises(TypeError, match="context must be mmattn.Tokens"):
        block(Tokens(torch.randn(2, 3, 16)), torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="kdim=8"):
        block(Tokens(torch.randn(2, 3, 16)), Tokens(torch.randn(2, 3, 16)))
    with pytest.raises(ValueError, match="same batch size"):
        block(Tokens(torch.randn(2, 3, 16)), Tokens(torch.randn(3, 3, 8)))
    assert "kdim=8" in repr(block)


# ---------------------------------------------------------------- Encoder


def test_encoder_is_blocks_then_norm():
    enc = Encoder(16, 3, 2)
    tokens = _tokens([6, 2], length=6)
    x = tokens
    for block in enc.blocks:
        x = block(x)
    expected = _ln(x.x, enc.norm) * tokens.mask[..., None]
    torch.testing.assert_close(enc(tokens).x, expected)
    assert len(enc.blocks) == 3
    assert torch.equal(enc(tokens).x, enc(_scramble_padding(tokens)).x)


def test_encoder_keeps_meta_and_checks_depth():
    enc = Encoder(16, 1, 2, final_norm=False)
    out = enc(Tokens(torch.randn(1, 3, 16), meta={"grid": (1, 3)}))
    assert out.meta == {"grid": (1, 3)}
    assert isinstance(enc.norm, nn.Identity)
    with pytest.raises(ValueError, match="depth must be >= 1"):
        Encoder(16, 0, 2)
    with pytest.raises(TypeError, match="depth must be an int"):
        Encoder(16, 1.5, 2)


# ---------------------------------------------------------------- pooling


def test_masked_mean_and_max_equal_per_sequence_reductions():
    tokens = _scramble_padding(_tokens([7, 3, 1]))
    mean, top = masked_mean(tokens), masked_max(tokens)
    for b, n in enumerate([7, 3, 1]):
        torch.testing.assert_close(mean[b], tokens.x[b, :n].mean(0))
        torch.testing.assert_close(top[b], tokens.x[b, :n].amax(0))
    torch.testing.assert_close(MaskedPool("mean")(tokens), mean)
    torch.testing.assert_close(MaskedPool("max")(tokens), top)
    torch.testing.assert_close(MaskedPool("first")(tokens), tokens.x[:, 0])


def test_pooling_empty_sequence_is_zero_and_unmasked_is_plain():
    tokens = _tokens([2, 0])
    assert masked_mean(tokens)[1].abs().sum() == 0
    assert masked_max(tokens)[1].abs().sum() == 0
    plain = Tokens(torch.randn(2, 4, 3))
    torch.testing.assert_close(masked_mean(plain), plain.x.mean(1))
    torch.testing.assert_close(masked_max(plain), plain.x.amax(1))


def test_attention_pool_is_padding_invariant_and_matches_cross_attention():
    pool = AttentionPool(16, 2)
    tokens = _tokens([5, 2])
    out = pool(tokens)
    assert torch.equal(out, pool(_scramble_padding(tokens)))
    torch_attn = pool.attn.to_torch()
    for b, n in enumerate([5, 2]):
        ref = torch_attn(pool.query, tokens.x[b : b + 1, :n], tokens.x[b : b + 1, :n])[0]
        torch.testing.assert_close(out[b], ref[0, 0], atol=ATOL, rtol=1e-4)


def test_pooling_errors():
    with pytest.raises(ValueError, match="mode must be one of"):
        MaskedPool("sum")
    with pytest.raises(TypeError, match="tokens must be mmattn.Tokens"):
        masked_mean(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="embed_dim=16"):
        AttentionPool(16)(Tokens(torch.randn(2, 3, 4)))
