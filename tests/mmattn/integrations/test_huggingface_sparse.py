"""The Hugging Face backend runs masks with mostly empty 64-tiles on the block-sparse kernel.

``attention_forward`` is called the way transformers calls it (projected heads, a
(b, 1, l, l) bool mask built by transformers' rules); the reference is a float64 softmax
written out here (rows with no allowed key give 0), never the kernel under test. These
tests need no transformers; the Gemma 3 model tests are in test_huggingface_gemma3.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mmattn.functional import fused_attn
from mmattn.integrations import _hf_sparse
from mmattn.integrations import huggingface as hf
from mmattn.kernels import dense as _kernel


def reference(q, k, v, mask, scale):
    """softmax(q kᵀ · scale, masked) v in float64; a row without any allowed key is 0."""
    groups = q.shape[1] // k.shape[1]
    q, k, v = (t.double() for t in (q, k, v))
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    live = mask.any(-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~live, 0.0), -1) * live
    return (weights @ v).transpose(1, 2), weights


def documents_mask(lengths, pad_left, batch=2):
    """transformers' packed-documents rule: same document and causal, padding False."""
    length = sum(lengths)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    rule = (doc[:, None] == doc[None, :]) & torch.ones(length, length, dtype=torch.bool).tril()
    mask = rule.expand(batch, 1, length, length).clone()
    real = torch.ones(batch, length, dtype=torch.bool)
    real[0, :pad_left] = False
    return mask & real[:, None, None, :] & real[:, None, :, None], real


def _paths(fn):
    seen = []
    remove = _kernel.add_listener(lambda record: seen.append(record["path"]))
    try:
        result = fn()
    finally:
        remove()
    return result, seen


def _heads(batch, length, heads=4, kv_heads=2, width=8, device="cpu"):
    gen = torch.Generator().manual_seed(length)
    q = torch.randn(batch, heads, length, width, generator=gen).to(device)
    k = torch.randn(batch, kv_heads, length, width, generator=gen).to(device)
    v = torch.randn(batch, kv_heads, length, width, generator=gen).to(device)
    return [t.requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_a_mostly_empty_mask_runs_block_sparse_with_the_reference_numbers(fused, device):
    mask, real = documents_mask([70, 45, 90, 35], pad_left=30)  # L = 240: ragged last tile
    mask = mask.to(device)
    q, k, v = _heads(2, 240, device=device)
    layer = nn.Module()
    with fused_attn(fused):
        (out, weights), paths = _paths(
            lambda: hf.attention_forward(layer, q, k, v, mask, scaling=0.3)
        )
    assert paths == ["block-sparse"] and weights is None
    ref, _ = reference(q, k, v, mask, 0.3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[0, :30], torch.zeros_like(out[0, :30]))  # padded rows: zeros
    grad = torch.randn_like(out)
    ours = torch.autograd.grad((out * grad).sum(), (q, k, v))
    theirs = torch.autograd.grad((ref * grad.double()).sum(), (q, k, v))
    for a, b in zip(ours, theirs):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_weights_are_the_reference_and_a_nan_under_padding_stays_there():
    mask, _ = documents_mask([100, 60, 100], pad_left=40)
    q, k, v = _heads(2, 260)
    ref, ref_weights = reference(q, k, v, mask, 8**-0.5)
    with torch.no_grad():
        k, v = k.clone(), v.clone()
        k[0, :, :40], v[0, :, :40] = float("nan"), float("nan")  # padded keys
    (out, weights), paths = _paths(lambda: hf.attention_forward(
        nn.Module(), q, k, v, mask, output_attentions=True))
    assert paths == ["block-sparse"]
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights.double(), ref_weights, atol=1e-6, rtol=1e-5)


def test_a_mask_over_half_full_and_a_per_head_mask_run_dense():
    length = 192
    causal = torch.ones(1, 1, length, length, dtype=torch.bool).tril()  # 6 of 9 tiles
    q, k, v = _heads(1, length)
    (out, _), paths = _paths(lambda: hf.attention_forward(nn.Module(), q, k, v, causal))
    assert "block-sparse" not in paths
    torch.testing.assert_close(out.double(), reference(q, k, v, causal, 8**-0.5)[0],
                               atol=1e-5, rtol=1e-5)
    mask, _ = documents_mask([64, 64, 64], pad_left=0, batch=1)
    per_head = mask.expand(1, 4, length, length)
    _, paths = _paths(lambda: hf.attention_forward(nn.Module(), q, k, v, per_head))
    assert "block-sparse" not in paths


def test_one_mask_item_expanded_over_the_batch_is_read_once_and_serves_every_item():
    mask, _ = documents_mask([64] * 4, pad_left=0, batch=1)
    q, k, v = _heads(3, 256)
    calls = []
    read = _hf_sparse.sparse_from_dense

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return read(*args, **kwargs)

    expanded = mask.expand(3, 1, 256, 256)  # stride 0 on the batch, as sdpa_mask expands
    ref = reference(q, k, v, mask, 8**-0.5)[0]
    _hf_sparse.sparse_from_dense = counting
    try:
        for given in (mask, expanded, expanded):
            (out, _), paths = _paths(lambda m=given: hf.attention_forward(
                nn.Module(), q, k, v, m))
            assert paths == ["block-sparse"]
            torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        with torch.no_grad():
            mask[:, :, 5, 5] = False  # in place (a view shares the version): read again
        hf.attention_forward(nn.Module(), q, k, v, expanded)
    finally:
        _hf_sparse.sparse_from_dense = read
    # one item read each time; the second call with the same expanded mask is remembered
    assert calls == [(1, 256, 256)] * 3, calls


@pytest.mark.slow
def test_under_torch_compile_the_dense_kernel_gives_the_same_numbers():
    mask, _ = documents_mask([70, 45, 90, 35], pad_left=30)
    q, k, v = _heads(2, 240)
    eager, eager_paths = _paths(lambda: hf.attention_forward(nn.Module(), q, k, v, mask)[0])
    compiled = torch.compile(hf.attention_forward, backend="aot_eager")
    out, paths = _paths(lambda: compiled(nn.Module(), q, k, v, mask)[0])
    assert eager_paths == ["block-sparse"] and "block-sparse" not in paths
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
