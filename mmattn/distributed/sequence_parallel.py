"""Sequence parallelism: each rank holds one contiguous shard of the sequence.

Axis key: ``b`` batch, ``h`` heads, ``n`` shard length (L / P), ``d`` model width, ``e`` head
width, ``w`` window (halo rows), ``g`` global tokens, ``p`` ranks.

A :class:`~mmattn.LocalAttention` query sees keys at most ``w`` positions away, so a shard
needs only ``w`` rows of keys and values from each neighbour (a *halo*)::

    rank r:            [ left halo (w) | my shard (n) | right halo (w) ]
                         ▲ rank r-1's last w rows        ▲ rank r+1's first w rows

Keys and values are projected locally, the halos come in by one ``batch_isend_irecv`` (the
backward pass sends their gradients back), and the blocked kernel
:func:`mmattn.kernels.blocked.local_attend` runs on the assembled rows; the halo rows' outputs are
cropped. Causal attention needs only the left halo. Global tokens (the first ``g`` of the
whole sequence, which must lie in rank 0's shard) are broadcast from rank 0 to every rank as
extra keys; their own query rows, which see the whole sequence, are merged from every rank's
partial attention with a log-sum-exp reduction (one all-gather of (g, e) rows).

Full attention (a plain :class:`~mmattn.MultiHeadAttention`) has no small halo; there the
wrapper goes Ulysses style: one all-to-all turns every rank's (b, h, n, e) shard into all
positions of h / p heads, the module's own attention kernel runs, a second all-to-all
returns (b, h, n, e).

Score modifiers (``sinks``, ``softcap``, ``alibi``) follow: a rank attends with its heads'
sinks and slopes, ALiBi at the rows' absolute positions, and the global rows' log-sum-exp
merge takes the sink into its total.

Everything here is a thin wrapper: the wrapped module keeps its parameters and stays the
single-process reference (tests compare the two).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from mmattn._helpers import default
from mmattn.attention._modifiers import score_modifiers
from mmattn.attention.local import LocalAttention
from mmattn.attention.mha import MultiHeadAttention
from mmattn.distributed._agree import agree, require_group
from mmattn.kernels.blocked import local_attend
from mmattn.kernels.modifiers import join_sink

__all__ = ["SequenceParallel", "all_reduce_grads"]

class SequenceParallel(nn.Module):
    r"""Run a :class:`~mmattn.LocalAttention` (or a full :class:`~mmattn.MultiHeadAttention`)
    on a sequence split across ranks.

    Every rank of ``group`` calls this module with its own contiguous shard of the sequence
    (rank r holds positions ``[r·n, (r+1)·n)``); the result is that shard of what the wrapped
    module computes on the whole sequence, and backward gives each rank the gradient of its
    shard (and its share of the parameter gradients: sum them over ranks, e.g. with
    :func:`all_reduce_grads`). Communication per call: one tiny all-gather of shapes (so bad
    input fails on every rank instead of hanging), one ``batch_isend_irecv`` of the ``w``
    boundary keys and values with each neighbour (and of the padding mask), and with global
    tokens one broadcast and one all-gather of ``g`` rows. A full ``MultiHeadAttention`` is
    run with two all-to-alls over heads instead (``num_heads`` divisible by the ranks).

    It has the forward contract of the wrapped module for self-attention, so it can replace
    the ``attn`` of a local :class:`~mmattn.TransformerBlock` (everything else in a block
    works token by token, so the whole block then runs sequence-parallel).

    Args:
        attention: a LocalAttention (halo exchange) or a plain MultiHeadAttention (all-to-all
            over heads); its parameters are used as they are (not copied).
        group: the process group whose ranks hold the shards, in rank order
            (None = the default group).

    Shape:
        - query (and key, value when given): (B, n, D) with batch_first, else (n, B, D); the
          same n on every rank, ``n >= window_size`` (local)
        - key_padding_mask: (B, n) bool, True = padding (this rank's shard)
        - returns: (B, n, D) and None (attention weights are not gathered)

    Raises:
        TypeError: ``attention`` is neither a LocalAttention nor a MultiHeadAttention.
        ValueError: shard shorter than the window, ranks disagree on shapes, global tokens
            outside rank 0's shard, heads not divisible by the ranks (full attention),
            ``need_weights`` or ``attn_mask`` given, a key/value of another length, a
            non-bool mask, or ``add_bias_kv``/``add_zero_attn``.
        RuntimeError: no initialised process group.

    Examples:
        >>> import torch.distributed as dist
        >>> attn = LocalAttention(512, 8, window_size=128)
        >>> sp = SequenceParallel(attn)  # doctest: +SKIP
        >>> shard = full[:, rank * n:(rank + 1) * n]  # doctest: +SKIP
        >>> out, _ = sp(shard)  # == attn(full)[0][:, rank * n:(rank + 1) * n]  # doctest: +SKIP
    """

    def __init__(self, attention: LocalAttention | MultiHeadAttention, group=None) -> None:
        super().__init__()
        if not isinstance(attention, LocalAttention) and type(attention) is not (
            MultiHeadAttention
        ):
            raise TypeError(
                "attention must be an mmattn.LocalAttention (halo exchange) or an "
                "mmattn.MultiHeadAttention (all-to-all over heads), got "
                f"{type(attention).__name__}"
            )
        refuse_extra_keys(attention, "SequenceParallel", "shard")
        self.attention = attention
        self.group = group

    def extra_repr(self) -> str:
        return "group=default" if self.group is None else f"group={self.group}"

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = False,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, None]:
        """Attend this rank's shard; see the class docstring."""
        dist = require_group("SequenceParallel")
        attn, group = self.attention, self.group
        key = default(key, query)
        value = default(value, key)
        error = _local_error(attn, query, key, value, key_padding_mask, need_weights, attn_mask)
        if not error and not attn.batch_first:
            query, key, value = (rearrange(t, "n b d -> b n d") for t in (query, key, value))
        causal = bool(getattr(attn, "causal", False) or is_causal)
        # Nothing of the input is read before the ranks agree: a rank with bad input still
        # joins the all-gather, and every rank raises the same error.
        batch_n = (0, 0) if error else tuple(query.shape[:2])
        _agree(group, batch_n, key_padding_mask is not None, causal, error)
        rank, ranks = dist.get_rank(group), dist.get_world_size(group)
        batch, n = query.shape[:2]
        q, k, v = _heads(attn, query, key, value)
        if getattr(attn, "position", None) is not None:  # e.g. rotary, at absolute positions
            q, k = attn.position(q, rank * n), attn.position(k, rank * n)
        real = None if key_padding_mask is None else ~key_padding_mask
        if not isinstance(attn, LocalAttention):
            out = _attend_heads(dist, group, attn, q, k, v, real, causal, ranks)
            return self._finish(out)
        window, glob = attn.window_size, attn.num_global_tokens
        if n < window:
            raise ValueError(
                f"SequenceParallel needs every shard to hold at least window_size={window} "
                f"positions (its halo comes from one neighbour), got shard length {n}"
            )
        if glob > n:
            raise ValueError(
                f"SequenceParallel needs the num_global_tokens={glob} global tokens inside "
                f"rank 0's shard, got shard length {n}"
            )

        out = _attend_shard(dist, group, attn, q, k, v, real, causal, rank, ranks)
        return self._finish(out)

    def _finish(self, out: Tensor) -> tuple[Tensor, None]:
        out = self.attention.out_proj(rearrange(out, "b h n e -> b n (h e)"))
        if not self.attention.batch_first:
            out = rearrange(out, "b n d -> n b d")
        return out, None


def refuse_extra_keys(attn: MultiHeadAttention, who: str, where: str) -> None:
    """Raise a ValueError for ``add_bias_kv`` / ``add_zero_attn``: keys of no rank's rows."""
    if attn.bias_k is not None or attn.add_zero_attn:
        raise ValueError(
            f"{who} does not support add_bias_kv or add_zero_attn (extra keys that belong to "
            f"no {where}); build the attention without them"
        )


def _heads(attn: MultiHeadAttention, query: Tensor, key: Tensor, value: Tensor):
    """Project and split heads: q (b, h, n, e); k, v (b, h_kv, n, e)."""
    kv_heads = getattr(attn, "num_kv_heads", None) or attn.num_heads
    q = rearrange(attn.q_proj(query), "b n (h e) -> b h n e", h=attn.num_heads)
    k, v = (
        rearrange(t, "b n (h e) -> b h n e", h=kv_heads)
        for t in (attn.k_proj(key), attn.v_proj(value))
    )
    return q, k, v


def _attend_heads(dist, group, attn, q, k, v, real, causal, ranks):
    """Full attention, Ulysses style: all-to-all to every position of h / p heads, attend
    with the module's own kernel, all-to-all back. (b, h, n, e) -> (b, h, n, e)."""
    from mmattn.distributed import _halo

    for name, heads in (("num_heads", q.shape[1]), ("key/value heads", k.shape[1])):
        if heads % ranks:
            raise ValueError(
                f"SequenceParallel over heads needs {name}={heads} divisible by the "
                f"{ranks} ranks of the group"
            )
    q, k, v = (_halo.heads_to_sequence(t, group=group) for t in (q, k, v))
    mask = None
    if _halo.any_rank(real is not None, group=group):
        mine = real if real is not None else torch.ones(q.shape[0], k.shape[2] // ranks,
                                                          dtype=torch.bool, device=q.device)
        every = [torch.empty_like(mine, dtype=torch.uint8) for _ in range(ranks)]
        dist.all_gather(every, mine.to(torch.uint8).contiguous(), group=group)
        mask = rearrange(torch.cat(every, dim=1).bool(), "b j -> b 1 1 j")
    mods = score_modifiers(attn)
    if mods is not None:  # this rank's heads: [r·h/p, (r+1)·h/p)
        heads = q.shape[1]
        mods = mods.heads(dist.get_rank(group) * heads, (dist.get_rank(group) + 1) * heads)
    out, _ = attn._attention(
        q, k, v, mask, is_causal=causal,
        dropout_p=attn.dropout if attn.training else 0.0, need_weights=False,
        modifiers=mods,
    )
    return _halo.sequence_to_heads(out, group=group)


def _attend_shard(dist, group, attn, q, k, v, real, causal, rank, ranks):
    """Halo exchange, global tokens and the blocked kernel for one shard; (b, h, n, e)."""
    from mmattn.distributed import _halo

    batch, heads, n, _ = q.shape
    window, glob = attn.window_size, attn.num_global_tokens
    dropout_p = attn.dropout if attn.training else 0.0
    ek = k.shape[-1]
    start = rank * n  # absolute position of my first row
    any_mask = _halo.any_rank(real is not None, group=group)
    mine = real if real is not None else torch.ones(batch, n, dtype=torch.bool, device=q.device)

    kv = torch.cat([k, v], dim=-1)
    if window > 0 and ranks > 1:
        kv_left, kv_right = _halo.exchange_halo(kv, window, causal=causal, group=group)
        m_left, m_right = _halo.exchange_halo_mask(
            mine.to(torch.uint8), window, causal=causal, group=group
        )
        m_left, m_right = m_left.bool(), m_right.bool()
    else:
        kv_left = kv_right = kv[..., :0, :]
        m_left = m_right = mine[:, :0]
    left = kv_left.shape[2]
    # A left halo of rank 1 may reach back into the global tokens: they already come as
    # global keys, so drop them from the band (no key counts twice).
    positions = torch.arange(start - left, start, device=q.device)
    m_left = m_left & (positions >= glob)
    keys_kv = [kv_left, kv, kv_right]
    keys_real = [m_left, mine, m_right]
    lead = left
    ties = []  # collectives every rank joins, also in backward, whether it uses them or not
    if glob:
        shared = _halo.broadcast_from_first(kv[..., :glob, :], group=group)
        shared_real = _halo.broadcast_mask(mine[:, :glob], group=group)
        if rank > 0:
            keys_kv.insert(0, shared)
            keys_real.insert(0, shared_real)
            lead += glob
        else:
            ties.append(shared)
    seq = torch.cat(keys_kv, dim=2)
    seq_real = torch.cat(keys_real, dim=1)
    length = seq.shape[2]
    q_seq = F.pad(q, (0, 0, lead, length - lead - n))
    need_mask = any_mask or bool(glob and left and start - left < glob)
    mods = score_modifiers(attn)
    if mods is not None:  # ALiBi at the absolute positions of the assembled rows
        rows = torch.arange(start - left, start - left + length - (lead - left), device=q.device)
        rows = torch.cat([torch.arange(lead - left, device=q.device), rows])
        mods = mods.at(rows[:, None], rows[:, None])
    out, _ = local_attend(
        q_seq,
        seq[..., :ek],
        seq[..., ek:],
        window,
        causal=causal,
        key_mask=seq_real if need_mask else None,
        num_global_tokens=glob,
        block_size=attn.block_size,
        dropout_p=dropout_p,
        modifiers=mods,
    )
    out = out[:, :, lead:lead + n]
    if glob:
        rows = _global_rows(q, k, v, mine, start, glob, causal, dropout_p, group, mods)
        if rank == 0:
            out = torch.cat([rows, out[:, :, glob:]], dim=2)
        else:
            ties.append(rows)
    return _Tie.apply(out, *ties) if ties else out


class _Tie(torch.autograd.Function):
    """Identity on ``out`` that also makes ``others`` part of the graph with zero gradient,
    so that every rank runs their backward collectives."""

    @staticmethod
    def forward(ctx, out: Tensor, *others: Tensor) -> Tensor:
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in others]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        zeros = [torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.shapes]
        return (grad, *zeros)


def _global_rows(q, k, v, real, start, glob, causal, dropout_p, group, mods=None):
    """The g global query rows over the WHOLE sequence: each rank attends its own shard,
    partial results merge by log-sum-exp across ranks (the sink joins the total). Returns
    (b, h, g, e) on every rank."""
    from mmattn.distributed import _halo

    ek, ev = k.shape[-1], v.shape[-1]
    qg = _halo.broadcast_from_first(q[:, :, :glob], group=group)
    groups = q.shape[1] // k.shape[1]  # grouped-query attention: query head n uses n // groups
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    scores = torch.einsum("bhge,bhje->bhgj", qg, k) / math.sqrt(ek)
    key_pos = torch.arange(start, start + k.shape[2], device=q.device)
    if mods is not None:
        bias = mods.alibi(torch.arange(glob, device=q.device)[:, None], key_pos[:, None],
                          scores.dtype)
        scores = mods.hook(scores, bias)
    allowed = real[:, None, None, :]  # (b, 1, 1, n)
    if causal:
        allowed = allowed & (key_pos[None, :] <= torch.arange(glob, device=q.device)[:, None])
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (b, h, g, 1), -inf if no key
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    weights = torch.exp(scores - safe)
    if dropout_p:
        weights = F.dropout(weights, dropout_p)
    partial = torch.einsum("bhgj,bhje->bhge", weights, v)
    parts = _halo.all_gather_stack(torch.cat([partial, lse], dim=-1), group=group)
    outs, lses = parts[..., :ev], parts[..., ev:]  # (p, b, h, g, e), (p, b, h, g, 1)
    total = torch.logsumexp(lses, dim=0)
    if mods is not None and mods.sinks is not None:
        _, total = join_sink(total, mods.sinks[:, None, None])
    finite = torch.isfinite(total)
    scale = torch.exp(lses - torch.where(finite, total, torch.zeros_like(total)))
    scale = torch.where(torch.isfinite(lses) & finite, scale, torch.zeros_like(scale))
    return (scale * outs).sum(dim=0)


def _local_error(attn, query, key, value, key_padding_mask, need_weights, attn_mask,
                 who: str = "SequenceParallel") -> str:
    """This rank's input error message, or "" (raised only after every rank has checked)."""
    if need_weights:
        return f"{who} does not gather attention weights: need_weights must be False"
    if attn_mask is not None:
        return "SequenceParallel takes no attn_mask (the band is the mask), got one"
    weight = attn.q_proj.weight
    for name, t, width in (("query", query, attn.embed_dim), ("key", key, attn.kdim),
                           ("value", value, attn.vdim)):
        if not isinstance(t, Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
        if t.device != weight.device:
            return (f"{name} must be on the module's device {weight.device}, got "
                    f"{t.device}")
        autocast = t.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(
            t.device.type
        )
        if t.dtype != weight.dtype and not autocast:
            return (f"{name} must have the module's dtype {weight.dtype} (on every rank), "
                    f"got {t.dtype}")
        if t.dim() != 3 or t.shape[-1] != width:
            return (f"{name} must be a 3-D shard (B, n, {width}) (batch_first) or (n, B, "
                    f"{width}), got shape {tuple(t.shape)}")
        if t.shape[:2] != query.shape[:2]:
            return (f"{who} is self-attention on one shard: {name} must have the "
                    f"query's leading shape {tuple(query.shape[:2])}, got {tuple(t.shape)}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
            got = getattr(key_padding_mask, "dtype", type(key_padding_mask).__name__)
            return f"key_padding_mask must be a bool tensor (True = padding), got {got}"
        if key_padding_mask.device != query.device:
            return (f"key_padding_mask must be on the query's device {query.device}, got "
                    f"{key_padding_mask.device}")
        batch_n = query.shape[:2] if attn.batch_first else query.shape[1::-1]
        if tuple(key_padding_mask.shape) != tuple(batch_n):
            return (f"key_padding_mask must have shape {tuple(batch_n)} (batch, shard length), "
                    f"got {tuple(key_padding_mask.shape)}")
    return ""


def _agree(group, batch_n, has_mask: bool, causal: bool, error: str) -> None:
    """Every rank's (error, batch, shard length, mask, causal), agreed before any halo
    exchange could hang (:func:`~mmattn.distributed._agree.agree`): the same ValueError on
    every rank when something is off."""
    table = agree(group, "SequenceParallel", error, [*batch_n, int(has_mask), int(causal)], 4)
    widths = [tuple(row[:2]) for row in table]
    if len(set(widths)) > 1:
        raise ValueError(
            "SequenceParallel needs the same (batch, shard length) on every rank, got "
            + ", ".join(f"rank {r}: {w}" for r, w in enumerate(widths))
        )
    if len({row[3] for row in table}) > 1:
        causal_by_rank = [bool(row[3]) for row in table]
        raise ValueError(f"SequenceParallel: ranks disagree on is_causal: {causal_by_rank}")


def all_reduce_grads(module: nn.Module, group=None) -> None:
    """Sum every parameter gradient of ``module`` over ``group`` (in place).

    Under sequence parallelism each rank's backward gives the parameter gradient of its own
    shard's share of the loss; the gradient of the whole loss is their sum. A parameter
    that has a gradient on some rank is summed on every rank (a rank where it has none, e.g.
    one that held no rows of a context-parallel call, adds zeros), so every rank reduces the
    same tensors; one without a gradient anywhere keeps None.

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` (e.g. a list of tensors).
        RuntimeError: no initialised process group.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"all_reduce_grads takes the module whose parameter gradients to sum (an "
            f"nn.Module), got {type(module).__name__}"
        )
    from mmattn.distributed import _halo

    dist = require_group("all_reduce_grads")
    params = [p for p in module.parameters() if p.requires_grad]
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8,
                       device=_halo.comm_device(group))
    dist.all_reduce(has, op=dist.ReduceOp.MAX, group=group)
    for param, any_rank in zip(params, has.tolist()):
        if any_rank:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, group=group)
