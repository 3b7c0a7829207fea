"""One contract for every attention class: the same checks, the same inputs.

Shape and dtype follow the input, padding never leaks into real outputs, fully masked
rows are finite zeros, the fused and explicit paths agree, gradients reach every
parameter, weights are a distribution over allowed keys — on CPU and, when present, CUDA.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import mmattn
from mmattn import LinformerAttention, MultiHeadAttention
from mmattn.functional import fused_attn

E, H, L = 16, 4, 10


class TemperedAttention(MultiHeadAttention):
    """A variant defined here, as a user would: the contract must hold for it too."""

    def __init__(self, embed_dim, num_heads, *, temperature=0.5, **kwargs):
        super().__init__(embed_dim, num_heads, **kwargs)
        self.temperature = temperature

    def _attention(self, q, k, v, mask, *, is_causal, dropout_p, need_weights):
        return super()._attention(
            q / self.temperature, k, v, mask, is_causal=is_causal, dropout_p=dropout_p,
            need_weights=need_weights,
        )


class GriddedNeighborhood(mmattn.NeighborhoodAttention):
    """NeighborhoodAttention on the contract's L tokens, laid out as a (2, L // 2) grid."""

    def forward(self, *args, grid=(2, L // 2), **kwargs):
        return super().forward(*args, grid=grid, **kwargs)


def attention_classes() -> list[type]:
    """Every attention class mmattn exports, plus the test-defined variant."""
    exported = [getattr(mmattn, name) for name in mmattn.__all__]
    found = [c for c in exported if isinstance(c, type) and issubclass(c, MultiHeadAttention)
             # layers that need geometry (edges, grids) have the same checks in their own
             # test files, with the geometry they need; NeighborhoodAttention runs here on a
             # fixed grid too
             and c.geometry is MultiHeadAttention.geometry]
    found.append(GriddedNeighborhood)
    return [*found, TemperedAttention]


#: Example values for required constructor arguments, by argument name. A new class with a
#: required argument not listed here fails test_every_class_is_constructible.
EXAMPLE_ARGS = {"window_size": 3, "seq_len": 16, "proj_len": 6, "kernel_size": 3}


def _required(cls: type) -> dict:
    params = list(inspect.signature(cls).parameters.values())[2:]  # after embed_dim, num_heads
    return {p.name: EXAMPLE_ARGS.get(p.name) for p in params
            if p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def _factory(cls: type, **extra):
    return lambda **kw: cls(E, H, **_required(cls), **extra, **kw)


FACTORIES = {cls.__name__: _factory(cls) for cls in attention_classes()}
FACTORIES.update({f"{name}-gqa": _factory(cls, num_kv_heads=2)
                  for name, cls in [(c.__name__, c) for c in attention_classes()]})
FACTORIES["LocalAttention-causal-global"] = _factory(
    mmattn.LocalAttention, causal=True, num_global_tokens=1
)


def test_every_class_is_discovered_and_constructible():
    names = {cls.__name__ for cls in attention_classes()}
    assert {"MultiHeadAttention", "CrossAttention", "LocalAttention", "AdditiveAttention",
            "LinformerAttention", "TemperedAttention"} <= names
    for cls in attention_classes():
        missing = [k for k, v in _required(cls).items() if v is None]
        assert not missing, f"{cls.__name__} needs an example value in EXAMPLE_ARGS: {missing}"


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
