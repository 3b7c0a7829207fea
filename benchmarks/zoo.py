"""Swapped vs stock models: torchvision's ``swin_t`` after ``mmattn.replace_attention``, CPU.

Forward + backward of one 224 x 224 image batch through torchvision's ``swin_t`` (random
init, fp32, one torch thread, train mode with stochastic depth off so both runs do the same
work), stock and after :func:`mmattn.replace_attention` (a deep copy, same weights). The
contenders run interleaved (benchmarks/_harness.py); we report medians of process CPU time
(the steadier measure on a shared machine) and of wall time, and the peak RSS growth of one
step of each in a fresh child process.

    python benchmarks/zoo.py --write-docs   # the table, into docs/performance.md
    python benchmarks/zoo.py --quick        # 112 x 112, fewer repeats, prints only
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mmattn  # noqa: E402
from benchmarks._harness import (  # noqa: E402
    add_docs_argument,
    child_peak_memory,
    interleaved_samples,
    markdown_table,
    print_child_peak,
    write_docs,
)

TARGET = 1.05


def models(name: str) -> dict[str, torch.nn.Module]:
    import torchvision

    torch.manual_seed(0)
    stock = getattr(torchvision.models, name)().train()
    for module in stock.modules():  # stochastic depth draws per call: off, same work
        if type(module).__name__ == "StochasticDepth":
            module.p = 0.0
    ours = copy.deepcopy(stock)
    count = mmattn.replace_attention(ours)
    assert count == 12, count
    return {"stock": stock, "mmattn": ours}


def step(model: torch.nn.Module, images: torch.Tensor):
    def run() -> None:
        model(images).square().mean().backward()
        model.zero_grad(set_to_none=True)

    return run


def child(name: str, who: str, size: int, batch: int) -> None:
    """One step of one contender; prints its peak RSS growth (see _harness)."""
    from benchmarks._harness import peak_rss_growth

    torch.set_num_threads(1)
    model = models(name)[who]
    images = torch.randn(batch, 3, size, size)
    step(model, images)()  # warm-up: allocator and first-call costs out of the peak
    print_child_peak(peak_rss_growth(step(model, images)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="112 px, 3 repeats")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--child", nargs=4, metavar=("NAME", "WHO", "SIZE", "BATCH"))
    add_docs_argument(parser)
    args = parser.parse_args()
    if args.child:
        name, who, size, batch = args.child
        child(name, who, int(size), int(batch))
        return
    torch.set_num_threads(1)
    size, repeats = (112, 3) if args.quick else (224, args.repeats)
    images = torch.randn(args.batch, 3, size, size)
    rows = []
    for name in ("swin_t",):
        contenders = models(name)
        runs = {who: step(model, images) for who, model in contenders.items()}
        wall_runs, cpu_runs = interleaved_samples(runs, repeats=repeats, warmup=1)
        cpu = {n: statistics.median(ts) for n, ts in cpu_runs.items()}
        wall = {n: statistics.median(ts) for n, ts in wall_runs.items()}
        peaks = {
            who: child_peak_memory(__file__, [name, who, str(size), str(args.batch)], who)
            for who in contenders
        }
        for who in contenders:
            peak = peaks[who]
            rows.append([name, who, round(cpu[who] * 1e3), round(wall[who] * 1e3),
                         "" if peak is None else f"{peak / 2**20:.0f}", ""])
        ratio = cpu["mmattn"] / cpu["stock"]
        verdict = "met" if ratio <= TARGET else "NOT met"
        rows.append([name, "mmattn / stock", "", "", "",
                     f"{ratio:.3f}x (wall {wall['mmattn'] / wall['stock']:.3f}x); "
                     f"target <= {TARGET}x: {verdict}"])
        print(name, {n: f"{t * 1e3:.0f} ms" for n, t in cpu.items()}, f"{ratio:.3f}x")
    table = markdown_table(
        ["model", "contender (fwd+bwd)", "CPU ms", "wall ms", "peak RSS MiB", "ratio (CPU time)"],
        rows,
    )
    facts = (
        f"torchvision swin_t, random init, train mode (stochastic depth off), batch "
        f"{args.batch} at {size} x {size}, fp32; {repeats} interleaved repeats, medians; "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread; machine load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the end (wall time counts the "
        "other processes, CPU time hardly)."
    )
    print(facts)
    print(table)
    if args.write_docs:
        write_docs("zoo", f"{facts}\n\n{table}")


if __name__ == "__main__":
    main()
