"""The packed forward of every attention module: jagged nested query, key and value.

Axis key: ``b`` batch, ``t`` packed tokens, ``h`` query heads, ``k`` key heads, ``e`` head
width, ``d`` model width, ``n`` items in a bucket, ``i``/``j`` padded query/key length.

``MultiHeadAttention.forward`` (and so every variant) hands jagged input here. The
projections run on the packed ``values()``; attention runs per bucket of similar lengths
(:mod:`mmattn.kernels.packed`) through the module's own ``_attention`` hook, so LocalAttention,
AdditiveAttention and LinformerAttention keep their kernels; the plain dot-product hook calls
SDPA directly (or torch's jagged SDPA on CUDA).
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor, nn

from mmattn.attention._appended import extra_keys, num_extra_keys
from mmattn.attention._modifiers import score_modifiers
from mmattn.attention._packed_checks import check_attn_mask, check_packed, check_values
from mmattn.attention._positions import check_packed_positions
from mmattn.kernels import _routes
from mmattn.kernels import dense as _kernel
from mmattn.kernels.dense import report_facts
from mmattn.kernels.packed import (
    Bucket,
    contiguous_parts,
    jagged,
    jagged_sdpa,
    layout,
    report,
)


@torch.compiler.disable(recursive=False)  # plans eagerly; the calls it makes are compiled
def packed_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None,
    need_weights: bool,
    attn_mask: Tensor | None,
    average_attn_weights: bool,
    is_causal: bool,
    positions: Tensor | None = None,
) -> tuple[Tensor, list[Tensor] | None]:
    """Attention on packed (jagged) input; see ``MultiHeadAttention.forward``.

    Shape:
        - query: (b, i*, embed_dim) jagged; key: (b, j*, kdim); value: (b, j*, vdim), key and
          value with the same offsets
        - attn_mask: (max i, max j) or (b · h, max i, max j), applied to each item's top-left
          corner as it would be to the padded batch
        - positions: (b, max i, a) or (b, max i): item m's first i_m rows (query = key)
        - returns: (b, i*, embed_dim) jagged with the query's offsets, and when
          ``need_weights`` a list of b tensors (i_m, j_m), or (h, i_m, j_m) per head
    """
    check_packed(module, query, key, value, key_padding_mask)
    qv, q_off = contiguous_parts(query)
    kv, k_off = (qv, q_off) if key is query else contiguous_parts(key)
    vv, v_off = (kv, k_off) if value is key else contiguous_parts(value)
    if v_off is not k_off and not torch.equal(k_off, v_off):
        raise ValueError(
            f"key and value must have the same lengths per item, got key lengths "
            f"{k_off.diff().tolist()} and value lengths {v_off.diff().tolist()}"
        )
    out, weights = attend_values(
        module, qv, q_off, kv, k_off, vv, need_weights=need_weights, attn_mask=attn_mask,
        average_attn_weights=average_attn_weights, is_causal=is_causal,
        self_attention=query is key and key is value, positions=positions,
    )
    return jagged(out, q_off), weights


@torch.compiler.disable(recursive=False)
def attend_values(
    module: nn.Module,
    qv: Tensor,
    q_off: Tensor,
    kv: Tensor,
    k_off: Tensor,
    vv: Tensor,
    *,
    need_weights: bool = False,
    attn_mask: Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
    self_attention: bool = False,
    positions: Tensor | None = None,
) -> tuple[Tensor, list[Tensor] | None]:
    """:func:`packed_forward` on the packed rows themselves (no nested tensor in or out).

    Blocks call this directly: wrapping and unwrapping jagged tensors costs more than a
    small attention call. ``self_attention`` says that q, k and v are the same rows;
    ``positions`` (b, max lᵢ[, a]) are the rows' own (``Tokens.meta["positions"]``).

    Shape:
        - qv: (t_q, embed_dim); kv: (t_k, kdim); vv: (t_k, vdim); offsets (b + 1,)
        - returns: (t_q, embed_dim), and the per-item weights or None
    """
    check_values(module, qv, kv, vv)
    q_lens = q_off.diff().tolist()
    k_lens = q_lens if self_attention else k_off.diff().tolist()
    module._check_lengths(q_lens, k_lens, is_causal=is_causal, attn_mask=attn_mask)
    attn_mask = check_attn_mask(module, attn_mask, q_lens, k_lens, qv)
    pos_rows = check_packed_positions(module, positions, q_lens, qv, k_lens)  # (t[, a])
    e = module.head_dim
    dropout_p = module.dropout if module.training else 0.0
    extra = num_extra_keys(module)
    groups = module.num_heads // module.num_kv_heads
    # The position module on q and k after the head split (``position(x, offset)``, x (b, h,
    # l, e)): per bucket each item starts at position 0, or sits at its rows' positions.
    position = module.position
    direct = module._plain_attention() and _kernel.use_fused_attn()
    # score modifiers run in the module's own hook (each item's positions start at 0)
    direct = direct and not need_weights and extra == 0 and score_modifiers(module) is None
    facts = {"q_lengths": q_lens, "k_lengths": k_lens}

    jagged_ok = direct and attn_mask is None and position is None and qv.is_cuda
    fallback = []
    if jagged_ok and min(q_lens + k_lens, default=0) > 0 and (not is_causal or q_lens == k_lens):
        q, k, v = (
            rearrange(proj(t), "t (h e) -> t h e", e=e)
            for proj, t in ((module.q_proj, qv), (module.k_proj, kv), (module.v_proj, vv))
        )
        out, _ = module._step(_routes.packed, q, k, v, q_off, k_off, max(q_lens), max(k_lens),
                              is_causal=is_causal, dropout_p=dropout_p, groups=groups)
        if out is not None:  # varlen_attn (mmattn.kernels.engines), reported there
            return module.out_proj(rearrange(out, "t h e -> t (h e)")), None
        try:
            out = module._step(
                jagged_sdpa, q, k, v, q_off, k_off, dropout_p=dropout_p, is_causal=is_causal,
                groups=groups,
            )
        except (RuntimeError, NotImplementedError, ValueError) as error:  # no kernel fits
            fallback = [f"torch's jagged SDPA refused these inputs: {error}"]
        else:  # jagged_sdpa reported the call
            return module.out_proj(rearrange(out, "t h e -> t (h e)")), None

    plan_k = [length + extra for length in k_lens]
    plan_of = layout(
        tuple(q_lens), tuple(plan_k), tuple(k_lens), module._packed_cost_key(), module.embed_dim,
        qv.device,
    )
    buckets = plan_of.buckets
    # Path reports: each bucket's SDPA call reports its own tensors below (direct); the
    # module's own kernel reports each bucket call itself (local, explicit, chunked, ...).
    sizes = [(len(b.items), b.q_len, b.k_len) for b in buckets]

    # Gather every bucket's padded rows at once, then project: one gather (one scatter in
    # backward) per input, and self-attention shares its gather.
    q_rows = qv.index_select(0, plan_of.q_index)
    if self_attention and extra == 0:
        k_rows = v_rows = q_rows
    else:
        if kv.shape[0] == 0:  # only appended keys exist: gather from one (masked) zero row
            kv, vv = kv.new_zeros(1, kv.shape[1]), vv.new_zeros(1, vv.shape[1])
        k_rows = kv.index_select(0, plan_of.k_index)
        v_rows = k_rows if kv is vv else vv.index_select(0, plan_of.k_index)
    q_sizes = [len(b.items) * b.q_len for b in buckets]
    k_sizes = [len(b.items) * b.k_len for b in buckets]
    if pos_rows is not None:  # the rows' positions, gathered as the rows are
        q_pos = pos_rows.index_select(0, plan_of.q_index).split(q_sizes)
        k_pos = pos_rows.index_select(0, plan_of.k_index).split(k_sizes)
    qs = module.q_proj(q_rows).split(q_sizes)
    ks = module.k_proj(k_rows).split(k_sizes)
    vs = module.v_proj(v_rows).split(k_sizes)
    extra_k, extra_v = extra_keys(module, e, qv.dtype, qv.device)

    outs, bucket_weights = [], []
    for index, bucket in enumerate(buckets):
        n = len(bucket.items)
        qb = rearrange(qs[index], "(n i) (h e) -> n h i e", n=n, e=e)
        kb = rearrange(ks[index], "(n j) (k e) -> n k j e", n=n, e=e)
        vb = rearrange(vs[index], "(n j) (k e) -> n k j e", n=n, e=e)
        if pos_rows is not None:
            qb = position(qb, rearrange(q_pos[index], "(n i) ... -> n i ...", n=n))
            kb = position(kb, rearrange(k_pos[index], "(n j) ... -> n j ...", n=n))
        elif position is not None:
            qb, kb = position(qb, 0), position(kb, 0)
        mask = plan_of.key_masks[index]
        causal = is_causal
        if attn_mask is not None:
            mask = _combine(mask, _bucket_attn_mask(attn_mask, bucket, module.num_heads))
        if extra:
            if causal:
                mask = _kernel.with_causal(mask, bucket.q_len, bucket.k_len, qb.device)
                causal = False
            kb = torch.cat([kb, extra_k.expand(n, -1, -1, -1)], dim=2)
            vb = torch.cat([vb, extra_v.expand(n, -1, -1, -1)], dim=2)
            mask = _open_extra(mask, n, bucket, extra, qb.device)
        with report_facts(bucket=index, items=bucket.items, **facts):
            w = None
            if direct:  # padded keys repeat the item's own rows: no dead keys to clear
                if mask is not None and causal:
                    mask = _kernel.with_causal(mask, bucket.q_len, bucket.k_len, qb.device)
                    causal = False
                if _kernel.reporting():
                    report("buckets", fallback if index == 0 else [], q=qb, k=kb, v=vb,
                           mask=mask, is_causal=causal, dropout_p=dropout_p, groups=groups,
                           buckets=sizes)
                # only the user's mask may leave a row without keys
                out = module._step(
                    _kernel.sdpa, qb, kb, vb, mask, dropout_p=dropout_p, is_causal=causal,
                    groups=groups, dead_rows=attn_mask is not None,
                )
            else:
                out, w = module._step(
                    module._attention, qb, kb, vb, mask, is_causal=causal, dropout_p=dropout_p,
                    need_weights=need_weights,
                )
        if w is not None:
            bucket_weights.append((index, w))
        outs.append(rearrange(out, "n h i e -> (n i) (h e)"))
    outs.append(qv.new_zeros(1, module.embed_dim))  # the result of items without keys
    out = torch.cat(outs).index_select(0, plan_of.rows)
    out = module.out_proj(out)
    if not need_weights:
        return out, None
    maps = _item_weights(module, bucket_weights, buckets, q_lens, k_lens, extra, qv)
    if average_attn_weights:
        maps = [w.mean(dim=0) for w in maps]
    return out, maps


def _open_extra(mask: Tensor | None, n: int, bucket: Bucket, extra: int, device) -> Tensor:
    """Extend a bucket mask over ``extra`` appended, always-visible key columns."""
    if mask is None:
        mask = torch.ones(n, 1, 1, bucket.k_len, dtype=torch.bool, device=device)
    fill = True if mask.dtype == torch.bool else 0.0
    pad = mask.new_full((*mask.shape[:-1], extra), fill)
    return torch.cat([mask, pad], dim=-1)


def _combine(key_mask: Tensor | None, mask: Tensor) -> Tensor:
    """SDPA-direction key mask AND a bool or additive attention mask."""
    if key_mask is None:
        return mask
    if mask.dtype == torch.bool:
        return key_mask & mask
    return mask.masked_fill(~key_mask, float("-inf"))


def _bucket_attn_mask(attn_mask: Tensor, bucket: Bucket, num_heads: int) -> Tensor:
    """The top-left (i, j) corner of a module-direction attn_mask, in the SDPA direction."""
    if attn_mask.dim() == 2:
        corner = attn_mask[None, None, : bucket.q_len, : bucket.k_len]
    else:
        items = torch.tensor(bucket.items, dtype=torch.long, device=attn_mask.device)
        grouped = rearrange(attn_mask, "(b h) i j -> b h i j", h=num_heads)
        corner = grouped.index_select(0, items)[:, :, : bucket.q_len, : bucket.k_len]
    return ~corner if corner.dtype == torch.bool else corner


def _item_weights(module, bucket_weights, buckets, q_lens, k_lens, extra, like) -> list[Tensor]:
    """Per-item (h, i_m, key columns) maps in batch order: real keys then appended keys."""
    projected = module._packed_weights_width()  # Linformer: weights over its slots
    heads = module.num_heads
    maps: list[Tensor | None] = [None] * len(q_lens)
    # the kernels' weights dtype (float32 under CUDA autocast), also for items without keys
    dtype = bucket_weights[0][1].dtype if bucket_weights else like.dtype
    for index, w in bucket_weights:
        bucket = buckets[index]
        for slot, m in enumerate(bucket.items):
            item = w[slot, :, : q_lens[m]]
            if projected is None:
                item = torch.cat([item[..., : k_lens[m]], item[..., bucket.k_len:]], dim=-1)
            maps[m] = item
    for m, found in enumerate(maps):
        if found is None:  # no query or no key: nothing attended
            width = projected if projected is not None else k_lens[m] + extra
            maps[m] = like.new_zeros(heads, q_lens[m], width, dtype=dtype)
    return maps
