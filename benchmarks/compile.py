"""torch.compile (inductor) vs eager for the main modules on the CPU.

Run: ``.venv/bin/python benchmarks/compile.py`` (``--quick`` for a smoke run;
``--write-docs`` puts the table into docs/performance.md, as ``make bench`` does).

B=4, D=256, H=8, fp32. Modules: ``MultiHeadAttention`` (L=512), ``LocalAttention``
(window 64, L=2048), ``TransformerBlock`` (L=512) and a 2-block ``Encoder`` (L=512).
"inference" is eval mode under ``torch.no_grad``, "training" is forward + backward. The
compiled module is ``torch.compile(module, fullgraph=True)`` (default inductor); its first
call (compilation) is timed separately and excluded from the medians; the compiled output
is checked against eager before timing. Times are medians of
interleaved repeats (benchmarks/_harness.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    add_docs_argument,
    interleaved_medians,
    markdown_table,
    write_docs,
)

from mmattn import Encoder, LocalAttention, MultiHeadAttention, Tokens, TransformerBlock  # noqa: E402

BATCH, EMBED, HEADS = 4, 256, 8


def cases(quick: bool):
    """(name, module, length, call) with call(module, x) -> a tensor."""
    def attend(m, x):
        return m(x)[0]

    def blocks(m, x):
        return m(Tokens(x)).x

    if quick:
        return [("MultiHeadAttention", MultiHeadAttention(EMBED, HEADS), 128, attend)]
    return [
        ("MultiHeadAttention", MultiHeadAttention(EMBED, HEADS), 512, attend),
        ("LocalAttention w=64", LocalAttention(EMBED, HEADS, window_size=64), 2048, attend),
        ("TransformerBlock", TransformerBlock(EMBED, HEADS), 512, blocks),
        ("Encoder depth 2", Encoder(EMBED, depth=2, num_heads=HEADS), 512, blocks),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small module, 3 repeats")
    parser.add_argument("--repeats", type=int, default=None)
    add_docs_argument(parser)
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 7)
    torch.manual_seed(0)
    rows = []
    for name, module, length, call in cases(args.quick):
        compiled = torch.compile(module, fullgraph=True)
        for mode in ("inference", "training"):
            module.train(mode == "training")
            x = torch.randn(BATCH, length, EMBED, requires_grad=mode == "training")

            def run(m, x=x, mode=mode, call=call):
                if mode == "training":
                    call(m, x).sum().backward()
                else:
                    with torch.no_grad():
                        call(m, x)

            start = time.perf_counter()
            run(compiled)
            compile_s = time.perf_counter() - start
            with torch.no_grad():  # the compiled module must compute what eager does
                torch.testing.assert_close(call(compiled, x), call(module, x),
                                           atol=1e-4, rtol=1e-4)
            medians = interleaved_medians(
                {"eager": lambda m=module: run(m), "compiled": lambda m=compiled: run(m)},
                repeats,
            )
            rows.append([
                name, length, mode, f"{medians['eager'] * 1e3:.1f}",
                f"{medians['compiled'] * 1e3:.1f}", medians["compiled"] / medians["eager"],
                f"{compile_s:.1f}",
            ])
            print(f"{name} L={length} {mode}: eager {medians['eager'] * 1e3:.1f} ms, "
                  f"compiled {medians['compiled'] * 1e3:.1f} ms "
                  f"(first call {compile_s:.1f} s)", flush=True)
    table = markdown_table(
        ["module", "L", "mode", "eager ms", "compiled ms", "compiled/eager", "compile s"], rows
    )
    print()
    print(table)
    if args.write_docs:
        write_docs("compile", table)


if __name__ == "__main__":
    main()
