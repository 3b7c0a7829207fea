"""One contract for every attention class: the same checks, the same inputs.

Shape and dtype follow the input, padding never leaks into real outputs, fully masked
rows are finite zeros, the fused and explicit paths agree, gradients reach every
parameter, weights are a distribution over allowed keys — on CPU and, when present, CUDA.
"""

from __future__ import annotations

import pytest
import torch

from mmattn import (
    AdditiveAttention,
    CrossAttention,
    LinformerAttention,
    LocalAttention,
    MultiHeadAttention,
)
from mmattn.functional import fused_attn

E, H, L = 16, 4, 10

FACTORIES = {
    "MultiHeadAttention": lambda **kw: MultiHeadAttention(E, H, **kw),
    "CrossAttention": lambda **kw: CrossAttention(E, H, **kw),
    "LocalAttention": lambda **kw: LocalAttention(E, H, window_size=3, **kw),
    "LocalAttention-causal-global": lambda **kw: LocalAttention(
        E, H, window_size=2, causal=True, num_global_tokens=1, **kw
    ),
    "AdditiveAttention": lambda **kw: AdditiveAttention(E, H, **kw),
    "LinformerAttention": lambda **kw: LinformerAttention(E, H, seq_len=16, proj_len=6, **kw),
}


@pytest.fixture(params=sorted(FACTORIES))
def make(request):
    return FACTORIES[request.param]


def _inputs(device, dtype=torch.float32):
    x = torch.randn(3, L, E, device=device, dtype=dtype)
    kpm = torch.zeros(3, L, dtype=torch.bool, device=device)
    kpm[0, 7:] = True
    kpm[2] = True
    kpm[2, 0] = False  # sample 2: a single real key
    return x, kpm


def test_shape_dtype_and_weights(make, device):
    mha = make(device=device)
    x, kpm = _inputs(device)
    out, w = mha(x, x, x, key_padding_mask=kpm, need_weights=True)
    assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
    assert w.shape[:2] == (3, L)
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    if not isinstance(mha, LinformerAttention):  # Linformer's weights are over projections
        assert w.shape == (3, L, L)
        assert (w[0, :, 7:] == 0).all() and (w[2, :, 1:] == 0).all()
        row_sums = w.sum(-1)
        torch.testing.assert_close(row_sums[row_sums > 0], torch.ones_like(row_sums[row_sums > 0]))


def test_padding_never_leaks(make, device):
    mha = make(device=device)
    x, kpm = _inputs(device)
    out, _ = mha(x, x, x, key_padding_mask=kpm)
    noisy = x.clone()
    noisy[kpm] = 1e3 * torch.randn_like(noisy[kpm])
    out2, _ = mha(noisy, noisy, noisy, key_padding_mask=kpm)
    real = ~kpm
    torch.testing.assert_close(out2[real], out[real], atol=1e-4, rtol=1e-4)


def test_fully_masked_rows_are_finite_zeros(make, device):
    mha = make(device=device)
    x, _ = _inputs(device)
    x.requires_grad_(True)
    kpm = torch.zeros(3, L, dtype=torch.bool, device=device)
    kpm[1] = True
    out, w = mha(x, x, x, key_padding_mask=kpm, need_weights=True)
    bias = mha.out_proj.bias
    torch.testing.assert_close(out[1], bias.expand(L, E))
    assert (w[1] == 0).all()
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_fused_equals_explicit(make, device):
    mha = make(device=device)
    x, kpm = _inputs(device)
    with fused_attn(True):
        a, _ = mha(x, x, x, key_padding_mask=kpm)
    with fused_attn(False):
        b, _ = mha(x, x, x, key_padding_mask=kpm)
    c, _ = mha(x, x, x, key_padding_mask=kpm, need_weights=True)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


def test_gradients_reach_every_parameter(make, device):
    mha = make(device=device)
    x, kpm = _inputs(device)
    out, _ = mha(x, x, x, key_padding_mask=kpm)
    out.square().sum().backward()
    for name, p in mha.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_bfloat16(make, device):
    mha = make(device=device)
    x, kpm = _inputs(device)
    ref, _ = mha(x, x, x, key_padding_mask=kpm)
    low = mha.to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    out, _ = low(xb, xb, xb, key_padding_mask=kpm)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    rel = (out.float() - ref).norm() / ref.norm()
    assert rel < 0.05, rel
