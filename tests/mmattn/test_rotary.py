"""mmattn.rotary: RoPE's bad inputs, tensor offsets, and ``position=`` inside attention.

(Numerical checks of the rotation itself — complex-number reference, relative positions —
are in test_position.py, which tests the re-exported names.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange

import mmattn.position
import mmattn.rotary
from mmattn import (
    AdditiveAttention,
    CrossAttention,
    LinformerAttention,
    LocalAttention,
    MultiHeadAttention,
)
from mmattn.functional import fused_attn
from mmattn.rotary import RotaryEmbedding, apply_rotary, rotary_cos_sin


def test_position_re_exports_rotary():
    for name in ("RotaryEmbedding", "apply_rotary", "rotary_cos_sin"):
        assert getattr(mmattn.position, name) is getattr(mmattn.rotary, name)
        assert name in mmattn.position.__all__


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: apply_rotary([[1.0, 2.0]], *rotary_cos_sin(1, 2)), TypeError,
         "x must be a torch.Tensor, got list"),
        (lambda: apply_rotary(torch.randn(3, 4), [0.0], torch.ones(3, 4)), TypeError,
         "cos must be a torch.Tensor, got list"),
        (lambda: apply_rotary(torch.randn(3, 5), torch.ones(3, 5), torch.ones(3, 5)),
         ValueError, r"x.shape\[-1\] must be divisible by 2, got 5"),
        (lambda: rotary_cos_sin(4, 8, base=0), ValueError,
         "base must be a number > 0 and != 1, got 0"),
        (lambda: rotary_cos_sin(4, 8, base=-2.0), ValueError, "base must be a number > 0"),
        (lambda: rotary_cos_sin(4, 8, base="big"), TypeError, "base must be a number > 0, got str"),
        (lambda: rotary_cos_sin(4, 8, offset=0.5), TypeError, r"offset must be an int, got float"),
        (lambda: rotary_cos_sin(4, 8, offset=-1), ValueError, "offset must be >= 0, got -1"),
        (lambda: rotary_cos_sin(4, 8, offset=torch.tensor(0.5)), TypeError,
         "offset must be an int or a 0-D integer tensor"),
        (lambda: rotary_cos_sin(4, 7), ValueError, "dim must be divisible by 2, got 7"),
        (lambda: RotaryEmbedding(7), ValueError, "dim must be divisible by 2, got 7"),
        (lambda: RotaryEmbedding(8, base=0), ValueError, "base must be a number > 0"),
        (lambda: RotaryEmbedding(8)(torch.randn(2, 3, 8), offset=-3), ValueError,
         "offset must be >= 0, got -3"),
        (lambda: RotaryEmbedding(8)(torch.randn(2, 3, 6)), ValueError, "last dimension dim=8"),
    ],
)
def test_bad_input_raises_named_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_tensor_offset_equals_int_offset():
    rope = RotaryEmbedding(8)
    x = torch.randn(2, 3, 5, 8)
    torch.testing.assert_close(rope(x, torch.tensor(7)), rope(x, 7), atol=0, rtol=0)
    torch.testing.assert_close(rope(x[:, :, 2:], 2), rope(x)[:, :, 2:], atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------- position= in attention


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_rotary_attention_equals_manual_reference(device, fused):
    mha = MultiHeadAttention(32, 4, position="rotary", num_kv_heads=2, device=device)
    x = torch.randn(2, 9, 32, device=device)
    rope = RotaryEmbedding(8)
    q = rope(rearrange(mha.q_proj(x), "b l (h e) -> b h l e", h=4))
    k = rope(rearrange(mha.k_proj(x), "b l (h e) -> b h l e", h=2))
    v = rearrange(mha.v_proj(x), "b l (h e) -> b h l e", h=2)
    k, v = (t.repeat_interleave(2, dim=1) for t in (k, v))
    want = mha.out_proj(rearrange(
        F.scaled_dot_product_attention(q, k, v, is_causal=True), "b h l e -> b l (h e)"
    ))
    with fused_attn(fused):
        out, _ = mha(x, is_causal=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_rotary_local_attention_equals_full_with_band():
    local = LocalAttention(32, 4, window_size=3, position=RotaryEmbedding(8))
    full = MultiHeadAttention(32, 4, position="rotary")
    full.load_state_dict(local.state_dict())
    x = torch.randn(2, 20, 32)
    band = (torch.arange(20)[:, None] - torch.arange(20)[None, :]).abs() > 3
    torch.testing.assert_close(local(x)[0], full(x, attn_mask=band)[0], atol=1e-5, rtol=1e-5)


def test_rotary_makes_self_attention_shift_invariant():
    """With RoPE only, a sequence attends the same way wherever it sits: equal results."""
    mha = MultiHeadAttention(16, 2, position="rotary", bias=False)
    x = torch.randn(1, 6, 16)
    out, weights = mha(x, need_weights=True)
    padded = torch.cat([torch.randn(1, 3, 16), x], dim=1)
    kpm = torch.tensor([[True] * 3 + [False] * 6])
    out2, weights2 = mha(padded, key_padding_mask=kpm, need_weights=True)
    torch.testing.assert_close(out2[:, 3:], out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights2[:, 3:, 3:], weights, atol=1e-5, rtol=1e-5)


def test_position_accepts_any_module_called_with_offset():
    calls = []

    class Tag(torch.nn.Module):
        def forward(self, x, offset):
            calls.append((tuple(x.shape), offset))
            return x

    mha = MultiHeadAttention(16, 2, position=Tag())
    mha(torch.randn(1, 4, 16))
    assert calls == [((1, 2, 4, 8), 0), ((1, 2, 4, 8), 0)]
    assert isinstance(AdditiveAttention(16, 2, position="rotary").position, RotaryEmbedding)


def test_position_errors_at_construction():
    with pytest.raises(ValueError, match=r"even head width .* head_dim=5"):
        MultiHeadAttention(20, 4, position="rotary")
    with pytest.raises(ValueError, match=r"head_dim=5 .* dim=4"):
        LocalAttention(20, 4, 2, position=RotaryEmbedding(4))
    with pytest.raises(ValueError, match="position must be 'rotary' or a module, got 'alibi'"):
        MultiHeadAttention(16, 2, position="alibi")
    with pytest.raises(TypeError, match="position must be a module called as"):
        MultiHeadAttention(16, 2, position=3)
    with pytest.raises(ValueError, match="not supported by LinformerAttention"):
        LinformerAttention(16, 2, seq_len=8, proj_len=4, position="rotary")
    with pytest.raises(ValueError, match="not supported by CrossAttention"):
        CrossAttention(16, 2, position="rotary")
