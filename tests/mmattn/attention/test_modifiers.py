"""Score modifiers (``sinks=``, ``softcap=``, ``alibi=``) on every layer equal a float64 explicit
reference: scores → softcap → ALiBi → mask → softmax with the sink column → weights · V.

The reference is written out here from the module's own projections (no mmattn kernel): for
each layer its scores (dot product, additive, Linformer's slots), its pattern (band, global
tokens, causal, padding), then the modifiers as docs/variants.md states them. Outputs, input
gradients and the gradients of ``sinks`` (and of a learned per-head float mask) must agree
within 1e-5, on the fused and the explicit path, dead rows included (zero, finite gradients).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from mmattn import (
    AdditiveAttention,
    CrossAttention,
    LinformerAttention,
    LocalAttention,
    MultiHeadAttention,
)
from mmattn.debug import explain
from mmattn.functional import fused_attn
from mmattn.kernels import dense as _kernel
from mmattn.kernels.modifiers import alibi_slopes

B, L, D, H = 2, 9, 16, 4
PAD = 4  # item 1 has its first PAD tokens padded: causal and band rows there are dead

MODS = {
    "sinks": {"sinks": True},
    "softcap": {"softcap": 1.5},
    "alibi": {"alibi": True},
    "all": {"sinks": True, "softcap": 1.5, "alibi": True},
}

#: name -> (build(**modifiers), call kind, is_causal at call time)
LAYERS = {
    "mha_gqa": (lambda **kw: MultiHeadAttention(D, H, num_kv_heads=2, **kw), "self", False),
    "mha_causal": (lambda **kw: MultiHeadAttention(D, H, **kw), "self", True),
    "mha_bias": (lambda **kw: MultiHeadAttention(D, H, **kw), "bias", False),
    "cross": (lambda **kw: CrossAttention(D, H, kdim=12, num_kv_heads=1, **kw), "cross", False),
    "local": (lambda **kw: LocalAttention(D, H, window_size=2, block_size=3, **kw), "self",
              False),
    "local_causal_gqa": (
        lambda **kw: LocalAttention(D, H, window_size=3, causal=True, num_kv_heads=2, **kw),
        "self", False,
    ),
    "local_global": (
        lambda **kw: LocalAttention(D, H, window_size=1, num_global_tokens=2, **kw), "self",
        False,
    ),
    "additive": (lambda **kw: AdditiveAttention(D, H, **kw), "self", True),
    "linformer": (lambda **kw: LinformerAttention(D, H, seq_len=L, proj_len=4, **kw), "self",
                  False),
}
NO_ALIBI = {"cross", "linformer"}  # two sequences / projected slots: refused (tested below)


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)


def reference(m: nn.Module, x, context, key_padding_mask, attn_mask, is_causal):
    """The layer's output, spelled out (any dtype: the tests pass float64 copies)."""
    key = x if context is None else context
    h, groups, e = m.num_heads, m.num_heads // m.num_kv_heads, m.head_dim
    q = _heads(m.q_proj(x), h)
    k = _heads(m.k_proj(key), m.num_kv_heads).repeat_interleave(groups, 1)
    v = _heads(m.v_proj(key), m.num_kv_heads).repeat_interleave(groups, 1)
    i, j = q.shape[2], k.shape[2]
    real = torch.ones(B, j, dtype=torch.bool) if key_padding_mask is None else ~key_padding_mask
    allowed = real[:, None, None, :]
    if isinstance(m, LinformerAttention):  # keys and values become proj_len slots
        e_proj = m.key_seq_proj[:, :j]
        f_proj = e_proj if m.value_seq_proj is None else m.value_seq_proj[:, :j]
        keep = real[:, None, :, None].to(k.dtype)
        k = torch.einsum("pj,bhje->bhpe", e_proj, k * keep)
        v = torch.einsum("pj,bhje->bhpe", f_proj, v * keep)
        feeds = (e_proj.abs() + f_proj.abs()) @ real.T.to(k.dtype)  # (p, b)
        allowed = (feeds.T > 0)[:, None, None, :]
        j = k.shape[2]
    if isinstance(m, AdditiveAttention):
        w = m.score_weight[None, :, None, None, :]
        scores = (torch.tanh(q[:, :, :, None] + k[:, :, None]) * w).sum(-1)
    else:
        scores = q @ k.transpose(-1, -2) / math.sqrt(e)
    qi, kj = torch.arange(i)[:, None], torch.arange(j)[None, :]
    if isinstance(m, LocalAttention):
        g = m.num_global_tokens
        band = ((qi - kj).abs() <= m.window_size) & ((qi >= kj) | (not m.causal))
        allowed = allowed & (band | (qi < g) | (kj < g))
    if is_causal:
        allowed = allowed & (qi >= kj)
    if m.softcap is not None:
        scores = m.softcap * torch.tanh(scores / m.softcap)
    if m.alibi_slopes is not None:
        scores = scores - m.alibi_slopes[:, None, None] * (qi - kj).abs()
    if attn_mask is not None:  # a per-head float bias, added like any float mask
        scores = scores + attn_mask.view(B, h, i, j)
    live = allowed.any(-1, keepdim=True)
    scores = torch.where(allowed & live, scores, -math.inf)
    if m.sinks is not None:
        sink = m.sinks[None, :, None, None].expand(B, h, i, 1)
    else:
        sink = scores.new_full((B, h, i, 1), -math.inf)
    scores = torch.where(live, torch.cat([scores, sink], -1), 0.0)  # dead rows: no NaN
    weights = torch.where(live, torch.softmax(scores, -1)[..., :-1], 0.0)
    out = (weights @ v).transpose(1, 2).flatten(2)
    return m.out_proj(out), weights


def _inputs(kind: str, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, L, D, generator=gen, dtype=dtype)
    context = torch.randn(B, L + 2, 12, generator=gen, dtype=dtype) if kind == "cross" else None
    padding = torch.zeros(B, L + 2 if kind == "cross" else L, dtype=torch.bool)
    if kind == "cross":
        padding[1] = True  # every row of item 1 is dead
    else:
        padding[1, :PAD] = True
    bias = None
    if kind == "bias":  # a learned per-head additive mask (e.g. a relative-position table)
        bias = (0.5 * torch.randn(B * H, L, L, generator=gen, dtype=dtype)).requires_grad_()
    return x, context, padding, bias


def _build(name: str, mods: dict) -> nn.Module:
    torch.manual_seed(0)
    module = LAYERS[name][0](**mods)
    if module.sinks is not None:  # zeros at construction: make them matter
        with torch.no_grad():
            module.sinks.copy_(torch.linspace(-1.0, 1.5, H))
    return module


def _grads(out, leaves, seed=3):
    gen = torch.Generator().manual_seed(seed)
    upstream = torch.randn(out.shape, generator=gen).to(out.dtype)  # the same in any dtype
    return torch.autograd.grad(out, leaves, upstream)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("mods", list(MODS))
@pytest.mark.parametrize("name", list(LAYERS))
def test_each_modifier_on_each_layer_equals_the_float64_reference(name, mods, fused):
    if name in NO_ALIBI and "alibi" in MODS[mods]:
        pytest.skip("alibi=True is refused by this layer (test_bad_arguments)")
    module = _build(name, MODS[mods])
    _, kind, causal = LAYERS[name]
    x, context, padding, bias = _inputs(kind)
    x.requires_grad_()
    args = (x,) if context is None else (x, context)
    with fused_attn(fused):
        out, _ = module(*args, key_padding_mask=padding, attn_mask=bias, is_causal=causal)
    ours = [x] + ([module.sinks] if module.sinks is not None else []) + ([bias] if bias is not
                                                                          None else [])
    got = _grads(out, ours)

    ref = copy.deepcopy(module).double()
    x64 = x.detach().double().requires_grad_()
    c64 = None if context is None else context.double()
    b64 = None if bias is None else bias.detach().double().requires_grad_()
    want_out, _ = reference(ref, x64, c64, padding, b64, causal)
    leaves = [x64] + ([ref.sinks] if ref.sinks is not None else []) + ([b64] if bias is not
                                                                       None else [])
    want = _grads(want_out, leaves)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=1e-5)
    if kind != "bias":  # dead rows: the attention result is zero, the output out_proj's bias
        dead = (~reference(ref, x64, c64, padding, b64, causal)[1].any(-1)).all(1)  # (b, i)
        if dead.any():
            torch.testing.assert_close(out[dead], module.out_proj.bias.expand_as(out[dead]))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_weights_leave_the_sink_out_and_the_report_reproduces_them(fused):
    """need_weights gives the weights without the sink column; a listener's record (q, k,
    scale, the mask with the ALiBi term, softcap and sinks) reproduces them exactly."""
    module = _build("mha_gqa", MODS["all"])
    x, _, padding, _ = _inputs("self")
    records = []
    remove = _kernel.add_listener(records.append)
    try:
        with fused_attn(fused):
            _, weights = module(x, key_padding_mask=padding, need_weights=True,
                                average_attn_weights=False)
    finally:
        remove()
    want = reference(copy.deepcopy(module).double(), x.double(), None, padding, None, False)[1]
    torch.testing.assert_close(weights.double(), want, atol=1e-6, rtol=1e-6)
    assert (weights.sum(-1)[0] < 1 - 1e-3).all()  # every row gave the sink its share
    (record,) = records
    mods = record["modifiers"]
    assert mods.names() == ["sinks", "softcap=1.5", "alibi"]
    k = record["k"].repeat_interleave(H // record["k"].shape[1], 1)
    scores = mods.cap(record["q"] @ k.transpose(-1, -2) * record["scale"]) + record["mask"]
    sinks = mods.sinks[None, :, None, None].expand(*scores.shape[:-1], 1)
    rebuilt = torch.softmax(torch.cat([scores, sinks], -1), -1)[..., :-1]
    torch.testing.assert_close(rebuilt, weights, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("name", ["mha", "local"])
def test_cached_decoding_with_sinks_and_alibi_equals_the_whole_sequence(name, fused):
    """The sinks are parameters: a ring cache that drops old keys keeps them in every step."""
    torch.manual_seed(0)
    kw = {"sinks": True, "alibi": True, "num_kv_heads": 2}
    if name == "mha":
        module = MultiHeadAttention(D, H, **kw)
    else:
        module = LocalAttention(D, H, window_size=3, causal=True, **kw)
    with torch.no_grad():
        module.sinks.normal_()
    x = torch.randn(B, 11, D)
    with fused_attn(fused):
        want, _ = module(x, is_causal=True)
        cache = module.make_cache(B, 11)
        steps, start = [], 0
        for size in (1, 3, 1, 4, 2):
            steps.append(module(x[:, start:start + size], is_causal=True, cache=cache)[0])
            start += size
    torch.testing.assert_close(torch.cat(steps, 1), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["mha_gqa", "local", "additive"])
def test_packed_items_equal_each_item_alone(name):
    module = _build(name, MODS["all"])
    gen = torch.Generator().manual_seed(4)
    items = [torch.randn(n, D, generator=gen) for n in (5, 9, 3)]
    packed = torch.nested.nested_tensor(items, layout=torch.jagged)
    out, _ = module(packed)
    for item, got in zip(items, out.unbind()):
        torch.testing.assert_close(got, module(item[None])[0][0], atol=1e-5, rtol=1e-5)


def test_alibi_slopes_follow_the_paper():
    """Geometric 2^(-8 k / n) for a power of two; the paper's interpolation otherwise."""
    for n in (1, 2, 4, 8, 16):
        assert alibi_slopes(n) == pytest.approx([2.0 ** (-8.0 * (k + 1) / n) for k in range(n)])
    assert alibi_slopes(6) == pytest.approx([2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])
    module = MultiHeadAttention(24, 12, alibi=True)
    assert module.alibi_slopes.shape == (12,)
    assert "alibi_slopes" not in module.state_dict()  # a constant, not a weight


def test_sinks_are_a_zero_parameter_per_head_that_reset_keeps_at_zero():
    module = LocalAttention(D, H, window_size=2, sinks=True, softcap=30.0, alibi=True)
    assert isinstance(module.sinks, nn.Parameter) and module.sinks.shape == (H,)
    assert not module.sinks.any() and "sinks" in module.state_dict()
    with torch.no_grad():
        module.sinks.fill_(2.0)
    module.reset_parameters()
    assert not module.sinks.any()
    assert "sinks=True, softcap=30.0, alibi=True" in repr(module)
    # the draws are torch's: a module with sinks has the weights of one without
    torch.manual_seed(5)
    plain = MultiHeadAttention(D, H)
    torch.manual_seed(5)
    sinked = MultiHeadAttention(D, H, sinks=True)
    assert torch.equal(plain.q_proj.weight, sinked.q_proj.weight)
    assert MultiHeadAttention(D, H).sinks is None and MultiHeadAttention(D, H).softcap is None


def test_explain_names_the_modifiers():
    module = MultiHeadAttention(D, H, sinks=True, alibi=True).eval()
    with fused_attn(True):
        (call,) = explain(module, torch.randn(1, 5, D))
    assert call.path == "fused" and call.modifiers == ["sinks", "alibi"]
    assert "sinks, alibi" in str(explain(module, torch.randn(1, 5, D)))
    (call,) = explain(LocalAttention(D, H, window_size=2, softcap=5.0), torch.randn(1, 5, D))
    assert call.path == "local" and call.modifiers == ["softcap=5"]
    assert any("softcap" in reason for reason in call.reasons)


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda: MultiHeadAttention(D, H, softcap=0.0), ValueError, "softcap must be > 0, got 0"),
        (lambda: MultiHeadAttention(D, H, softcap=-2), ValueError, "softcap must be > 0, got -2"),
        (lambda: MultiHeadAttention(D, H, softcap=float("nan")), ValueError,
         "softcap must be a finite number"),
        (lambda: LocalAttention(D, H, 2, softcap="30"), TypeError,
         r"softcap must be a number, got str"),
        (lambda: MultiHeadAttention(D, H, sinks=1), TypeError, "sinks must be a bool, got int"),
        (lambda: MultiHeadAttention(D, H, alibi="yes"), TypeError, "alibi must be a bool"),
        (lambda: CrossAttention(D, H, alibi=True), ValueError,
         "alibi=True is not supported by CrossAttention: query and context are two sequences"),
        (lambda: LinformerAttention(D, H, seq_len=8, proj_len=2, alibi=True), ValueError,
         "alibi=True is not supported by LinformerAttention: the sequence projection"),
        (lambda: MultiHeadAttention(D, H, add_bias_kv=True, alibi=True), ValueError,
         "add_bias_kv / add_zero_attn have no position"),
        (lambda: MultiHeadAttention(D, H, sinks=True).to_torch(), NotImplementedError,
         "to_torch is not available with sinks=True"),
        (lambda: torch.jit.script(MultiHeadAttention(D, H, softcap=3.0)), NotImplementedError,
         "torch.jit.script cannot compile .*softcap=3.0"),
    ],
)
def test_bad_arguments_raise_naming_them(build, error, match):
    with pytest.raises(error, match=match):
        build()


@pytest.mark.parametrize(
    ("name", "dynamic"),
    [("mha_gqa", True), pytest.param("local_causal_gqa", False, marks=pytest.mark.slow)],
)
def test_compiled_equals_eager(name, dynamic):
    """fullgraph capture (aot_eager: Dynamo and AOTAutograd); torch.export and ONNX Runtime
    are in the export cases (tests/mmattn/integrations/_export_cases.py)."""
    module = _build(name, {"sinks": True, "alibi": True})
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for length in (7, 12) if dynamic else (12,):
        x = torch.randn(B, length, D, requires_grad=True)
        padding = torch.zeros(B, length, dtype=torch.bool)
        padding[1, :PAD] = True
        results = []
        for run in (module, compiled):
            out, _ = run(x, key_padding_mask=padding)
            results.append((out, *_grads(out, [x, module.sinks])))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_from_torch_keeps_an_mmattn_sources_modifiers_and_sinks():
    source = _build("mha_gqa", MODS["all"])
    local = LocalAttention.from_torch(MultiHeadAttention(D, H, **MODS["all"]), window_size=3)
    assert local.softcap == 1.5 and local.alibi_slopes is not None and local.sinks is not None
    copy_ = MultiHeadAttention.from_torch(source)
    assert torch.equal(copy_.sinks, source.sinks)
    x = torch.randn(B, L, D)
    torch.testing.assert_close(copy_(x)[0], source(x)[0], atol=0, rtol=0)


def test_a_variant_whose_hook_takes_no_modifiers_refuses_them():
    class Old(MultiHeadAttention):  # a hook written before modifiers existed
        def _attention(self, q, k, v, mask, *, is_causal, dropout_p, need_weights):
            return super()._attention(q, k, v, mask, is_causal=is_causal, dropout_p=dropout_p,
                                      need_weights=need_weights)

    with pytest.raises(ValueError, match="Old does not apply score modifiers"):
        Old(D, H, sinks=True)
    old = Old(D, H)  # still decodes: the cache passes no modifiers= to it
    cache = old.make_cache(1, 4)
    assert old(torch.randn(1, 2, D), is_causal=True, cache=cache)[0].shape == (1, 2, D)
