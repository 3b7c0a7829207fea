"""The unchecked bodies of :mod:`mmattn.kernels.neighborhood`: one tile runner for every form.

Axis key: ``c`` copies of the plan (items that share one plan: the batch of a padded input
on one grid, or 1 for flat rows), ``r`` rows of a copy, ``h`` query heads, ``k`` key/value
heads, ``e`` head width, ``n`` tiles, ``s`` query slots, ``t`` key slots, ``b`` items with
global tokens, ``g`` / ``j`` their global queries / keys, ``l`` tokens of an item.

:func:`run_tiles` gathers the tiles of (c, r, h, e) rows by a plan (the zero row appended at
index r) and runs every tile of every copy as ONE batched attention call: a padded batch on
one grid shares the plan of one item (c = batch, gathers along the token axis; this is also
the traceable form that ``torch.export`` and ``torch.compile`` take), per-item grids and
packed rows use a plan over all their rows (c = 1). Score modifiers come with the call:
sinks and softcap join every attention call, the grid's ALiBi and NAT's table are an
additive term on every tile (:mod:`._neighborhood_terms`, none for global queries).
Nothing here checks its input: the public functions of :mod:`mmattn.kernels.neighborhood`
do, and the layer checks its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from mmattn._helpers import exporting
from mmattn.kernels import dense as _kernel
from mmattn.kernels._neighborhood_chunks import (
    gather_tiles,
    run_chunks,
    tile_attention,
    tile_chunks,
)
from mmattn.kernels._neighborhood_plan import (
    Item,
    Plan,
    cached_plan,
    choose_tiles,
    merge_key_mask,
    shared_plan,
)
from mmattn.kernels._neighborhood_terms import softmax_modifiers, tile_terms
from mmattn.kernels._scores import default_scale
from mmattn.kernels.modifiers import Modifiers


def run_tiles(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    plan: Plan,
    key_mask: Tensor | None = None,
    *,
    dropout_p: float = 0.0,
    scale: float | None = None,
    need_weights: bool = False,
    modifiers: Modifiers | None = None,
    table: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Neighbourhood attention of ``c`` copies of the plan's rows.

    ``modifiers``: sinks, softcap and ALiBi (its distance is the grid's); ``table``: NAT's
    relative-position bias table (:mod:`._neighborhood_terms`).

    Shape:
        - q: (c, r, h, e); k, v: (c, r, k, e) / (c, r, k, e_v); key_mask: (c, r) bool
          (True = real key) or float (added), or None; table: ((2 kh − 1)(2 kw − 1), h)
          (a 2-D plan)
        - returns: (c, r, h, e_v), and weights (c, r, h, plan.width) or None
    """
    copies, _, heads, _ = q.shape
    mods = softmax_modifiers(modifiers)  # sinks, softcap: every call; ALiBi: in the term
    scale = default_scale(q, scale)
    n, slots, keys = plan.tile_shape
    km = None
    if key_mask is not None:
        fill = False if key_mask.dtype == torch.bool else float("-inf")
        km = torch.cat([key_mask, torch.full_like(key_mask[:, :1], fill)], dim=1)
    traced = exporting() or torch.compiler.is_compiling()
    fused = not traced and _kernel.use_fused_attn() and not (mods is not None and mods.explicit)
    spans = None
    if not (traced or need_weights or dropout_p):  # a video grid's tiles: in chunks
        spans = tile_chunks(plan, copies, k.shape[2], k.shape[3] + v.shape[3], q.dtype)
    items, glob = plan.global_shape
    if spans is None or items * glob:
        qz, kz, vz = (F.pad(t, (0, 0, 0, 0, 0, 1)) for t in (q, k, v))  # the zero row at r
    if spans is None:  # every tile in one batched call
        qt, kt, vt, km_t = gather_tiles(qz, kz, vz, km, plan, 0, n)
        term = tile_terms(plan, modifiers, table, q.dtype)  # (n, h, s, t) or None
        out_t, w_t = tile_attention(
            qt, kt, vt, km_t, 0, n, plan=plan, term=term, mods=mods, dropout_p=dropout_p,
            scale=scale, need_weights=need_weights, fused=fused)
        parts = [rearrange(out_t, "(c n) h s e -> c (n s) h e", n=n)]
    else:  # one chunk of gathered tiles at a time, forward and backward
        out_t, w_t = None, None
        parts = [run_chunks(q, k, v, km, spans, plan=plan, modifiers=modifiers, table=table,
                            scale=scale, fused=fused)]
    w_g = None
    if items * glob:  # global queries attend every key of their item
        gq = rearrange(qz.index_select(1, plan.gq_index.flatten()),
                       "c (b g) h e -> (c b) h g e", b=items)
        gk, gv = (rearrange(t.index_select(1, plan.gk_index.flatten()),
                            "c (b j) k e -> (c b) k j e", b=items) for t in (kz, vz))
        gm = rearrange(plan.gk_valid, "b j -> 1 b 1 1 j")
        if km is not None:
            gm = merge_key_mask(gm, rearrange(km.index_select(1, plan.gk_index.flatten()),
                                              "c (b j) -> c b 1 1 j", b=items))
        gm = rearrange(gm.expand(copies, *gm.shape[1:]), "c b 1 1 j -> (c b) 1 1 j")
        out_g, w_g = _kernel.attend(
            gq, gk, gv, gm, dropout_p=dropout_p, scale=scale, need_weights=need_weights,
            report_path=False, modifiers=mods,
        )
        parts.append(rearrange(out_g, "(c b) h g e -> c (b g) h e", b=items))
    parts.append(parts[0].new_zeros(copies, 1, heads, v.shape[-1]))
    out = torch.cat(parts, dim=1).index_select(1, plan.pick)
    weights = None
    if need_weights:
        weights = dense_weights(plan, w_t, w_g, copies, q.shape[1], heads)
    return out, weights


def dense_weights(
    plan: Plan, w_t: Tensor, w_g: Tensor | None, copies: int, rows: int, heads: int
) -> Tensor:
    """Scatter tile and global weights into (c, r, h, width) rows over each item's tokens."""
    n, slots, _ = plan.tile_shape
    width = plan.width
    dense = w_t.new_zeros(copies, rows + 1, heads, width + 1)
    grid_rows = torch.nonzero(plan.pick < n * slots).flatten()
    slot = plan.pick[grid_rows]
    w = rearrange(w_t, "(c n) h s t -> c (n s) h t", n=n).index_select(1, slot)
    cols = plan.k_col.index_select(0, torch.div(slot, slots, rounding_mode="floor"))
    grid_w = w.new_zeros(copies, len(slot), heads, width + 1)
    grid_w.scatter_add_(-1, cols[None, :, None, :].expand(copies, -1, heads, -1), w)
    dense.index_copy_(1, grid_rows, grid_w)
    if w_g is not None:
        items, g = plan.global_shape
        cols = plan.gk_col[None, :, None, None, :].expand(copies, -1, g, heads, -1)
        glob_w = w_g.new_zeros(*cols.shape[:4], width + 1)
        glob_w.scatter_add_(-1, cols, rearrange(w_g, "(c b) h g j -> c b g h j", b=items))
        real = plan.gq_index.flatten() < rows
        glob_w = rearrange(glob_w, "c b g h j -> c (b g) h j")[:, real]
        dense.index_copy_(1, plan.gq_index.flatten()[real], glob_w)
    return dense[:, :rows, :, :width]


def attend_padded(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    items: tuple[Item, ...],
    kernel: tuple[int, ...],
    dilation: tuple[int, ...],
    tiles: tuple[int, ...] | None,
    *,
    causal: tuple[bool, ...] | None = None,
    shared: bool,
    key_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    need_weights: bool = False,
    modifiers: Modifiers | None = None,
    table: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Neighbourhood attention of a padded batch: with ``shared`` the one item of ``items``
    is every item's geometry (one plan for all), else ``items`` lists every item; ``tiles``
    None: :func:`~mmattn.kernels.neighborhood.choose_tiles`; ``causal``: per axis (None:
    none); ``modifiers``, ``table``: as :func:`run_tiles`.

    Shape:
        - q: (b, h, l, e); k, v: (b, k, l, e); key_mask: (b, l) or None
        - returns: (b, h, l, e), and weights (b, h, l, l) or None
    """
    batch = q.shape[0]
    if shared:
        plan = shared_plan(items[0], kernel, dilation, tiles, q.device, causal)
        rows = [rearrange(t, "b h l e -> b l h e") for t in (q, k, v)]
    else:
        tiles = tiles or choose_tiles(items, kernel, dilation)
        plan = cached_plan(batch * q.shape[2], items, kernel, dilation, tiles, q.device,
                           causal)
        rows = [rearrange(t, "b h l e -> 1 (b l) h e") for t in (q, k, v)]
        key_mask = None if key_mask is None else key_mask.reshape(1, -1)
    out, weights = run_tiles(
        *rows, plan, key_mask, dropout_p=dropout_p, scale=scale, need_weights=need_weights,
        modifiers=modifiers, table=table,
    )
    rows_of = "b i" if shared else "1 (b i)"  # the rows: one copy per item, or all in one
    out = rearrange(out, f"{rows_of} h e -> b h i e", b=batch)
    if weights is not None:
        weights = rearrange(weights, f"{rows_of} h j -> b h i j", b=batch)
    return out, weights
