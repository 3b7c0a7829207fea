"""Issue 34's table side by side: mmattn vs torch's varlen_attn, flex (hand-written
mask_mod), flex (``Pattern.mask_mod``) and dense SDPA, each with the same four projections
(CUDA, bf16).

Run (on a CUDA machine; benchmarks/gpu_check.sh does): ``python benchmarks/gpu_engines.py
--write-docs --budget 200`` (the "GPU engines" block of docs/performance.md, rewritten after
every case so a run cut short keeps what it measured). ``--device cpu --tiny`` checks the
script's logic on a CPU at toy sizes (flex runs its CPU forward only, varlen is left out;
the numbers mean nothing).

Rows (D=1024, H=16 unless tiny), most important first: packed documents (B=4, L=8192,
lengths 128..1024, causal inside); LocalAttention (window 256, L=16384, fwd and fwd+bwd);
per-modality (B=2, text 1024 causal, image 64² neighbourhood 7, audio 4096 window 128);
NeighborhoodAttention (k=7, 64² and 128²); packed Tokens (benchmarks/varlen.py's lengths);
MultiHeadAttention (L=1024, B=16); EdgeAttention vs PyG's TransformerConv (N=100k, 16
edges a node, fp32; as benchmarks/edge.py).

- The varlen anchor is torch's ``varlen_attn`` called directly on the runs.
- The flex baselines compile their own copy of flex_attention (one per contender, apart from
  mmattn's: neither spends the other's dynamo cache or recompile budget); their block masks
  are built by ``torch.compile(create_block_mask)``.
- Before its time is reported, every contender's output (and, fwd+bwd, the input's
  gradient) is compared with mmattn's fallback kernel (``engines.use("fallback")``) on the
  same input: a contender that differs by more than ``TOLERANCE`` (relative to the largest
  value) shows the difference instead of a time.
- Time: CUDA events around enough back-to-back calls to last about 20 ms a sample, samples
  interleaved in a shuffled order, medians (benchmarks/_harness.py); peak memory: one more
  run after resetting the peak counter. The mmattn row names the engines its attention
  calls ran (``explain``'s listener); the last line counts the graphs mmattn's flex calls
  compiled. A contender that fails prints its error in the table instead of a time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpu_contenders import (  # noqa: E402
    Projected,
    dense_kernel,
    flex_kernel,
    once,
    outputs,
    relative_error,
    varlen_kernel,
)
from _harness import add_docs_argument, interleaved_medians, markdown_table, write_docs  # noqa

from mmattn import LocalAttention, MultiHeadAttention, NeighborhoodAttention, Tokens  # noqa
from mmattn import patterns as P  # noqa: E402
from mmattn.kernels import dense as _kernel  # noqa: E402
from mmattn.kernels import engines as _engines  # noqa: E402
from mmattn.kernels import flex as _flex_engine  # noqa: E402

#: Largest difference from the fallback's output (relative to its largest value) for a
#: contender's time to be reported (bf16: a few units of its 8-bit mantissa).
TOLERANCE = 3e-2
#: Contenders whose output is not mmattn's by construction (their own weights): not compared.
UNCOMPARED = {"TransformerConv": "its own weights"}


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
    with _engines.use("fallback"):  # the reference every contender is held to
        want = outputs(runs["mmattn"], x, train)
    steps, errors, engines, diffs = {}, {}, set(), {}
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
                got = outputs(fn, x, train)
            finally:
                remove()
            if name in UNCOMPARED:
                diffs[name] = f"not compared ({UNCOMPARED[name]})"
            else:
                err = max(relative_error(g, w) for g, w in zip(got, want) if w is not None)
                diffs[name] = f"{err:.1e}"
                if not err <= TOLERANCE:
                    errors[name] = f"differs from the fallback: max error {err:.2g}"
                    continue
            steps[name] = step
        except Exception as error:  # noqa: BLE001 - reported in the table
            text = " ".join(str(error).split())[:80].replace("|", "/")
            errors[name] = f"failed: {type(error).__name__}: {text}"
    times = interleaved_medians(steps, cfg["repeats"], warmup=1, calls=None,
                                device=dev.type) if steps else {}
    peaks = {}
    for name, step in steps.items():
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated() / 2**30
    rows = []
    mode = "fwd+bwd" if train else "fwd"
    for name in runs:
        diff = diffs.get(name, "")
        if name in errors:
            rows.append([label, mode, name, errors[name], "", "", diff])
            continue
        ratio = f"{times[name] / times[anchor]:.2f}x" if anchor in times else ""
        peak = f"{peaks[name]:.2f}" if name in peaks else "-"
        shown = f"mmattn ({', '.join(sorted(engines))})" if name == "mmattn" else name
        rows.append([label, mode, shown, f"{1e3 * times[name]:.2f}", peak, ratio, diff])
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


HEADER = ["case", "pass", "contender", "ms", "peak GiB", "vs anchor", "max err vs fallback"]


def graph_line() -> str:
    """How many graphs mmattn's flex calls compiled (per signature: see mmattn.kernels.flex)."""
    counts = [n for n in _flex_engine.graphs().values() if n is not None]
    if not counts:
        return "mmattn's flex calls compiled no graph here."
    return (f"mmattn's flex calls: {len(counts)} signatures, {sum(counts)} graphs "
            f"(at most {max(counts)} for one signature; dynamo's limit "
            f"{_engines.recompile_limit()} per signature).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy sizes (logic check)")
    parser.add_argument("--only", default="", help="comma-separated case names")
    parser.add_argument("--budget", type=float, default=0.0,
                        help="seconds: start no new case after this (0: no limit)")
    add_docs_argument(parser)
    args = parser.parse_args()
    dev = torch.device(args.device)
    cfg = dict(SIZES["tiny" if args.tiny else "full"])
    cfg["dtype"] = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    cases = {
        "documents": lambda: case_documents(cfg, dev),
        "local": lambda: case_local(cfg, dev),
        "per_modality": lambda: case_per_modality(cfg, dev),
        **{f"neighborhood{s}": (lambda s=s: case_neighborhood(cfg, dev, s))
           for s in cfg["nbhd"]},
        "tokens": lambda: case_packed_tokens(cfg, dev),
        "mha": lambda: case_mha(cfg, dev),
        "edge": lambda: case_edge(cfg, dev),
    }
    only = [c for c in args.only.split(",") if c]
    train_modes = {"local": (False, True), "mha": (False, True)}
    rows, start = [], time.monotonic()
    for name, make in cases.items():
        if only and name not in only:
            continue
        if args.budget and time.monotonic() - start > args.budget:
            rows.append([name, "", "", "skipped: time budget spent", "", "", ""])
            continue
        try:
            label, shape, runs, anchor = make()
        except Exception as error:  # noqa: BLE001 - one broken case must not end the run
            rows.append([name, "", "", f"failed to build: {type(error).__name__}: {error}",
                         "", "", ""])
            continue
        modes = train_modes.get(name, (True,)) if dev.type == "cuda" else (False,)
        for train in modes:  # (no flex backward on the CPU)
            rows += measure(label, shape, runs, anchor, cfg, dev, train)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        print(markdown_table(HEADER, rows[-len(runs) * len(modes):]), flush=True)
        write(args, dev, cfg, rows)
    print(markdown_table(HEADER, rows))
    print(graph_line())
    write(args, dev, cfg, rows)


def write(args, dev, cfg, rows) -> None:
    """The table so far into docs/performance.md (after every case: a run cut short keeps
    what it measured)."""
    if not args.write_docs or args.tiny:
        return
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    write_docs("gpu-engines", f"{name}, torch {torch.__version__}, {str(cfg['dtype'])[6:]}"
               f"\n\n{markdown_table(HEADER, rows)}\n\n{graph_line()}", device=str(dev))


if __name__ == "__main__":
    main()
