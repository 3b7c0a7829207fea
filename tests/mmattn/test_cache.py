"""KV caches: decoding step by step equals one causal forward over the whole sequence.

The reference is the same module run once on all ``t`` tokens (``is_causal=True``; for
cross-attention, all queries against the context). Decoding feeds the tokens one at a time
and in chunks of 3 through ``module.make_cache`` and must agree within 1e-5 — for full,
local (ring cache), additive and cross-attention, with and without RoPE and GQA, on both
kernel paths. A compile counter shows that a compiled decoding step traces once.
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
from mmattn.cache import ContextCache, KVCache, LocalKVCache
from mmattn.functional import fused_attn

B, T, D, H = 2, 10, 32, 4

SELF = {
    "full": lambda **kw: MultiHeadAttention(D, H, **kw),
    "full-gqa-rope": lambda **kw: MultiHeadAttention(D, H, num_kv_heads=2, position="rotary", **kw),
    "local": lambda **kw: LocalAttention(D, H, window_size=3, **kw),
    "local-causal-rope": lambda **kw: LocalAttention(
        D, H, window_size=2, causal=True, position="rotary", num_kv_heads=1, **kw
    ),
    "local-window0": lambda **kw: LocalAttention(D, H, window_size=0, **kw),
    "additive-rope": lambda **kw: AdditiveAttention(D, H, position="rotary", **kw),
}


def _decode(module, x, chunk, cache, **kw):
    outs = [module(x[:, s:s + chunk], cache=cache, **kw)[0] for s in range(0, x.shape[1], chunk)]
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("name", sorted(SELF))
def test_self_attention_decoding_equals_causal_forward(device, name, chunk, fused):
    module = SELF[name](device=device).eval()
    x = torch.randn(B, T, D, device=device)
    with fused_attn(fused):
        want, _ = module(x, is_causal=True)
        cache = module.make_cache(B, max_len=T)
        got = _decode(module, x, chunk, cache, is_causal=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(cache) == T


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_cross_attention_decoding_projects_context_once(device, chunk, fused):
    module = CrossAttention(D, H, kdim=12, num_kv_heads=2, device=device).eval()
    x = torch.randn(B, T, D, device=device)
    context = torch.randn(B, 7, 12, device=device)
    kpm = torch.zeros(B, 7, dtype=torch.bool, device=device)
    kpm[1, 4:] = True
    with fused_attn(fused):
        want, _ = module(x, context, key_padding_mask=kpm)
        cache = module.make_cache(B, max_len=8)
        calls = []
        hook = module.k_proj.register_forward_hook(lambda *a: calls.append(1))
        got = _decode(module, x, chunk, cache, key=context, key_padding_mask=kpm)
        hook.remove()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(calls) == 1 and cache.filled and cache.context_len == 7


def test_decoding_gradients_match_the_causal_forward():
    module = MultiHeadAttention(D, H, position="rotary")
    x = torch.randn(B, 6, D)
    want, _ = module(x, is_causal=True)
    ref = torch.autograd.grad(want.square().sum(), module.q_proj.weight)[0]
    got = _decode(module, x, 2, module.make_cache(B, 6), is_causal=True)
    grad = torch.autograd.grad(got.square().sum(), module.q_proj.weight)[0]
    torch.testing.assert_close(grad, ref, atol=1e-5, rtol=1e-5)


def test_local_cache_memory_is_the_window_not_the_length():
    module = LocalAttention(D, H, window_size=4, causal=True)
    small, large = module.make_cache(B, 16), module.make_cache(B, 100_000)
    assert isinstance(small, LocalKVCache)
    assert small.k.shape == (B, H, 4, D // H) and small.nbytes == large.nbytes
    x = torch.randn(B, 40, D)
    before = large.nbytes
    _decode(module, x, 1, large)
    assert large.nbytes == before and len(large) == 40


def test_cache_types_and_reset():
    assert isinstance(MultiHeadAttention(D, H).make_cache(B, 4), KVCache)
    assert isinstance(AdditiveAttention(D, H).make_cache(B, 4), KVCache)
    cache = CrossAttention(D, H).make_cache(B, 4)
    assert isinstance(cache, ContextCache)
    module = MultiHeadAttention(D, H).eval()
    kv = module.make_cache(B, 4)
    x = torch.randn(B, 4, D)
    first = _decode(module, x, 1, kv, is_causal=True)
    kv.reset()
    torch.testing.assert_close(_decode(module, x, 2, kv, is_causal=True), first, atol=1e-6,
                               rtol=1e-6)
    assert "max_len=4" in repr(kv)


# ---------------------------------------------------------------------- bad input


def test_full_cache_names_the_sizes():
    module = MultiHeadAttention(D, H)
    cache = module.make_cache(B, max_len=4)
    module(torch.randn(B, 3, D), is_causal=True, cache=cache)
    with pytest.raises(ValueError, match=r"cache is full: it holds 3 of max_len=4 tokens and "
                                         r"cannot take 2 more"):
        module(torch.randn(B, 2, D), is_causal=True, cache=cache)
    local = LocalAttention(D, H, 2)
    ring = local.make_cache(B, max_len=2)
    with pytest.raises(ValueError, match="holds 0 of max_len=2 tokens and cannot take 3"):
        local(torch.randn(B, 3, D), is_causal=True, cache=ring)
    cross = CrossAttention(D, H)
    with pytest.raises(ValueError, match="context of length 5 does not fit the cache: max_len=4"):
        cross(torch.randn(B, 1, D), torch.randn(B, 5, D), cache=cross.make_cache(B, 4))


def test_cache_for_another_batch_or_dtype_raises():
    module = MultiHeadAttention(D, H)
    cache = module.make_cache(4, max_len=8)
    with pytest.raises(ValueError, match=r"batch_size=4, got query with batch size 2"):
        module(torch.randn(2, 1, D), is_causal=True, cache=cache)
    half = module.make_cache(2, max_len=8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"made for dtype torch.float64, got keys of dtype "
                                         r"torch.float32"):
        module(torch.randn(2, 1, D), is_causal=True, cache=half)
    other = MultiHeadAttention(D, H, num_kv_heads=2).make_cache(2, 8)
    with pytest.raises(ValueError, match="num_kv_heads=2, got keys with batch size 2 and 4"):
        module(torch.randn(2, 1, D), is_causal=True, cache=other)


def test_cache_call_errors():
    module = MultiHeadAttention(D, H)
    cache = module.make_cache(B, 8)
    x = torch.randn(B, 1, D)
    with pytest.raises(ValueError, match="call with is_causal=True"):
        module(x, cache=cache)
    with pytest.raises(ValueError, match="key_padding_mask is not supported"):
        module(x, key_padding_mask=torch.zeros(B, 1, dtype=torch.bool), is_causal=True,
               cache=cache)
    with pytest.raises(ValueError, match="attn_mask is not supported with cache="):
        module(x, attn_mask=torch.zeros(1, 1, dtype=torch.bool), is_causal=True, cache=cache)
    with pytest.raises(ValueError, match="needs a batched query"):
        module(x[0], is_causal=True, cache=cache)
    with pytest.raises(TypeError, match="cache must come from MultiHeadAttention.make_cache"):
        module(x, is_causal=True, cache={})
    cross = CrossAttention(D, H)
    with pytest.raises(ValueError, match="is_causal=True does not apply with a ContextCache"):
        cross(x, x, is_causal=True, cache=cross.make_cache(B, 4))
    with pytest.raises(ValueError, match="LinformerAttention has no cache"):
        LinformerAttention(D, H, seq_len=8, proj_len=4).make_cache(B, 8)
    with pytest.raises(ValueError, match="num_global_tokens > 0 has no cache"):
        LocalAttention(D, H, 2, num_global_tokens=1).make_cache(B, 8)
    with pytest.raises(ValueError, match="add_bias_kv or add_zero_attn has no cache"):
        MultiHeadAttention(D, H, add_bias_kv=True).make_cache(B, 8)


def test_cache_of_another_kind_window_or_device_raises():
    """A cache the module did not make would attend the wrong keys: refused by name."""
    full, local = MultiHeadAttention(D, H), LocalAttention(D, H, 2)
    cross = CrossAttention(D, H)
    x = torch.randn(B, 1, D)
    full_kinds = "KVCache, ContextCache or ChunkCache"
    for module, cache, kind in ((full, local.make_cache(B, 8), full_kinds),
                                (local, full.make_cache(B, 8), "LocalKVCache"),
                                (local, cross.make_cache(B, 8), "LocalKVCache"),
                                (cross, full.make_cache(B, 8), "ContextCache")):
        with pytest.raises(TypeError, match=rf"make_cache\(\.\.\.\) \(a {kind}\), got"):
            module(x, x, is_causal=module is not cross, cache=cache)
    with pytest.raises(ValueError, match="cache was made for window_size=3, but this "
                                         "LocalAttention has window_size=2"):
        local(x, is_causal=True, cache=LocalAttention(D, H, 3).make_cache(B, 8))
    with pytest.raises(ValueError, match="cache is on device meta but MultiHeadAttention"):
        full(x, is_causal=True, cache=full.make_cache(B, 8, device="meta"))
    filled = cross.make_cache(B, 8)
    cross(x, torch.randn(B, 3, D), cache=filled)
    with pytest.raises(ValueError, match="batch_size=2, got query with batch size 1"):
        cross(x[:1], torch.randn(1, 3, D), cache=filled)  # would broadcast over the context


@pytest.mark.parametrize("kind", ["full", "local", "cross"])
def test_decoding_an_empty_batch_or_no_new_token(kind):
    """Batch 0 and a step of 0 tokens give empty results (docs/edge_cases.md) and leave the
    cache as it was."""
    module = {"full": MultiHeadAttention(D, H, position="rotary"),
              "local": LocalAttention(D, H, 2), "cross": CrossAttention(D, H)}[kind]
    kw = {"is_causal": True} if kind != "cross" else {}
    for batch, steps in ((0, 2), (B, 0)):
        cache = module.make_cache(batch, 8)
        x = torch.randn(batch, steps, D)
        out, _ = module(x, x if kind != "cross" else torch.randn(batch, 3, D), cache=cache,
                        **kw)
        assert out.shape == (batch, steps, D)
        assert len(cache) == (steps if kind != "cross" else 3)


# ---------------------------------------------------------------------- torch.compile


def _compiled_steps(module, steps, **kw):
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    step = torch.compile(module, backend=counter, fullgraph=True)
    x = torch.randn(B, steps, D)
    cache = module.make_cache(B, max_len=16)
    with torch.no_grad():  # decoding: the buffers never start tracking gradients
        got = [step(x[:, s:s + 1], cache=cache, **kw)[0] for s in range(steps)]
    return counter.frame_count, torch.cat(got, dim=1), x


@pytest.mark.parametrize("name", ["full-gqa-rope", "local-causal-rope"])
def test_compiled_decoding_traces_once(name):
    module = SELF[name]().eval()
    frames, got, x = _compiled_steps(module, 6, is_causal=True)
    assert frames == 1
    want, _ = module(x, is_causal=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_compiled_cross_attention_decoding_traces_twice_at_most():
    module = CrossAttention(D, H).eval()
    context = torch.randn(B, 5, D)
    frames, got, x = _compiled_steps(module, 5, key=context)
    assert frames <= 2  # the call that fills the cache, then every later step
    torch.testing.assert_close(got, module(x, context)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["full", "local-causal-rope"])
def test_compiled_decoding_past_max_len_raises_instead_of_writing(name):
    """Compiled, the counter is never read in Python: an in-graph assertion must stop the
    step that would write past the buffers (eagerly ``check_room`` raises ValueError)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    module = SELF[name]().eval()
    step = torch.compile(module, backend=CompileCounter(), fullgraph=True)
    cache = module.make_cache(B, max_len=3)
    x = torch.randn(B, 4, D)
    with torch.no_grad():
        for s in range(3):
            step(x[:, s:s + 1], is_causal=True, cache=cache)
        keys = cache.k.clone()
        with pytest.raises(RuntimeError, match="cache is full: 1 more token.s. do not fit "
                                               "max_len=3"):
            step(x[:, 3:4], is_causal=True, cache=cache)
    assert len(cache) == 3 and torch.equal(cache.k, keys)  # nothing was written
