"""Named cases of the second hardening pass (issue 22, items 6-8) that no generic rule of
the matrix reaches; ``tests/test_bad_input_items.py`` runs them with its own ``ITEMS``.

Each asserts one of the matrix's three outcomes: a named error, a result checked against a
reference (torch's SDPA, the same module per sample, the padded call), or NaN confined.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mmattn
from mmattn import functional as MF
from mmattn import masks, registry
from mmattn.cache import ContextCache, KVCache, LocalKVCache
from mmattn.tokens import Tokens
from tests._matrix import MATCHES, RAISES


def _raises(error: type, *names: str) -> Callable[[Callable[[], Any]], Callable[[], None]]:
    def wrap(call: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            with pytest.raises(error) as info:
                call()
            assert any(n in str(info.value) for n in names), f"{info.value} names none of {names}"

        return run

    return wrap


# --------------------------------------------------------------------------- 6. silent


def _merge_masks_integer() -> None:
    kpm = torch.tensor([[0, 0, 1]])  # an int64 padding mask: as additive, +1 on the pad
    with pytest.raises(TypeError, match="key_padding_mask must have dtype torch.bool"):
        masks.merge_masks(kpm, None, batch_size=1, num_heads=1, dtype=torch.float32)
    with pytest.raises(TypeError, match="attn_mask must have dtype torch.bool"):
        masks.merge_masks(None, torch.ones(3, 3, dtype=torch.int32), batch_size=1,
                          num_heads=1, dtype=torch.float32)


def _replace_keeps_ties() -> None:
    torch.manual_seed(0)
    a = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    b = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    tied = nn.ModuleList([a, a, b])
    parent = nn.Sequential(nn.ModuleDict({"x": a}), tied)
    x = torch.randn(2, 4, 8)
    want = [a(x, x, x)[0], b(x, x, x)[0]]
    calls = []

    def factory(m: nn.MultiheadAttention) -> nn.Module:
        calls.append(m)
        return mmattn.MultiHeadAttention.from_torch(m)

    assert mmattn.replace_attention(parent, factory) == 2  # distinct modules, once each
    assert len(calls) == 2
    assert all(isinstance(m, mmattn.MultiHeadAttention) for m in tied)
    assert tied[0] is tied[1] is parent[0]["x"] and tied[2] is not tied[0]
    with torch.no_grad():
        torch.testing.assert_close(tied[0](x)[0], want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(tied[2](x)[0], want[1], rtol=1e-5, atol=1e-6)


def _replace_keeps_timm_ties() -> None:
    layers = pytest.importorskip("timm.layers")
    torch.manual_seed(0)
    a = layers.Attention(8, 2).eval()
    tied = nn.ModuleList([a, a])
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        want = a(x)
    assert mmattn.replace_attention(tied) == 1
    assert tied[0] is tied[1] and type(tied[1]).__module__ == "mmattn.integrations.timm"
    with torch.no_grad():
        torch.testing.assert_close(tied[1](x), want, rtol=1e-5, atol=1e-6)


def _block_with_torch_attention_keeps_samples_apart() -> None:
    torch.manual_seed(0)
    block = mmattn.TransformerBlock(8, 2, attention=nn.MultiheadAttention).eval()
    assert block.attn.batch_first
    x = torch.randn(3, 5, 8)
    with torch.no_grad():
        whole = block(Tokens(x)).x
        alone = torch.cat([block(Tokens(x[i : i + 1])).x for i in range(3)])
    torch.testing.assert_close(whole, alone, rtol=1e-5, atol=1e-6)


def _block_refuses_sequence_first_attention() -> None:
    with pytest.raises(ValueError, match="batch_first=False"):
        mmattn.TransformerBlock(8, 2, attention=nn.MultiheadAttention,
                                attention_kwargs={"batch_first": False})
    with pytest.raises(ValueError, match="batch_first=False"):
        mmattn.TransformerBlock(8, 2, attention=lambda e, h, **kw: nn.MultiheadAttention(e, h))


def _registry_compares_identity() -> None:
    saved = dict(registry._REGISTRY)
    try:
        first, second = (lambda e, h, **kw: mmattn.MultiHeadAttention(e, h, **kw),
                         lambda e, h, **kw: mmattn.AdditiveAttention(e, h, **kw))
        registry.register_attention("t-lambda", first)
        with pytest.raises(ValueError, match="'t-lambda' is already registered"):
            registry.register_attention("t-lambda", second)  # same __qualname__ "<lambda>"
        assert registry._REGISTRY["t-lambda"] is first
        one, two = types.ModuleType("pkg_one"), types.ModuleType("pkg_two")
        for mod in (one, two):
            exec("from mmattn import MultiHeadAttention\n"
                 "class Attn(MultiHeadAttention):\n    pass\n", mod.__dict__)
        registry.register_attention("t-attn", one.Attn)
        with pytest.raises(ValueError, match="pkg_one.Attn.*pkg_two.Attn"):
            registry.register_attention("t-attn", two.Attn)
        gqa = functools.partial(mmattn.MultiHeadAttention, num_kv_heads=1)
        assert registry.register_attention("t-partial", gqa) is gqa
        assert registry.register_attention("t-partial", gqa) is gqa  # the same object: fine
        registry.register_attention("t-attn", two.Attn, override=True)
        assert isinstance(mmattn.TransformerBlock(8, 2, attention="t-attn").attn, two.Attn)
        with pytest.raises(TypeError, match="override must be a bool"):
            registry.register_attention("t-attn", two.Attn, override="yes")
    finally:
        registry._REGISTRY.clear()
        registry._REGISTRY.update(saved)


def _decode(attn: nn.Module, cache: Any, steps: int = 1) -> Any:
    return attn(torch.randn(2, steps, 8), is_causal=True, cache=cache)


def _hand_made_caches() -> None:
    local = mmattn.LocalAttention(8, 2, window_size=2, num_global_tokens=1)
    with pytest.raises(ValueError, match="num_global_tokens > 0 has no cache"):
        _decode(local, LocalKVCache(2, 16, 2, 2, 4))
    linformer = mmattn.LinformerAttention(8, 2, seq_len=8, proj_len=4)
    for steps in (1, 2):
        with pytest.raises(ValueError, match="LinformerAttention has no cache"):
            linformer(torch.randn(2, steps, 8), cache=KVCache(2, 16, 2, 4))


def _integer_caches() -> None:
    for make in (lambda: KVCache(2, 8, 2, 4, dtype=torch.long),
                 lambda: LocalKVCache(2, 8, 2, 2, 4, dtype=torch.int32),
                 lambda: ContextCache(2, 8, 2, 4, dtype=torch.int8),
                 lambda: mmattn.MultiHeadAttention(8, 2).make_cache(2, 8, dtype=torch.long)):
        with pytest.raises(TypeError, match="dtype must be a floating-point dtype"):
            make()


def _viz() -> Any:
    return pytest.importorskip("mmattn.viz")


def _viz_errors() -> None:
    viz = _viz()
    ring = torch.tensor([[0, 1], [1, 0]])
    for call, error, name in (
        (lambda: viz.audio_attention(torch.rand(4), torch.randn(4, 3), frame_rate=-5),
         ValueError, "frame_rate"),
        (lambda: viz.audio_attention(torch.rand(4), torch.randn(4, 3), frame_rate=0),
         ValueError, "frame_rate"),
        (lambda: viz.head_grid(torch.rand(3, 4, 4), ncols=2.5), TypeError, "ncols"),
        (lambda: viz.head_grid(torch.rand(0, 4, 4)), ValueError, "head"),
        (lambda: viz.image_attention(torch.rand(4), torch.rand(3, 8, 8), (-2, -2)),
         ValueError, "grid"),
        (lambda: viz.image_attention(torch.rand(4), torch.rand(3, 8, 8), (2.0, 2)),
         TypeError, "grid"),
        (lambda: viz.graph_attention(torch.rand(0), ring[:, :0]), ValueError, "node"),
        (lambda: viz.graph_attention(torch.rand(2), ring, query=1.5), TypeError, "query"),
        (lambda: viz.graph_attention(torch.rand(2), ring.float()), TypeError, "edge_index"),
    ):
        with pytest.raises(error, match=name):
            call()


# --------------------------------------------------------------------------- 7. opaque


def _meta_masks() -> None:
    meta = "meta"
    x = torch.randn(2, 5, 8, device=meta)
    attn = mmattn.LinformerAttention(8, 2, seq_len=8, proj_len=4, device=meta)
    out, _ = attn(x, key_padding_mask=torch.zeros(2, 5, device=meta))  # handled: no values read
    assert out.shape == (2, 5, 8) and out.is_meta
    tokens = Tokens(x, torch.ones(2, 5, dtype=torch.bool, device=meta))
    assert "meta" in repr(tokens)
    with pytest.raises(ValueError, match="Tokens.mask is on the meta device"):
        tokens.pack()
    with pytest.raises(ValueError, match="offsets is on the meta device"):
        Tokens.from_packed(torch.randn(3, 8, device=meta), torch.tensor([0, 3], device=meta))


# --------------------------------------------------------------------------- 8. refused


def _sdpa_float32_mask_with_half_query() -> None:
    """torch's SDPA takes a float32 mask with bf16 / fp16 queries: so do both our paths."""
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = torch.randn(3, 2, 2, 5, 8).to(dtype).unbind(0)
        bias = torch.randn(5, 5) * 3  # a relative-position bias kept in float32
        bias[0, 1] = float("-inf")
        want = F.scaled_dot_product_attention(q, k, v, bias)
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                               bias.double())
        for fused in (True, False):
            with MF.fused_attn(fused):
                out = MF.scaled_dot_product_attention(q, k, v, bias)
            assert out.dtype == dtype
            torch.testing.assert_close(out.float(), want.float(), rtol=3e-2, atol=3e-2)
            torch.testing.assert_close(out.double(), exact, rtol=3e-2, atol=3e-2)
        out, weights = MF.scaled_dot_product_attention(q, k, v, bias, need_weights=True)
        torch.testing.assert_close(weights.double(), torch.softmax(
            q.double() @ k.double().transpose(-1, -2) / 8 ** 0.5 + bias.double(), -1),
            rtol=2e-2, atol=2e-2)
    q = torch.randn(1, 2, 3, 4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="float32 or the dtype of query"):  # torch refuses too
        MF.scaled_dot_product_attention(q, q, q, torch.zeros(3, 3, dtype=torch.float16))


ITEMS_SECOND_PASS = [
    # 6. silently wrong results
    pytest.param(RAISES, _merge_masks_integer, id="merge_masks-integer-mask"),
    pytest.param(MATCHES, _replace_keeps_ties, id="replace_attention-tied-layers"),
    pytest.param(MATCHES, _replace_keeps_timm_ties, id="replace_attention-tied-timm-layers"),
    pytest.param(MATCHES, _block_with_torch_attention_keeps_samples_apart,
                 id="TransformerBlock-nn.MultiheadAttention-batch-first"),
    pytest.param(RAISES, _block_refuses_sequence_first_attention,
                 id="TransformerBlock-batch_first-False-attention"),
    pytest.param(RAISES, _registry_compares_identity, id="register_attention-identity"),
    pytest.param(RAISES, _hand_made_caches, id="hand-made-cache-global-tokens-linformer"),
    pytest.param(RAISES, _integer_caches, id="cache-integer-dtype"),
    pytest.param(RAISES, _viz_errors, id="viz-argument-errors"),
    # 7. opaque errors
    pytest.param(RAISES, _raises(TypeError, "attention_kwargs")(
        lambda: mmattn.TransformerBlock(8, 2, attention_kwargs="window")),
        id="attention_kwargs-str"),
    pytest.param(RAISES, _raises(TypeError, "attention_kwargs")(
        lambda: registry.build_attention("full", 8, 2, attention_kwargs=[("a", 1)])),
        id="build_attention-attention_kwargs-list"),
    pytest.param(MATCHES, _meta_masks, id="meta-masks-handled-or-named"),
    # 8. refused valid input
    pytest.param(MATCHES, _sdpa_float32_mask_with_half_query,
                 id="sdpa-float32-mask-with-bf16-fp16-query"),
]
