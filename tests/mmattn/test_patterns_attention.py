"""MultiHeadAttention(attn_mask=SparseMask) equals the same module with the dense mask.

The reference is the module itself given ``attn_mask=(~mask.dense()).repeat_interleave(H, 0)``
(held to torch.nn.MultiheadAttention by the drop-in tests): outputs, weights and the
gradients of the input and of every parameter, with key padding, grouped heads, RoPE, both
paths; plus dropout, compile, export and the layers that must refuse a SparseMask.
"""

from __future__ import annotations

import pytest
import torch
from einops import rearrange

from mmattn import (
    AdditiveAttention,
    CrossAttention,
    EdgeAttention,
    Encoder,
    LinformerAttention,
    LocalAttention,
    MultiHeadAttention,
    NeighborhoodAttention,
    Tokens,
)
from mmattn import patterns as P
from mmattn.functional import fused_attn
from tests._features import needs

B, L, D, H = 2, 41, 32, 4


def batch():
    mask = torch.arange(L)[None] < torch.tensor([[L], [29]])
    docs = (torch.arange(L) // 13)[None].repeat(2, 1)
    docs[0, 13:16] = -1  # rows with no allowed key
    x = torch.randn(B, L, D)
    return x, Tokens(x, mask, meta={"documents": docs})


PATTERN = P.same("documents") & P.causal() | P.window(2) & P.same("documents")


def compare(module, x, mask, key_padding_mask, need_weights, **kwargs):
    dense = (~mask.dense()).repeat_interleave(module.num_heads, 0)
    results = []
    for attn_mask in (mask, dense):
        xi = x.clone().requires_grad_()
        out, w = module(xi, key_padding_mask=key_padding_mask, need_weights=need_weights,
                        attn_mask=attn_mask, average_attn_weights=False, **kwargs)
        grads = torch.autograd.grad(out, [xi, *module.parameters()], torch.ones_like(out))
        results.append((out, w, grads))
    (out, w, grads), (ref, ref_w, ref_grads) = results
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if need_weights:
        torch.testing.assert_close(w, ref_w, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    return out


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("kv_heads, position", [(4, None), (2, "rotary"), (1, None)])
def test_equals_dense_mask(kv_heads, position, fused):
    x, tokens = batch()
    module = MultiHeadAttention(D, H, num_kv_heads=kv_heads, position=position)
    with fused_attn(fused):
        for block in (16,) if kv_heads != 4 else (16, 64):
            mask = PATTERN.compile(tokens, block)
            out = compare(module, x, mask, tokens.key_padding_mask, need_weights=not fused)
            dead = ~PATTERN.dense(tokens).any(-1)  # rows without a key: out_proj.bias
            assert torch.allclose(out[dead], module.out_proj.bias.expand_as(out[dead]))
        if kv_heads != 2:
            return
        # an extra key mask and the causal flag on top of the pattern
        mask = P.window(4).compile(tokens, 8)
        extra = torch.rand(B, L) > 0.7
        compare(module, x, mask, extra, need_weights=False, is_causal=True)
        compare(module, x, mask, torch.where(extra, -1.5, 0.0), need_weights=False)


def test_padding_values_never_leak():
    x, tokens = batch()
    module = MultiHeadAttention(D, H)
    mask = PATTERN.compile(tokens)
    out, _ = module(x, attn_mask=mask)
    poisoned = x.clone()
    poisoned[1, 29:] = float("nan")
    out2, _ = module(poisoned, attn_mask=mask)
    real = tokens.mask
    torch.testing.assert_close(out2[real], out[real], atol=0, rtol=0)


def test_layouts_unbatched_and_sequence_first():
    x, tokens = batch()
    module = MultiHeadAttention(D, H, batch_first=False)
    mask = PATTERN.compile(tokens)
    out, _ = module(x.transpose(0, 1), attn_mask=mask)
    ref, _ = module(x.transpose(0, 1), attn_mask=(~mask.dense()).repeat_interleave(H, 0))
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    one = PATTERN.compile(Tokens(x[:1], meta={"documents": tokens.meta["documents"][:1]}))
    single, w = MultiHeadAttention(D, H)(x[0], attn_mask=one, need_weights=True)
    assert single.shape == (L, D) and w.shape == (L, L)


def test_dropout_acts_on_the_weights():
    """Training with dropout: the output is out_proj(weights · v) of the returned weights."""
    x, tokens = batch()
    module = MultiHeadAttention(D, H, dropout=0.5).train()
    mask = PATTERN.compile(tokens, 16)
    out, w = module(x, attn_mask=mask, need_weights=True, average_attn_weights=False)
    v = rearrange(module.v_proj(x), "b l (h e) -> b h l e", h=H)
    manual = module.out_proj(rearrange(w @ v, "b h l e -> b l (h e)"))
    torch.testing.assert_close(out, manual, atol=1e-5, rtol=1e-5)
    allowed = mask.dense()[:, None].expand_as(w)
    assert (w[allowed] == 0).float().mean() > 0.3  # about half the allowed weights dropped
    assert (w[~allowed] == 0).all()
    with fused_attn(True):
        fast, _ = module(x, attn_mask=mask)
    assert torch.isfinite(fast).all()
    assert not torch.allclose(fast, module.eval()(x, attn_mask=mask)[0])


@pytest.mark.slow
def test_torch_compile_same_numbers():
    """The kernel runs eagerly behind a graph break; the projections compile around it."""
    x, tokens = batch()
    module = MultiHeadAttention(D, H, num_kv_heads=2)
    mask = PATTERN.compile(tokens, 16)
    ref, _ = module(x, attn_mask=mask)
    for dynamic in (False, True):  # dynamo's capture; the graph break keeps the kernel eager
        backend = "eager"
        compiled = torch.compile(module, backend=backend, dynamic=dynamic)
        out, _ = compiled(x, attn_mask=mask)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


@needs("is_exporting")  # torch 2.5's dynamo reports our error as "Observed exception"
def test_export_raises_a_clear_error():
    """A SparseMask is no tensor: torch.export refuses it as an input, and a model that
    compiles its pattern inside (Encoder(pattern=...)) raises ours."""
    x, tokens = batch()
    mask = PATTERN.compile(tokens)
    with pytest.raises(Exception, match="Unsupported input type .*SparseMask"):
        torch.export.export(MultiHeadAttention(D, H), (x,), {"attn_mask": mask})
    encoder = Encoder(D, 1, H, pattern=P.causal())
    with pytest.raises(NotImplementedError, match="pattern= does not export"):
        torch.export.export(encoder, (Tokens(x),))


def test_layers_with_their_own_geometry_refuse_it():
    x, tokens = batch()
    mask = PATTERN.compile(tokens)
    layers = [
        (LocalAttention(D, H, window_size=2), {}),
        (NeighborhoodAttention(D, H, 3), {"grid": (1, L)}),
        (EdgeAttention(D, H), {"edge_index": torch.tensor([[0], [1]])}),
        (AdditiveAttention(D, H), {}),
        (LinformerAttention(D, H, seq_len=L, proj_len=4), {}),
    ]
    for layer, kwargs in layers:
        with pytest.raises(TypeError, match=f"attn_mask: {type(layer).__name__} does not take"):
            layer(x, attn_mask=mask, **kwargs)
    with pytest.raises(TypeError, match="attn_mask: CrossAttention does not take a SparseMask"):
        CrossAttention(D, H)(x, x, attn_mask=mask)
    with pytest.raises(TypeError, match="attn_mask: a SparseMask is a self-attention pattern"):
        MultiHeadAttention(D, H)(x, torch.randn(B, L, D), attn_mask=mask)


def test_a_mask_for_another_call_is_refused():
    x, tokens = batch()
    mask = PATTERN.compile(tokens)
    module = MultiHeadAttention(D, H)
    with pytest.raises(ValueError, match=r"attn_mask: the SparseMask was compiled for shape "
                                         r"\(2, 41, 41\).*batch 2 and length 40"):
        module(x[:, :40], attn_mask=mask)
    with pytest.raises(ValueError, match="batch 1 and length 41"):
        module(x[:1], attn_mask=mask)
    with pytest.raises(ValueError, match="attn_mask: a SparseMask does not take cache="):
        module(x, attn_mask=mask, cache=module.make_cache(B, L))
    with pytest.raises(ValueError, match="does not combine with add_bias_kv"):
        MultiHeadAttention(D, H, add_bias_kv=True)(x, attn_mask=mask)
    with pytest.raises(ValueError, match="a SparseMask runs on padded input"):
        module(tokens.pack().x, attn_mask=mask)


def test_on_every_device(device):
    """The compiled mask and the kernel follow the tokens' device (CUDA: the generic path)."""
    x, tokens = batch()
    x, tokens = x.to(device), tokens.to(device)
    tokens.meta["documents"] = tokens.meta["documents"].to(device)
    module = MultiHeadAttention(D, H, num_kv_heads=2).to(device)
    mask = PATTERN.compile(tokens, 16)
    assert mask.device.type == torch.device(device).type
    compare(module, x, mask, tokens.key_padding_mask.to(device), need_weights=False)
