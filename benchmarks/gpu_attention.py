"""GPU attention throughput: our modules vs the raw kernels they wrap (bf16, CUDA).

Run (on a CUDA machine; benchmarks/gpu_check.sh does): ``python benchmarks/gpu_attention.py``
(``--quick`` for L=1024 only; ``--write-docs`` writes the tables into docs/performance.md).

1. ``MultiHeadAttention`` vs raw ``F.scaled_dot_product_attention`` at L in {1024, 4096,
   16384}, D=1024, H=16, B·L = 16384 tokens. The raw contender does the same work: four
   ``nn.Linear`` projections (the projections' fair share) around one SDPA call. TFLOP/s
   counts 2·B·L·D² per projection and 4·B·L²·D for attention (QKᵀ and PV); fwd+bwd counts
   3× the forward. Target: ours ≥ 90 % of raw.
2. ``LocalAttention`` (window 256) vs FlexAttention (``torch.compile(flex_attention)``
   with a sliding-window ``BlockMask``) around the same projections, L in {4096, 16384}.
   Target: ours no slower.

Times are medians of interleaved repeats (benchmarks/_harness.py), synchronised.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    add_docs_argument,
    interleaved_medians,
    markdown_table,
    write_docs,
)

from mmattn import LocalAttention, MultiHeadAttention  # noqa: E402

D, H, WINDOW, TOKENS = 1024, 16, 256, 16384


class RawSDPA(nn.Module):
    """The same four projections as ``ours`` around one raw SDPA call."""

    def __init__(self, ours: MultiHeadAttention, kernel=None) -> None:
        super().__init__()
        self.ours = ours
        self.kernel = kernel or F.scaled_dot_product_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.ours
        q, k, v = (rearrange(p(x), "b l (h e) -> b h l e", h=H)
                   for p in (m.q_proj, m.k_proj, m.v_proj))
        return m.out_proj(rearrange(self.kernel(q, k, v), "b h l e -> b l (h e)"))


def _step(fn, x, train: bool):
    def run():
        if train:
            fn(x).sum().backward()
        else:
            with torch.no_grad():
                fn(x)
    return run


def mha_vs_sdpa(lengths, repeats):
    rows = []
    for length in lengths:
        batch = max(1, TOKENS // length)
        ours = MultiHeadAttention(D, H, device="cuda", dtype=torch.bfloat16)
        raw = RawSDPA(ours)
        flops = 4 * 2 * batch * length * D * D + 4 * batch * length * length * D
        for train in (False, True):
            x = torch.randn(batch, length, D, device="cuda", dtype=torch.bfloat16,
                            requires_grad=train)
            t = interleaved_medians(
                {"ours": _step(lambda x, m=ours: m(x)[0], x, train), "raw": _step(raw, x, train)},
                repeats, warmup=2, calls=None, device="cuda",
            )
            work = flops * (3 if train else 1)
            tf = {k: work / v / 1e12 for k, v in t.items()}
            rows.append([length, batch, "fwd+bwd" if train else "forward", tf["ours"],
                         tf["raw"], f"{tf['ours'] / tf['raw']:.1%}"])
            print(rows[-1], flush=True)
    return markdown_table(
        ["L", "B", "mode", "ours TFLOP/s", "raw SDPA TFLOP/s", "ours/raw (target ≥ 90 %)"], rows
    )


def local_vs_flex(lengths, repeats):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)
    rows = []
    for length in lengths:
        ours = LocalAttention(D, H, window_size=WINDOW, device="cuda", dtype=torch.bfloat16)

        def band(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx).abs() <= WINDOW

        block_mask = create_block_mask(band, None, None, length, length, device="cuda")
        flex = RawSDPA(ours, lambda q, k, v, bm=block_mask: compiled(q, k, v, block_mask=bm))
        for train in (False, True):
            x = torch.randn(1, length, D, device="cuda", dtype=torch.bfloat16,
                            requires_grad=train)
            t = interleaved_medians(
                {"ours": _step(lambda x, m=ours: m(x)[0], x, train), "flex": _step(flex, x, train)},
                repeats, warmup=2, calls=None, device="cuda",
            )
            rows.append([length, "fwd+bwd" if train else "forward", t["ours"] * 1e3,
                         t["flex"] * 1e3, t["ours"] / t["flex"]])
            print(rows[-1], flush=True)
    return markdown_table(
        ["L", "mode", "LocalAttention ms", "FlexAttention ms", "ours/flex (target ≤ 1)"], rows
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--part", choices=["mha", "local", "all"], default="all")
    add_docs_argument(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_attention.py needs CUDA")
    torch.manual_seed(0)
    repeats = args.repeats or (3 if args.quick else 10)
    if args.part in ("mha", "all"):
        table = mha_vs_sdpa([1024] if args.quick else [1024, 4096, 16384], repeats)
        print(table)
        if args.write_docs:
            write_docs("gpu-mha", table, device="cuda")
    if args.part in ("local", "all"):
        table = local_vs_flex([4096] if args.quick else [4096, 16384], repeats)
        print(table)
        if args.write_docs:
            write_docs("gpu-local", table, device="cuda")


if __name__ == "__main__":
    main()
