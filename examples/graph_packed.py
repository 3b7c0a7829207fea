"""Graph, packed: the SBM graph classification of graph_sbm.py straight from PyG batches.

Same task, data, model and training as ``examples/graph_sbm.py`` (2 vs 3 communities in
stochastic-block-model graphs of 12–30 nodes), but the node tokens never get padded:
``GraphNodeSequencer(batch, packed=True)`` views PyG's own ``x`` (N_total, D) and ``ptr`` as a
jagged batch, the ``Encoder`` attends within each graph (a token never sees another graph,
by construction rather than by a mask), and ``masked_mean`` pools per graph with a segment
sum. The padded model of graph_sbm.py (its 1-hop neighbourhood mask over padded node
tokens) is trained alongside on the same batches as the baseline; both accuracies and the
seconds per epoch of each are reported. ``PackedGraphClassifier(hops=1)`` applies the same
neighbourhood mask to the packed batch (each graph's corner of it) and computes exactly the
padded model.

Run: ``python -m examples.graph_packed``
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import Tensor, nn

from adapters import GraphNodeSequencer
from examples._common import Result, Timer, main_for, progress, seed_everything
from examples.graph_sbm import GraphClassifier, graph_accuracy, sbm_dataset
from mmattn import Encoder, masked_mean

EXAMPLE = "graph_packed"


class PackedGraphClassifier(nn.Module):
    """GraphNodeSequencer(packed=True) → Encoder on packed tokens → per-graph mean → head.

    ``hops=None`` (default): full attention within each graph; ``hops=k``: attention along
    the k-hop neighbourhood, as in graph_sbm.py.
    """

    def __init__(self, in_channels: int, classes: int, dim: int = 48, depth: int = 2,
                 heads: int = 4, hops: int | None = None):
        super().__init__()
        self.hops = hops
        self.sequencer = GraphNodeSequencer(in_channels, dim, structural=("degree", "laplacian"),
                                            num_eigenvectors=6)
        self.encoder = Encoder(dim, depth, heads, mlp_ratio=2.0)
        self.head = nn.Linear(dim, classes)

    def forward(self, batch) -> Tensor:
        tokens = self.sequencer(batch, packed=True)  # jagged (graphs, nodes*, dim): PyG's layout
        mask = None
        if self.hops is not None:  # (graphs, n_max, n_max): each graph's own top-left corner
            mask = self.sequencer.neighbourhood_mask(batch, self.hops)
        return self.head(masked_mean(self.encoder(tokens, attn_mask=mask)))


def train_both(models: dict[str, nn.Module], graphs, epochs: int, batch_size: int, lr: float,
               show: bool, generator: torch.Generator) -> dict[str, float]:
    """Train each model on the same batches.

    Returns each one's median seconds per epoch: ``name`` for the whole training step and
    ``name/model`` for its forward and backward only (the optimizer step costs both alike).
    """
    from torch_geometric.data import Batch

    opts = {k: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.01)
            for k, m in models.items()}
    steps = epochs * ((len(graphs) + batch_size - 1) // batch_size)
    scheds = {k: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=lr, total_steps=steps,
                                                     pct_start=0.15) for k, o in opts.items()}
    device = next(iter(models.values())).head.weight.device
    seconds: dict[str, list[float]] = {k: [] for k in models}
    seconds.update({f"{k}/model": [] for k in models})
    for model in models.values():
        model.train()
    for _ in progress(range(epochs), desc="graph: packed vs padded", enabled=show):
        order = torch.randperm(len(graphs), generator=generator)
        spent = dict.fromkeys(seconds, 0.0)
        for start in range(0, len(graphs), batch_size):
            batch = Batch.from_data_list([graphs[i] for i in order[start : start + batch_size]])
            batch = batch.to(device)
            for name, model in models.items():  # interleaved: the same load on both
                begin = time.perf_counter()
                opts[name].zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(model(batch), batch.y)
                loss.backward()
                spent[f"{name}/model"] += time.perf_counter() - begin
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opts[name].step()
                scheds[name].step()
                spent[name] += time.perf_counter() - begin
        for name in seconds:
            seconds[name].append(spent[name])
    for model in models.values():
        model.eval()
    return {k: sorted(v)[len(v) // 2] for k, v in seconds.items()}


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
    n_train, n_test, epochs = (64, 64, 2) if quick else (1200, 400, 20)
    train = sbm_dataset(n_train, generator)
    test = sbm_dataset(n_test, generator)
    torch.manual_seed(seed)
    padded = GraphClassifier(1, 2).to(device)
    torch.manual_seed(seed)
    packed = PackedGraphClassifier(1, 2).to(device)
    per_epoch = train_both({"packed": packed, "padded": padded}, train, epochs, 32, 3e-3,
                           show_progress, generator)
    acc, acc_padded = graph_accuracy(packed, test, device), graph_accuracy(padded, test, device)
    speedup = per_epoch["padded"] / per_epoch["packed"]
    model_speedup = per_epoch["padded/model"] / per_epoch["packed/model"]
    print(f"SBM 2 vs 3 communities, packed: held-out accuracy {acc:.3f} "
          f"(padded graph_sbm model {acc_padded:.3f}) on {n_test} graphs")
    print(f"seconds per epoch (median, training): packed {per_epoch['packed']:.2f}, "
          f"padded {per_epoch['padded']:.2f} ({speedup:.2f}x); forward + backward only: "
          f"packed {per_epoch['packed/model']:.2f}, padded {per_epoch['padded/model']:.2f} "
          f"({model_speedup:.2f}x)")
    return [
        Result(EXAMPLE, "SBM graphs, packed from PyG batches", "test accuracy", acc,
               acc_padded, "padded graph_sbm model", 0.90, timer.seconds),
        Result(f"{EXAMPLE}/speed", "training seconds per epoch", "padded / packed time",
               speedup, 1.0, "padded graph_sbm model", None, timer.seconds),
    ]


main = main_for(EXAMPLE, __doc__.splitlines()[0], run)

if __name__ == "__main__":
    main()
