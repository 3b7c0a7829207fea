"""LinformerAttention against MultiHeadAttention (identity projections) and a direct formula."""

from __future__ import annotations

import pytest
import torch

from mmattn import LinformerAttention, MultiHeadAttention
from mmattn.functional import fused_attn


def identity_pair(seq_len=8, dtype=torch.float64, device="cpu", share_kv=False):
    lin = LinformerAttention(16, 4, seq_len, seq_len, share_kv=share_kv, dtype=dtype,
                             device=device)
    with torch.no_grad():
        lin.key_seq_proj.copy_(torch.eye(seq_len))
        if lin.value_seq_proj is not None:
            lin.value_seq_proj.copy_(torch.eye(seq_len))
    dense = MultiHeadAttention(16, 4, dtype=dtype, device=device)
    dense.load_state_dict(lin.state_dict(), strict=False)
    return lin, dense


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("length", [8, 5])  # = seq_len, and shorter
def test_identity_projection_equals_multihead(device, dtype, length):
    lin, dense = identity_pair(8, dtype, device)
    x = torch.randn(3, length, 16, dtype=dtype, device=device)
    kpm = torch.zeros(3, length, dtype=torch.bool, device=device)
    kpm[1, 3:] = True
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    ref, ref_w = dense(x, key_padding_mask=kpm, need_weights=True, average_attn_weights=False)
    for fused in (True, False):
        with fused_attn(fused):
            out, _ = lin(x, key_padding_mask=kpm)
            torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    out, w = lin(x, key_padding_mask=kpm, need_weights=True, average_attn_weights=False)
    assert w.shape == (3, 4, length, 8)
    torch.testing.assert_close(w[..., :length], ref_w, atol=tol, rtol=tol)
    assert torch.all(w[..., length:] == 0)


def test_random_projection_equals_formula():
    lin = LinformerAttention(8, 2, 10, 4, kdim=6, vdim=5, dtype=torch.float64)
    query = torch.randn(2, 3, 8, dtype=torch.float64)
    key = torch.randn(2, 7, 6, dtype=torch.float64)
    value = torch.randn(2, 7, 5, dtype=torch.float64)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[0, 5:] = True
    with torch.no_grad():
        out, w = lin(query, key, value, key_padding_mask=kpm, need_weights=True,
                     average_attn_weights=False)
        real = (~kpm).double()[:, :, None]
        for b in range(2):
            q = lin.q_proj(query[b]).view(3, 2, 4).transpose(0, 1)  # (h, i, e)
            k = (lin.k_proj(key[b]) * real[b])
            v = (lin.v_proj(value[b]) * real[b])
            kp = (lin.key_seq_proj[:, :7] @ k).view(4, 2, 4).transpose(0, 1)  # (h, p, e)
            vp = (lin.value_seq_proj[:, :7] @ v).view(4, 2, 4).transpose(0, 1)
            probs = torch.softmax(q @ kp.transpose(1, 2) / 2.0, dim=-1)
            torch.testing.assert_close(w[b], probs, atol=1e-10, rtol=1e-10)
            ref = lin.out_proj((probs @ vp).transpose(0, 1).reshape(3, 8))
            torch.testing.assert_close(out[b], ref, atol=1e-10, rtol=1e-10)


def test_padding_equals_truncated_input_and_never_leaks():
    lin = LinformerAttention(16, 4, 12, 5, share_kv=True)
    x = torch.randn(2, 10, 16)
    kpm = torch.zeros(2, 10, dtype=torch.bool)
    kpm[:, 6:] = True
    padded, _ = lin(x, key_padding_mask=kpm)
    truncated, _ = lin(x[:, :6])
    torch.testing.assert_close(padded[:, :6], truncated, atol=1e-5, rtol=1e-5)
    changed = x.clone()
    changed[:, 6:] = 1e3 * torch.randn(2, 4, 16)
    moved = lin(changed, key_padding_mask=kpm)[0]
    torch.testing.assert_close(moved[:, :6], padded[:, :6], atol=1e-4, rtol=1e-4)
    # The same with a float 0 / -inf key padding mask.
    additive = torch.zeros(2, 10).masked_fill(kpm, float("-inf"))
    torch.testing.assert_close(lin(x, key_padding_mask=additive)[0], padded, atol=1e-6,
                               rtol=1e-6)


def test_fully_padded_sample_gives_bias_and_finite_grads():
    lin = LinformerAttention(8, 2, 6, 3, dtype=torch.float64)
    x = torch.randn(2, 4, 8, dtype=torch.float64, requires_grad=True)
    kpm = torch.zeros(2, 4, dtype=torch.bool)
    kpm[1] = True
    out = lin(x, key_padding_mask=kpm)[0]
    torch.testing.assert_close(out[1], lin.out_proj.bias.expand(4, 8), atol=1e-12, rtol=1e-12)
    out.sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(lin.key_seq_proj.grad).all()
    assert torch.autograd.gradcheck(lambda t: lin(t, key_padding_mask=kpm)[0], (x.detach()
                                    .requires_grad_(),))


def test_repr_and_reset():
    lin = LinformerAttention(8, 2, 6, 3, share_kv=True)
    assert "seq_len=6" in repr(lin) and "proj_len=3" in repr(lin) and "share_kv" in repr(lin)
    assert lin.value_seq_proj is None
    before = lin.key_seq_proj.clone()
    lin.reset_parameters()
    assert not torch.equal(before, lin.key_seq_proj)


def test_bad_inputs():
    with pytest.raises(TypeError, match="seq_len must be an int"):
        LinformerAttention(8, 2, 6.0, 3)
    with pytest.raises(ValueError, match="proj_len must be >= 1"):
        LinformerAttention(8, 2, 6, 0)
    with pytest.raises(TypeError, match=r"share_kv must be a bool, got str"):
        LinformerAttention(8, 2, 6, 3, share_kv="no")
    lin = LinformerAttention(8, 2, 6, 3)
    with pytest.raises(ValueError, match="key length must be <= seq_len=6"):
        lin(torch.randn(2, 7, 8))
    with pytest.raises(ValueError, match="attn_mask is not supported"):
        lin(torch.randn(2, 4, 8), attn_mask=torch.zeros(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="is_causal=True is not supported"):
        lin(torch.randn(2, 4, 8), is_causal=True)
    with pytest.raises(ValueError, match="key_padding_mask for LinformerAttention"):
        lin(torch.randn(2, 4, 8), key_padding_mask=torch.randn(2, 4))
