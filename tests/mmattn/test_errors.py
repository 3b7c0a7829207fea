"""Bad input raises ValueError / TypeError naming the argument, at the public boundary."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mmattn import CrossAttention, MultiHeadAttention, Tokens, TransformerBlock, masks
from mmattn import functional as MF
from mmattn.kernels import dense

E, H = 16, 4


def _mha(**kw):
    return MultiHeadAttention(E, H, **kw)


x = torch.randn(2, 5, E)

CONSTRUCTOR_CASES = [
    (lambda: MultiHeadAttention(10, 3), ValueError, r"num_heads must divide embed_dim.*10.*3"),
    (lambda: MultiHeadAttention(0, 1), ValueError, r"embed_dim must be >= 1, got 0"),
    (lambda: MultiHeadAttention(16, 2.0), TypeError, r"num_heads must be an int, got float"),
    (lambda: MultiHeadAttention(16, 4, dropout=1.5), ValueError, r"dropout must be in \[0, 1\)"),
    (lambda: MultiHeadAttention(16, 4, kdim=-3), ValueError, r"kdim must be >= 1, got -3"),
    (lambda: MultiHeadAttention.from_torch(nn.Linear(2, 2)), TypeError,
     r"module must be a torch.nn.MultiheadAttention, got Linear"),
]

FORWARD_CASES = [
    (lambda m: m(x.tolist()), TypeError, r"query must be a torch.Tensor, got list"),
    (lambda m: m(torch.ones(2, 5, E, dtype=torch.long)), TypeError,
     r"query must have a floating-point dtype, got torch.int64"),
    (lambda m: m(torch.randn(1, 2, 5, E)), ValueError, r"query must be a 2 or 3-D tensor.*4-D"),
    (lambda m: m(torch.randn(2, 5, 8)), ValueError,
     r"query must have last dimension embed_dim=16, got shape \(2, 5, 8\)"),
    (lambda m: m(x, torch.randn(2, 5, 7)), ValueError, r"key must have last dimension kdim=16"),
    (lambda m: m(x, x, torch.randn(2, 5, 3)), ValueError,
     r"value must have last dimension vdim=16"),
    (lambda m: m(x, torch.randn(2, 6, E), torch.randn(2, 7, E)), ValueError,
     r"key and value must have the same length"),
    (lambda m: m(x, torch.randn(3, 5, E)), ValueError, r"same batch size"),
    (lambda m: m(x, torch.randn(5, E)), ValueError, r"key must have the same rank as query"),
    (lambda m: m(x, x.double()), TypeError, r"key has dtype torch.float64 but query"),
    (lambda m: m(x.double()), TypeError, r"query has dtype torch.float64 but the module's"),
    (lambda m: m(x, x.to("meta")), ValueError, r"key is on device meta but query is on"),
    (lambda m: m(x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)), ValueError,
     r"key_padding_mask must have shape \(2, 5\).*got \(2, 4\)"),
    (lambda m: m(x, key_padding_mask=torch.zeros(2, 5, dtype=torch.int32)), TypeError,
     r"key_padding_mask must have dtype torch.bool or a floating dtype, got torch.int32"),
    (lambda m: m(x, attn_mask=torch.zeros(5, 6, dtype=torch.bool)), ValueError,
     r"attn_mask must have shape \(5, 5\) or \(8, 5, 5\).*got \(5, 6\)"),
    (lambda m: m(x, attn_mask=torch.zeros(2, 5, 5, dtype=torch.bool)), ValueError,
     r"attn_mask must have shape .*batch \* num_heads.*got \(2, 5, 5\)"),
    (lambda m: m(x, attn_mask=torch.zeros(5, 5, dtype=torch.uint8)), TypeError,
     r"attn_mask must have dtype torch.bool or a floating dtype, got torch.uint8"),
    (lambda m: m(x, attn_mask=torch.zeros(5, 5, dtype=torch.bool, device="meta")), ValueError,
     r"attn_mask is on device meta"),
]


@pytest.mark.parametrize("build, error, message", CONSTRUCTOR_CASES)
def test_constructor_rejects(build, error, message):
    with pytest.raises(error, match=message):
        build()


@pytest.mark.parametrize("call, error, message", FORWARD_CASES)
def test_forward_rejects(call, error, message):
    with pytest.raises(error, match=message):
        call(_mha())


def test_cross_attention_rejects_missing_context():
    with pytest.raises(TypeError, match="CrossAttention.forward requires key"):
        CrossAttention(E, H)(x)


q = torch.randn(2, 4, 5, 8)

FUNCTIONAL_CASES = [
    (lambda: MF.scaled_dot_product_attention(q, q[..., :6], q), ValueError,
     r"key must have the same last dimension as query \(8\)"),
    (lambda: MF.scaled_dot_product_attention(q, q, q[..., :3, :]), ValueError,
     r"value must have the same length as key \(5\)"),
    (lambda: MF.scaled_dot_product_attention(q, q[0], q[0]), ValueError,
     r"query, key and value must have the same rank"),
    (lambda: MF.scaled_dot_product_attention(q, q[:1], q[:1]), ValueError,
     r"must share leading \(batch, head\) dimensions"),
    (lambda: MF.scaled_dot_product_attention(q, q, q, torch.ones(3, 5, dtype=torch.bool)),
     ValueError, r"attn_mask must broadcast to \(\.\.\., L, S\) = \(2, 4, 5, 5\), got \(3, 5\)"),
    (lambda: MF.scaled_dot_product_attention(q, q, q, torch.ones(5, 5, dtype=torch.long)),
     TypeError, r"attn_mask must have dtype torch.bool or a floating dtype"),
    (lambda: MF.scaled_dot_product_attention(q, q, q, dropout_p=1.0), ValueError,
     r"dropout_p must be in \[0, 1\), got 1.0"),
    (lambda: MF.scaled_dot_product_attention(q.half(), q, q), TypeError,
     r"key has dtype torch.float32 but query has dtype torch.float16"),
    (lambda: MF.scaled_dot_product_attention(q.long(), q, q), TypeError,
     r"query must have a floating-point dtype"),
]


@pytest.mark.parametrize("call, error, message", FUNCTIONAL_CASES)
def test_functional_rejects(call, error, message):
    with pytest.raises(error, match=message):
        call()


OTHER_CASES = [
    (lambda: Tokens(torch.randn(2, 5)), ValueError, r"Tokens.x must be a 3-D tensor"),
    (lambda: Tokens(torch.randn(2, 5, 4), torch.ones(2, 5)), TypeError,
     r"Tokens.mask must have dtype torch.bool"),
    (lambda: Tokens(torch.randn(2, 5, 4), torch.ones(2, 4, dtype=torch.bool)), ValueError,
     r"Tokens.mask must have shape \(2, 5\)"),
    (lambda: Tokens(torch.ones(2, 5, 4, dtype=torch.long)), TypeError,
     r"Tokens.x must have a floating-point dtype"),
    (lambda: Tokens.cat([]), ValueError, r"Tokens.cat needs at least one part"),
    (lambda: Tokens.cat([Tokens(torch.randn(2, 3, 4)), Tokens(torch.randn(2, 3, 5))]),
     ValueError, r"Tokens.cat part 1 has \(batch, dim\)=\(2, 5\), expected \(2, 4\)"),
    (lambda: masks.band_mask(4, -1), ValueError, r"window_size must be >= 0, got -1"),
    (lambda: masks.band_mask(4, 1.5), TypeError, r"window_size must be an int, got float"),
    (lambda: masks.padding_mask(torch.tensor([1.0, 2.0])), TypeError,
     r"lengths must have an integer dtype"),
    (lambda: masks.padding_mask(torch.tensor([3, 5]), max_len=4), ValueError,
     r"lengths must be <= max_len=4, got a length of 5"),
    (lambda: masks.to_bool(torch.tensor([0.0, 1.5])), ValueError,
     r"mask must hold only 0 and -inf"),
    (lambda: masks.invert(torch.zeros(3)), TypeError, r"mask must have dtype torch.bool"),
    # issue 29 (fuzz): a device string torch cannot parse gave torch's RuntimeError, and the
    # dense kernel took integer or mixed-dtype tensors (silent on an empty batch)
    (lambda: MultiHeadAttention(E, H, device="nope"), ValueError,
     r"device must name a device such as 'cpu' or 'cuda:0', got 'nope'"),
    (lambda: TransformerBlock(E, H, device=3.0), TypeError,
     r"device must be a torch.device, a device string or None, got float 3.0"),
    (lambda: masks.neighborhood_mask((2, 2), 1, device="nope"), ValueError,
     r"device must name a device"),
    (lambda: masks.band_mask(4, 1, device="nope"), ValueError, r"device must name a device"),
    (lambda: masks.causal_mask(4, device="cpux"), ValueError, r"device must name a device"),
    (lambda: dense.attend(q.long(), q, q, None), TypeError,
     r"q must have a floating-point dtype, got torch.int64"),
    (lambda: dense.attend(q[:0].long(), q[:0], q[:0], None), TypeError,
     r"q must have a floating-point dtype"),
    (lambda: dense.attend(q, q.double(), q, None), TypeError,
     r"k has dtype torch.float64 but q has dtype torch.float32"),
]


@pytest.mark.parametrize("call, error, message", OTHER_CASES)
def test_other_public_functions_reject(call, error, message):
    with pytest.raises(error, match=message):
        call()
