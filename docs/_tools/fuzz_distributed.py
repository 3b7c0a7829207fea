"""Fuzz ``mmattn.distributed`` on real gloo processes: valid and bad input, and hangs.

    python docs/_tools/fuzz_distributed.py [--seed 0] [--cases 150] [--world 2] [--timeout 60]

Not a unit test (a few minutes on one core). ``--world`` processes run the same seeded
cases; each case draws a subject (``SequenceParallel`` over a LocalAttention band or over
the heads of a MultiHeadAttention; ``ContextParallel`` on a MultiHeadAttention with a
SparseMask, random score modifiers, grouped heads, rotary, padding, ``is_causal``; on an
Encoder with ``pattern=``), random valid sizes, and either nothing or one corruption of the
call (a dtype, a shape, a non-tensor, a mask, a key, another rank's plan, ...) on a random
non-empty set of ranks. A case is, over all ranks:

- ``ok``: valid input; every rank's rows equal the single-process module's (float64);
- ``named``: bad input; every rank raised ValueError / TypeError, each bad rank naming the
  argument, the others naming the bad ranks;
- ``opaque``: bad input refused by another error, or without naming it;
- ``split``: the ranks disagree (some raised, some did not): the next collective would hang;
- ``silent``: bad input accepted everywhere, or valid input with wrong numbers;
- ``refused``: valid input raised;
- ``hang``: no answer within ``--timeout`` seconds (the processes are killed; the run
  resumes after that case);
- ``crash``: the tool itself failed building the case (its bug, shown with its traceback).

The exit status is 1 when any case is not ok or named.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout, not an install

DTYPE = torch.float64
D = 8
NAMED = (ValueError, TypeError)
SUBJECTS = ("sp_local", "sp_heads", "cp_attention", "cp_encoder")


# ------------------------------------------------------------------ one case, on one rank


def _documents(rng: random.Random, batch: int, length: int) -> torch.Tensor:
    ids = torch.empty(batch, length, dtype=torch.long)
    for b in range(batch):
        pos, doc = 0, 0
        while pos < length:
            size = rng.randint(1, max(1, length // 2))
            ids[b, pos:pos + size] = -1 if rng.random() < 0.15 else doc
            pos, doc = pos + size, doc + 1
    return ids


def _padding(rng: random.Random, batch: int, length: int) -> torch.Tensor | None:
    if rng.random() < 0.5:
        return None
    pad = torch.zeros(batch, length, dtype=torch.bool)
    for b in range(batch):
        pad[b, length - rng.randint(0, length // 2):] = True
    return pad


def _case(index: int, seed: int, world: int, rank: int) -> dict:
    """Run case ``index`` on this rank: {"out": "ok"/"wrong ..."} or {"error": ...}."""

    from mmattn import Encoder, LocalAttention, MultiHeadAttention, Tokens
    from mmattn import patterns as P
    from mmattn.distributed import ContextParallel, SequenceParallel
    from mmattn.distributed.context_plan import build_plan

    rng = random.Random(seed * 100003 + index)  # the same draws on every rank
    subject = rng.choice(SUBJECTS)
    batch = rng.randint(1, 2)
    gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
    torch.manual_seed(rng.randint(0, 2**31))
    corruptions = CORRUPT[subject]
    corrupt = rng.choice(corruptions) if rng.random() < 0.7 else None
    bad = set(rng.sample(range(world), rng.randint(1, world))) if corrupt else set()
    if corrupt in DISAGREE and len(bad) == world:  # on every rank it is a valid call
        bad.discard(rng.choice(sorted(bad)))
    if not bad:
        corrupt = None
    mine = corrupt if rank in bad else None
    info = {"subject": subject, "corrupt": corrupt, "bad": sorted(bad)}

    if subject.startswith("sp"):
        n = rng.randint(3, 6)
        length = n * world
        if subject == "sp_local":
            window = rng.randint(1, n)
            attn = LocalAttention(D, 2, window_size=window, causal=rng.random() < 0.5,
                                  num_global_tokens=rng.randint(0, min(2, n))).to(DTYPE)
        else:
            attn = MultiHeadAttention(D, world, position=rng.choice([None, "rotary"]))
            attn = attn.to(DTYPE)
        x = torch.randn(batch, length, D, generator=gen, dtype=DTYPE)
        pad = _padding(rng, batch, length)
        rows = slice(rank * n, (rank + 1) * n)
        kwargs = {"key_padding_mask": None if pad is None else pad[:, rows]}
        call = {"query": x[:, rows], **kwargs}
        call = _apply(mine, call, rng, extra={"attn_mask": torch.zeros(n, n, dtype=torch.bool)})
        try:
            out, _ = SequenceParallel(attn)(**call)
        except Exception as error:  # noqa: BLE001
            return {**info, "error": _describe(error)}
        want, _ = attn(x, key_padding_mask=pad)
        return {**info, "out": _compare(out, want[:, rows])}

    length = rng.randint(5, 40)
    block = rng.choice([2, 3, 4, 8])
    tokens = Tokens(torch.randn(batch, length, D, generator=gen, dtype=DTYPE),
                    None, {"documents": _documents(rng, batch, length)})
    pad = _padding(rng, batch, length)
    if pad is not None:
        tokens = Tokens(tokens.x, ~pad, tokens.meta)
    pattern = rng.choice([P.same("documents") & P.causal(), P.same("documents"), P.causal(),
                          P.window(rng.randint(0, 3)) | P.same("documents")])
    if subject == "cp_encoder":
        module = Encoder(D, 1, 2, pattern=pattern, causal=rng.random() < 0.5).to(DTYPE)
        cp = ContextParallel(module)
        plan = cp.plan(tokens)
        local = plan.scatter(tokens)
        other = build_plan(plan.mask, world, (rank + 1) % world) if world > 1 else plan
        full = P.full().compile(tokens, block_size=2)  # another mask, and its rows
        call = _apply(mine, {"tokens": local, "attn_mask": plan}, rng, extra={
            "plan": other, "mask": full, "tokens": cp.plan(full).scatter(tokens)})
        try:
            out = cp(call["tokens"], attn_mask=call["attn_mask"]).x
        except Exception as error:  # noqa: BLE001
            return {**info, "error": _describe(error)}
        want = plan.scatter(module(tokens).x)
        return {**info, "out": _compare(out[:, plan.real], want[:, plan.real])}

    heads = rng.choice([2, 4])
    attn = MultiHeadAttention(
        D, heads, num_kv_heads=rng.choice([1, 2]), sinks=rng.random() < 0.4,
        alibi=rng.random() < 0.4, softcap=rng.choice([None, 2.0]),
        position=rng.choice([None, "rotary"]),
    ).to(DTYPE)
    mask = pattern.compile(tokens, block_size=block)
    cp = ContextParallel(attn)
    plan = cp.plan(mask)
    causal = rng.random() < 0.3
    local_pad = None if pad is None else plan.scatter(pad) | ~plan.real[None]
    call = {"query": plan.scatter(tokens.x), "attn_mask": plan,
            "key_padding_mask": local_pad, "is_causal": causal}
    other = build_plan(mask, world, (rank + 1) % world) if world > 1 else plan
    full = P.full().compile(tokens, block_size=block)  # another mask, and its rows
    call = _apply(mine, call, rng, extra={"plan": other, "mask": full,
                                          "query": cp.plan(full).scatter(tokens.x)})
    try:
        out, _ = cp(**call)
    except Exception as error:  # noqa: BLE001
        return {**info, "error": _describe(error)}
    want, _ = attn(tokens.x, attn_mask=mask, key_padding_mask=pad, is_causal=causal)
    real = plan.real
    return {**info, "out": _compare(out[:, real], plan.scatter(want)[:, real])}


#: subject -> corruptions (each names what the error must mention).
CORRUPT = {
    "sp_local": ["dtype", "width", "rows", "list", "key", "need_weights", "attn_mask",
                 "pad_dtype", "pad_shape"],
    "sp_heads": ["dtype", "width", "rows", "list", "need_weights", "pad_dtype", "pad_shape"],
    "cp_attention": ["dtype", "width", "rows", "list", "key", "need_weights", "attn_none",
                     "attn_tensor", "attn_plan", "attn_mask_other", "pad_dtype", "pad_shape",
                     "causal", "positions"],
    "cp_encoder": ["tokens_tensor", "tokens_dtype", "tokens_rows", "attn_none", "attn_plan",
                   "attn_mask_other"],
}

#: corruptions that only make the ranks disagree (on every rank they are a valid call): every
#: rank raises the same error, naming what differs.
DISAGREE = {"rows", "attn_mask_other", "causal"}

#: corruption -> substrings one of which the bad rank's message must hold.
NAMES = {
    "dtype": ["dtype"], "width": ["query"], "rows": ["query", "shard length", "rows"],
    "list": ["query"], "key": ["key"], "need_weights": ["need_weights"],
    "attn_mask": ["attn_mask"], "attn_none": ["attn_mask"], "attn_tensor": ["attn_mask"],
    "attn_plan": ["ContextPlan"], "attn_mask_other": ["SparseMask"],
    "pad_dtype": ["key_padding_mask"], "pad_shape": ["key_padding_mask"],
    "causal": ["is_causal"], "positions": ["positions"], "tokens_tensor": ["tokens"],
    "tokens_dtype": ["dtype"], "tokens_rows": ["tokens.x"],
}


def _apply(corrupt: str | None, call: dict, rng: random.Random, extra: dict) -> dict:
    """``call`` with this rank's corruption (None: as it is)."""
    call = dict(call)
    q = call.get("query")
    if corrupt == "dtype":
        call["query"] = q.float()
    elif corrupt == "width":
        call["query"] = torch.cat([q, q[..., :1]], dim=-1)
    elif corrupt == "rows":  # one row fewer (one more where there is none)
        call["query"] = q[:, 1:] if q.shape[1] else torch.cat([q, q[:, :1, :] * 0 + 1], 1)
    elif corrupt == "list":
        call["query"] = q.tolist()
    elif corrupt == "key":  # another length (SequenceParallel takes another key of this one)
        call["key"] = q.clone()[:, :-1]
    elif corrupt == "need_weights":
        call["need_weights"] = True
    elif corrupt == "attn_mask":
        call["attn_mask"] = extra["attn_mask"]
    elif corrupt == "attn_none":
        call["attn_mask"] = None
    elif corrupt == "attn_tensor":
        call["attn_mask"] = torch.ones(3, 3, dtype=torch.bool)
    elif corrupt == "attn_plan":
        call["attn_mask"] = extra["plan"]
    elif corrupt == "attn_mask_other":  # another mask, with its own rows (and no padding)
        call["attn_mask"] = extra["mask"]
        for name in ("query", "tokens"):
            if name in call:
                call[name] = extra[name]
        call.pop("key_padding_mask", None)
    elif corrupt == "pad_dtype":
        call["key_padding_mask"] = torch.zeros(q.shape[:2], dtype=torch.long)
    elif corrupt == "pad_shape":
        call["key_padding_mask"] = torch.zeros(q.shape[0], q.shape[1] + 1, dtype=torch.bool)
    elif corrupt == "causal":
        call["is_causal"] = not call.get("is_causal", False)
    elif corrupt == "positions":
        call["positions"] = torch.zeros(1, 2, dtype=torch.long)
    elif corrupt == "tokens_tensor":
        call["tokens"] = call["tokens"].x
    elif corrupt == "tokens_dtype":
        call["tokens"] = call["tokens"].to(torch.float32)
    elif corrupt == "tokens_rows":
        tokens = call["tokens"]
        x, mask = tokens.x, tokens.mask
        if x.shape[1]:
            x, mask = x[:, 1:], mask[:, 1:]
        else:
            x, mask = x.new_zeros(1, 1, x.shape[2]), mask.new_ones(1, 1)
        call["tokens"] = type(tokens)(x, mask, {})
    return call


def _compare(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f"wrong shape {tuple(got.shape)} vs {tuple(want.shape)}"
    error = (got - want).abs().max().item() if got.numel() else 0.0
    return "ok" if error <= 1e-6 else f"wrong by {error:.3g}"


def _describe(error: Exception) -> dict:
    where = traceback.extract_tb(error.__traceback__)[-1]
    return {"type": type(error).__name__, "message": str(error)[:400],
            "where": f"{Path(where.filename).name}:{where.lineno}"}


def _worker(rank: int, world: int, port: int, seed: int, first: int, cases: int,
            out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    (Path(out) / f"rank{rank}.ready").touch()  # the watchdog counts from here
    with open(Path(out) / f"rank{rank}.jsonl", "a") as log:
        for index in range(first, cases):
            try:
                result = _case(index, seed, world, rank)
            except Exception:  # noqa: BLE001 (the tool's own failure: reported, not a hang)
                result = {"subject": "?", "corrupt": None, "bad": [],
                          "crash": traceback.format_exc()[-600:]}
            log.write(json.dumps({"index": index, **result}) + "\n")
            log.flush()
            dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------ launching, judging


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _read(out: Path, world: int) -> list[dict[int, dict]]:
    logs = []
    for rank in range(world):
        path = out / f"rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        logs.append({entry["index"]: entry for entry in map(json.loads, lines)})
    return logs


def _judge(entries: list[dict]) -> tuple[str, str]:
    crashed = [e["crash"] for e in entries if "crash" in e]
    if crashed:
        return "crash", crashed[0]
    first = entries[0]
    raised = [e for e in entries if "error" in e]
    if not first["corrupt"]:
        if raised:
            return "refused", json.dumps(raised[0]["error"])
        wrong = [e["out"] for e in entries if e["out"] != "ok"]
        return ("silent", wrong[0]) if wrong else ("ok", "")
    if not raised:
        return "silent", "bad input accepted on every rank"
    if len(raised) < len(entries):
        return "split", f"ranks {[e['rank'] for e in raised]} raised, the others did not"
    names = NAMES[first["corrupt"]]
    for entry in entries:
        error = entry["error"]
        text = error["message"]
        named = any(name in text for name in names)
        if error["type"] not in {t.__name__ for t in NAMED}:
            return "opaque", json.dumps(error)
        if entry["rank"] in first["bad"] or first["corrupt"] in DISAGREE:
            if not named:
                return "opaque", json.dumps(error)
        elif "got bad input" not in text or not named:
            return "opaque", json.dumps(error)
    return "named", ""


def main() -> int:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=150)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    counts = collections.Counter()
    bad_lines = []
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        first = 0
        while first < args.cases:
            port = _free_port()
            procs = [ctx.Process(target=_worker, args=(r, args.world, port, args.seed, first,
                                                        args.cases, tmp), daemon=True)
                     for r in range(args.world)]
            for proc in procs:
                proc.start()
            done, last, started = first, time.monotonic(), False
            while any(p.is_alive() for p in procs):
                time.sleep(0.2)
                if not started:  # starting (imports, rendezvous) may take long: not a case
                    started = all((out / f"rank{r}.ready").exists() for r in range(args.world))
                    last = time.monotonic()
                    continue
                logs = _read(out, args.world)
                now = min(max(log, default=first - 1) + 1 for log in logs)
                if now > done:
                    done, last = now, time.monotonic()
                elif time.monotonic() - last > args.timeout:
                    break
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join()
            for ready in out.glob("*.ready"):
                ready.unlink()
            logs = _read(out, args.world)
            for index in range(first, args.cases):
                if not all(index in log for log in logs):
                    counts["hang"] += 1
                    bad_lines.append(f"hang     case {index}")
                    first = index + 1
                    break
                entries = [{**log[index], "rank": r} for r, log in enumerate(logs)]
                outcome, detail = _judge(entries)
                counts[outcome] += 1
                label = (f"case {index} {entries[0]['subject']} {entries[0]['corrupt']} on "
                         f"{entries[0]['bad']}")
                if outcome not in ("ok", "named"):
                    bad_lines.append(f"{outcome:8s} {label}: {detail}"[:400])
                if args.verbose:
                    print(f"{outcome:8s} {label}")
                first = index + 1
    total = sum(counts.values())
    print(f"{total} cases on {args.world} processes: " + ", ".join(
        f"{k} {counts[k]}" for k in ("ok", "named", "opaque", "split", "silent", "refused",
                                    "hang", "crash")))
    for line in bad_lines:
        print(line)
    failed = any(counts[k] for k in ("opaque", "split", "silent", "refused", "hang", "crash"))
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
