"""The flex engine (mmattn.kernels.flex) through LocalAttention's route: flex == fallback ==
a dense reference in fp32, with padding, dead rows, GQA, global tokens, sinks, softcap and
ALiBi. On the CPU flex runs its forward only (forced, without autograd); the CUDA cases
check outputs and gradients and skip here. Compiles are slow on the CPU: few configurations,
small shapes (L <= 64, tiles of 16)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from mmattn import LocalAttention
from mmattn.debug import explain
from mmattn.kernels import engines
from mmattn.kernels.blocked import local_attend
from mmattn.kernels.modifiers import Modifiers
from tests._features import needs
from tests.conftest import DEVICES

B, H, KV, L, E = 2, 4, 2, 40, 16
pytestmark = [pytest.mark.pins_path, pytest.mark.usefixtures("fused_only")]


SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])


def reference(q, k, v, allowed, mods: Modifiers | None):
    """softmax(cap(q kᵀ/√e) − m·|i − j| masked) v, with the sink in the denominator; dead
    rows 0 (written out, independent of mmattn's kernels)."""
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mods = mods or Modifiers()
    if mods.softcap is not None:
        s = mods.softcap * torch.tanh(s / mods.softcap)
    if mods.slopes is not None:
        i = torch.arange(q.shape[2]).float()
        s = s - mods.slopes.float()[:, None, None] * (i[:, None] - i[None, :]).abs()
    s = s.masked_fill(~allowed, float("-inf"))
    total = torch.logsumexp(s, -1, keepdim=True)
    if mods.sinks is not None:
        total = torch.logaddexp(total, mods.sinks[:, None, None].to(s.dtype))
    w = torch.nan_to_num(torch.exp(s - total))
    return w @ v


def band(length, window, glob=0, causal=False):
    i = torch.arange(length)
    ok = (i[:, None] - i[None, :]).abs() <= window
    ok |= (i[:, None] < glob) | (i[None, :] < glob)
    return ok & (i[None, :] <= i[:, None]) if causal else ok


def inputs(device="cpu", grad=False):
    q = torch.randn(B, H, L, E, device=device, requires_grad=grad)
    k = torch.randn(B, KV, L, E, device=device, requires_grad=grad)
    v = torch.randn(B, KV, L, E, device=device, requires_grad=grad)
    key_ok = torch.ones(B, L, dtype=torch.bool, device=device)
    key_ok[0, 30:] = False  # padding
    key_ok[1, 10:20] = False  # a hole: rows 12..17 see no key within the window 2 ...
    key_ok[1, :3] = False  # ... nor a global one
    return q, k, v, key_ok


def close(a, b):
    scale = b.abs().max().clamp_min(1e-6)
    assert ((a - b).abs().max() / scale).item() < 1e-4


MODS = {
    "none": None,
    "softcap+alibi": Modifiers(softcap=2.0, slopes=SLOPES),
    "sinks": Modifiers(sinks=torch.tensor([0.5, -1.0, 0.0, 2.0])),
}


@needs("flex_cpu")
@pytest.mark.parametrize("mods", list(MODS))
def test_local_flex_cpu_forward(mods):
    q, k, v, key_ok = inputs()
    m = MODS[mods]
    allowed = band(L, 2, glob=3)[None, None] & key_ok[:, None, None, :]
    want = reference(q, k, v, allowed, m)
    kwargs = dict(key_mask=key_ok, num_global_tokens=3, groups=2, modifiers=m)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fallback, _ = local_attend(q, k, v, 2, **kwargs)
        with engines.use("flex"):
            flex, _ = local_attend(q, k, v, 2, **kwargs)
    close(fallback, want)
    close(flex, want)
    assert (flex[1, :, 12:18] == 0).all()  # dead rows: exactly zero
    # padding never leaks: NaN in the padded keys and values moves no output
    k2, v2 = (t.masked_fill(~key_ok[:, None, :, None], float("nan")) for t in (k, v))
    with torch.no_grad(), warnings.catch_warnings(), engines.use("flex"):
        warnings.simplefilter("ignore")
        dirty, _ = local_attend(q, k2, v2, 2, **kwargs)
    assert torch.equal(dirty, flex)


@needs("flex_cpu")
def test_local_flex_cpu_causal_explain():
    """The engine a module ran, in explain: flex when forced, the fallback's reason when
    the call needs autograd on the CPU, none considered by default."""
    torch.manual_seed(1)
    layer = LocalAttention(16, 2, window_size=3, causal=True).eval()
    x = torch.randn(2, 33, 16)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = explain(layer, x)
        with engines.use("flex"):
            forced = explain(layer, x)
    assert plain[0].engine is None and plain[0].path == "local"
    assert forced[0].engine == "flex" and forced[0].path == "flex"
    assert "engine flex" in str(forced)
    close(forced.output[0], plain.output[0])
    with engines.use("flex"):
        graded = explain(layer, x)  # grad enabled: no CPU backward for flex
    assert graded[0].engine == "fallback" and "no backward on cpu" in graded[0].engine_reason
    close(graded.output[0], plain.output[0])


@pytest.mark.parametrize("device", [d for d in DEVICES if not isinstance(d, str)])
@pytest.mark.parametrize("mods", list(MODS))
def test_local_engines_cuda_grad(device, mods):
    """On CUDA, fp32 (flex) and bf16 (varlen where it applies): outputs and gradients of the
    engine equal the fallback's."""
    q, k, v, key_ok = inputs(device, grad=True)
    m = MODS[mods]
    if m is not None:
        m = Modifiers(**{f: (t.to(device) if isinstance(t, torch.Tensor) else t)
                         for f, t in vars(m).items()})
    kwargs = dict(key_mask=key_ok, num_global_tokens=3, groups=2, modifiers=m)
    outs = {}
    for engine in ("flex", "fallback"):
        with engines.use(engine):
            out, _ = local_attend(q, k, v, 2, **kwargs)
            grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        outs[engine] = (out, *grads)
        assert all(torch.isfinite(g).all() for g in grads)
    for a, b in zip(outs["flex"], outs["fallback"]):
        close(a, b)
    # varlen: bf16, no key mask, no global tokens, no modifiers
    if m is None:
        qh, kh, vh = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
        res = {}
        for engine in ("varlen", "fallback"):
            with engines.use(engine):
                out, _ = local_attend(qh, kh, vh, 5, groups=2)
                res[engine] = (out, *torch.autograd.grad(out.float().square().sum(),
                                                          (qh, kh, vh)))
        for a, b in zip(res["varlen"], res["fallback"]):
            scale = b.float().abs().max()
            assert ((a.float() - b.float()).abs().max() / scale).item() < 2e-2


@needs("flex_cpu")
def test_neighborhood_flex_cpu_forward():
    """NeighborhoodAttention's window as a flex mask_mod (rectangular kernel, dilation,
    global tokens, ALiBi on grid distances, softcap, GQA, key padding) == the tiled kernel
    == the dense reference mask."""
    from mmattn.kernels.neighborhood import neighborhood_attend
    from mmattn.masks import neighborhood_mask

    grid, kernel, dilation, glob = (6, 7), (3, 5), (2, 1), 2
    length = glob + 42
    q, k, v = torch.randn(2, 4, length, 8), torch.randn(2, 2, length, 8), torch.randn(2, 2,
                                                                                       length, 8)
    key_ok = torch.ones(2, length, dtype=torch.bool)
    key_ok[1, -5:] = False
    mods = Modifiers(softcap=2.0, slopes=SLOPES)
    kwargs = dict(dilation=dilation, num_global_tokens=glob, key_mask=key_ok, modifiers=mods)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fallback, _ = neighborhood_attend(q, k, v, grid, kernel, **kwargs)
        with engines.use("flex"):
            flex, _ = neighborhood_attend(q, k, v, grid, kernel, **kwargs)
    close(flex, fallback)
    # the window itself against the dense reference (no modifiers: ALiBi here is Euclidean)
    allowed = neighborhood_mask(grid, kernel, dilation=dilation, num_global_tokens=glob)
    from mmattn.kernels._routes import window_mask_mod

    rule = window_mask_mod(grid, kernel, dilation, glob, torch.device("cpu"))
    i = torch.arange(length)
    zero = torch.zeros((), dtype=torch.long)
    assert torch.equal(rule(zero, zero, i[:, None], i[None, :]), allowed)


@pytest.mark.parametrize("device", [d for d in DEVICES if not isinstance(d, str)])
def test_neighborhood_flex_cuda_grad(device):
    from mmattn.kernels.neighborhood import neighborhood_attend

    length = 2 + 42
    q, k, v = (torch.randn(2, h, length, 16, device=device, requires_grad=True)
               for h in (4, 2, 2))
    key_ok = torch.ones(2, length, dtype=torch.bool, device=device)
    key_ok[1, -5:] = False
    mods = Modifiers(sinks=torch.zeros(4, device=device), slopes=SLOPES.to(device))
    res = {}
    for engine in ("flex", "fallback"):
        with engines.use(engine):
            out, _ = neighborhood_attend(q, k, v, (6, 7), (3, 5), dilation=(2, 1),
                                         num_global_tokens=2, key_mask=key_ok, modifiers=mods)
        res[engine] = (out, *torch.autograd.grad(out.square().sum(), (q, k, v)))
    for a, b in zip(res["flex"], res["fallback"]):
        assert torch.isfinite(a).all()
        close(a, b)
