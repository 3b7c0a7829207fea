"""Cost of every attention variant as L grows: forward time (and peak memory on CUDA).

Run: ``.venv/bin/python benchmarks/variants.py`` (``--quick`` for a smoke run,
``--device cuda`` on a GPU, ``--lengths 256 1024 4096``).

One (1, L, 256) batch, 4 heads, eval mode under ``torch.inference_mode``, one CPU thread.
Contenders: ``MultiHeadAttention`` (fused), the same with ``need_weights=True`` (explicit),
``LocalAttention`` (window 64), ``LinformerAttention`` (proj_len 64) and
``AdditiveAttention`` (only up to ``--additive-max``: its cost is L²·e). Times are medians of
interleaved repeats (benchmarks/_harness.py); the table lands in docs/variants.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    add_docs_argument,
    interleaved_medians,
    markdown_table,
    write_docs,
)

from mmattn import (  # noqa: E402
    AdditiveAttention,
    LinformerAttention,
    LocalAttention,
    MultiHeadAttention,
)

D, H = 256, 4


def contenders(length: int, device: str, additive_max: int) -> dict[str, tuple]:
    """name -> (module, forward kwargs)."""
    found = {
        "mha fused": (MultiHeadAttention(D, H), {}),
        "mha explicit (weights)": (MultiHeadAttention(D, H), {"need_weights": True}),
        "local w=64": (LocalAttention(D, H, window_size=64), {}),
        "linformer p=64": (LinformerAttention(D, H, seq_len=length, proj_len=64), {}),
    }
    if length <= additive_max:
        found["additive"] = (AdditiveAttention(D, H), {})
    return {name: (m.to(device).eval(), kw) for name, (m, kw) in found.items()}


def peak_mib(module, x, kwargs, device: str) -> float | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    module(x, **kwargs)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--additive-max", type=int, default=1024)
    p.add_argument("--quick", action="store_true", help="L = 64, 128; 2 repeats")
    add_docs_argument(p)
    args = p.parse_args()
    if args.quick:
        args.lengths, args.repeats = [64, 128], 2
    torch.set_num_threads(1)
    torch.manual_seed(0)
    sync = torch.cuda.synchronize if args.device == "cuda" else None
    rows = []
    with torch.inference_mode():
        for length in args.lengths:
            x = torch.randn(1, length, D, device=args.device)
            mods = contenders(length, args.device, args.additive_max)
            calls = {n: (lambda m=m, kw=kw, x=x: m(x, **kw)) for n, (m, kw) in mods.items()}
            times = interleaved_medians(calls, args.repeats, sync=sync)
            for name, (m, kw) in mods.items():
                peak = peak_mib(m, x, kw, args.device)
                rows.append([length, name, times[name] * 1e3,
                             "-" if peak is None else f"{peak:.1f}"])
                print(f"L={length} {name}: {times[name] * 1e3:.1f} ms", flush=True)
    table = markdown_table(["L", "variant", "forward ms", "peak MiB (cuda)"], rows)
    print()
    print(table)
    if args.write_docs:
        write_docs("variants" if args.device == "cpu" else f"variants-{args.device}", table,
                   device=args.device)


if __name__ == "__main__":
    main()
