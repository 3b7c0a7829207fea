"""Attention patterns on the block-sparse kernel vs the dense mask and FlexAttention, CPU.

Run: ``.venv/bin/python benchmarks/patterns.py`` (``--quick`` for a short smoke run,
``--write-docs`` to write the table into docs/performance.md).

fp32, one torch thread, D = 64, 4 heads of width 16, batch 1. Measures (issue 26):

- ``documents``: 16 documents of 512 tokens in one row of L = 8192, causal inside each
  (``P.same("documents") & P.causal()``), forward + backward of ``MultiHeadAttention`` with
  the compiled SparseMask against the same module with the (H, L, L) dense ``attn_mask``
  (built outside the timing), and the peak memory of both;
- ``forward vs flex``: the same pattern, forward only (no_grad), the block-sparse kernel on
  the compiled mask against ``torch.compile(flex_attention)`` with
  ``create_block_mask(pattern.mask_mod(tokens), ...)`` (its default 128 block), both on the
  same head-split q, k, v (in the layout a projection gives) and both with their masks
  built outside the timing;
- ``per-modality``: text 512 (causal) | image 64 x 64 (neighbourhood k = 7) | audio 2048
  (window 32), text <-> everything full across, fwd + bwd against the dense mask;
- ``exponent``: documents of 512, L = 2k ... 16k, fwd + bwd of the SparseMask run, the
  slope of log time over log L;
- ``compile``: ``pattern.compile(tokens)`` at L = 32768 (64 documents, causal), and the
  kernel's one-off bucket plan beside it;
- ``--video`` (its own table, issue 42): video tokens on the grid (8, 32, 32) (L = 8192, the
  ``meta`` a VideoPatcher writes: ``grid`` and ``frames``), ``Encoder(pattern=
  P.causal(by="frames") & P.neighborhood((3, 7, 7), causal=(True, False, False)))`` (one
  block; the pattern compiled in every forward) against the same encoder with the pattern's
  dense (H, L, L) ``attn_mask`` (built outside the timing), fwd + bwd, and the peak memory
  of both (measured with glibc's mmap threshold fixed at 128 KiB in the children, as
  benchmarks/neighborhood_video.py explains).

Times are medians of interleaved repeats of process CPU time (benchmarks/_harness.py); the
machine is shared, so the load average is printed beside them. Peak memory is the growth
of a fresh child process's peak RSS over one fwd + bwd call, after a warm-up call.
"""

from __future__ import annotations

import argparse
import math
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
    child_peak_memory,
    interleaved_samples,
    markdown_table,
    peak_rss_growth,
    print_child_peak,
    write_docs,
)

from mmattn import MultiHeadAttention, Tokens  # noqa: E402
from mmattn import patterns as P  # noqa: E402
from mmattn.kernels import block_sparse  # noqa: E402

EMBED, HEADS, HEAD = 64, 4, 16
MIB = 1024**2
DOCUMENTS = P.same("documents") & P.causal()


def documents(length: int, size: int = 512) -> Tokens:
    x = torch.randn(1, length, EMBED)
    return Tokens(x, meta={"documents": (torch.arange(length) // size)[None]})


def fused(text: int = 512, side: int = 64, audio: int = 2048) -> Tokens:
    parts = {"text": Tokens(torch.randn(1, text, EMBED)),
             "image": Tokens(torch.randn(1, side * side, EMBED), meta={"grid": (side, side)}),
             "audio": Tokens(torch.randn(1, audio, EMBED))}
    return Tokens.cat(parts)


PER_MODALITY = P.per_modality(
    within={"text": P.causal(), "image": P.neighborhood(7), "audio": P.window(32)},
    across=P.modality(query="text") | P.modality(key="text"),
)


def step(module, x, attn_mask):
    """One forward + backward, the input requiring grad."""
    def run():
        xi = x.detach().requires_grad_()
        out, _ = module(xi, attn_mask=attn_mask)
        out.sum().backward()
    return run


def contenders(tokens: Tokens, pattern) -> dict:
    torch.manual_seed(0)
    module = MultiHeadAttention(EMBED, HEADS)
    mask = pattern.compile(tokens)
    dense = (~pattern.dense(tokens)).repeat_interleave(HEADS, 0)
    return {"sparse": step(module, tokens.x, mask), "dense": step(module, tokens.x, dense)}


def medians(runs: dict, repeats: int) -> dict:
    _, cpu = interleaved_samples(runs, repeats)
    return {name: statistics.median(ts) for name, ts in cpu.items()}


def flex_forward(tokens: Tokens, pattern, repeats: int) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    length = tokens.length
    # the layout a projection and a head split give: (b, l, h, e) memory, seen as (b, h, l, e)
    q, k, v = (torch.randn(1, length, HEADS, HEAD).transpose(1, 2) for _ in range(3))
    block_mask = create_block_mask(pattern.mask_mod(tokens), 1, None, length, length,
                                   device="cpu")
    flex = torch.compile(flex_attention)
    plan = pattern.compile(tokens).plan(EMBED)

    def ours():
        with torch.no_grad():
            block_sparse.attend(q, k, v, plan)

    def theirs():
        with torch.no_grad():
            flex(q, k, v, block_mask=block_mask)

    with torch.no_grad():
        torch.testing.assert_close(flex(q, k, v, block_mask=block_mask),
                                   block_sparse.attend(q, k, v, plan)[0], atol=1e-4, rtol=1e-4)
    return medians({"sparse": ours, "flex": theirs}, repeats)


def compile_times(length: int, repeats: int) -> tuple[float, float]:
    tokens = documents(length)
    DOCUMENTS.compile(tokens)  # warm-up
    times, plans = [], []
    for _ in range(repeats):
        start = time.process_time()
        mask = DOCUMENTS.compile(tokens)
        times.append(time.process_time() - start)
        start = time.process_time()
        mask.plan(EMBED)
        plans.append(time.process_time() - start)
    return statistics.median(times), statistics.median(plans)


VIDEO = P.causal(by="frames") & P.neighborhood((3, 7, 7), causal=(True, False, False))


def video(frames: int = 8, side: int = 32) -> Tokens:
    """Video tokens as VideoPatcher lays them out: (t, h, w) row-major, frame ids."""
    length = frames * side * side
    ids = (torch.arange(length) // (side * side))[None]
    return Tokens(torch.randn(1, length, EMBED), meta={"grid": (frames, side, side),
                                                       "frames": ids})


def encoders(tokens: Tokens) -> dict:
    """fwd + bwd of Encoder(pattern=VIDEO) and of the same encoder with the dense mask."""
    from mmattn import Encoder

    torch.manual_seed(0)
    sparse = Encoder(EMBED, 1, HEADS, pattern=VIDEO)
    dense = Encoder(EMBED, 1, HEADS)
    dense.load_state_dict(sparse.state_dict())
    hidden = (~VIDEO.dense(tokens)).repeat_interleave(HEADS, 0)

    def step(encoder, mask):
        def run():
            encoder(tokens.replace(tokens.x.detach().requires_grad_()),
                    attn_mask=mask).x.sum().backward()
        return run

    return {"sparse": step(sparse, None), "dense": step(dense, hidden)}


def video_main(quick: bool, write: bool) -> None:
    before = load()
    tokens = video(4 if quick else 8)
    times = medians(encoders(tokens), 2 if quick else 5)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)  # as benchmarks/neighborhood_video
    memory = {name: child_peak_memory(__file__, [f"video-{name}", str(tokens.length)], name)
              for name in ("sparse", "dense")}
    del os.environ["MALLOC_MMAP_THRESHOLD_"]
    density = VIDEO.compile(tokens).density
    speed = times["dense"] / times["sparse"]
    rows = [[f"video {tokens.meta['grid']}, L={tokens.length}, Encoder fwd+bwd",
             "pattern= vs dense mask", times["sparse"] * 1e3, times["dense"] * 1e3,
             f"{speed:.1f}x faster", f"{density:.3f}"]]
    lines = [f"- `P.causal(by=\"frames\") & P.neighborhood((3, 7, 7), causal=(True, False, "
             f"False))` through `Encoder(pattern=)` vs the dense mask: **{speed:.1f}x** "
             "(target >= 8x)"]
    if all(memory.values()):
        lines.append(f"- peak memory growth: {memory['sparse'] / MIB:.0f} MiB vs "
                     f"{memory['dense'] / MIB:.0f} MiB")
    lines.append(f"- machine load average before / after: {before} / {load()}")
    body = markdown_table(["case", "contenders", "ours ms", "other ms", "ratio", "density"],
                          rows) + "\n\n" + "\n".join(lines)
    print(body)
    if write and not quick:
        write_docs("patterns-video", body)


def child(case: str, length: int) -> None:
    torch.set_num_threads(1)
    if case.startswith("video"):
        run = encoders(video(length // 1024))[case.split("-")[1]]
        run()  # warm-up (the plan is built here)
        print_child_peak(peak_rss_growth(run))
        return
    tokens = documents(length) if case.startswith("documents") else fused()
    pattern = DOCUMENTS if case.startswith("documents") else PER_MODALITY
    run = contenders(tokens, pattern)[case.split("-")[1]]
    run()  # warm-up (the plan is built here)
    print_child_peak(peak_rss_growth(run))


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f} (1 min) / {five:.1f} (5 min) on {os.cpu_count()} CPUs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--video", action="store_true",
                        help="only the video case (its own table in docs/performance.md)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    add_docs_argument(parser)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    torch.set_num_threads(1)
    if args.video:
        video_main(args.quick, args.write_docs)
        return
    quick = args.quick
    length = 2048 if quick else 8192
    repeats = 2 if quick else 5
    rows, lines = [], []
    load_before = load()

    docs = documents(length)
    times = medians(contenders(docs, DOCUMENTS), repeats)
    memory = {name: child_peak_memory(__file__, [f"documents-{name}", str(length)], name)
              for name in ("sparse", "dense")}
    mask = DOCUMENTS.compile(docs)
    speed = times["dense"] / times["sparse"]
    mem_ratio = (memory["sparse"] / memory["dense"]) if all(memory.values()) else math.nan
    rows.append([f"documents 16 x 512 causal, L={length}, fwd+bwd", "SparseMask vs dense mask",
                 times["sparse"] * 1e3, times["dense"] * 1e3, f"{speed:.1f}x faster",
                 f"{mask.density:.3f}"])
    lines.append(f"- documents, fwd+bwd vs the dense mask: **{speed:.1f}x** (target >= 30x)")
    if all(memory.values()):
        lines.append(
            f"- documents, peak memory growth: {memory['sparse'] / MIB:.0f} MiB vs "
            f"{memory['dense'] / MIB:.0f} MiB = **1/{1 / mem_ratio:.0f}** (target <= 1/16)")

    flex = flex_forward(docs, DOCUMENTS, 3 if quick else 9)
    rel = flex["sparse"] / flex["flex"]
    rows.append([f"documents, L={length}, forward only", "kernel vs compiled flex_attention",
                 flex["sparse"] * 1e3, flex["flex"] * 1e3, f"{rel:.2f}x its time", "—"])
    lines.append(f"- forward vs compiled flex_attention: **{rel:.2f}x** its time (target <= 0.7x)")

    modal = fused(512, 32, 512) if quick else fused()
    times = medians(contenders(modal, PER_MODALITY), repeats)
    mask = PER_MODALITY.compile(modal)
    speed = times["dense"] / times["sparse"]
    rows.append([f"per-modality fused, L={modal.length}, fwd+bwd", "SparseMask vs dense mask",
                 times["sparse"] * 1e3, times["dense"] * 1e3, f"{speed:.1f}x faster",
                 f"{mask.density:.3f}"])
    lines.append(f"- per-modality fused sequence vs the dense mask: **{speed:.1f}x** "
                 f"(density {mask.density:.3f}; target >= 8x)")

    sizes = [1024, 2048, 4096] if quick else [2048, 4096, 8192, 16384]
    runs = {}
    for size in sizes:
        torch.manual_seed(0)
        tokens = documents(size)
        runs[size] = step(MultiHeadAttention(EMBED, HEADS), tokens.x, DOCUMENTS.compile(tokens))
    scaling = medians(runs, repeats)
    logs = [(math.log(n), math.log(scaling[n])) for n in sizes]
    mx, my = (statistics.mean(c) for c in zip(*logs))
    slope = sum((a - mx) * (b - my) for a, b in logs) / sum((a - mx) ** 2 for a, _ in logs)
    for size in sizes:
        rows.append([f"documents of 512, L={size}, fwd+bwd", "SparseMask", scaling[size] * 1e3,
                     "—", "—", "—"])
    lines.append(f"- time exponent in L over L={sizes}: **{slope:.2f}** (target <= 1.1)")

    big = 8192 if quick else 32768
    compile_s, plan_s = compile_times(big, 3 if quick else 9)
    rows.append([f"compile, L={big} ({big // 512} documents, causal)", "pattern.compile",
                 compile_s * 1e3, "—", f"plan {plan_s * 1e3:.1f} ms (once per mask)", "—"])
    lines.append(f"- `compile` at L={big}: **{compile_s * 1e3:.1f} ms** (target <= 20 ms); the "
                 f"kernel's bucket plan, built once per mask on first use: {plan_s * 1e3:.1f} ms")
    lines.append(f"- machine load average before / after: {load_before} / {load()}")
    table = markdown_table(
        ["case", "contenders", "ours ms", "other ms", "ratio", "density"], rows)
    body = table + "\n\n" + "\n".join(lines)
    print(body)
    if args.write_docs and not quick:
        write_docs("patterns", body)


if __name__ == "__main__":
    main()
