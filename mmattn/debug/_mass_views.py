"""One kernel call as tiles of attention problems, read from its path report.

Axis key: ``n`` slots (items of the call, or tiles), ``h`` query heads, ``k`` key heads, ``r``
query rows of a tile, ``j`` key columns of a tile, ``e`` head width, ``E`` edges, ``t``
flat token rows.

Every kernel tells the path listeners (:func:`mmattn.kernels.dense.add_listener`) what it is
about to run: its tensors and facts. A *view* turns one such report into :class:`Tile` s:
queries (n, h, r, e) against candidate keys (n, k, j, e) with the kernel's own mask, and the
token each row and column is (``-1``: no token — a padded row, an appended ``bias_k``/zero
key, an empty slot, a row another tile answers). A local call's tiles are its own blocks and
key slabs, a neighbourhood call's its plan's tiles, a dense call's blocks of rows; so a tile
holds O(block · keys of a block) scores and no view ever forms an (L, L) tensor. Each query
row is answered by exactly one tile of a call, so a consumer may add tiles up. Edge calls
give their (E, h) weights instead (:func:`edge_weights`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from einops import rearrange
from torch import Tensor

from mmattn.kernels import block_sparse
from mmattn.kernels import dense as _dense
from mmattn.kernels._segment import default_scale
from mmattn.kernels._segment_modifiers import edge_attend_modified_explicit
from mmattn.kernels.modifiers import Modifiers, with_bias


class Unsupported(Exception):
    """A call or kernel report attention_mass / top_keys cannot measure (then skipped)."""


#: At most this many scores in one tile (blocks of rows are cut to fit).
TILE_ELEMENTS = 1 << 22


class Tile(NamedTuple):
    """Queries against candidate keys, as the kernel runs them.

    ``allowed`` (bool, True = may attend) and ``bias`` (added) broadcast to (n, h, r, j);
    ``score_weight`` is set for additive (Bahdanau) scores instead of ``q kᵀ · scale``;
    ``softcap`` caps the scores before the mask (``c · tanh(s / c)``) and ``sinks`` (h,) join
    every row's softmax as a key of score ``σ_h`` whose weight is dropped (ALiBi and other
    additive terms are in ``bias``).
    """

    q: Tensor
    k: Tensor
    allowed: Tensor | None
    bias: Tensor | None
    scale: float
    q_tok: Tensor
    k_tok: Tensor
    score_weight: Tensor | None = None
    softcap: float | None = None
    sinks: Tensor | None = None


def modifiers_of(record: dict) -> dict:
    """The softcap and sinks a kernel report carries (its ``modifiers`` fact), as Tile
    fields; ALiBi is a view's ``bias`` (the dense kernels report their mask with it)."""
    mods = record.get("modifiers")
    if not mods:
        return {}
    return {"softcap": mods.softcap, "sinks": mods.sinks}


class Slots:
    """Token ids of (slot, position) coordinates: the items of a padded batch or a bucket.

    Slot ``n`` has queries at token ids ``q_base[n] + i`` for ``i < q_len[n]`` and keys at
    ``k_base[n] + j`` for ``j < k_len[n]``; other positions are no token (-1).
    """

    def __init__(self, q_base: Tensor, q_len: Tensor, k_base: Tensor, k_len: Tensor) -> None:
        self.q_base, self.q_len, self.k_base, self.k_len = q_base, q_len, k_base, k_len

    @staticmethod
    def _ids(base: Tensor, length: Tensor, slot: Tensor, pos: Tensor) -> Tensor:
        base, length = base[slot], length[slot]
        return torch.where((pos >= 0) & (pos < length), base + pos, -1)

    def query(self, slot: Tensor, pos: Tensor) -> Tensor:
        return self._ids(self.q_base, self.q_len, slot, pos)

    def key(self, slot: Tensor, pos: Tensor) -> Tensor:
        return self._ids(self.k_base, self.k_len, slot, pos)


# ---------------------------------------------------------------------- shared pieces


def _acc(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def weights(tile: Tile) -> Tensor:
    """The exact (n, h, r, j) weights of a tile, from the kernels' own explicit path
    (:func:`mmattn.kernels.dense.attend` with ``need_weights``, or its softmax on additive
    scores): their score function, modifiers and dead-row rule, on zero-width values."""
    mask = with_bias(tile.allowed, tile.bias)
    mods = Modifiers(sinks=tile.sinks, softcap=tile.softcap)
    none = tile.k.new_zeros(*tile.k.shape[:-1], 0)
    if tile.score_weight is None:
        _, w = _dense.attend(tile.q, tile.k, none, mask, scale=tile.scale, need_weights=True,
                             report_path=False, modifiers=mods)
        return w
    from mmattn.attention.additive import additive_scores

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


def _step(tile: Tile, elements: int) -> int:
    n, heads, rows, _ = tile.q.shape
    return max(1, elements // max(1, heads * rows * tile.k.shape[2]))


def chunks(tile: Tile, elements: int = TILE_ELEMENTS) -> Iterator[Tile]:
    """A tile cut along its slots so that each part holds at most ``elements`` scores."""
    n = tile.q.shape[0]
    step = _step(tile, elements)
    if step >= n:
        yield tile
        return
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        yield tile._replace(
            q=tile.q[n0:n1], k=tile.k[n0:n1], allowed=_part(tile.allowed, n0, n1),
            bias=_part(tile.bias, n0, n1), q_tok=tile.q_tok[n0:n1], k_tok=tile.k_tok[n0:n1],
        )


# ---------------------------------------------------------------------- dense


def dense_tiles(
    q: Tensor, k: Tensor, mask: Tensor | None, slots: Slots, *, is_causal: bool = False,
    scale: float | None = None, block: int = 64, score_weight: Tensor | None = None,
    softcap: float | None = None, sinks: Tensor | None = None,
) -> Iterator[Tile]:
    """Blocks of rows of ``softmax(q kᵀ · scale + mask)`` (or of additive scores).

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
        k_tok = slots.key(slot, cols[None])
        for r0 in range(0, length, rows):
            r1 = min(length, r0 + rows)
            ok = _part(allowed, n0, n1, r0, r1)
            if is_causal:
                causal = cols[None, :] <= torch.arange(r0, r1, device=q.device)[:, None]
                ok = causal if ok is None else ok & causal
            pos = torch.arange(r0, r1, device=q.device)[None]
            yield Tile(q[n0:n1, :, r0:r1], k[n0:n1], ok, _part(bias, n0, n1, r0, r1), scale,
                       slots.query(slot, pos), k_tok, score_weight, softcap, sinks)


# ---------------------------------------------------------------------- local band


def band_tiles(record: dict, slots: Slots) -> Iterator[Tile]:
    """A local call's own blocks against their key slabs (the tensors it reports), and its
    global query rows against every key.

    The kernel cuts the sequence into blocks of s queries; block m attends the slab of keys
    ``[m·s - w, m·s + s + w)`` (``w`` the window clamped to the sequence; no right part
    when causal), then the global keys.
    """
    qb, kb, mask = record["q"], record["k"], record["mask"]
    q, k, key_mask = record["inputs"]
    batch, _, length, width = q.shape
    scale = default_scale(q, record.get("scale"))
    if batch == 0 or length == 0:
        return
    window = min(record["window_size"], length - 1)
    glob = min(record["num_global_tokens"], length)
    block = qb.shape[2]
    blocks = qb.shape[0] // batch
    left, right = window, (0 if record["causal"] else window)
    slab = block + left + right
    device = q.device
    m = torch.arange(blocks, device=device)[:, None]
    q_pos = m * block + torch.arange(block, device=device)  # (n, s)
    k_pos = m * block - left + torch.arange(slab, device=device)  # (n, slab)
    k_pos = torch.cat([k_pos, torch.arange(glob, device=device).expand(blocks, -1)], dim=1)
    item = torch.arange(batch, device=device)[:, None, None]
    q_tok = slots.query(item, torch.where(q_pos >= glob, q_pos, -1)[None])  # global rows: below
    k_tok = slots.key(item, k_pos[None])
    allowed, bias = split_mask(mask)
    mods = modifiers_of(record)
    yield from chunks(Tile(qb, kb, allowed, bias, scale,
                           rearrange(q_tok, "b n s -> (b n) s"),
                           rearrange(k_tok, "b n t -> (b n) t"), **mods))
    if glob:  # the global query rows see every key
        cols = torch.arange(length, device=device)
        ok = None if not record["causal"] else (cols[None, :] <= cols[:glob, None])[None, None]
        keyed = None if key_mask is None else rearrange(key_mask, "b j -> b 1 1 j")
        bias = None
        if keyed is not None and keyed.dtype == torch.bool:
            ok = keyed if ok is None else ok & keyed
        else:
            bias = keyed
        alibi = _global_alibi(record.get("modifiers"), glob, length, q)
        if alibi is not None:
            bias = alibi if bias is None else bias + alibi
        item = torch.arange(batch, device=device)[:, None]
        yield from chunks(Tile(q[:, :, :glob], k, ok, bias, scale,
                               slots.query(item, cols[None, :glob]), slots.key(item, cols[None]),
                               **mods))


def _global_alibi(mods, glob: int, length: int, q: Tensor) -> Tensor | None:
    """ALiBi of a band's global rows against every key, at the kernel's positions."""
    if not mods or mods.slopes is None:
        return None
    rows = mods.q_pos[:, 0] if mods.q_pos is not None else torch.arange(length, device=q.device)
    acc = _acc(q)
    return mods.alibi(rows[:glob, None], rows[:, None], acc)[None]  # (1, h, g, l)


# ---------------------------------------------------------------------- neighbourhood


def plan_tiles(
    q: Tensor, k: Tensor, key_mask: Tensor | None, plan, *, scale: float | None, term=None,
    softcap: float | None = None, sinks: Tensor | None = None,
) -> Iterator[Tile]:
    """The tiles of a neighbourhood plan on flat rows; token ids are the rows. ``term``
    (query rows (n, s), key rows (n, t)) -> (n, h, s, t) or None: the tiles' additive term
    (grid ALiBi, the table; global rows get none), evaluated chunk by chunk.

    Shape:
        - q: (t, h, e); k: (t, k, e); key_mask: (t,) bool or float, or None
    """
    rows, heads, width = q.shape
    scale = default_scale(q, scale)
    zero = rows
    qz = torch.cat([q, q.new_zeros(1, *q.shape[1:])])
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
        qi = plan.q_index[n0 * s:n1 * s]
        ki = plan.k_index[n0 * t:n1 * t]
        ok, bias = _key_rule(plan.allowed[n0:n1][:, None], km, ki, t)
        extra = None if term is None else term(qi.view(n1 - n0, s), ki.view(n1 - n0, t))
        bias = extra if bias is None else bias if extra is None else bias + extra
        slot_id = torch.arange(n0 * s, n1 * s, device=q.device)
        picked = (qi < zero) & (pick[qi] == slot_id)  # a row answered by its first tile
        yield Tile(rearrange(qz[qi], "(n s) h e -> n h s e", s=s),
                   rearrange(kz[ki], "(n t) k e -> n k t e", t=t), ok, bias, scale,
                   torch.where(picked, qi, -1).view(n1 - n0, s),
                   torch.where(ki < zero, ki, -1).view(n1 - n0, t), softcap=softcap, sinks=sinks)
    for b in range(plan.gq_index.shape[0]):  # global rows attend every key of their item
        gq, gk = plan.gq_index[b:b + 1], plan.gk_index[b:b + 1]
        valid = plan.gk_valid[b:b + 1]
        ok, bias = _key_rule(valid[:, None, None], km, gk.reshape(-1), gk.shape[1])
        yield Tile(rearrange(qz[gq], "n g h e -> n h g e"),
                   rearrange(kz[gk], "n j k e -> n k j e"), ok, bias, scale,
                   torch.where(gq < zero, gq, -1), torch.where(valid, gk, -1), softcap=softcap,
                   sinks=sinks)


def _key_rule(ok: Tensor, km: Tensor | None, index: Tensor, width: int):
    """A tile's pattern with the gathered key mask: (allowed, bias)."""
    if km is None:
        return ok, None
    keyed = rearrange(km[index], "(n t) -> n 1 1 t", t=width)
    return (ok & keyed, None) if keyed.dtype == torch.bool else (ok, keyed)


# ---------------------------------------------------------------------- block-sparse


def sparse_tiles(record: dict) -> Iterator[Tile]:
    """A block-sparse call's buckets as its explicit path runs them: query tiles against
    their key tiles with the kernel's own bucket mask and ALiBi term
    (:func:`~mmattn.kernels.block_sparse.explicit_mask`); token ids ``b·L + i``.

    Shape:
        - q: (b, h, l, e); k: (b, k, l, e)
    """
    q, k, plan = record["q"], record["k"], record["plan"]
    batch, heads, length, width = q.shape
    padded, s = plan.padded, plan.block
    call = block_sparse.Call.of(record.get("key_mask"), bool(record.get("is_causal")), padded)

    def rows(x: Tensor) -> Tensor:  # (b, h, l, e) -> (b padded, h, e)
        x = rearrange(x, "b h l e -> b l h e")
        return torch.cat([x, x.new_zeros(batch, padded - length, *x.shape[2:])], 1).flatten(0, 1)

    def token(flat: Tensor) -> Tensor:
        pos = flat % padded
        return torch.where(pos < length, flat // padded * length + pos, -1)

    q2, k2 = rows(q), rows(k)
    mods = record.get("modifiers")
    for bucket in plan.buckets:
        mask, terms = block_sparse.explicit_mask(bucket, call._replace(mods=mods), padded,
                                                 _acc(q))
        allowed, bias = split_mask(mask)
        alibi = None if terms is None else terms.bias
        bias = alibi if bias is None else bias if alibi is None else bias + alibi
        yield from chunks(Tile(
            rearrange(q2[bucket.q_rows], "(n s) h e -> n h s e", s=s),
            rearrange(k2[bucket.k_rows], "(n t) k e -> n k t e", n=bucket.tiles), allowed,
            bias, default_scale(q, record.get("scale")), token(bucket.q_rows).view(
                bucket.tiles, s), token(bucket.k_rows).view(bucket.tiles, -1),
            **modifiers_of(record)))


# ---------------------------------------------------------------------- edges


def edge_weights(
    q: Tensor, k: Tensor, src: Tensor, dst: Tensor, bias: Tensor | None, scale: float | None,
    softcap: float | None = None, sinks: Tensor | None = None,
) -> Tensor:
    """The (E, h) weights of attention along edges, from the edge kernel's explicit twin
    (its scores, softcap, sink and segment softmax) on zero-width values.

    Shape:
        - q: (t_q, h, e); k: (t_k, k, e); src, dst: (E,); bias: (E, h)
    """
    none = k.new_zeros(*k.shape[:-1], 0)
    return edge_attend_modified_explicit(
        q, k, none, src, dst, Modifiers(sinks=sinks, softcap=softcap), bias=bias,
        scale=default_scale(q, scale))[1]
