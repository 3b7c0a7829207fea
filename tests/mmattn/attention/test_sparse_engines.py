"""A SparseMask on the flex engine (its BlockMask): flex == fallback == the module with the
dense mask, in fp32, with padding, dead rows, GQA and the score modifiers. CPU: flex's
forward, forced, without autograd; CUDA: outputs and gradients (skipped here)."""

from __future__ import annotations

import warnings

import pytest
import torch

from mmattn import MultiHeadAttention
from mmattn import patterns as P
from mmattn._features import features
from mmattn.debug import explain
from mmattn.kernels import engines
from tests._features import needs, reason
from tests.conftest import DEVICES
from tests.mmattn._pattern_cases import fused_tokens

pytest.importorskip("torch.nn.attention.flex_attention")

pytestmark = [pytest.mark.pins_path, pytest.mark.usefixtures("fused_only")]


PATTERN = P.same("documents") & P.causal() | P.modality(query="text")
MODS = {"none": {}, "softcap+alibi": {"softcap": 3.0, "alibi": True}, "sinks": {"sinks": True}}


def layer(mods: str, device="cpu") -> MultiHeadAttention:
    torch.manual_seed(0)
    mha = MultiHeadAttention(64, 4, num_kv_heads=2, **MODS[mods]).to(device).eval()
    if mha.sinks is not None:
        with torch.no_grad():
            mha.sinks.copy_(torch.tensor([0.5, -1.0, 0.0, 2.0]))
    return mha


def close(a, b):
    assert ((a - b).abs().max() / b.abs().max()).item() < 1e-4


def run(mha, tokens, mask, engine):
    kpm = ~tokens.mask
    with engines.use(engine), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return explain(mha, tokens.x, attn_mask=mask, key_padding_mask=kpm)


@needs("flex_cpu")
@pytest.mark.parametrize("mods", list(MODS))
def test_sparse_flex_cpu_forward(mods):
    tokens = fused_tokens(64)
    mask = PATTERN.compile(tokens, block_size=16)
    mha = layer(mods)
    dense = (~mask.dense()).repeat_interleave(4, 0)
    with torch.no_grad():
        want, _ = mha(tokens.x, attn_mask=dense, key_padding_mask=~tokens.mask)
        flex = run(mha, tokens, mask, "flex")
        fallback = run(mha, tokens, mask, "fallback")
    assert flex[0].engine == "flex" and flex[0].path == "flex"
    assert fallback[0].engine == "fallback" and fallback[0].path == "block-sparse"
    close(flex.output[0], want)
    close(fallback.output[0], want)
    # dead rows (no allowed key: id -1 outside text, padded queries) give out_proj's bias
    dead = ~mask.dense().any(-1)
    assert dead.any()
    bias = mha.out_proj.bias
    assert torch.equal(flex.output[0][dead], bias.expand(int(dead.sum()), -1))
    # padding never leaks: NaN in the padded tokens moves no real output
    dirty = tokens.x.masked_fill(~tokens.mask[..., None], float("nan"))
    with torch.no_grad():
        with engines.use("flex"):
            again, _ = mha(dirty, attn_mask=mask, key_padding_mask=~tokens.mask)
    real = tokens.mask
    assert torch.isfinite(again[real]).all()
    close(again[real], want[real])


@pytest.mark.parametrize("device", DEVICES)
def test_flex_compiled_once_for_new_masks(device):
    if device == "cpu" and not features().flex_cpu:
        pytest.skip(reason("flex_cpu"))
    """New masks are new data for the one compiled flex_attention, not new graphs. On CUDA
    any pattern (another count of partial tiles makes torch.compile mark that size dynamic
    once, on the second mask); on the CPU, whose flex compiles static sizes only, a new
    batch of the same layout (new tokens, ids and values: a new SparseMask and BlockMask)."""
    from torch._dynamo.utils import counters

    mha = layer("none", device)
    if device == "cpu":
        batches = [fused_tokens(64) for _ in range(3)]
        for number, tokens in enumerate(batches):
            tokens.x.mul_(number + 1)
            tokens.meta["documents"] = tokens.meta["documents"] + 7 * number
        cases = [(t.to(device), PATTERN) for t in batches]
    else:
        tokens = fused_tokens(64).to(device)
        cases = [(tokens, p) for p in (PATTERN, P.same("documents"), P.causal() & P.window(5),
                                       P.window(2) | P.modality(key="text"))]
    masks = [p.compile(t, block_size=16) for t, p in cases]
    with torch.no_grad(), engines.use("flex"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = [mha(t.x, attn_mask=m, key_padding_mask=~t.mask)[0]
                for (t, _), m in zip(cases[:2], masks[:2])]
        graphs = counters["stats"]["unique_graphs"]
        for (t, _), mask in zip(cases[2:], masks[2:]):
            outs.append(mha(t.x, attn_mask=mask, key_padding_mask=~t.mask)[0])
        assert counters["stats"]["unique_graphs"] == graphs
        for (t, _), mask, out in zip(cases, masks, outs):
            dense = (~mask.dense()).repeat_interleave(4, 0)
            close(out, mha(t.x, attn_mask=dense, key_padding_mask=~t.mask)[0])


@pytest.mark.parametrize("device", [d for d in DEVICES if not isinstance(d, str)])
@pytest.mark.parametrize("mods", list(MODS))
def test_sparse_flex_cuda_grad(device, mods):
    tokens = fused_tokens(64).to(device)
    mask = PATTERN.compile(tokens, block_size=16)
    mha = layer(mods, device)
    results = {}
    for engine in ("flex", "fallback"):
        x = tokens.x.clone().requires_grad_()
        with engines.use(engine):
            out, _ = mha(x, attn_mask=mask, key_padding_mask=~tokens.mask)
        grads = torch.autograd.grad(out.square().sum(), [x, *mha.parameters()])
        results[engine] = (out, *grads)
        assert all(torch.isfinite(g).all() for g in grads)
    for a, b in zip(results["flex"], results["fallback"]):
        close(a, b)
