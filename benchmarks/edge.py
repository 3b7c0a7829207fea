"""EdgeAttention vs the dense neighbourhood-mask path vs PyG's TransformerConv.

Run: ``.venv/bin/python benchmarks/edge.py`` (``--quick`` for a short smoke run;
torch_geometric is the ``graph`` extra).

One random directed graph per size, N nodes and 16·N distinct edges (average in-degree 16),
D=64, 4 heads (head width 16), fp32 on the CPU with one torch thread, forward + backward
(``out.sum().backward()`` with the node features requiring grad). Contenders:

- ``edge``: :class:`mmattn.EdgeAttention` on the (N, D) node rows (its default,
  memory-lean path; the edge checks, deduplication and sort run inside every call);
- ``dense``: :class:`mmattn.MultiHeadAttention` with the same weights and the (H, N, N)
  ``attn_mask`` that ``adapters.neighbourhood_mask(edge_index, None, 1, num_heads=4)``
  gives, built once outside the timing. Both attend the edges plus a self loop;
- ``pyg``: ``torch_geometric.nn.TransformerConv(64, 16, heads=4, concat=True,
  root_weight=False, beta=False)``, which has no self loops and no output projection;
  against it ``edge`` runs with ``add_self_loops=False`` on the same edges (and keeps its
  output projection, so it does a little more work).

Times are medians of interleaved repeats (benchmarks/_harness.py), process CPU time.
Peak memory is the growth of a fresh child process's peak RSS (VmHWM, reset through
/proc/self/clear_refs) over one fwd+bwd call, measured after a warm-up call on a small graph.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    add_docs_argument,
    child_peak_memory,
    interleaved_samples,
    markdown_table,
    peak_rss_growth,
    print_child_peak,
    write_docs,
)

from mmattn import EdgeAttention, MultiHeadAttention  # noqa: E402

EMBED, HEADS, DEGREE = 64, 4, 16
MIB = 1024**2


def random_graph(n: int, seed: int = 0) -> torch.Tensor:
    """(2, E) distinct directed edges, about DEGREE per node, no self loops."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, n, (int(DEGREE * n * 1.05),), generator=gen)
    dst = torch.randint(0, n, src.shape, generator=gen)
    keep = src != dst
    key = torch.unique(dst[keep] * n + src[keep])[: DEGREE * n]
    return torch.stack([key % n, key // n])


def dense_blocked(edge_index: torch.Tensor, n: int) -> torch.Tensor:
    """(H, N, N), what ``adapters.neighbourhood_mask(edge_index, None, 1, num_heads=H)``
    returns for one graph (True = not allowed), built without torch_geometric."""
    allowed = torch.eye(n, dtype=torch.bool)
    allowed[edge_index[1], edge_index[0]] = True
    return (~allowed).expand(HEADS, n, n).contiguous()


def build(name: str, n: int, edge_index: torch.Tensor):
    """A callable x -> output for a contender (weights shared through one seed)."""
    torch.manual_seed(0)
    if name in ("edge", "edge_noloops"):
        edge = EdgeAttention(EMBED, HEADS, add_self_loops=name == "edge")
        return lambda x, ei=edge_index: edge(x, edge_index=ei)[0]
    if name == "dense":
        dense = MultiHeadAttention(EMBED, HEADS)
        blocked = dense_blocked(edge_index, n)
        return lambda x: dense(x[None], attn_mask=blocked)[0][0]
    if name == "pyg":
        from torch_geometric.nn import TransformerConv

        conv = TransformerConv(EMBED, EMBED // HEADS, heads=HEADS, concat=True,
                               root_weight=False, beta=False)
        return lambda x, ei=edge_index: conv(x, ei)
    raise ValueError(name)


def fwd_bwd(fn, x: torch.Tensor) -> None:
    fn(x).sum().backward()
    x.grad = None


def child(name: str, n: int) -> None:
    """Peak RSS growth of one fwd+bwd call of one contender; print JSON."""

    torch.set_num_threads(1)
    small = random_graph(512, seed=1)
    fwd_bwd(build(name, 512, small), torch.randn(512, EMBED, requires_grad=True))
    edge_index = random_graph(n)
    fn = build(name, n, edge_index)
    x = torch.randn(n, EMBED, requires_grad=True)
    print_child_peak(peak_rss_growth(lambda: fwd_bwd(fn, x)))


def peak_memory(name: str, n: int) -> float | None:
    """MiB of peak RSS growth, measured in a fresh child; None where it failed."""
    peak = child_peak_memory(__file__, [name, str(n)], f"{name} N={n}")
    return None if peak is None else peak / MIB


def measure(names: list[str], n: int, repeats: int) -> dict[str, float]:
    """Median CPU seconds of fwd+bwd for each contender, interleaved."""
    edge_index = random_graph(n)
    x = torch.randn(n, EMBED, requires_grad=True)
    calls = {name: build(name, n, edge_index) for name in names}
    contenders = {name: (lambda fn=fn: fwd_bwd(fn, x)) for name, fn in calls.items()}
    _, cpu = interleaved_samples(contenders, repeats)
    return {name: statistics.median(ts) for name, ts in cpu.items()}


def slope(xs: list[float], ys: list[float]) -> float:
    lx, ly = [math.log(v) for v in xs], [math.log(v) for v in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory children")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    add_docs_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    crossover_sizes = [128, 256, 512, 1024] if args.quick else [128, 256, 512, 1024, 2048]
    dense_size = 1024 if args.quick else 4096
    pyg_sizes = [5000, 10000] if args.quick else [20000, 50000, 100000]
    memory_size = pyg_sizes[-1]
    print(f"# torch {torch.__version__}, 1 thread; D={EMBED} H={HEADS} degree={DEGREE}")

    rows, dense_times, edge_times = [], {}, {}
    for n in [*crossover_sizes, dense_size]:
        t = measure(["edge", "dense"], n, 3 if n >= 2048 else 7)
        dense_times[n], edge_times[n] = t["dense"], t["edge"]
        rows.append([n, DEGREE * n, "edge vs dense", t["edge"] * 1e3, t["dense"] * 1e3,
                     f"{t['dense'] / t['edge']:.1f}× faster", "—"])
        print(f"N={n}: edge {t['edge'] * 1e3:.1f} ms, dense {t['dense'] * 1e3:.1f} ms",
              flush=True)
    crossover = next((n for n in crossover_sizes if edge_times[n] < dense_times[n]), None)

    pyg_ratio, pyg_edge = {}, {}
    for n in pyg_sizes:
        t = measure(["edge_noloops", "pyg"], n, 3)
        pyg_ratio[n], pyg_edge[n] = t["edge_noloops"] / t["pyg"], t["edge_noloops"]
        memory = {}
        if n == memory_size and not args.no_memory:
            memory = {name: peak_memory(name, n) for name in ("edge_noloops", "pyg")}
        mem = ("—" if not memory or None in memory.values() else
               f"{memory['edge_noloops']:.0f} / {memory['pyg']:.0f} MiB = "
               f"{memory['edge_noloops'] / memory['pyg']:.2f}×")
        rows.append([n, DEGREE * n, "edge vs TransformerConv", t["edge_noloops"] * 1e3,
                     t["pyg"] * 1e3, f"{pyg_ratio[n]:.2f}× its time", mem])
        print(f"N={n}: edge {t['edge_noloops']:.2f} s, TransformerConv {t['pyg']:.2f} s, "
              f"memory {mem}", flush=True)

    sizes = [*crossover_sizes[-2:], dense_size]
    exp_sizes = sorted({*sizes, *pyg_sizes})
    times = {**{n: edge_times[n] for n in sizes}, **pyg_edge}
    exponent = slope([DEGREE * n for n in exp_sizes], [times[n] for n in exp_sizes])
    table = markdown_table(
        ["N", "E", "pair", "edge ms", "other ms", "edge speed", "peak growth edge / other"],
        rows,
    )
    summary = [
        f"- speed-up vs the dense neighbourhood-mask path at N={dense_size}: "
        f"{dense_times[dense_size] / edge_times[dense_size]:.1f}× (target ≥ 10×)",
        *(f"- time vs TransformerConv at N={n}: {pyg_ratio[n]:.2f}× (target ≤ 1.0×)"
          for n in pyg_sizes),
        f"- time exponent in E over N={exp_sizes}: {exponent:.2f} (target ≤ 1.1)",
        f"- crossover: EdgeAttention is faster than the dense mask from N = {crossover} "
        f"(degree {DEGREE}; sizes tried {crossover_sizes})",
    ]
    print()
    print(table)
    print("\n".join(summary))
    if args.write_docs:
        write_docs("edge", f"{table}\n\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
