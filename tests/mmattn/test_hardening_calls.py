"""Issue 36 (hardening, fourth pass), the calls: items 3, 5, 6, 9, 10, 12 and 13.

Each test failed on main before its fix. References are naive float64 computations written
here from the docs (softmax over the allowed keys, ALiBi's −m_h·|i − j| with Press et al.'s
slopes, the chunked rule by a loop over pairs), or torch's own SDPA where the contract is
"as torch does".
"""

from __future__ import annotations

import math

import pytest
import torch

from mmattn import MultiHeadAttention, Tokens
from mmattn import patterns as P
from mmattn.functional import fused_attn

D, H = 16, 4


#: Tiny tensors: one intra-op thread (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_thread")


def chunked_allowed(length: int, chunk: int, left: int) -> torch.Tensor:
    """(L, L) bool, True = may attend: ``q // c - left <= k // c <= q // c``, by a loop."""
    return torch.tensor([[q // chunk - left <= k // chunk <= q // chunk for k in range(length)]
                         for q in range(length)])


def reference_layer(module, x, allowed, slopes=None):
    """The module's projections and a float64 softmax over ``allowed`` (L, L), with ALiBi
    ``−slopes[h]·|i − j|`` when given; a row with no allowed key gives 0."""
    p = {k: t.double() for k, t in module.state_dict().items()}
    b, n, d = x.shape
    e = d // H
    x = x.double()

    def heads(t):
        return t.reshape(b, n, H, e).transpose(1, 2)

    q, k, v = (heads(x @ p[f"{w}_proj.weight"].T + p[f"{w}_proj.bias"]) for w in "qkv")
    scores = q @ k.transpose(-1, -2) / math.sqrt(e)
    if slopes is not None:
        dist = (torch.arange(n)[:, None] - torch.arange(n)[None]).abs().double()
        scores = scores - torch.tensor(slopes, dtype=torch.float64)[:, None, None] * dist
    scores = scores.masked_fill(~allowed, -math.inf)
    weights = torch.softmax(scores, -1).nan_to_num(0.0)
    out = (weights @ v).transpose(1, 2).reshape(b, n, d)
    return out @ p["out_proj.weight"].T + p["out_proj.bias"]


def assert_close(got, want):
    """float32 against float64: relative to the reference's size."""
    scale = want.abs().max().item() + 1e-12
    err = (got.double() - want).abs().max().item()
    assert err <= 1e-5 * scale, f"max error {err:.3g} at scale {scale:.3g}"


# ---------------------------------------------------------------- item 3: key != query length


@pytest.mark.parametrize("left", [0, 1])
def test_chunk_cache_refuses_a_key_of_another_length_than_the_query(left):
    m = MultiHeadAttention(D, H).eval()
    x = torch.randn(2, 4, D)
    cache = m.make_cache(2, chunk=4, left=left)
    with pytest.raises(ValueError, match=r"key holds 3 tokens but query holds 4"):
        m(x, x[:, :3], cache=cache)
    assert len(cache) == 0  # refused before the cache moved
    out, _ = m(x, cache=cache)  # the stream goes on as if the bad call never happened
    assert out.shape == (2, 4, D)


# ---------------------------------------------------------------- item 13: ALiBi streams


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("left", [0, 1, 2])
def test_alibi_streams_through_a_chunk_cache_as_the_whole_clip(left, fused):
    torch.manual_seed(0)
    m = MultiHeadAttention(D, H, alibi=True).eval()
    chunk, length = 4, 14  # the last chunk is shorter
    x = torch.randn(2, length, D)
    slopes = [2.0 ** (-8.0 * (h + 1) / H) for h in range(H)]  # Press et al., H a power of 2
    want = reference_layer(m, x, chunked_allowed(length, chunk, left), slopes)
    with fused_attn(fused), torch.no_grad():
        cache = m.make_cache(2, chunk=chunk, left=left)
        got = torch.cat([m(x[:, s:s + chunk], cache=cache)[0]
                         for s in range(0, length, chunk)], 1)
        whole = m(x, attn_mask=P.chunked(chunk, left=left).compile(Tokens(x)))[0]
    assert_close(got, want)
    assert_close(whole, want)


# ---------------------------------------------------------------- item 6: empty sizes, block-sparse

EMPTY = [(0, 5), (2, 0), (0, 0)]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize(("batch", "length"), EMPTY, ids=[f"B{b}-L{n}" for b, n in EMPTY])
def test_a_sparse_mask_on_empty_sizes_gives_the_empty_result(batch, length, fused):
    x = torch.randn(batch, length, D, requires_grad=True)
    m = MultiHeadAttention(D, H, num_kv_heads=2)
    with fused_attn(fused):
        out, weights = m(x, attn_mask=P.causal().compile(Tokens(x)), need_weights=True,
                         average_attn_weights=False)
    assert out.shape == (batch, length, D) and weights.shape == (batch, H, length, length)
    out.sum().backward()  # attached to autograd, zero gradients (docs/edge_cases.md)
    assert torch.equal(m.q_proj.weight.grad, torch.zeros(D, D))


@pytest.mark.parametrize(("batch", "length"), EMPTY, ids=[f"B{b}-L{n}" for b, n in EMPTY])
@pytest.mark.parametrize("pattern", [P.causal(), P.chunked(2, left=1), ~P.window(1),
                                     P.same("documents") & P.causal()], ids=str)
def test_blocks_with_pattern_on_empty_sizes_give_the_empty_result(pattern, batch, length):
    from mmattn import Encoder, TransformerBlock

    meta = {"documents": torch.zeros(batch, length, dtype=torch.long)}
    tokens = Tokens(torch.randn(batch, length, D), None, meta)
    for model in (TransformerBlock(D, H, pattern=pattern), Encoder(D, H, 2, pattern=pattern)):
        out = model(tokens)
        assert out.x.shape == (batch, length, D)
        out.x.sum().backward()


# ---------------------------------------------------------------- item 12: (L, E) inputs to SDPA


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("case", ["plain", "bool", "float", "causal", "scale", "cross"])
def test_functional_sdpa_takes_two_dimensional_inputs_as_torch_does(case, fused):
    from torch.nn.functional import scaled_dot_product_attention as torch_sdpa

    from mmattn.functional import scaled_dot_product_attention

    torch.manual_seed(0)
    length, keys = 5, (7 if case == "cross" else 5)
    q, k, v = torch.randn(length, 8), torch.randn(keys, 8), torch.randn(keys, 6)
    kwargs = {}
    if case == "bool":
        kwargs["attn_mask"] = torch.rand(length, keys) > 0.3
        kwargs["attn_mask"][:, 0] = True  # torch gives NaN for a row without keys; mmattn 0
    elif case == "float":
        kwargs["attn_mask"] = torch.randn(length, keys)
    elif case == "causal":
        kwargs["is_causal"] = True
    elif case == "scale":
        kwargs["scale"] = 0.3
    want = torch_sdpa(q.double(), k.double(), v.double(),
                      **{n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point()
                             else t) for n, t in kwargs.items()})
    with fused_attn(fused):
        got = scaled_dot_product_attention(q, k, v, **kwargs)
        out, weights = scaled_dot_product_attention(q, k, v, **kwargs, need_weights=True)
    assert got.shape == want.shape == (length, 6) and weights.shape == (length, keys)
    assert_close(got, want)
    assert_close(out, want)
    assert_close(weights @ v, want)


# ---------------------------------------------------------------- item 10: a block streams


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize(("chunk", "left", "padded"), [(3, 1, False), (3, 1, True),
                                                       (4, 0, True), (2, 3, False)])
def test_a_block_built_with_chunked_streams_as_the_whole_clip(chunk, left, padded, fused):
    from mmattn import TransformerBlock

    torch.manual_seed(0)
    block = TransformerBlock(D, H, pattern=P.chunked(chunk, left=left)).eval()
    length = 11
    x = torch.randn(2, length, D)
    real = torch.ones(2, length, dtype=torch.bool)
    if padded:
        real[1, 7:] = False
    # the reference: the block's attention by hand on the chunked rule (float64), then its
    # residual, norm and MLP on the float64 result
    allowed = chunked_allowed(length, chunk, left) & real[:, None, :] & real[:, :, None]
    with torch.no_grad():
        h = block.norm1(x.masked_fill(~real[..., None], 0.0))
        y = x.masked_fill(~real[..., None], 0.0).double() + reference_layer(
            block.attn, h, allowed[:, None])
        want = (y + block.mlp.double()(block.norm2.double()(y))).masked_fill(
            ~real[..., None], 0.0)
        block.float()
        with fused_attn(fused):
            cache = block.attn.make_cache(2, chunk=chunk, left=left)
            got = torch.cat([block(Tokens(x[:, s:s + chunk], real[:, s:s + chunk]),
                                   cache=cache).x for s in range(0, length, chunk)], 1)
            whole = block(Tokens(x, real)).x
    assert len(cache) == length
    assert_close(got, want)
    assert_close(whole, want)


def test_a_block_refuses_a_cache_that_disagrees_with_its_pattern():
    from mmattn import TransformerBlock

    block = TransformerBlock(D, H, pattern=P.chunked(3, left=1)).eval()
    tokens = Tokens(torch.randn(2, 3, D))
    for chunk, left in ((4, 1), (3, 0), (3, 2)):
        with pytest.raises(ValueError, match=rf"chunk={chunk}, left={left}, but the block's "
                                             r"pattern is chunked\(3, left=1"):
            block(tokens, cache=block.attn.make_cache(2, chunk=chunk, left=left))
    with pytest.raises(TypeError, match=r"cache must be a ChunkCache .* got KVCache"):
        block(tokens, cache=block.attn.make_cache(2, 8))
    other = TransformerBlock(D, H, pattern=P.causal()).eval()
    with pytest.raises(ValueError, match=r"alone .*pattern=causal\(\)"):
        other(tokens, cache=other.attn.make_cache(2, chunk=3, left=1))
    causal = TransformerBlock(D, H, causal=True, pattern=P.chunked(3, left=1)).eval()
    with pytest.raises(ValueError, match=r"needs causal=False"):
        causal(tokens, cache=causal.attn.make_cache(2, chunk=3, left=1))


# ---------------------------------------------------------------- item 9: timm norm names


@pytest.mark.parametrize("name", ["LayerNorm", "layernorm", "rms_norm"])
def test_timm_attention_takes_a_norm_layer_name_as_timms_models_do(name):
    timm_layers = pytest.importorskip("timm.layers")
    from mmattn.integrations.timm import Attention

    # timm's own resolution of the name, used to build timm's module as the reference
    layer = timm_layers.get_norm_layer(name)
    kwargs = {"qk_norm": True, "scale_norm": True, "qkv_bias": True}
    torch.manual_seed(0)
    ours = Attention(D, H, norm_layer=name, **kwargs).eval()
    torch.manual_seed(0)
    theirs = timm_layers.Attention(D, H, norm_layer=layer, **kwargs).eval()
    assert type(ours.q_norm) is type(theirs.q_norm) is layer
    assert type(ours.norm) is layer
    for (n1, t1), (n2, t2) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert n1 == n2 and torch.equal(t1, t2)
    x = torch.randn(2, 5, D)
    with torch.no_grad():
        want = theirs(x).double()  # timm in float32: relative 1e-5 of its size
        assert_close(ours(x), want)


def test_timm_attention_names_a_bad_norm_layer():
    pytest.importorskip("timm")
    from mmattn.integrations.timm import Attention

    with pytest.raises(ValueError, match=r"norm_layer='nope' is not a norm layer name"):
        Attention(D, H, qk_norm=True, norm_layer="nope")
    with pytest.raises(TypeError, match=r"norm_layer must be a norm constructor .* got int"):
        Attention(D, H, qk_norm=True, norm_layer=3)


# ---------------------------------------------------------------- item 5: s_aux checked


def _sink_reference(q, k, v, sinks):
    """softmax over the keys plus one zero-valued key of score sinks[h] (float64)."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    sink = sinks.double()[None, :, None, None].expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    return (weights @ v).transpose(1, 2)  # (b, i, h, e), as transformers expects back


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_hf_s_aux_of_a_float_dtype_is_the_sink_logit(dtype):
    from torch import nn

    from mmattn.integrations.huggingface import attention_forward

    torch.manual_seed(0)
    module = nn.Module()
    module.is_causal = False
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    sinks = torch.randn(4).to(dtype)
    out, _ = attention_forward(module, q, k, v, None, s_aux=sinks)
    assert_close(out, _sink_reference(q, k, v, sinks))


def test_hf_s_aux_of_a_wrong_kind_dtype_or_device_is_named():
    from torch import nn

    from mmattn.integrations.huggingface import attention_forward

    module = nn.Module()
    module.is_causal = False
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    for bad, got in ((torch.zeros(4, dtype=torch.long), "torch.int64"),
                     (torch.zeros(4, dtype=torch.bool), "torch.bool"), ([0.0] * 4, "list")):
        with pytest.raises(TypeError, match=rf"s_aux .*floating tensor .* got {got}"):
            attention_forward(module, q, k, v, None, s_aux=bad)
    with pytest.raises(ValueError, match=r"s_aux .* on device meta but query is on device cpu"):
        attention_forward(module, q, k, v, None, s_aux=torch.zeros(4, device="meta"))
    with pytest.raises(ValueError, match=r"s_aux .* shape \(4,\), got \(1, 4\)"):
        attention_forward(module, q, k, v, None, s_aux=torch.zeros(1, 4))
