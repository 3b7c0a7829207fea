"""Incremental decoding: a KV cache against recomputing the prefix at every step.

Run: ``.venv/bin/python benchmarks/decode.py`` (``--quick`` for a short smoke run).

A causal decoder of ``depth`` (default 1) pre-norm :class:`mmattn.TransformerBlock` layers
(D=256, H=8, MLP ×4, fp32, CPU, one thread by default, eval mode under ``torch.no_grad``)
produces T=512 outputs for a batch of B=8, one position at a time, two ways:

- ``cache``: each layer has a :class:`mmattn.cache.KVCache`; step t feeds only token t, which
  attends the t cached keys — O(t) work per step;
- ``recompute``: step t runs the whole prefix (t tokens, ``causal=True``) and keeps the last
  output — O(t²) attention and O(t) projections per step, what a decoder without a cache
  does.

Both give the same outputs (checked, max |diff| printed). Times are medians of interleaved
repeats (benchmarks/_harness.py) of the whole T-step decode.

Second table: a causal :class:`mmattn.LocalAttention` (window 64) decoding up to 4096 tokens
with its ring cache (:class:`mmattn.cache.LocalKVCache`) against a full KV cache: bytes held
by the cache and the median time of one step at position t. The ring's memory and step time
stay flat in t; the full cache's step time grows with t.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    add_docs_argument,
    interleaved_medians,
    markdown_table,
    write_docs,
)

from mmattn import LocalAttention, MultiHeadAttention, Tokens, TransformerBlock  # noqa: E402

B, D, H = 8, 256, 8


class Decoder(nn.Module):
    """``depth`` causal blocks; :meth:`step` decodes with caches, :meth:`prefix` without."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TransformerBlock(D, H, causal=True) for _ in range(depth))

    def caches(self, max_len: int) -> list:
        return [block.attn.make_cache(B, max_len) for block in self.blocks]

    def step(self, x: torch.Tensor, caches: list) -> torch.Tensor:
        tokens = Tokens(x)
        for block, cache in zip(self.blocks, caches):
            tokens = block(tokens, cache=cache)
        return tokens.x

    def prefix(self, x: torch.Tensor) -> torch.Tensor:
        tokens = Tokens(x)
        for block in self.blocks:
            tokens = block(tokens)
        return tokens.x


def decode_cached(model: Decoder, x: torch.Tensor) -> torch.Tensor:
    caches = model.caches(x.shape[1])
    return torch.cat([model.step(x[:, t:t + 1], caches) for t in range(x.shape[1])], dim=1)


def decode_recompute(model: Decoder, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([model.prefix(x[:, :t + 1])[:, -1:] for t in range(x.shape[1])], dim=1)


def step_times(module: nn.Module, positions: list[int], repeats: int) -> list[float]:
    """Median seconds of one decoding step at each position (cache filled up to it)."""
    cache = module.make_cache(B, positions[-1] + repeats + 1)
    x = torch.randn(B, 1, D)
    times = []
    for target in positions:
        while len(cache) < target:
            module(x, is_causal=True, cache=cache)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            module(x, is_causal=True, cache=cache)
            samples.append(time.perf_counter() - start)
        times.append(statistics.median(samples))
    return times, cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="T=64, 1 repeat: a smoke run")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: the shared CPU gives steadier medians)")
    add_docs_argument(parser)
    args = parser.parse_args()
    tokens, repeats = (64, 1) if args.quick else (args.tokens, args.repeats)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads; B={B}, D={D}, H={H}, depth={args.depth}, "
          f"T={tokens}")

    model = Decoder(args.depth).eval()
    x = torch.randn(B, tokens, D)
    with torch.no_grad():
        diff = (decode_cached(model, x) - decode_recompute(model, x)).abs().max().item()
        medians = interleaved_medians(
            {"cache": lambda: decode_cached(model, x),
             "recompute": lambda: decode_recompute(model, x)},
            repeats=repeats, warmup=0,  # the equality check above warmed both up
        )
    ratio = medians["recompute"] / medians["cache"]
    table = markdown_table(
        [f"decode {tokens} tokens", "seconds", "ms / token", "speed-up"],
        [[name, medians[name], 1e3 * medians[name] / tokens,
          f"{medians['recompute'] / medians[name]:.1f}x"] for name in ("cache", "recompute")],
    )
    summary = (f"max |cache - recompute| = {diff:.2e}; cache is {ratio:.1f}x faster "
               f"(target >= 20x)")
    print(table)
    print(summary)
    if args.write_docs:
        write_docs("decode", f"{table}\n\n{summary}")

    window = 64
    positions = [64, 256, 1024, 4096] if not args.quick else [64, 256]
    local = LocalAttention(D, H, window, causal=True).eval()
    full = MultiHeadAttention(D, H).eval()
    full.load_state_dict(local.state_dict())
    step_repeats = 21 if not args.quick else 5
    with torch.no_grad():
        local_times, ring = step_times(local, positions, step_repeats)
        full_times, kv = step_times(full, positions, step_repeats)
    rows = [[t, f"{1e3 * a:.3f}", f"{1e3 * b:.3f}"] for t, a, b in zip(positions, local_times,
                                                                     full_times)]
    table = markdown_table(["position t", "local ring: ms / step", "full KV: ms / step"], rows)
    summary = (f"cache bytes: local ring (window {window}) {ring.nbytes:,} whatever t; full "
               f"KV cache for {kv.max_len} tokens {kv.nbytes:,} (grows with max_len)")
    print()
    print(table)
    print(summary)
    if args.write_docs:
        write_docs("decode-local", f"{table}\n\n{summary}")


if __name__ == "__main__":
    main()
