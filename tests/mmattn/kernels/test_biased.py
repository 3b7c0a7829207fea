"""mmattn.kernels.biased against softmax(q kᵀ · scale + bias) v written out in float64.

Both paths are held to the reference on every device: the fused one forced with
``fused=True`` (on the CPU the default is the explicit twin), the explicit one with
``fused=False``; weights, dead rows (a row of ``-inf``) and the gradient of the bias too.
"""

from __future__ import annotations

import pytest
import torch

from mmattn.functional import fused_attn
from mmattn.kernels.biased import biased_attend
from mmattn.kernels.dense import add_listener


def _reference(q, k, v, bias, scale):
    q, k, v, bias = (t.double() for t in (q, k, v, bias))
    scores = q @ k.transpose(-1, -2) * scale + bias
    live = ~torch.isneginf(scores).all(-1, keepdim=True)
    weights = torch.softmax(torch.where(live, scores, 0.0), -1) * live
    return weights @ v, weights


def _inputs(device, dead: bool):
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 4, 6, 5, generator=gen).to(device) for _ in range(3))
    bias = torch.randn(3, 4, 6, 6, generator=gen)  # (windows, heads, i, j): broadcast over b
    bias = bias.masked_fill(torch.rand(3, 4, 6, 6, generator=gen) > 0.7, -100.0)
    if dead:
        bias[1, 2, 3] = float("-inf")
    return q, k, v, bias.to(device)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("dead", [False, True], ids=["finite", "dead_row"])
def test_both_paths_equal_the_float64_reference(fused, dead, device):
    q, k, v, bias = _inputs(device, dead)
    tensors = [t.clone().requires_grad_(True) for t in (q, k, v, bias)]
    out, weights = biased_attend(*tensors, scale=0.3, finite=not dead, fused=fused,
                                 need_weights=not fused)
    want, want_w = _reference(q, k, v, bias, 0.3)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    if not fused:
        torch.testing.assert_close(weights.double(), want_w, atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    ref = [t.double().clone().requires_grad_(True) for t in (q, k, v, bias)]
    _reference(*ref, 0.3)[0].square().sum().backward()
    for got, exp in zip(tensors, ref):
        assert torch.isfinite(got.grad).all()
        torch.testing.assert_close(got.grad.double(), torch.nan_to_num(exp.grad), atol=1e-5,
                                   rtol=1e-5)
    if dead:
        assert torch.equal(out[:, 1, 2, 3], torch.zeros_like(out[:, 1, 2, 3]))


def test_path_choice_follows_the_switch_the_device_and_the_caller():
    q, k, v, bias = _inputs("cpu", dead=False)
    paths = []
    remove = add_listener(lambda record: paths.append((record["path"], record["reasons"])))
    try:
        with fused_attn(True):
            biased_attend(q, k, v, bias)
            biased_attend(q, k, v, bias, fused=True)
            biased_attend(q, k, v, bias, fused=True, need_weights=True)
        with fused_attn(False):
            biased_attend(q, k, v, bias)
    finally:
        remove()
    assert [p for p, _ in paths] == ["explicit", "fused", "explicit", "explicit"]
    assert "on the CPU a score bias runs the explicit twin" in paths[0][1][0]
    assert any("weights were requested" in r for r in paths[2][1])
    assert any("switched off" in r for r in paths[3][1])
