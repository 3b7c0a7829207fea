"""Issue 34's table side by side: mmattn vs varlen_attn, flex (hand-written mask_mod), flex
(``Pattern.mask_mod``) and dense SDPA, each with the same four projections (CUDA, bf16).

Run (on a CUDA machine; benchmarks/gpu_check.sh does): ``python benchmarks/gpu_engines.py
--write-docs`` (the "GPU engines" block of docs/performance.md). ``--device cpu --tiny``
checks the script's logic on a CPU at toy sizes (flex runs its CPU forward only, varlen is
left out; the numbers mean nothing).

Rows (D=1024, H=16 unless tiny): packed documents (B=4, L=8192, lengths 128..1024, causal
inside); packed Tokens (benchmarks/varlen.py's lengths); per-modality (B=2, text 1024
causal, image 64² neighbourhood 7, audio 4096 window 128); LocalAttention (window 256,
L=16384, fwd and fwd+bwd); NeighborhoodAttention (k=7, 64² and 128²); MultiHeadAttention
forward (L=1024, B=16); EdgeAttention vs PyG's TransformerConv (N=100k, 16 edges a node,
fp32; as benchmarks/edge.py). Time: medians of interleaved, synchronised repeats; peak memory:
one more run after resetting the peak counter. The mmattn row names the engines its
attention calls ran (``explain``'s listener). A contender that fails prints its error in
the table instead of a time.
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
from _harness import add_docs_argument, interleaved_medians, markdown_table, write_docs  # noqa

from mmattn import LocalAttention, MultiHeadAttention, NeighborhoodAttention, Tokens  # noqa
from mmattn import patterns as P  # noqa: E402
from mmattn.kernels import dense as _kernel  # noqa: E402


class Projected(nn.Module):
    """The four projections of ``ours`` around ``kernel(q, k, v)`` on (b, h, l, e)."""

    def __init__(self, ours: nn.Module, kernel, heads: int) -> None:
        super().__init__()
        self.ours, self.kernel, self.heads = ours, kernel, heads

    def forward(self, x):
        m = self.ours
        q, k, v = (rearrange(p(x), "b l (h e) -> b h l e", h=self.heads)
                   for p in (m.q_proj, m.k_proj, m.v_proj))
        return m.out_proj(rearrange(self.kernel(q, k, v), "b h l e -> b l (h e)"))


def flex_kernel(mask_mod, batch, length, device, score_mod=None):
    from torch.nn.attention.flex_attention import create_block_mask

    from mmattn.kernels.flex import compiled

    mask = create_block_mask(mask_mod, batch, None, length, length, device=device,
                             BLOCK_SIZE=128 if device.type == "cuda" else 16,
                             _compile=device.type == "cuda")
    return lambda q, k, v: compiled(device.type)(q, k, v, block_mask=mask,
                                                   score_mod=score_mod)


def once(build):
    """A contender built on its first call (outside the timing), then reused."""
    made = []

    def run(x):
        if not made:
            made.append(build())
        return made[0](x)

    return run


def varlen_kernel(cu, max_len, window=(-1, -1)):
    from mmattn.kernels.varlen import packed_attend

    def kernel(q, k, v):
        b, h, length, e = q.shape
        rows = [t.transpose(1, 2).reshape(b * length, h, e) for t in (q, k, v)]
        out = packed_attend(*rows, cu, cu, max_len, max_len, window=window)
        return out.view(b, length, h, e).transpose(1, 2)

    return kernel


def dense_kernel(allowed):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def pattern_runs(mha, pattern, tokens, hand, hand_batch, cfg):
    """The contenders of a pattern: mmattn's SparseMask, flex with the hand-written mask_mod
    (one for every item when ``hand_batch`` is None) and with ``Pattern.mask_mod``, and
    dense SDPA on ``pattern.dense``."""
    batch, length, dev, heads = tokens.batch_size, tokens.length, tokens.device, cfg["heads"]
    sparse = pattern.compile(tokens, block_size=cfg["block"])
    return {
        "mmattn": lambda x: mha(x, attn_mask=sparse)[0],
        "flex hand mask_mod": Projected(mha, flex_kernel(hand, hand_batch, length, dev), heads),
        "flex Pattern.mask_mod": once(lambda: Projected(mha, flex_kernel(
            pattern.mask_mod(tokens), batch, length, dev), heads)),
        "dense SDPA": Projected(mha, dense_kernel(pattern.dense(tokens)[:, None]), heads),
    }


def doc_lengths(length, low, high, gen):
    out, total = [], 0
    while total < length:
        n = min(int(torch.randint(low, high + 1, (1,), generator=gen)), length - total)
        out.append(n)
        total += n
    return out


def case_documents(cfg, dev):
    batch, length = cfg["doc_batch"], cfg["doc_len"]
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls))
                       for ls in (doc_lengths(length, *cfg["doc_range"], gen)
                                  for _ in range(batch))]).to(dev)
    tokens = Tokens(torch.zeros(batch, length, 1, device=dev), meta={"documents": ids})
    pattern = P.same("documents") & P.causal()
    mha = MultiHeadAttention(cfg["dim"], cfg["heads"]).to(dev, cfg["dtype"])
    doc = ids

    def hand(b, h, q, kv):
        return (doc[b, q] == doc[b, kv]) & (kv <= q)

    runs = pattern_runs(mha, pattern, tokens, hand, batch, cfg)
    if dev.type == "cuda":
        from mmattn.kernels.varlen import runs as find_runs

        found = find_runs(ids)
        runs["varlen"] = Projected(mha, varlen_kernel(found.cu_seqlens, found.max_len, (-1, 0)),
                                   cfg["heads"])
    return f"packed documents B={batch}, L={length}", (batch, length), runs, "varlen"


def case_packed_tokens(cfg, dev):
    from varlen import lengths

    lens = lengths(cfg["tok_batch"], cfg["tok_mean"], cfg["tok_max"])
    offsets = torch.tensor([0, *lens], device=dev).cumsum(0)
    mha = MultiHeadAttention(cfg["dim"], cfg["heads"]).to(dev, cfg["dtype"])
    total = sum(lens)

    def ours(x):  # packed rows as torch's jagged nested tensor, as Tokens.packed holds them
        return mha(torch.nested.nested_tensor_from_jagged(x[0], offsets))[0].values()

    runs = {"mmattn": ours}
    if dev.type == "cuda":
        kernel = varlen_kernel(offsets.to(torch.int32), max(lens))
        runs["varlen"] = Projected(mha, kernel, cfg["heads"])
    return f"packed Tokens B={len(lens)}, {total} tokens", (1, total), runs, "varlen"


def case_per_modality(cfg, dev):
    text, side, audio = cfg["pm_text"], cfg["pm_side"], cfg["pm_audio"]
    batch = cfg["pm_batch"]
    parts = {"text": Tokens(torch.zeros(batch, text, 1)),
             "image": Tokens(torch.zeros(batch, side * side, 1), meta={"grid": (side, side)}),
             "audio": Tokens(torch.zeros(batch, audio, 1))}
    tokens = Tokens.cat(parts).to(dev)
    length = tokens.length
    pattern = P.per_modality(within={"text": P.causal(), "image": P.neighborhood(7),
                                     "audio": P.window(cfg["pm_window"])},
                             across=P.full())
    mha = MultiHeadAttention(cfg["dim"], cfg["heads"]).to(dev, cfg["dtype"])
    t0, t1 = text, text + side * side
    w, half = cfg["pm_window"], 3

    def hand(b, h, q, kv):
        img_q, img_k = (q >= t0) & (q < t1), (kv >= t0) & (kv < t1)
        aud_q, aud_k = q >= t1, kv >= t1
        txt_q, txt_k = q < t0, kv < t0
        rq, cq = (q - t0) // side, (q - t0) % side
        rk, ck = (kv - t0) // side, (kv - t0) % side
        r0 = torch.clamp(rq - half, 0, side - 7)
        c0 = torch.clamp(cq - half, 0, side - 7)
        image = img_q & img_k & (rk >= r0) & (rk < r0 + 7) & (ck >= c0) & (ck < c0 + 7)
        same = (img_q & img_k) | (aud_q & aud_k) | (txt_q & txt_k)
        return (~same) | (txt_q & txt_k & (kv <= q)) | image | \
            (aud_q & aud_k & ((q - kv).abs() <= w))

    runs = pattern_runs(mha, pattern, tokens, hand, None, cfg)
    return f"per-modality B={batch}, L={length}", (batch, length), runs, "flex hand mask_mod"


def case_local(cfg, dev):
    length, window = cfg["local_len"], cfg["local_window"]
    ours = LocalAttention(cfg["dim"], cfg["heads"], window_size=window).to(dev, cfg["dtype"])

    def band(b, h, q, kv):
        return (q - kv).abs() <= window

    runs = {"mmattn": lambda x: ours(x)[0],
            "flex hand mask_mod": Projected(ours, flex_kernel(band, None, length, dev),
                                            cfg["heads"])}
    if dev.type == "cuda":
        cu = torch.tensor([0, length], device=dev, dtype=torch.int32)
        runs["varlen"] = Projected(ours, varlen_kernel(cu, length, (window, window)),
                                   cfg["heads"])
    return f"LocalAttention w={window}, L={length}", (1, length), runs, "varlen"


def case_neighborhood(cfg, dev, side):
    ours = NeighborhoodAttention(cfg["dim"], cfg["heads"], kernel_size=7).to(dev, cfg["dtype"])
    length = side * side

    def window(b, h, q, kv):
        rq, cq, rk, ck = q // side, q % side, kv // side, kv % side
        r0, c0 = torch.clamp(rq - 3, 0, side - 7), torch.clamp(cq - 3, 0, side - 7)
        return (rk >= r0) & (rk < r0 + 7) & (ck >= c0) & (ck < c0 + 7)

    runs = {"mmattn": lambda x: ours(x, grid=(side, side))[0],
            "flex hand mask_mod": Projected(ours, flex_kernel(window, None, length, dev),
                                            cfg["heads"])}
    return f"NeighborhoodAttention k=7, {side}²", (1, length), runs, "flex hand mask_mod"


def case_mha(cfg, dev):
    mha = MultiHeadAttention(cfg["dim"], cfg["heads"]).to(dev, cfg["dtype"])
    runs = {"mmattn": lambda x: mha(x)[0],
            "dense SDPA": Projected(mha, F.scaled_dot_product_attention, cfg["heads"])}
    return (f"MultiHeadAttention B={cfg['mha_batch']}, L={cfg['mha_len']}",
            (cfg["mha_batch"], cfg["mha_len"]), runs, "dense SDPA")


def case_edge(cfg, dev):
    """EdgeAttention vs PyG's TransformerConv (fp32, D=64, 4 heads, no self loops), as
    benchmarks/edge.py on the CPU."""
    from edge import EMBED, HEADS, random_graph

    n = cfg["edge_nodes"]
    edge_index = random_graph(n).to(dev)
    torch.manual_seed(0)
    from mmattn import EdgeAttention

    edge = EdgeAttention(EMBED, HEADS, add_self_loops=False).to(dev)
    runs = {"mmattn": lambda x: edge(x, edge_index=edge_index)[0]}
    try:
        from torch_geometric.nn import TransformerConv

        conv = TransformerConv(EMBED, EMBED // HEADS, heads=HEADS, concat=True,
                               root_weight=False, beta=False).to(dev)
        runs["TransformerConv"] = lambda x: conv(x, edge_index)
    except ImportError:
        pass
    label = f"EdgeAttention N={n}, E={edge_index.shape[1]}, fp32"
    return label, lambda: torch.randn(n, EMBED, device=dev), runs, "TransformerConv"


def measure(label, shape, runs, anchor, cfg, dev, train):
    if callable(shape):  # the case makes its own input
        x = shape().requires_grad_(train)
    else:
        x = torch.randn(*shape, cfg["dim"], device=dev, dtype=cfg["dtype"], requires_grad=train)
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    steps, errors, engines = {}, {}, set()
    for name, fn in runs.items():
        def step(fn=fn):
            with torch.set_grad_enabled(train):
                out = fn(x)
                if train:
                    out.float().sum().backward()
        try:
            # compile, build masks: outside the timing; mmattn's calls say which engine ran
            ours = engines if name == "mmattn" else set()
            remove = _kernel.add_listener(
                lambda r, ours=ours: ours.add(r.get("engine") or r.get("path")))
            try:
                step()
            finally:
                remove()
            steps[name] = step
        except Exception as error:  # noqa: BLE001 - reported in the table
            text = " ".join(str(error).split())[:80].replace("|", "/")
            errors[name] = f"failed: {type(error).__name__}: {text}"
    times = interleaved_medians(steps, cfg["repeats"], warmup=1, sync=sync) if steps else {}
    peaks = {}
    for name, step in steps.items():
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated() / 2**30
    rows = []
    for name in runs:
        if name in errors:
            rows.append([label, "fwd+bwd" if train else "fwd", name, errors[name], "", ""])
            continue
        ratio = f"{times[name] / times[anchor]:.2f}x" if anchor in times else ""
        peak = f"{peaks[name]:.2f}" if name in peaks else "-"
        shown = f"mmattn ({', '.join(sorted(engines))})" if name == "mmattn" else name
        rows.append([label, "fwd+bwd" if train else "fwd", shown,
                     f"{1e3 * times[name]:.2f}", peak, ratio])
    return rows


SIZES = {
    "full": dict(dim=1024, heads=16, block=128, repeats=7, doc_batch=4, doc_len=8192,
                 doc_range=(128, 1024), tok_batch=32, tok_mean=200, tok_max=650, pm_batch=2,
                 pm_text=1024, pm_side=64, pm_audio=4096, pm_window=128, local_len=16384,
                 local_window=256, nbhd=(64, 128), mha_batch=16, mha_len=1024, edge_nodes=100_000),
    "tiny": dict(dim=32, heads=2, block=16, repeats=2, doc_batch=2, doc_len=48,
                 doc_range=(8, 20), tok_batch=4, tok_mean=10, tok_max=20, pm_batch=1,
                 pm_text=16, pm_side=8, pm_audio=24, pm_window=4, local_len=48,
                 local_window=5, nbhd=(8,), mha_batch=2, mha_len=32, edge_nodes=200),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy sizes (logic check)")
    parser.add_argument("--only", default="", help="comma-separated case names")
    add_docs_argument(parser)
    args = parser.parse_args()
    dev = torch.device(args.device)
    cfg = dict(SIZES["tiny" if args.tiny else "full"])
    cfg["dtype"] = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    cases = {
        "documents": lambda: case_documents(cfg, dev),
        "tokens": lambda: case_packed_tokens(cfg, dev),
        "per_modality": lambda: case_per_modality(cfg, dev),
        "local": lambda: case_local(cfg, dev),
        **{f"neighborhood{s}": (lambda s=s: case_neighborhood(cfg, dev, s))
           for s in cfg["nbhd"]},
        "mha": lambda: case_mha(cfg, dev),
        "edge": lambda: case_edge(cfg, dev),
    }
    only = [c for c in args.only.split(",") if c]
    train_modes = {"local": (False, True), "mha": (False, True)}
    rows = []
    for name, make in cases.items():
        if only and name not in only:
            continue
        try:
            label, shape, runs, anchor = make()
        except Exception as error:  # noqa: BLE001 - one broken case must not end the run
            rows.append([name, "", "", f"failed to build: {type(error).__name__}: {error}",
                         "", ""])
            continue
        modes = train_modes.get(name, (True,)) if dev.type == "cuda" else (False,)
        for train in modes:  # (no flex backward on the CPU)
            rows += measure(label, shape, runs, anchor, cfg, dev, train)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        print(markdown_table(["case", "pass", "contender", "ms", "peak GiB", "vs anchor"],
                             rows[-len(runs) * len(modes):]), flush=True)
    table = markdown_table(["case", "pass", "contender", "ms", "peak GiB", "vs anchor"], rows)
    print(table)
    if args.write_docs and not args.tiny:
        name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
        write_docs("gpu-engines", f"{name}, torch {torch.__version__}, "
                   f"{str(cfg['dtype'])[6:]}\n\n{table}", device=str(dev))


if __name__ == "__main__":
    main()
