"""A kernel call's attention weights, tile by tile, read from its path report.

Axis key: ``n`` slots (items of the call, or tiles), ``h`` query heads, ``k`` key heads, ``r``
query rows of a tile, ``j`` key columns of a tile, ``e`` head width, ``E`` edges.

Every kernel tells the path listeners (:func:`mmattn.kernels.dense.add_listener`) what it is
about to run. :func:`mmattn.kernels._report_tiles.weight_tiles` asks the kernel that made a
report for the tiles it runs:
queries (n, h, r, e) against candidate keys (n, k, j, e) with the kernel's own mask and
modifiers (each kernel module's ``weight_tiles``), and gives their exact weights through
the dense kernel's explicit path (:func:`weights`). So the scores, masks and modifiers of
each kernel are written once, in its module. A tile holds O(block · keys of a block)
scores, never (L, L), and each query row is answered by exactly one tile of a call.

Rows and columns are named by their place in the call's own tensors: ``b·L + i`` for row i
of item b of a batched (b, h, L, e) call (``L`` of the query or of the key tensor; a local
call's are its ``inputs``, the tensors before blocking), the row itself for a flat (t, h, e)
or jagged call; ``-1`` where a tile's row or column is no row of the call (padding of a
block, a row another tile answers). Edge calls give their (E, h) weights with the query and
key row of each edge instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from mmattn.kernels import dense as _dense
from mmattn.kernels._scores import additive_scores, default_scale
from mmattn.kernels.modifiers import Modifiers, with_bias

#: At most this many scores in one tile (blocks of rows are cut to fit).
TILE_ELEMENTS = 1 << 22


class Unsupported(Exception):
    """A kernel report whose weights cannot be formed tile by tile."""


class Tile(NamedTuple):
    """Queries against candidate keys, as the kernel runs them.

    ``allowed`` (bool, True = may attend; or a float mask) and ``bias`` (added) broadcast to
    (n, h, r, j);
    ``score_weight`` is set for additive (Bahdanau) scores instead of ``q kᵀ · scale``;
    ``mods`` the score modifiers the kernel gives this call (a dense report's ALiBi is in
    ``bias``: the kernels report their mask with it). ``q_ids`` (n, r) and ``k_ids`` (n, j):
    the call's rows (module docstring).
    """

    q: Tensor
    k: Tensor
    allowed: Tensor | None
    bias: Tensor | None
    scale: float
    q_ids: Tensor
    k_ids: Tensor
    score_weight: Tensor | None = None
    mods: Modifiers | None = None


class Weights(NamedTuple):
    """One tile's weights (n, h, r, j) and the call's rows of its queries (n, r) and keys
    (n, j); for edges, weights (E, h) and the query and key row (E,) of each edge."""

    q_ids: Tensor
    k_ids: Tensor
    w: Tensor


def modifiers_of(record: dict) -> Modifiers | None:
    """The softcap and sinks a kernel report carries (its ``modifiers`` fact); its ALiBi is
    in the reported mask (dense kernels) or a tile's ``bias``."""
    mods = record.get("modifiers")
    return Modifiers(sinks=mods.sinks, softcap=mods.softcap) if mods else None


def weights(tile: Tile) -> Tensor:
    """The exact (n, h, r, j) weights of a tile, from the explicit path
    (:func:`mmattn.kernels.dense.attend` with ``need_weights``, or its softmax on additive
    scores): the score function, modifiers and dead-row rule, on zero-width values."""
    mask = with_bias(tile.allowed, tile.bias)
    mods = tile.mods
    none = tile.k.new_zeros(*tile.k.shape[:-1], 0)
    if tile.score_weight is None:
        _, w = _dense.attend(tile.q, tile.k, none, mask, scale=tile.scale, need_weights=True,
                             report_path=False, modifiers=mods)
        return w
    scores = additive_scores(tile.q, tile.k, tile.score_weight.to(tile.q.dtype))
    return _dense.grouped_softmax_attend(scores, none, mask, 0.0, mods)[1]


def split_mask(mask: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """An SDPA-direction mask as (allowed bool, additive bias), either None, 4-D."""
    if mask is None:
        return None, None
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    return (mask, None) if mask.dtype == torch.bool else (None, mask)


def _part(t: Tensor | None, n0: int, n1: int, r0: int = 0, r1: int | None = None):
    """The (slots, rows) part of a 4-D mask that may broadcast along either."""
    if t is None:
        return None
    t = t if t.shape[0] == 1 else t[n0:n1]
    return t if t.shape[2] == 1 or r1 is None else t[:, :, r0:r1]


def chunks(tile: Tile, elements: int = TILE_ELEMENTS) -> Iterator[Tile]:
    """A tile cut along its slots so that each part holds at most ``elements`` scores."""
    n, heads, rows, _ = tile.q.shape
    step = max(1, elements // max(1, heads * rows * tile.k.shape[2]))
    if step >= n:
        yield tile
        return
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        yield tile._replace(
            q=tile.q[n0:n1], k=tile.k[n0:n1], allowed=_part(tile.allowed, n0, n1),
            bias=_part(tile.bias, n0, n1), q_ids=tile.q_ids[n0:n1], k_ids=tile.k_ids[n0:n1],
        )


def dense_tiles(
    q: Tensor, k: Tensor, mask: Tensor | None, *, is_causal: bool = False,
    scale: float | None = None, block: int = 64, score_weight: Tensor | None = None,
    mods: Modifiers | None = None,
) -> Iterator[Tile]:
    """Blocks of rows of the dense kernel, ``softmax(q kᵀ · scale + mask)`` (or of
    additive scores).

    Shape:
        - q: (n, h, i, e); k: (n, k, j, e); mask broadcastable to (n, h, i, j)
    """
    n_all, heads, length, width = q.shape
    keys = k.shape[2]
    if n_all == 0 or length == 0 or keys == 0:
        return
    scale = default_scale(q, scale)
    allowed, bias = split_mask(mask)
    extra = width if score_weight is not None else 1  # additive scores hold (r, j, e)
    rows = max(1, min(block, TILE_ELEMENTS // max(1, heads * keys * extra)))
    step = max(1, TILE_ELEMENTS // max(1, heads * rows * keys * extra))
    cols = torch.arange(keys, device=q.device)
    for n0 in range(0, n_all, step):
        n1 = min(n_all, n0 + step)
        slot = torch.arange(n0, n1, device=q.device)[:, None]
        for r0 in range(0, length, rows):
            r1 = min(length, r0 + rows)
            ok = _part(allowed, n0, n1, r0, r1)
            pos = torch.arange(r0, r1, device=q.device)
            if is_causal:
                causal = cols[None, :] <= pos[:, None]
                ok = causal if ok is None else ok & causal
            yield Tile(q[n0:n1, :, r0:r1], k[n0:n1], ok, _part(bias, n0, n1, r0, r1), scale,
                       slot * length + pos, slot * keys + cols, score_weight, mods)
