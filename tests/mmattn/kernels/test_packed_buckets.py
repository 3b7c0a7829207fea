"""Packed input split into several buckets, against the same module on padded input.

At the test width (E=16) the planner's fixed per-call cost (``CALL_WORK / width``, 51,200
score units) puts every item of a small batch into ONE bucket, so the tests of
test_packed.py never reach several buckets, buckets without a mask, or a batch whose rows
come back from several buckets. Here the per-call cost is lowered (the module constant the
planner reads, as a model ~500x wider would set it), so the same layers run several buckets:
one of equal lengths (no mask), masked ones and single items. The reference is the padded
path with ``key_padding_mask``, outputs and gradients (inputs and every parameter).
"""

from __future__ import annotations

import pytest
import torch

from mmattn import AdditiveAttention, CrossAttention, Encoder, Tokens
from mmattn.functional import fused_attn
from mmattn.kernels import packed as _packed
from mmattn.kernels.packed import CALL_WORK, plan
from tests.mmattn.kernels.test_packed import MODULES, batch, close, compare_grads, real

E, H = 16, 4
#: Two pairs of equal lengths (unmasked buckets), near lengths (masked), an empty item.
LENS = [3, 3, 12, 11, 26, 1, 0, 7, 24, 24]
CTX = [4, 6, 0, 2, 30, 1, 5, 9, 28, 28]
CALL = 100.0  # the fixed cost of a call, in score units (width 16 default: 51,200)


@pytest.fixture(autouse=True)
def _cheap_calls(monkeypatch):
    """Lower the per-call cost for these tests (layouts are cached: clear them both ways)."""
    _packed.clear_layouts()
    monkeypatch.setattr(_packed, "CALL_WORK", CALL * E)
    yield
    _packed.clear_layouts()


def _buckets(module, q_lens, k_lens) -> list:
    key = module._packed_cost_key()
    return plan(q_lens, k_lens, _packed._band_cost(*key) if key else None, CALL)


def test_the_default_width_16_plan_is_one_bucket_and_these_tests_get_several():
    assert len(plan(LENS, LENS, call_cost=CALL_WORK / E)) == 1
    for name in ("mha", "local-narrow", "local-global"):
        buckets = _buckets(MODULES[name](), LENS, LENS)
        assert len(buckets) >= 4, name
        assert any(b.uniform and len(b.items) > 1 for b in buckets)  # no mask
        assert any(not b.uniform for b in buckets)  # masked
    assert len(_buckets(CrossAttention(E, H), LENS, CTX)) >= 4


#: Causal too where the rule changes the bucket masks (appended keys, bands, global rows).
CAUSAL = ("mha", "mha-bias-kv-zero-attn", "local-narrow", "local-global")


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize(("name", "causal"), [(n, False) for n in sorted(MODULES)]
                         + [(n, True) for n in CAUSAL])
def test_self_attention_several_buckets_equals_padded(name, causal, fused):
    module = MODULES[name]()
    values, offsets, padded, mask, leaf = batch(LENS)
    nt = Tokens.from_packed(values, offsets).x
    weight = torch.randn(sum(LENS), E)
    with fused_attn(fused):
        out, _ = module(nt, is_causal=causal)
        ref, _ = module(padded, key_padding_mask=~mask, is_causal=causal)
    close(out.values(), real(ref, LENS))
    compare_grads(
        module, [(values, leaf)], (out.values() * weight).sum(), (real(ref, LENS) * weight).sum()
    )


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("cls", [CrossAttention, AdditiveAttention])
def test_cross_attention_several_buckets_equals_padded(cls, fused):
    module = cls(E, H, kdim=12, vdim=12)
    q_values, q_off, q_pad, _, q_leaf = batch(LENS)
    c_values, c_off, c_pad, c_mask, c_leaf = batch(CTX, dim=12)
    query, context = Tokens.from_packed(q_values, q_off).x, Tokens.from_packed(c_values, c_off).x
    with fused_attn(fused):
        out, weights = module(query, context, need_weights=not fused)
        ref, ref_w = module(q_pad, c_pad, key_padding_mask=~c_mask, need_weights=not fused)
    close(out.values(), real(ref, LENS))
    if not fused:
        for b, (n, m) in enumerate(zip(LENS, CTX)):
            close(weights[b], ref_w[b, :n, :m])
    weight = torch.randn(sum(LENS), E)
    compare_grads(
        module, [(q_values, q_leaf), (c_values, c_leaf)], (out.values() * weight).sum(),
        (real(ref, LENS) * weight).sum(),
    )


@pytest.mark.parametrize("attention", ["full", "local"])
def test_encoder_several_buckets_equals_padded(attention):
    kwargs = {"attention": "local", "window_size": 2} if attention == "local" else {}
    enc = Encoder(E, 2, H, **kwargs)
    values, offsets, padded, mask, leaf = batch(LENS)
    out = enc(Tokens.from_packed(values, offsets)).x.values()
    ref = real(enc(Tokens(padded, mask)).x, LENS)
    close(out, ref)
    weight = torch.randn(sum(LENS), E)
    compare_grads(enc, [(values, leaf)], (out * weight).sum(), (ref * weight).sum())
