"""Sequence-parallel LocalAttention over 1, 2 and 4 processes: time and peak memory per rank.

Run: ``.venv/bin/python benchmarks/seqpar.py`` (``--quick`` for a smoke run;
``--write-docs`` puts the table into docs/performance.md, as ``make bench`` does).

L=65536, D=512, H=8, window 128, B=1, fp32, forward + backward of
``mmattn.distributed.SequenceParallel(LocalAttention(...))`` on gloo (CPU). Each of P
processes holds L/P positions and gets ``cpu_count // P`` threads (at least 1: with more
processes than cores they share cores, which the table says). Time: median over repeats
of the slowest rank's step (a barrier starts each step). Peak memory: the growth of each
process's peak RSS (VmHWM, reset through /proc/self/clear_refs) over one step, after a
warm-up step — everything the step allocates, projections included.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    add_docs_argument,
    markdown_table,
    proc_status,
    spawn_ranks,
    write_docs,
)

EMBED, HEADS, WINDOW = 512, 8, 128
GIB = 1024**3


def _worker(rank: int, world: int, port: int, length: int, repeats: int, out: str) -> None:
    import torch.distributed as dist

    from mmattn import LocalAttention
    from mmattn.distributed import SequenceParallel

    threads = max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    attn = LocalAttention(EMBED, HEADS, window_size=WINDOW)
    sp = SequenceParallel(attn)
    shard = torch.randn(1, length // world, EMBED, requires_grad=True)

    def step() -> float:
        dist.barrier()
        start = time.perf_counter()
        out, _ = sp(shard)
        out.sum().backward()
        dist.barrier()
        return time.perf_counter() - start

    step()  # warm-up
    shard.grad = None
    attn.zero_grad(set_to_none=True)
    Path("/proc/self/clear_refs").write_text("5")
    base = proc_status("VmRSS")
    times = [step()]
    peak = proc_status("VmHWM") - base
    times += [step() for _ in range(repeats - 1)]
    result = {"rank": rank, "times": times, "peak": peak, "threads": threads}
    every = [None] * world
    dist.all_gather_object(every, result)
    if rank == 0:
        Path(out).write_text(json.dumps(every))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="L=8192, P in {1, 2}, 2 repeats")
    parser.add_argument("--length", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--procs", type=int, nargs="+", default=None)
    add_docs_argument(parser)
    args = parser.parse_args()
    length = args.length or (8192 if args.quick else 65536)
    repeats = args.repeats or (2 if args.quick else 3)
    worlds = args.procs or ([1, 2] if args.quick else [1, 2, 4])
    cores = os.cpu_count() or 1
    rows, base = [], None
    for world in worlds:
        ranks = spawn_ranks(_worker, world, (length, repeats), timeout=1800)
        steps = [max(r["times"][i] for r in ranks) for i in range(repeats)]
        seconds = statistics.median(steps)
        peak = max(r["peak"] for r in ranks) / GIB
        base = base or (seconds, peak)
        shared = " (shares cores)" if world > cores else ""
        rows.append([
            world, length // world, f"{ranks[0]['threads']}{shared}", seconds,
            seconds / base[0], f"{peak:.3f}", f"{peak / base[1]:.2f}",
        ])
        print(f"P={world}: {seconds:.2f} s per step, peak growth per rank {peak:.3f} GiB",
              flush=True)
    table = markdown_table(
        ["P", "positions per rank", "threads per rank", "fwd+bwd s", "× P=1 time",
         "peak growth GiB per rank", "× P=1 memory"],
        rows,
    )
    print()
    print(table)
    if args.write_docs:
        write_docs("seqpar", table)


if __name__ == "__main__":
    main()
