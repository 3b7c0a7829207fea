"""mmattn._features: each detected fact against what torch then does (issue 41), and the
export state that the layers' export-safe paths read, on every torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmattn._features import MissingFeature, features, require
from mmattn._helpers import exporting
from mmattn.kernels.modifiers import repeat_kv, sink_sdpa
from tests.mmattn.kernels.test_value_width import Ops


def test_cpu_flash_gqa_is_what_sdpa_dispatches_to():
    """The fact comes from torch's dispatcher; the dispatch seen here must agree with it."""
    q, kv = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    if not features().sdpa_gqa:
        pytest.skip("needs feature 'sdpa_gqa'")
    with Ops() as seen:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    flash = "_scaled_dot_product_flash_attention_for_cpu.default" in seen.names
    assert flash == features().cpu_flash_gqa


def test_fused_sinks_on_grouped_heads_equal_repeated_heads():
    """The sinks' fused path on grouped heads (where the CPU kernel has none, the heads are
    repeated) against the same call on repeated heads, forward and backward (torch 2.5.1
    gave errors of 2.7e14 here and aborted in backward)."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 9, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 9, 8, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, requires_grad=True)
    mask = torch.rand(2, 1, 9, 9) > 0.3
    mask[..., 0] = True
    out = sink_sdpa(q, k, v, mask, sinks, dropout_p=0.0, is_causal=False, scale=0.3, groups=2)
    k2, v2 = repeat_kv(k, v, 2)
    scores = (q @ k2.transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf"))
    total = torch.logaddexp(torch.logsumexp(scores, -1, keepdim=True), sinks[:, None, None])
    want = torch.exp(scores - total) @ v2
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, sinks))
    wants = torch.autograd.grad(want.square().sum(), (q, k, v, sinks))
    for got, ref in zip(grads, wants):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_recompile_limit_names_a_dynamo_setting():
    assert hasattr(torch._dynamo.config, features().recompile_limit)


def test_require_names_the_feature_and_the_torch():
    missing = features().missing()
    if not missing:
        pytest.skip("this torch has every feature")
    with pytest.raises(MissingFeature, match=rf"needs .*torch.* \(feature '{missing[0]}'\)"):
        require(missing[0], "this call")


class _Probe(nn.Module):
    def forward(self, x):
        return x + 1 if exporting() else x - 1


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non_strict"])
def test_exporting_is_true_inside_torch_export_only(strict):
    """Eager and torch.compile: False; torch.export, strict or not: True (on a torch
    without torch.compiler.is_exporting too, where mmattn detects the export itself)."""
    x, probe = torch.zeros(3), _Probe()
    assert torch.equal(probe(x), x - 1)
    assert torch.equal(torch.compile(probe, fullgraph=True, backend="eager")(x), x - 1)
    program = torch.export.export(probe, (x,), strict=strict)
    assert torch.equal(program.module()(x), x + 1)
    assert torch.equal(probe(x), x - 1)  # and after
