"""LocalAttention and functional.local_attention against dense attention with the band mask.

The reference is always computed independently of mmattn.kernels.blocked: MultiHeadAttention (or
functional SDPA) with identical weights and a mask built from ``masks.band_mask`` plus
hand-written global rows/columns, and for the mask itself a naive double loop.
"""

from __future__ import annotations

import pytest
import torch

from mmattn import LocalAttention, MultiHeadAttention
from mmattn.functional import fused_attn, local_attention, scaled_dot_product_attention
from mmattn.kernels.blocked import default_block_size, local_attend
from mmattn.masks import band_mask, local_allowed

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def reference_allowed(length: int, window: int, causal: bool, glob: int) -> torch.Tensor:
    """SDPA-direction pattern from band_mask + explicit global rows/columns (+ causal)."""
    allowed = band_mask(length, window, causal=causal).clone()
    for g in range(min(glob, length)):
        allowed[g, :] = True
        allowed[:, g] = True
    if causal:
        allowed &= torch.ones(length, length, dtype=torch.bool).tril()
    return allowed


def pair(window, causal=False, glob=0, block_size=None, dtype=torch.float32, device="cpu"):
    """A LocalAttention and a MultiHeadAttention holding the same weights."""
    local = LocalAttention(
        16, 4, window, causal=causal, num_global_tokens=glob, block_size=block_size,
        dtype=dtype, device=device,
    )
    dense = MultiHeadAttention(16, 4, dtype=dtype, device=device)
    dense.load_state_dict(local.state_dict())
    return local, dense


def padding(batch: int, length: int, device="cpu") -> torch.Tensor:
    """Module-direction key padding: sample 1 half padded, the last sample fully padded."""
    kpm = torch.zeros(batch, length, dtype=torch.bool, device=device)
    kpm[1, length // 2:] = True
    kpm[-1, :] = True
    return kpm


def test_local_allowed_matches_naive_loop():
    for length, window, causal, glob in [(7, 1, False, 0), (9, 2, True, 2), (6, 0, False, 3)]:
        naive = torch.zeros(length, length, dtype=torch.bool)
        for i in range(length):
            for j in range(length):
                ok = abs(i - j) <= window or i < glob or j < glob
                naive[i, j] = ok and (j <= i or not causal)
        assert torch.equal(local_allowed(length, window, causal=causal, num_global_tokens=glob),
                           naive)
        assert torch.equal(reference_allowed(length, window, causal, glob), naive)


CASES = [
    # (length, window, causal, global tokens, block size)
    (10, 2, False, 0, None),
    (37, 5, False, 0, 8),  # L not a multiple of the block, many blocks
    (37, 5, True, 0, 8),
    (23, 3, False, 2, 4),  # global tokens, blocks smaller than the window
    (23, 3, True, 3, 5),
    (9, 20, False, 0, None),  # window >= L
    (9, 20, True, 1, 4),
    (20, 0, False, 0, 6),  # window 0: only itself
    (20, 0, True, 2, 6),
    (5, 1, False, 7, 2),  # more global tokens than tokens: full attention
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
@pytest.mark.parametrize("pad", [False, True], ids=["nopad", "pad"])
def test_equals_dense_band(device, dtype, case, pad):
    length, window, causal, glob, block = case
    local, dense = pair(window, causal, glob, block, dtype, device)
    x = torch.randn(3, length, 16, dtype=dtype, device=device)
    kpm = padding(3, length, device) if pad else None
    attn_mask = ~reference_allowed(length, window, causal, glob).to(device)
    ref, ref_w = dense(x, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=True,
                       average_attn_weights=False)
    tol = TOL[dtype]
    for fused in (True, False):
        with fused_attn(fused):
            out, _ = local(x, key_padding_mask=kpm)
            torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    out, w = local(x, key_padding_mask=kpm, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(w, ref_w, atol=tol, rtol=tol)
    assert torch.isfinite(out).all()


def test_float_key_padding_mask_and_attn_mask_fallback(device):
    local, dense = pair(2, glob=1, block_size=4, device=device)
    x = torch.randn(2, 13, 16, device=device)
    kpm = torch.randn(2, 13, device=device)
    kpm[0, 7:] = float("-inf")
    band = ~reference_allowed(13, 2, False, 1).to(device)
    out, _ = local(x, key_padding_mask=kpm)
    ref, _ = dense(x, key_padding_mask=kpm, attn_mask=band)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # An extra attn_mask is honoured exactly (dense fallback): band AND user mask.
    user = torch.rand(13, 13, device=device) < 0.3
    out, w = local(x, key_padding_mask=kpm, attn_mask=user, need_weights=True)
    ref, ref_w = dense(x, key_padding_mask=kpm, attn_mask=user | band, need_weights=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, ref_w, atol=1e-5, rtol=1e-5)


def test_is_causal_argument_equals_causal_flag():
    causal, _ = pair(3, causal=True, block_size=4)
    plain = LocalAttention(16, 4, 3, block_size=4)
    plain.load_state_dict(causal.state_dict())
    x = torch.randn(2, 11, 16)
    torch.testing.assert_close(plain(x, is_causal=True)[0], causal(x)[0], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(plain(x)[0], causal(x)[0], atol=1e-3)


def test_layouts_unbatched_and_sequence_first():
    local, dense = pair(2, block_size=4)
    x = torch.randn(9, 16)
    band = ~band_mask(9, 2)
    torch.testing.assert_close(local(x)[0], dense(x, attn_mask=band)[0], atol=1e-5, rtol=1e-5)
    seq_first = LocalAttention(16, 4, 2, block_size=4, batch_first=False)
    seq_first.load_state_dict(local.state_dict())
    xb = torch.randn(9, 2, 16)  # (L, B, D)
    ref = dense(xb.transpose(0, 1), attn_mask=band)[0].transpose(0, 1)
    torch.testing.assert_close(seq_first(xb)[0], ref, atol=1e-5, rtol=1e-5)


def test_fully_masked_rows_give_zero_and_finite_grads(device):
    # Keys 4.. are padding, window 1: queries 6.. see no real key at all.
    local = LocalAttention(16, 4, 1, block_size=4, device=device)
    x = torch.randn(2, 12, 16, device=device, requires_grad=True)
    kpm = torch.zeros(2, 12, dtype=torch.bool, device=device)
    kpm[:, 4:] = True
    for fused in (True, False):
        with fused_attn(fused):
            out, w = local(x, key_padding_mask=kpm, need_weights=fused)
            bias = local.out_proj.bias.expand(2, 6, 16)
            torch.testing.assert_close(out[:, 6:], bias, atol=1e-6, rtol=1e-6)
            if w is not None:
                assert torch.all(w[:, 6:] == 0)
            out.sum().backward()
            assert torch.isfinite(x.grad).all()
            assert torch.isfinite(local.q_proj.weight.grad).all()
            x.grad = None


def test_padded_values_do_not_move_real_outputs():
    local = LocalAttention(16, 4, 3, num_global_tokens=2, block_size=4)
    x = torch.randn(2, 15, 16)
    kpm = torch.zeros(2, 15, dtype=torch.bool)
    kpm[:, 10:] = True
    changed = x.clone()
    changed[:, 10:] = 1e3 * torch.randn(2, 5, 16)
    a, b = local(x, key_padding_mask=kpm)[0], local(changed, key_padding_mask=kpm)[0]
    torch.testing.assert_close(a[:, :10], b[:, :10], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_functional_local_attention_equals_sdpa_with_band(device, causal):
    q, k, v = (torch.randn(2, 3, 29, 8, device=device) for _ in range(3))
    real = torch.ones(2, 29, dtype=torch.bool, device=device)
    real[1, 20:] = False
    allowed = band_mask(29, 4, causal=causal, device=device) & real[:, None, None, :]
    ref = scaled_dot_product_attention(q, k, v, allowed)
    out = local_attention(q, k, v, 4, causal=causal, key_mask=real)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # (B, L, E) input: one head.
    out3 = local_attention(q[:, 0], k[:, 0], v[:, 0], 4, causal=causal, key_mask=real)
    torch.testing.assert_close(out3, ref[:, 0], atol=1e-5, rtol=1e-5)


def test_gradcheck_blocked_kernel_float64():
    q, k, v = (torch.randn(2, 1, 8, 2, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    real = torch.ones(2, 8, dtype=torch.bool)
    real[1, 5:] = False

    def fn(q, k, v):
        return local_attend(q, k, v, 2, key_mask=real, num_global_tokens=2, block_size=3)[0]

    assert torch.autograd.gradcheck(fn, (q, k, v))

    def causal_fn(q, k, v):
        return local_attention(q, k, v, 3, causal=True, key_mask=real)

    assert torch.autograd.gradcheck(causal_fn, (q, k, v))


def test_gradcheck_module_float64():
    local = LocalAttention(4, 2, 1, num_global_tokens=1, block_size=2, dtype=torch.float64)
    x = torch.randn(1, 5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: local(t)[0], (x,))


def test_gradients_equal_dense():
    local, dense = pair(3, glob=1, block_size=4, dtype=torch.float64)
    x = torch.randn(2, 14, 16, dtype=torch.float64)
    kpm = padding(2, 14)
    band = ~reference_allowed(14, 3, False, 1)
    local(x, key_padding_mask=kpm)[0].square().sum().backward()
    dense(x, key_padding_mask=kpm, attn_mask=band)[0].square().sum().backward()
    for name, p in local.named_parameters():
        ref = dict(dense.named_parameters())[name].grad
        torch.testing.assert_close(p.grad, ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_no_quadratic_tensor_without_weights(fused):
    """The forward saves nothing of size L² (autograd's saved tensors are inspected).

    The explicit path saves the per-block weights, (b·n, h, s, s + 2w): h·L·(s + 2w)
    elements, linear in L. One head's dense map would be L², all heads' h·L².
    """
    length, window, heads = 512, 4, 4
    local = LocalAttention(16, heads, window)
    block = default_block_size(window)
    x = torch.randn(1, length, 16)
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with fused_attn(fused), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        local(x, key_padding_mask=torch.zeros(1, length, dtype=torch.bool))[0].sum()
    assert sizes and max(sizes) <= heads * length * (block + 2 * window)
    assert max(sizes) < length * length


def test_extra_repr_and_reset_parameters():
    local = LocalAttention(16, 4, 3, causal=True, num_global_tokens=2)
    text = repr(local)
    assert "window_size=3" in text and "causal=True" in text and "num_global_tokens=2" in text
    before = local.q_proj.weight.clone()
    local.reset_parameters()
    assert not torch.equal(before, local.q_proj.weight)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"window_size": -1}, ValueError, "window_size must be >= 0"),
        ({"window_size": 2.5}, TypeError, "window_size must be an int"),
        ({"window_size": True}, TypeError, "window_size must be an int"),
        ({"window_size": 2, "num_global_tokens": -1}, ValueError, "num_global_tokens"),
        ({"window_size": 2, "block_size": 0}, ValueError, "block_size must be >= 1"),
        ({"window_size": 2, "dropout": 1.5}, ValueError, "dropout"),
        ({"window_size": 2, "causal": "no"}, TypeError, r"causal must be a bool, got str"),
    ],
)
def test_bad_constructor_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        LocalAttention(16, 4, **kwargs)


def test_bad_forward_inputs():
    local = LocalAttention(16, 4, 2)
    x = torch.randn(2, 9, 16)
    with pytest.raises(ValueError, match="key of the same length as query"):
        local(x, torch.randn(2, 7, 16))
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        local(x, key_padding_mask=torch.zeros(2, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="query must have last dimension"):
        local(torch.randn(2, 9, 15))
    with pytest.raises(TypeError, match="from_torch needs window_size"):
        LocalAttention.from_torch(torch.nn.MultiheadAttention(16, 4))


@pytest.mark.parametrize(
    ("window", "kwargs", "error", "match"),
    [
        (-1, {}, ValueError, "window_size must be >= 0"),
        (1.0, {}, TypeError, "window_size must be an int"),
        (2, {"key_mask": torch.ones(2, 5, dtype=torch.bool)}, ValueError, "key_mask must have"),
        (2, {"key_mask": torch.ones(2, 9)}, TypeError, "key_mask must have dtype"),
    ],
)
def test_functional_bad_inputs(window, kwargs, error, match):
    q = torch.randn(2, 3, 9, 4)
    with pytest.raises(error, match=match):
        local_attention(q, q, q, window, **kwargs)


def test_functional_bad_shapes():
    q = torch.randn(2, 3, 9, 4)
    with pytest.raises(ValueError, match="key must have the same length as query"):
        local_attention(q, q[:, :, :5], q[:, :, :5], 2)
    with pytest.raises(ValueError, match="query must be a 3 or 4-D"):
        local_attention(q[0, 0], q[0, 0], q[0, 0], 2)
