"""Attention patterns on a GPU: FlexAttention with ``Pattern.mask_mod`` / ``block_mask()``
against a hand-written mask_mod, and the mask build against ``create_block_mask`` (issue 33).

Run (on a CUDA machine): ``python benchmarks/gpu_patterns.py`` (``--quick``: fewer repeats;
``--full``: also flex with ``block_mask()`` fwd+bwd, one more compile; ``--out FILE``: also
write the table there). The mask builds run first and the table is printed after each part,
so a run cut short by a time limit still shows what it measured. Without CUDA it prints why
and exits 0. ``--device cpu --small`` is a smoke run of the same code on small sizes (no
figure of it means anything).

Rows (bf16, medians of interleaved, synchronised repeats):

1. ``documents fwd+bwd``: packed documents (B=4, L=8192, random lengths 128..1024, causal in
   each), D=1024, 16 heads, the same q/k/v and output projections; compiled
   ``flex_attention`` with ``create_block_mask(P.same("documents") & P.causal()).mask_mod``
   vs a hand-written ``doc[b, q] == doc[b, k] & (k <= q)`` (target <= 1.15x), and
   (``--full``) with ``pattern.compile(tokens, 128).block_mask()``;
2. ``documents mask build``: L=32768, B=1: ``pattern.compile(tokens, 128)`` (and with
   ``.block_mask()``) vs ``create_block_mask`` of the hand-written rule (target <= 1.0x);
3. ``per-modality mask build``: text 1024 (causal) | image 64 x 64 (neighbourhood 7) | audio
   4096 (window 32), text <-> everything across, L=9216, B=2: tokens -> a ready mask, as the
   blocks build it (``compile`` + the kernel's bucket plan) and as ``block_mask()``, vs
   ``create_block_mask(pattern.mask_mod(tokens))`` (target <= 10 ms).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _harness import interleaved_medians, machine, markdown_table  # noqa: E402

from mmattn import Tokens  # noqa: E402
from mmattn import patterns as P  # noqa: E402

DOCUMENTS = P.same("documents") & P.causal()
PER_MODALITY = P.per_modality(
    within={"text": P.causal(), "image": P.neighborhood(7), "audio": P.window(32)},
    across=P.modality(query="text") | P.modality(key="text"),
)


def document_ids(batch: int, length: int, device: str, seed: int = 0) -> torch.Tensor:
    """(batch, length) int64 document ids, lengths drawn from 128..1024."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        sizes, total = [], 0
        while total < length:
            sizes.append(int(torch.randint(128, 1025, (), generator=gen)))
            total += sizes[-1]
        rows.append(torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))[:length])
    return torch.stack(rows).to(device)


def per_modality_tokens(device: str, small: bool) -> Tokens:
    text, side, audio = (64, 16, 192) if small else (1024, 64, 4096)
    parts = {"text": Tokens(torch.zeros(2, text, 1, device=device)),
             "image": Tokens(torch.zeros(2, side * side, 1, device=device),
                             meta={"grid": (side, side)}),
             "audio": Tokens(torch.zeros(2, audio, 1, device=device))}
    return Tokens.cat(parts)


def timed(calls: dict, repeats: int, device: str) -> dict:
    sync = torch.cuda.synchronize if device == "cuda" else None
    return interleaved_medians(calls, repeats=repeats, warmup=2, sync=sync)


def documents_fwd_bwd(args, rows: list) -> None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch, length, width, heads = (2, 256, 64, 4) if args.small else (4, 8192, 1024, 16)
    device, dtype = args.device, torch.bfloat16
    doc = document_ids(batch, length, device)
    tokens = Tokens(torch.zeros(batch, length, 1, device=device), meta={"documents": doc})

    def hand(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx)

    masks = {"flex, hand-written mask_mod": create_block_mask(
                 hand, batch, None, length, length, device=device),
             "flex, Pattern.mask_mod": create_block_mask(
                 DOCUMENTS.mask_mod(tokens), batch, None, length, length, device=device)}
    if args.full:
        masks["flex, SparseMask.block_mask()"] = DOCUMENTS.compile(tokens, 128).block_mask()
    torch.manual_seed(0)
    qkv = torch.nn.Linear(width, 3 * width, device=device, dtype=dtype)
    proj = torch.nn.Linear(width, width, device=device, dtype=dtype)
    backward = device == "cuda"  # (CPU flex has no backward: the smoke run is forward only)
    x = torch.randn(batch, length, width, device=device, dtype=dtype, requires_grad=backward)
    flex = torch.compile(flex_attention)

    def step(block_mask):
        def run():
            with torch.set_grad_enabled(backward):
                q, k, v = qkv(x).view(batch, length, 3, heads, -1).permute(2, 0, 3, 1, 4)
                out = flex(q, k, v, block_mask=block_mask)
                out = proj(out.transpose(1, 2).reshape(batch, length, width)).sum()
            if backward:
                out.backward()
        return run

    calls = {name: step(mask) for name, mask in masks.items()}
    medians = timed(calls, 5 if args.quick else 10, device)
    base = medians["flex, hand-written mask_mod"]
    for name, t in medians.items():
        rows.append([f"documents B={batch} L={length} {'fwd+bwd' if backward else 'fwd'}",
                     name, t * 1e3, t / base,
                     "<= 1.15x" if "Pattern" in name else ""])


def documents_build(args, rows: list) -> None:
    from torch.nn.attention.flex_attention import create_block_mask

    length, device = (2048 if args.small else 32768), args.device
    doc = document_ids(1, length, device, seed=1)
    tokens = Tokens(torch.zeros(1, length, 1, device=device), meta={"documents": doc})

    def hand(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx)

    calls = {
        "create_block_mask, hand-written": lambda: create_block_mask(
            hand, 1, None, length, length, device=device),
        "pattern.compile(tokens, 128)": lambda: DOCUMENTS.compile(tokens, 128),
        "pattern.compile(tokens, 128).block_mask()": lambda: DOCUMENTS.compile(
            tokens, 128).block_mask(),
    }
    medians = timed(calls, 5 if args.quick else 15, device)
    base = medians["create_block_mask, hand-written"]
    for name, t in medians.items():
        rows.append([f"documents L={length} mask build", name, t * 1e3, t / base,
                     "<= 1.0x" if name == "pattern.compile(tokens, 128)" else ""])


def per_modality_build(args, rows: list) -> None:
    from torch.nn.attention.flex_attention import create_block_mask

    tokens = per_modality_tokens(args.device, args.small)
    length = tokens.length
    calls = {
        "create_block_mask(pattern.mask_mod)": lambda: create_block_mask(
            PER_MODALITY.mask_mod(tokens), 2, None, length, length, device=args.device),
        "pattern.compile + plan (the blocks' pattern=)": lambda: PER_MODALITY.compile(
            tokens).plan(1024),
        "pattern.compile(tokens, 128).block_mask()": lambda: PER_MODALITY.compile(
            tokens, 128).block_mask(),
    }
    medians = timed(calls, 5 if args.quick else 15, args.device)
    base = medians["create_block_mask(pattern.mask_mod)"]
    for name, t in medians.items():
        rows.append([f"per-modality B=2 L={length} tokens -> mask", name, t * 1e3, t / base,
                     "" if name.startswith("create") else "<= 10 ms"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--full", action="store_true", help="also flex with block_mask()")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--small", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--out", type=Path, help="also write the markdown table here")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_patterns: skipped, needs CUDA")
        return
    rows: list = []
    for part in (documents_build, per_modality_build, documents_fwd_bwd):  # cheapest first
        part(args, rows)
        table = markdown_table(["case", "contender", "ms", "x first row", "target"], rows)
        text = f"{machine(args.device)}, torch {torch.__version__}\n\n{table}\n"
        print(f"after {part.__name__}:\n{text}", flush=True)
        if args.out is not None:
            args.out.write_text(text)


if __name__ == "__main__":
    main()
