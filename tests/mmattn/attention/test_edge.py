"""EdgeAttention against dense masked MultiHeadAttention and PyG's TransformerConv.

The reference is MultiHeadAttention holding the same weights with an ``attn_mask`` built
independently of mmattn.kernels.segment: ``adapters.neighbourhood_mask`` where it applies
(self loops, one hop), else a mask filled by a plain loop over the edges.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mmattn import EdgeAttention, Encoder, MultiHeadAttention, Tokens, TransformerBlock
from mmattn.functional import fused_attn
from mmattn.masks import k_hop_edges

D, H = 16, 4
LENGTHS = (5, 7, 0)  # an empty graph in the batch
L = max(LENGTHS)


def graph_batch():
    """Padded x (3, 7, D), mask, and flat (b·L + i) edges with an isolated node (item 0,
    node 4), duplicate edges and an explicit self loop."""
    x = torch.randn(len(LENGTHS), L, D, dtype=torch.float64)
    mask = torch.arange(L) < torch.tensor(LENGTHS)[:, None]
    pairs = [  # (item, source, target)
        (0, 0, 1), (0, 1, 0), (0, 1, 2), (0, 2, 3), (0, 3, 0), (0, 1, 2), (0, 2, 2),
        (1, 0, 6), (1, 6, 0), (1, 2, 3), (1, 3, 2), (1, 4, 5), (1, 5, 1), (1, 1, 4),
        (1, 6, 6), (1, 0, 6),
    ]
    edge_index = torch.tensor([[b * L + s for b, s, _ in pairs], [b * L + t for b, _, t in pairs]])
    return x, mask, edge_index


def unique_edges(edge_index):
    return torch.unique(edge_index, dim=1)


def dense_allowed(edge_index, batch, q_len, k_len, self_loops, q_lengths, k_lengths):
    """(B, L, S) "may attend" from a loop over the edges (the independent reference)."""
    allowed = torch.zeros(batch, q_len, k_len, dtype=torch.bool)
    for s, t in edge_index.t().tolist():
        allowed[t // q_len, t % q_len, s % k_len] = True
    if self_loops:
        for b in range(batch):
            for i in range(min(q_lengths[b], k_lengths[b])):
                allowed[b, i, i] = True
    return allowed


def pair(dtype=torch.float64, **kwargs):
    edge = EdgeAttention(D, H, dtype=dtype, **kwargs)
    dense = MultiHeadAttention(D, H, dtype=dtype, num_kv_heads=kwargs.get("num_kv_heads"),
                               kdim=kwargs.get("kdim"), vdim=kwargs.get("vdim"))
    dense.load_state_dict(edge.state_dict())
    return edge, dense


def compare(edge, dense, fused, x, mask, edge_index, attn_mask, edge_bias=None, key=None):
    """Outputs and input / weight gradients on the real tokens, within 1e-5."""
    weight = torch.randn(x.shape[0], x.shape[1], D, dtype=x.dtype)
    results = []
    for module, kwargs in (
        (edge, {"edge_index": edge_index, "edge_bias": edge_bias}),
        (dense, {"attn_mask": attn_mask}),
    ):
        xi = x.clone().requires_grad_()
        ki = None if key is None else key.clone().requires_grad_()
        kpm = ~mask if key is None else None
        with fused_attn(fused):
            out, _ = module(xi, ki, ki, key_padding_mask=kpm, **kwargs)
        loss = (out * weight)[mask].sum()
        inputs = [xi] if key is None else [xi, ki]
        got = torch.autograd.grad(loss, [*inputs, *module.parameters()])
        results.append((out[mask], got))
    (out_e, grad_e), (out_d, grad_d) = results
    torch.testing.assert_close(out_e, out_d, atol=1e-5, rtol=1e-5)
    for name, a, b in zip(["x", "key", *dict(edge.named_parameters())], grad_e, grad_d):
        ga = a[mask] if name == "x" else a
        gb = b[mask] if name == "x" else b
        torch.testing.assert_close(ga, gb, atol=1e-5, rtol=1e-5, msg=f"gradient of {name}")


OPTIONS = list(itertools.product([True, False], [None, 2], [True, False], [True, False]))


@pytest.mark.parametrize("self_loops, kv_heads, biased, fused", OPTIONS)
def test_equals_dense_masked_attention(self_loops, kv_heads, biased, fused):
    x, mask, edge_index = graph_batch()
    edge, dense = pair(add_self_loops=self_loops, num_kv_heads=kv_heads)
    edge_bias = None
    if biased:
        edge_index = unique_edges(edge_index)  # a bias needs unique edges
        edge_bias = torch.randn(edge_index.shape[1], H, dtype=x.dtype)
    allowed = dense_allowed(edge_index, 3, L, L, self_loops, LENGTHS, LENGTHS)
    if biased:
        additive = torch.where(allowed, 0.0, float("-inf")).to(x.dtype)
        additive = additive[:, None].repeat(1, H, 1, 1)
        for (s, t), b in zip(edge_index.t().tolist(), edge_bias):
            additive[t // L, :, t % L, s % L] = b
        attn_mask = additive.flatten(0, 1)
    else:
        attn_mask = (~allowed).repeat_interleave(H, dim=0)
    compare(edge, dense, fused, x, mask, edge_index, attn_mask, edge_bias)


@pytest.mark.parametrize("fused", [True, False])
def test_equals_neighbourhood_mask(fused):
    graph = pytest.importorskip("adapters.graph")
    pytest.importorskip("torch_geometric")
    x, mask, edge_index = graph_batch()
    # neighbourhood_mask takes global node ids (PyG's batch), our edges flat token rows
    ptr = torch.tensor([0, *itertools.accumulate(LENGTHS)])
    item = edge_index // L
    node_index = edge_index - item * L + ptr[item]
    batch = torch.repeat_interleave(torch.arange(3), torch.tensor(LENGTHS))
    for hops in (1, 2):
        attn_mask = graph.neighbourhood_mask(node_index, batch, hops, num_heads=H,
                                             max_num_nodes=L, batch_size=3)
        edge, dense = pair()
        compare(edge, dense, fused, x, mask, k_hop_edges(edge_index, hops, 3 * L),
                attn_mask)


@pytest.mark.parametrize("fused", [True, False])
def test_bipartite_key(fused):
    x, mask, _ = graph_batch()
    key = torch.randn(3, 4, 8, dtype=x.dtype)
    # sources index the flat key order b·S + j, targets the flat query order b·L + i
    edge_index = torch.tensor([[0, 3, 1, 4, 7, 5], [1, 1, 4, 8, 12, 7]])
    edge, dense = pair(kdim=8, vdim=8, num_kv_heads=2)
    allowed = torch.zeros(3, L, 4, dtype=torch.bool)
    for s, t in edge_index.t().tolist():
        allowed[t // L, t % L, s % 4] = True
    for i in range(4):  # self loops: query position i to key position i (where both exist)
        allowed[:, i, i] = True
    attn_mask = (~allowed).repeat_interleave(H, dim=0)
    compare(edge, dense, fused, x, mask, edge_index, attn_mask, key=key)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("kv_heads", [None, 2])
def test_packed_equals_padded(fused, kv_heads):
    x, mask, edge_index = graph_batch()
    edge = EdgeAttention(D, H, dtype=x.dtype, num_kv_heads=kv_heads)
    offsets = torch.tensor([0, *itertools.accumulate(LENGTHS)])
    item = edge_index // L
    packed_index = edge_index - item * L + offsets[item]  # the row of values()
    packed = Tokens(x, mask).pack()
    with fused_attn(fused):
        want, _ = edge(x, key_padding_mask=~mask, edge_index=edge_index)
        got, weights = edge(packed.x, edge_index=packed_index, need_weights=True)
    torch.testing.assert_close(got.values(), want[mask], atol=1e-10, rtol=1e-10)
    _, dense = edge(x, key_padding_mask=~mask, edge_index=edge_index, need_weights=True,
                    average_attn_weights=False)
    per_head = edge(packed.x, edge_index=packed_index, need_weights=True,
                    average_attn_weights=False)[1]
    for b, n in enumerate(LENGTHS):
        assert weights[b].shape == (n, n) and weights[b].is_sparse
        torch.testing.assert_close(weights[b].to_dense(), dense.to_dense()[b, :, :n, :n].mean(0))
        torch.testing.assert_close(per_head[b].to_dense(), dense.to_dense()[b, :, :n, :n])


def test_sparse_weights_have_the_dense_shape():
    x, mask, edge_index = graph_batch()
    edge, dense = pair()
    attn_mask = (~dense_allowed(edge_index, 3, L, L, True, LENGTHS, LENGTHS)).repeat_interleave(
        H, dim=0
    )
    for average in (True, False):
        _, got = edge(x, key_padding_mask=~mask, edge_index=edge_index, need_weights=True,
                      average_attn_weights=average)
        _, want = dense(x, key_padding_mask=~mask, attn_mask=attn_mask, need_weights=True,
                        average_attn_weights=average)
        assert got.is_sparse and got.shape == want.shape
        real = mask if average else mask[:, None].expand(-1, H, -1)
        torch.testing.assert_close(got.to_dense()[real], want[real], atol=1e-10, rtol=1e-10)
    out, w = edge(x[0], edge_index=edge_index[:, :6], need_weights=True)  # unbatched
    assert out.shape == (L, D) and w.shape == (L, L)


def test_matches_transformer_conv_before_out_proj():
    conv_mod = pytest.importorskip("torch_geometric.nn")
    n = 40
    edge_index = unique_edges(torch.randint(0, n, (2, 160)))
    edge_index = edge_index[:, edge_index[0] != edge_index[1]]
    conv = conv_mod.TransformerConv(D, D // H, heads=H, concat=True, root_weight=False,
                                    beta=False).double()
    edge = EdgeAttention(D, H, add_self_loops=False, dtype=torch.float64)
    with torch.no_grad():
        for ours, theirs in ((edge.q_proj, conv.lin_query), (edge.k_proj, conv.lin_key),
                             (edge.v_proj, conv.lin_value)):
            ours.weight.copy_(theirs.weight)
            ours.bias.copy_(theirs.bias)
        edge.out_proj.weight.copy_(torch.eye(D))
        edge.out_proj.bias.zero_()
    x = torch.randn(n, D, dtype=torch.float64)
    for fused in (True, False):
        with fused_attn(fused):
            out, _ = edge(x, edge_index=edge_index)
        torch.testing.assert_close(out, conv(x, edge_index), atol=1e-10, rtol=1e-10)


def test_padding_never_leaks_and_dead_rows_are_zero():
    x, mask, edge_index = graph_batch()
    edge = EdgeAttention(D, H, add_self_loops=False, dtype=x.dtype)
    out, _ = edge(x, key_padding_mask=~mask, edge_index=edge_index)
    poisoned = x.clone()
    poisoned[~mask] = float("nan")
    again, _ = edge(poisoned, key_padding_mask=~mask, edge_index=edge_index)
    torch.testing.assert_close(again[mask], out[mask])
    # node 4 of item 0 has no incoming edge and no self loop
    torch.testing.assert_close(out[0, 4], edge.out_proj.bias)
    poisoned.requires_grad_()
    again, _ = edge(poisoned, key_padding_mask=~mask, edge_index=edge_index)
    (grad,) = torch.autograd.grad(again[mask].sum(), poisoned)
    assert torch.isfinite(grad[mask]).all()


def test_empty_inputs():
    edge = EdgeAttention(D, H)
    empty = torch.empty(2, 0, dtype=torch.long)
    x = torch.randn(2, 3, D, requires_grad=True)
    out, _ = edge(x, edge_index=empty)  # self loops only
    assert out.shape == x.shape
    lonely = EdgeAttention(D, H, add_self_loops=False)
    out, _ = lonely(x, edge_index=empty)  # no edge at all: every output is out_proj.bias
    torch.testing.assert_close(out, lonely.out_proj.bias.expand_as(out).detach())
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    nothing = torch.randn(1, 0, D)
    assert edge(nothing, edge_index=empty)[0].shape == (1, 0, D)


@pytest.mark.parametrize("fused", [True, False])
def test_a_batch_of_zero_gives_an_empty_result(fused):
    # einops raised ZeroDivisionError here; every other layer returns (0, L, D)
    edge = EdgeAttention(D, H, batch_first=False)
    empty = torch.empty(2, 0, dtype=torch.long)
    x = torch.randn(3, 0, D, requires_grad=True)  # (L, B, D), B = 0
    with fused_attn(fused):
        out, weights = edge(x, edge_index=empty, need_weights=True)
        out.sum().backward()
    assert out.shape == (3, 0, D) and weights.shape == (0, 3, 3) and x.grad.shape == x.shape
    want = MultiHeadAttention(D, H, batch_first=False)(x, x, x)[0]
    assert out.shape == want.shape


def test_dropout_on_probabilities():
    x, mask, edge_index = graph_batch()
    edge = EdgeAttention(D, H, dropout=0.5, dtype=x.dtype)
    for fused in (True, False):
        with fused_attn(fused):
            edge.train()
            a = edge(x, key_padding_mask=~mask, edge_index=edge_index)[0]
            b = edge(x, key_padding_mask=~mask, edge_index=edge_index)[0]
            assert not torch.allclose(a[mask], b[mask])
            edge.eval()
            c = edge(x, key_padding_mask=~mask, edge_index=edge_index)[0]
            d = edge(x, key_padding_mask=~mask, edge_index=edge_index)[0]
            torch.testing.assert_close(c, d)


def test_blocks_take_edges_from_meta():
    x, mask, edge_index = graph_batch()
    x = x.float()
    tokens = Tokens(x, mask, {"edge_index": edge_index})
    block = TransformerBlock(D, H, attention="edge")
    out = block(tokens)
    h = block.norm1(tokens.zero_padding())
    want = tokens.zero_padding() + block.attn(h, key_padding_mask=~mask, edge_index=edge_index)[0]
    want = want + block.mlp(block.norm2(want))
    torch.testing.assert_close(out.x[mask], want[mask])
    # packed Tokens: PyG's own layout (row of values())
    offsets = torch.tensor([0, *itertools.accumulate(LENGTHS)])
    item = edge_index // L
    packed = Tokens(x, mask).pack().replace(edge_index=edge_index - item * L + offsets[item])
    torch.testing.assert_close(block(packed).x.values(), out.x[mask], atol=1e-5, rtol=1e-5)
    encoder = Encoder(D, depth=2, num_heads=H, attention="edge")
    torch.testing.assert_close(encoder(packed).x.values(), encoder(tokens).x[mask], atol=1e-5,
                               rtol=1e-5)
    with pytest.raises(ValueError, match=r"meta\['edge_index'\].*GraphNodeSequencer"):
        block(Tokens(x, mask))


def test_half_precision(device):
    x, mask, edge_index = graph_batch()
    ref = EdgeAttention(D, H, device=device)
    want = ref(x.float().to(device), key_padding_mask=~mask.to(device),
               edge_index=edge_index.to(device))[0]
    for dtype in (torch.bfloat16, torch.float16):
        edge = EdgeAttention(D, H, device=device, dtype=dtype)
        edge.load_state_dict(ref.state_dict())
        for fused in (True, False):
            with fused_attn(fused):
                xi = x.to(device, dtype).requires_grad_()
                out = edge(xi, key_padding_mask=~mask.to(device),
                           edge_index=edge_index.to(device))[0]
            assert out.dtype == dtype
            torch.testing.assert_close(out.float()[mask.to(device)],
                                       want[mask.to(device)], atol=5e-2, rtol=5e-2)
            out.float().sum().backward()
            assert xi.grad.dtype == dtype and torch.isfinite(xi.grad.float()).all()


def test_cuda_matches_cpu(device):
    x, mask, edge_index = graph_batch()
    edge = EdgeAttention(D, H, dtype=x.dtype)
    want = edge(x, key_padding_mask=~mask, edge_index=edge_index)[0]
    got = edge.to(device)(x.to(device), key_padding_mask=~mask.to(device),
                          edge_index=edge_index.to(device))[0]
    torch.testing.assert_close(got.cpu()[mask], want[mask])


def test_bad_input_names_the_problem():
    x, mask, edge_index = graph_batch()
    edge = EdgeAttention(D, H, dtype=x.dtype)
    cases = [
        (TypeError, "edge_index must have an integer dtype", dict(edge_index=edge_index.float())),
        (ValueError, r"edge_index must have shape \(2, num_edges\)",
         dict(edge_index=edge_index[:1])),
        (ValueError, r"edge_index must have shape", dict(edge_index=edge_index[..., None])),
        (ValueError, r"edge_index\[0\] .* must lie in \[0, number of key tokens=21\)",
         dict(edge_index=torch.tensor([[21], [0]]))),
        (ValueError, r"edge_index\[1\] .*must lie in \[0", dict(edge_index=torch.tensor([[0],
                                                                                         [-1]]))),
        (ValueError, "same batch item, got edge \\[1, 8\\] from item 0 to item 1",
         dict(edge_index=torch.tensor([[1], [8]]))),
        (ValueError, r"edge_bias must have shape", dict(edge_index=edge_index,
                                                         edge_bias=torch.randn(3, H))),
        (ValueError, "edge_bias needs unique edges", dict(
            edge_index=edge_index, edge_bias=torch.randn(edge_index.shape[1], H,
                                                         dtype=x.dtype))),
        (ValueError, "takes no attn_mask", dict(edge_index=edge_index,
                                                 attn_mask=torch.zeros(L, L, dtype=torch.bool))),
        (ValueError, "takes no is_causal", dict(edge_index=edge_index, is_causal=True)),
        (ValueError, "edge_index must be given", dict(edge_index=None)),
    ]
    for error, match, kwargs in cases:
        with pytest.raises(error, match=match):
            edge(x, key_padding_mask=~mask, **kwargs)
    with pytest.raises(ValueError, match="no cache"):
        edge.make_cache(1, 4)


@pytest.mark.parametrize("flag", ["no", None, 1, torch.tensor(True)])
def test_add_self_loops_must_be_a_bool(flag):
    # "no" was taken as True and None as False
    name = type(flag).__name__
    with pytest.raises(TypeError, match=f"add_self_loops must be a bool, got {name}"):
        EdgeAttention(D, H, add_self_loops=flag)


def test_registry_and_repr():
    from mmattn.registry import build_attention

    module = build_attention("edge", D, H, attention_kwargs={"add_self_loops": False})
    assert isinstance(module, EdgeAttention) and "add_self_loops=False" in repr(module)


def test_pack_and_unpack_carry_the_edges():
    x, mask, edge_index = graph_batch()
    tokens = Tokens(x.float(), mask, {"edge_index": edge_index})
    block = TransformerBlock(D, H, attention="edge")
    want = block(tokens).x[mask]
    packed = tokens.pack()
    torch.testing.assert_close(block(packed).x.values(), want, atol=1e-5, rtol=1e-5)
    back = packed.unpack()
    assert torch.equal(torch.unique(back.meta["edge_index"], dim=1),
                       torch.unique(edge_index, dim=1))
    torch.testing.assert_close(block(back).x[mask], want, atol=1e-5, rtol=1e-5)


def test_float_key_padding_mask_and_from_torch():
    x, mask, edge_index = graph_batch()
    edge = EdgeAttention(D, H, dtype=x.dtype)
    want = edge(x, key_padding_mask=~mask, edge_index=edge_index)[0]
    additive = torch.zeros(mask.shape, dtype=x.dtype).masked_fill(~mask, float("-inf"))
    got = edge(x, key_padding_mask=additive, edge_index=edge_index)[0]
    torch.testing.assert_close(got[mask], want[mask])
    torch_mha = torch.nn.MultiheadAttention(D, H, batch_first=True, dtype=x.dtype)
    copy = EdgeAttention.from_torch(torch_mha, add_self_loops=False)
    assert isinstance(copy, EdgeAttention) and not copy.add_self_loops
    with pytest.raises(NotImplementedError, match="no edges"):
        copy.to_torch()
