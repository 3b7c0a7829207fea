"""AdditiveAttention against a naive per-element Bahdanau loop."""

from __future__ import annotations

import pytest
import torch

import mmattn.attention.additive as additive_module
from mmattn import AdditiveAttention
from mmattn.functional import fused_attn


def naive(module: AdditiveAttention, query, key, value, kpm=None, attn_mask=None):
    """Loop over batch, head, query and key; mask True = not allowed (module direction)."""
    h, e = module.num_heads, module.head_dim
    q = module.q_proj(query)
    k = module.k_proj(key)
    v = module.v_proj(value)
    batch, length, keys = query.shape[0], query.shape[1], key.shape[1]
    out = torch.zeros(batch, h, length, e, dtype=query.dtype)
    weights = torch.zeros(batch, h, length, keys, dtype=query.dtype)
    for b in range(batch):
        for hh in range(h):
            sl = slice(hh * e, (hh + 1) * e)
            for i in range(length):
                scores = []
                for j in range(keys):
                    s = (module.score_weight[hh] * torch.tanh(q[b, i, sl] + k[b, j, sl])).sum()
                    hidden = (kpm is not None and kpm[b, j]) or (
                        attn_mask is not None and attn_mask[i, j]
                    )
                    scores.append(s if not hidden else torch.tensor(float("-inf"), dtype=s.dtype))
                scores = torch.stack(scores)
                if torch.isinf(scores).all():
                    continue  # a row with no allowed key: zero result and weights
                w = torch.softmax(scores, dim=0)
                weights[b, hh, i] = w
                out[b, hh, i] = w @ v[b, :, sl]
    merged = out.permute(0, 2, 1, 3).reshape(batch, length, h * e)
    return module.out_proj(merged), weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_equals_naive_loop_with_masks_and_different_widths(device, dtype):
    module = AdditiveAttention(8, 2, kdim=5, vdim=3, dtype=dtype).to(device)
    query = torch.randn(2, 4, 8, dtype=dtype, device=device)
    key = torch.randn(2, 6, 5, dtype=dtype, device=device)
    value = torch.randn(2, 6, 3, dtype=dtype, device=device)
    kpm = torch.zeros(2, 6, dtype=torch.bool, device=device)
    kpm[0, 4:] = True
    attn_mask = torch.zeros(4, 6, dtype=torch.bool, device=device)
    attn_mask[1, :4] = True  # row 1 of sample 0 has no allowed key
    with torch.no_grad():
        ref, ref_w = naive(module.cpu(), query.cpu(), key.cpu(), value.cpu(), kpm.cpu(),
                           attn_mask.cpu())
        module.to(device)
        tol = 1e-5 if dtype == torch.float32 else 1e-10
        for fused in (True, False):
            with fused_attn(fused):
                out, w = module(query, key, value, key_padding_mask=kpm, attn_mask=attn_mask,
                                need_weights=True, average_attn_weights=False)
                torch.testing.assert_close(out.cpu(), ref, atol=tol, rtol=tol)
                torch.testing.assert_close(w.cpu(), ref_w, atol=tol, rtol=tol)
                out2, _ = module(query, key, value, key_padding_mask=kpm, attn_mask=attn_mask)
                torch.testing.assert_close(out2.cpu(), ref, atol=tol, rtol=tol)
    # Sample 0, query 1: no allowed key -> output is exactly out_proj's bias.
    torch.testing.assert_close(out[0, 1], module.out_proj.bias, atol=1e-6, rtol=1e-6)


def test_chunked_path_equals_explicit_and_grads(monkeypatch):
    monkeypatch.setattr(additive_module, "CHUNK_ELEMENTS", 50)  # forces many query chunks
    module = AdditiveAttention(8, 2, dtype=torch.float64)
    x = torch.randn(2, 7, 8, dtype=torch.float64)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[1, 3:] = True
    grads = []
    outs = []
    for fused in (True, False):
        module.zero_grad()
        with fused_attn(fused):
            out = module(x, key_padding_mask=kpm, is_causal=True)[0]
        out.square().sum().backward()
        outs.append(out)
        grads.append([p.grad.clone() for p in module.parameters()])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-12, rtol=1e-12)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_causal_equals_naive_with_triangle():
    module = AdditiveAttention(8, 2, dtype=torch.float64)
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    hidden = torch.ones(5, 5, dtype=torch.bool).triu(1)
    with torch.no_grad():
        ref, _ = naive(module, x, x, x, attn_mask=hidden)
        torch.testing.assert_close(module(x, is_causal=True)[0], ref, atol=1e-10, rtol=1e-10)


def test_gradcheck_float64_with_dead_rows():
    module = AdditiveAttention(4, 2, dtype=torch.float64)
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    kpm = torch.zeros(2, 3, dtype=torch.bool)
    kpm[1] = True  # sample 1: every key is padding
    assert torch.autograd.gradcheck(lambda t: module(t, key_padding_mask=kpm)[0], (x,))
    out = module(x, key_padding_mask=kpm)[0]
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    torch.testing.assert_close(out[1], module.out_proj.bias.expand(3, 4), atol=1e-12, rtol=1e-12)


def test_padded_values_do_not_move_real_outputs():
    module = AdditiveAttention(8, 2)
    x = torch.randn(2, 6, 8)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[:, 4:] = True
    changed = x.clone()
    changed[:, 4:] = 100 * torch.randn(2, 2, 8)
    a = module(x, key_padding_mask=kpm)[0][:, :4]
    b = module(changed, key_padding_mask=kpm)[0][:, :4]
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_repr_reset_and_not_a_torch_module():
    module = AdditiveAttention(8, 2)
    assert "score=additive" in repr(module)
    before = module.score_weight.clone()
    module.reset_parameters()
    assert not torch.equal(before, module.score_weight)
    assert module.score_weight.shape == (2, 4)
    with pytest.raises(NotImplementedError, match="dot-product"):
        module.to_torch()


def test_bad_inputs():
    with pytest.raises(ValueError, match="num_heads must divide embed_dim"):
        AdditiveAttention(10, 3)
    module = AdditiveAttention(8, 2, kdim=5, vdim=5)
    with pytest.raises(ValueError, match="key must have last dimension kdim=5"):
        module(torch.randn(2, 3, 8), torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match="attn_mask must have shape"):
        module(torch.randn(2, 3, 8), torch.randn(2, 4, 5),
               attn_mask=torch.zeros(3, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask must have dtype"):
        module(torch.randn(2, 3, 8), torch.randn(2, 4, 5),
               key_padding_mask=torch.zeros(2, 4, dtype=torch.long))


@pytest.mark.parametrize("fused", [True, False], ids=["chunked", "explicit"])
def test_compiles_fullgraph_with_masks(fused):
    """The explicit path never masks in place on a tracked or strided view (issue 9, item 8)."""
    attn = AdditiveAttention(16, 2, kdim=6, vdim=6, num_kv_heads=1)
    q, kv = torch.randn(2, 5, 16), torch.randn(2, 7, 6)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[0, 4:] = True
    kpm[1] = True  # a sample without any real key
    band = torch.rand(5, 7) > 0.7
    torch._dynamo.reset()
    compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")
    with fused_attn(fused):
        want, want_w = attn(q, kv, key_padding_mask=kpm, attn_mask=band, need_weights=True)
        got, got_w = compiled(q, kv, key_padding_mask=kpm, attn_mask=band, need_weights=True)
        plain, _ = compiled(q, kv, key_padding_mask=kpm)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_w, want_w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain, attn(q, kv, key_padding_mask=kpm)[0], atol=1e-5, rtol=1e-5)
    got.square().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in attn.parameters())
