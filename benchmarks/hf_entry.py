"""What the transformers entry's input checks cost: ``attention_forward`` with and without them.

The checks (``huggingface._check_inputs``) read shapes, dtypes and devices only, so their
cost is a fixed few microseconds per call. This compares, interleaved in one process with one
torch thread, the entry as shipped against the same entry with the checks replaced by a
function that only returns the head-group count, on the masks transformers sends (bool, and
float in the model's dtype), at a small size (where a fixed cost shows most) and at a
layer-sized one. Medians of process CPU time per call.

    python benchmarks/hf_entry.py            # prints the table
    python benchmarks/hf_entry.py --quick    # fewer repeats
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._harness import interleaved_samples, markdown_table  # noqa: E402
from mmattn.integrations import huggingface as hf  # noqa: E402


def _unchecked(module, query, key, *args) -> int:
    return query.shape[1] // key.shape[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    checked = hf._check_inputs
    layer = nn.Module()
    layer.is_causal = False
    rows = []
    calls = 20 if args.quick else 50
    for b, h, kv, length, e in ((1, 4, 2, 16, 16), (2, 8, 4, 256, 64)):
        q = torch.randn(b, h, length, e)
        k, v = torch.randn(b, kv, length, e), torch.randn(b, kv, length, e)
        keep = torch.ones(b, 1, length, length, dtype=torch.bool).tril()
        masks = {"bool": keep, "float": torch.zeros(keep.shape).masked_fill(~keep, -1e9)}
        for kind, mask in masks.items():
            def run(check, mask=mask, q=q, k=k, v=v) -> None:
                hf._check_inputs = check
                try:
                    with torch.no_grad():
                        for _ in range(calls):
                            hf.attention_forward(layer, q, k, v, mask)
                finally:
                    hf._check_inputs = checked

            _, cpu = interleaved_samples(
                {"checked": lambda r=run: r(checked), "unchecked": lambda r=run: r(_unchecked)},
                repeats=7 if args.quick else 21,
            )
            per_call = {n: statistics.median(t) / calls * 1e6 for n, t in cpu.items()}
            rows.append([
                f"({b}, {h}/{kv}, {length}, {e})", kind, f"{per_call['checked']:.1f}",
                f"{per_call['unchecked']:.1f}",
                f"{per_call['checked'] / per_call['unchecked']:.3f}",
            ])
    print(markdown_table(
        ["q (b, h/kv, l, e)", "mask", "with checks, µs/call", "without, µs/call", "ratio"],
        rows,
    ))


if __name__ == "__main__":
    main()
