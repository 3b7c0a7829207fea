"""Tests for mmattn/debug.py against independent computations."""

from __future__ import annotations

import math

import pytest
import torch
from einops import rearrange
from torch import nn

from mmattn import MultiHeadAttention, Tokens
from mmattn.blocks import Encoder
from mmattn.debug import (
    debug_shape,
    grad_norm_hook,
    record_attention,
    record_qkv_grad_norms,
    trace_shapes,
)
from mmattn.masks import padding_mask


def _no_hooks(model: nn.Module) -> bool:
    return all(
        not m._forward_hooks and not m._forward_pre_hooks for m in model.modules()
    )


def _manual_weights(attn: MultiHeadAttention, h: torch.Tensor, keep: torch.Tensor):
    """softmax(q kᵀ / √e) with padded keys removed, by hand, per head: (b, h, i, j)."""
    q = rearrange(attn.q_proj(h), "b i (h e) -> b h i e", h=attn.num_heads)
    k = rearrange(attn.k_proj(h), "b j (h e) -> b h j e", h=attn.num_heads)
    scores = q @ k.transpose(-1, -2) / math.sqrt(attn.head_dim)
    scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    return scores.softmax(-1)


def test_debug_shape_prints_and_returns_same_object(capsys):
    q = torch.zeros(3, 4)
    assert debug_shape(q, "Q") is q
    tokens = Tokens(torch.zeros(2, 5, 4), padding_mask(torch.tensor([5, 2])))
    assert debug_shape(tokens, "tok") is tokens
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "Q shape: torch.Size([3, 4])",
        "tok shape: torch.Size([2, 5, 4]), lengths: [5, 2]",
    ]
    with pytest.raises(TypeError, match="value must be a torch.Tensor or Tokens"):
        debug_shape([1, 2], "x")


def test_trace_shapes_matches_direct_calls_and_removes_hooks():
    enc = Encoder(16, 2, 2, mlp_ratio=2.0)
    tokens = Tokens(torch.randn(3, 5, 16))
    lines: list[str] = []
    with trace_shapes(enc, print_fn=lines.append) as records:
        enc(tokens)
    by_name = {r.name: r for r in records}
    # the set of traced modules is exactly the set of modules that ran (a ModuleList never runs)
    ran = {name for name, m in enc.named_modules() if not isinstance(m, nn.ModuleList)}
    assert set(by_name) == ran
    assert by_name[""].module == "Encoder" and by_name[""].outputs == [(3, 5, 16)]
    assert by_name["blocks.0.mlp.0"].outputs == [(3, 5, 32)]  # hidden = 2 * 16
    assert by_name["blocks.1.attn"].inputs == [(3, 5, 16)] * 3
    assert by_name["blocks.1.attn"].outputs == [(3, 5, 16)]  # weights None: not a tensor
    assert records[0].name == "" and records[0].depth == 0  # the root starts first
    assert by_name["blocks.1"].depth == 1 and by_name["blocks.1.attn.q_proj"].depth == 3
    assert len(lines) == len(records) and lines[0].startswith("(model) [Encoder]")
    assert "\n".join(lines[:3]) == (
        "(model) [Encoder]: (3, 5, 16) -> (3, 5, 16)\n"
        "  0 [TransformerBlock]: (3, 5, 16) -> (3, 5, 16)\n"
        "    norm1 [LayerNorm]: (3, 5, 16) -> (3, 5, 16)"
    )
    # every parent is the closest earlier record one level up, and its name prefixes ours
    for n, record in enumerate(records[1:], start=1):
        parent = next(r for r in reversed(records[:n]) if r.depth == record.depth - 1)
        assert record.name.startswith(parent.name)
    assert _no_hooks(enc)


def test_trace_shapes_leaves_only():
    net = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 2)))
    with trace_shapes(net, leaves_only=True) as records:
        net(torch.zeros(5, 4))
    assert [(r.name, r.outputs) for r in records] == [
        ("0", [(5, 8)]), ("1.0", [(5, 8)]), ("1.1", [(5, 2)])
    ]
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        with trace_shapes(lambda x: x):
            pass


def test_record_attention_equals_manual_softmax_in_each_block():
    enc = Encoder(16, 2, 4)
    mask = padding_mask(torch.tensor([6, 3]), 6)
    tokens = Tokens(torch.randn(2, 6, 16), mask)
    plain = enc(tokens).x
    with record_attention(enc, average_attn_weights=False) as maps:
        out = enc(tokens).x
    assert sorted(maps) == ["blocks.0.attn", "blocks.1.attn"]
    torch.testing.assert_close(out, plain, atol=1e-5, rtol=1e-4)  # outputs unchanged
    x = tokens.x * mask[..., None]
    for i, block in enumerate(enc.blocks):
        (weights,) = maps[f"blocks.{i}.attn"]
        expected = _manual_weights(block.attn, block.norm1(x), mask)
        torch.testing.assert_close(weights, expected, atol=1e-6, rtol=1e-5)
        assert weights[1, :, :, 3:].abs().sum() == 0  # padded keys get no weight
        x = block(Tokens(x, mask)).x
    assert _no_hooks(enc)


def test_record_attention_equals_direct_need_weights_call_and_keeps_caller_contract():
    mha = MultiHeadAttention(8, 2)
    torch_mha = nn.MultiheadAttention(8, 2, batch_first=True)
    model = nn.ModuleDict({"ours": mha, "torch": torch_mha})
    x = torch.randn(2, 4, 8)
    with record_attention(model) as maps:
        out, weights = mha(x)  # positional need_weights absent: caller gets None
        _, torch_weights = torch_mha(x, x, x, None, False)  # need_weights positional False
        _, asked = mha(x, need_weights=True)
    assert weights is None and torch_weights is None and asked is not None
    direct = mha(x, need_weights=True)[1]
    assert len(maps["ours"]) == 2
    torch.testing.assert_close(maps["ours"][0], direct)
    torch.testing.assert_close(maps["ours"][1], direct)
    torch.testing.assert_close(maps["torch"][0], torch_mha(x, x, x)[1])
    torch.testing.assert_close(out, mha(x)[0], atol=1e-6, rtol=1e-5)


def test_record_attention_detach_option_keeps_graph():
    mha = MultiHeadAttention(8, 2)
    with record_attention(mha, detach=False) as maps:
        mha(torch.randn(1, 3, 8))
    assert maps[""][0].requires_grad
    with record_attention(mha) as maps:
        mha(torch.randn(1, 3, 8))
    assert not maps[""][0].requires_grad


def test_record_qkv_grad_norms_equals_autograd_grad():
    enc = Encoder(16, 2, 2)
    tokens = Tokens(torch.randn(2, 5, 16), padding_mask(torch.tensor([5, 2])))
    outputs: dict[str, torch.Tensor] = {}
    handles = [
        module.register_forward_hook(lambda m, a, o, n=name: outputs.__setitem__(n, o))
        for name, module in enc.named_modules()
        if name.endswith(("q_proj", "k_proj", "v_proj"))
    ]
    with record_qkv_grad_norms(enc) as norms:
        loss = enc(tokens).x.square().sum()
        grads = torch.autograd.grad(loss, list(outputs.values()), retain_graph=True)
        loss.backward()
    for h in handles:
        h.remove()
    assert sorted(norms) == sorted(outputs)
    assert len(norms) == 6
    for (name, _), grad in zip(outputs.items(), grads):
        # one entry from autograd.grad, one from backward: both the same norm
        assert norms[name] == pytest.approx([grad.norm().item()] * 2, rel=1e-5)
        assert norms[name][0] > 0
    assert _no_hooks(enc)


def test_grad_norm_hook_prints_and_stores(capsys):
    q = torch.randn(3, 4, requires_grad=True)
    store: list[float] = []
    handle = grad_norm_hook(q, "Q", store=store)
    (q * 3).sum().backward()
    assert store == pytest.approx([3 * math.sqrt(12)])
    assert capsys.readouterr().out.startswith("Q gradient norm: 10.3923")
    handle.remove()
    with pytest.raises(ValueError, match="must require grad"):
        grad_norm_hook(torch.zeros(2), "Z")
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor"):
        grad_norm_hook([1.0], "Z")
