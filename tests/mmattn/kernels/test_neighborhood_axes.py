"""Neighbourhood attention on grids of 1, 2 and 3 axes with causal axes and dilation.

``masks.neighborhood_mask`` is held to a pair-by-pair Python loop over NATTEN's definition
(written here from the definition, not from mmattn's ``axis_window``) and to ``natten.na1d``
/ ``na2d`` / ``na3d`` with ``is_causal`` per axis where natten is installed; the kernel is
held to ``F.scaled_dot_product_attention`` with that dense mask in float64, for outputs and
gradients, on both attention paths.
"""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from mmattn.functional import fused_attn
from mmattn.kernels.modifiers import Modifiers
from mmattn.kernels.neighborhood import (
    build_plan,
    choose_tiles,
    neighborhood_attend,
    neighborhood_rows,
    packed_items,
    padded_items,
)
from mmattn.masks import neighborhood_mask
from tests._tolerance import assert_close_scaled

pytestmark = pytest.mark.usefixtures("one_thread")


def naive_window(n: int, k: int, d: int, p: int, causal: bool) -> set[int]:
    """NATTEN's window of position p on an axis of n: its dilation subgrid's min(k, m)
    neighbours centred and clamped inward, or on a causal axis the <= k ending at p."""
    sub = [q for q in range(n) if q % d == p % d]
    i = sub.index(p)
    if causal:
        return set(sub[max(0, i - k + 1):i + 1])
    width = min(k, len(sub))
    start = min(max(i - width // 2, 0), len(sub) - width)
    return set(sub[start:start + width])


def naive_mask(grid, kernel, dilation, causal, glob=0) -> torch.Tensor:
    """(L, L) bool by a loop over every (query cell, key cell) pair, row-major cells."""
    cells = list(itertools.product(*(range(n) for n in grid)))
    length = glob + len(cells)
    out = torch.ones(length, length, dtype=torch.bool)
    for (i, x), (j, y) in itertools.product(enumerate(cells), enumerate(cells)):
        out[glob + i, glob + j] = all(
            b in naive_window(n, k, d, a, c)
            for a, b, n, k, d, c in zip(x, y, grid, kernel, dilation, causal))
    return out


MASK_CASES = [  # (grid, kernel, dilation, causal, global tokens)
    ((9,), (3,), (1,), (True,), 0),
    ((11,), (5,), (2,), (False,), 1),
    ((10,), (5,), (3,), (True,), 0),
    ((6, 7), (3, 5), (1, 2), (True, False), 0),
    ((5, 4), (7, 3), (1, 1), (False, True), 2),  # kernel larger than an axis
    ((4, 5, 6), (3, 3, 3), (1, 1, 1), (True, False, False), 0),
    ((5, 4, 7), (3, 3, 5), (2, 1, 2), (True, True, False), 1),
    ((3, 6, 5), (5, 3, 3), (1, 2, 1), (False, False, True), 0),
]


@pytest.mark.parametrize("case", MASK_CASES, ids=str)
def test_mask_equals_a_pair_by_pair_loop(case):
    grid, kernel, dilation, causal, glob = case
    got = neighborhood_mask(grid, kernel, dilation=dilation, causal=causal,
                            num_global_tokens=glob)
    assert torch.equal(got, naive_mask(grid, kernel, dilation, causal, glob))


def test_scalars_apply_to_every_axis():
    grid = (4, 5, 6)
    want = naive_mask(grid, (3, 3, 3), (2, 2, 2), (True, True, True))
    assert torch.equal(neighborhood_mask(grid, 3, dilation=2, causal=True), want)
    # a causal window has at most k keys per axis; a centred one exactly min(k, m)
    counts = neighborhood_mask((9,), 5, causal=True).sum(-1)
    assert counts.tolist() == [1, 2, 3, 4, 5, 5, 5, 5, 5]
    assert (neighborhood_mask((4, 6, 7), 3).sum(-1) == 27).all()


NATTEN_CASES = [  # natten needs kernel * dilation <= every side
    ((12,), (5,), (2,), (True,)),
    ((7, 9), (3, 5), (2, 1), (True, False)),
    ((4, 5, 6), (3, 3, 3), (1, 1, 2), (True, False, False)),
    ((5, 6, 7), (3, 5, 3), (1, 1, 2), (False, True, True)),
]


@pytest.mark.parametrize("case", NATTEN_CASES, ids=str)
def test_kernel_equals_natten_with_causal_axes_and_dilation(case):
    natten = pytest.importorskip("natten", reason="needs natten (the bench extra)")
    grid, kernel, dilation, causal = case
    function = {1: natten.na1d, 2: natten.na2d, 3: natten.na3d}[len(grid)]
    q, k, v = (torch.randn(1, *grid, 2, 16) for _ in range(3))  # (b, *grid, heads, e)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = function(q, k, v, kernel, dilation=dilation, is_causal=causal)
    flat = [t.reshape(1, -1, 2, 16).transpose(1, 2) for t in (q, k, v)]
    out, _ = neighborhood_attend(*flat, grid, kernel, dilation=dilation, causal=causal)
    got = out.transpose(1, 2).reshape(want.shape)
    assert_close_scaled(got, want, atol=1e-5)
    # and the mask, through SDPA
    allowed = neighborhood_mask(grid, kernel, dilation=dilation, causal=causal)
    sdpa = F.scaled_dot_product_attention(*flat, attn_mask=allowed)
    assert_close_scaled(sdpa.transpose(1, 2).reshape(want.shape), want, atol=1e-5)


def _qkv(batch, heads, kv_heads, length, e=8, dtype=torch.float64):
    make = lambda h: torch.randn(batch, h, length, e, dtype=dtype,  # noqa: E731
                                 requires_grad=True)
    return make(heads), make(kv_heads), make(kv_heads)


def _sdpa(q, k, v, allowed):
    """The dense reference: SDPA with the mask, grouped heads repeated, dead rows zero."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, 1) for t in (k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    live = allowed.any(-1, keepdim=True)
    return torch.where(live, out, 0.0)


KERNEL_CASES = [  # (grid, kernel, dilation, causal, global tokens, tiles)
    ((13,), (5,), (2,), (True,), 1, None),
    ((6, 7), (3, 5), (1, 2), (False, True), 0, None),
    ((4, 6, 5), (3, 3, 3), (1, 1, 1), (True, False, False), 0, None),
    ((5, 7, 6), (3, 5, 3), (2, 1, 2), (True, True, False), 2, None),
    ((6, 5, 8), (3, 3, 5), (1, 1, 1), (True, False, False), 0, (2, 4, 4)),
    ((3, 4, 4), (5, 5, 5), (1, 1, 1), (False, True, False), 1, (4, 2, 8)),  # tiles > axes
]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
def test_kernel_equals_sdpa_with_the_dense_mask_float64(case, fused):
    grid, kernel, dilation, causal, glob, tiles = case
    length = glob + math.prod(grid)
    q, k, v = _qkv(2, 4, 2, length)
    allowed = neighborhood_mask(grid, kernel, dilation=dilation, causal=causal,
                                num_global_tokens=glob)
    with fused_attn(fused):
        out, _ = neighborhood_attend(q, k, v, grid, kernel, dilation=dilation, causal=causal,
                                     num_global_tokens=glob, tiles=tiles)
        _, weights = neighborhood_attend(q, k, v, grid, kernel, dilation=dilation,
                                         causal=causal, num_global_tokens=glob, tiles=tiles,
                                         need_weights=True)
    want = _sdpa(q, k, v, allowed)
    torch.testing.assert_close(out, want)
    assert torch.equal(weights[0, 0] > 0, allowed)  # the weights fall where the mask says
    grad = torch.randn_like(out)
    for got, ref in zip(torch.autograd.grad(out, (q, k, v), grad),
                        torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(got, ref)


def test_padding_and_per_item_grids_of_three_axes():
    grids = [(3, 4, 5), (2, 3, 3)]
    length = 1 + 60
    q, k, v = _qkv(2, 2, 2, length)
    real = torch.ones(2, length, dtype=torch.bool)
    real[0, 50:] = False  # key padding inside item 0's grid
    kernel, causal = (3, 3, 3), (True, False, False)
    out, _ = neighborhood_attend(q, k, v, grids, kernel, causal=causal, num_global_tokens=1,
                                 key_mask=real)
    for m, grid in enumerate(grids):
        stop = 1 + math.prod(grid)
        allowed = torch.zeros(length, length, dtype=torch.bool)
        allowed[:stop, :stop] = neighborhood_mask(grid, kernel, causal=causal,
                                                  num_global_tokens=1)
        want = _sdpa(q[m:m + 1], k[m:m + 1], v[m:m + 1], allowed & real[m])
        torch.testing.assert_close(out[m:m + 1], want)
    assert (out[1, :, 1 + 18:] == 0).all()  # item 1's tokens after its grid are dead


def test_packed_rows_of_video_items_each_as_if_alone():
    grids = [(2, 3, 4), (3, 2, 2), (4, 1, 3)]
    lengths = [math.prod(g) for g in grids]
    items = packed_items(lengths, grids)
    kernel, causal = (3, 3, 3), (True, False, False)
    tiles = choose_tiles(items, kernel, (1, 1, 1))
    plan = build_plan(sum(lengths), items, kernel, (1, 1, 1), tiles, "cpu", causal=causal)
    rows = [torch.randn(sum(lengths), h, 8, dtype=torch.float64) for h in (4, 2, 2)]
    out, _ = neighborhood_rows(*rows, plan)
    start = 0
    for grid, n in zip(grids, lengths):
        alone = [t[start:start + n].transpose(0, 1)[None] for t in rows]
        want = _sdpa(*alone, neighborhood_mask(grid, kernel, causal=causal))
        torch.testing.assert_close(out[start:start + n], want[0].transpose(0, 1))
        start += n


def test_alibi_is_euclidean_in_three_axes_float64_loop():
    grid, kernel, causal, glob, heads = (3, 4, 4), (3, 3, 3), (True, False, False), 1, 2
    length = glob + math.prod(grid)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, heads, length, 4, generator=gen, dtype=torch.float64)
               for _ in range(3))
    mods = Modifiers(slopes=torch.tensor([0.5, 0.25], dtype=torch.float64))
    out, _ = neighborhood_attend(q, k, v, grid, kernel, causal=causal, num_global_tokens=glob,
                                 modifiers=mods)
    allowed = naive_mask(grid, kernel, (1, 1, 1), causal, glob)
    cells = list(itertools.product(*(range(n) for n in grid)))
    want = torch.zeros_like(out)
    for h, i in itertools.product(range(heads), range(length)):
        scores = []
        for j in range(length):
            s = float(q[0, h, i] @ k[0, h, j]) / 2.0
            if i >= glob and j >= glob:
                s -= float(mods.slopes[h]) * math.dist(cells[i - glob], cells[j - glob])
            scores.append(s if allowed[i, j] else -math.inf)
        want[0, h, i] = torch.tensor(scores, dtype=torch.float64).softmax(0) @ v[0, h]
    torch.testing.assert_close(out, want)


def test_plan_of_a_video_grid_is_linear_in_its_cells():
    grid, kernel = (8, 32, 32), (3, 7, 7)
    items = padded_items(1, math.prod(grid), grid)
    tiles = choose_tiles(items, kernel, (1, 1, 1))
    plan = build_plan(math.prod(grid), items, kernel, (1, 1, 1), tiles, "cpu",
                      causal=(True, False, False))
    n, s, t = plan.allowed.shape
    cells = math.prod(grid)
    assert n * s >= cells and n * s * t < cells * cells / 10  # O(L · slab), far below L²
    assert t == math.prod(a + b - 1 for a, b in zip(tiles, kernel))
    # every query sees exactly its causal window: kt x kh x kw, fewer in the first frames
    counts = plan.allowed.sum(-1).flatten()[plan.q_index < cells]
    assert counts.max() == 3 * 7 * 7 and counts.min() == 7 * 7


@pytest.mark.parametrize("kwargs, error, match", [
    ({"kernel_size": (3, 3)}, ValueError,
     r"kernel_size must have one entry per grid axis: expected 3 of grid \(2, 3, 4\), got 2"),
    ({"causal": (True, False)}, ValueError,
     r"causal must have one entry per grid axis: expected 3 of grid \(2, 3, 4\), got 2"),
    ({"dilation": (1, 1, 1, 1)}, ValueError, r"dilation must have one entry per grid axis"),
    ({"causal": "yes"}, TypeError, "causal must be a bool or a tuple of bools"),
    ({"causal": (True, 1, False)}, TypeError, r"causal\[1\] must be a bool, got int"),
    ({"kernel_size": (3, 4, 3)}, ValueError, "kernel_size must be odd"),
    ({"grid": (2, 3, 4, 1)}, TypeError,
     r"grid must be 1 to 3 ints: \(length,\), \(rows, cols\) or \(frames, rows, cols\), "
     r"got \(2, 3, 4, 1\)"),
    ({"grid": (2, 0, 12)}, ValueError, r"grid\[1\] must be >= 1"),
])
def test_named_errors_expected_and_got(kwargs, error, match):
    q = k = v = torch.randn(1, 2, 24, 8)
    args = dict(grid=(2, 3, 4), kernel_size=3) | kwargs
    with pytest.raises(error, match=match):
        neighborhood_attend(q, k, v, **args)
    if "grid" not in kwargs:
        with pytest.raises(error, match=match):
            neighborhood_mask(**args)


def test_table_needs_a_two_axis_grid():
    q = k = v = torch.randn(1, 2, 24, 8)
    with pytest.raises(ValueError, match="table .* needs a 2-D grid, got a kernel of 3 axes"):
        neighborhood_attend(q, k, v, (2, 3, 4), 3, table=torch.zeros(25, 2))
    with pytest.raises(ValueError, match="grid must hold grids of one number of axes"):
        neighborhood_attend(torch.randn(2, 2, 24, 8), torch.randn(2, 2, 24, 8),
                            torch.randn(2, 2, 24, 8), [(2, 3, 4), (4, 6)], 3)


# ---------------------------------------------------------------------- chunked video tiles


def _saved_bytes(run) -> int:
    """Bytes of every tensor autograd saves for the backward while ``run()`` runs."""
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(total), out


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("options", [
    {},
    {"num_global_tokens": 1, "sinks": True, "alibi": True, "num_kv_heads": 2},
    {"softcap": 4.0, "dilation": (1, 2, 1)},
], ids=["plain", "modifiers", "softcap"])
def test_chunked_video_tiles_equal_one_call_and_save_no_gathered_tile(options, fused,
                                                                      monkeypatch):
    from mmattn import NeighborhoodAttention
    from mmattn.kernels import _neighborhood_chunks as chunks

    torch.manual_seed(0)
    grid = (4, 6, 6)
    layer = NeighborhoodAttention(16, 4, (3, 5, 5), causal=(True, False, False),
                                  dtype=torch.float64, **options)
    if options.get("sinks"):
        with torch.no_grad():
            layer.sinks.normal_()
    glob = options.get("num_global_tokens", 0)
    x = torch.randn(2, glob + 144, 16, dtype=torch.float64, requires_grad=True)
    kpm = torch.zeros(2, glob + 144, dtype=torch.bool)
    kpm[1, 100:] = True
    moved = x.detach().clone()
    moved[1, 100:] = float("nan")  # padding never leaks, on either path
    results = {}
    for name, budget in (("one", 10**12), ("chunks", 4096)):
        monkeypatch.setattr(chunks, "CHUNK_BYTES", budget)
        with fused_attn(fused):
            saved, out = _saved_bytes(lambda: layer(x, key_padding_mask=kpm, grid=grid)[0])
            grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
            nan_out, _ = layer(moved, key_padding_mask=kpm, grid=grid)
        results[name] = (saved, out, grads, nan_out)
    (saved_one, out, grads, nan_one), (saved_chunks, out_c, grads_c, nan_c) = results.values()
    torch.testing.assert_close(out_c, out)
    for a, b in zip(grads_c, grads):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(nan_c[:, :100], out[:, :100])
    torch.testing.assert_close(nan_one[:, :100], out[:, :100])
    rows = x.numel() * x.element_size()  # (B, L, D): the size of q, of k, of v
    assert saved_chunks < saved_one / 2  # the gathered tiles are not kept
    assert saved_chunks < 16 * rows  # O(L): projections, rows, outputs; no slab copies
