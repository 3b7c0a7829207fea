"""Blocked sliding-window attention: the O(L·w) kernel behind :class:`mmattn.LocalAttention`.

Axis key: ``b`` batch, ``h`` heads, ``l`` sequence length, ``e`` head width, ``n`` query
blocks, ``s`` queries in a block, ``t`` keys in a block's slab, ``g`` global tokens.

Query i may attend key j iff ``|i - j| <= w`` (and ``j <= i`` when causal). The sequence is
cut into ``n`` blocks of ``s`` queries; block ``m`` (queries ``[m·s, m·s + s)``) can only
reach keys in the slab ``[m·s - w, m·s + s + w)``. All slabs are gathered at once with
``unfold`` over a padded key sequence, so the whole band runs as ONE batched attention call
on (b·n, h, s, e) queries against (b·n, h, s + 2w, e) keys with a per-block band mask::

    keys   ─pad w─▶ |····|····|····|····|─pad─▶ unfold(size=s+2w, step=s) ─▶ (b n) h t e
    queries ─pad──▶ |··|··|··|··|                rearrange               ─▶ (b n) h s e
    mask (b n) 1 s t = band(s, t) & real key & not global key

Memory and time are O(L·(s + 2w)); no (L, L) tensor exists unless weights are requested.

Global tokens (Longformer style): the first ``g`` keys are appended to every block's slab
(and removed from the band part so none is counted twice), and the first ``g`` query rows
are computed densely over all keys — O(g·L).

The per-block attention is :func:`mmattn.kernels.dense.attend`, so the fused
(``F.scaled_dot_product_attention``) and explicit (softmax) paths, dropout and the
"fully masked row gives zeros" rule are the same as in the dense modules.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from mmattn._helpers import ceil_div, exporting, surely
from mmattn.kernels import _inputs, _routes
from mmattn.kernels import dense as _kernel
from mmattn.kernels._scores import default_scale
from mmattn.kernels._tiles import Tile, modifiers_of, split_mask
from mmattn.kernels.dense import attend
from mmattn.kernels.modifiers import Modifiers, with_bias

#: Smallest query block; below this the per-block matmuls are too small to be efficient.
MIN_BLOCK = 32


def default_block_size(window_size: int) -> int:
    """Query block size for a window: half the window, at least :data:`MIN_BLOCK`.

    A block of ``s`` queries attends ``s + 2w`` keys (``s + w`` causal), i.e. ``s + 2w``
    scores per query against the ideal ``2w + 1``: smaller blocks waste fewer scores, larger
    ones make bigger matmuls. ``s = w / 2`` measured best on CPU (docs/performance.md).
    """
    return max(MIN_BLOCK, window_size // 2)


def _key_bias(key_mask: Tensor | None, batch: int, length: int, dtype, device) -> Tensor:
    """(b, l) key mask as bool "real key" or additive float; all-True when None."""
    if key_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    if key_mask.dtype == torch.bool:
        return key_mask
    return key_mask.to(dtype)


def _exclude(keys: Tensor, drop: Tensor) -> Tensor:
    """Mark the keys where ``drop`` is True as not allowed (bool or additive ``keys``)."""
    if keys.dtype == torch.bool:
        return keys & ~drop
    return torch.where(drop, float("-inf"), keys)


def _combine(allowed: Tensor, keys: Tensor) -> Tensor:
    """Merge a bool "may attend" pattern with a bool or additive key mask (broadcasting)."""
    if keys.dtype == torch.bool:
        return allowed & keys
    return torch.where(allowed, keys, float("-inf"))


def local_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window_size: int,
    *,
    causal: bool = False,
    key_mask: Tensor | None = None,
    num_global_tokens: int = 0,
    block_size: int | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    need_weights: bool = False,
    groups: int | None = None,
    modifiers: Modifiers | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Blocked band attention on head-split tensors (checked in O(1): shapes, sizes, mask).

    Args:
        q, k, v: queries, keys, values of one length ``l``.
        window_size: ``w``; query i sees keys with ``|i - j| <= w``.
        causal: also require ``j <= i``.
        key_mask: (b, l) bool, True = real key (SDPA direction), or float added to scores.
        num_global_tokens: ``g``; the first g tokens see and are seen by every token.
        block_size: queries per block; default :func:`default_block_size`.
        dropout_p: dropout on the attention weights.
        scale: score scale; default ``1 / sqrt(e)``.
        need_weights: also return the dense (b, h, l, l) weights (O(l²) memory).
        groups: query heads per key head (modules pass it from their configuration).
        modifiers: sinks, softcap and ALiBi (:mod:`mmattn.kernels.modifiers`). ALiBi's
            distance inside the band is the rows' offset ``|i - j|`` (the same (h, s, t)
            term for every block); ``modifiers.q_pos`` (l, 1), when set, gives the rows'
            positions for the global tokens' distances (sequence parallelism).

    Shape:
        - q: (b, h, l, e); k: (b, k, l, e); v: (b, k, l, e_v) with ``k`` dividing ``h``
          (grouped-query attention: the kernel shares each key head with its query heads,
          never repeating K/V)
        - returns: (b, h, l, e_v) and (b, h, l, l) weights or None
    """
    _inputs.check_band(q, k, v, window_size, key_mask, num_global_tokens, block_size)
    batch, heads, length, _ = q.shape
    groups = _kernel.num_groups(q, k, groups)
    scale = default_scale(q, scale)
    if v.shape[-1] > q.shape[-1]:  # one head width (dense.one_width) before k's slabs copy it
        q, k, v, _ = _kernel.one_width(q, k, v, scale)
    mods = modifiers if modifiers else None
    facts = {"dropout_p": dropout_p, "scale": scale, "groups": groups, "causal": causal,
             "window_size": window_size, "num_global_tokens": num_global_tokens,
             "modifiers": mods}
    reasons = _kernel.explicit_reasons(need_weights, mods)
    if isinstance(length, int) and length and batch:
        out, choice = _routes.local(
            q, k, v, window_size, causal=causal, key_mask=key_mask,
            num_global_tokens=num_global_tokens, dropout_p=dropout_p, need_weights=need_weights,
            groups=groups, modifiers=mods, scale=scale)
        if out is not None:
            return out, None
        facts.update(_routes.fallback(choice))  # explain: the fallback ran, and why
    if length == 0 or batch == 0:
        if _kernel.reporting():
            _kernel.report("local", reasons, q=q, k=k, v=v, mask=key_mask, **facts)
        return _kernel.attend(
            q, k, v, None, scale=scale, need_weights=need_weights, report_path=False,
            groups=groups, modifiers=mods,
        )
    # Blocks of ceil(l / s); no negative floor division (ONNX's integer Div truncates).
    if isinstance(length, int) and not torch.compiler.is_compiling():
        # eager: clamped to the sequence (a wider band sees the same keys)
        window = min(window_size, length - 1)
        block = min(block_size or default_block_size(window), length)
        blocks = (length + block - 1) // block
    else:
        # Traced (torch.export, torch.compile): the layout depends on the window only, never
        # specialised to the length (a block of min(s, l) made one graph per short length
        # under dynamic compile). One spare block keeps ``n >= 2`` and the padded length
        # above ``l`` for every size, so no guard asks whether they are equal.
        window, block = window_size, block_size or default_block_size(window_size)
        blocks = (length + 2 * block - 1) // block
    glob = min(num_global_tokens, length)
    left, right = window, (0 if causal else window)
    slab = block + left + right
    padded = blocks * block
    device = q.device
    keys = _key_bias(key_mask, batch, length, q.dtype, device)  # (b, l)

    # Slabs of keys, values and key validity, one per query block.
    def slabs(t: Tensor, fill: float | bool = 0.0) -> Tensor:
        t = F.pad(t, (0, 0, left, padded - length + right), value=fill)
        return rearrange(t.unfold(2, slab, block), "b h n e t -> (b n) h t e")

    qb = q if surely(padded == length) else F.pad(q, (0, 0, 0, padded - length))
    qb = rearrange(qb, "b h (n s) e -> (b n) h s e", s=block)
    kb, vb = slabs(k), slabs(v)
    position = torch.arange(length, device=device)
    band_keys = _exclude(keys, position < glob)  # global keys come separately
    fill = False if band_keys.dtype == torch.bool else float("-inf")
    band_keys = F.pad(band_keys, (left, padded - length + right), value=fill)
    band_keys = rearrange(band_keys.unfold(1, slab, block), "b n t -> (b n) 1 1 t")
    # Block-relative band: query a (absolute m·s + a) vs slab key c (absolute m·s - left + c).
    offset = torch.arange(block, device=device)[:, None] + left
    offset = offset - torch.arange(slab, device=device)[None, :]  # i - j, (s, t)
    band = offset.abs() <= window
    if causal:
        band &= offset >= 0
    mask = _combine(band, band_keys)  # ((b n), 1, s, t)
    alibi = mods is not None and mods.slopes is not None
    rows = None
    if alibi:  # the band's term is one (1, h, s, t) tensor: the offsets of every block
        bias = mods.from_distance(offset.abs(), q.dtype)[None]
        rows = mods.q_pos[:, 0] if mods.q_pos is not None else position

    if glob:
        kg, vg = (
            rearrange(t[:, :, :glob], "b h g e -> b 1 h g e").expand(-1, blocks, -1, -1, -1)
            for t in (k, v)
        )
        kb = torch.cat([kb, rearrange(kg, "b n h g e -> (b n) h g e")], dim=2)
        vb = torch.cat([vb, rearrange(vg, "b n h g e -> (b n) h g e")], dim=2)
        glob_keys = rearrange(keys[:, :glob], "b g -> b 1 1 g")
        if causal:
            query_pos = rearrange(torch.arange(padded, device=device), "(n s) -> n s 1", s=block)
            seen = query_pos >= torch.arange(glob, device=device)  # (n, s, g)
        else:
            seen = torch.ones(1, 1, glob, dtype=torch.bool, device=device)
        glob_mask = _combine(seen, glob_keys)  # (b, n, s, g)
        glob_mask = rearrange(glob_mask.expand(-1, blocks, block, -1), "b n s g -> (b n) 1 s g")
        mask = torch.cat([mask.expand(-1, -1, block, -1), glob_mask], dim=-1)
        if alibi:  # global keys: each block's own distances, (b n, h, s, t + g)
            query_pos = F.pad(rows, (0, padded - length))
            query_pos = rearrange(query_pos, "(n s) -> n s 1", s=block)
            glob_bias = mods.alibi(query_pos, rows[:glob, None], q.dtype)  # (n, h, s, g)
            glob_bias = glob_bias.expand(batch, -1, -1, -1, -1).flatten(0, 1)
            bias = torch.cat([bias.expand(batch * blocks, -1, -1, -1), glob_bias], dim=-1)

    if key_mask is None and not surely(padded == length):
        # Without padding no real query row is fully masked; the extra rows past the end
        # may be, so open them (they are cropped) and skip the dead-row bookkeeping.
        tail = torch.arange(padded, device=device) >= length
        tail = rearrange(tail, "(n s) -> 1 n 1 s 1", s=block)
        mask = rearrange(mask, "(b n) 1 s t -> b n 1 s t", b=batch) | tail
        mask = rearrange(mask, "b n 1 s t -> (b n) 1 s t")
    block_mods = None
    if mods is not None:
        block_mods = mods.with_terms(bias if alibi else None)
    if _kernel.reporting():  # the call that runs: per-block tensors and the band mask
        _kernel.report("local", reasons, q=qb, k=kb, v=vb,
                       mask=with_bias(mask, bias) if alibi else mask,
                       inputs=(q, k, key_mask), **facts)
    shared = None
    if alibi and not glob and isinstance(length, int) and not exporting():
        dirty = None
        if key_mask is None:  # the ends only: known from the sizes
            dirty = _dirty_blocks(batch, blocks, block, left, right, length, q.device)
        elif key_mask.dtype == torch.bool and not torch.compiler.is_compiling():
            dirty = (~band_keys).flatten(1).any(1).nonzero().flatten()  # reads the mask
            dirty = dirty if 2 * dirty.numel() < batch * blocks else None
        shared = None if dirty is None else (band, dirty)
    out, wb = _attend_blocks(
        qb, kb, vb, mask, key_mask is not None, dropout_p, scale, need_weights, groups,
        block_mods, shared,
    )
    out = rearrange(out, "(b n) h s e -> b h (n s) e", b=batch)
    if isinstance(length, int) and not torch.compiler.is_compiling():
        out = out[:, :, :length]
    else:  # a gather, not a slice: no guard that the padded length holds l
        out = out.index_select(2, position)
    weights = None
    if need_weights:
        weights = _scatter_weights(wb, batch, length, block, left, right, glob)

    if glob:  # the global query rows see every key
        row_keys, glob_mods = _global_rows(keys, position, glob, causal, mods)
        out_g, weights_g = attend(
            q[:, :, :glob], k, v, row_keys, dropout_p=dropout_p, scale=scale,
            need_weights=need_weights, report_path=False, groups=groups, modifiers=glob_mods,
        )
        out = out.slice_scatter(out_g, dim=2, end=glob)  # no (l - g)-sized slice: no guard
        if need_weights:
            weights = torch.cat([weights_g, weights[:, :, glob:]], dim=2)
    return out, weights


def _global_rows(keys: Tensor, position: Tensor, glob: int, causal: bool,
                 mods: Modifiers | None) -> tuple[Tensor, Modifiers | None]:
    """The first ``glob`` query rows against every key: their mask (b, 1, g | 1, l) from the
    (b, l) key mask (and ``j <= i`` when causal), and their modifiers (ALiBi at the rows'
    positions, ``mods.q_pos`` when set)."""
    row_keys = rearrange(keys, "b j -> b 1 1 j")
    if causal:
        row_keys = _combine(position[None, :] <= position[:glob, None], row_keys)
    if mods is None or mods.slopes is None:
        return row_keys, mods
    rows = mods.q_pos[:, 0] if mods.q_pos is not None else position
    return row_keys, mods.at(rows[:glob, None], rows[:, None])


def _attend_blocks(
    qb: Tensor,
    kb: Tensor,
    vb: Tensor,
    mask: Tensor,
    dead_rows: bool,
    dropout_p: float,
    scale: float,
    need_weights: bool,
    groups: int,
    mods: Modifiers | None = None,
    shared: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """One batched attention call over all blocks.

    :func:`mmattn.kernels.dense.attend` guards rows without any allowed key; when the caller
    knows there are none (no key mask), the fused path calls SDPA directly and saves three
    passes over the (b·n, 1, s, t) mask and the output.

    With ALiBi the fused call needs one float mask: band AND key validity is per block, the
    ALiBi term per head, and their combination a (b·n, h, s, t) tensor as large as the
    scores. ``shared`` = (band (s, t), dirty block indices): every block first runs under
    the one (1, h, s, t) band + ALiBi mask, exact for the blocks whose slab lies inside the
    sequence and holds no padded key; the others (the ends, the padding) run again under
    their own masks and take their place.
    """
    if need_weights or not _kernel.use_fused_attn() or (mods and mods.explicit) or (
        dead_rows and shared is None
    ):
        return attend(qb, kb, vb, mask, dropout_p=dropout_p, scale=scale,
                      need_weights=need_weights, report_path=False, groups=groups,
                      modifiers=mods)
    sinks = None if mods is None else mods.sinks
    bias = None if mods is None else mods.bias
    if shared is None:
        return _kernel.sdpa(
            qb, kb, vb, with_bias(mask, bias), dropout_p=dropout_p, scale=scale, groups=groups,
            dead_rows=False, sinks=sinks,
        ), None
    band, dirty = shared
    if dead_rows:  # padded keys may hold anything (NaN): the shared pass reads them too
        kb, vb = _kernel.clear_dead_keys(mask, kb, vb)
    out = _kernel.sdpa(qb, kb, vb, with_bias(band, bias), dropout_p=dropout_p, scale=scale,
                       groups=groups, dead_rows=False, sinks=sinks)
    if dirty.numel():  # their own masks, dead rows guarded
        redo, _ = attend(
            qb.index_select(0, dirty), kb.index_select(0, dirty), vb.index_select(0, dirty),
            mask.index_select(0, dirty), dropout_p=dropout_p, scale=scale, report_path=False,
            groups=groups, modifiers=mods,
        )
        # along the layout SDPA writes ((b n), s, h, e), so the later reshapes stay views;
        # in place where nothing saved ``out`` for a backward pass
        rows, redo = out.transpose(1, 2), redo.transpose(1, 2)
        if out.requires_grad:
            rows = rows.index_copy(0, dirty, redo)
        else:
            rows = rows.index_copy_(0, dirty, redo)
        out = rows.transpose(1, 2)
    return out, None


def _dirty_blocks(
    batch: int, blocks: int, block: int, left: int, right: int, length: int, device
) -> Tensor | None:
    """((b n),) indices of the blocks whose key slab reaches past either end of the sequence
    (their mask is not the band's); None when no block's slab lies inside."""
    first = ceil_div(left, block)  # blocks m >= first start their slab at m·s - w >= 0
    stop = (length - block - right) // block + 1  # blocks m < stop end it inside
    if stop <= first:
        return None
    ends = [m for m in range(blocks) if m < first or m >= stop]
    index = [item * blocks + m for item in range(batch) for m in ends]
    return torch.tensor(index, dtype=torch.long, device=device)


def _scatter_weights(
    wb: Tensor, batch: int, length: int, block: int, left: int, right: int, glob: int
) -> Tensor:
    """Place per-block weights ((b n), h, s, t [+ g]) into the dense (b, h, l, l) map."""
    wb = rearrange(wb, "(b n) h s t -> b h n s t", b=batch)
    blocks = wb.shape[2]
    slab = block + left + right
    band, wg = wb[..., :slab], wb[..., slab:]
    width = blocks * block + left + right
    cols = torch.arange(blocks, device=wb.device)[:, None] * block
    cols = (cols + torch.arange(slab, device=wb.device)).view(1, 1, blocks, 1, slab)
    dense = wb.new_zeros(*wb.shape[:4], width).scatter(-1, cols.expand_as(band), band)
    dense = rearrange(dense[..., left:left + length], "b h n s j -> b h (n s) j")[:, :, :length]
    if glob:
        wg = rearrange(wg, "b h n s g -> b h (n s) g")[:, :, :length]
        dense = torch.cat([dense[..., :glob] + wg, dense[..., glob:]], dim=-1)
    return dense


def weight_tiles(record: dict) -> Iterator[Tile]:
    """The tiles of a local call's report (:func:`mmattn.kernels._report_tiles.weight_tiles`): its
    own blocks against their key slabs (the tensors it reports), and its global query rows
    against every key. Block m holds queries ``[m·s, m·s + s)`` and the slab of keys
    ``[m·s - w, m·s + s + w)`` (no right part when causal), then the global keys.
    """
    if "inputs" not in record:  # an empty sequence or batch: nothing attended
        return
    qb, kb, mask = record["q"], record["k"], record["mask"]
    q, k, key_mask = record["inputs"]
    batch, _, length, _ = q.shape
    scale = default_scale(q, record.get("scale"))
    window = min(record["window_size"], length - 1)
    glob = min(record["num_global_tokens"], length)
    block = qb.shape[2]
    blocks = qb.shape[0] // batch
    left, right = window, (0 if record["causal"] else window)
    device = q.device
    m = torch.arange(blocks, device=device)[:, None]
    q_pos = m * block + torch.arange(block, device=device)  # (n, s)
    k_pos = m * block - left + torch.arange(block + left + right, device=device)  # (n, t)
    k_pos = torch.cat([k_pos, torch.arange(glob, device=device).expand(blocks, -1)], dim=1)
    item = torch.arange(batch, device=device)[:, None, None] * length
    q_ids = torch.where((q_pos >= glob) & (q_pos < length), item + q_pos, -1)  # global: below
    k_ids = torch.where((k_pos >= 0) & (k_pos < length), item + k_pos, -1)
    yield Tile(qb, kb, *split_mask(mask), scale, rearrange(q_ids, "b n s -> (b n) s"),
               rearrange(k_ids, "b n t -> (b n) t"), mods=modifiers_of(record))
    if glob:  # the global query rows see every key, as the kernel runs them
        keys = _key_bias(key_mask, batch, length, q.dtype, device)
        row_keys, mods = _global_rows(keys, torch.arange(length, device=device), glob,
                                      record["causal"], record.get("modifiers"))
        ids = torch.arange(batch, device=device)[:, None] * length + torch.arange(
            length, device=device)
        yield Tile(q[:, :, :glob], k, *split_mask(row_keys), scale, ids[:, :glob], ids,
                   mods=mods)
