"""Worker processes for tests/mmattn/distributed/ (gloo on the CPU).

:func:`launch` starts ``world`` processes that each run :func:`_main`: join a gloo group, run
the named scenarios, and ``torch.save`` what they computed (outputs, gradients, error
messages) to ``outdir/rank{r}.pt``. The test process then compares those numbers with the
same models run in one process. The builders below are shared by both sides, so a model is
identical wherever it is built (same seed, float64).
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import adapters
from mmattn import LocalAttention, MaskedPool, MultiHeadAttention, Tokens, TransformerBlock
from tests._dist_context import SCENARIOS as CONTEXT_SCENARIOS

DTYPE = torch.float64
VOCAB, D, H = 40, 8, 2


# --- models and data, built identically in the workers and in the test --------------------


class TextClassifier(nn.Module):
    """Adapter -> blocks -> pooling -> head, with Tokens between the stages."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.embed = adapters.TextTokenEmbedder(VOCAB, D)
        self.blocks = nn.ModuleList(
            [TransformerBlock(D, H), TransformerBlock(D, H, attention="local", window_size=2)]
        )
        self.pool = MaskedPool("mean")
        self.head = nn.Linear(D, 3)
        self.unused = nn.Linear(D, D) if unused else None  # never called: DDP must cope

    def forward(self, ids: torch.Tensor) -> Tokens:
        tokens = self.embed(ids)
        for block in self.blocks:
            tokens = block(tokens)
        return tokens.replace(pooled=self.head(self.pool(tokens)))


def build_classifier(unused: bool = False) -> TextClassifier:
    torch.manual_seed(0)
    return TextClassifier(unused).to(DTYPE)


def classifier_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Four padded id rows and their targets; rank r of 2 takes rows 2r, 2r + 1."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (4, 7), generator=gen)
    for row, length in enumerate((7, 4, 6, 2)):
        ids[row, length:] = 0
    return ids, torch.randn(4, 3, generator=gen, dtype=DTYPE)


def classifier_loss(model: nn.Module, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    out = model(ids)  # Tokens: DDP/FSDP must find the tensors inside
    return ((out.meta["pooled"] - target) ** 2).mean()


def train_steps(model: nn.Module, ids, target, steps: int = 2) -> list[dict[str, torch.Tensor]]:
    """SGD steps; returns the gradients of each step by parameter name."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for _ in range(steps):
        opt.zero_grad()
        classifier_loss(model, ids, target).backward()
        grads.append({n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    return grads


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a DTensor shard (FSDP2) or a tensor."""
    return t.full_tensor().detach().clone() if hasattr(t, "full_tensor") else t.detach().clone()


#: Sequence-parallel cases: name -> LocalAttention kwargs and whether the shards are padded.
SP_CASES = {
    "plain": ({"window_size": 3}, False),
    "padded_blocks": ({"window_size": 3, "block_size": 2}, True),
    "causal": ({"window_size": 4, "causal": True}, True),
    "global": ({"window_size": 3, "num_global_tokens": 2}, True),
    "global_causal": ({"window_size": 2, "num_global_tokens": 2, "causal": True}, False),
    # on 4 ranks rank 1's left halo reaches back into the global tokens
    "global_wide": ({"window_size": 5, "num_global_tokens": 2}, True),
    # rotary positions at each shard's absolute offset, grouped-query attention
    "rotary_gqa_global": (
        {"window_size": 3, "num_global_tokens": 2, "num_kv_heads": 1, "position": "rotary"},
        True,
    ),
    # full attention: all-to-all over heads (4 heads: one per rank on 4 ranks)
    "full": ({"full": True}, True),
    "full_causal": ({"full": True}, False),
    "full_rotary": ({"full": True, "position": "rotary"}, True),
    # score modifiers: the rank's heads' sinks and slopes, ALiBi at absolute positions, the
    # sink in the global rows' log-sum-exp merge; softcap on the explicit blocks
    "modifiers_global": (
        {"window_size": 3, "num_global_tokens": 2, "sinks": True, "alibi": True}, True
    ),
    "modifiers_softcap": ({"window_size": 4, "causal": True, "sinks": True, "softcap": 1.5}, False),
    "full_modifiers": ({"full": True, "sinks": True, "alibi": True}, True),
}
SP_LENGTH = 24  # 12 per rank on 2 ranks, 6 on 4


def build_sp(name: str) -> tuple[LocalAttention, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(module, x (2, L, D), key padding mask or None, upstream gradient), all float64."""
    kwargs, padded = SP_CASES[name]
    torch.manual_seed(2)
    if kwargs.get("full"):
        kwargs = {k: v for k, v in kwargs.items() if k != "full"}
        attn = MultiHeadAttention(D, 4, **kwargs).to(DTYPE).eval()
    else:
        attn = LocalAttention(D, H, **kwargs).to(DTYPE).eval()
    if attn.sinks is not None:  # zeros at construction: make them matter
        with torch.no_grad():
            attn.sinks.normal_()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, SP_LENGTH, D, generator=gen, dtype=DTYPE)
    grad = torch.randn(2, SP_LENGTH, D, generator=gen, dtype=DTYPE)
    mask = None
    if padded:  # padding at the end of row 1 and a hole in the middle of row 0
        mask = torch.zeros(2, SP_LENGTH, dtype=torch.bool)
        mask[1, SP_LENGTH - 9:] = True
        mask[0, 10:13] = True
    return attn, x, mask, grad


def sp_causal(name: str) -> bool:
    """``is_causal`` passed at call time (full attention has no causal constructor flag)."""
    return name == "full_causal"


# --- scenarios run in every worker -------------------------------------------------------


def _ddp(find_unused: bool, outdir: Path):
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()
    model = DistributedDataParallel(
        build_classifier(unused=find_unused), find_unused_parameters=find_unused
    )
    ids, target = classifier_batch()
    rows = slice(2 * rank, 2 * rank + 2)
    grads = train_steps(model, ids[rows], target[rows])
    return [{n.removeprefix("module."): g for n, g in step.items()} for step in grads]


def _fsdp(outdir: Path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    model = build_classifier()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ids, target = classifier_batch()
    rows = slice(2 * rank, 2 * rank + 2)
    grads = train_steps(model, ids[rows], target[rows])
    dcp.save(model.state_dict(), checkpoint_id=str(outdir / "dcp"))
    params = {n: _full(p) for n, p in model.named_parameters()}
    return {"grads": grads, "params": params}


def _sp(name: str, outdir: Path):
    from mmattn.distributed import SequenceParallel, all_reduce_grads

    rank, ranks = dist.get_rank(), dist.get_world_size()
    attn, x, mask, grad = build_sp(name)
    n = SP_LENGTH // ranks
    rows = slice(rank * n, (rank + 1) * n)
    shard = x[:, rows].clone().requires_grad_()
    sp = SequenceParallel(attn)
    out, _ = sp(shard, key_padding_mask=None if mask is None else mask[:, rows],
                is_causal=sp_causal(name))
    out.backward(grad[:, rows])
    all_reduce_grads(attn)
    return {
        "out": out.detach(),
        "grad_x": shard.grad,
        "grad_params": {n: p.grad.clone() for n, p in attn.named_parameters()},
    }


def _sp_errors(outdir: Path):
    """Bad input must raise the same error on every rank, never hang."""
    from mmattn.distributed import SequenceParallel, all_reduce_grads

    rank = dist.get_rank()
    errors = {}
    attn = LocalAttention(D, H, window_size=5).to(DTYPE)
    cases = {
        "short": lambda: torch.randn(1, 4, D, dtype=DTYPE),
        "widths": lambda: torch.randn(1, 6 + 2 * rank, D, dtype=DTYPE),
        "one_rank_bad_dim": lambda: torch.randn(1, 6, D + rank, dtype=DTYPE),
    }
    real = torch.ones(1, 6, dtype=torch.bool)
    # One rank's input is bad in a way that it alone can see (a non-tensor, another dtype,
    # a mask on another device): that rank must still join the agreement, not hang its peer.
    one_rank = {
        "one_rank_not_tensor": lambda: ([[0.0] * D] * 6 if rank else torch.randn(1, 6, D,
                                        dtype=DTYPE), None),
        "one_rank_dtype": lambda: (torch.randn(1, 6, D, dtype=torch.float32 if rank else DTYPE),
                                   None),
        "one_rank_meta_mask": lambda: (torch.randn(1, 6, D, dtype=DTYPE),
                                       real.to("meta" if rank else "cpu")),
    }
    for case, make in [*cases.items(), *one_rank.items()]:
        try:
            made = make()
            query, mask = made if isinstance(made, tuple) else (made, None)
            SequenceParallel(attn)(query, key_padding_mask=mask)
            errors[case] = None
        except ValueError as err:
            errors[case] = str(err)
    try:
        all_reduce_grads([torch.zeros(1)])
        errors["all_reduce_grads_list"] = None
    except TypeError as err:
        errors["all_reduce_grads_list"] = str(err)
    glob = LocalAttention(D, H, window_size=1, num_global_tokens=5).to(DTYPE)
    try:
        SequenceParallel(glob)(torch.randn(1, 4, D, dtype=DTYPE))
        errors["global"] = None
    except ValueError as err:
        errors["global"] = str(err)
    return errors


SCENARIOS: dict[str, Callable[[Path], object]] = {
    **CONTEXT_SCENARIOS,  # tests/_dist_context.py
    "ddp": lambda out: _ddp(False, out),
    "ddp_unused": lambda out: _ddp(True, out),
    "fsdp": _fsdp,
    "sp_errors": _sp_errors,
    **{f"sp_{name}": (lambda out, name=name: _sp(name, out)) for name in SP_CASES},
}


def _main(rank: int, world: int, port: int, outdir: str, scenarios: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=150)
    )
    results = {}
    try:
        for name in scenarios:
            try:
                results[name] = SCENARIOS[name](Path(outdir))
            except Exception:  # reported to the test, which fails with the traceback
                results[name] = {"error": traceback.format_exc()}
                break  # the ranks may be out of step now: no more collectives
            dist.barrier()
    finally:
        torch.save(results, Path(outdir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(world: int, scenarios: list[str], outdir: Path, timeout: float) -> list[dict]:
    """Run ``scenarios`` on ``world`` gloo processes; each rank's results, in rank order.

    Raises:
        TimeoutError: a worker still runs after ``timeout`` seconds (it is killed: a hang
            fails the test instead of stalling CI).
        RuntimeError: a worker exited with an error.
    """
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(target=_main, args=(r, world, port, str(outdir), scenarios), daemon=True)
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, proc in enumerate(procs) if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    if hung:
        raise TimeoutError(f"ranks {hung} of {world} still ran after {timeout} s: killed")
    codes = [proc.exitcode for proc in procs]
    results = [
        torch.load(outdir / f"rank{r}.pt", weights_only=False)
        if (outdir / f"rank{r}.pt").exists() else {}
        for r in range(world)
    ]
    if any(codes):
        raise RuntimeError(f"worker exit codes {codes}; results: {results}")
    return results
