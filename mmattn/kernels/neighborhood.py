"""Tiled N-D neighbourhood attention, the O(L·kᴺ) kernel of :class:`mmattn.NeighborhoodAttention`.

Axis key: ``b`` batch, ``h`` query heads, ``k`` key/value heads, ``l`` tokens of an item,
``e`` head width, ``r`` flat rows (every item's tokens one after the other), ``n`` tiles,
``s`` query slots of a tile, ``t`` key slots of a tile, ``g`` global queries of an item,
``j`` keys of an item.

Semantics are NATTEN's ``na1d`` / ``na2d`` / ``na3d`` (clamped windows, dilation, causal
axes), plus global tokens; the dense reference is :func:`mmattn.masks.neighborhood_mask`.
Grids have 1, 2 or 3 axes ((length,), (rows, cols), (frames, rows, cols)). The grid is cut
into tiles of ``t_1 × … × t_N`` queries; a tile's queries only reach a slab of
``(t_1 + k_1 - 1) × … × (t_N + k_N - 1)`` grid keys (windows are clamped inward or end at
their query, so the slab stays inside the grid) plus the item's global keys. Every tile is
gathered at once and all run as ONE batched attention call with the exact window mask::

    rows (r, h, e) ─gather q_index─▶ (n, h, s, e) ┐
    rows (r, k, e) ─gather k_index─▶ (n, k, t, e) ├─ attend(mask (n, 1, s, t)) ─▶ (n, h, s, e)
    plan.allowed (n, s, t) & real key ────────────┘                 │
    global rows (b', h, g, e) attend all of their item's keys ──────┤
                                     cat(tiles, globals, zero) ─gather pick─▶ (r, h, e)

Time and memory are O(L·∏(t_a + k_a - 1)) in the forward and the backward; no
(L, L) tensor exists unless weights are requested. The tile plan (:mod:`._neighborhood_plan`)
depends only on the geometry and is cached, bounded in bytes; a padded batch on one grid
shares the plan of one item. The per-tile attention is :func:`mmattn.kernels.dense.attend`,
so the fused and explicit paths, dropout, grouped-query heads and the "row without allowed
keys gives zeros" rule are those of the dense modules. The runner is
:func:`._neighborhood.run_tiles`, one for eager, compiled and exported calls.

Public entry points: :func:`neighborhood_attend` (a padded batch), :func:`build_plan` with
:func:`padded_items` / :func:`packed_items` / :func:`choose_tiles`, and
:func:`neighborhood_rows` (flat rows after :func:`build_plan`). They check their input
(shapes, dtypes, devices, and that every item's grid fits its rows), so a kernel never
reads the rows of another item or outside its tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from einops import rearrange
from torch import Tensor

from mmattn import _checks as checks
from mmattn._helpers import exporting
from mmattn._masks_grid import check_window
from mmattn.kernels import _inputs, _routes
from mmattn.kernels import dense as _kernel
from mmattn.kernels._neighborhood import attend_padded, run_tiles
from mmattn.kernels._neighborhood_plan import (
    Item,
    Plan,
    cached_plan,
    choose_tiles,
    merge_key_mask,
)
from mmattn.kernels._neighborhood_terms import pair_terms, plan_coords
from mmattn.kernels._scores import acc_dtype, default_scale
from mmattn.kernels._tiles import (
    TILE_ELEMENTS,
    Tile,
    modifiers_of,
)
from mmattn.kernels.modifiers import Modifiers

__all__ = [
    "Item",
    "Plan",
    "build_plan",
    "choose_tiles",
    "neighborhood_attend",
    "neighborhood_rows",
    "packed_items",
    "padded_items",
]

Grid = tuple[int, ...]


def _per_item(value, count: int) -> list:
    """A per-item list from one value or a list of ``count`` values."""
    if isinstance(value, list):
        return value
    return [value] * count


def padded_items(
    batch: int,
    length: int,
    grid: Grid | Sequence[Grid],
    *,
    num_global_tokens: int = 0,
    grid_start: int | Sequence[int] | None = None,
) -> tuple[Item, ...]:
    """The items of a padded (b, l) batch: item m is flat rows ``[m·l, m·l + l)``.

    ``grid`` is one grid (1 to 3 sides) for every item or a list of per-item grids. Without
    ``grid_start`` the grid starts after ``num_global_tokens`` tokens and an item's tokens
    after its grid are padding (dead); with it every token outside the grid is global.
    """
    grids = [tuple(g) for g in grid] if isinstance(grid, list) else [tuple(grid)] * batch
    starts = _per_item(num_global_tokens if grid_start is None else grid_start, batch)
    return tuple(
        Item(m * length, length, tuple(int(n) for n in shape), int(start),
             grid_start is not None)
        for m, (shape, start) in enumerate(zip(grids, starts))
    )


def packed_items(
    lengths: Sequence[int],
    grid: Grid | Sequence[Grid],
    *,
    num_global_tokens: int = 0,
    grid_start: int | Sequence[int] | None = None,
) -> tuple[Item, ...]:
    """The items of packed rows: item m has ``lengths[m]`` rows, one after the other."""
    count = len(lengths)
    grids = [tuple(g) for g in grid] if isinstance(grid, list) else [tuple(grid)] * count
    starts = _per_item(num_global_tokens if grid_start is None else grid_start, count)
    items, offset = [], 0
    for length, shape, start in zip(lengths, grids, starts):
        items.append(Item(offset, int(length), tuple(int(n) for n in shape), int(start),
                          grid_start is not None))
        offset += int(length)
    return tuple(items)


def build_plan(
    total: int,
    items: tuple[Item, ...],
    kernel: tuple[int, ...],
    dilation: tuple[int, ...],
    tiles: tuple[int, ...],
    device: torch.device | str,
    *,
    causal: bool | tuple[bool, ...] = False,
) -> Plan:
    """The tile plan of ``items`` laid out in ``total`` flat rows, for :func:`neighborhood_rows`.

    Cached (bounded in bytes); ``items`` come from :func:`padded_items` or
    :func:`packed_items`, ``tiles`` from :func:`choose_tiles`; ``kernel``, ``dilation``,
    ``tiles`` and ``causal`` have one entry per grid axis (an int or bool: every axis).

    Raises:
        TypeError / ValueError: an item whose grid does not fit its rows, items that
            overlap or leave ``[0, total)``, items of different numbers of axes; an even
            kernel, a dilation or tile side < 1; per-axis arguments of another length.

    Examples:
        >>> items = packed_items([6, 4], [(2, 3), (2, 2)])
        >>> plan = build_plan(10, items, (3, 3), (1, 1), choose_tiles(items, (3, 3), (1, 1)),
        ...                   "cpu")
        >>> plan.pick.shape, plan.width
        (torch.Size([10]), 6)
    """
    items, kernel, dilation, tiles, causal = _inputs.check_items(
        total, items, kernel, dilation, tiles, causal)
    return cached_plan(total, items, kernel, dilation, tiles, device, causal)


def neighborhood_rows(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    plan: Plan,
    *,
    key_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    need_weights: bool = False,
    modifiers: Modifiers | None = None,
    table: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Neighbourhood attention on flat rows, after :func:`build_plan`.

    Args:
        q, k, v: the rows of every item, one after the other.
        plan: the geometry, from :func:`build_plan` for these rows.
        key_mask: (r,) bool, True = real key, or float added to the scores; None = all real.
        dropout_p: dropout on the attention weights.
        scale: score scale; default ``1 / sqrt(e)``.
        need_weights: also return each row's weights over its item's tokens.
        modifiers, table: as :func:`neighborhood_attend` (the plan's kernel and dilation).

    Shape:
        - q: (r, h, e); k: (r, k, e); v: (r, k, e_v) with ``k`` dividing ``h``
        - returns: (r, h, e_v), and weights (r, h, plan.width) or None

    Raises:
        TypeError / ValueError: tensors that do not fit together, a plan built for another
            number of rows, a key mask of another shape or an integer one, modifiers or a
            table of other heads or another window.

    Examples:
        >>> items = packed_items([6, 4], [(2, 3), (2, 2)])
        >>> plan = build_plan(10, items, (3, 3), (1, 1), (4, 4), "cpu")
        >>> q = k = v = torch.randn(10, 2, 8)
        >>> neighborhood_rows(q, k, v, plan)[0].shape
        torch.Size([10, 2, 8])
    """
    _inputs.check_heads(q, k, v, "(r, h, e)")
    if q.shape[0] != k.shape[0]:
        raise ValueError(
            f"q and k must have the same rows (self-attention on a grid), got q "
            f"{tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a Plan from build_plan, got {type(plan).__name__}")
    if plan.pick.shape[0] != q.shape[0] or plan.pick.device != q.device:
        raise ValueError(
            f"plan was built for {plan.pick.shape[0]} rows on {plan.pick.device}, got "
            f"{q.shape[0]} rows on {q.device}; build it with build_plan(total={q.shape[0]}, ...)"
        )
    _inputs.check_key_mask(key_mask, (q.shape[0],), q, "(r,)")
    _inputs.check_options(dropout_p, scale, need_weights)
    _inputs.check_modifiers(modifiers, table, q.shape[1], plan.key.kernel, q)
    out, weights = run_tiles(
        q[None], k[None], v[None], plan, None if key_mask is None else key_mask[None],
        dropout_p=dropout_p, scale=scale, need_weights=need_weights,
        modifiers=modifiers or None, table=table,
    )
    return out[0], (None if weights is None else weights[0])


def neighborhood_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    grid: Grid | Sequence[Grid],
    kernel_size: int | tuple[int, ...],
    *,
    dilation: int | tuple[int, ...] = 1,
    causal: bool | tuple[bool, ...] = False,
    num_global_tokens: int = 0,
    grid_start: int | Sequence[int] | None = None,
    key_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    need_weights: bool = False,
    tiles: tuple[int, ...] | None = None,
    modifiers: Modifiers | None = None,
    table: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Neighbourhood attention on a padded batch of head-split tensors.

    Args:
        q, k, v: queries, keys, values of one length ``l``.
        grid: one grid for every item ((length,), (rows, cols) or (frames, rows, cols)), or
            a list of per-item grids with one number of axes (item m's grid covers its
            tokens ``[g, g + prod(grid_m))``; the rest of the item is padding).
        kernel_size, dilation: one int per grid axis, or one int for every axis; kernels
            odd.
        causal: one bool per grid axis (NATTEN's ``is_causal``), or one for every axis: on
            a causal axis a query's window is the (at most) k positions ending at it.
        num_global_tokens: ``g``; the first g tokens see and are seen by every token.
        grid_start: the grid's first token (int or per item) when the grid sits inside the
            sequence; every token outside the grid is then global.
        key_mask: (b, l) bool, True = real key, or float added to the scores.
        dropout_p, scale: as :func:`mmattn.kernels.dense.attend`.
        need_weights: also return the dense (b, h, l, l) weights (O(l²) memory).
        tiles: tile shape; default :func:`choose_tiles`.
        modifiers: sinks, softcap and ALiBi (:class:`~mmattn.kernels.modifiers.Modifiers`);
            ALiBi's distance is Euclidean between grid cells, 0 for a pair with a global
            token (:mod:`._neighborhood_terms`).
        table: ((2 kh − 1)(2 kw − 1), h) relative-position bias table in Swin's layout
            (NAT's ``rpb``; 2-D grids only), or None.

    Shape:
        - q: (b, h, l, e); k, v: (b, k, l, e) with ``k`` dividing ``h``
        - returns: (b, h, l, e) and (b, h, l, l) weights or None

    Raises:
        TypeError / ValueError: tensors that do not fit together; a grid that is not 1 to 3
            ints or does not fit the length; an even kernel, a dilation < 1; a per-axis
            kernel, dilation or causal of another length than the grid's axes; modifiers or
            a table of other heads or another window, a table on a grid that is not 2-D.
        NotImplementedError: while exporting, per-item grids or ``need_weights``.

    Examples:
        >>> q = k = v = torch.randn(2, 4, 8 * 8, 16)
        >>> out, _ = neighborhood_attend(q, k, v, (8, 8), (3, 3))
        >>> out.shape
        torch.Size([2, 4, 64, 16])
        >>> video = torch.randn(1, 2, 4 * 6 * 6, 16)
        >>> neighborhood_attend(video, video, video, (4, 6, 6), (3, 5, 5),
        ...                     causal=(True, False, False))[0].shape
        torch.Size([1, 2, 144, 16])
    """
    _inputs.check_heads(q, k, v, "(b, h, l, e)")
    batch, heads, length, _ = q.shape
    if k.shape[2] != length:
        raise ValueError(
            f"q and k must have the same length (self-attention on a grid), got q "
            f"{tuple(q.shape)} and k {tuple(k.shape)}"
        )
    num_global_tokens = checks.check_positive_int("num_global_tokens", num_global_tokens,
                                                  minimum=0)
    _inputs.check_key_mask(key_mask, (batch, length), q, "(b, l)")
    _inputs.check_options(dropout_p, scale, need_weights)
    shared = not (_inputs.is_grid_list(grid) or isinstance(grid_start, (Sequence, Tensor)))
    traced = exporting() or not isinstance(batch, int)  # symbolic batch: one item's plan
    if traced:
        _inputs.check_exportable(grid, grid_start, length)
        if need_weights:
            raise NotImplementedError(
                "NeighborhoodAttention does not export need_weights=True; export without it"
            )
    grid, grid_start = _inputs.check_geometry(
        grid, grid_start, [length] * (1 if shared else batch), num_global_tokens,
        packed=False,
    )
    shape = grid[0] if isinstance(grid, list) else grid
    kernel, dilation, causal = check_window(shape, kernel_size, dilation, causal)
    _inputs.check_modifiers(modifiers, table, heads, kernel, q)
    modifiers = modifiers or None
    if tiles is not None:
        tiles = checks.check_axes("tiles", tiles, len(shape), grid=shape)
    choice = None
    if not traced and batch and length:  # CUDA (or forced): an engine first
        out, choice = _routes.neighborhood(
            q, k, v, grid, kernel, dilation, causal,
            first=num_global_tokens if grid_start is None else grid_start, key_mask=key_mask,
            dropout_p=dropout_p, need_weights=need_weights, modifiers=modifiers, table=table,
            scale=scale)
        if out is not None:
            return out, None
    if _kernel.reporting():
        _kernel.report(
            "neighborhood", _kernel.explicit_reasons(need_weights, modifiers),
            **_routes.fallback(choice),
            q=q, k=k, v=v,
            mask=key_mask, dropout_p=dropout_p, is_causal=False, scale=scale,
            kernel_size=kernel, dilation=dilation, causal=causal,
            num_global_tokens=num_global_tokens, grid=grid, grid_start=grid_start,
            modifiers=modifiers, position_bias=table,
        )
    if not traced and (batch == 0 or length == 0):
        return _kernel.attend(q, k, v, None, need_weights=need_weights, report_path=False)
    length = int(length)  # the plan's static size (a traced length is specialised here)
    items = padded_items(
        1 if shared else batch, length, grid, num_global_tokens=num_global_tokens,
        grid_start=grid_start,
    )
    return attend_padded(
        q, k, v, items, kernel, dilation, tiles, causal=causal, shared=shared,
        key_mask=key_mask,
        dropout_p=dropout_p, scale=scale, need_weights=need_weights, modifiers=modifiers,
        table=table,
    )


def weight_tiles(record: dict) -> Iterator[Tile]:
    """The tiles of a neighbourhood call's report
    (:func:`mmattn.kernels._report_tiles.weight_tiles`) on its flat rows (a padded call's
    plan over every item of its batch): the plan's tiles with their window masks and
    additive term (grid ALiBi, the table; global rows get none), then each item's global
    rows against every key of the item.
    """
    q, k, key_mask = record["q"], record["k"], record.get("mask")
    plan = record.get("plan")
    kernel, dilation = tuple(record["kernel_size"]), tuple(record["dilation"])
    if plan is None:  # the padded form: a plan over every item of the batch
        batch, _, length, _ = q.shape
        items = padded_items(batch, length, record["grid"],
                             num_global_tokens=record["num_global_tokens"],
                             grid_start=record["grid_start"])
        plan = build_plan(batch * length, items, kernel, dilation,
                          choose_tiles(items, kernel, dilation), q.device,
                          causal=tuple(record["causal"]))
        q, k = (rearrange(t, "b h l e -> (b l) h e") for t in (q, k))
        key_mask = None if key_mask is None else key_mask.reshape(-1)
    rows, heads, _ = q.shape
    scale, mods = default_scale(q, record.get("scale")), modifiers_of(record)
    term = _grid_term(record, plan, q)
    qz = torch.cat([q, q.new_zeros(1, *q.shape[1:])])  # row ``rows``: none
    kz = torch.cat([k, k.new_zeros(1, *k.shape[1:])])
    km = None
    if key_mask is not None:
        fill = False if key_mask.dtype == torch.bool else float("-inf")
        km = torch.cat([key_mask, key_mask.new_full((1,), fill)])
    n, s, t = plan.allowed.shape
    step = max(1, TILE_ELEMENTS // max(1, heads * s * t))
    pick = torch.cat([plan.pick, plan.pick.new_full((1,), -1)])
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        qi, ki = plan.q_index[n0 * s:n1 * s], plan.k_index[n0 * t:n1 * t]
        ok = merge_key_mask(plan.allowed[n0:n1][:, None], _keys(km, ki, t))
        bias = None if term is None else term(qi.view(n1 - n0, s), ki.view(n1 - n0, t))
        slot = torch.arange(n0 * s, n1 * s, device=q.device)
        picked = (qi < rows) & (pick[qi] == slot)  # a row answered by its first tile
        yield Tile(rearrange(qz[qi], "(n s) h e -> n h s e", s=s),
                   rearrange(kz[ki], "(n t) k e -> n k t e", t=t), ok, bias, scale,
                   torch.where(picked, qi, -1).view(n1 - n0, s),
                   torch.where(ki < rows, ki, -1).view(n1 - n0, t), mods=mods)
    for b in range(plan.gq_index.shape[0]):  # global rows attend every key of their item
        gq, gk, valid = plan.gq_index[b:b + 1], plan.gk_index[b:b + 1], plan.gk_valid[b:b + 1]
        ok = merge_key_mask(valid[:, None, None], _keys(km, gk.reshape(-1), gk.shape[1]))
        yield Tile(rearrange(qz[gq], "n g h e -> n h g e"),
                   rearrange(kz[gk], "n j k e -> n k j e"), ok, None, scale,
                   torch.where(gq < rows, gq, -1), torch.where(valid, gk, -1), mods=mods)


def _keys(km: Tensor | None, index: Tensor, width: int) -> Tensor | None:
    """The key mask gathered for tiles of ``width`` keys: (n, 1, 1, t), or None."""
    return None if km is None else rearrange(km[index], "(n t) -> n 1 1 t", t=width)


def _grid_term(record: dict, plan: Plan, q: Tensor):
    """(query rows (n, s), key rows (n, t)) -> (n, h, s, t): the report's grid ALiBi and
    table between the cells of a chunk's rows (:func:`._neighborhood_terms.pair_terms`, on
    the cells of the plan's rows), or None."""
    mods, table = record.get("modifiers"), record.get("position_bias")
    slopes = mods.slopes if mods else None
    if slopes is None and table is None:
        return None
    coords = plan_coords(plan)
    kernel, dilation = plan.key.kernel, plan.key.dilation

    def term(q_rows: Tensor, k_rows: Tensor) -> Tensor:
        return pair_terms(coords, q_rows, k_rows, slopes=slopes, table=table, kernel=kernel,
                          dilation=dilation, dtype=acc_dtype(q))

    return term
