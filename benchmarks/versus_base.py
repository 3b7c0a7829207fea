"""CPU speed and peak memory of this tree against an earlier one, workload by workload.

One representative, moderately sized call per benchmark family of docs/performance.md
(50-300 ms a sample), run in short child processes: ``PYTHONPATH=<tree>`` for the base tree
and for this tree, alternately (A B A B ...), each child with ``OMP_NUM_THREADS=1`` and
``torch.set_num_threads(1)``. A child builds the workload (seed 0), warms it up, and times
``--repeats`` samples with ``time.process_time`` (the process's CPU time: another process's
load on a shared machine hardly moves it), then reports the median. The table gives, per
workload, the median over every child of each tree (the medians of the children), the ratio
current / base, and flags ratios outside [0.9, 1.1].

Peak memory, two figures (tracemalloc does not see torch's allocations):
``peak alloc``, the most bytes torch's CPU allocations hold at once during one call after the
warm-up (``torch.profiler`` with ``profile_memory=True``, each op's own allocations and frees
summed in time order: ``_harness.peak_bytes``); it is deterministic, so any change is a
real one. ``maxrss``, the child's ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` at its end:
the whole process, torch and the tree's imports included.

Only APIs both trees have are used. The child imports nothing from this tree but the
harness beside it, so ``PYTHONPATH`` decides which ``mmattn`` (and ``adapters``) runs:
each child prints the path of the ``mmattn`` it imported, and the parent checks it.

    git worktree add --detach ../mmattn-base 1220173   # the tree before the sixth wave
    OMP_NUM_THREADS=1 python benchmarks/versus_base.py --base ../mmattn-base
    python benchmarks/versus_base.py --base ../mmattn-base --only local_fwd_bwd --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import machine, markdown_table, peak_bytes  # noqa: E402

HERE = Path(__file__).resolve().parents[1]
MIB = 1024**2


def _fwd_bwd(module, x, **kw) -> Callable[[], None]:
    """One forward + backward of ``module(x, **kw)``, the grads cleared first."""
    def run() -> None:
        module.zero_grad(set_to_none=True)
        out = module(x, **kw)
        out = out[0] if isinstance(out, tuple) else out
        out = getattr(out, "x", out)
        (out.values() if out.is_nested else out).sum().backward()
    return run


def _no_grad(fn: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        with torch.inference_mode():
            fn()
    return run


def _times(fn: Callable[[], None], k: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(k):
            fn()
    return run


# --- the workloads: name -> builder of a zero-argument call (run in the child) ----------

def mha(mode: str, length: int) -> Callable[[], None]:
    """benchmarks/mha.py: MultiHeadAttention.from_torch(nn.MultiheadAttention(256, 8)),
    B=8; 4 training steps or 10 inference calls a sample."""
    from torch import nn

    from mmattn import MultiHeadAttention

    ours = MultiHeadAttention.from_torch(nn.MultiheadAttention(256, 8, batch_first=True))
    x = torch.randn(8, length, 256, requires_grad=mode == "train")
    if mode == "train":
        return _times(_fwd_bwd(ours.train(), x), 4)
    ours.eval()
    return _times(_no_grad(lambda: ours(x)), 10)


def local() -> Callable[[], None]:
    """benchmarks/local.py: LocalAttention(512, 8, window 128), L=4096, fwd+bwd."""
    from mmattn import LocalAttention

    return _fwd_bwd(LocalAttention(512, 8, 128), torch.randn(1, 4096, 512, requires_grad=True))


def neighborhood() -> Callable[[], None]:
    """benchmarks/neighborhood.py: NeighborhoodAttention(256, 8, 7) on 64x64, fwd+bwd."""
    from mmattn import NeighborhoodAttention

    x = torch.randn(1, 64 * 64, 256, requires_grad=True)
    return _fwd_bwd(NeighborhoodAttention(256, 8, 7), x, grid=(64, 64))


def varlen(what: str) -> Callable[[], None]:
    """benchmarks/varlen.py: 16 packed items (mean 256, longest 1024), D=256, fwd+bwd."""
    from varlen import lengths

    from mmattn import LocalAttention, MultiHeadAttention, Tokens, TransformerBlock

    offsets = torch.tensor([0, *lengths(16, 256, 1024)]).cumsum(0)
    packed = Tokens.from_packed(torch.randn(int(offsets[-1]), 256), offsets)
    if what == "mha":
        return _fwd_bwd(MultiHeadAttention(256, 8), packed.x)
    if what == "local":
        return _fwd_bwd(LocalAttention(256, 8, 64), packed.x)
    return _fwd_bwd(TransformerBlock(256, 8), packed)


def variants(what: str) -> Callable[[], None]:
    """benchmarks/variants.py: D=256, H=4, forward (no grad)."""
    from mmattn import AdditiveAttention, LinformerAttention

    if what == "additive":  # O(L^2 D): a short sequence
        module, x, k = AdditiveAttention(256, 4), torch.randn(1, 384, 256), 1
    else:
        module, x, k = LinformerAttention(256, 4, seq_len=4096, proj_len=64), torch.randn(
            1, 4096, 256), 5
    return _times(_no_grad(lambda: module(x)), k)


def modifiers(what: str) -> Callable[[], None]:
    """benchmarks/modifiers.py: D=512, H=8, fwd+bwd; LocalAttention at L=2048, MHA at 1024."""
    from mmattn import LocalAttention, MultiHeadAttention

    x = torch.randn(1, 2048 if what == "alibi" else 1024, 512, requires_grad=True)
    if what == "alibi":
        module = LocalAttention(512, 8, 128, alibi=True)
    elif what == "softcap":
        module = MultiHeadAttention(512, 8, softcap=30.0)
    else:
        module = MultiHeadAttention(512, 8, sinks=True)
        with torch.no_grad():
            module.sinks.normal_()
    return _fwd_bwd(module, x)


def pattern() -> Callable[[], None]:
    """benchmarks/patterns.py: P.same("documents") & P.causal(), documents of 512, L=8192,
    D=64, H=4, through MultiHeadAttention(attn_mask=the compiled pattern), fwd+bwd."""
    from mmattn import MultiHeadAttention, Tokens
    from mmattn import patterns as P

    length = 8192
    tokens = Tokens(torch.randn(1, length, 64),
                    meta={"documents": (torch.arange(length) // 512)[None]})
    mask = (P.same("documents") & P.causal()).compile(tokens)
    x = tokens.x.requires_grad_()
    return _fwd_bwd(MultiHeadAttention(64, 4), x, attn_mask=mask)


def mass() -> Callable[[], None]:
    """benchmarks/mass.py: attention_mass of LocalAttention(256, 8, 128) on text + image
    spans, L=4096."""
    from mmattn import LocalAttention, Tokens
    from mmattn.debug import attention_mass

    layer = LocalAttention(256, 8, window_size=128).eval()
    tokens = Tokens.cat({"text": Tokens(torch.randn(1, 1024, 256)),
                         "image": Tokens(torch.randn(1, 3072, 256))})
    return _no_grad(lambda: attention_mass(layer, tokens))


def edge() -> Callable[[], None]:
    """benchmarks/edge.py: EdgeAttention(64, 4) on a random graph of 4096 nodes, degree 16,
    fwd+bwd, 2 calls a sample."""
    from edge import random_graph

    from mmattn import EdgeAttention

    x = torch.randn(4096, 64, requires_grad=True)
    edge_index = random_graph(4096)
    return _times(_fwd_bwd(EdgeAttention(64, 4), x, edge_index=edge_index), 2)


def streaming() -> Callable[[], None]:
    """benchmarks/streaming.py's encoder: Encoder(256, 4, 4, pattern=P.chunked(16, left=4),
    rotary), B=8, 16 chunks of 16 frames streamed through its cache (no grad)."""
    from mmattn import Encoder, Tokens
    from mmattn import patterns as P

    encoder = Encoder(256, 4, 4, pattern=P.chunked(16, left=4),
                      attention_kwargs={"position": "rotary"}).eval()
    chunks = torch.randn(16, 8, 16, 256).unbind()

    def run() -> None:
        cache = encoder.make_cache(8)
        for chunk in chunks:
            encoder(Tokens(chunk), cache=cache)
    return _no_grad(run)


def decode() -> Callable[[], None]:
    """benchmarks/decode.py: 2 causal TransformerBlock(256, 8), B=8, 64 steps with a KV cache
    (no grad)."""
    from torch import nn

    from mmattn import Tokens, TransformerBlock

    blocks = nn.ModuleList(TransformerBlock(256, 8, causal=True) for _ in range(2)).eval()
    x = torch.randn(8, 64, 256)

    def run() -> None:
        caches = [block.attn.make_cache(8, 64) for block in blocks]
        for t in range(64):
            tokens = Tokens(x[:, t:t + 1])
            for block, cache in zip(blocks, caches):
                tokens = block(tokens, cache=cache)
    return _no_grad(run)


def adapter() -> Callable[[], None]:
    """benchmarks/adapters.py + an encoder: ImagePatcher(256, 16) on 8 images of 224x224, then
    Encoder(256, 2, 8), fwd+bwd."""
    from torch import nn

    from adapters import ImagePatcher
    from mmattn import Encoder

    model = nn.ModuleDict({"patch": ImagePatcher(256, 16, img_size=224),
                           "encoder": Encoder(256, 2, 8)})
    images = torch.randn(8, 3, 224, 224)

    def run() -> None:
        model.zero_grad(set_to_none=True)
        model["encoder"](model["patch"](images)).x.sum().backward()
    return run


def encoder() -> Callable[[], None]:
    """An Encoder(256, 4, 8) forward on B=2, L=1024 (no grad)."""
    from mmattn import Encoder, Tokens

    model = Encoder(256, 4, 8).eval()
    tokens = Tokens(torch.randn(2, 1024, 256))
    return _no_grad(lambda: model(tokens))


WORKLOADS: dict[str, tuple[Callable[..., Callable[[], None]], tuple]] = {
    "mha_train_L128 (x4)": (mha, ("train", 128)),
    "mha_train_L256 (x4)": (mha, ("train", 256)),
    "mha_infer_L128 (x10)": (mha, ("infer", 128)),
    "mha_infer_L256 (x10)": (mha, ("infer", 256)),
    "local_L4096_fwd_bwd": (local, ()),
    "neighborhood_64x64_k7_fwd_bwd": (neighborhood, ()),
    "varlen_mha_packed_fwd_bwd": (varlen, ("mha",)),
    "varlen_local_packed_fwd_bwd": (varlen, ("local",)),
    "varlen_block_packed_fwd_bwd": (varlen, ("block",)),
    "variants_additive_L384_fwd": (variants, ("additive",)),
    "variants_linformer_L4096_fwd (x5)": (variants, ("linformer",)),
    "modifiers_local_alibi_L2048_fwd_bwd": (modifiers, ("alibi",)),
    "modifiers_mha_softcap_L1024_fwd_bwd": (modifiers, ("softcap",)),
    "modifiers_mha_sinks_L1024_fwd_bwd": (modifiers, ("sinks",)),
    "pattern_documents_L8192_fwd_bwd": (pattern, ()),
    "attention_mass_L4096": (mass, ()),
    "edge_4096_nodes_fwd_bwd (x2)": (edge, ()),
    "streaming_encoder_16_chunks": (streaming, ()),
    "decode_kv_cache_64_steps": (decode, ()),
    "adapter_image_encoder_fwd_bwd": (adapter, ()),
    "encoder_forward_B2_L1024": (encoder, ()),
}


def child(name: str, repeats: int) -> None:
    """Build one workload, warm it up, time ``repeats`` samples; print one JSON line."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    # the tree's own ``adapters`` package, not benchmarks/adapters.py beside this script
    sys.path.insert(0, os.environ["PYTHONPATH"])
    import mmattn

    builder, args = WORKLOADS[name]
    call = builder(*args)
    call()  # warm-up: allocator, caches, lazy imports
    samples = []
    for _ in range(repeats):
        start = time.process_time()
        call()
        samples.append(time.process_time() - start)
    tree = Path(os.environ["PYTHONPATH"]).resolve()
    for module in list(sys.modules.values()):  # no module of the other tree slipped in
        top = getattr(module, "__name__", "").split(".")[0]
        where = getattr(module, "__file__", None)
        if top in ("mmattn", "adapters") and where and not Path(where).is_relative_to(tree):
            raise RuntimeError(f"{module.__name__} came from {where}, not from {tree}")
    print(json.dumps({"mmattn": mmattn.__file__, "cpu": statistics.median(samples),
                      "samples": samples, "peak": peak_bytes(call),
                      "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def run_child(tree: Path, name: str, repeats: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, __file__, "--child", name, "--repeats", str(repeats)],
        capture_output=True, text=True, env=env, cwd=tree,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{name} on {tree} failed:\n{result.stderr[-2000:]}")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    if not Path(out["mmattn"]).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"{name}: the child imported {out['mmattn']}, not {tree}'s mmattn")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="a checkout of the tree to compare against (required)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="children per tree and workload, alternating A B A B ...")
    parser.add_argument("--repeats", type=int, default=5, help="timed samples per child")
    parser.add_argument("--only", nargs="*", help="workload names (or prefixes) to run")
    parser.add_argument("--json", help="also write the raw results to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.repeats)
        return
    if not args.base:
        parser.error("--base is required: a checkout of the tree to compare against")
    base = Path(args.base).resolve()
    trees = {"base": base, "current": HERE}
    names = [n for n in WORKLOADS
             if not args.only or any(n.startswith(p) for p in args.only)]
    print(f"# {machine()} (children: 1 torch thread); base {base}, current {HERE}; "
          f"{args.rounds} children per tree, {args.repeats} samples each; "
          f"load average at start {os.getloadavg()[0]:.2f}", flush=True)
    raw: dict[str, dict[str, list[dict]]] = {}
    start = time.monotonic()
    for name in names:
        raw[name] = {"base": [], "current": []}
        for r in range(args.rounds):
            order = ("base", "current") if r % 2 == 0 else ("current", "base")
            for which in order:
                raw[name][which].append(run_child(trees[which], name, args.repeats))
        b = [c["cpu"] for c in raw[name]["base"]]
        c = [c["cpu"] for c in raw[name]["current"]]
        print(f"{name}: base {[round(t * 1e3, 1) for t in b]} ms, "
              f"current {[round(t * 1e3, 1) for t in c]} ms", flush=True)
    rows, flagged = [], []
    for name in names:
        med = {w: statistics.median(ch["cpu"] for ch in raw[name][w]) for w in trees}
        mem = {w: statistics.median(ch["peak"] for ch in raw[name][w]) / MIB for w in trees}
        rss = {w: statistics.median(ch["maxrss"] for ch in raw[name][w]) / MIB for w in trees}
        ratio = med["current"] / med["base"]
        flag = "" if 0.9 <= ratio <= 1.1 else "FLAG"
        if flag:
            flagged.append(name)
        rows.append([name, med["base"] * 1e3, med["current"] * 1e3, f"{ratio:.3f}",
                     f"{mem['base']:.1f}", f"{mem['current']:.1f}",
                     f"{mem['current'] / mem['base']:.2f}" if mem["base"] > 0 else "-",
                     f"{rss['base']:.0f}", f"{rss['current']:.0f}", flag])
    header = ["workload", "base ms", "current ms", "current/base", "base peak alloc MiB",
              "current peak alloc MiB", "peak ratio", "base maxrss MiB", "current maxrss MiB",
              "outside [0.9, 1.1]"]
    print()
    print(markdown_table(header, rows))
    print(f"\n{len(names)} workloads in {time.monotonic() - start:.0f} s; load average now "
          f"{os.getloadavg()[0]:.2f}; flagged: {', '.join(flagged) or 'none'}")
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
