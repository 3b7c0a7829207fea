"""attention_mass (and top_keys) vs a plain forward of a LocalAttention layer at L = 16k.

Run: ``.venv/bin/python benchmarks/mass.py`` (about 2 minutes; ``--quick`` for a smoke run
at L = 4k).

Each case is one ``LocalAttention`` layer (eval mode, fp32, B=1, one torch thread) over the
fused Tokens of two modalities:

- ``spans``: text then image (``Tokens.cat``: 1/4 text, 3/4 image), the usual fused
  sequence;
- ``interleaved``: ``meta["modality_ids"]`` switching modality every 48 tokens, so that every
  tile mixes them (the mass is an attention call of the layer with the one-hot modalities
  as values, here in the layer's own call, ``[v | modalities]``: both layouts cost the
  same).

Contenders, interleaved and timed by process CPU time (medians of repeats,
benchmarks/_harness.py), all under ``torch.no_grad()``:

- ``forward``: ``layer(x)``;
- ``attention_mass``: ``mmattn.debug.attention_mass(layer, tokens)`` (its forward included);
- ``top_keys``: ``mmattn.debug.top_keys(layer, tokens, k=8)`` (its forward included).

Peak memory is the growth of a fresh child process's peak RSS (VmHWM, reset through
/proc/self/clear_refs) over one call after a warm-up, compared with the (B, H, L, L) float32
weights that ``need_weights=True`` would return for one layer.
"""

from __future__ import annotations

import argparse
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

from mmattn import LocalAttention, Tokens  # noqa: E402
from mmattn.debug import attention_mass, top_keys  # noqa: E402

#: (embed_dim, heads, window) of the cases; the first is the headline.
CONFIGS = ((256, 8, 128), (128, 4, 64))
MIB = 1024**2


def build(length: int, dim: int, heads: int, window: int, layout: str):
    torch.manual_seed(0)
    layer = LocalAttention(dim, heads, window_size=window).eval()
    text = length // 4
    if layout == "spans":
        tokens = Tokens.cat({"text": Tokens(torch.randn(1, text, dim)),
                             "image": Tokens(torch.randn(1, length - text, dim))})
    else:
        ids = (torch.arange(length) // 48 % 2)[None]
        tokens = Tokens(torch.randn(1, length, dim),
                        meta={"modality_ids": ids, "modalities": ["text", "image"]})
    return layer, tokens


def contenders(layer, tokens, names) -> dict:
    calls = {
        "forward": lambda: layer(tokens.x),
        "attention_mass": lambda: attention_mass(layer, tokens),
        "top_keys": lambda: top_keys(layer, tokens, k=8),
    }

    def no_grad(fn):
        def call():
            with torch.no_grad():
                fn()
        return call

    return {name: no_grad(calls[name]) for name in names}


def child(name: str, length: int, dim: int, heads: int, window: int, layout: str) -> None:
    torch.set_num_threads(1)
    call = contenders(*build(length, dim, heads, window, layout), [name])[name]
    call()  # warm-up: allocator, caches
    print_child_peak(peak_rss_growth(call))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="L = 4k, few repeats")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory children")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    add_docs_argument(parser)
    args = parser.parse_args()
    if args.child:
        name, length, dim, heads, window, layout = args.child
        child(name, int(length), int(dim), int(heads), int(window), layout)
        return
    torch.set_num_threads(1)
    length = 4096 if args.quick else 16384
    repeats = 3 if args.quick else 7
    rows, lines = [], []
    for dim, heads, window in CONFIGS:
        for layout in ("spans", "interleaved"):
            names = ["forward", "attention_mass"]
            if layout == "spans" and (dim, heads, window) == CONFIGS[0]:
                names.append("top_keys")
            layer, tokens = build(length, dim, heads, window, layout)
            _, cpu = interleaved_samples(contenders(layer, tokens, names), repeats, warmup=1)
            medians = {name: statistics.median(ts) for name, ts in cpu.items()}
            memory = {}
            if not args.no_memory:
                for name in names:
                    peak = child_peak_memory(
                        __file__, [name, str(length), str(dim), str(heads), str(window),
                                   layout], f"{name} {layout}")
                    memory[name] = None if peak is None else peak / MIB
            dense = heads * length * length * 4 / MIB  # one layer's (B, H, L, L) weights
            for name, t in medians.items():
                peak = memory.get(name)
                rows.append([f"D={dim} H={heads} w={window}", layout, name, t * 1e3,
                             t / medians["forward"], "—" if peak is None else f"{peak:.0f}",
                             "—" if peak is None else f"{peak / dense:.4f}"])
            print(f"D={dim} H={heads} w={window} {layout}: " + ", ".join(
                f"{n}={t * 1e3:.0f}ms" for n, t in medians.items()), flush=True)
            if layout == "spans" and (dim, heads, window) == CONFIGS[0]:
                ratio = medians["attention_mass"] / medians["forward"]
                lines.append(f"- attention_mass time / forward at L={length}, D={dim}, "
                             f"w={window}, spans: {ratio:.2f} (target <= 1.5)")
                peak = memory.get("attention_mass")
                if peak is not None:
                    lines.append(f"- attention_mass peak memory / one layer's dense weights "
                                 f"({dense / 1024:.0f} GiB): {peak / dense:.4f} "
                                 f"(target <= 0.05)")
    table = markdown_table(
        ["layer", "modalities", "contender", "median CPU ms", "× forward", "peak MiB",
         "peak / dense weights"], rows)
    body = "\n".join([f"L = {length}, B = 1, fp32, one torch thread.", "", table, "",
                      *lines])
    print()
    print(body)
    if args.write_docs:
        write_docs("mass", body)


if __name__ == "__main__":
    main()
