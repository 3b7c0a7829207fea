"""Graph, large: node classification on a 20,000-node planted-partition graph with
EdgeAttention, where the dense neighbourhood mask would not fit.

One generated graph: 20,000 nodes in 4 communities (the labels); each node draws 6 edges
inside its community and 2 across, made undirected (average degree ≈ 16). Node features are
the community's centre plus heavy noise, so a node alone is often misread; its neighbours,
mostly of its own community, tell. ``GraphNodeSequencer(packed=True)`` keeps PyG's layout
(``meta["edge_index"]`` is the graph's own edge_index), an ``Encoder(attention="edge")``
attends along the edges, and a linear head classifies every node; 10 % of the labels train,
the rest test. Baseline: the same sequencer and head with an MLP instead of attention,
trained alike. The script also reports the peak memory of one training step beside what
the dense path would need for the same graph (its (H, N, N) mask and (H, N, N) scores).

Run: ``python -m examples.graph_edges``
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from examples._common import Result, Timer, main_for, progress, seed_everything
from mmattn import Encoder

EXAMPLE = "graph_edges"
CLASSES, FEATURES, DIM, HEADS = 4, 16, 32, 4


def planted_partition(num_nodes: int, generator: torch.Generator, inside: int = 6,
                      across: int = 2, noise: float = 2.0):
    """A PyG ``Data``: community labels ``y``, noisy features ``x``, undirected edges."""
    from torch_geometric.data import Data
    from torch_geometric.utils import coalesce, to_undirected

    y = torch.randint(CLASSES, (num_nodes,), generator=generator)
    members = [torch.nonzero(y == c).flatten() for c in range(CLASSES)]
    centres = torch.randn(CLASSES, FEATURES, generator=generator)
    x = centres[y] + noise * torch.randn(num_nodes, FEATURES, generator=generator)
    nodes = torch.arange(num_nodes)
    src = []
    for c, count in ((None, inside), ("other", across)):
        for _ in range(count):
            pick = torch.empty(num_nodes, dtype=torch.long)
            for k in range(CLASSES):
                pool = members[k] if c is None else torch.nonzero(y != k).flatten()
                mine = y == k
                draw = torch.randint(len(pool), (int(mine.sum()),), generator=generator)
                pick[mine] = pool[draw]
            src.append(torch.stack([pick, nodes]))
    edge_index = torch.cat(src, dim=1)
    edge_index = edge_index[:, edge_index[0] != edge_index[1]]
    edge_index = coalesce(to_undirected(edge_index, num_nodes=num_nodes), num_nodes=num_nodes)
    return Data(x=x, y=y, edge_index=edge_index)


class NodeClassifier(nn.Module):
    """GraphNodeSequencer(packed) → Encoder along the edges (or an MLP) → per-node head."""

    def __init__(self, attention: bool, depth: int = 2):
        super().__init__()
        from adapters import GraphNodeSequencer

        self.sequencer = GraphNodeSequencer(FEATURES, DIM)
        self.attention = attention
        if attention:
            self.body = Encoder(DIM, depth, HEADS, mlp_ratio=2.0, attention="edge")
        else:
            self.body = nn.Sequential(*[nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM),
                                                      nn.GELU(), nn.Linear(2 * DIM, DIM))
                                        for _ in range(depth)])
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, data) -> Tensor:
        tokens = self.sequencer(data, packed=True)  # one graph: PyG's own rows and edges
        if self.attention:
            nodes = self.sequencer.to_nodes(self.body(tokens))
        else:
            nodes = self.sequencer.to_nodes(tokens)
            nodes = nodes + self.body(nodes)
        return self.head(nodes)


def peak_bytes(fn) -> int:
    """Peak CPU memory allocated by ``fn()`` (the profiler's allocation trace)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage),
                    key=lambda e: e.time_range.start)
    for event in events:
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def train(model: nn.Module, data, train_mask: Tensor, epochs: int, lr: float, show: bool,
          desc: str) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs,
                                                pct_start=0.2)
    model.train()
    for _ in progress(range(epochs), desc=desc, enabled=show):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(data)[train_mask], data.y[train_mask])
        loss.backward()
        opt.step()
        sched.step()
    model.eval()


def accuracy(model: nn.Module, data, mask: Tensor) -> float:
    with torch.no_grad():
        return float((model(data).argmax(-1)[mask] == data.y[mask]).float().mean())


def run(
    device: torch.device | str = "cpu",
    seed: int = 0,
    quick: bool = False,
    out_dir: Path | None = None,
    show_progress: bool = True,
) -> list[Result]:
    timer = Timer()
    seed_everything(seed)
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    num_nodes, epochs = (2_000, 3) if quick else (20_000, 40)
    data = planted_partition(num_nodes, generator).to(device)
    train_mask = torch.rand(num_nodes, generator=generator).to(device) < 0.1
    test_mask = ~train_mask
    torch.manual_seed(seed)
    model = NodeClassifier(attention=True).to(device)
    torch.manual_seed(seed)
    baseline = NodeClassifier(attention=False).to(device)
    train(model, data, train_mask, epochs, 1e-2, show_progress, "graph: edge attention")
    train(baseline, data, train_mask, epochs, 1e-2, show_progress, "graph: MLP baseline")
    acc, acc_mlp = accuracy(model, data, test_mask), accuracy(baseline, data, test_mask)

    def step() -> None:
        model(data)[train_mask].logsumexp(-1).sum().backward()

    peak = peak_bytes(step) if device.type == "cpu" else float("nan")
    model.zero_grad(set_to_none=True)
    # the dense path per layer: a bool (H, N, N) mask and float32 (H, N, N) scores
    dense = HEADS * num_nodes**2 * (1 + 4)
    edges = data.edge_index.shape[1]
    print(f"planted partition, {num_nodes} nodes, {edges} edges: test accuracy {acc:.3f} "
          f"(MLP without attention {acc_mlp:.3f})")
    print(f"peak memory of one training step: {peak / 2**20:.0f} MiB; the dense "
          f"neighbourhood mask and scores of one layer alone would need "
          f"{dense / 2**30:.1f} GiB ({dense / peak:.0f}x)")
    return [
        Result(EXAMPLE, f"node classes, {num_nodes}-node planted partition", "test accuracy",
               acc, acc_mlp, "MLP without attention", None if quick else 0.8, timer.seconds),
        Result(f"{EXAMPLE}/memory", "one training step", "dense need / edge peak", dense / peak,
               1.0, "edge attention peak", None, timer.seconds),
    ]


main = main_for(EXAMPLE, __doc__.splitlines()[0], run)

if __name__ == "__main__":
    main()
