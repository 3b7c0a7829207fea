"""NeighborhoodAttention vs FlexAttention with the same window as a block mask (CUDA).

Run (on a CUDA machine; benchmarks/gpu_check.sh does): ``python benchmarks/gpu_neighborhood.py``
(``--quick``: the 64² grid only). B=2, 4 heads of width 32, kernel 7, grids 64² and 128².

1. Correctness: outputs and the gradients of q, k, v of our kernel
   (``kernels.neighborhood.neighborhood_attend``) equal compiled ``flex_attention`` with a
   ``BlockMask`` of NATTEN's window (fp32, 1e-4).
2. Time of fwd+bwd (bf16) of both, medians of interleaved, synchronised repeats.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import interleaved_medians, markdown_table  # noqa: E402

from mmattn.kernels.neighborhood import neighborhood_attend  # noqa: E402

B, H, E, K = 2, 4, 32, 7


def flex_call(side: int):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def window(b, h, q_idx, kv_idx):  # NATTEN's clamped window, dilation 1, k <= side
        rq, cq, rk, ck = q_idx // side, q_idx % side, kv_idx // side, kv_idx % side
        r0 = torch.clamp(rq - K // 2, 0, side - K)
        c0 = torch.clamp(cq - K // 2, 0, side - K)
        return (rk >= r0) & (rk < r0 + K) & (ck >= c0) & (ck < c0 + K)

    length = side * side
    mask = create_block_mask(window, None, None, length, length, device="cuda")
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, block_mask=mask)


def ours_call(side: int):
    return lambda q, k, v: neighborhood_attend(q, k, v, (side, side), (K, K))[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    rows, failures = [], 0
    for side in [64] if args.quick else [64, 128]:
        flex = flex_call(side)
        ours = ours_call(side)
        q, k, v = (torch.randn(B, H, side * side, E, device="cuda", requires_grad=True)
                   for _ in range(3))
        grad = torch.randn_like(q)
        results = {}
        for name, fn in (("ours", ours), ("flex", flex)):
            out = fn(q, k, v)
            results[name] = (out, *torch.autograd.grad(out, (q, k, v), grad))
        err = max((a - b).abs().max().item() for a, b in zip(results["ours"], results["flex"]))
        ok = err < 1e-4
        failures += not ok
        print(f"{side}²: max |ours - flex| over out, dq, dk, dv = {err:.2e} "
              f"({'ok' if ok else 'MISMATCH'})", flush=True)
        qb, kb, vb = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
        medians = interleaved_medians(
            {n: (lambda fn=fn, qkv=(qb, kb, vb): fn(*qkv).sum().backward()) for n, fn in
             (("ours", ours), ("flex", flex))},
            repeats=10, warmup=2, calls=None, device="cuda",
        )
        for name, t in medians.items():
            rows.append([f"{side}²", name, t * 1e3, t / medians["flex"]])
    print(markdown_table(["grid", "contender", "fwd+bwd ms (bf16)", "× flex time"], rows))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
