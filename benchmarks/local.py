"""LocalAttention vs dense band-masked attention vs the ``local-attention`` package.

Run: ``.venv/bin/python benchmarks/local.py`` (``--quick`` for a short smoke run; the
``local-attention`` package is the ``bench`` extra: ``pip install -e ".[bench]"``).

B=1, H=8, head width 64 (D=512), window 128, fp32 on the CPU, L in {2048, 4096, 8192, 16384};
"forward" is eval mode under ``torch.inference_mode``, "fwd+bwd" is forward + backward.
Every contender is a whole module (the same q/k/v/out projections and weights) around its
attention kernel:

- ``ours``: :class:`mmattn.LocalAttention` (blocked, one batched SDPA call);
- ``dense``: ``nn.MultiheadAttention`` with the dense bool band ``attn_mask``;
- ``la_exact``: ``local_attention.LocalAttention(window_size=128, look_backward=1,
  look_forward=1, exact_windowsize=True)`` — the same band |i - j| <= 128;
- ``la_default``: the same without ``exact_windowsize`` (its default): blocks of 128 see
  the previous, own and next block, a wider receptive field (128 to 255 keys each side);
- ``flex`` (forward only): ``torch.compile(flex_attention)`` with the band ``BlockMask``.

Times are medians of interleaved repeats (benchmarks/_harness.py). Peak memory is the growth
of a fresh child process's peak RSS (VmHWM, reset through /proc/self/clear_refs) over one
call, measured after a warm-up; ``flex`` is not memory-measured (each child would recompile).
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
from pathlib import Path

import torch
from einops import rearrange
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    add_docs_argument,
    child_peak_memory,
    interleaved_medians,
    markdown_table,
    peak_rss_growth,
    print_child_peak,
    write_docs,
)

from mmattn import LocalAttention, MultiHeadAttention  # noqa: E402
from mmattn.masks import band_mask  # noqa: E402

HEADS, HEAD_DIM, WINDOW = 8, 64, 128
EMBED = HEADS * HEAD_DIM
GIB = 1024**3


class Projected(nn.Module):
    """Our module's projections around a foreign (b, h, l, e) attention kernel."""

    def __init__(self, ours: LocalAttention, kernel) -> None:
        super().__init__()
        self.ours = ours
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.ours
        q, k, v = (
            rearrange(proj(x), "b l (h e) -> b h l e", h=HEADS)
            for proj in (m.q_proj, m.k_proj, m.v_proj)
        )
        return m.out_proj(rearrange(self.kernel(q, k, v), "b h l e -> b l (h e)"))


def flex_kernel(length: int):
    """Compiled FlexAttention with the band as a BlockMask, or None where it cannot run."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None

    def band(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= WINDOW

    block_mask = create_block_mask(band, None, None, length, length, device="cpu")
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


def dense_twin(ours: LocalAttention) -> nn.MultiheadAttention:
    """nn.MultiheadAttention with our weights (the band goes in as attn_mask)."""
    twin = MultiHeadAttention(ours.embed_dim, ours.num_heads)
    twin.load_state_dict(ours.state_dict())
    return twin.to_torch()


def build(length: int, names: list[str]) -> dict[str, nn.Module | object]:
    """Modules sharing one set of weights; a callable x -> output for each name."""
    ours = LocalAttention(EMBED, HEADS, WINDOW)
    calls = {}
    if "ours" in names:
        calls["ours"] = lambda x: ours(x)[0]
    if "dense" in names:
        dense = dense_twin(ours)
        hidden = ~band_mask(length, WINDOW)
        calls["dense"] = lambda x: dense(x, x, x, attn_mask=hidden, need_weights=False)[0]
    if "la_exact" in names or "la_default" in names:
        from local_attention import LocalAttention as PackageLocal

        for name, exact in (("la_exact", True), ("la_default", False)):
            if name in names:
                kernel = PackageLocal(
                    window_size=WINDOW, look_backward=1, look_forward=1,
                    exact_windowsize=exact, autopad=True,
                )
                calls[name] = Projected(ours, kernel)
    if "flex" in names:
        kernel = flex_kernel(length)
        if kernel is not None:
            calls["flex"] = Projected(ours, kernel)
    return calls


def run_once(fn, x: torch.Tensor, mode: str) -> None:
    if mode == "fwd+bwd":
        fn(x).sum().backward()
    else:
        with torch.inference_mode():
            fn(x)


def child(name: str, length: int, mode: str) -> None:
    """Measure one contender's peak RSS growth over one call; print JSON."""

    torch.manual_seed(0)
    fn = build(length, [name])[name]
    x = torch.randn(1, length, EMBED, requires_grad=mode == "fwd+bwd")
    warm = torch.randn(1, 512, EMBED, requires_grad=mode == "fwd+bwd")
    if name != "dense":  # dense's mask is built for `length`
        run_once(fn, warm, mode)
    print_child_peak(peak_rss_growth(lambda: run_once(fn, x, mode)))


def peak_memory(name: str, length: int, mode: str) -> float | None:
    """GiB of peak RSS growth, measured in a fresh child; None where it failed."""
    peak = child_peak_memory(__file__, [name, str(length), mode], f"{name} L={length} {mode}")
    return None if peak is None else peak / GIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory children")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    add_docs_argument(parser)
    args = parser.parse_args()
    if args.child:
        name, length, mode = args.child
        child(name, int(length), mode)
        return
    lengths = [1024, 2048] if args.quick else [2048, 4096, 8192, 16384]
    use_flex = not (args.no_flex or args.quick)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}; B=1 H={HEADS} e={HEAD_DIM} "
          f"window={WINDOW}")
    times: dict[tuple[str, int], dict[str, float]] = {}
    rows = []
    for mode in ("fwd+bwd", "forward"):
        for length in lengths:
            torch.manual_seed(0)
            names = ["ours", "dense", "la_exact", "la_default"]
            if mode == "forward" and use_flex:
                names.append("flex")
            calls = build(length, names)
            x = torch.randn(1, length, EMBED, requires_grad=mode == "fwd+bwd")
            repeats = args.repeats or (2 if args.quick else (5 if length <= 4096 else 3))
            contenders = {
                n: (lambda fn=fn, x=x, mode=mode: run_once(fn, x, mode))
                for n, fn in calls.items()
            }
            medians = interleaved_medians(contenders, repeats)
            times[mode, length] = medians
            memory = {}
            if not args.no_memory:
                memory = {n: peak_memory(n, length, mode) for n in calls if n != "flex"}
            for n in calls:
                rows.append([
                    mode, length, n, medians[n] * 1e3, medians[n] / medians["ours"],
                    "—" if memory.get(n) is None else f"{memory[n]:.3f}",
                ])
            print(f"{mode} L={length}: " + ", ".join(
                f"{n}={medians[n] * 1e3:.0f}ms" for n in calls), flush=True)
    table = markdown_table(
        ["mode", "L", "contender", "median ms", "× ours time", "peak growth GiB"], rows
    )
    print()
    print(table)

    big = 8192 if args.quick else 65536
    x = torch.randn(1, big, EMBED, requires_grad=True)
    ours = build(big, ["ours"])["ours"]
    t = interleaved_medians({"ours": lambda: run_once(ours, x, "fwd+bwd")}, 1, warmup=0)
    mem = None if args.no_memory else peak_memory("ours", big, "fwd+bwd")
    mem_text = "—" if mem is None else f"{mem:.2f} GiB"
    big_line = (f"ours fwd+bwd at L={big}: {t['ours']:.2f} s, peak growth {mem_text} "
                f"(target < 6 GiB)")
    print("\n" + big_line)
    if args.write_docs:
        write_docs("local", f"{table}\n\n{big_line}")

    print("\n## targets (fwd+bwd unless stated)")
    top = lengths[-1]
    tb = times["fwd+bwd", top]
    print(f"- dense / ours at L={top}: {tb['dense'] / tb['ours']:.1f}x (target >= 10x)")
    print(f"- ours / la_exact at L={top}: {tb['ours'] / tb['la_exact']:.2f} (target <= 0.8)")
    print(f"- ours / la_default at L={top}: {tb['ours'] / tb['la_default']:.2f}")
    ls = [math.log(n) for n in lengths]
    ts = [math.log(times["fwd+bwd", n]["ours"]) for n in lengths]
    mean_l, mean_t = sum(ls) / len(ls), sum(ts) / len(ts)
    slope = sum((a - mean_l) * (b - mean_t) for a, b in zip(ls, ts)) / sum(
        (a - mean_l) ** 2 for a in ls
    )
    print(f"- time exponent of ours over L={lengths}: {slope:.2f} (target <= 1.15)")
    if use_flex and "flex" in times["forward", top]:
        for n in lengths:
            f = times["forward", n]
            print(f"- forward ours / flex at L={n}: {f['ours'] / f['flex']:.2f} (target <= 1)")


if __name__ == "__main__":
    main()
