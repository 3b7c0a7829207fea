"""Engine selection (mmattn.kernels.engines) as a pure function, forcing engines, and the
varlen argument builders (mmattn.kernels.varlen) against hand-computed values."""

from __future__ import annotations

import contextlib

import pytest
import torch

from mmattn.kernels import engines
from mmattn.kernels.engines import Available, Call, select
from mmattn.kernels.varlen import offsets, row_offsets, runs, window_size

pytestmark = [pytest.mark.pins_path, pytest.mark.usefixtures("fused_only")]


ALL = Available(varlen=True, varlen_window=True, varlen_gqa=True, flex=True, flex_aux=True)
TORCH_2_11 = Available(varlen=True, varlen_window=True, varlen_gqa=False, flex=True,
                       flex_aux=True)
NONE = Available()
BF16 = torch.bfloat16


def call(kind="window", device="cuda", dtype=BF16, **kw) -> Call:
    return Call(kind=kind, device=device, dtype=dtype, head_dim=64, **kw)


@pytest.mark.parametrize("case, have, engine, words", [
    (call(), ALL, "varlen", "varlen_attn"),
    (call("segments"), ALL, "varlen", "varlen_attn"),
    (call("blocks"), ALL, "flex", "segments and windows only"),
    (call(global_tokens=True), ALL, "flex", "segments and windows only"),
    (call(dtype=torch.float32), ALL, "flex", "float16/bfloat16, not float32"),
    (call(groups=2), TORCH_2_11, "flex", "no enable_gqa"),
    (call(groups=2), ALL, "varlen", "varlen_attn"),
    (call(modifiers=("sinks",)), ALL, "flex", "no score modifiers (sinks)"),
    (call(key_mask=True), ALL, "flex", "no key padding mask"),
    (call(), Available(varlen=True, flex=True), "flex", "no window_size"),
    (call("segments", banded=True), Available(varlen=True, flex=True), "flex", "no window_size"),
    (call("segments"), Available(varlen=True, flex=True), "varlen", "varlen_attn"),
    (call(), NONE, "fallback", "no flex_attention"),
    (call(need_weights=True), ALL, "fallback", "need_weights=True"),
    (call(dropout=True), ALL, "fallback", "dropout"),
    (call(fused=False), ALL, "fallback", "MMATTN_FUSED_ATTN=0"),
    (call(traced=True), ALL, "fallback", "exporting"),
    (call(device="cpu"), ALL, "fallback", "on cpu mmattn's own kernels run"),
])
def test_select_automatic(case, have, engine, words):
    choice = select(case, have, allowed=None)
    assert choice.engine == engine
    assert words in choice.reason


def test_select_head_width_and_kinds():
    odd = Call(kind="segments", device="cuda", dtype=BF16, head_dim=20)
    assert select(odd, ALL, None).engine == "flex"
    assert "head widths" in select(odd, ALL, None).reason
    narrow = Call(kind="blocks", device="cuda", dtype=BF16, head_dim=8)
    assert "head widths >= 16" in select(narrow, ALL, None).reason
    with pytest.raises(ValueError, match="kind"):
        select(Call(kind="dense", device="cuda", dtype=BF16, head_dim=8), ALL, None)


def test_select_forced():
    cpu = call(device="cpu", dtype=torch.float32)
    # forced flex runs on the CPU, without autograd only
    assert select(cpu, ALL, ("flex",)).engine == "flex"
    refused = select(call(device="cpu", grad=True), ALL, ("flex",))
    assert refused.engine == "fallback" and "no backward on cpu" in refused.reason
    # varlen never leaves CUDA, even forced
    assert "CUDA-only" in select(cpu, ALL, ("varlen",)).reason
    # order is the user's; "fallback" alone refuses every engine
    assert select(call(), ALL, ("flex", "varlen")).engine == "flex"
    off = select(call(), ALL, ("fallback",))
    assert off.engine == "fallback" and "refused" in off.reason


def test_use_nests_and_checks_names():
    assert engines.forced() is None
    with engines.use("flex", "fallback"):
        assert engines.forced() == ("flex", "fallback")
        assert engines.considered("cpu")
        with engines.use("fallback"):
            assert engines.forced() == ("fallback",)
        assert engines.forced() == ("flex", "fallback")
    assert engines.forced() is None
    assert not engines.considered("cpu") and engines.considered("cuda")
    with pytest.raises(ValueError, match="expected one of .* got 'flash'"):
        with engines.use("flash"):
            pass
    with pytest.raises(ValueError, match="at least one"):
        with engines.use():
            pass


def test_available_detects_features():
    have = engines.available()
    assert isinstance(have, Available)
    # each argument implies the engine
    assert not (have.varlen_window or have.varlen_gqa) or have.varlen


def test_offsets():
    assert offsets(torch.tensor([3, 1, 4])).tolist() == [0, 3, 4, 8]
    assert offsets(torch.tensor([3, 1, 4])).dtype == torch.int32
    assert row_offsets(3, 5).tolist() == [0, 5, 10, 15]
    assert window_size(None, True) == (-1, 0)
    assert window_size(None, False) == (-1, -1)
    assert window_size(256, False) == (256, 256)
    assert window_size(256, True) == (256, 0)


def test_runs_by_hand():
    ids = torch.tensor([[0, 0, 1, 1, 1, -1, -1], [5, 5, 5, 2, 2, 2, 2]])
    r = runs(ids)
    assert r.cu_seqlens.tolist() == [0, 2, 5, 7, 10, 14]
    assert r.cu_seqlens.dtype == torch.int32
    assert r.max_len == 4 and r.contiguous
    assert r.dead.tolist() == [False] * 5 + [True] * 2 + [False] * 7


def test_runs_rows_split_and_noncontiguous():
    # the same id in two rows is two runs; an id coming back within a row is not contiguous
    same = runs(torch.tensor([[3, 3], [3, 3]]))
    assert same.cu_seqlens.tolist() == [0, 2, 4] and same.contiguous
    back = runs(torch.tensor([[0, 1, 0]]))
    assert back.cu_seqlens.tolist() == [0, 1, 2, 3] and not back.contiguous
    # negative stretches may come back (they attend nothing)
    assert runs(torch.tensor([[-1, 0, -1, 1]])).contiguous


def _doc_tokens(device="cpu"):
    from mmattn import Tokens

    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [5, 5, -1, -1, 6, 6, 6, 6]])
    mask = torch.tensor([[True] * 8, [True] * 6 + [False] * 2])
    return Tokens(torch.randn(2, 8, 16), mask, {"documents": ids}).to(device)


def test_segment_runs_of_a_compiled_pattern():
    from mmattn import patterns as P
    from mmattn.kernels.varlen import segment_runs

    tokens = _doc_tokens()
    cu = [0, 3, 7, 8, 10, 12, 14, 16]  # padding (-1) splits row 1's document 6
    dead = [0] * 10 + [1, 1, 0, 0, 1, 1]
    for pattern, window in ((P.same("documents"), (-1, -1)),
                            (P.same("documents") & P.causal(), (-1, 0)),
                            (P.causal() & P.window(2) & P.same("documents"), (2, 0)),
                            (P.same("documents") & P.window(3), (3, 3))):
        found, got = segment_runs(pattern.compile(tokens, block_size=16))
        assert found.cu_seqlens.tolist() == cu and found.max_len == 4
        assert found.dead.int().tolist() == dead and got == window
    for other in (P.same("documents") | P.causal(), P.same("documents") & P.full(),
                  P.causal()):
        assert segment_runs(other.compile(tokens, block_size=16)) is None
    # moved to another device (here "meta" stands in for CUDA), the runs come along
    mask = (P.same("documents") & P.causal()).compile(tokens, block_size=16)
    moved = mask.to("meta").segment_source
    assert moved.ids.device.type == "meta" and moved.real.device.type == "meta"
    assert moved.window == mask.segment_source.window == (-1, 0)
    assert torch.equal(mask.to("cpu").segment_source.ids, mask.segment_source.ids)
    # a document that comes back after padding is not one run: flex instead
    gap = _doc_tokens()
    gap.mask[0, 1] = False
    assert segment_runs(P.same("documents").compile(gap, block_size=16)) is None


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_segment_varlen_cuda(device):
    """A SparseMask of documents & causal on varlen (bf16) equals the fallback (the mask
    holds its tokens' padding: no key_padding_mask); explain names varlen. With a key
    padding mask the automatic choice is flex (no host read compares it with the
    padding), and the numbers are the same."""
    from mmattn import MultiHeadAttention
    from mmattn import patterns as P
    from mmattn.debug import explain

    tokens = _doc_tokens(device)
    mha = MultiHeadAttention(16 * 8, 2).to(device, torch.bfloat16)
    x = torch.randn(2, 8, 128, device=device, dtype=torch.bfloat16)
    mask = (P.same("documents") & P.causal()).compile(tokens, block_size=16)
    res = {}
    for engine, kpm in (("varlen", None), ("fallback", ~tokens.mask), ("flex", ~tokens.mask)):
        xi = x.clone().requires_grad_()
        with engines.use(engine) if engine != "flex" else contextlib.nullcontext():
            report = explain(mha, xi, attn_mask=mask, key_padding_mask=kpm)
        out = report.output[0]
        res[engine] = (out, *torch.autograd.grad(out.float().square().sum(), xi))
        assert report[0].engine == engine
    for engine in ("varlen", "flex"):
        for a, b in zip(res[engine], res["fallback"]):
            assert ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() < 2e-2


def test_varlen_takes_values_wider_than_the_queries():
    """Flash (varlen_attn) wants values as wide as the queries: wider values run e columns
    a call and are cropped; checked with a reference in varlen_attn's place (CPU)."""
    from mmattn.kernels.varlen import packed_attend

    def reference(q, k, v, cu_q, cu_k, max_q, max_k, *, scale):  # one SDPA per run
        outs = []
        for (a, b), (c, d) in zip(zip(cu_q[:-1], cu_q[1:]), zip(cu_k[:-1], cu_k[1:])):
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                *(t.transpose(0, 1) for t in (q[a:b], k[c:d], v[c:d])),
                scale=scale).transpose(0, 1))
        return torch.cat(outs)

    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 12, 20])
    q, k = torch.randn(20, 2, 8), torch.randn(20, 2, 8)
    v = torch.randn(20, 2, 8 + 11)  # e + M: two calls of 8 columns, the second padded
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[2].shape[-1])
        return reference(*args, **kwargs)

    out = packed_attend(q, k, v, cu, cu, 8, 8, attend=counted)
    want = reference(q, k, v, cu, cu, 8, 8, scale=8 ** -0.5)
    assert out.shape == (20, 2, 19) and calls == [8, 8, 8]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
