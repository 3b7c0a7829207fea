"""The attention of a range of a plan's tiles, and tiles run in chunks recomputed in the
backward (see :mod:`mmattn.kernels._neighborhood`).

Axis key: ``c`` copies of the plan, ``r`` rows of a copy (plus the zero row), ``h`` query
heads, ``k`` key/value heads, ``e`` head width, ``n`` tiles, ``m`` tiles of a chunk, ``s``
query slots, ``t`` key slots.

A tile's keys are its slab: along each axis ``t + k - 1`` keys for ``t`` queries, so the
gathered keys and values hold ``slab / tile`` copies of every key row. On an image grid with
the chosen tiles that is about 3, and every tile runs in one batched call. On a video grid
(kt × kh × kw windows) it is 6 to 13, and those copies, which autograd would keep for the
backward, outgrow even the dense mask's memory. There (:func:`tile_chunks`) the tiles run in
chunks of about :data:`CHUNK_BYTES` through :class:`_Chunks`: the forward keeps no gathered
tile; the backward gathers and runs each chunk again, takes its gradients with respect to
the gathered tiles and adds them into one gradient per input (``index_add_``). The math of
a chunk is :func:`tile_attention`, the same call as the one-batch path.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from einops import rearrange
from torch import Tensor
from torch.autograd.function import once_differentiable

from mmattn.kernels import dense as _kernel
from mmattn.kernels._neighborhood_plan import CACHE, Plan, merge_key_mask, tile_mask
from mmattn.kernels._neighborhood_terms import softmax_modifiers, tile_terms
from mmattn.kernels.modifiers import Modifiers, with_bias

#: Above this many bytes of gathered keys and values, and ...
CHUNK_BYTES = 4 * 2**20
#: ... when every key is gathered this many times over (the slab over the tile), the tiles
#: run in chunks of about CHUNK_BYTES / 2 each, recomputed in the backward.
CHUNK_HALO = 6


def tile_chunks(
    plan: Plan, copies: int, kv_heads: int, widths: int, dtype: torch.dtype
) -> list[tuple[int, int]] | None:
    """Ranges of tiles to run one after the other, or None (every tile in one call): when
    the gathered keys and values (``widths`` = e + e_v per key head) pass
    :data:`CHUNK_BYTES` and hold at least :data:`CHUNK_HALO` copies of every key."""
    n, slots, keys = plan.tile_shape
    per_tile = copies * keys * kv_heads * widths * torch.finfo(dtype).bits // 8
    if n * per_tile <= CHUNK_BYTES or keys < CHUNK_HALO * slots:
        return None
    step = max(1, CHUNK_BYTES // (2 * per_tile))
    return [(n0, min(n, n0 + step)) for n0 in range(0, n, step)]


def gather_tiles(
    qz: Tensor, kz: Tensor, vz: Tensor, km: Tensor | None, plan: Plan, n0: int, n1: int,
    padded: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The rows of tiles ``n0 .. n1 - 1``: qt ((c m), h, s, e), kt / vt ((c m), k, t, e),
    the key mask (c, m, 1, t) or None. ``padded``: q, k, v end with the zero row the empty
    slots read; else they are the rows alone and the empty slots are zeroed after the
    gather (:func:`_slots`; ``km`` always has the extra row)."""
    n, slots, keys = plan.tile_shape
    m = n1 - n0
    k_index = plan.k_index[n0 * keys:n1 * keys]
    q_index = plan.q_index[n0 * slots:n1 * slots]
    if padded:
        rows = [qz.index_select(1, q_index), kz.index_select(1, k_index),
                vz.index_select(1, k_index)]
    else:
        (q_at, q_empty), (k_at, k_empty) = _slots(plan, n0, n1)
        rows = [_zeroed(qz.index_select(1, q_at), q_empty),
                _zeroed(kz.index_select(1, k_at), k_empty),
                _zeroed(vz.index_select(1, k_at), k_empty)]
    qt = rearrange(rows[0], "c (n s) h e -> (c n) h s e", n=m)
    kt = rearrange(rows[1], "c (n t) k e -> (c n) k t e", n=m)
    vt = rearrange(rows[2], "c (n t) k e -> (c n) k t e", n=m)
    km_t = None
    if km is not None:
        km_t = rearrange(km.index_select(1, k_index), "c (n t) -> c n 1 t", n=m)
    return qt, kt, vt, km_t


def tile_attention(
    qt: Tensor, kt: Tensor, vt: Tensor, km_t: Tensor | None, n0: int, n1: int, *,
    plan: Plan, term: Tensor | None, mods: Modifiers | None, dropout_p: float,
    scale: float, need_weights: bool, fused: bool,
) -> tuple[Tensor, Tensor | None]:
    """Attention of the gathered tiles ``n0 .. n1 - 1`` (:func:`gather_tiles`) with their
    window (and key) mask and additive ``term`` of those tiles ((m, h, s, t), or None):
    ((c m), h, s, e_v) and weights or None."""
    n, slots, keys = plan.tile_shape
    m = n1 - n0
    copies = qt.shape[0] // max(m, 1)
    if term is not None and copies > 1:  # the same term for every copy of the plan
        term = term.repeat(copies, 1, 1, 1)
    if km_t is None and not need_weights and fused:
        # No key mask: every real query sees itself, every empty slot sees all; no dead row.
        mask = tile_mask(plan, qt.dtype, copies)
        if m != n:
            mask = rearrange(rearrange(mask, "(c n) o s t -> c n o s t", c=copies)[:, n0:n1],
                             "c n o s t -> (c n) o s t")
        out = _kernel.sdpa(
            qt, kt, vt, with_bias(mask, term), dropout_p=dropout_p, scale=scale,
            groups=qt.shape[1] // kt.shape[1], dead_rows=False,
            sinks=None if mods is None else mods.sinks,
        )
        return out, None
    mask = merge_key_mask(plan.allowed[None, n0:n1], km_t)  # (c or 1, m, s, t)
    mask = rearrange(mask.expand(copies, m, slots, keys), "c n s t -> (c n) 1 s t")
    return _kernel.attend(
        qt, kt, vt, with_bias(mask, term), dropout_p=dropout_p, scale=scale,
        need_weights=need_weights, report_path=False, modifiers=mods,
    )


def _zeroed(rows: Tensor, empty: Tensor) -> Tensor:
    """``rows`` with the slots at ``empty`` (dim 1) set to zero, in place (most chunks have
    none: then untouched)."""
    return rows.index_fill_(1, empty, 0) if empty.numel() else rows


def _slots(plan: Plan, n0: int, n1: int) -> tuple[tuple[Tensor, Tensor], ...]:
    """For the query and the key slots of tiles ``n0 .. n1 - 1``: the row each reads
    (the zero row's index clamped to the last row) and the positions of the empty slots;
    cached with the plan (the positions are found once per plan, not per call)."""
    key = ("slots", plan.key, n0, n1)
    found = CACHE.get(key)
    if found is None:
        _, slots, keys = plan.tile_shape
        rows = plan.pick.shape[0]
        found = tuple(
            (index.clamp(max=max(rows - 1, 0)), torch.nonzero(index >= rows).flatten())
            for index in (plan.q_index[n0 * slots:n1 * slots],
                          plan.k_index[n0 * keys:n1 * keys]))
        found = CACHE.put(key, found, sum(t.nbytes for pair in found for t in pair))
    return found


def run_chunks(
    q: Tensor, k: Tensor, v: Tensor, km: Tensor | None, spans: list[tuple[int, int]],
    *, plan: Plan, modifiers: Modifiers | None, table: Tensor | None, **options: Any,
) -> Tensor:
    """The tiles in chunks (:class:`_Chunks`) on the rows ``q``, ``k``, ``v`` (no zero row:
    no padded copy of them; ``km`` with it): (c, n·s, h, e_v), the tiles' outputs in plan
    order. ``modifiers``: the call's (sinks and softcap join each tile's softmax, ALiBi and
    the ``table`` are each chunk's additive term, made per chunk); ``options``: scale and
    fused of :func:`tile_attention` (no dropout, no weights)."""
    sinks = None if modifiers is None else modifiers.sinks
    return _Chunks.apply(q, k, v, table, sinks, km, spans, (plan, modifiers, options))


class _Chunks(torch.autograd.Function):
    """Chunks of tiles whose gathered rows live one chunk at a time, forward and backward."""

    @staticmethod
    def forward(ctx: Any, qz: Tensor, kz: Tensor, vz: Tensor, table: Tensor | None,
                sinks: Tensor | None, km: Tensor | None, spans: list[tuple[int, int]],
                fixed: tuple) -> Tensor:
        ctx.save_for_backward(qz, kz, vz, table, sinks, km)
        ctx.spans, ctx.fixed = spans, fixed
        parts = [_chunk(qz, kz, vz, km, table, sinks, n0, n1, fixed) for n0, n1 in spans]
        return torch.cat(parts, dim=1)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple:
        qz, kz, vz, table, sinks, km = ctx.saved_tensors
        plan = ctx.fixed[0]
        need = ctx.needs_input_grad
        dq, dk, dv = (torch.zeros_like(t) for t in (qz, kz, vz))
        dtable = torch.zeros_like(table) if need[3] else None
        dsinks = torch.zeros_like(sinks) if need[4] else None
        start = 0
        for n0, n1 in ctx.spans:
            qt, kt, vt, km_t = gather_tiles(qz, kz, vz, km, plan, n0, n1, padded=False)
            leaves = [t.requires_grad_() for t in (qt, kt, vt)]
            table_c = None if table is None else table.detach().requires_grad_(need[3])
            sinks_c = None if sinks is None else sinks.detach().requires_grad_(need[4])
            with torch.enable_grad():
                out = _attend(leaves, km_t, table_c, sinks_c, n0, n1, ctx.fixed)
                wanted = leaves + [t for t, on in ((table_c, need[3]), (sinks_c, need[4]))
                                   if on]
                part = grad[:, start:start + out.shape[1]]
                grads = torch.autograd.grad(out, wanted, part)
            start += out.shape[1]
            copies = qz.shape[0]
            (q_at, q_empty), (k_at, k_empty) = _slots(plan, n0, n1)  # empty slots: no grad
            dq.index_add_(1, q_at, _zeroed(rearrange(grads[0], "(c n) h s e -> c (n s) h e",
                                                     c=copies), q_empty))
            for total, g in ((dk, grads[1]), (dv, grads[2])):
                total.index_add_(1, k_at, _zeroed(rearrange(g, "(c n) k t e -> c (n t) k e",
                                                            c=copies), k_empty))
            rest = list(grads[3:])
            if dtable is not None:
                dtable += rest.pop(0)
            if dsinks is not None:
                dsinks += rest.pop(0)
        return dq, dk, dv, dtable, dsinks, None, None, None


def _attend(leaves: list[Tensor], km_t: Tensor | None, table: Tensor | None,
            sinks: Tensor | None, n0: int, n1: int, fixed: tuple) -> Tensor:
    """One chunk's attention on its gathered tiles: (c, m·s, h, e_v), its ALiBi and table
    term made here (:func:`~._neighborhood_terms.tile_terms` of these tiles)."""
    plan, modifiers, options = fixed
    term = tile_terms(plan, modifiers, table, leaves[0].dtype, (n0, n1))
    mods = softmax_modifiers(modifiers)
    if mods is not None and sinks is not None:
        mods = replace(mods, sinks=sinks)
    out, _ = tile_attention(*leaves, km_t, n0, n1, plan=plan, term=term, mods=mods,
                            dropout_p=0.0, need_weights=False, **options)
    copies = out.shape[0] // (n1 - n0)
    return rearrange(out, "(c n) h s e -> c (n s) h e", c=copies)


def _chunk(qz: Tensor, kz: Tensor, vz: Tensor, km: Tensor | None, table: Tensor | None,
           sinks: Tensor | None, n0: int, n1: int, fixed: tuple) -> Tensor:
    """One chunk, gathered and run (no autograd: the forward of :class:`_Chunks`)."""
    qt, kt, vt, km_t = gather_tiles(qz, kz, vz, km, fixed[0], n0, n1, padded=False)
    return _attend([qt, kt, vt], km_t, table, sinks, n0, n1, fixed)
