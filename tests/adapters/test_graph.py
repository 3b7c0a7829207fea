"""GraphNodeSequencer: layout per graph, exact round trip, neighbourhood masks, encodings."""

from __future__ import annotations

from collections import deque

import pytest
import torch
from torch import nn

pyg_data = pytest.importorskip("torch_geometric.data")

from adapters import GraphNodeSequencer, laplacian_eigenvectors, neighbourhood_mask  # noqa: E402

SIZES = (3, 7, 1, 5)


def test_nodes_land_in_their_graph_row_in_order(make_graphs):
    batch = make_graphs(SIZES)
    seq = GraphNodeSequencer(4, 8)
    out = seq(batch)
    assert out.x.shape == (4, 7, 8) and out.mask.dtype == torch.bool
    assert out.lengths.tolist() == list(SIZES)
    start = 0
    for g, n in enumerate(SIZES):
        ref = seq.proj(batch.x[start : start + n])
        torch.testing.assert_close(out.x[g, :n], ref)
        assert torch.equal(out.x[g, n:], torch.zeros(7 - n, 8))
        start += n
    assert out.meta["num_nodes"] == sum(SIZES) and out.meta["num_graphs"] == 4


def test_to_nodes_is_the_exact_inverse(make_graphs):
    batch = make_graphs(SIZES)
    seq = GraphNodeSequencer(4, 8)
    out = seq(batch)
    assert torch.equal(seq.to_nodes(out), seq.proj(batch.x))
    other = out.replace(x=torch.randn(4, 7, 5))  # any width, e.g. after attention blocks
    nodes = seq.to_nodes(other)
    assert nodes.shape == (sum(SIZES), 5)
    dense = torch.cat([other.x[g, :n] for g, n in enumerate(SIZES)])
    assert torch.equal(nodes, dense)


def test_single_data_is_one_graph():
    data = pyg_data.Data(x=torch.randn(6, 4), edge_index=torch.tensor([[0, 1], [1, 2]]))
    seq = GraphNodeSequencer(4, 8)
    out = seq(data)
    assert out.x.shape == (1, 6, 8) and out.mask.all()
    assert torch.equal(seq.to_nodes(out), seq.proj(data.x))
    assert seq.neighbourhood_mask(data).shape == (1, 6, 6)  # node 5 has no edge: still counted


def _k_hop_reference(edge_index, num_nodes, k):
    """allowed[i, j]: a path of <= k edges from j to i (BFS along incoming edges)."""
    incoming = [[] for _ in range(num_nodes)]
    for src, dst in edge_index.t().tolist():
        incoming[dst].append(src)
    allowed = torch.zeros(num_nodes, num_nodes, dtype=torch.bool)
    for i in range(num_nodes):
        seen, queue = {i: 0}, deque([i])
        while queue:
            node = queue.popleft()
            if seen[node] == k:
                continue
            for prev in incoming[node]:
                if prev not in seen:
                    seen[prev] = seen[node] + 1
                    queue.append(prev)
        allowed[i, list(seen)] = True
    return allowed


@pytest.mark.parametrize("num_hops", [1, 2, 3])
def test_neighbourhood_mask_matches_bfs(make_graphs, num_hops):
    batch = make_graphs(SIZES, edges_per_node=1)
    blocked = neighbourhood_mask(batch.edge_index, batch.batch, num_hops)
    assert blocked.shape == (4, 7, 7) and blocked.dtype == torch.bool
    for g, n in enumerate(SIZES):
        graph = batch.get_example(g)
        ref = _k_hop_reference(graph.edge_index, n, num_hops)
        assert torch.equal(~blocked[g, :n, :n], ref)
        assert blocked[g, :n, n:].all()  # real nodes never see padding
        assert torch.equal(~blocked[g, n:, n:], torch.eye(7 - n, dtype=torch.bool))
    assert not blocked.all(dim=-1).any()  # no row is fully masked


def test_directed_edges_flow_source_to_target():
    edge_index = torch.tensor([[0], [1]])  # 0 -> 1: node 1 may attend node 0, not back
    allowed = ~neighbourhood_mask(edge_index, None, 1)
    assert allowed[0].tolist() == [[True, False], [True, True]]


def test_mask_per_head_and_with_torch_multihead_attention(make_graphs):
    batch = make_graphs(SIZES)
    seq = GraphNodeSequencer(4, 8)
    heads = 2
    blocked = seq.neighbourhood_mask(batch, 1, num_heads=heads)
    plain = seq.neighbourhood_mask(batch, 1)
    assert blocked.shape == (4 * heads, 7, 7)
    for index in range(4 * heads):
        assert torch.equal(blocked[index], plain[index // heads])  # batch-major, like nn.MHA

    tokens = seq(batch)
    mha = nn.MultiheadAttention(8, heads, batch_first=True).eval()
    out, _ = mha(tokens.x, tokens.x, tokens.x, attn_mask=blocked)
    for g, n in enumerate(SIZES):
        for i in range(n):
            keys = tokens.x[g : g + 1, ~plain[g, i]]  # the allowed neighbours only
            ref, _ = mha(tokens.x[g : g + 1, i : i + 1], keys, keys)
            torch.testing.assert_close(out[g, i], ref[0, 0], atol=1e-5, rtol=1e-5)


def test_degree_encoding_adds_the_in_degree_row(make_graphs):
    batch = make_graphs(SIZES)
    seq = GraphNodeSequencer(4, 8, structural=("degree",), max_degree=3)
    nodes = seq.to_nodes(seq(batch))
    in_degree = torch.bincount(batch.edge_index[1], minlength=batch.num_nodes).clamp(max=3)
    torch.testing.assert_close(nodes - seq.proj(batch.x), seq.degree_embedding.weight[in_degree])


def test_laplacian_eigenvectors_solve_each_graphs_eigenproblem(make_graphs):
    batch = make_graphs(SIZES)
    k = 3
    vectors = laplacian_eigenvectors(batch.edge_index, batch.batch, k)
    assert vectors.shape == (4, 7, k)
    for g, n in enumerate(SIZES):
        graph = batch.get_example(g)
        adj = torch.zeros(n, n)
        adj[graph.edge_index[0], graph.edge_index[1]] = 1.0
        adj = ((adj + adj.T) > 0).float().fill_diagonal_(0)
        deg = adj.sum(1)
        dinv = torch.where(deg > 0, deg.rsqrt(), torch.zeros_like(deg))
        lap = torch.eye(n) - dinv[:, None] * adj * dinv[None, :]
        expected = torch.linalg.eigvalsh(lap)[1 : k + 1]
        v = vectors[g, :n, : min(k, n - 1)]
        torch.testing.assert_close(lap @ v, v * expected, atol=1e-4, rtol=1e-4)  # L v = lambda v
        torch.testing.assert_close(v.T @ v, torch.eye(v.shape[1]), atol=1e-4, rtol=1e-4)
        assert torch.equal(vectors[g, n:], torch.zeros(7 - n, k))  # padded slots
        assert torch.equal(vectors[g, :n, n - 1 :], torch.zeros(n, k - min(k, n - 1)))


def test_laplacian_of_a_path_with_fixed_signs():
    edge_index = torch.tensor([[0, 1, 1, 2], [1, 0, 2, 1]])
    vectors = laplacian_eigenvectors(edge_index, None, 2)[0]
    s = 0.5**0.5
    expected = torch.tensor([[s, -0.5], [0.0, s], [-s, -0.5]])
    torch.testing.assert_close(vectors, expected, atol=1e-5, rtol=1e-5)


def test_laplacian_encoding_is_added_through_its_projection(make_graphs):
    batch = make_graphs(SIZES)
    seq = GraphNodeSequencer(4, 8, structural="laplacian", num_eigenvectors=2)
    out = seq(batch)
    vectors = laplacian_eigenvectors(batch.edge_index, batch.batch, 2)
    dense = seq.proj(batch.x)
    start = 0
    for g, n in enumerate(SIZES):
        ref = dense[start : start + n] + seq.laplacian_proj(vectors[g, :n])
        torch.testing.assert_close(out.x[g, :n], ref, atol=1e-5, rtol=1e-5)
        start += n


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: pyg_data.Data(edge_index=torch.zeros(2, 0).long()), ValueError, "data.x must"),
        (
            lambda: pyg_data.Data(x=torch.randn(3, 5)),
            ValueError,
            r"in_channels=4 columns.*\(3, 5\)",
        ),
        (lambda: pyg_data.Data(x=torch.randn(3)), ValueError, r"data.x must be a 2-D tensor"),
        (
            lambda: pyg_data.Data(x=torch.ones(3, 4).long()),
            TypeError,
            "data.x must have a floating",
        ),
        (lambda: {"x": torch.randn(3, 4)}, TypeError, "data must be a torch_geometric Data"),
        (
            lambda: pyg_data.Data(x=torch.randn(3, 4), batch=torch.tensor([1, 0, 0])),
            ValueError,
            "data.batch must be sorted",
        ),
        (
            lambda: pyg_data.Data(x=torch.randn(3, 4), edge_index=torch.zeros(3, 2).long()),
            ValueError,
            r"edge_index must have shape \(2, num_edges\)",
        ),
    ],
)
def test_bad_graphs(make, error, match):
    with pytest.raises(error, match=match):
        GraphNodeSequencer(4, 8)(make())


def test_bad_constructor_and_mask_arguments():
    with pytest.raises(ValueError, match="structural must hold names from"):
        GraphNodeSequencer(4, 8, structural=("pagerank",))
    with pytest.raises(ValueError, match="num_hops must be >= 1"):
        neighbourhood_mask(torch.tensor([[0], [1]]), None, 0)
    with pytest.raises(TypeError, match="edge_index must have an integer dtype"):
        neighbourhood_mask(torch.zeros(2, 3), None, 1)


def test_mask_works_as_attn_mask_of_mmattn_attention(make_graphs):
    from mmattn import MultiHeadAttention

    batch = make_graphs(SIZES)
    seq = GraphNodeSequencer(4, 8)
    tokens = seq(batch)
    attn = MultiHeadAttention(8, 2).eval()
    blocked = seq.neighbourhood_mask(batch, 2, num_heads=2)
    out, _ = attn(tokens.x, key_padding_mask=tokens.key_padding_mask, attn_mask=blocked)
    assert torch.isfinite(out).all()  # padded rows (self only, self padded) give no NaN
    plain = seq.neighbourhood_mask(batch, 2)
    nodes = seq.to_nodes(tokens.replace(x=out))
    start = 0
    for g, n in enumerate(SIZES):
        for i in range(n):
            keys = tokens.x[g : g + 1, ~plain[g, i]]
            ref, _ = attn(tokens.x[g : g + 1, i : i + 1], keys)
            torch.testing.assert_close(nodes[start + i], ref[0, 0], atol=1e-5, rtol=1e-5)
        start += n


# ---------------------------------------------------------------- edges in Tokens.meta


def test_meta_edge_index_in_token_coordinates(make_graphs):
    batch = make_graphs(SIZES)
    seq = GraphNodeSequencer(4, 8)
    padded, packed = seq(batch), seq(batch, packed=True)
    nodes = seq.proj(batch.x)
    flat = padded.x.reshape(-1, 8)  # row b * N_max + slot
    for i in range(2):  # sources and targets land on their node's token
        torch.testing.assert_close(flat[padded.meta["edge_index"][i]], nodes[batch.edge_index[i]])
    assert packed.meta["edge_index"] is batch.edge_index  # packed: PyG's own, unchanged
    torch.testing.assert_close(packed.x.values()[packed.meta["edge_index"][0]],
                               nodes[batch.edge_index[0]])


@pytest.mark.parametrize("num_hops", [1, 2])
def test_edge_attention_block_equals_the_dense_neighbourhood_mask(make_graphs, num_hops):
    from mmattn import MultiHeadAttention, TransformerBlock

    batch = make_graphs(SIZES)
    seq = GraphNodeSequencer(4, 8, num_hops=num_hops)
    tokens = seq(batch)
    block = TransformerBlock(8, 2, attention="edge")
    dense = TransformerBlock(8, 2)
    dense.load_state_dict(block.state_dict())
    blocked = seq.neighbourhood_mask(batch, num_hops, num_heads=2)
    want = seq.to_nodes(dense(tokens, attn_mask=blocked))
    torch.testing.assert_close(seq.to_nodes(block(tokens)), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(seq.to_nodes(block(seq(batch, packed=True))), want, atol=1e-5,
                               rtol=1e-5)
    assert isinstance(dense.attn, MultiHeadAttention)


def test_multimodal_encoder_reindexes_graph_edges(make_graphs):
    from mmattn import MultiModalEncoder

    class Vectors(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(3, 8)

        def forward(self, v):
            return __import__("mmattn").Tokens(self.proj(v))

    batch = make_graphs(SIZES)
    encoder = MultiModalEncoder({"vec": Vectors(), "graph": GraphNodeSequencer(4, 8)}, 8, 1, 2,
                                attention="edge")
    vec = torch.randn(4, 3, 3)
    fused = encoder.embed({"vec": vec, "graph": batch})
    graph_tokens = encoder.adapters["graph"](batch)
    flat, src = fused.x.reshape(-1, 8), graph_tokens.x.reshape(-1, 8)
    for i in range(2):
        torch.testing.assert_close(
            flat[fused.meta["edge_index"][i]] - encoder.modality_embedding["graph"],
            src[graph_tokens.meta["edge_index"][i]],
        )
    out = encoder({"vec": vec, "graph": batch})
    assert out.x.shape == fused.x.shape and torch.isfinite(out.x).all()
    # packed: the same numbers on the real tokens
    encoder.adapters["graph"].forward = lambda data, f=encoder.adapters["graph"].forward: f(
        data, packed=True
    )
    encoder.adapters["vec"].forward = lambda v, f=encoder.adapters["vec"].forward: f(v).pack()
    packed = encoder({"vec": vec, "graph": batch})
    torch.testing.assert_close(packed.x.values(), out.x[out.full_mask()], atol=1e-5, rtol=1e-5)


def test_multimodal_encoder_carries_the_edge_bias(make_graphs):
    # MultiModalEncoder re-indexed the parts' edge_index but dropped their edge_bias
    from mmattn import MultiModalEncoder, Tokens

    class Biased(nn.Module):
        """GraphNodeSequencer plus a per-edge bias (Graphormer-style edge encodings)."""

        def __init__(self):
            super().__init__()
            self.seq = GraphNodeSequencer(4, 8)

        def forward(self, data):
            tokens = self.seq(data)
            count = tokens.meta["edge_index"].shape[1]
            bias = torch.linspace(-3.0, 3.0, count * 2).reshape(count, 2)
            return tokens.replace(edge_bias=bias)

    from torch_geometric.utils import coalesce

    batch = make_graphs(SIZES)
    batch.edge_index = coalesce(batch.edge_index)  # a bias needs unique edges
    encoder = MultiModalEncoder({"graph": Biased(), "plain": GraphNodeSequencer(4, 8)}, 8, 1,
                                2, attention="edge")
    inputs = {"graph": batch, "plain": batch}
    fused = encoder.embed(inputs)
    parts = {name: encoder.adapters[name](batch) for name in inputs}
    num_plain = parts["plain"].meta["edge_index"].shape[1]
    want_bias = torch.cat([parts["graph"].meta["edge_bias"], torch.zeros(num_plain, 2)])
    torch.testing.assert_close(fused.meta["edge_bias"], want_bias)
    out = encoder(inputs)
    without = {key: value for key, value in fused.meta.items() if key != "edge_bias"}
    unbiased = encoder.encoder(Tokens(fused.x, fused.mask, without))
    assert not torch.allclose(out.x, unbiased.x)  # the bias reaches the attention
    block = encoder.encoder.blocks[0]
    assert block.geometry(fused.meta)["edge_bias"] is fused.meta["edge_bias"]


def test_num_hops_is_checked():
    with pytest.raises(ValueError, match="num_hops must be >= 1"):
        GraphNodeSequencer(4, 8, num_hops=0)
