"""MultiHeadAttention / CrossAttention against torch.nn.MultiheadAttention (the reference)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from mmattn import CrossAttention, MultiHeadAttention
from mmattn.functional import fused_attn

warnings.filterwarnings("ignore", message=".*mismatched key_padding_mask.*")


def _random_mask(gen: torch.Generator, shape, kind: str, dtype: torch.dtype):
    """A module-direction mask (True / -inf = not allowed) of the requested kind."""
    hidden = torch.rand(shape, generator=gen) < 0.35
    if kind == "bool":
        return hidden
    values = torch.randn(shape, generator=gen, dtype=dtype)
    return values.masked_fill(hidden, float("-inf"))


def _compare(ref_out, out, ref_w, w, atol):
    """Equal wherever torch is finite. Where torch gives NaN (a query row with no allowed key
    in some head) ours stays finite and that head's weights are zero; the exact output there
    is checked against a per-head reference in ``test_rows_dead_in_some_heads``."""
    finite = torch.isfinite(ref_out)
    torch.testing.assert_close(out[finite], ref_out[finite], atol=atol, rtol=atol)
    assert torch.isfinite(out).all()
    if ref_w is not None:
        finite_w = torch.isfinite(ref_w)
        torch.testing.assert_close(w[finite_w], ref_w[finite_w], atol=atol, rtol=atol)
        assert torch.isfinite(w).all()


@st.composite
def configs(draw):
    num_heads = draw(st.sampled_from([1, 2, 3, 4]))
    head_dim = draw(st.integers(1, 4))
    return {
        "batch": draw(st.integers(1, 3)),
        "q_len": draw(st.integers(1, 6)),
        "k_len": draw(st.integers(1, 6)),
        "num_heads": num_heads,
        "embed_dim": num_heads * head_dim,
        "kdim": draw(st.sampled_from([None, 3, 5])),
        "vdim": draw(st.sampled_from([None, 2, 7])),
        "bias": draw(st.booleans()),
        "add_bias_kv": draw(st.booleans()),
        "add_zero_attn": draw(st.booleans()),
        "batch_first": draw(st.booleans()),
        "unbatched": draw(st.booleans()),
        "kpm": draw(st.sampled_from([None, "bool", "float"])),
        "attn_mask": draw(st.sampled_from([None, "bool2d", "bool3d", "float2d", "float3d"])),
        "is_causal": draw(st.booleans()),
        "need_weights": draw(st.booleans()),
        "average": draw(st.booleans()),
        "fused": draw(st.booleans()),
        "dtype": draw(st.sampled_from([torch.float32, torch.float64])),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs())
def test_matches_torch_multihead_attention(cfg):
    """>= 200 generated configurations: outputs and weights equal nn.MultiheadAttention's."""
    torch.manual_seed(cfg["seed"])
    gen = torch.Generator().manual_seed(cfg["seed"])
    dtype = cfg["dtype"]
    batch, q_len, heads = cfg["batch"], cfg["q_len"], cfg["num_heads"]
    k_len = q_len if cfg["is_causal"] else cfg["k_len"]
    ref = nn.MultiheadAttention(
        cfg["embed_dim"], heads, bias=cfg["bias"], add_bias_kv=cfg["add_bias_kv"],
        add_zero_attn=cfg["add_zero_attn"], kdim=cfg["kdim"], vdim=cfg["vdim"],
        batch_first=cfg["batch_first"], dtype=dtype,
    )
    ours = MultiHeadAttention.from_torch(ref)
    kdim, vdim = ref.kdim, ref.vdim
    if cfg["unbatched"]:
        batch = 1
    query = torch.randn(batch, q_len, cfg["embed_dim"], generator=gen, dtype=dtype)
    key = torch.randn(batch, k_len, kdim, generator=gen, dtype=dtype)
    value = torch.randn(batch, k_len, vdim, generator=gen, dtype=dtype)
    kpm = None if cfg["kpm"] is None else _random_mask(gen, (batch, k_len), cfg["kpm"], dtype)
    attn_mask = None
    if cfg["attn_mask"] is not None:
        kind, rank = cfg["attn_mask"][:-2], cfg["attn_mask"][-2:]
        shape = (q_len, k_len) if rank == "2d" else (batch * heads, q_len, k_len)
        attn_mask = _random_mask(gen, shape, kind, dtype)
    if cfg["unbatched"]:
        query, key, value = query[0], key[0], value[0]
        kpm = None if kpm is None else kpm[0]
    elif not cfg["batch_first"]:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))

    # torch needs the causal mask spelled out; ours applies it from is_causal alone
    # (combined with any attn_mask).
    ref_mask = attn_mask
    if cfg["is_causal"]:
        causal = torch.ones(q_len, k_len, dtype=torch.bool).triu(1)
        if attn_mask is None:
            ref_mask = causal
        elif attn_mask.dtype == torch.bool:
            ref_mask = attn_mask | causal
        else:
            ref_mask = attn_mask.masked_fill(causal, float("-inf"))
    kwargs = {"need_weights": cfg["need_weights"], "average_attn_weights": cfg["average"]}
    ref_out, ref_w = ref(query, key, value, key_padding_mask=kpm, attn_mask=ref_mask, **kwargs)
    with fused_attn(cfg["fused"]):
        out, w = ours(
            query, key, value, key_padding_mask=kpm, attn_mask=attn_mask,
            is_causal=cfg["is_causal"], **kwargs,
        )
    atol = 1e-5 if dtype == torch.float32 else 1e-10
    assert out.shape == ref_out.shape
    assert (w is None) == (ref_w is None)
    if w is not None:
        assert w.shape == ref_w.shape
    _compare(ref_out, out, ref_w, w, atol)


def test_round_trip_to_torch_and_back():
    ours = MultiHeadAttention(12, 3, kdim=5, vdim=7, add_bias_kv=True, batch_first=False)
    back = MultiHeadAttention.from_torch(ours.to_torch())
    for (name, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name
    packed = MultiHeadAttention(8, 2).to_torch()
    assert packed._qkv_same_embed_dim and packed.in_proj_weight.shape == (24, 8)


@pytest.mark.parametrize("fused", [True, False])
def test_fully_masked_rows_are_zero_with_finite_gradients(device, fused):
    mha = MultiHeadAttention(8, 2, device=device)
    x = torch.randn(3, 4, 8, device=device, requires_grad=True)
    kpm = torch.zeros(3, 4, dtype=torch.bool, device=device)
    kpm[1] = True  # sample 1: every key is padding
    attn_mask = torch.zeros(4, 4, dtype=torch.bool, device=device)
    attn_mask[2] = True  # query 2 of every sample: no allowed key
    with fused_attn(fused):
        out, w = mha(x, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=True)
        out_fast, _ = mha(x, key_padding_mask=kpm, attn_mask=attn_mask)
    bias = mha.out_proj.bias
    torch.testing.assert_close(out[1], bias.expand(4, 8))
    torch.testing.assert_close(out[:, 2], bias.expand(3, 8))
    assert (w[1] == 0).all() and (w[:, 2] == 0).all()
    torch.testing.assert_close(out_fast, out)
    (out.square().sum() + out_fast.sum()).backward()
    assert torch.isfinite(x.grad).all()
    for p in mha.parameters():
        assert torch.isfinite(p.grad).all()


@pytest.mark.parametrize("fused", [True, False])
def test_rows_dead_in_some_heads(fused):
    """A (row, head) with no allowed key contributes a zero attention result to that head."""
    mha = MultiHeadAttention(8, 2)
    x = torch.randn(2, 4, 8)
    attn_mask = torch.zeros(2 * 2, 4, 4, dtype=torch.bool)
    attn_mask[0, 1] = True  # sample 0, head 0, query 1: nothing allowed
    with fused_attn(fused):
        out, _ = mha(x, attn_mask=attn_mask)
    _, w = mha(x, attn_mask=attn_mask, need_weights=True, average_attn_weights=False)
    assert (w[0, 0, 1] == 0).all() and torch.allclose(w[0, 1, 1].sum(), torch.tensor(1.0))
    v = mha.v_proj(x).reshape(2, 4, 2, 4).transpose(1, 2)  # (b, h, j, e), independent split
    per_head = torch.matmul(w, v).transpose(1, 2).reshape(2, 4, 8)
    torch.testing.assert_close(out, mha.out_proj(per_head), atol=1e-6, rtol=1e-5)
    assert (per_head[0, 1, :4] == 0).all()


def test_padding_invariance(device):
    """Changing values at padded key positions leaves every real output unchanged."""
    mha = MultiHeadAttention(16, 4, device=device)
    x = torch.randn(2, 6, 16, device=device)
    kpm = torch.tensor([[0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.bool, device=device)
    out, _ = mha(x, key_padding_mask=kpm)
    noisy = x.clone()
    noisy[0, 4:] = 1e4 * torch.randn(2, 16, device=device)
    out2, _ = mha(noisy, key_padding_mask=kpm)
    torch.testing.assert_close(out2[0, :4], out[0, :4])
    torch.testing.assert_close(out2[1], out[1])


def test_explicit_and_fused_paths_agree(device):
    mha = MultiHeadAttention(32, 4, device=device)
    x = torch.randn(3, 9, 32, device=device)
    kpm = torch.rand(3, 9, device=device) < 0.3
    with fused_attn(True):
        a, _ = mha(x, key_padding_mask=kpm, is_causal=True)
    with fused_attn(False):
        b, _ = mha(x, key_padding_mask=kpm, is_causal=True)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_dropout_matches_torch_with_the_same_seed():
    """Explicit path: same RNG draws as nn.MultiheadAttention, so the same dropped weights."""
    ref = nn.MultiheadAttention(16, 4, dropout=0.3, batch_first=True)
    ours = MultiHeadAttention.from_torch(ref)
    x = torch.randn(2, 5, 16)
    torch.manual_seed(7)
    ref_out, ref_w = ref(x, x, x, need_weights=True, average_attn_weights=False)
    torch.manual_seed(7)
    out, w = ours(x, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(w, ref_w)
    assert (w == 0).any()  # dropout really dropped something


def test_fused_dropout_is_unbiased_and_off_in_eval():
    mha = MultiHeadAttention(8, 2, dropout=0.5)
    x = torch.randn(1, 4, 8)
    clean, _ = mha.eval()(x)
    mha.train()
    draws = torch.stack([mha(x)[0] for _ in range(3000)])
    assert not torch.equal(draws[0], draws[1])
    # a sampling error (3000 draws of values below 1), not rounding: it stays absolute
    torch.testing.assert_close(draws.mean(0), clean, atol=0.05, rtol=0)


def test_gradcheck_float64():
    mha = MultiHeadAttention(6, 2, kdim=4, add_bias_kv=True, dtype=torch.float64)
    q = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 4, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 4, 6, dtype=torch.float64, requires_grad=True)
    kpm = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    for fused in (True, False):
        with fused_attn(fused):
            assert torch.autograd.gradcheck(
                lambda q, k, v: mha(q, k, v, key_padding_mask=kpm)[0], (q, k, v)
            )
    no_bias_kv = MultiHeadAttention(6, 2, dtype=torch.float64)
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    all_masked = torch.ones(2, 3, dtype=torch.bool)
    assert torch.autograd.gradcheck(
        lambda x: no_bias_kv(x, key_padding_mask=all_masked, need_weights=True)[0], (x,)
    )


@pytest.mark.parametrize(
    "device, dtype",
    [
        ("cpu", torch.bfloat16),
        pytest.param("cuda", torch.bfloat16, marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="needs CUDA")),
        pytest.param("cuda", torch.float16, marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="needs CUDA")),
    ],
)
@pytest.mark.parametrize("fused", [True, False])
def test_low_precision_large_inputs_stay_close_to_fp32(device, dtype, fused):
    """Inputs x100 in half precision: finite, and close to the fp32 result.

    With default weights, x100 inputs make the softmax so sharp that rounding the weights
    to bf16 alone moves an fp32 model by ~20%: that case only checks for overflow. For
    closeness the query/key projections are scaled down so the scores stay O(1) while
    values, projections and outputs carry the x100 magnitudes.
    """
    ref = MultiHeadAttention(64, 4, device=device)
    x = 100 * torch.randn(2, 16, 64, device=device)
    kpm = torch.zeros(2, 16, dtype=torch.bool, device=device)
    kpm[0, 10:] = True
    with fused_attn(fused):
        sharp, _ = copy.deepcopy(ref).to(dtype)(x.to(dtype), key_padding_mask=kpm)
        assert torch.isfinite(sharp).all()
        with torch.no_grad():
            ref.q_proj.weight.div_(100)
            ref.k_proj.weight.div_(100)
        low = copy.deepcopy(ref).to(dtype)
        ref = copy.deepcopy(low).float()  # fp32 twin of the exact same (rounded) weights
        x = x.to(dtype)
        expected, _ = ref(x.float(), key_padding_mask=kpm)
        out, _ = low(x, key_padding_mask=kpm)
    assert out.dtype == dtype and torch.isfinite(out).all()
    rel = (out.float() - expected).norm() / expected.norm()
    assert rel < 0.02, rel


def test_cross_attention_widths_and_required_key():
    xattn = CrossAttention(16, 4, kdim=6)
    assert xattn.vdim == 6
    q, ctx = torch.randn(2, 3, 16), torch.randn(2, 11, 6)
    out, w = xattn(q, ctx, need_weights=True)
    assert out.shape == (2, 3, 16) and w.shape == (2, 3, 11)
    ref = nn.MultiheadAttention(16, 4, kdim=6, vdim=6, batch_first=True)
    ref.load_state_dict(xattn.to_torch().state_dict())
    torch.testing.assert_close(out, ref(q, ctx, ctx)[0])
    with pytest.raises(TypeError, match="requires key"):
        xattn(q)


def test_is_causal_alone_equals_explicit_causal_mask(device):
    mha = MultiHeadAttention(8, 2, device=device)
    x = torch.randn(2, 5, 8, device=device)
    causal = torch.ones(5, 5, dtype=torch.bool, device=device).triu(1)
    torch.testing.assert_close(mha(x, is_causal=True)[0], mha(x, attn_mask=causal)[0])


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("training", [True, False])
def test_drop_in_for_transformer_encoder_layer(norm_first, batch_first, training):
    layer = nn.TransformerEncoderLayer(
        32, 4, dim_feedforward=64, dropout=0.0, batch_first=batch_first, norm_first=norm_first
    )
    swapped = copy.deepcopy(layer)
    swapped.self_attn = MultiHeadAttention.from_torch(layer.self_attn)
    layer.train(training)
    swapped.train(training)
    src = torch.randn(3, 7, 32)
    kpm = torch.zeros(3, 7, dtype=torch.bool)
    kpm[0, 5:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(7) == float("-inf")
    if not batch_first:
        src = src.transpose(0, 1)
    with torch.no_grad():
        for kwargs in ({}, {"src_key_padding_mask": kpm},
                       {"src_mask": causal, "is_causal": True, "src_key_padding_mask": kpm}):
            expected = layer(src, **kwargs)
            got = swapped(src, **kwargs)
            if "src_key_padding_mask" in kwargs and not training and batch_first:
                # torch's eval fast path zeroes padded query rows; compare the real ones.
                real = ~kpm
                expected, got = expected[real], got[real]
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("training", [True, False])
def test_drop_in_for_transformer_decoder_layer(training):
    layer = nn.TransformerDecoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    swapped = copy.deepcopy(layer)
    swapped.self_attn = MultiHeadAttention.from_torch(layer.self_attn)
    swapped.multihead_attn = CrossAttention.from_torch(layer.multihead_attn)
    layer.train(training)
    swapped.train(training)
    tgt, memory = torch.randn(2, 5, 32), torch.randn(2, 9, 32)
    mem_kpm = torch.zeros(2, 9, dtype=torch.bool)
    mem_kpm[1, 6:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    with torch.no_grad():
        expected = layer(tgt, memory, tgt_mask=causal, tgt_is_causal=True,
                         memory_key_padding_mask=mem_kpm)
        got = swapped(tgt, memory, tgt_mask=causal, tgt_is_causal=True,
                      memory_key_padding_mask=mem_kpm)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_torch_compile_fullgraph_matches_eager():
    mha = MultiHeadAttention(16, 4)
    x = torch.randn(2, 6, 16)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, 4:] = True
    compiled = torch.compile(mha, fullgraph=True, backend="aot_eager")
    for need_weights in (False, True):
        out, w = compiled(x, key_padding_mask=kpm, need_weights=need_weights)
        ref_out, ref_w = mha(x, key_padding_mask=kpm, need_weights=need_weights)
        torch.testing.assert_close(out, ref_out)
        if need_weights:
            torch.testing.assert_close(w, ref_w)


def test_extra_repr_and_reset_parameters():
    mha = MultiHeadAttention(16, 4, dropout=0.1, kdim=8)
    text = repr(mha)
    assert "embed_dim=16" in text and "num_heads=4" in text and "kdim=8" in text
    with torch.no_grad():
        mha.q_proj.weight.zero_()
    mha.reset_parameters()
    assert mha.q_proj.weight.abs().sum() > 0
    assert (mha.q_proj.bias == 0).all()
