"""Score modifiers: what sinks, ALiBi and softcap cost on the fused kernels.

Run: ``.venv/bin/python benchmarks/modifiers.py`` (``--quick`` for a short smoke run,
``--write-docs`` to update docs/performance.md).

CPU, fp32, one torch thread; times are the process's CPU time (``time.process_time``),
medians of interleaved repeats (benchmarks/_harness.py), so the load other processes put on
a shared machine stretches them little. Every contender is a whole module with the same
weights; only the modifier differs:

- MHA, B=1, D=512, H=8 (head width 64), L=1024, fwd+bwd: ``plain`` vs ``sinks`` (the
  logsumexp identity on torch's CPU flash kernel) — target ≤ 1.10×; ``softcap`` (explicit
  path: no fused kernel caps scores) for comparison;
- LocalAttention, window 128, same widths, L=16384, forward and fwd+bwd: ``plain`` vs
  ``alibi`` (the band's one (1, H, s, t) term; the blocks at either end run again under their
  own masks) — target ≤ 1.25×; ``sinks``; and with the last eighth of the keys padded,
  ``plain+pad`` vs ``alibi+pad`` (the blocks that hold padding run again too).

Peak memory is the growth of a fresh child process's peak RSS over one call
(benchmarks/_harness.py), after a warm-up.
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

from mmattn import LocalAttention, MultiHeadAttention  # noqa: E402

HEADS, EMBED, WINDOW = 8, 512, 128
MIB = 1024**2

#: contender -> (layer, modifier keyword arguments, padded keys)
CONTENDERS = {
    "mha": {"plain": {}, "sinks": {"sinks": True}, "softcap": {"softcap": 30.0}},
    "local": {"plain": {}, "alibi": {"alibi": True}, "sinks": {"sinks": True},
              "plain+pad": {}, "alibi+pad": {"alibi": True}},
}


def build(layer: str, name: str, length: int):
    """A zero-argument callable running one call, and its mode-independent module."""
    torch.manual_seed(0)
    kwargs = CONTENDERS[layer][name]
    if layer == "mha":
        module = MultiHeadAttention(EMBED, HEADS, **kwargs)
    else:
        module = LocalAttention(EMBED, HEADS, WINDOW, **kwargs)
    if getattr(module, "sinks", None) is not None:
        with torch.no_grad():
            module.sinks.normal_()
    padding = None
    if name.endswith("+pad"):
        padding = torch.zeros(1, length, dtype=torch.bool)
        padding[0, -length // 8:] = True
    return module, padding


def run_once(module, x: torch.Tensor, padding, mode: str) -> None:
    if mode == "fwd+bwd":
        module(x, key_padding_mask=padding)[0].sum().backward()
    else:
        with torch.inference_mode():
            module(x, key_padding_mask=padding)


def child(layer: str, name: str, length: int, mode: str) -> None:
    """One contender's peak RSS growth over one call (after a warm-up); prints JSON."""
    torch.set_num_threads(1)
    module, padding = build(layer, name, length)
    x = torch.randn(1, length, EMBED, requires_grad=mode == "fwd+bwd")
    run_once(module, x, padding, mode)
    print_child_peak(peak_rss_growth(lambda: run_once(module, x, padding, mode)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory children")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    add_docs_argument(parser)
    args = parser.parse_args()
    if args.child:
        layer, name, length, mode = args.child
        child(layer, name, int(length), mode)
        return
    torch.set_num_threads(1)
    runs = [("mha", 256 if args.quick else 1024, "fwd+bwd")]
    local = 2048 if args.quick else 16384
    runs += [("local", local, "forward"), ("local", local, "fwd+bwd")]
    rows, ratios = [], {}
    for layer, length, mode in runs:
        x = torch.randn(1, length, EMBED, requires_grad=mode == "fwd+bwd")
        built = {n: build(layer, n, length) for n in CONTENDERS[layer]}
        contenders = {
            n: (lambda m=m, p=p, x=x, mode=mode: run_once(m, x, p, mode))
            for n, (m, p) in built.items()
        }
        repeats = args.repeats or (3 if args.quick else (7 if layer == "mha" else 5))
        _, cpu = interleaved_samples(contenders, repeats)
        medians = {n: statistics.median(ts) for n, ts in cpu.items()}
        for n in contenders:
            memory = None
            if not args.no_memory:
                peak = child_peak_memory(__file__, [layer, n, str(length), mode], n)
                memory = None if peak is None else peak / MIB
            ratio = medians[n] / medians["plain"]
            ratios[layer, mode, n] = ratio
            rows.append([
                "MultiHeadAttention" if layer == "mha" else f"LocalAttention(w={WINDOW})",
                length, mode, n, medians[n] * 1e3, f"{ratio:.3f}",
                "—" if memory is None else f"{memory:.0f}",
            ])
        print(f"{layer} L={length} {mode}: " + ", ".join(
            f"{n}={medians[n] * 1e3:.0f}ms ({medians[n] / medians['plain']:.3f}x)"
            for n in contenders), flush=True)
    table = markdown_table(
        ["layer", "L", "mode", "contender", "median CPU ms", "× plain", "peak growth MiB"], rows
    )
    print()
    print(table)
    targets = [
        f"- sinks on MHA, fwd+bwd: {ratios['mha', 'fwd+bwd', 'sinks']:.3f}x plain "
        "(target <= 1.10)",
        f"- ALiBi on LocalAttention, forward: {ratios['local', 'forward', 'alibi']:.3f}x, "
        f"fwd+bwd: {ratios['local', 'fwd+bwd', 'alibi']:.3f}x plain (target <= 1.25)",
    ]
    print("\n" + "\n".join(targets))
    if args.write_docs:
        write_docs("modifiers", table + "\n\n" + "\n".join(targets))


if __name__ == "__main__":
    main()
