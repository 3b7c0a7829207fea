"""Score modifiers on the geometric layers equal a float64 explicit reference.

NeighborhoodAttention (``sinks=``, ``softcap=``, ``alibi=``, ``relative_position_bias=``) and
EdgeAttention (``sinks=``, ``softcap=``): the reference is written out here from the module's
own projections, with NATTEN's window and ``rpb`` indexing (``get_window_start`` /
``get_pb_start``, the helpers of tests/mmattn/test_relative_position.py) and the edge list as
a dense mask: scores → softcap → ALiBi (Euclidean in grid cells, 0 with a global token) + the
table → mask → softmax with the sink column → weights · V. Outputs, input gradients and the
gradients of ``sinks``, the table and ``edge_bias`` agree within 1e-5 on the fused and the
explicit path, dead rows included (zero, finite gradients). torch.export and ONNX Runtime
are the ``neighborhood_modifiers`` case of tests/mmattn/integrations/_export_cases.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from einops import rearrange

from mmattn import EdgeAttention, NeighborhoodAttention
from mmattn.functional import fused_attn
from mmattn.position import RelativePositionBias
from tests.mmattn.test_relative_position import _natten_pb_start, _natten_window_start

B, D, H = 2, 16, 4
SLOPES = [2.0 ** (-8.0 * (k + 1) / H) for k in range(H)]  # Press et al., H a power of two

#: name -> (constructor keywords, grid (one or per item), padded tokens of item 1)
NEIGHBORHOOD = {
    "globals": ({"kernel_size": 3, "num_global_tokens": 2}, (6, 7), slice(0, 2 + 3 * 7)),
    "dilated_gqa": ({"kernel_size": (3, 5), "dilation": (2, 1), "num_kv_heads": 2}, (7, 6),
                    slice(38, 42)),
    "grids": ({"kernel_size": 3, "num_global_tokens": 1}, [(6, 7), (4, 7)], None),
}
MODS = {
    "sinks": {"sinks": True},
    "softcap": {"softcap": 1.5},
    "alibi": {"alibi": True},
    "table": {"relative_position_bias": True},
    "all": {"sinks": True, "softcap": 1.5, "alibi": True, "relative_position_bias": True},
}


def _heads(t, heads):
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)


def _softmax_with_sink(scores, allowed, sinks):
    """(b, h, i, j) scores and pattern: weights with the sink column dropped; dead rows 0."""
    live = allowed.any(-1, keepdim=True)
    scores = torch.where(allowed & live, scores, -math.inf)
    sink = scores.new_full((*scores.shape[:-1], 1), -math.inf)
    if sinks is not None:
        sink = sinks[None, :, None, None].expand_as(sink)
    scores = torch.where(live, torch.cat([scores, sink], -1), 0.0)
    return torch.where(live, torch.softmax(scores, -1)[..., :-1], 0.0)


def _axis(n, k, d):
    starts = [_natten_window_start(i, n, k, d) for i in range(n)]
    return torch.tensor(starts), torch.tensor([_natten_pb_start(i, n, k, d) for i in range(n)])


def _item_geometry(m, rows, cols, start, length, nat):
    """NATTEN's pattern (l, l) of one item, its rpb term (l, l, h) and the grid cell of every
    token (l, 2), -1 off the grid."""
    (kh, kw), (dh, dw) = m.kernel_size, m.dilation
    ws_r, pb_r = _axis(rows, kh, dh)
    ws_c, pb_c = _axis(cols, kw, dw)
    r, c = torch.arange(rows)[:, None, None, None], torch.arange(cols)[None, :, None, None]
    ki, kj = torch.arange(kh)[None, None, :, None], torch.arange(kw)[None, None, None, :]
    shape = (rows, cols, kh, kw)
    query = (start + r * cols + c).expand(shape).flatten()
    key = (start + (ws_r[r] + ki * dh) * cols + ws_c[c] + kj * dw).expand(shape).flatten()
    allowed = torch.zeros(length, length, dtype=torch.bool)
    allowed[query, key] = True
    stop = start + rows * cols
    allowed[:start, :stop] = allowed[:stop, :start] = True  # global tokens (tail: dead)
    bias = torch.zeros(length, length, H, dtype=torch.float64)
    if nat is not None:
        values = nat[:, pb_r[r] + ki, pb_c[c] + kj].reshape(H, -1).T
        bias = bias.index_put((query, key), values)
    cells = torch.full((length, 2), -1)
    cells[start:stop] = torch.stack(torch.meshgrid(
        torch.arange(rows), torch.arange(cols), indexing="ij"), -1).reshape(-1, 2)
    return allowed, bias, cells


def reference_neighborhood(m, x, padding, grid, nat):
    g, groups = m.num_global_tokens, m.num_heads // m.num_kv_heads
    q = _heads(m.q_proj(x), H)
    k = _heads(m.k_proj(x), m.num_kv_heads).repeat_interleave(groups, 1)
    v = _heads(m.v_proj(x), m.num_kv_heads).repeat_interleave(groups, 1)
    length = x.shape[1]
    scores = q @ k.transpose(-1, -2) / math.sqrt(m.head_dim)
    if m.softcap is not None:
        scores = m.softcap * torch.tanh(scores / m.softcap)
    grids = grid if isinstance(grid, list) else [grid] * B
    allowed, terms = [], []
    for rows, cols in grids:
        ok, bias, cells = _item_geometry(m, rows, cols, g, length, nat)
        on = (cells[:, None, 0] >= 0) & (cells[None, :, 0] >= 0)
        dist = (cells[:, None] - cells[None, :]).double().square().sum(-1).sqrt()
        alibi = torch.zeros(H, length, length, dtype=torch.float64)
        if m.alibi_slopes is not None:
            alibi = -torch.tensor(SLOPES, dtype=torch.float64)[:, None, None] * (dist * on)
        allowed.append(ok)
        terms.append(alibi + bias.permute(2, 0, 1))
    allowed = torch.stack(allowed)[:, None] & ~padding[:, None, None, :]
    weights = _softmax_with_sink(scores + torch.stack(terms), allowed, m.sinks)
    return m.out_proj((weights @ v).transpose(1, 2).flatten(2)), weights


def _neighborhood_case(name, mods):
    kw, grid, pad = NEIGHBORHOOD[name]
    mods = dict(mods)
    kernel = kw["kernel_size"]
    kh, kw_ = (kernel, kernel) if isinstance(kernel, int) else kernel
    gen = torch.Generator().manual_seed(2)
    nat = None
    if mods.pop("relative_position_bias", False):  # a NAT checkpoint's rpb, NATTEN's layout
        nat = 0.5 * torch.randn(H, 2 * kh - 1, 2 * kw_ - 1, generator=gen)
        mods["relative_position_bias"] = RelativePositionBias.from_nat(nat)
    torch.manual_seed(0)
    module = NeighborhoodAttention(D, H, **kw, **mods)
    if module.sinks is not None:
        with torch.no_grad():
            module.sinks.copy_(torch.linspace(-1.0, 1.5, H))
    first = grid[0] if isinstance(grid, list) else grid
    length = kw.get("num_global_tokens", 0) + first[0] * first[1]
    x = torch.randn(B, length, D, generator=gen)
    padding = torch.zeros(B, length, dtype=torch.bool)
    if pad is not None:
        padding[1, pad] = True
    return module, x, padding, grid, nat


def _grads(out, leaves):
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    return torch.autograd.grad(out, leaves, upstream.to(out.dtype))


def _check(got, want, out, dead, bias):
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=1e-5)
    if dead.any():  # no allowed key: the attention result is 0, the output out_proj's bias
        torch.testing.assert_close(out[dead], bias.expand_as(out[dead]))


#: each modifier alone on the first geometry; the table where dilation counts; all of them
#: on every geometry
PAIRS = [("globals", m) for m in MODS] + [
    ("dilated_gqa", "table"), ("dilated_gqa", "all"), ("grids", "alibi"), ("grids", "all"),
]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize(("name", "mods"), PAIRS)
def test_neighborhood_modifiers_equal_the_float64_reference(name, mods, fused):
    module, x, padding, grid, nat = _neighborhood_case(name, MODS[mods])
    x.requires_grad_()
    kpm = padding if padding.any() else None  # "grids": no key mask, the direct tile call
    with fused_attn(fused):
        out, _ = module(x, key_padding_mask=kpm, grid=grid)
    table = module.relative_position_bias
    leaves = [x] + [p for p in (module.sinks, table and table.relative_position_bias_table)
                    if p is not None]
    got = _grads(out, leaves)

    ref = copy.deepcopy(module).double()
    x64 = x.detach().double().requires_grad_()
    nat64 = None if nat is None else nat.double().requires_grad_()
    want_out, weights = reference_neighborhood(ref, x64, padding, grid, nat64)
    want = list(_grads(want_out, [x64] + [p for p in (ref.sinks, nat64) if p is not None]))
    if nat64 is not None:  # NATTEN's layout -> Swin's: flip both offset axes, flatten
        want[-1] = rearrange(want[-1].flip(1, 2), "h r c -> (r c) h")
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    _check(got, want, out, ~weights.detach().any(-1).any(1), module.out_proj.bias)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_neighborhood_weights_and_the_dense_fallback_follow_the_reference(fused):
    """need_weights (weights without the sink column) and an extra attn_mask (the dense O(L²)
    fallback) apply the same modifiers."""
    module, x, padding, grid, nat = _neighborhood_case("globals", MODS["all"])
    ref = copy.deepcopy(module).double()
    want_out, want_w = reference_neighborhood(ref, x.double(), padding, grid,
                                              nat.double())
    with fused_attn(fused):
        out, weights = module(x, key_padding_mask=padding, grid=grid, need_weights=True,
                              average_attn_weights=False)
        dense, _ = module(x, key_padding_mask=padding, grid=grid,
                          attn_mask=torch.zeros(x.shape[1], x.shape[1], dtype=torch.bool))
    torch.testing.assert_close(weights.double(), want_w, atol=1e-6, rtol=1e-6)
    for got in (out, dense):
        torch.testing.assert_close(got.double(), want_out, atol=1e-5, rtol=1e-5)


def test_neighborhood_packed_items_equal_each_item_alone():
    module, *_ = _neighborhood_case("grids", MODS["all"])
    gen = torch.Generator().manual_seed(4)
    grids = [(5, 6), (4, 7), (6, 6)]
    items = [torch.randn(1 + r * c, D, generator=gen) for r, c in grids]
    packed = torch.nested.nested_tensor(items, layout=torch.jagged)
    out, _ = module(packed, grid=grids)
    for item, g, got in zip(items, grids, out.unbind()):
        torch.testing.assert_close(got, module(item[None], grid=g)[0][0], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- edges

EDGES = {  # name -> (constructor keywords, edge bias)
    "bias_loops": ({}, True),
    "gqa_no_loops": ({"num_kv_heads": 2, "add_self_loops": False}, False),
}
EDGE_MODS = {"sinks": {"sinks": True}, "softcap": {"softcap": 1.5},
             "both": {"sinks": True, "softcap": 1.5}}
L = 7


def _edge_case(name, mods):
    kw, with_bias = EDGES[name]
    torch.manual_seed(0)
    module = EdgeAttention(D, H, **kw, **mods)
    if module.sinks is not None:
        with torch.no_grad():
            module.sinks.copy_(torch.linspace(-1.0, 1.5, H))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(B, L, D, generator=gen)
    pairs = {(int(s), int(t)) for s, t in torch.randint(0, L, (20, 2), generator=gen)}
    pairs = sorted(pairs | {(2, 3)})
    pairs = [(s, t) for s, t in pairs if t != 0]  # token 0 has no edge in: dead without loops
    edges = torch.tensor([[b * L + s, b * L + t] for b in range(B) for s, t in pairs]).T
    bias = 0.5 * torch.randn(edges.shape[1], H, generator=gen) if with_bias else None
    padding = torch.zeros(B, L, dtype=torch.bool)
    padding[1, 4:] = True
    return module, x, edges, bias, padding


def reference_edges(m, x, edges, bias, padding):
    groups = m.num_heads // m.num_kv_heads
    q = _heads(m.q_proj(x), H)
    k = _heads(m.k_proj(x), m.num_kv_heads).repeat_interleave(groups, 1)
    v = _heads(m.v_proj(x), m.num_kv_heads).repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(m.head_dim)
    if m.softcap is not None:
        scores = m.softcap * torch.tanh(scores / m.softcap)
    allowed = torch.zeros(B * L, B * L, dtype=torch.bool)
    allowed[edges[1], edges[0]] = True  # query = target, key = source
    dense_bias = torch.zeros(B * L, B * L, H, dtype=scores.dtype)
    if bias is not None:
        dense_bias = dense_bias.index_put((edges[1], edges[0]), bias)
    blocks = torch.arange(B * L).view(B, L)
    allowed = torch.stack([allowed[r][:, r] for r in blocks])[:, None]
    dense_bias = torch.stack([dense_bias[r][:, r] for r in blocks]).permute(0, 3, 1, 2)
    if m.add_self_loops:
        allowed = allowed | torch.eye(L, dtype=torch.bool)
    real = ~padding
    allowed = allowed & real[:, None, None, :] & real[:, None, :, None]
    weights = _softmax_with_sink(scores + dense_bias, allowed, m.sinks)
    return m.out_proj((weights @ v).transpose(1, 2).flatten(2)), weights


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("mods", list(EDGE_MODS))
@pytest.mark.parametrize("name", list(EDGES))
def test_edge_modifiers_equal_the_float64_reference(name, mods, fused):
    module, x, edges, bias, padding = _edge_case(name, EDGE_MODS[mods])
    x.requires_grad_()
    if bias is not None:
        bias.requires_grad_()
    with fused_attn(fused):
        out, _ = module(x, key_padding_mask=padding, edge_index=edges, edge_bias=bias)
    leaves = [t for t in (x, module.sinks, bias) if t is not None]
    got = _grads(out, leaves)
    ref = copy.deepcopy(module).double()
    x64 = x.detach().double().requires_grad_()
    b64 = None if bias is None else bias.detach().double().requires_grad_()
    want_out, weights = reference_edges(ref, x64, edges, b64, padding)
    want = _grads(want_out, [t for t in (x64, ref.sinks, b64) if t is not None])
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    dead = ~weights.detach().any(-1).any(1)
    assert dead.any() or module.add_self_loops
    _check(got, want, out, dead, module.out_proj.bias)


def test_edge_weights_leave_the_sink_out():
    module, x, edges, bias, padding = _edge_case("bias_loops", EDGE_MODS["both"])
    _, weights = module(x, key_padding_mask=padding, edge_index=edges, edge_bias=bias,
                        need_weights=True, average_attn_weights=False)
    want = reference_edges(copy.deepcopy(module).double(), x.double(), edges, bias.double(),
                           padding)[1]
    torch.testing.assert_close(weights.to_dense().double(), want, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda: NeighborhoodAttention(D, H, 3, softcap=0.0), ValueError,
         "softcap must be > 0, got 0"),
        (lambda: EdgeAttention(D, H, softcap=-1.0), ValueError, "softcap must be > 0, got -1"),
        (lambda: NeighborhoodAttention(D, H, 3, relative_position_bias=RelativePositionBias(
            H, 5)), ValueError, r"relative_position_bias must have the window of kernel_size "
         r"\(3, 3\) \(a table of 25 offsets\), got a table for the window \(5, 5\)"),
        (lambda: NeighborhoodAttention(D, H, (3, 5), relative_position_bias=(
            RelativePositionBias.from_nat(torch.zeros(H, 5, 5)))), ValueError,
         r"window of kernel_size \(3, 5\).*got a table for the window \(3, 3\)"),
        (lambda: NeighborhoodAttention(D, H, 3, relative_position_bias=RelativePositionBias(
            2, 3)), ValueError, "relative_position_bias must have num_heads=4 columns, got 2"),
        (lambda: NeighborhoodAttention(D, H, 3, relative_position_bias="yes"), TypeError,
         "relative_position_bias must be a bool or a mmattn.position.RelativePositionBias"),
        (lambda: EdgeAttention(D, H, alibi=True), ValueError,
         "alibi=True is not supported by EdgeAttention: graph nodes have no order"),
    ],
)
def test_bad_arguments_raise_naming_them(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_a_table_assigned_later_is_checked_at_the_call():
    module = NeighborhoodAttention(D, H, 3, relative_position_bias=True)
    assert "relative_position_bias.relative_position_bias_table" in module.state_dict()
    module.relative_position_bias = RelativePositionBias(H, 5)
    with pytest.raises(ValueError, match=r"window of kernel_size \(3, 3\)"):
        module(torch.randn(1, 9, D), grid=(3, 3))
