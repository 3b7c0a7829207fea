"""3-D NeighborhoodAttention on video grids vs dense masked attention vs natten's na3d, CPU.

Run: ``.venv/bin/python benchmarks/neighborhood_video.py`` (``--quick`` for a short smoke
run, ``--write-docs`` to write the table into docs/performance.md; ``natten`` is the ``bench``
extra: ``pip install --no-build-isolation natten==0.21.7``).

B=1, 4 heads of width 32 (D=128), kernel (3, 7, 7) with a causal time axis
(``causal=(True, False, False)``), fp32 on the CPU with one torch thread (issue 42):

- ``fwd+bwd`` at the grid (8, 32, 32) (L = 8192): :class:`mmattn.NeighborhoodAttention`
  (``ours``) against :class:`mmattn.MultiHeadAttention` with the same weights and
  ``attn_mask=~neighborhood_mask(...)`` (``dense``: the same numbers in O(L²)), forward +
  backward of the whole module; the peak memory of both;
- ``exponent``: ours, fwd+bwd, as the frames grow (T = 4 .. 32 at 32 x 32; L = 4k .. 32k),
  the slope of log time over log L;
- ``forward`` at (8, 32, 32), eval mode under ``torch.inference_mode``: ours against
  ``natten.na3d`` (``is_causal=(True, False, False)``) between the same projections (natten's
  CPU path is FlexAttention, forward only; its compiled form is refused on the CPU).

Times are medians of the process CPU time of interleaved repeats (benchmarks/_harness.py);
the machine is shared, so the load average is printed beside them. Peak memory is the growth
of a fresh child process's peak RSS over one fwd+bwd call after a warm-up call, with glibc's
mmap threshold fixed at 128 KiB in the child (``MALLOC_MMAP_THRESHOLD_``): every large
buffer is then mapped on allocation and unmapped on free, so the growth is the peak of live
large buffers, the same for every contender (with glibc's sliding threshold, buffers under
32 MiB are served from heap the warm-up left, and the figure varies by ±30 % run to run).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import warnings
from pathlib import Path

import torch
from einops import rearrange
from torch import nn

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
from neighborhood import run_once, timed  # noqa: E402 (the 2-D benchmark's)
from patterns import load  # noqa: E402

from mmattn import MultiHeadAttention, NeighborhoodAttention  # noqa: E402
from mmattn.masks import neighborhood_mask  # noqa: E402

HEADS, HEAD_DIM = 4, 32
EMBED = HEADS * HEAD_DIM
KERNEL, CAUSAL = (3, 7, 7), (True, False, False)
GRID = (8, 32, 32)
MIB = 1024**2


class Natten(nn.Module):
    """Our module's projections around natten's na3d on (b, t, h, w, heads, e)."""

    def __init__(self, ours: NeighborhoodAttention, grid: tuple[int, int, int]) -> None:
        super().__init__()
        from natten import na3d

        self.ours, self.grid, self.na3d = ours, grid, na3d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m, (t, h, _) = self.ours, self.grid
        q, k, v = (rearrange(proj(x), "b (t h w) (n e) -> b t h w n e", t=t, h=h, n=HEADS)
                   for proj in (m.q_proj, m.k_proj, m.v_proj))
        out = self.na3d(q, k, v, KERNEL, is_causal=CAUSAL)
        return m.out_proj(rearrange(out, "b t h w n e -> b (t h w) (n e)"))


def build(grid: tuple[int, int, int], names: list[str]) -> tuple[dict, dict]:
    """A callable x -> output per name (one set of weights), and why a name cannot run."""
    torch.manual_seed(0)
    ours = NeighborhoodAttention(EMBED, HEADS, KERNEL, causal=CAUSAL)
    calls, refused = {}, {}
    if "ours" in names:
        calls["ours"] = lambda x: ours(x, grid=grid)[0]
    if "dense" in names:
        dense = MultiHeadAttention(EMBED, HEADS)
        dense.load_state_dict(ours.state_dict())
        hidden = ~neighborhood_mask(grid, KERNEL, causal=CAUSAL)
        calls["dense"] = lambda x: dense(x, attn_mask=hidden)[0]
    if "natten" in names:
        try:
            calls["natten"] = Natten(ours, grid)
        except ImportError as error:
            refused["natten"] = f"natten is not installed ({error}); pip install the bench extra"
    return calls, refused


def child(name: str, frames: int) -> None:
    """Measure one contender's peak RSS growth over one fwd+bwd call; print JSON."""
    torch.set_num_threads(1)
    grid = (frames, *GRID[1:])
    fn = build(grid, [name])[0][name]
    x = torch.randn(1, math.prod(grid), EMBED, requires_grad=True)
    run_once(fn, x, "fwd+bwd")  # warm the allocator and the plan cache
    print_child_peak(peak_rss_growth(lambda: run_once(fn, x, "fwd+bwd")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small grids, few repeats")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    add_docs_argument(parser)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    torch.set_num_threads(1)
    quick = args.quick
    frames = 4 if quick else GRID[0]
    grid = (frames, *GRID[1:])
    length = math.prod(grid)
    before = load()
    print(f"# torch {torch.__version__}, 1 thread; B=1 H={HEADS} e={HEAD_DIM} kernel={KERNEL} "
          f"causal={CAUSAL}; load {before}", flush=True)
    rows, lines = [], []

    x = torch.randn(1, length, EMBED, requires_grad=True)
    calls, _ = build(grid, ["ours", "dense"])
    train = timed(calls, x, "fwd+bwd", 2 if quick else 5, 1)
    for name, t in train.items():
        rows.append(["fwd+bwd", str(grid), length, name, t * 1e3, t / train["ours"]])
    print(f"fwd+bwd {grid}: " + ", ".join(f"{n}={t * 1e3:.0f}ms" for n, t in train.items()),
          flush=True)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)  # the children's allocator
    memory = {n: child_peak_memory(__file__, [n, str(frames)], f"{n} {grid}")
              for n in ("ours", "dense")}
    del os.environ["MALLOC_MMAP_THRESHOLD_"]

    sizes = [2, 4, 8] if quick else [4, 8, 16, 32]
    runs = {}
    for t in sizes:
        g = (t, *GRID[1:])
        xt = torch.randn(1, math.prod(g), EMBED, requires_grad=True)
        fn = build(g, ["ours"])[0]["ours"]
        runs[t] = (lambda fn=fn, xt=xt: run_once(fn, xt, "fwd+bwd"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, cpu = interleaved_samples(runs, 2 if quick else 3)
    scaling = {t: statistics.median(ts) for t, ts in cpu.items()}
    for t in sizes:
        g = (t, *GRID[1:])
        rows.append(["fwd+bwd", str(g), math.prod(g), "ours", scaling[t] * 1e3, "—"])
    logs = [(math.log(t * GRID[1] * GRID[2]), math.log(scaling[t])) for t in sizes]
    mx, my = (statistics.mean(c) for c in zip(*logs))
    slope = sum((a - mx) * (b - my) for a, b in logs) / sum((a - mx) ** 2 for a, _ in logs)

    calls, refused = build(grid, ["ours", "natten"])
    xi = torch.randn(1, length, EMBED)
    infer = timed(calls, xi, "forward", 1 if quick else 3, warmup=1)
    for name, t in infer.items():
        rows.append(["forward", str(grid), length, name, t * 1e3, t / infer["ours"]])
    print(f"forward {grid}: " + ", ".join(f"{n}={t * 1e3:.0f}ms" for n, t in infer.items()),
          flush=True)

    speed = train["dense"] / train["ours"]
    lines.append(f"- fwd+bwd at {grid}, dense / ours: **{speed:.1f}x** (target >= 6x)")
    if all(memory.values()):
        ratio = memory["ours"] / memory["dense"]
        lines.append(f"- peak RSS growth of one fwd+bwd at {grid}: ours "
                     f"{memory['ours'] / MIB:.0f} MiB, dense {memory['dense'] / MIB:.0f} MiB = "
                     f"**{ratio:.3f}** (target <= 0.1)")
    lines.append(f"- time exponent of ours in L, T = {sizes[0]} .. {sizes[-1]} at "
                 f"{GRID[1]} x {GRID[2]}: **{slope:.2f}** (target <= 1.2)")
    if "natten" in infer:
        lines.append(f"- forward at {grid}, natten.na3d / ours: "
                     f"**{infer['natten'] / infer['ours']:.0f}x** (target >= 4x)")
    for name, why in refused.items():
        lines.append(f"- `{name}` cannot run here: {why}")
    lines.append(f"- machine load average before / after: {before} / {load()}")
    table = markdown_table(["mode", "grid", "L", "contender", "median CPU ms", "× ours time"],
                           rows)
    body = table + "\n\n" + "\n".join(lines)
    print("\n" + body)
    if args.write_docs and not quick:
        write_docs("neighborhood-video", body)


if __name__ == "__main__":
    main()
