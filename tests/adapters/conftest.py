"""Fixtures shared by the adapter tests: small random graphs, clips and images."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def make_graphs():
    """Factory: a torch_geometric Batch of random graphs with the given node counts."""
    pyg_data = pytest.importorskip("torch_geometric.data")

    def make(sizes=(3, 7, 1, 5), in_channels=4, edges_per_node=2, seed=0):
        gen = torch.Generator().manual_seed(seed)
        graphs = []
        for n in sizes:
            e = edges_per_node * n
            src = torch.randint(0, n, (e,), generator=gen)
            dst = torch.randint(0, n, (e,), generator=gen)
            edge_index = torch.stack([torch.cat([src, dst]), torch.cat([dst, src])])  # undirected
            graphs.append(
                pyg_data.Data(x=torch.randn(n, in_channels, generator=gen), edge_index=edge_index)
            )
        return pyg_data.Batch.from_data_list(graphs)

    return make


@pytest.fixture
def clips():
    """Factory: (waveform (B, T) zero-padded, lengths (B,)) of random clips."""

    def make(lengths=(1600, 1000, 1337), seed=0):
        gen = torch.Generator().manual_seed(seed)
        total = max(lengths)
        wave = torch.zeros(len(lengths), total)
        for i, n in enumerate(lengths):
            wave[i, :n] = torch.randn(n, generator=gen)
        return wave, torch.tensor(lengths)

    return make
