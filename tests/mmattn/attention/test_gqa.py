"""Grouped-query attention (``num_kv_heads``) against references that repeat K/V heads.

The kernel shares each key/value head with its group of query heads (SDPA ``enable_gqa`` on
the fused path, query heads folded into the query axis on the explicit path). The reference
repeats every K/V head explicitly — ``repeat_interleave`` on tensors, or on the projection
weights of an ordinary multi-head module — and the results must agree within 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from einops import rearrange, repeat

from mmattn import (
    AdditiveAttention,
    CrossAttention,
    LinformerAttention,
    LocalAttention,
    MultiHeadAttention,
)
from mmattn.functional import fused_attn
from mmattn.kernels.blocked import local_attend
from mmattn.kernels.dense import attend
from tests._tolerance import assert_close_scaled

B, H, KV, LQ, J, E = 3, 6, 2, 5, 7, 8
G = H // KV


def _naive(q, k, v, mask):
    """softmax(q kᵀ/√e + mask) v with repeated K/V heads; rows without a key give 0."""
    k, v = (t.repeat_interleave(G, dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / E**0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool \
            else scores + mask
    live = torch.isfinite(scores).any(-1, keepdim=True)
    weights = torch.where(live, scores, 0.0).softmax(-1)
    weights = torch.where(live & torch.isfinite(scores), weights, 0.0)
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-30)
    return weights @ v, weights


def _masks(device):
    padding = torch.ones(B, 1, 1, J, dtype=torch.bool, device=device)
    padding[0, ..., 4:] = False
    padding[2] = False  # sample 2: no real key at all, every row dead
    per_head = torch.rand(B, H, LQ, J, device=device) > 0.4
    per_head[1, 3, 2] = False  # one dead row in one head
    additive = torch.randn(B, 1, LQ, J, device=device)
    additive[0, 0, 1] = float("-inf")  # a dead row in an additive mask
    return {"none": None, "padding": padding, "per_head": per_head, "additive": additive}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("mask_kind", ["none", "padding", "per_head", "additive"])
def test_kernel_gqa_equals_repeated_kv(device, fused, mask_kind):
    q = torch.randn(B, H, LQ, E, device=device)
    k, v = torch.randn(B, KV, J, E, device=device), torch.randn(B, KV, J, E, device=device)
    mask = _masks(device)[mask_kind]
    want, want_w = _naive(q, k, v, mask)
    with fused_attn(fused):
        out, _ = attend(q, k, v, mask)
        out_w, weights = attend(q, k, v, mask, need_weights=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_w, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights, want_w, atol=1e-5, rtol=1e-5)
    if mask_kind == "padding":
        assert (out[2] == 0).all()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_kernel_gqa_causal_gradients_match(device, fused):
    q = torch.randn(B, H, J, E, device=device, requires_grad=True)
    k = torch.randn(B, KV, J, E, device=device, requires_grad=True)
    v = torch.randn(B, KV, J, E, device=device, requires_grad=True)
    causal = torch.ones(J, J, dtype=torch.bool, device=device).tril()
    with fused_attn(fused):
        out, _ = attend(q, k, v, None, is_causal=True)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    want, _ = _naive(q, k, v, causal)
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    for got, ref in zip(grads, want_grads):  # gradients of a square: values near 20
        assert_close_scaled(got, ref, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("glob", [0, 2])
def test_local_kernel_gqa_equals_repeated_kv(device, fused, causal, glob):
    length = 23
    q = torch.randn(B, H, length, E, device=device)
    k = torch.randn(B, KV, length, E, device=device)
    v = torch.randn(B, KV, length, E, device=device)
    key_mask = torch.ones(B, length, dtype=torch.bool, device=device)
    key_mask[0, 15:] = False
    kr, vr = (t.repeat_interleave(G, dim=1) for t in (k, v))
    kw = dict(causal=causal, key_mask=key_mask, num_global_tokens=glob, block_size=8)
    with fused_attn(fused):
        out, _ = local_attend(q, k, v, 3, **kw)
        want, _ = local_attend(q, kr, vr, 3, **kw)
        _, weights = local_attend(q, k, v, 3, need_weights=True, **kw)
        _, want_w = local_attend(q, kr, vr, 3, need_weights=True, **kw)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights, want_w, atol=1e-5, rtol=1e-5)


def _repeat_kv_weights(gqa: MultiHeadAttention, ref: MultiHeadAttention) -> None:
    """Load ``gqa``'s weights into the ordinary ``ref``, each K/V head repeated g times."""
    state = dict(gqa.state_dict())
    for name in ("k_proj", "v_proj"):
        w = state[f"{name}.weight"]
        state[f"{name}.weight"] = repeat(
            rearrange(w, "(k e) d -> k e d", k=gqa.num_kv_heads), "k e d -> (k g e) d", g=G
        )
        if f"{name}.bias" in state:
            b = rearrange(state[f"{name}.bias"], "(k e) -> k e", k=gqa.num_kv_heads)
            state[f"{name}.bias"] = repeat(b, "k e -> (k g e)", g=G)
    for name in ("bias_k", "bias_v"):
        if state.get(name) is not None:
            state[name] = repeat(state[name], "1 1 (k e) -> 1 1 (k g e)", k=gqa.num_kv_heads, g=G)
    ref.load_state_dict(state)


D = H * E
CLASSES = {
    "MultiHeadAttention": lambda **kw: MultiHeadAttention(D, H, **kw),
    "CrossAttention": lambda **kw: CrossAttention(D, H, kdim=12, **kw),
    "LocalAttention": lambda **kw: LocalAttention(D, H, 2, causal=True, block_size=4, **kw),
    "AdditiveAttention": lambda **kw: AdditiveAttention(D, H, **kw),
    "LinformerAttention": lambda **kw: LinformerAttention(D, H, seq_len=9, proj_len=4, **kw),
}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("name", sorted(CLASSES))
def test_module_gqa_equals_repeated_projection(device, name, fused):
    gqa = CLASSES[name](num_kv_heads=KV, device=device)
    ref = CLASSES[name](device=device)
    _repeat_kv_weights(gqa, ref)
    assert gqa.k_proj.out_features == KV * E and gqa.v_proj.out_features == KV * E
    x = torch.randn(B, 9, D, device=device)
    key = torch.randn(B, 9, 12, device=device) if name == "CrossAttention" else x
    kpm = torch.zeros(B, 9, dtype=torch.bool, device=device)
    kpm[0, 6:] = True
    kpm[2] = True  # no real key: zero attention result
    with fused_attn(fused):
        out, _ = gqa(x, key, key_padding_mask=kpm)
        want, _ = ref(x, key, key_padding_mask=kpm)
        out_w, weights = gqa(x, key, key_padding_mask=kpm, need_weights=True)
        _, want_w = ref(x, key, key_padding_mask=kpm, need_weights=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_w, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights, want_w, atol=1e-5, rtol=1e-5)


def test_multi_query_and_repr():
    mqa = MultiHeadAttention(16, 4, num_kv_heads=1)
    assert mqa.k_proj.weight.shape == (4, 16) and "num_kv_heads=1" in repr(mqa)
    assert "num_kv_heads" not in repr(MultiHeadAttention(16, 4, num_kv_heads=4))
    out, _ = mqa(torch.randn(2, 5, 16), is_causal=True)
    assert out.shape == (2, 5, 16)


def test_gqa_with_bias_kv_and_zero_attn_matches_repeated():
    gqa = MultiHeadAttention(D, H, add_bias_kv=True, add_zero_attn=True, num_kv_heads=KV)
    ref = MultiHeadAttention(D, H, add_bias_kv=True, add_zero_attn=True)
    _repeat_kv_weights(gqa, ref)
    x = torch.randn(B, 6, D)
    torch.testing.assert_close(gqa(x, is_causal=True)[0], ref(x, is_causal=True)[0],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls", [MultiHeadAttention, AdditiveAttention, CrossAttention])
def test_num_kv_heads_must_divide_num_heads(cls):
    with pytest.raises(ValueError, match=r"num_kv_heads must divide num_heads.*num_heads=6.*"
                                         r"num_kv_heads=4"):
        cls(24, 6, num_kv_heads=4)
    with pytest.raises(ValueError, match="num_kv_heads must be >= 1"):
        cls(24, 6, num_kv_heads=0)
    with pytest.raises(TypeError, match="num_kv_heads must be an int"):
        cls(24, 6, num_kv_heads=2.0)


def test_local_and_linformer_check_num_kv_heads():
    with pytest.raises(ValueError, match="num_kv_heads must divide num_heads"):
        LocalAttention(24, 6, 2, num_kv_heads=5)
    with pytest.raises(ValueError, match="num_kv_heads must divide num_heads"):
        LinformerAttention(24, 6, seq_len=8, proj_len=4, num_kv_heads=4)


def test_to_torch_refuses_what_torch_cannot_hold():
    with pytest.raises(NotImplementedError, match="num_kv_heads=2 .* num_heads=4"):
        MultiHeadAttention(16, 4, num_kv_heads=2).to_torch()
    with pytest.raises(NotImplementedError, match="position=RotaryEmbedding"):
        MultiHeadAttention(16, 4, position="rotary").to_torch()


@pytest.mark.parametrize("local", [False, True], ids=["dense", "local"])
def test_explicit_path_never_repeats_kv(local):
    """Autograd's saved tensors hold no K/V repeated per query head (explicit path).

    With 8 query heads on 2 K/V heads, a repeated K or V would be (b, 8, j, e); the folded
    explicit path saves only (b, 2, j, e) keys and values, the (b, 2, g·i, j) weights and
    the queries.
    """
    heads, kv, i, j, e = 8, 2, 3, 64, 16
    q = torch.randn(1, heads, j if local else i, e, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    def repeated_kv(kv_heads):
        saved.clear()
        with fused_attn(False), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            k, v = (torch.randn(1, kv_heads, j, e, requires_grad=True) for _ in range(2))
            if local:  # blocks of 16 queries see slabs of 16 + 2·4 keys
                local_attend(q, k, v, 4, block_size=16)[0].sum()
            else:
                attend(q, k, v, None)[0].sum()
        keys = heads * (j // 16 * (16 + 8) if local else j) * e  # numel of a repeated K
        return [tuple(t.shape) for t in saved if t.shape[-1] == e and t.numel() >= keys]

    assert repeated_kv(heads)  # the check sees K/V of all heads when they are given so
    assert not repeated_kv(kv)
