"""Engine selection (mmattn.kernels.engines) as a pure function, forcing engines, and the
varlen argument builders (mmattn.kernels.varlen) against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from mmattn.kernels import engines
from mmattn.kernels.engines import Available, Call, select
from mmattn.kernels.varlen import offsets, row_offsets, runs, window_size

ALL = Available(varlen=True, varlen_window=True, varlen_gqa=True, varlen_lse=True, flex=True)
TORCH_2_11 = Available(varlen=True, varlen_window=True, varlen_gqa=False, varlen_lse=True,
                       flex=True)
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
    odd = Call(kind="segments", device="cuda", dtype=BF16, head_dim=12)
    assert select(odd, ALL, None).engine == "flex"
    assert "head widths" in select(odd, ALL, None).reason
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
