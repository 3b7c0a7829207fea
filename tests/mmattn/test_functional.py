"""mmattn.functional against torch's SDPA and a naive softmax(QKᵀ/√d)V."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mmattn.functional import fused_attn, scaled_dot_product_attention, use_fused_attn


def naive(q, k, v, allowed=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("fused", [True, False])
def test_matches_naive_and_torch_sdpa(device, fused):
    q = torch.randn(2, 3, 6, 8, device=device)
    k = torch.randn(2, 3, 9, 8, device=device)
    v = torch.randn(2, 3, 9, 5, device=device)
    allowed = torch.rand(2, 1, 6, 9, device=device) > 0.3
    allowed[..., 0] = True  # every row has a key, so torch is defined everywhere
    with fused_attn(fused):
        out = scaled_dot_product_attention(q, k, v, allowed)
        plain = scaled_dot_product_attention(q, k, v)
        causal = scaled_dot_product_attention(q, k, v, is_causal=True)
        additive = scaled_dot_product_attention(
            q, k, v, torch.zeros(6, 9, device=device).masked_fill(~allowed[0, 0], -math.inf)
        )
    torch.testing.assert_close(out, naive(q, k, v, allowed), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, allowed))
    torch.testing.assert_close(plain, naive(q, k, v), atol=1e-5, rtol=1e-5)
    tril = torch.ones(6, 9, dtype=torch.bool, device=device).tril()
    torch.testing.assert_close(causal, naive(q, k, v, tril), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        additive, naive(q, k, v, allowed[0, 0].expand(2, 3, 6, 9)), atol=1e-5, rtol=1e-5
    )


def test_need_weights_returns_softmax_weights():
    q, k, v = torch.randn(4, 5, 8), torch.randn(4, 7, 8), torch.randn(4, 7, 8)
    out, w = scaled_dot_product_attention(q, k, v, need_weights=True)
    expected = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8), -1)
    torch.testing.assert_close(w, expected)
    torch.testing.assert_close(out, expected @ v)
    torch.testing.assert_close(w.sum(-1), torch.ones(4, 5))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_give_zero_and_finite_grads(device, fused, kind):
    q = torch.randn(2, 4, 8, device=device, requires_grad=True)
    k = torch.randn(2, 6, 8, device=device, requires_grad=True)
    v = torch.randn(2, 6, 8, device=device, requires_grad=True)
    allowed = torch.ones(2, 4, 6, dtype=torch.bool, device=device)
    allowed[0, 1] = False
    allowed[1] = False
    mask = allowed if kind == "bool" else torch.zeros(allowed.shape, device=device).masked_fill(
        ~allowed, -math.inf
    )
    with fused_attn(fused):
        out, w = scaled_dot_product_attention(q, k, v, mask, need_weights=True)
        out_fast = scaled_dot_product_attention(q, k, v, mask)
    assert (out[0, 1] == 0).all() and (out[1] == 0).all() and (w[1] == 0).all()
    torch.testing.assert_close(out_fast, out)
    live = naive(q[0, [0, 2, 3]], k[0], v[0])
    torch.testing.assert_close(out[0, [0, 2, 3]], live, atol=1e-5, rtol=1e-5)
    (out.sum() + out_fast.sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[1] == 0).all()


def test_gradcheck_float64():
    q = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    allowed = torch.rand(2, 3, 5) > 0.4
    allowed[0, 0] = False
    for fused in (True, False):
        with fused_attn(fused):
            assert torch.autograd.gradcheck(
                lambda q, k, v: scaled_dot_product_attention(q, k, v, allowed), (q, k, v)
            )


def test_switch_restores_previous_setting():
    before = use_fused_attn()
    with fused_attn(not before):
        assert use_fused_attn() is (not before)
    assert use_fused_attn() is before


def test_env_variable_forces_explicit_path():
    import subprocess
    import sys

    code = "import mmattn.functional as f; print(f.use_fused_attn())"
    env = {"MMATTN_FUSED_ATTN": "0", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


# --------------------------------------------------------------- learned biases (float masks)


def _naive_biased(q, k, v, bias):
    return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + bias, dim=-1) @ v


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("need_weights", [True, False])
def test_a_learned_float_mask_gets_its_gradient(need_weights, fused):
    """A relative-position bias is a float attn_mask that requires grad; q, k, v may not."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=gen) for _ in range(3))
    bias = torch.randn(5, 5, generator=gen, requires_grad=True)
    with fused_attn(fused):
        out = scaled_dot_product_attention(q, k, v, attn_mask=bias, need_weights=need_weights)
    out = out[0] if need_weights else out
    want = _naive_biased(q, k, v, bias)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    weight = torch.randn(out.shape, generator=gen)
    (got,) = torch.autograd.grad((out * weight).sum(), bias)
    (ref,) = torch.autograd.grad((want * weight).sum(), bias)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("need_weights", [True, False])
def test_a_frozen_module_trains_its_learned_attn_mask(need_weights, fused):
    from einops import rearrange

    from mmattn import MultiHeadAttention

    mha = MultiHeadAttention(8, 2).requires_grad_(False)
    x = torch.randn(2, 5, 8)
    bias = torch.randn(5, 5, requires_grad=True)
    with fused_attn(fused):
        out, _ = mha(x, attn_mask=bias, need_weights=need_weights)
    q, k, v = (rearrange(p(x), "b l (h e) -> b h l e", h=2)
               for p in (mha.q_proj, mha.k_proj, mha.v_proj))
    want = mha.out_proj(rearrange(_naive_biased(q, k, v, bias), "b h l e -> b l (h e)"))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    (got,) = torch.autograd.grad(out.square().sum(), bias)
    (ref,) = torch.autograd.grad(want.square().sum(), bias)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
