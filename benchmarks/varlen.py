"""Packed (jagged) vs padded + mask vs a per-item loop, forward + backward, CPU.

B sequences with log-normal lengths (mean ≈ 200, max ≈ 650 at the defaults), D=512, H=8.
Contenders run interleaved (benchmarks/_harness.py); we report median times, ratios and the
peak memory each allocates (tracked by a CPU allocation hook: torch.profiler memory stats).

    python benchmarks/varlen.py --write-docs   # the full table, into docs/performance.md
    python benchmarks/varlen.py --quick        # small sizes, prints only
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._harness import (  # noqa: E402
    add_docs_argument,
    interleaved_samples,
    markdown_table,
    peak_bytes,
    write_docs,
)
from mmattn import LocalAttention, MultiHeadAttention, Tokens, TransformerBlock  # noqa: E402


def lengths(batch: int, mean: float, longest: int, seed: int = 0) -> list[int]:
    """Log-normal lengths (sigma 0.6) rescaled to the given mean, the largest set to ``longest``."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(batch, generator=gen) * 0.6)
    raw = raw / raw.mean() * mean
    out = [max(1, round(float(x))) for x in raw]
    out[int(raw.argmax())] = longest
    return out


def make_inputs(lens: list[int], dim: int) -> tuple[Tokens, Tokens]:
    """The same real tokens as a packed and as a padded (+ mask) batch."""
    offsets = torch.tensor([0, *lens]).cumsum(0)
    values = torch.randn(int(offsets[-1]), dim)
    packed = Tokens.from_packed(values, offsets)
    return packed, packed.unpack()


def step(module, x, **kw):
    """One forward + backward of ``module`` on ``x`` (Tensor or Tokens)."""

    def run():
        for p in module.parameters():
            p.grad = None
        leaf = x.x if isinstance(x, Tokens) else x
        out = module(x, **kw)
        out = out[0] if isinstance(out, tuple) else out
        out = out.x if isinstance(out, Tokens) else out
        (out.values() if out.is_nested else out).sum().backward()
        return leaf

    return run


def contenders(lens: list[int], dim: int, heads: int, window: int):
    """Name -> (module call, note) for every row of the table."""
    packed, padded = make_inputs(lens, dim)
    kpm = padded.key_padding_mask
    mha = MultiHeadAttention(dim, heads)
    items = [x[None] for x in packed.x.unbind()]
    local = LocalAttention(dim, heads, window)
    block = TransformerBlock(dim, heads)

    def loop():
        for p in mha.parameters():
            p.grad = None
        total = sum(mha(x)[0].sum() for x in items)
        total.backward()

    return {
        "mha packed": step(mha, packed.x),
        "mha padded+mask": step(mha, padded.x, key_padding_mask=kpm),
        "mha per-item loop": loop,
        "local packed": step(local, packed.x),
        "local padded+mask": step(local, padded.x, key_padding_mask=kpm),
        "block packed": step(block, packed),
        "block padded+mask": step(block, padded),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch threads (default 1: on a shared, loaded machine more threads make "
             "OpenMP wait on each other and the timings meaningless; 0: torch's default)",
    )
    add_docs_argument(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.quick:
        batch, mean, longest, dim, heads, window, repeats = 8, 40, 130, 64, 4, 16, 3
    else:
        batch, mean, longest, dim, heads, window = args.batch, 200, 650, 512, 8, 64
        repeats = args.repeats
    lens = lengths(batch, mean, longest)
    runs = contenders(lens, dim, heads, window)
    wall_runs, cpu_runs = interleaved_samples(runs, repeats=repeats, warmup=1)
    walls = {name: statistics.median(ts) for name, ts in wall_runs.items()}
    times = {name: statistics.median(ts) for name, ts in cpu_runs.items()}
    peaks = {name: peak_bytes(fn) for name, fn in runs.items()}
    real, padded = sum(lens), batch * max(lens)
    scores_real, scores_padded = sum(n * n for n in lens), batch * max(lens) ** 2

    def row(name: str, ref: str | None) -> list[object]:
        ratio = "" if ref is None else f"{times[ref] / times[name]:.2f}x"
        return [name, f"{times[name] * 1e3:.0f}", f"{walls[name] * 1e3:.0f}", ratio,
                f"{peaks[name] / 2**20:.0f}"]

    def ratio(label: str, value: float) -> list[object]:
        return [label, "", "", value, ""]

    rows = [
        row("mha packed", None),
        row("mha padded+mask", None),
        row("mha per-item loop", None),
        ratio("packed vs padded+mask (speed-up)",
              f"{times['mha padded+mask'] / times['mha packed']:.2f}x "
              f"(wall {walls['mha padded+mask'] / walls['mha packed']:.2f}x)"),
        ratio("packed / per-item loop (time ratio)",
              f"{times['mha packed'] / times['mha per-item loop']:.2f} "
              f"(wall {walls['mha packed'] / walls['mha per-item loop']:.2f})"),
        row("local packed", None),
        row("local padded+mask", None),
        ratio("local packed vs padded (speed-up)",
              f"{times['local padded+mask'] / times['local packed']:.2f}x "
              f"(wall {walls['local padded+mask'] / walls['local packed']:.2f}x)"),
        row("block packed", None),
        row("block padded+mask", None),
        ratio("block packed vs padded (speed-up)",
              f"{times['block padded+mask'] / times['block packed']:.2f}x "
              f"(wall {walls['block padded+mask'] / walls['block packed']:.2f}x)"),
    ]
    table = markdown_table(
        ["contender (fwd+bwd)", "CPU ms", "wall ms", "ratio (CPU time)", "peak MiB"], rows
    )
    facts = (
        f"B={batch}, lengths mean {sum(lens) / batch:.0f}, max {max(lens)}, min {min(lens)} "
        f"(log-normal); D={dim}, H={heads}, local window {window}; {repeats} interleaved "
        f"repeats, medians of process CPU time and of wall time; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads. "
        f"Real tokens are 1/{padded / real:.1f} of the padded ones, real scores "
        f"1/{scores_padded / scores_real:.1f}."
    )
    print(facts)
    print(table)
    if args.write_docs:
        write_docs("varlen", f"{facts}\n\n{table}")


if __name__ == "__main__":
    main()
