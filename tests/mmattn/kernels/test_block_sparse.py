"""kernels/block_sparse.py against the dense kernel with the pattern's dense mask.

The reference is :func:`mmattn.kernels.dense.attend` (itself held to SDPA and a float64
loop elsewhere) on ``pattern.dense(tokens)``; outputs, weights and the gradients of q, k
and v must agree, for block sizes that do not divide L, grouped heads, key masks, the
causal flag and both paths.
"""

from __future__ import annotations

import pytest
import torch

from mmattn import Tokens
from mmattn import patterns as P
from mmattn.functional import fused_attn
from mmattn.kernels import block_sparse, dense

B, L, H, E = 2, 45, 4, 8


def tokens() -> Tokens:
    mask = torch.arange(L)[None] < torch.tensor([[L], [31]])
    docs = (torch.arange(L) // 12)[None].repeat(2, 1)
    docs[0, 20:24] = -1  # tokens in no document: rows without any key
    return Tokens(torch.zeros(B, L, 1), mask, meta={"documents": docs})


CASES = {
    "documents-causal": P.same("documents") & P.causal(),
    "window": P.window(5),
    "not-causal": ~P.causal(),  # the last row has no key at all
}


def qkv(kv_heads: int, dtype=torch.float64, value_width=E):
    """Value width E takes the CPU flash Function; another width the generic path."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, L, E, dtype=dtype, generator=gen, requires_grad=True)
    k = torch.randn(B, kv_heads, L, E, dtype=dtype, generator=gen, requires_grad=True)
    v = torch.randn(B, kv_heads, L, value_width, dtype=dtype, generator=gen,
                    requires_grad=True)
    return q, k, v


def run_both(mask, allowed, kv_heads, need_weights, value_width=E, **kwargs):
    q, k, v = qkv(kv_heads, value_width=value_width)
    groups = H // kv_heads
    out, w = block_sparse.attend(q, k, v, mask.plan(64), need_weights=need_weights,
                                 groups=groups, **kwargs)
    ref_mask = allowed[:, None]
    key_mask = kwargs.get("key_mask")
    if key_mask is not None:
        extra = key_mask[:, None, None] if key_mask.dtype == torch.bool else None
        ref_mask = ref_mask & extra if extra is not None else torch.where(
            ref_mask, key_mask[:, None, None], float("-inf"))
    ref, ref_w = dense.attend(q, k, v, ref_mask, need_weights=need_weights, groups=groups,
                              is_causal=kwargs.get("is_causal", False))
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    return (out, w, got), (ref, ref_w, want)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("block", [7, 64])
@pytest.mark.parametrize("name", list(CASES))
def test_equals_dense_kernel(name, block, fused):
    t = tokens()
    mask = CASES[name].compile(t, block)
    allowed = CASES[name].dense(t)
    with fused_attn(fused):
        for kv_heads, need_weights, width in ((H, False, E), (2, not fused, E), (2, False, E + 2)):
            (out, w, got), (ref, ref_w, want) = run_both(mask, allowed, kv_heads, need_weights,
                                                         width)
            torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-9)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)
            if need_weights:
                torch.testing.assert_close(w, ref_w, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("fused", [True, False])
def test_key_mask_and_causal_flag(fused):
    t = tokens()
    pattern = P.window(9)
    mask, allowed = pattern.compile(t, 8), pattern.dense(t)
    bool_keys = torch.rand(B, L, generator=torch.Generator().manual_seed(3)) > 0.3
    float_keys = torch.where(bool_keys, torch.randn(B, L, dtype=torch.float64), float("-inf"))
    with fused_attn(fused):
        for key_mask in (bool_keys, float_keys):
            for causal in (False, True):
                (out, _, got), (ref, _, want) = run_both(
                    mask, allowed, H, False, key_mask=key_mask, is_causal=causal)
                torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-9)
                for a, b in zip(got, want):
                    torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("fused", [True, False])
def test_dead_rows_zero_and_padding_never_leaks(fused):
    t = tokens()
    pattern = CASES["documents-causal"]
    mask = pattern.compile(t, 16)
    allowed = pattern.dense(t)
    q, k, v = qkv(H, torch.float32)
    with torch.no_grad():  # NaN and Inf where no query may look
        k[1, :, 31:] = float("nan")
        v[1, :, 31:] = float("inf")
    with fused_attn(fused):
        out, _ = block_sparse.attend(q, k, v, mask.plan(32))
    dead = ~allowed.any(dim=-1)  # (B, L): padding and the tokens in no document
    assert dead.sum() > 10
    rows = out.permute(0, 2, 1, 3)[dead]
    assert torch.equal(rows, torch.zeros_like(rows))
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert all(torch.isfinite(g).all() for g in (q.grad, k.grad[0], v.grad[0]))
    assert torch.isfinite(q.grad).all() and q.grad.permute(0, 2, 1, 3)[dead].abs().sum() == 0


def test_empty_pattern_and_plan_cache():
    t = tokens()
    mask = (~P.full()).compile(t)
    assert mask.nonempty_blocks == 0 and mask.density == 0.0
    q, k, v = qkv(H, torch.float32)
    out, _ = block_sparse.attend(q, k, v, mask.plan(32))
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))
    causal = P.causal().compile(t)
    assert causal.plan(32) is causal.plan(32)


def test_reports_block_sparse_path():
    seen = []
    remove = dense.add_listener(seen.append)
    try:
        t = tokens()
        q, k, v = qkv(H, torch.float32)
        block_sparse.attend(q, k, v, P.causal().compile(t, 16).plan(32))
    finally:
        remove()
    assert [r["path"] for r in seen] == ["block-sparse"]
    assert seen[0]["block"] == 16 and 0 < seen[0]["density"] < 1


@pytest.mark.slow
def test_equals_compiled_flex_attention_forward():
    """FlexAttention (compiled, CPU, forward only) with create_block_mask(mask_mod)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    length = 96
    mask_ = torch.arange(length)[None] < torch.tensor([[length], [70]])
    t = Tokens(torch.zeros(2, length, 1), mask_,
               meta={"documents": (torch.arange(length) // 40)[None].repeat(2, 1)})
    pattern = (P.same("documents") & P.causal()) | P.window(3) & ~P.chunked(8)
    q, k, v = (torch.randn(2, H, length, E) for _ in range(3))
    block_mask = create_block_mask(pattern.mask_mod(t), 2, None, length, length, device="cpu")
    with torch.no_grad():
        flex = torch.compile(flex_attention)(q, k, v, block_mask=block_mask)
        ours, _ = block_sparse.attend(q, k, v, pattern.compile(t, 32).plan(32))
    live = pattern.dense(t).any(-1)[:, None, :, None]
    torch.testing.assert_close(torch.where(live, flex, 0.0), ours, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fused", [True, False])
def test_full_rectangles_split_over_keys(fused, monkeypatch):
    """Runs of full tiles shared by several query tiles (text <-> everything) run as tall
    calls merged with the other tiles through their logsumexp (thresholds lowered so that
    small sizes have them): outputs, gradients and dead rows as the dense kernel."""
    from mmattn.kernels import _block_sparse_cpu

    monkeypatch.setattr(_block_sparse_cpu, "RECT_TILES", 2)
    monkeypatch.setattr(_block_sparse_cpu, "RECT_ROWS", 2)
    kinds = torch.zeros(B, L, dtype=torch.long)  # image | text | audio | (none)
    kinds[:, 16:28], kinds[:, 28:40], kinds[0, 40:] = 1, 2, -1
    t = Tokens(torch.zeros(B, L, 1), torch.arange(L)[None] < torch.tensor([[L], [37]]),
               meta={"modality_ids": kinds, "modalities": ["image", "text", "audio"],
                     "segments": P.runs(kinds)})
    pattern = P.per_modality(
        within={"text": P.causal(), "image": P.window(2), "audio": P.window(1)},
        across=P.modality(query="text") | P.modality(key="text"))
    mask, allowed = pattern.compile(t, 4), pattern.dense(t)
    rects, _ = block_sparse.fast_parts(mask.plan(64))
    assert len(rects) >= 3  # text rows against both sides, both sides against text
    assert (~allowed.any(-1)).any()  # rows without any key
    with fused_attn(fused):
        for kv_heads in (H, 2):
            (out, _, got), (ref, _, want) = run_both(mask, allowed, kv_heads, False)
            torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-9)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)
    rows = out.permute(0, 2, 1, 3)[~allowed.any(-1)]
    assert torch.equal(rows, torch.zeros_like(rows))
