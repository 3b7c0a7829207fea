"""Differentiable point-to-point and collective steps behind :mod:`mmattn.distributed`.

Axis key: ``b`` batch, ``h`` heads, ``w`` halo rows, ``e`` channels, ``g`` global tokens,
``p`` ranks.

Each step is an ``autograd.Function`` whose backward is the adjoint communication, so the
gradient of a shard's keys and values includes what its neighbours' queries did with them:

- :func:`exchange_halo`: send my first ``w`` rows left and my last ``w`` rows right, receive
  the neighbours' boundary rows; backward sends the halo gradients back where they came from.
- :func:`broadcast_from_first`: rank 0's rows to every rank; backward sums the gradients on
  rank 0.
- :func:`all_gather_stack`: every rank's tensor, stacked; backward sums each slice's gradient
  over ranks and hands each rank its own slice.
- :func:`heads_to_sequence` / :func:`sequence_to_heads`: the two all-to-alls of Ulysses-style
  sequence parallelism for full attention (each is the other's backward).
- :func:`exchange_rows`: rows of uneven counts to every rank (context parallelism's keys and
  values); backward sends the gradients back the other way.

Every rank of the group must call each step (forward and backward) in the same order, as
with any collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from einops import rearrange
from torch import Tensor


def _peer(group, rank: int) -> int:
    """The global rank of ``rank`` in ``group`` (P2P ops address global ranks)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def _p2p(sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]], group) -> None:
    """One ``batch_isend_irecv`` of (tensor, group rank) pairs, then wait for all of it."""
    ops = [dist.P2POp(dist.isend, t, _peer(group, r), group) for t, r in sends]
    ops += [dist.P2POp(dist.irecv, t, _peer(group, r), group) for t, r in recvs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _swap(
    to_left: Tensor | None,
    to_right: Tensor | None,
    expect_left: bool,
    expect_right: bool,
    like: Tensor,
    shape: tuple[int, ...],
    group,
) -> tuple[Tensor | None, Tensor | None]:
    """Send ``to_left`` to rank - 1 and ``to_right`` to rank + 1 (None = nothing); receive
    a ``shape`` tensor from each side that is expected. Returns (from_left, from_right)."""
    rank = dist.get_rank(group)
    sends, recvs = [], []
    from_left = from_right = None
    if to_left is not None:
        sends.append((to_left.contiguous(), rank - 1))
    if to_right is not None:
        sends.append((to_right.contiguous(), rank + 1))
    if expect_left:
        from_left = like.new_empty(shape)
        recvs.append((from_left, rank - 1))
    if expect_right:
        from_right = like.new_empty(shape)
        recvs.append((from_right, rank + 1))
    _p2p(sends, recvs, group)
    return from_left, from_right


def _sides(group, causal: bool) -> tuple[bool, bool]:
    """(has a left halo, has a right halo) for this rank."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    return rank > 0, rank < size - 1 and not causal


def _has_neighbour(group) -> tuple[bool, bool]:
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    return rank > 0, rank < size - 1


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, rows: int, causal: bool, group):
        ctx.rows, ctx.causal, ctx.group, ctx.shape = rows, causal, group, x.shape
        left_side, right_side = _has_neighbour(group)
        has_left, has_right = _sides(group, causal)
        shape = (*x.shape[:-2], rows, x.shape[-1])
        left, right = _swap(
            x[..., :rows, :] if left_side and not causal else None,
            x[..., -rows:, :] if right_side else None,
            has_left, has_right, x, shape, group,
        )
        ctx.has_left, ctx.has_right = has_left, has_right
        empty = x.new_zeros(*x.shape[:-2], 0, x.shape[-1])
        return (empty if left is None else left), (empty if right is None else right)

    @staticmethod
    def backward(ctx, grad_left: Tensor | None, grad_right: Tensor | None):
        rows, group, shape = ctx.rows, ctx.group, ctx.shape
        halo = (*shape[:-2], rows, shape[-1])
        like = grad_left if grad_left is not None else grad_right
        left_side, right_side = _has_neighbour(group)
        # My left halo was rank - 1's last rows: its gradient goes back left; the right
        # halo's goes right. What arrives is the gradient of my own first rows (rank - 1
        # used them as its right halo) and of my last rows (rank + 1's left halo).
        from_left, from_right = _swap(
            _dense(grad_left, halo, like) if ctx.has_left else None,
            _dense(grad_right, halo, like) if ctx.has_right else None,
            left_side and not ctx.causal, right_side, like, halo, group,
        )
        grad = like.new_zeros(shape)
        if from_left is not None:
            grad[..., :rows, :] += from_left
        if from_right is not None:
            grad[..., -rows:, :] += from_right
        return grad, None, None, None


def _dense(grad: Tensor | None, shape, like: Tensor) -> Tensor:
    """A gradient autograd left undefined (None) is zero."""
    return like.new_zeros(shape) if grad is None else grad


def exchange_halo(x: Tensor, rows: int, *, causal: bool = False, group=None):
    """The ``rows`` boundary rows of the neighbouring shards, differentiably.

    Args:
        x: this rank's shard; rows are the second-to-last axis.
        rows: halo width (the attention window).
        causal: only the left halo is needed (nothing is sent left).
        group: the process group (None = default).

    Shape:
        - x: (..., n, e) with n >= rows
        - returns: (left, right), each (..., rows, e), or (..., 0, e) where there is no
          neighbour (rank 0's left, the last rank's right, every right halo when causal)
    """
    return _HaloExchange.apply(x, rows, causal, group)


def exchange_halo_mask(mask: Tensor, rows: int, *, causal: bool = False, group=None):
    """:func:`exchange_halo` for a (b, n) bool key mask (no gradient); (b, 0) where none."""
    left_side, right_side = _has_neighbour(group)
    has_left, has_right = _sides(group, causal)
    left, right = _swap(
        mask[:, :rows] if left_side and not causal else None,
        mask[:, -rows:] if right_side else None,
        has_left, has_right, mask, (mask.shape[0], rows), group,
    )
    empty = mask.new_zeros(mask.shape[0], 0)
    return (empty if left is None else left), (empty if right is None else right)


class _BroadcastFromFirst(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group):
        ctx.group = group
        out = x.detach().clone().contiguous()
        dist.broadcast(out, _peer(group, 0), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        if dist.get_rank(ctx.group) != 0:
            grad = torch.zeros_like(grad)
        return grad, None


def broadcast_from_first(x: Tensor, group=None) -> Tensor:
    """Rank 0's ``x`` on every rank; gradients flow back to rank 0 (summed over ranks)."""
    return _BroadcastFromFirst.apply(x, group)


class _AllGatherStack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def all_gather_stack(x: Tensor, group=None) -> Tensor:
    """Every rank's ``x`` stacked along a new first axis (p, ...), differentiably."""
    return _AllGatherStack.apply(x, group)


class _AllToAllHeads(torch.autograd.Function):
    """(b, h, n, e) shards of the sequence <-> (b, h / p, p·n, e) groups of heads."""

    @staticmethod
    def forward(ctx, x: Tensor, to_heads: bool, group):
        ctx.to_heads, ctx.group = to_heads, group
        return _all_to_all(x, to_heads, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_to_all(grad.contiguous(), not ctx.to_heads, ctx.group), None, None


def _all_to_all(x: Tensor, to_heads: bool, group) -> Tensor:
    ranks = dist.get_world_size(group)
    if to_heads:  # send head group p of my positions to rank p
        send = rearrange(x, "b (p g) n e -> p g b n e", p=ranks).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        return rearrange(recv, "p g b n e -> b g (p n) e")
    # back: positions of shard p of my head group go to rank p
    send = rearrange(x, "b g (p n) e -> p g b n e", p=ranks).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return rearrange(recv, "p g b n e -> b (p g) n e")


def heads_to_sequence(x: Tensor, group=None) -> Tensor:
    """All-to-all (Ulysses): my shard of every head -> every position of my head group.

    Shape:
        - x: (b, h, n, e), h divisible by the group size p
        - returns: (b, h / p, p·n, e); rank r gets heads [r·h/p, (r+1)·h/p)
    """
    return _AllToAllHeads.apply(x, True, group)


def sequence_to_heads(x: Tensor, group=None) -> Tensor:
    """The inverse all-to-all of :func:`heads_to_sequence`: (b, h / p, p·n, e) -> (b, h, n, e)."""
    return _AllToAllHeads.apply(x, False, group)


class _ExchangeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: Tensor, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all_rows(rows, send, recv, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_to_all_rows(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _all_to_all_rows(rows: Tensor, send: list[int], recv: list[int], group) -> Tensor:
    out = rows.new_empty(sum(recv), *rows.shape[1:])
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv,
                           input_split_sizes=send, group=group)
    return out


def exchange_rows(rows: Tensor, send: list[int], recv: list[int], group=None) -> Tensor:
    """One ``all_to_all_single`` of rows: the first ``send[0]`` rows go to rank 0, the next
    ``send[1]`` to rank 1, ...; ``recv[p]`` rows come from rank p, in rank order.
    Differentiable: backward sends the gradients of what came back where it came from.

    Shape:
        - rows: (sum(send), c); returns (sum(recv), c)
    """
    return _ExchangeRows.apply(rows, send, recv, group)


def broadcast_mask(mask: Tensor, group=None) -> Tensor:
    """Rank 0's bool ``mask`` on every rank (no gradient; sent as uint8)."""
    out = mask.to(torch.uint8).contiguous().clone()
    dist.broadcast(out, _peer(group, 0), group=group)
    return out.bool()


def any_rank(flag: bool, group=None) -> bool:
    """True when ``flag`` holds on any rank of ``group`` (a collective)."""
    value = torch.tensor([int(flag)], device=comm_device(group))
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def comm_device(group=None) -> torch.device:
    """Where small bookkeeping tensors must live for ``group``'s backend (NCCL: the GPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
