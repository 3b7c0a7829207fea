"""kernels.neighborhood and masks.neighborhood_mask against independent references.

The mask is held to a naive loop over NATTEN's definition (subgrids, clamped windows) and to
``natten.functional.na2d`` where natten runs; the kernel is held to the dense kernel
(``kernels.dense.attend``) with that mask, for outputs, weights and gradients.
"""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest
import torch

from mmattn.functional import fused_attn
from mmattn.kernels.dense import attend
from mmattn.kernels.neighborhood import (
    build_plan,
    choose_tiles,
    neighborhood_attend,
    neighborhood_rows,
    packed_items,
    padded_items,
)
from mmattn.masks import neighborhood_mask


def naive_window(n: int, k: int, d: int, p: int) -> set[int]:
    """NATTEN's window of position p on an axis of n: min(k, m) subgrid neighbours, clamped."""
    sub = [q for q in range(n) if q % d == p % d]
    width = min(k, len(sub))
    i = sub.index(p)
    start = min(max(i - width // 2, 0), len(sub) - width)
    return set(sub[start:start + width])


def naive_mask(grid, kernel, dilation, glob=0) -> torch.Tensor:
    (rows, cols), (kh, kw), (dh, dw) = grid, kernel, dilation
    length = glob + rows * cols
    out = torch.ones(length, length, dtype=torch.bool)
    for r, c, r2, c2 in itertools.product(range(rows), range(cols), range(rows), range(cols)):
        ok = r2 in naive_window(rows, kh, dh, r) and c2 in naive_window(cols, kw, dw, c)
        out[glob + r * cols + c, glob + r2 * cols + c2] = ok
    return out


MASK_CASES = [
    ((5, 6), (3, 3), (1, 1), 0),
    ((7, 4), (5, 3), (2, 1), 1),
    ((3, 2), (7, 7), (1, 1), 0),  # grid smaller than the kernel: whole axes
    ((9, 8), (3, 5), (3, 2), 2),  # subgrids of different sizes
    ((4, 9), (9, 3), (2, 3), 0),  # subgrids smaller than the kernel
    ((1, 1), (3, 3), (1, 1), 1),
]


@pytest.mark.parametrize("case", MASK_CASES, ids=str)
def test_mask_matches_naive_definition(case):
    grid, kernel, dilation, glob = case
    got = neighborhood_mask(grid, kernel, dilation=dilation, num_global_tokens=glob)
    assert torch.equal(got, naive_mask(grid, kernel, dilation, glob))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"grid": (4, 4), "kernel_size": 2}, ValueError, "kernel_size must be odd"),
    ({"grid": (4, 4), "kernel_size": 3, "dilation": 0}, ValueError, r"dilation\[0\] must be >= 1"),
    ({"grid": (0, 4), "kernel_size": 3}, ValueError, r"grid\[0\] must be >= 1"),
    ({"grid": 4, "kernel_size": 3}, TypeError, r"grid must be 1 to 3 ints: .*got 4"),
    # sides are checked, never coerced: 2.5 is not rounded to 2, True is not taken as 1
    ({"grid": (2.5, 4), "kernel_size": 3}, TypeError, r"grid\[0\] must be an int, got float"),
    ({"grid": (4, 2.0), "kernel_size": 3}, TypeError, r"grid\[1\] must be an int, got float"),
    ({"grid": (True, 4), "kernel_size": 3}, TypeError, r"grid\[0\] must be an int, got bool"),
    ({"grid": torch.tensor([2.0, 4.0]), "kernel_size": 3}, TypeError,
     "grid must be 1 to 3 ints: .* got a tensor .* torch.float32"),
    ({"grid": (4, 4), "kernel_size": 3, "num_global_tokens": -1}, ValueError,
     "num_global_tokens must be >= 0"),
])
def test_mask_named_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        neighborhood_mask(**kwargs)


def test_mask_takes_integer_sides_of_any_integer_type():
    want = neighborhood_mask((3, 4), 3)
    for grid in (torch.tensor([3, 4]), (torch.tensor(3), torch.tensor(4)),
                 (np.int64(3), np.int32(4))):
        assert torch.equal(neighborhood_mask(grid, 3), want)


def test_every_query_sees_the_same_number_of_keys():
    allowed = neighborhood_mask((11, 13), 5, dilation=2)
    counts = allowed.sum(-1)
    assert (counts == 25).all()


NATTEN_CASES = [
    # (rows, cols, kernel, dilation): every odd kernel 3-9, dilation 1-3, rectangles
    (9, 10, 3, 1),
    (11, 9, 5, 1),
    (12, 13, 7, 1),
    (9, 11, 9, 1),
    (10, 13, 3, 2),
    (14, 11, 5, 2),
    (22, 21, 7, 3),
    (12, 14, (3, 5), (2, 1)),
]


def test_mask_matches_natten_forward():
    natten = pytest.importorskip("natten")
    from natten.functional import na2d

    del natten
    for rows, cols, kernel, dilation in NATTEN_CASES:
        q, k, v = (torch.randn(1, rows, cols, 2, 8) for _ in range(3))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = na2d(q, k, v, kernel, dilation=dilation)  # (b, rows, cols, heads, e)
        flat = [t.reshape(1, rows * cols, 2, 8).transpose(1, 2) for t in (q, k, v)]
        pair = kernel if isinstance(kernel, tuple) else (kernel, kernel)
        dil = dilation if isinstance(dilation, tuple) else (dilation, dilation)
        out, _ = neighborhood_attend(*flat, (rows, cols), pair, dilation=dil)
        got = out.transpose(1, 2).reshape(want.shape)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _qkv(batch, heads, kv_heads, length, e=8, dtype=torch.float32, device="cpu"):
    make = lambda h: torch.randn(batch, h, length, e, dtype=dtype, device=device,  # noqa: E731
                                 requires_grad=True)
    return make(heads), make(kv_heads), make(kv_heads)


KERNEL_CASES = [
    # (grid, kernel, dilation, global tokens, tiles)
    ((9, 11), (3, 3), (1, 1), 0, None),
    ((10, 13), (5, 5), (2, 2), 0, (4, 4)),
    ((5, 4), (7, 7), (1, 1), 2, None),  # grid smaller than the kernel
    ((22, 21), (7, 7), (3, 3), 1, (6, 4)),
    ((3, 17), (3, 5), (2, 1), 0, (4, 8)),  # tiles larger than a subgrid
    ((16, 16), (7, 7), (1, 1), 3, (8, 8)),
]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
def test_kernel_equals_dense_attention(case, fused):
    grid, kernel, dilation, glob, tiles = case
    length = glob + grid[0] * grid[1]
    q, k, v = _qkv(2, 4, 2, length)
    allowed = neighborhood_mask(grid, kernel, dilation=dilation, num_global_tokens=glob)
    with fused_attn(fused):
        out, _ = neighborhood_attend(
            q, k, v, grid, kernel, dilation=dilation, num_global_tokens=glob, tiles=tiles
        )
        with_w, weights = neighborhood_attend(
            q, k, v, grid, kernel, dilation=dilation, num_global_tokens=glob, tiles=tiles,
            need_weights=True,
        )
    want, want_w = attend(q, k, v, allowed, need_weights=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(with_w, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-5)
    grad = torch.randn_like(out)
    got_g = torch.autograd.grad(out, (q, k, v), grad)
    want_g = torch.autograd.grad(want, (q, k, v), grad)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("additive", [False, True])
def test_key_mask_and_dead_rows(additive):
    grid, kernel = (6, 7), (3, 3)
    length = 1 + 42
    q, k, v = _qkv(3, 2, 2, length)
    real = torch.ones(3, length, dtype=torch.bool)
    real[1, 20:] = False
    real[2, :] = False  # every key padded: zeros, never NaN
    real[2, 5] = True  # ... except one: rows whose window misses it are dead
    real[2, 0] = False  # the global key padded too
    key_mask = real if not additive else torch.zeros(3, length).masked_fill(~real, float("-inf"))
    allowed = neighborhood_mask(grid, kernel, num_global_tokens=1) & real[:, None, None, :]
    for fused in (True, False):
        with fused_attn(fused):
            out, _ = neighborhood_attend(
                q, k, v, grid, kernel, num_global_tokens=1, key_mask=key_mask
            )
        want, _ = attend(q, k, v, allowed)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        want_g = torch.autograd.grad(want.sum(), (q, k, v))
        for a, b in zip(grads, want_g):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert (out[2, :, 30:] == 0).all()  # far from the one real key


def _item_reference(q, k, v, item, kernel, dilation):
    """One item alone: its own tokens, the dense mask of its grid, globals around it."""
    start, stop = item.offset, item.offset + item.length
    grid_end = item.start + item.rows * item.cols
    live = item.length if item.tail_global else grid_end
    allowed = torch.ones(live, live, dtype=torch.bool)
    allowed[item.start:grid_end, item.start:grid_end] = neighborhood_mask(
        (item.rows, item.cols), kernel, dilation=dilation
    )
    rows = [t[start:start + live].transpose(0, 1)[None] for t in (q, k, v)]
    out, _ = attend(*rows, allowed)
    full = torch.zeros(stop - start, q.shape[1], v.shape[-1])
    full[:live] = out[0].transpose(0, 1)
    return full


@pytest.mark.parametrize("tail_global", [False, True])
def test_rows_with_items_of_different_grids(tail_global):
    lengths, grids = [13, 40, 7], [(3, 4), (5, 7), (1, 5)]
    items = (
        packed_items(lengths, grids, grid_start=[1, 2, 0]) if tail_global
        else packed_items([1 + r * c for r, c in grids], grids, num_global_tokens=1)
    )
    total = sum(item.length for item in items)
    q = torch.randn(total, 4, 8, requires_grad=True)
    k, v = torch.randn(total, 2, 8), torch.randn(total, 2, 8)
    kernel, dilation = (3, 5), (1, 2)
    tiles = choose_tiles(items, kernel, dilation)
    plan = build_plan(total, items, kernel, dilation, tiles, "cpu")
    out, weights = neighborhood_rows(q, k, v, plan, need_weights=True)
    for item in items:
        want = _item_reference(q, k, v, item, kernel, dilation)
        torch.testing.assert_close(out[item.offset:item.offset + item.length], want,
                                   atol=1e-5, rtol=1e-5)
        w = weights[item.offset:item.offset + item.length, :, :item.length]
        live = w.sum(-1)
        torch.testing.assert_close(live[live > 0], torch.ones_like(live[live > 0]))


def test_grid_start_makes_outside_tokens_global():
    q, k, v = _qkv(2, 2, 2, 3 + 20 + 4)
    out, _ = neighborhood_attend(q, k, v, (4, 5), (3, 3), grid_start=3)
    allowed = torch.ones(27, 27, dtype=torch.bool)
    allowed[3:23, 3:23] = neighborhood_mask((4, 5), 3)
    want, _ = attend(q, k, v, allowed)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_padded_per_item_grids_leave_the_rest_dead():
    q, k, v = _qkv(2, 2, 2, 1 + 30)
    out, _ = neighborhood_attend(q, k, v, [(5, 6), (3, 4)], (3, 3), num_global_tokens=1)
    assert (out[1, :, 13:] == 0).all()
    items = padded_items(2, 31, [(5, 6), (3, 4)], num_global_tokens=1)
    rows = [t.transpose(1, 2).reshape(62, 2, 8) for t in (q, k, v)]
    for m, item in enumerate(items):
        want = _item_reference(*rows, item, (3, 3), (1, 1))
        torch.testing.assert_close(out[m].transpose(0, 1), want, atol=1e-5, rtol=1e-5)


def test_plan_never_builds_an_l_by_l_tensor():
    items = padded_items(1, 64 * 64, (64, 64))
    tiles = choose_tiles(items, (7, 7), (1, 1))
    plan = build_plan(64 * 64, items, (7, 7), (1, 1), tiles, "cpu")
    n, s, t = plan.allowed.shape
    assert n * s * t < 64 * 64 * 64 * 64 / 20  # O(L · slab), far below L²
    assert plan.pick.shape == (64 * 64,) and plan.gq_index.numel() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype, device):
    q, k, v = _qkv(2, 4, 4, 1 + 8 * 9, dtype=dtype, device=device)
    allowed = neighborhood_mask((8, 9), 3, num_global_tokens=1, device=device)
    for fused in (True, False):
        with fused_attn(fused):
            out, _ = neighborhood_attend(q, k, v, (8, 9), (3, 3), num_global_tokens=1)
        assert out.dtype == dtype
        want, _ = attend(*(t.float() for t in (q, k, v)), allowed)
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
        out.float().sum().backward()
        assert torch.isfinite(q.grad).all()


def test_device(device):
    q, k, v = _qkv(2, 4, 2, 12 * 10, device=device)
    out, _ = neighborhood_attend(q, k, v, (12, 10), (5, 5), dilation=(2, 1))
    allowed = neighborhood_mask((12, 10), 5, dilation=(2, 1), device=device)
    want, _ = attend(q, k, v, allowed)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_public_entry_points_refuse_what_they_cannot_run():
    # a grid larger than the item read the next item's rows (or past the end); a plan for
    # another number of rows, or items beyond their rows, went unchecked
    q, k, v = _qkv(2, 4, 2, 16)
    bad = [
        (dict(grid=(5, 5)), ValueError, r"grid \(5, 5\) has rows \* cols = 25 tokens.*got 16"),
        (dict(grid=(4, 4.0)), TypeError, r"grid\[1\] must be an int, got float"),
        (dict(grid=[(4, 4)]), ValueError, "grid must hold one .rows, cols. per item: expected 2"),
        (dict(kernel_size=2), ValueError, "kernel_size must be odd"),
        (dict(dilation=0), ValueError, r"dilation\[0\] must be >= 1"),
        (dict(k=k[..., :4], v=v[..., :4]), ValueError, "q and k must have the same head width"),
        (dict(k=k[:, :, :9], v=v[:, :, :9]), ValueError, "q and k must have the same length"),
        (dict(v=v[:1]), ValueError, "k and v must have the same rows and heads"),
        (dict(key_mask=torch.ones(2, 15, dtype=torch.bool)), ValueError, "key_mask must have"),
        (dict(key_mask=torch.ones(2, 16, dtype=torch.long)), TypeError, "key_mask must have"),
        (dict(dropout_p=-0.1), ValueError, r"dropout_p must be in \[0, 1\)"),
    ]
    for change, error, match in bad:
        args = dict(q=q, k=k, v=v, grid=(4, 4), kernel_size=3) | change
        with pytest.raises(error, match=match):
            neighborhood_attend(**args)
    rows = [t.transpose(1, 2).reshape(32, t.shape[1], 8) for t in (q, k, v)]
    items = packed_items([16, 16], (4, 4))
    plan = build_plan(32, items, (3, 3), (1, 1), (4, 4), "cpu")
    with pytest.raises(ValueError, match="plan was built for 32 rows on cpu, got 31 rows"):
        neighborhood_rows(*(t[:31] for t in rows), plan)
    with pytest.raises(ValueError, match=r"items\[1\] has a grid \(4, 5\) starting at 0: it "
                                         r"needs 20 rows, got length 16"):
        build_plan(32, packed_items([16, 16], [(4, 4), (4, 5)]), (3, 3), (1, 1), (4, 4), "cpu")
    with pytest.raises(ValueError, match=r"items\[1\] covers rows \[16, 32\), which must lie in "
                                         r"\[16, total=20\)"):
        build_plan(20, items, (3, 3), (1, 1), (4, 4), "cpu")


def test_one_plan_per_grid_shared_by_the_batch_and_a_cache_bounded_in_bytes():
    # the plan was keyed on batch x length and copied the windows once per item; its cache
    # held 32 entries whatever their size (B=8, 56², k=7: ~25 MB each)
    from mmattn.kernels import _neighborhood_plan as plans

    plans.CACHE.clear()
    for batch in (1, 3, 8):
        q, k, v = _qkv(batch, 2, 2, 9 * 7)
        with fused_attn(False):  # no tile mask either
            neighborhood_attend(q, k, v, (9, 7), (3, 3))
    assert len(plans.CACHE) == 1  # one plan: the grid's, whatever the batch
    (plan, _), = plans.CACHE._entries.values()
    assert plan.pick.shape == (9 * 7,)  # one item's rows, not batch x length
    cache = plans.ByteCache(100)
    for m in range(5):
        cache.put(m, f"value {m}", 40)
    assert len(cache) == 2 and cache.nbytes == 80 and cache.get(0) is None
    assert cache.get(4) == "value 4"
    assert cache.put("big", "too big", 101) == "too big" and cache.get("big") is None
    with fused_attn(True):
        for batch in (1, 2):
            neighborhood_attend(*_qkv(batch, 2, 2, 9 * 7), (9, 7), (3, 3))
    assert plans.CACHE.nbytes <= plans.CACHE.limit and len(plans.CACHE) == 3  # + two masks


def test_every_plan_field_is_read():
    # issue 29, item 11: Plan.has_dead and Plan.tiles were built for every plan and never read
    import pathlib
    import re

    from mmattn.kernels._neighborhood_plan import Plan

    root = pathlib.Path(__file__).parents[3] / "mmattn"
    source = "\n".join(p.read_text() for p in root.rglob("*.py"))
    unread = [f for f in Plan._fields if not re.search(rf"\.{f}\b(?!\s*=[^=])", source)]
    assert not unread, f"Plan fields never read: {unread}"


def test_eager_packed_and_exported_calls_share_one_tile_runner(monkeypatch):
    # issue 29, item 11: the export path had its own copy of neighborhood_rows
    # (_neighborhood_export.export_attend); every path now runs _neighborhood.run_tiles
    from mmattn.kernels import _neighborhood
    from mmattn.kernels import neighborhood as kernel

    calls, run = [], _neighborhood.run_tiles
    counted = lambda *a, **kw: calls.append(1) or run(*a, **kw)  # noqa: E731
    monkeypatch.setattr(_neighborhood, "run_tiles", counted)
    monkeypatch.setattr(kernel, "run_tiles", counted)
    q, k, v = _qkv(2, 2, 2, 12)
    key_mask = torch.ones(2, 12, dtype=torch.bool)
    key_mask[0, -2:] = False
    eager = neighborhood_attend(q, k, v, (3, 4), 3, key_mask=key_mask)[0]
    rows = [t.transpose(1, 2).reshape(24, 2, 8) for t in (q, k, v)]
    items = packed_items([12, 12], (3, 4))
    plan = build_plan(24, items, (3, 3), (1, 1), choose_tiles(items, (3, 3), (1, 1)), "cpu")
    neighborhood_rows(*rows, plan, key_mask=key_mask.reshape(-1))
    monkeypatch.setattr(_neighborhood, "exporting", lambda: True)
    monkeypatch.setattr(kernel, "exporting", lambda: True)
    exported = neighborhood_attend(q, k, v, (3, 4), 3, key_mask=key_mask)[0]
    torch.testing.assert_close(exported, eager)
    assert len(calls) == 3


@pytest.mark.parametrize("fused", [True, False])
def test_modifiers_and_table_equal_a_float64_loop(fused):
    # the kernel's own modifiers= / table= (the layer's are in attention/test_modifiers_geometry)
    from mmattn.kernels.modifiers import Modifiers

    grid, kernel, dilation, glob, heads = (4, 5), (3, 3), (1, 2), 1, 2
    length = glob + grid[0] * grid[1]
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, heads, length, 4, generator=gen, dtype=torch.float64)
               for _ in range(3))
    table = torch.randn(25, heads, generator=gen, dtype=torch.float64)
    mods = Modifiers(sinks=torch.tensor([0.5, -1.0], dtype=torch.float64),
                     slopes=torch.tensor([0.25, 0.5], dtype=torch.float64))
    with fused_attn(fused):
        out, _ = neighborhood_attend(q, k, v, grid, kernel, dilation=dilation,
                                     num_global_tokens=glob, modifiers=mods, table=table)
    allowed = naive_mask(grid, kernel, dilation, glob)
    want = torch.zeros_like(out)
    for b, h, i in itertools.product(range(2), range(heads), range(length)):
        scores = []
        for j in range(length):
            s = float(q[b, h, i] @ k[b, h, j]) / 2.0
            if i >= glob and j >= glob:  # both on the grid: ALiBi in cells, the table
                (r, c), (r2, c2) = divmod(i - glob, grid[1]), divmod(j - glob, grid[1])
                s -= float(mods.slopes[h]) * math.hypot(r - r2, c - c2)
                dr, dc = (r - r2) // dilation[0], (c - c2) // dilation[1]
                if allowed[i, j]:
                    s += float(table[(dr + 2) * 5 + (dc + 2), h])
            scores.append(s if allowed[i, j] else -math.inf)
        p = torch.tensor(scores + [float(mods.sinks[h])], dtype=torch.float64).softmax(0)
        want[b, h, i] = p[:-1] @ v[b, h]
    torch.testing.assert_close(out, want)


def test_bad_modifiers_and_table_raise_naming_them():
    from mmattn.kernels.modifiers import Modifiers

    q, k, v = _qkv(1, 2, 2, 12)
    with pytest.raises(TypeError, match="modifiers must be a mmattn.kernels.modifiers"):
        neighborhood_attend(q, k, v, (3, 4), 3, modifiers={"sinks": None})
    with pytest.raises(ValueError, match=r"modifiers.sinks must have shape \(2,\)"):
        neighborhood_attend(q, k, v, (3, 4), 3, modifiers=Modifiers(sinks=torch.zeros(3)))
    with pytest.raises(ValueError, match=r"table must have shape \(25, 2\)"):
        neighborhood_attend(q, k, v, (3, 4), 3, table=torch.zeros(9, 2))
    with pytest.raises(TypeError, match="table must be a floating tensor"):
        neighborhood_attend(q, k, v, (3, 4), 3, table=torch.zeros(25, 2, dtype=torch.long))
