"""Context parallelism for pattern calls on 2 and 4 gloo processes: balance, bytes, memory, time.

Run: ``.venv/bin/python benchmarks/context_parallel.py`` (``--quick`` for L=8192 and one
repeat; ``--write-docs`` puts the table into docs/performance.md).

Masks at L = 32768 (tile 64, batch 1):

- ``documents``: packed documents of random lengths 128..1024, causal inside each
  (``P.same("documents") & P.causal()``);
- ``per-modality``: text 1024 (causal) | image 128 x 128 (neighbourhood 7) | audio 15360
  (window 32), text <-> everything across;
- ``causal``: one causal text.

On each mask three dispatches of the query tiles, all run through the same exchange
(``build_plan(mask, P, rank, owner)``): **mmattn** (balanced by tile work,
:mod:`mmattn.distributed._dispatch`), **contiguous** (P equal shards of the sequence) and
**zig-zag** (2P equal chunks, rank r holds chunks r and 2P - 1 - r: torch context parallel's
head-tail order). Per rank, one ``MultiHeadAttention(64, 4)`` layer (fp32, one torch thread
per process) under :class:`mmattn.distributed.ContextParallel`:

- tile work: non-empty tiles of its query tiles; the table gives max / mean over ranks;
- key/value rows and bytes received and sent per layer (the most of any rank), beside what
  an all-gather of keys and values (torch CP's flex path) would bring every rank;
- process CPU time of one forward + backward (median over repeats; the slowest rank, and
  its ratio to the mean rank), and the single process on the whole sequence beside it (CPU
  time, so ranks that share a core are measured as if each had its own);
- peak memory: the growth of the process's peak RSS (VmHWM, reset through
  /proc/self/clear_refs) over one step after a warm-up step (the most of any rank).
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _harness import (  # noqa: E402
    add_docs_argument,
    markdown_table,
    proc_status,
    spawn_ranks,
    write_docs,
)

from mmattn import Tokens  # noqa: E402
from mmattn import patterns as P  # noqa: E402

LENGTH, BLOCK, EMBED, HEADS = 32768, 64, 64, 4
MIB = 1024**2
DISPATCHES = ("mmattn", "contiguous", "zig-zag")


# --- the masks and the dispatches to compare ------------------------------------------------


def masks(length: int) -> dict[str, tuple[Tokens, P.Pattern]]:
    """name -> (Tokens, pattern) at this length (x random, fp32, width EMBED)."""
    gen = torch.Generator().manual_seed(0)
    lengths, total = [], 0
    while total < length:
        lengths.append(int(torch.randint(128, 1025, (1,), generator=gen)))
        total += lengths[-1]
    docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:length]
    x = torch.randn(1, length, EMBED, generator=gen)
    side = int((length // 2) ** 0.5)
    text = length // 32
    fused = Tokens.cat({
        "text": Tokens(x[:, :text]),
        "image": Tokens(x[:, text:text + side * side], meta={"grid": (side, side)}),
        "audio": Tokens(x[:, text + side * side:]),
    })
    per_modality = P.per_modality(
        within={"text": P.causal(), "image": P.neighborhood(7), "audio": P.window(32)},
        across=P.modality(query="text") | P.modality(key="text"),
    )
    return {
        "documents": (Tokens(x, meta={"documents": docs[None]}),
                      P.same("documents") & P.causal()),
        "per-modality": (fused, per_modality),
        "causal": (Tokens(x), P.causal()),
    }


def _chunks(mask, parts: int) -> torch.Tensor:
    """(B n,) the chunk (0 .. parts - 1) of each query tile: ``parts`` equal runs per item."""
    n = mask.tiles_per_axis
    chunk = torch.arange(n) * parts // n
    return chunk.repeat(mask.batch)


def contiguous(mask, ranks: int) -> torch.Tensor:
    """The owner of each query tile when each item is cut into ``ranks`` equal shards."""
    return _chunks(mask, ranks)


def zigzag(mask, ranks: int) -> torch.Tensor:
    """torch CP's head-tail order: 2P equal chunks, rank r holds chunks r and 2P - 1 - r."""
    chunk = _chunks(mask, 2 * ranks)
    return torch.where(chunk < ranks, chunk, 2 * ranks - 1 - chunk)


# --- one process of a launch ----------------------------------------------------------------


def _measure(step, repeats: int) -> tuple[list[float], list[float], int]:
    """(cpu seconds, wall seconds, peak RSS growth) of ``step`` after a warm-up call."""
    step()
    Path("/proc/self/clear_refs").write_text("5")
    base = proc_status("VmRSS")
    first = step()
    peak = proc_status("VmHWM") - base
    runs = [first] + [step() for _ in range(repeats - 1)]
    return [r[0] for r in runs], [r[1] for r in runs], peak


def _step(module, x: torch.Tensor, attn_mask, sync):
    """One forward + backward of ``module(x, attn_mask=...)``: (process CPU s, wall s), the
    wall time from one ``sync()`` to the next (the slowest rank's)."""
    def step() -> tuple[float, float]:
        sync()
        start, wall = time.process_time(), time.perf_counter()
        out, _ = module(x, attn_mask=attn_mask)
        out.sum().backward()
        cpu = time.process_time() - start
        sync()
        return cpu, time.perf_counter() - wall

    return step


def _worker(rank: int, world: int, port: int, length: int, repeats: int, out: str) -> None:
    import torch.distributed as dist

    from mmattn import MultiHeadAttention
    from mmattn.distributed import ContextParallel, context_plan
    from mmattn.distributed.context_plan import build_plan

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = []
    for name, (tokens, pattern) in masks(length).items():
        mask = pattern.compile(tokens, block_size=BLOCK)
        torch.manual_seed(0)
        attn = MultiHeadAttention(EMBED, HEADS)
        single = None
        if rank == 0:  # one process on the whole sequence, the others wait
            whole = _step(attn, tokens.x.detach().requires_grad_(), mask, lambda: None)
            single = statistics.median(_measure(whole, repeats)[0])
        dist.barrier()
        for dispatch in DISPATCHES:
            start = time.perf_counter()
            if dispatch == "mmattn":
                plan = context_plan(mask)
            else:
                owner = (contiguous if dispatch == "contiguous" else zigzag)(mask, world)
                plan = build_plan(mask, world, rank, owner)
            planning = time.perf_counter() - start
            step = _step(ContextParallel(attn), plan.scatter(tokens.x).requires_grad_(), plan,
                         dist.barrier)
            cpu, wall, peak = _measure(step, repeats)
            results.append({
                "mask": name, "dispatch": dispatch, "rank": rank, "single": single,
                "cpu": statistics.median(cpu), "wall": statistics.median(wall), "peak": peak,
                "work": plan.work.tolist(), "recv": plan.recv_rows, "sent": plan.send_rows,
                "rows": int(plan.rows.shape[0]), "plan": planning,
                "tiles": mask.nonempty_blocks, "length": mask.length * mask.batch,
            })
    every = [None] * world
    dist.all_gather_object(every, results)
    if rank == 0:
        Path(out).write_text(json.dumps([r for part in every for r in part]))
    dist.destroy_process_group()


def table_rows(results: list[dict], world: int) -> list[list[object]]:
    """One row per (mask, dispatch) of a launch."""
    row_bytes = 2 * EMBED * 4  # a key and a value row, fp32
    rows = []
    keys = dict.fromkeys((r["mask"], r["dispatch"]) for r in results)
    for mask, dispatch in keys:
        ranks = [r for r in results if (r["mask"], r["dispatch"]) == (mask, dispatch)]
        first = ranks[0]
        work = first["work"]
        spread = max(work) * len(work) / sum(work)
        cpu = [r["cpu"] for r in ranks]
        single = next(r["single"] for r in results if r["mask"] == mask and r["single"])
        gathered = (first["length"] - min(r["rows"] for r in ranks)) * row_bytes / MIB
        rows.append([
            mask, world, dispatch, f"{spread:.3f}", max(first["recv"]),
            f"{max(first['recv']) * row_bytes / MIB:.2f}",
            f"{max(first['sent']) * row_bytes / MIB:.2f}", f"{gathered:.2f}",
            f"{max(cpu) * 1e3:.0f}", f"{max(cpu) * len(cpu) / sum(cpu):.2f}",
            f"{max(cpu) / single:.2f}", f"{max(r['peak'] for r in ranks) / MIB:.0f}",
            f"{max(r['plan'] for r in ranks) * 1e3:.0f}",
        ])
    return rows


HEADER = ["mask", "P", "dispatch", "work max/mean", "kv rows recv (max rank)",
          "MiB recv / layer", "MiB sent / layer", "all-gather MiB", "CPU ms (slowest rank)",
          "CPU max/mean", "× 1 process CPU", "peak MiB", "plan ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="L=8192, one repeat")
    parser.add_argument("--length", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    add_docs_argument(parser)
    args = parser.parse_args()
    length = args.length or (8192 if args.quick else LENGTH)
    repeats = args.repeats or (1 if args.quick else 3)
    rows = []
    for world in args.procs:
        rows += table_rows(spawn_ranks(_worker, world, (length, repeats), 3600), world)
        print(markdown_table(HEADER, rows[-len(DISPATCHES) * 3:]), flush=True)
    table = markdown_table(HEADER, rows)
    print()
    print(table)
    if args.write_docs:
        write_docs("context_parallel", table)


if __name__ == "__main__":
    main()
