"""Agreeing before exchanging: every rank learns every rank's input errors and facts first.

A collective whose peers disagree on sizes hangs (or worse, mixes data). So each call of a
:mod:`mmattn.distributed` wrapper first checks its own input without communicating, then
joins one small all-gather of (error?, facts) with every rank, bad input or not: a rank
with bad input raises its own ValueError, the others raise one that names it, and nobody
is left waiting in an exchange.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_NO_GROUP = (
    "{who} needs an initialised torch.distributed process group: call "
    "torch.distributed.init_process_group(backend='gloo' or 'nccl', ...) first (torchrun "
    "sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for it)"
)


def require_group(who: str):
    """``torch.distributed`` when a process group is initialised, else RuntimeError."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(_NO_GROUP.format(who=who))
    return dist


def agree(group, who: str, error: str, facts: Sequence[int], width: int) -> list[list[int]]:
    """All-gather every rank's (error?, ``facts``) and raise the same ValueError on every
    rank when some rank's input is bad; else return every rank's facts, in rank order.

    Args:
        group: the process group (None = default).
        who: the wrapper's name, for the messages.
        error: this rank's input error, or "" (its ``facts`` are then not read).
        facts: ``width`` integers every rank sends (shapes, flags, fingerprints).
    """
    import torch.distributed as dist

    from mmattn.distributed import _halo

    row = [1] + [0] * width if error else [0, *facts]
    mine = torch.tensor(row, dtype=torch.long, device=_halo.comm_device(group))
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    table = torch.stack(every).tolist()
    bad = [r for r, line in enumerate(table) if line[0]]
    if bad:  # every rank knows: all join one more gather, of the messages
        messages = [None] * len(table)
        dist.all_gather_object(messages, error, group=group)
        if error:
            raise ValueError(error)
        raise ValueError(
            f"{who}: rank(s) {bad} got bad input: "
            + "; ".join(f"rank {r}: {messages[r]}" for r in bad)
        )
    return [line[1:] for line in table]
