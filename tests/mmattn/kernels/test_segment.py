"""kernels/segment.py: the edge kernel against a per-query loop, its twin and gradcheck.

The reference is a plain loop: for every query, the softmax over the scores of its edges and
the weighted sum of their values.
"""

from __future__ import annotations

import pytest
import torch

from mmattn.functional import fused_attn
from mmattn.kernels import _segment
from mmattn.kernels._segment import EdgeAttend
from mmattn.kernels.segment import edge_attend, edge_attend_explicit, edge_set
from mmattn.masks import k_hop_edges


def naive(q, k, v, src, dst, bias=None, scale=None):
    """Per query: softmax over its edges' scores, weighted sum of their values."""
    n, h, e = q.shape
    groups = h // k.shape[1]
    scale = e ** -0.5 if scale is None else scale
    out = torch.zeros(n, h, v.shape[-1], dtype=q.dtype)
    for i in range(n):
        edges = (dst == i).nonzero().flatten()
        if edges.numel() == 0:
            continue
        for head in range(h):
            keys = k[src[edges], head // groups]
            scores = keys @ q[i, head] * scale
            if bias is not None:
                scores = scores + bias[edges, head]
            out[i, head] = scores.softmax(0) @ v[src[edges], head // groups]
    return out


def random_problem(n=9, m=7, heads=4, kv_heads=2, width=3, num_edges=30, seed=0,
                   dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, width, generator=gen, dtype=dtype)
    k = torch.randn(m, kv_heads, width, generator=gen, dtype=dtype)
    v = torch.randn(m, kv_heads, 5, generator=gen, dtype=dtype)
    src = torch.randint(0, m, (num_edges,), generator=gen)
    dst = torch.randint(0, n - 1, (num_edges,), generator=gen)  # query n - 1: no edge
    src, dst, _, _ = edge_set(src, dst, m)
    bias = torch.randn(src.shape[0], heads, generator=gen, dtype=dtype)
    return q, k, v, src, dst, bias


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_both_paths_equal_the_loop(kv_heads):
    q, k, v, src, dst, bias = random_problem(kv_heads=kv_heads)
    want = naive(q, k, v, src, dst, bias)
    for fused in (True, False):
        with fused_attn(fused):
            got, _ = edge_attend(q, k, v, src, dst, bias=bias)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert got[-1].abs().max() == 0  # the query without an edge gets zeros


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_gradcheck(kv_heads):
    q, k, v, src, dst, bias = random_problem(n=5, m=4, heads=2, kv_heads=kv_heads, width=2,
                                             num_edges=10)
    inputs = [t.requires_grad_() for t in (q, k, v, bias)]
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: EdgeAttend.apply(q, k, v, b, src, dst, 0.7, 0.0), inputs,
        fast_mode=True,
    )
    assert torch.autograd.gradcheck(
        lambda q, k, v: EdgeAttend.apply(q, k, v, None, src[:0], dst[:0], 0.7, 0.0),
        inputs[:3], fast_mode=True,
    )


def test_fused_equals_explicit_gradients():
    q, k, v, src, dst, bias = random_problem(n=300, m=200, num_edges=5000)
    weight = torch.randn(300, 4, 5, dtype=q.dtype)
    results = []
    for fn in (
        lambda *t: EdgeAttend.apply(*t, src, dst, 0.5, 0.0),
        lambda q, k, v, b: edge_attend_explicit(q, k, v, src, dst, bias=b, scale=0.5)[0],
    ):
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
        out = fn(*inputs)
        results.append([out, *torch.autograd.grad((out * weight).sum(), inputs)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_dropout_keeps_the_mask_for_backward():
    q, k, v, src, dst, bias = random_problem()
    groups = q.shape[1] // k.shape[1]
    inputs = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    torch.manual_seed(3)
    out = EdgeAttend.apply(*inputs, src, dst, 0.5, 0.4)
    torch.manual_seed(3)
    keep = (torch.rand(q.shape[1], src.shape[0], dtype=torch.float64) >= 0.4).t()  # (h, E)
    ref_inputs = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    qr, kr, vr, br = ref_inputs
    kr, vr = (t.repeat_interleave(groups, dim=1) for t in (kr, vr))
    scores = (qr[dst] * kr[src]).sum(-1) * 0.5 + br
    weights = _segment.segment_softmax(scores, dst, q.shape[0]) * keep / 0.6
    want = torch.zeros_like(out).index_add(0, dst, weights[..., None] * vr[src])
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)
    for a, b in zip(torch.autograd.grad(out.sum(), inputs),
                    torch.autograd.grad(want.sum(), ref_inputs)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_weights_are_a_distribution_per_query():
    q, k, v, src, dst, _ = random_problem()
    _, weights = edge_attend(q, k, v, src, dst, need_weights=True)
    sums = torch.zeros(q.shape[0], q.shape[1], dtype=weights.dtype).index_add_(0, dst, weights)
    has = torch.bincount(dst, minlength=q.shape[0]) > 0
    torch.testing.assert_close(sums[has], torch.ones_like(sums[has]))
    assert (sums[~has] == 0).all()


def test_all_minus_inf_scores_give_zeros():
    q, k, v, src, dst, bias = random_problem()
    bias = torch.full_like(bias, float("-inf"))
    for fused in (True, False):
        with fused_attn(fused):
            qi = q.clone().requires_grad_()
            out, _ = edge_attend(qi, k, v, src, dst, bias=bias)
        assert (out == 0).all()
        (grad,) = torch.autograd.grad(out.sum(), qi)
        assert torch.isfinite(grad).all()


@pytest.mark.parametrize("fused", [True, False])
def test_edges_in_any_order_equal_the_loop(fused):
    # the fused path built its CSR rows from the order given: unsorted edges were off by ~2
    q, k, v, src, dst, bias = random_problem(kv_heads=2)
    order = torch.randperm(src.shape[0], generator=torch.Generator().manual_seed(5))
    src, dst, bias = src[order], dst[order], bias[order]
    src, dst = torch.cat([src, src[:3]]), torch.cat([dst, dst[:3]])  # repeats count twice
    bias = torch.cat([bias, bias[:3]])
    inputs = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    with fused_attn(fused):
        got, _ = edge_attend(*inputs[:3], src.int(), dst.int(), bias=inputs[3])
    want_inputs = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    want = naive(*want_inputs[:3], src, dst, want_inputs[3])
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    weight = torch.randn(got.shape, dtype=got.dtype)
    for a, b in zip(torch.autograd.grad((got * weight).sum(), inputs),
                    torch.autograd.grad((want * weight).sum(), want_inputs)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    _, weights = edge_attend(q, k, v, src, dst, bias=bias, need_weights=True)
    _, sorted_weights = edge_attend_explicit(q, k, v, src, dst, bias=bias)
    torch.testing.assert_close(weights, sorted_weights)  # in the order of the edges given


@pytest.mark.parametrize("fused", [True, False])
def test_public_entry_points_refuse_what_they_cannot_run(fused):
    # an out-of-range source was read outside the key rows on the fused path (garbage, no
    # error); an out-of-range target gave torch's expand error
    q, k, v, src, dst, bias = random_problem()  # n = 9 queries, m = 7 keys, 4 / 2 heads
    bad = [
        (dict(src=torch.tensor([7]), dst=torch.tensor([0])), ValueError,
         r"src \(key rows\) must lie in \[0, number of key rows=7\), got values in \[7, 7\]"),
        (dict(src=torch.tensor([-1]), dst=torch.tensor([0])), ValueError, r"src .* \[-1, -1\]"),
        (dict(src=torch.tensor([0]), dst=torch.tensor([9])), ValueError,
         r"dst \(query rows\) must lie in \[0, number of query rows=9\)"),
        (dict(src=torch.tensor([0, 1]), dst=torch.tensor([0])), ValueError,
         "src and dst must hold one id per edge, got 2 and 1"),
        (dict(src=torch.tensor([0.0]), dst=torch.tensor([0])), TypeError,
         "src must have an integer dtype"),
        (dict(src=torch.zeros(1, 1, dtype=torch.long), dst=torch.tensor([0])), ValueError,
         "src must be a 1-D tensor"),
        (dict(k=k[..., :2]), ValueError, "q and k must have the same head width"),
        (dict(v=v[:3]), ValueError, "k and v must have the same rows and heads"),
        (dict(k=k[:, :1].expand(-1, 3, -1).contiguous(), v=v[:, :1].expand(-1, 3, -1)),
         ValueError, r"key/value heads must divide the query heads .*, got 4 query heads and 3"),
        (dict(k=k.float()), TypeError, "k has dtype torch.float32 but q has dtype torch.float64"),
        (dict(q=q[0]), ValueError, r"q must be a 3-D tensor \(n, h, e\)"),
        (dict(bias=bias[:, :2]), ValueError, r"bias must have shape \(.*, 4\)"),
        (dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\)"),
        (dict(scale=float("nan")), ValueError, "scale must be a finite number"),
    ]
    for change, error, match in bad:
        args = dict(q=q, k=k, v=v, src=src, dst=dst, bias=bias)
        if "src" in change:
            args["bias"] = None
        args.update(change)
        for fn in (edge_attend, edge_attend_explicit):
            with fused_attn(fused), pytest.raises(error, match=match):
                fn(**args)
    with pytest.raises(ValueError, match=r"src \(key rows\) must lie in \[0, number of key"):
        edge_set(torch.tensor([3]), torch.tensor([0]), 3)
    with pytest.raises(ValueError, match=r"loops\[0\] \(key rows\) must lie"):
        edge_set(src, dst, 7, loops=(torch.arange(9), torch.arange(9)))


def test_edge_set_dedups_sorts_and_adds_loops():
    src, dst = torch.tensor([2, 0, 2, 1, 1]), torch.tensor([1, 1, 1, 0, 1])
    bias = torch.arange(5.0)[:, None]
    out_src, out_dst, out_bias, dup = edge_set(
        src, dst, 3, loops=(torch.arange(3), torch.arange(3)), bias=bias
    )
    assert dup
    assert out_dst.tolist() == [0, 0, 1, 1, 1, 2] and out_src.tolist() == [0, 1, 0, 1, 2, 2]
    assert out_bias.flatten().tolist() == [0.0, 3.0, 1.0, 4.0, 0.0, 0.0]  # given edges win
    _, _, _, dup = edge_set(torch.tensor([0, 1]), torch.tensor([1, 1]), 2,
                            loops=(torch.arange(2), torch.arange(2)))
    assert not dup  # an added loop never counts as a duplicate


def test_half_precision_keeps_float32_scores(device):
    q, k, v, src, dst, bias = random_problem(dtype=torch.float32)
    want = naive(q.double(), k.double(), v.double(), src, dst, bias.double())
    to = dict(device=device)
    for dtype in (torch.bfloat16, torch.float16):
        for fused in (True, False):
            with fused_attn(fused):
                got, _ = edge_attend(q.to(dtype=dtype, **to), k.to(dtype=dtype, **to),
                                     v.to(dtype=dtype, **to), src.to(device), dst.to(device),
                                     bias=bias.to(device))
            assert got.dtype == dtype
            torch.testing.assert_close(got.double().cpu(), want, atol=3e-2, rtol=3e-2)


def _reach(edge_index, n, hops):
    step = torch.zeros(n, n, dtype=torch.long)
    step[edge_index[1], edge_index[0]] = 1
    reach, power = step.clone(), step.clone()
    for _ in range(hops - 1):
        power = ((power @ step) > 0).long()
        reach |= power
    return reach.bool()


@pytest.mark.parametrize("hops", [1, 2, 3])
def test_k_hop_edges_are_the_paths(hops):
    edge_index = torch.randint(0, 12, (2, 20))
    got = k_hop_edges(edge_index, hops, 12)
    want = _reach(edge_index, 12, hops).nonzero()  # (target, source), row-major
    assert got.tolist() == want.flip(1).t().tolist()


def test_k_hop_edges_errors():
    with pytest.raises(ValueError, match="num_hops must be >= 1"):
        k_hop_edges(torch.tensor([[0], [1]]), 0)
    with pytest.raises(TypeError, match="edge_index must have an integer dtype"):
        k_hop_edges(torch.zeros(2, 1), 1)
    with pytest.raises(ValueError, match=r"must lie in \[0, num_nodes=2\)"):
        k_hop_edges(torch.tensor([[0], [2]]), 1, 2)
    with pytest.raises(ValueError, match=r"shape \(2, num_edges\)"):
        k_hop_edges(torch.zeros(3, 1, dtype=torch.long), 1)


def test_both_paths_share_one_segment_softmax(monkeypatch):
    # issue 29, item 11: the fused and the explicit path each had their own segment softmax
    # (_segment_softmax, _softmax_rows); both now call _segment.segment_softmax
    calls = []
    softmax = _segment.segment_softmax
    monkeypatch.setattr(_segment, "segment_softmax",
                        lambda *a, **kw: calls.append(kw.get("dim", 0)) or softmax(*a, **kw))
    q, k, v = (torch.randn(4, 2, 3) for _ in range(3))
    src, dst = torch.tensor([0, 1, 2, 3]), torch.tensor([0, 0, 1, 3])
    with fused_attn(True):
        fused = edge_attend(q, k, v, src, dst)[0]
    explicit = edge_attend_explicit(q, k, v, src, dst)[0]
    torch.testing.assert_close(fused, explicit)
    assert sorted(set(calls)) == [0, 1]  # the explicit path along edges, the fused along heads
