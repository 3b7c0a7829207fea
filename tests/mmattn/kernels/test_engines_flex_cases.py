"""The flex engine on the calls a first GPU run meets (issue 40), checked through flex's CPU
forward (forced, no autograd) against the fallback and an independent dense reference:
lengths that change between calls under a tight recompile limit, ALiBi at the absolute
positions sequence parallelism sets (with and without global tokens), a block size that is
not a power of two, sink gradients (CPU: a dense stand-in in flex's place, as torch has no
CPU flex backward; CUDA: the kernel itself), P.chunked's mask_mod under dynamic shapes. The
CUDA cases (outputs, gradients, graph counts, no host sync) skip here. Few, small compiles:
each one costs 10-30 s on a busy 2-core CPU."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from mmattn import MultiHeadAttention, Tokens
from mmattn import patterns as P
from mmattn.kernels import _routes, engines, flex
from mmattn.kernels.blocked import local_attend
from mmattn.kernels.modifiers import Modifiers
from tests.conftest import DEVICES

pytest.importorskip("torch.nn.attention.flex_attention")
pytestmark = [pytest.mark.pins_path, pytest.mark.usefixtures("fused_only")]

CUDA = [d for d in DEVICES if not isinstance(d, str)]
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])


def reference(q, k, v, allowed, dist=None, slopes=None, sinks=None):
    """softmax(q kᵀ/√e − m·d, masked) v with the sink in the denominator; dead rows 0
    (written out here, independent of mmattn's kernels)."""
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if slopes is not None:
        s = s - slopes[:, None, None] * dist
    s = s.masked_fill(~allowed, float("-inf"))
    total = torch.logsumexp(s, -1, keepdim=True)
    if sinks is not None:
        total = torch.logaddexp(total, sinks[:, None, None].to(s.dtype))
    return torch.nan_to_num(torch.exp(s - total)) @ v


def band(length, window, glob=0):
    i = torch.arange(length)
    return ((i[:, None] - i[None, :]).abs() <= window) | (i[:, None] < glob) | (i[None] < glob)


def close(a, b, tol=1e-4):
    assert ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item() < tol


def qkv(batch, length, heads=4, kv=2, width=16, device="cpu", grad=False):
    gen = torch.Generator().manual_seed(length)
    return tuple(torch.randn(batch, h, length, width, generator=gen).to(device)
                 .requires_grad_(grad) for h in (heads, kv, kv))


def test_lengths_that_change_beyond_the_recompile_limit_still_run():
    """Six calls of one signature with four lengths, a new window and batch (every length
    a new graph on the CPU, which compiles static sizes), dynamo's recompile limit patched
    to 1 (one compile: the CPU's are slow): every call runs and equals the fallback; the
    calls past the limit fall back with one warning that names it."""
    import torch._dynamo

    have = engines.available()
    if not have.limit_name:
        pytest.skip("this torch names no recompile limit")
    engines.forget_failures()
    before = flex.graphs()
    cases = [(2, 40, 2), (2, 33, 2), (2, 40, 5), (3, 33, 2), (2, 50, 2), (2, 27, 3)]
    with torch._dynamo.config.patch(**{have.limit_name: 1}), torch.no_grad(), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch, length, window in cases:
            q, k, v = qkv(batch, length)
            with engines.use("flex"):
                got, _ = local_attend(q, k, v, window, groups=2)
            with engines.use("fallback"):
                want, _ = local_attend(q, k, v, window, groups=2)
            close(got, want)
            close(got, reference(q, k, v, band(length, window)))
    limits = [w for w in caught if "recompile limit" in str(w.message)]
    assert len(limits) == 1, [str(w.message) for w in caught]
    assert f"{have.limit_name} = 1" in str(limits[0].message)
    grown = [n for sig, n in flex.graphs().items() if n is not None and n != before.get(sig)]
    assert all(n <= 1 for n in grown)  # this signature's graphs: as many as the limit


def positions(length, glob, start):
    """Sequence parallelism's rows on a rank: the g global tokens at 0..g-1, then its shard
    (with halo) at its absolute positions from ``start``."""
    return torch.cat([torch.arange(glob), torch.arange(start, start + length - glob)])


@pytest.mark.parametrize("glob", [0, 3])
def test_alibi_at_absolute_positions_under_flex(glob):
    """ALiBi at the positions sequence parallelism sets (``Modifiers.at``) equals the
    fallback on the flex route, with and without global tokens: the band measures the
    rows' offset, a pair with a global token its absolute positions."""
    length, window = 40, 3
    q, k, v = qkv(2, length)
    key_ok = torch.ones(2, length, dtype=torch.bool)
    key_ok[1, 30:] = False
    rows = positions(length, glob, 1000)
    mods = Modifiers(slopes=SLOPES).at(rows[:, None], rows[:, None])
    kwargs = dict(key_mask=key_ok, num_global_tokens=glob, groups=2, modifiers=mods)
    with torch.no_grad():
        with engines.use("flex"):
            got, _ = local_attend(q, k, v, window, **kwargs)
        with engines.use("fallback"):
            want, _ = local_attend(q, k, v, window, **kwargs)
    i = torch.arange(length)
    special = (i[:, None] < glob) | (i[None, :] < glob)
    dist = torch.where(special, (rows[:, None] - rows[None, :]).abs(),
                       (i[:, None] - i[None, :]).abs()).float()
    allowed = band(length, window, glob)[None, None] & key_ok[:, None, None, :]
    close(want, reference(q, k, v, allowed, dist, SLOPES))
    close(got, want)


def test_a_block_size_that_is_not_a_power_of_two():
    """48 is no CUDA tile for flex (select refuses it there, with the reason), but the CPU
    flex runs it: forced, it equals the fallback and the dense mask."""
    tokens = Tokens(torch.randn(2, 70, 32), meta={"documents": (torch.arange(70) // 23)
                                                  .expand(2, 70)})
    pattern = P.same("documents") & P.causal() | P.window(2)
    mask = pattern.compile(tokens, block_size=48)
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 2).eval()
    with torch.no_grad():
        with engines.use("flex"):
            got, _ = mha(tokens.x, attn_mask=mask)
        with engines.use("fallback"):
            want, _ = mha(tokens.x, attn_mask=mask)
        dense, _ = mha(tokens.x, attn_mask=(~mask.dense()).repeat_interleave(2, 0))
    close(got, want)
    close(got, dense)
    cuda = engines.Call(kind="blocks", device="cuda", dtype=torch.bfloat16, head_dim=16,
                        capability=(9, 0), block=48)
    choice = engines.select(cuda, engines.Available(flex=True), None)
    assert choice.engine == "fallback" and "powers of two >= 16, not 48" in choice.reason


def dense_flex(q, k, v, score_mod, block_mask, scale, enable_gqa, lse, aux):
    """flex_attention written out densely, with autograd (a stand-in for flex where torch
    has no backward): the block mask's mask_mod and the score_mod on every pair."""
    b, h, length = q.shape[0], q.shape[1], q.shape[2]
    k, v = (t.repeat_interleave(h // k.shape[1], 1) for t in (k, v))
    bi, hi, qi, ki = (torch.arange(n).view(*[-1 if a == d else 1 for a in range(4)])
                      for d, n in enumerate((b, h, length, length)))
    s = q @ k.transpose(-1, -2) * scale
    if score_mod is not None:
        s = score_mod(s, bi, hi, qi, ki)
    s = s.masked_fill(~block_mask.mask_mod(bi, hi, qi, ki), float("-inf"))
    total = torch.logsumexp(s, -1)
    out = torch.nan_to_num(torch.exp(s - total[..., None])) @ v
    return (out, total) if lse else out


def test_sink_gradients_through_the_flex_route(monkeypatch):
    """Sinks on flex are ``out · σ(ℓ − σ_h)`` from flex's logsumexp; the gradients of
    q, k, v and the sinks through that identity (with softcap, ALiBi, GQA and a key mask)
    equal the dense reference's. CPU: a dense stand-in with autograd takes flex's place
    (torch has no CPU flex backward); test_sink_gradients_cuda runs the kernel."""
    from mmattn.kernels._routes import band_mask_mod, block_mask

    monkeypatch.setattr(flex, "_flex_call", dense_flex)  # the CPU sinks path calls it
    length, window, glob = 36, 2, 3
    q, k, v = qkv(2, length, grad=True)
    sinks = torch.tensor([0.5, -1.0, 0.0, 2.0], requires_grad=True)
    key_ok = torch.ones(2, length, dtype=torch.bool)
    key_ok[0, 28:] = False
    cpu = torch.device("cpu")
    mask = block_mask(("band", window, False, glob),
                      lambda: band_mask_mod(window, False, glob, cpu), length, cpu, 16)
    mods = Modifiers(sinks=sinks, slopes=SLOPES)
    got = flex.flex_attend(q, k, v, mask, key_mask=key_ok, groups=2, modifiers=mods)
    i = torch.arange(length).float()
    allowed = band(length, window, glob)[None, None] & key_ok[:, None, None, :]
    want = reference(q, k, v, allowed, (i[:, None] - i[None, :]).abs(), SLOPES, sinks)
    close(got, want)
    for a, b in zip(torch.autograd.grad(got.square().sum(), (q, k, v, sinks)),
                    torch.autograd.grad(want.square().sum(), (q, k, v, sinks))):
        assert torch.isfinite(a).all()
        close(a, b)


def _flex_probe(q, k, v, block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=block_mask)


def test_chunked_mask_mod_compiles_with_dynamic_shapes():
    """P.chunked's mask_mod in a compiled flex_attention with dynamic shapes (how a run
    compiles once sizes or numbers change) on the CPU: it reads its window as tables, not
    Python ints (an int read by a mask_mod becomes a symbol, which inductor's CPU flex
    kernel fails to build beside a lookup: docs/decisions.md). A function of this test's
    own, so no other test's graphs of flex_attention change how this one compiles."""
    from torch.nn.attention.flex_attention import create_block_mask

    length = 13
    tokens = Tokens(torch.zeros(1, length, 8))
    pattern = P.chunked(3, left=1)
    bm = create_block_mask(pattern.mask_mod(tokens), 1, None, length, length, device="cpu")
    q, k, v = qkv(1, length, heads=2, kv=2)
    with torch.no_grad():
        out = torch.compile(_flex_probe, dynamic=True)(q, k, v, bm)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=pattern.dense(tokens)[:, None])
    close(out, want)


# ------------------------------------------------------------ CUDA (skipped on the CPU)


@pytest.mark.parametrize("device", CUDA)
def test_flex_graphs_stay_few_cuda(device):
    """Lengths, windows and batches changing between calls, forward and fwd+bwd: each
    signature holds at most three graphs (static, then dynamic length, then dynamic tile
    count), no warning, every output and gradient equals the fallback's."""
    engines.forget_failures()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for batch, length, window in [(2, 200, 8), (2, 331, 8), (3, 512, 16), (2, 777, 4)]:
            q, k, v = qkv(batch, length, device=device, grad=True)
            res = {}
            for engine in ("flex", "fallback"):
                with engines.use(engine):
                    out, _ = local_attend(q, k, v, window, num_global_tokens=2, groups=2)
                res[engine] = (out, *torch.autograd.grad(out.square().sum(), (q, k, v)))
            for a, b in zip(res["flex"], res["fallback"]):
                close(a, b)
    counts = [n for n in flex.graphs().values() if n is not None]
    assert counts and max(counts) <= 3, flex.graphs()


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("glob", [0, 3])
def test_alibi_positions_cuda_grad(device, glob):
    length = 300
    q, k, v = qkv(2, length, device=device, grad=True)
    rows = positions(length, glob, 5000).to(device)
    mods = Modifiers(slopes=SLOPES.to(device)).at(rows[:, None], rows[:, None])
    res = {}
    for engine in ("flex", "fallback"):
        with engines.use(engine):
            out, _ = local_attend(q, k, v, 16, num_global_tokens=glob, groups=2, modifiers=mods)
        res[engine] = (out, *torch.autograd.grad(out.square().sum(), (q, k, v)))
    for a, b in zip(res["flex"], res["fallback"]):
        close(a, b)


@pytest.mark.parametrize("device", CUDA)
def test_sink_gradients_cuda(device):
    q, k, v = qkv(2, 200, device=device, grad=True)
    sinks = torch.tensor([0.5, -1.0, 0.0, 2.0], device=device, requires_grad=True)
    mods = Modifiers(sinks=sinks, softcap=20.0, slopes=SLOPES.to(device))
    res = {}
    for engine in ("flex", "fallback"):
        with engines.use(engine):
            out, _ = local_attend(q, k, v, 8, num_global_tokens=2, groups=2, modifiers=mods)
        res[engine] = (out, *torch.autograd.grad(out.square().sum(), (q, k, v, sinks)))
    for a, b in zip(res["flex"], res["fallback"]):
        close(a, b)


@pytest.mark.parametrize("device", CUDA)
def test_engines_make_no_host_sync_cuda(device):
    """Warm calls of every engine route (varlen and flex for LocalAttention, a SparseMask
    on flex with a key mask and on varlen without, NeighborhoodAttention on flex) under
    torch.cuda.set_sync_debug_mode("error"): no host synchronisation per call; and no
    deprecation warning."""
    from mmattn.kernels.neighborhood import neighborhood_attend

    tokens = Tokens(torch.randn(2, 256, 64), meta={"documents": (torch.arange(256) // 60)
                                                   .expand(2, 256)}).to(device)
    segments = (P.same("documents") & P.causal()).compile(tokens, block_size=64)
    q, k, v = qkv(2, 256, device=device)
    half = tuple(t.half() for t in (q, k, v))
    key_ok = torch.ones(2, 256, dtype=torch.bool, device=device)
    key_ok[1, 200:] = False
    sparse = dict(is_causal=False, dropout_p=0.0, need_weights=False, groups=2, modifiers=None)
    calls = {
        "local varlen": lambda: local_attend(*half, 16, groups=2),
        "local flex": lambda: local_attend(q, k, v, 16, num_global_tokens=2, groups=2,
                                           key_mask=key_ok, modifiers=Modifiers(softcap=9.0)),
        "sparse flex": lambda: _routes.sparse(q, k, v, segments, key_mask=key_ok, **sparse),
        "sparse varlen": lambda: _routes.sparse(*half, segments, key_mask=None, **sparse),
        "neighborhood": lambda: neighborhood_attend(q, k, v, (16, 16), (5, 5)),
    }
    engine = {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for name, run in calls.items():  # the first call builds what is cached
            out = run()
            engine[name] = out[1].engine if isinstance(out[1], engines.Choice) else None
        assert engine["sparse flex"] == "flex" and engine["sparse varlen"] == "varlen"
        torch.cuda.synchronize()
        for name, run in calls.items():
            torch.cuda.set_sync_debug_mode("error")
            try:
                run()
            except RuntimeError as error:
                raise AssertionError(f"{name}: {error}") from error
            finally:
                torch.cuda.set_sync_debug_mode(0)
