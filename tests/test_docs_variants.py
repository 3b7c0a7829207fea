"""docs/variants.md, "Writing your own attention variant": the worked example is true.

The page's Python block is executed as written; the variant it defines is then checked
against a reference written with plain tensor ops, run in a TransformerBlock by its
registered name with gradients reaching every parameter, and decoded with a KV cache.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from einops import rearrange

from mmattn import Tokens, TransformerBlock, registry
from mmattn.functional import fused_attn
from mmattn.registry import available_attention

PAGE = Path(__file__).resolve().parents[1] / "docs" / "variants.md"


@pytest.fixture(scope="module")
def example() -> Iterator[dict]:
    text = PAGE.read_text(encoding="utf-8")
    section = text.split("## Writing your own attention variant", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    buffer = io.StringIO()
    registered = dict(registry._REGISTRY)  # the page's register_attention("qk_norm")
    with contextlib.redirect_stdout(buffer):
        exec(compile(block, str(PAGE), "exec"), namespace)
    namespace["printed"] = buffer.getvalue().strip()
    yield namespace
    registry._REGISTRY.clear()
    registry._REGISTRY.update(registered)


def test_example_prints_what_the_page_shows(example):
    assert example["printed"] == "torch.Size([2, 10, 64])"
    assert "qk_norm" in available_attention()


def _reference(attn, x, kpm):
    """RMS-normalised q and k, repeated K/V heads, softmax(q kᵀ/√e) v — by hand."""
    heads, kv = attn.num_heads, attn.num_kv_heads
    q = rearrange(attn.q_proj(x), "b l (h e) -> b h l e", h=heads)
    k = rearrange(attn.k_proj(x), "b l (h e) -> b h l e", h=kv)
    v = rearrange(attn.v_proj(x), "b l (h e) -> b h l e", h=kv)

    def rms(t, norm):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight

    q, k = rms(q, attn.q_norm), rms(k, attn.k_norm)
    k, v = (t.repeat_interleave(heads // kv, dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(kpm[:, None, None, :], float("-inf"))
    out = rearrange(scores.softmax(-1) @ v, "b h l e -> b l (h e)")
    return attn.out_proj(out)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_variant_equals_reference(example, fused):
    attn = example["QKNormAttention"](32, 4, num_kv_heads=2)
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 7, 32)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[1, 5:] = True
    with fused_attn(fused):
        out, _ = attn(x, key_padding_mask=kpm)
    torch.testing.assert_close(out, _reference(attn, x, kpm), atol=1e-5, rtol=1e-5)


def test_variant_in_a_block_by_name_trains(example):
    block = TransformerBlock(32, 4, attention="qk_norm")
    assert type(block.attn).__name__ == "QKNormAttention"
    block(Tokens(torch.randn(2, 6, 32))).x.square().sum().backward()
    for name, param in block.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_variant_decodes_with_a_cache(example):
    attn = example["QKNormAttention"](32, 4, position="rotary").eval()
    x = torch.randn(2, 8, 32)
    want, _ = attn(x, is_causal=True)
    cache = attn.make_cache(2, 8)
    got = torch.cat([attn(x[:, t:t + 1], is_causal=True, cache=cache)[0] for t in range(8)], 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_reset_parameters_resets_the_norms(example):
    attn = example["QKNormAttention"](32, 4)
    with torch.no_grad():
        attn.q_norm.weight.fill_(3.0)
    attn.reset_parameters()
    assert torch.equal(attn.q_norm.weight, torch.ones(8))
