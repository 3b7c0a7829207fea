"""Score modifiers (sinks, softcap, ALiBi) on the block-sparse kernel.

``MultiHeadAttention(..., attn_mask=SparseMask)`` with modifiers equals the same module
given the dense mask ``(~mask.dense()).repeat_interleave(H, 0)`` (the dense kernel, held to
a float64 explicit reference in tests/mmattn/attention/test_modifiers.py): outputs, weights,
the gradients of the input, of ``sinks`` and of every other parameter, with key padding,
grouped heads and rows without any allowed key, on both paths. The fused CPU path's split
over rectangles (merged through the logsumexp) is covered with sinks; an Encoder takes the
modifiers through ``attention_kwargs`` with ``pattern=``; the Hugging Face backend runs a
gpt-oss-like call (``s_aux``) on a half-empty mask block-sparse, against a float64 softmax
with the sink column written out here.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mmattn import Encoder, MultiHeadAttention, Tokens
from mmattn import patterns as P
from mmattn.debug import explain
from mmattn.functional import fused_attn
from mmattn.integrations import huggingface as hf
from mmattn.kernels import dense as _kernel
from mmattn.kernels.block_sparse import fast_parts

B, L, D, H = 2, 41, 32, 4
PATTERN = P.same("documents") & P.causal() | P.window(2) & P.same("documents")
MODIFIERS = {
    "sinks": ({"sinks": True}, 2),
    "softcap": ({"softcap": 2.0}, 4),
    "alibi": ({"alibi": True}, 1),
    "all": ({"sinks": True, "softcap": 3.0, "alibi": True}, 2),
}


def batch(length=L, docs_len=13, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.arange(length)[None] < torch.tensor([[length], [length * 2 // 3]])
    docs = (torch.arange(length) // docs_len)[None].repeat(2, 1)
    docs[0, docs_len:docs_len + 3] = -1  # rows with no allowed key
    x = torch.randn(B, length, D, generator=gen)
    return x, Tokens(x, mask, meta={"documents": docs})


def module(kv_heads, **mods):
    torch.manual_seed(1)
    attn = MultiHeadAttention(D, H, num_kv_heads=kv_heads, **mods)
    if attn.sinks is not None:
        with torch.no_grad():
            attn.sinks.copy_(torch.tensor([1.5, -0.5, 0.0, 3.0]))  # a sink that matters
    return attn


def run(attn, x, attn_mask, **kwargs):
    xi = x.clone().requires_grad_()
    out, w = attn(xi, attn_mask=attn_mask, average_attn_weights=False, **kwargs)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.device)
    params = [xi, *attn.parameters()]
    return out, w, torch.autograd.grad(out, params, grad)


def compare(attn, x, mask, **kwargs):
    """Sparse vs dense mask on the same module; returns the sparse output and gradients."""
    dense = (~mask.dense()).repeat_interleave(H, 0)
    (out, w, grads), (ref, ref_w, ref_grads) = (run(attn, x, m, **kwargs) for m in (mask, dense))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if w is not None:
        torch.testing.assert_close(w, ref_w, atol=1e-5, rtol=1e-5)
    names = ["input", *(n for n, _ in attn.named_parameters())]
    for name, a, b in zip(names, grads, ref_grads):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    return out, dict(zip(names, grads))


def paths(fn):
    """``fn()`` and the path records of its attention calls."""
    seen = []
    remove = _kernel.add_listener(seen.append)
    try:
        result = fn()
    finally:
        remove()
    return result, seen


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("case", list(MODIFIERS))
def test_module_with_modifiers_equals_the_dense_mask(case, fused):
    mods, kv_heads = MODIFIERS[case]
    x, tokens = batch()
    attn = module(kv_heads, **mods)
    with fused_attn(fused):
        for block in (8, 16):
            mask = PATTERN.compile(tokens, block)
            out, grads = compare(attn, x, mask, key_padding_mask=tokens.key_padding_mask,
                                 need_weights=not fused and block == 8)
            dead = ~PATTERN.dense(tokens).any(-1)  # no allowed key: attention gives 0
            assert dead.sum() >= 3
            assert torch.allclose(out[dead], attn.out_proj.bias.expand_as(out[dead]))
            if "sinks" in mods:
                assert grads["sinks"].abs().min() > 0  # every head's sink gets a gradient
        record = paths(lambda m=mask: attn(x, attn_mask=m))[1][0]
    assert record["path"] == "block-sparse"
    assert record["modifiers"].names() == _names(mods)
    assert bool(record["reasons"]) == (not fused or "softcap" in mods)


def _names(mods):
    found = ["sinks"] if mods.get("sinks") else []
    found += [f"softcap={mods['softcap']:g}"] if "softcap" in mods else []
    return found + (["alibi"] if mods.get("alibi") else [])


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_extra_key_mask_and_causal_flag_with_modifiers(fused, device):
    """A bool key mask with the causal flag; a float one (one that needs a gradient sends
    the fused call to the bucket-by-bucket SDPA path, as CUDA does)."""
    x, tokens = batch()
    x, tokens = x.to(device), tokens.to(device)
    tokens.meta["documents"] = tokens.meta["documents"].to(device)
    attn = module(2, sinks=True, alibi=True).to(device)
    mask = P.window(4).compile(tokens, 8)
    extra = torch.rand(B, L, generator=torch.Generator().manual_seed(3)).to(device) > 0.7
    with fused_attn(fused):
        compare(attn, x, mask, key_padding_mask=extra, is_causal=True)
        compare(attn, x, mask, key_padding_mask=torch.where(extra, -1.5, 0.0))
        compare(attn, x, mask, key_padding_mask=torch.where(extra, -1.5, 0.0).requires_grad_())


def test_sinks_on_the_fused_rectangles_merged_by_logsumexp():
    """Long documents give rectangles of full tiles (one call each, no mask), merged with
    the buckets through the logsumexp; the sink joins after the merge."""
    x, tokens = batch(length=140, docs_len=64)
    mask = P.same("documents").compile(tokens, 8)
    rects, _ = fast_parts(mask.plan(D))
    assert len(rects) >= 2
    for mods in ({"sinks": True}, {"sinks": True, "alibi": True}):
        attn = module(2, **mods)
        out, grads = compare(attn, x, mask)
        dead = ~mask.dense().any(-1)
        assert torch.allclose(out[dead], attn.out_proj.bias.expand_as(out[dead]))


def test_encoder_pattern_with_modifiers_in_attention_kwargs():
    x, tokens = batch(length=70, docs_len=23)
    pattern = P.same("documents") & P.window(9)
    kwargs = {"sinks": True, "softcap": 4.0, "alibi": True, "num_kv_heads": 2}
    torch.manual_seed(0)
    model = Encoder(D, 2, H, causal=True, pattern=pattern, attention_kwargs=kwargs)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.sinks.normal_()
    ref = Encoder(D, 2, H, causal=True, attention_kwargs=kwargs)
    ref.load_state_dict(model.state_dict())
    out = model(tokens).x
    expected = ref(tokens, attn_mask=~(pattern & P.causal()).dense(tokens)).x
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    expected.square().sum().backward()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5, msg=name)
    assert [c.path for c in explain(model, tokens)] == ["block-sparse"] * 2


def sink_reference(q, k, v, mask, scale, sinks, softcap=None):
    """float64 softmax over [scores, σ_h] (the sink column dropped) · V; rows without an
    allowed key give 0."""
    groups = q.shape[1] // k.shape[1]
    q, k, v = (t.double() for t in (q, k, v))
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.double()[None, :, None, None].expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    weights = weights * mask.any(-1, keepdim=True)
    return (weights @ v).transpose(1, 2)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["sinks", "sinks+softcap"])
def test_hf_backend_runs_s_aux_block_sparse(fused, softcap):
    """A gpt-oss-like call: GQA, s_aux, a causal documents mask with left padding (at least
    half of its 64-tiles empty), against the float64 reference."""
    length, pad = 200, 30
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor([70, 60, 70]))
    rule = (doc[:, None] == doc[None]) & torch.ones(length, length, dtype=torch.bool).tril()
    real = torch.arange(length)[None] >= torch.tensor([[pad], [0]])
    mask = rule[None, None] & real[:, None, None, :] & real[:, None, :, None]
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(B, 4, length, 8, generator=gen).requires_grad_()
    k, v = (torch.randn(B, 2, length, 8, generator=gen).requires_grad_() for _ in range(2))
    s_aux = torch.tensor([0.5, 2.0, -1.0, 1.0], requires_grad=True)
    layer = nn.Module()
    with fused_attn(fused):
        (out, _), records = paths(lambda: hf.attention_forward(
            layer, q, k, v, mask, scaling=0.35, s_aux=s_aux, softcap=softcap))
    assert [r["path"] for r in records] == ["block-sparse"]
    ref = sink_reference(q, k, v, mask, 0.35, s_aux, softcap)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[0, :pad], torch.zeros_like(out[0, :pad]))  # padded rows: zero
    grad = torch.randn(out.shape, generator=gen)
    ours = torch.autograd.grad((out * grad).sum(), (q, k, v, s_aux))
    theirs = torch.autograd.grad((ref * grad.double()).sum(), (q, k, v, s_aux))
    for a, b in zip(ours, theirs):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

