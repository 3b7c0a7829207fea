"""MultiHeadAttention vs nn.MultiheadAttention vs the tutorial's naive code, side by side.

Run: ``.venv/bin/python benchmarks/mha.py`` (``--quick`` for a short smoke run).

B=8, D=256, H=8, fp32 on the CPU, L in {128, 512, 1024, 2048} (``--device cuda
--dtype bfloat16`` for the GPU check in ``benchmarks/gpu_check.sh``). Training is forward +
backward in train mode (dropout 0); inference is eval mode under ``torch.inference_mode``.
Every contender is self-attention on the same input with the same weights.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    add_docs_argument,
    interleaved_medians,
    markdown_table,
    write_docs,
)

from mmattn import MultiHeadAttention  # noqa: E402


class TutorialAttention(nn.Module):
    """The seed tutorial's code, batched: three Linear layers, view, matmul/softmax/matmul."""

    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_linear = nn.Linear(embed_dim, embed_dim)
        self.k_linear = nn.Linear(embed_dim, embed_dim)
        self.v_linear = nn.Linear(embed_dim, embed_dim)
        self.out = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h = self.num_heads
        q = self.q_linear(x).view(b, n, h, d // h).transpose(1, 2)
        k = self.k_linear(x).view(b, n, h, d // h).transpose(1, 2)
        v = self.v_linear(x).view(b, n, h, d // h).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d // h)
        out = torch.matmul(F.softmax(scores, dim=-1), v)
        return self.out(out.transpose(1, 2).reshape(b, n, d))


def build(embed_dim: int, num_heads: int, device: str = "cpu", dtype=torch.float32):
    ref = nn.MultiheadAttention(embed_dim, num_heads, batch_first=True, device=device,
                                dtype=dtype)
    ours = MultiHeadAttention.from_torch(ref)
    naive = TutorialAttention(embed_dim, num_heads).to(device, dtype)
    calls = {
        "torch": lambda x: ref(x, x, x, need_weights=False)[0],
        "ours": lambda x: ours(x)[0],
        "torch_w": lambda x: ref(x, x, x, need_weights=True)[0],
        "ours_w": lambda x: ours(x, need_weights=True)[0],
        "naive": naive,
    }
    return (ref, ours, naive), calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    add_docs_argument(parser)
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    batch, embed_dim, num_heads = 8, 256, 8
    lengths = [128, 256] if args.quick else [128, 512, 1024, 2048]
    modules, calls = build(embed_dim, num_heads, args.device, dtype)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else None
    # on CUDA: CUDA events around k calls a sample (benchmarks/_harness.py)
    timing = {"calls": None, "device": "cuda"} if sync else {}
    where = (torch.cuda.get_device_name() if sync else
             f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print(f"# torch {torch.__version__}, {args.device} {args.dtype}, {where}")
    rows = []
    for mode in ("training", "inference"):
        for length in lengths:
            # short runs are the noisiest: repeat them more (medians of 31 at L=128)
            repeats = args.repeats or (3 if args.quick else {128: 31, 512: 15, 1024: 9}.get(
                length, 5))
            x = torch.randn(batch, length, embed_dim, device=args.device, dtype=dtype,
                            requires_grad=mode == "training")
            for m in modules:
                m.train(mode == "training")
            if mode == "training":
                def run(fn, x=x):
                    fn(x).sum().backward()
                contenders = {name: (lambda fn=fn: run(fn)) for name, fn in calls.items()}
                medians = interleaved_medians(contenders, repeats, sync=sync, **timing)
            else:
                def infer(fn, x=x):
                    with torch.inference_mode():
                        fn(x)
                contenders = {name: (lambda fn=fn: infer(fn)) for name, fn in calls.items()}
                medians = interleaved_medians(contenders, repeats, sync=sync, **timing)
            rows.append([
                mode, length,
                medians["torch"] * 1e3, medians["ours"] * 1e3,
                medians["ours"] / medians["torch"],
                medians["torch_w"] * 1e3, medians["ours_w"] * 1e3,
                medians["ours_w"] / medians["torch_w"],
                medians["naive"] * 1e3, medians["naive"] / medians["torch"],
            ])
            print(f"{mode} L={length}: ours/torch={rows[-1][4]:.3f} "
                  f"ours_w/torch_w={rows[-1][7]:.3f}", flush=True)
    header = [
        "mode", "L", "torch ms", "ours ms", "ours/torch", "torch w ms", "ours w ms",
        "ours_w/torch_w", "naive ms", "naive/torch",
    ]
    table = markdown_table(header, rows)
    print()
    print(table)
    if args.write_docs:
        plain = args.device == "cpu" and args.dtype == "float32"
        write_docs("mha" if plain else f"mha-{args.device}-{args.dtype}", table,
                   device=args.device)


if __name__ == "__main__":
    main()
