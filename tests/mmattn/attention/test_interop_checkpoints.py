"""load_state_dict with nn.MultiheadAttention's keys, and NestedTensor input."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from mmattn import LocalAttention, MultiHeadAttention

warnings.filterwarnings("ignore", message=".*nested tensors is in prototype stage.*")

LAYOUTS = {
    "packed": {},
    "packed, no bias": {"bias": False},
    "separate": {"kdim": 6, "vdim": 5},
    "separate, no bias": {"kdim": 6, "vdim": 5, "bias": False},
    "bias_kv": {"add_bias_kv": True},
    "bias_kv, separate": {"add_bias_kv": True, "kdim": 6, "vdim": 6, "add_zero_attn": True},
}


def _pair(kwargs, device="cpu"):
    """A torch module with random weights and a fresh one of ours with the same settings."""
    ref = nn.MultiheadAttention(16, 4, batch_first=True, device=device, **kwargs)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_()  # biases start at zero; make every value count
    ours = MultiHeadAttention(16, 4, device=device, **kwargs)
    return ref, ours


def _check_same(ref, ours, device="cpu", k_len=7):
    q = torch.randn(2, 5, 16, device=device)
    kv = (torch.randn(2, k_len, ref.kdim, device=device),
          torch.randn(2, k_len, ref.vdim, device=device))
    kpm = torch.zeros(2, k_len, dtype=torch.bool, device=device)
    kpm[1, 4:] = True
    expected = ref(q, *kv, key_padding_mask=kpm)[0]
    # N(0, 1) weights give outputs near 70; torch (bmm) and ours (a fused kernel on CUDA)
    # round differently, so the absolute tolerance scales with the reference's size.
    torch.testing.assert_close(ours(q, *kv, key_padding_mask=kpm)[0], expected,
                               atol=1e-5 * expected.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loads_torch_keys_directly(layout, device):
    ref, ours = _pair(LAYOUTS[layout], device)
    state = ref.state_dict()
    result = ours.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert set(state) == set(ref.state_dict())  # the caller's dict is not modified
    _check_same(ref, ours, device)
    if ref.bias_k is not None:
        assert state["bias_k"].shape == ours.bias_k.shape == (1, 1, 16)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loads_torch_keys_inside_a_bigger_model(layout):
    def model(attn):
        return nn.ModuleDict({"embed": nn.Linear(3, 16), "layers": nn.ModuleList([attn])})

    ref, ours = _pair(LAYOUTS[layout])
    source, target = model(ref), model(ours)
    target.load_state_dict(source.state_dict(), strict=True)
    assert torch.equal(target["embed"].weight, source["embed"].weight)
    _check_same(ref, target["layers"][0])


def test_own_keys_and_variants_load_too():
    ref, ours = _pair({})
    ours.load_state_dict(MultiHeadAttention.from_torch(ref).state_dict())
    _check_same(ref, ours)
    local = LocalAttention(16, 4, window_size=100, batch_first=True)
    local.load_state_dict(ref.state_dict())  # a variant takes torch's keys as well
    _check_same(ref, local, k_len=5)


@pytest.mark.parametrize(
    ("source", "target", "match"),
    [
        ({"embed_dim": 8, "num_heads": 2}, {}, r"size mismatch for attn.in_proj_weight: copying "
         r"a param with shape torch.Size\(\[24, 8\]\) from checkpoint, the shape in current "
         r"model is torch.Size\(\[48, 16\]\)"),
        ({"kdim": 6, "vdim": 6}, {"kdim": 7, "vdim": 6}, r"size mismatch for "
         r"attn.k_proj_weight: copying a param with shape torch.Size\(\[16, 6\]\)"),
        ({}, {"kdim": 6, "vdim": 6}, r"size mismatch for attn.in_proj_weight: .* current model "
         r"is \(16, 16\) / \(16, 6\) / \(16, 6\) \(q_proj / k_proj / v_proj\)"),
        ({"add_bias_kv": True}, {}, r"Unexpected key\(s\) in state_dict: \"attn.bias_k\""),
        ({}, {"bias": False}, r"Unexpected key\(s\) in state_dict: \"attn.in_proj_bias\""),
    ],
)
def test_wrong_checkpoints_fail_like_torch_naming_the_key(source, target, match):
    src = nn.ModuleDict({"attn": nn.MultiheadAttention(**{"embed_dim": 16, "num_heads": 4,
                                                          **source})})
    dst = nn.ModuleDict({"attn": MultiHeadAttention(16, 4, **target)})
    with pytest.raises(RuntimeError, match=match) as info:
        dst.load_state_dict(src.state_dict())
    assert "Missing key" not in str(info.value)  # only the real problem is reported


# ---------------------------------------------------------------------- nested input


def _nested(lengths, width, layout, device, requires_grad=False):
    parts = [torch.randn(n, width, device=device, requires_grad=requires_grad) for n in lengths]
    return parts, torch.nested.as_nested_tensor(parts, layout=layout)


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_nested_input_equals_each_sample_alone(layout, device):
    """A nested batch gives, per sample, what the sample gives alone (no padding at all)."""
    mha = MultiHeadAttention(16, 4, kdim=6, vdim=6, device=device)
    q_parts, query = _nested([4, 1, 6], 16, layout, device, requires_grad=True)
    k_parts, key = _nested([3, 5, 2], 6, layout, device)
    out, weights = mha(query, key, need_weights=True)
    assert out.is_nested and out.layout == layout
    outs = out.unbind()
    for b, (q, k) in enumerate(zip(q_parts, k_parts)):
        ref_out, ref_w = mha(q, k, need_weights=True)
        torch.testing.assert_close(outs[b], ref_out, atol=1e-5, rtol=1e-5)
        if layout == torch.jagged:  # packed input: one (L_b, S_b) map per item (packed.md)
            torch.testing.assert_close(weights[b], ref_w)
            continue
        torch.testing.assert_close(weights[b, : q.shape[0], : k.shape[0]], ref_w)
        assert not weights[b, q.shape[0]:].any() and not weights[b, :, k.shape[0]:].any()
    sum(o.sum() for o in outs).backward()
    grads = [q.grad for q in q_parts]
    for q in q_parts:
        q.grad = None
    sum(mha(q, k)[0].sum() for q, k in zip(q_parts, k_parts)).backward()
    for g, q in zip(grads, q_parts):
        torch.testing.assert_close(g, q.grad, atol=1e-5, rtol=1e-5)


def test_nested_self_attention_with_causal_and_per_head_weights():
    mha = MultiHeadAttention(8, 2)
    parts, x = _nested([3, 5], 8, torch.strided, "cpu")
    out, weights = mha(x, is_causal=True, need_weights=True, average_attn_weights=False)
    assert weights.shape == (2, 2, 5, 5)
    for b, part in enumerate(parts):
        torch.testing.assert_close(out.unbind()[b], mha(part, is_causal=True)[0])


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m, x: m(x, torch.randn(2, 3, 8)), "key must be a nested tensor when query is"),
        (lambda m, x: m(x, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool)),
         "key_padding_mask must be None for nested input"),
        (lambda m, x: m(x, attn_mask=torch.zeros(5, 5, dtype=torch.bool)),
         "attn_mask must be None for nested input"),
        (lambda m, x: MultiHeadAttention(8, 2, batch_first=False)(x),
         "nested input needs batch_first=True"),
        (lambda m, x: m(x, _nested([3, 5], 8, torch.strided, "cpu")[1],
                        _nested([3, 4], 8, torch.strided, "cpu")[1]),
         r"key and value must have the same lengths, got \[3, 5\] and \[3, 4\]"),
        (lambda m, x: m(x, _nested([3], 8, torch.strided, "cpu")[1]),
         "query, key and value must have the same batch size, got 2, 1 and 1"),
    ],
)
def test_nested_bad_input(call, match):
    _, x = _nested([3, 5], 8, torch.strided, "cpu")
    with pytest.raises(ValueError, match=match):
        call(MultiHeadAttention(8, 2), x)
