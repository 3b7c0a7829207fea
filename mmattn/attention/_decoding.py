"""Decoding with a cache: the one step every attention layer shares.

Axis key: ``b`` batch, ``h`` heads, ``i`` new query tokens, ``j`` cached keys, ``e`` head
width. A layer owns what differs: ``cache_kinds`` (which caches it takes),
``make_cache`` and ``_attend_cached`` (e.g. LocalAttention's band over its ring).
"""

from __future__ import annotations

from torch import Tensor, nn

from mmattn.cache import ContextCache, KVCache, LocalKVCache, check_cache_call
from mmattn.masks import merge_masks


def check_cache_step(
    module: nn.Module,
    cache: object,
    batched: bool,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    is_causal: bool,
) -> None:
    """Raise unless ``cache`` can serve this call (sizes and dtype are checked later)."""
    module._check_cacheable()
    window, always_causal = module._cache_rules()
    check_cache_call(
        type(module).__name__, cache, kinds=module.cache_kinds,
        device=module.q_proj.weight.device, window_size=window, batched=batched,
        key_padding_mask=key_padding_mask, attn_mask=attn_mask,
        causal=is_causal or always_causal, position=module.position,
    )


def cached_step(
    module: nn.Module,
    q: Tensor,
    key: Tensor,
    value: Tensor,
    cache: KVCache | LocalKVCache | ContextCache,
    key_padding_mask: Tensor | None,
    dropout_p: float,
    need_weights: bool,
) -> tuple[Tensor, Tensor | None]:
    """One decoding step: new keys at ``offset = len(cache)``, then attend the cache.

    Shape:
        - q: (b, h, i, e); key: (b, i, kdim); value: (b, i, vdim)
        - returns: (b, h, i, e) and weights (b, h, i, j), or None
    """
    cache.check_batch("query", q.shape[0])
    if isinstance(cache, ContextCache):
        k = v = mask = None
        if not cache.filled:
            k, v = module._project_kv(key, value)
            mask = merge_masks(
                key_padding_mask, None, batch_size=q.shape[0], num_heads=module.num_heads,
                dtype=q.dtype,
            )
        k, v, mask = cache.update(k, v, mask)
    else:
        k, v = module._project_kv(key, value)
        if module.position is not None:
            offset = cache.offset
            q, k = module.position(q, offset), module.position(k, offset)
        k, v, mask = cache.update(k, v)
    return module._attend_cached(q, k, v, mask, dropout_p=dropout_p, need_weights=need_weights)
