"""NeighborhoodAttention vs dense masked attention vs natten's CPU path, on image grids.

Run: ``.venv/bin/python benchmarks/neighborhood.py`` (``--quick`` for a short smoke run;
``natten`` is the ``bench`` extra: ``pip install --no-build-isolation natten==0.21.7``).

B=1, 4 heads of width 32 (D=128), kernel 7, fp32 on the CPU with one torch thread; grids of
32² to 128² patches (L = 1,024 to 16,384). "fwd+bwd" is forward + backward of a whole
module (the same q/k/v/out projections and weights); "forward" is eval mode under
``torch.inference_mode``:

- ``ours``: :class:`mmattn.NeighborhoodAttention` (tiles + halo, one batched SDPA call);
- ``dense``: :class:`mmattn.MultiHeadAttention` with ``attn_mask=~neighborhood_mask(...)``
  (the dense masked path: the same numbers in O(L²));
- ``natten``: ``natten.functional.na2d`` between our projections (forward only: natten's
  CPU path is FlexAttention, which has no CPU backward; its compiled form is refused on the
  CPU, see the notes the run prints);
- ``flex`` (forward, optional): ``torch.compile(flex_attention)`` with the same window as a
  ``BlockMask`` — what a compiled natten would run.

Times are medians of the process CPU time of interleaved repeats (benchmarks/_harness.py):
on a shared machine CPU time is the steadier clock with one thread. Peak memory is the growth
of a fresh child process's peak RSS (VmHWM, reset through /proc/self/clear_refs) over one
fwd+bwd call after a warm-up, as in benchmarks/local.py.
"""

from __future__ import annotations

import argparse
import math
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

from mmattn import MultiHeadAttention, NeighborhoodAttention  # noqa: E402
from mmattn.masks import neighborhood_mask  # noqa: E402

HEADS, HEAD_DIM, KERNEL = 4, 32, 7
EMBED = HEADS * HEAD_DIM
GIB = 1024**3
#: What the refusals mean (checked with natten 0.21.7 and torch 2.14 on the CPU).
WHY = {
    "natten_compiled": (
        " (natten offers its compiled Flex path only on CUDA devices of compute capability "
        ">= 7.0; wrapping na2d in torch.compile fails too: inductor's CPU flex_attention "
        "does not support the return_lse natten asks for)"
    ),
}


class Projected(nn.Module):
    """Our module's projections around a foreign (b, rows, cols, h, e) kernel (natten's)."""

    def __init__(self, ours: NeighborhoodAttention, side: int, kernel) -> None:
        super().__init__()
        self.ours, self.side, self.kernel = ours, side, kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.ours
        q, k, v = (
            rearrange(proj(x), "b (r c) (h e) -> b r c h e", r=self.side, h=HEADS)
            for proj in (m.q_proj, m.k_proj, m.v_proj)
        )
        return m.out_proj(rearrange(self.kernel(q, k, v), "b r c h e -> b (r c) (h e)"))


def natten_kernel(compiled: bool):
    """natten's na2d (eager, or compiled), or the reason it cannot run."""
    try:
        from natten.functional import na2d
    except ImportError as error:
        return f"natten is not installed ({error}); pip install the bench extra"
    if not compiled:
        return lambda q, k, v: na2d(q, k, v, KERNEL)
    return lambda q, k, v: na2d(q, k, v, KERNEL, torch_compile=True)


def flex_kernel(side: int):
    """Compiled FlexAttention with the window as a BlockMask (heads-last in and out)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as error:
        return f"no FlexAttention ({error})"
    allowed = neighborhood_mask((side, side), KERNEL)

    def window(b, h, q_idx, kv_idx):
        return allowed[q_idx, kv_idx]

    length = side * side
    block_mask = create_block_mask(window, None, None, length, length, device="cpu")
    compiled = torch.compile(flex_attention)

    def call(q, k, v):
        q, k, v = (rearrange(t, "b r c h e -> b h (r c) e") for t in (q, k, v))
        out = compiled(q, k, v, block_mask=block_mask)
        return rearrange(out, "b h (r c) e -> b r c h e", r=side)

    return call


def build(side: int, names: list[str]) -> tuple[dict[str, object], dict[str, str]]:
    """A callable x -> output per name (one set of weights), and why a name cannot run."""
    torch.manual_seed(0)
    ours = NeighborhoodAttention(EMBED, HEADS, KERNEL)
    calls: dict[str, object] = {}
    refused: dict[str, str] = {}
    if "ours" in names:
        calls["ours"] = lambda x: ours(x, grid=(side, side))[0]
    if "dense" in names:
        dense = MultiHeadAttention(EMBED, HEADS)
        dense.load_state_dict(ours.state_dict())
        hidden = ~neighborhood_mask((side, side), KERNEL)
        calls["dense"] = lambda x: dense(x, attn_mask=hidden)[0]
    for name, compiled in (("natten", False), ("natten_compiled", True)):
        if name in names:
            kernel = natten_kernel(compiled)
            if isinstance(kernel, str):
                refused[name] = kernel
            else:
                calls[name] = Projected(ours, side, kernel)
    if "flex" in names:
        kernel = flex_kernel(side)
        if isinstance(kernel, str):
            refused["flex"] = kernel
        else:
            calls["flex"] = Projected(ours, side, kernel)
    return calls, refused


def run_once(fn, x: torch.Tensor, mode: str) -> None:
    if mode == "fwd+bwd":
        fn(x).sum().backward()
    else:
        with torch.inference_mode():
            fn(x)


def child(name: str, side: int, mode: str) -> None:
    """Measure one contender's peak RSS growth over one call; print JSON."""

    torch.set_num_threads(1)
    fn = build(side, [name])[0][name]
    x = torch.randn(1, side * side, EMBED, requires_grad=mode == "fwd+bwd")
    if name == "ours":  # warm the allocator and the plan cache (dense's mask is per size)
        run_once(fn, x, mode)
    print_child_peak(peak_rss_growth(lambda: run_once(fn, x, mode)))


def peak_memory(name: str, side: int, mode: str) -> float | None:
    """GiB of peak RSS growth, measured in a fresh child; None where it failed."""
    peak = child_peak_memory(__file__, [name, str(side), mode], f"{name} {side}² {mode}")
    return None if peak is None else peak / GIB


def attempt(calls: dict, refused: dict, x: torch.Tensor, mode: str) -> None:
    """Drop the contenders that raise on this input (natten's compiled path on the CPU)."""
    for name in list(calls):
        if name.startswith("natten") or name == "flex":
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    run_once(calls[name], x, mode)
            except Exception as error:  # noqa: BLE001 - report any refusal, keep going
                refused[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
                refused[name] += WHY.get(name, "")
                del calls[name]


def timed(calls: dict, x: torch.Tensor, mode: str, repeats: int, warmup: int) -> dict:
    contenders = {n: (lambda fn=fn: run_once(fn, x, mode)) for n, fn in calls.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, cpu = interleaved_samples(contenders, repeats, warmup=warmup)
    return {name: statistics.median(ts) for name, ts in cpu.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small grids, few repeats")
    parser.add_argument("--flex", action="store_true", help="also time compiled FlexAttention")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory children")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    add_docs_argument(parser)
    args = parser.parse_args()
    if args.child:
        name, side, mode = args.child
        child(name, int(side), mode)
        return
    torch.set_num_threads(1)
    sides = [8, 12, 16] if args.quick else [32, 48, 64, 96, 128]
    infer_side = 16 if args.quick else 64
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} thread; B=1 H={HEADS} "
          f"e={HEAD_DIM} kernel={KERNEL}")
    rows, times, refused_all = [], {}, {}
    for side in sides:
        x = torch.randn(1, side * side, EMBED, requires_grad=True)
        calls, _ = build(side, ["ours", "dense"])
        big = side >= 96
        medians = timed(calls, x, "fwd+bwd", 2 if big else (2 if args.quick else 5),
                        0 if side >= 128 else 1)
        times[side] = medians
        for name, t in medians.items():
            rows.append(["fwd+bwd", f"{side}²", side * side, name, t * 1e3, t / medians["ours"]])
        print(f"fwd+bwd {side}²: " + ", ".join(f"{n}={t * 1e3:.0f}ms"
                                               for n, t in medians.items()), flush=True)
    names = ["ours", "dense", "natten", "natten_compiled"] + (["flex"] if args.flex else [])
    calls, refused = build(infer_side, names)
    x = torch.randn(1, infer_side * infer_side, EMBED)
    attempt(calls, refused, x, "forward")
    refused_all.update(refused)
    infer = timed(calls, x, "forward", 3, 0)
    for name, t in infer.items():
        rows.append(["forward", f"{infer_side}²", infer_side**2, name, t * 1e3,
                     t / infer["ours"]])
    print(f"forward {infer_side}²: " + ", ".join(f"{n}={t * 1e3:.0f}ms"
                                                for n, t in infer.items()), flush=True)
    table = markdown_table(
        ["mode", "grid", "L", "contender", "median CPU ms", "× ours time"], rows
    )
    print()
    print(table)

    top = sides[-1]
    lines = []
    memory = {}
    if not args.no_memory:
        memory = {n: peak_memory(n, top, "fwd+bwd") for n in ("ours", "dense")}
        text = ", ".join(
            f"{n} {'—' if m is None else f'{m:.3f} GiB'}" for n, m in memory.items()
        )
        lines.append(f"Peak RSS growth of one fwd+bwd at {top}²: {text}.")
    for name, why in refused_all.items():
        lines.append(f"`{name}` cannot run here: {why}")
    ls = [math.log(s * s) for s in sides]
    ts = [math.log(times[s]["ours"]) for s in sides]
    mean_l, mean_t = sum(ls) / len(ls), sum(ts) / len(ts)
    slope = sum((a - mean_l) * (b - mean_t) for a, b in zip(ls, ts)) / sum(
        (a - mean_l) ** 2 for a in ls
    )
    mid = sides[-2]
    targets = [
        f"- speed-up vs dense at {mid}²: {times[mid]['dense'] / times[mid]['ours']:.1f}x "
        f"(target >= 8x)",
        f"- speed-up vs dense at {top}²: {times[top]['dense'] / times[top]['ours']:.1f}x "
        f"(target >= 12x)",
        f"- time exponent of ours in L over {sides[0]}² to {top}²: {slope:.2f} "
        f"(target <= 1.15)",
    ]
    if memory.get("ours") and memory.get("dense"):
        targets.append(f"- peak memory at {top}², ours / dense: "
                       f"{memory['ours'] / memory['dense']:.3f} (target <= 0.1)")
    natten_times = [infer[n] for n in ("natten", "natten_compiled") if n in infer]
    if natten_times:
        targets.append(f"- forward at {infer_side}², natten's fastest CPU path / ours: "
                       f"{min(natten_times) / infer['ours']:.1f}x (target >= 5x)")
    body = "\n".join([table, "", *lines, "", *targets])
    print("\n" + "\n".join(lines + ["", "## targets", *targets]))
    if args.write_docs:
        write_docs("neighborhood", body)


if __name__ == "__main__":
    main()
