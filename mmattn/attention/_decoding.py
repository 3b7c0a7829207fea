"""Decoding with a cache: the one step every attention layer shares.

Axis key: ``b`` batch, ``h`` heads, ``i`` new query tokens, ``j`` cached keys, ``e`` head
width. A layer owns what differs: ``cache_kinds`` (which caches it takes),
``make_cache`` and ``_attend_cached`` (e.g. LocalAttention's band over its ring).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mmattn._chunk_cache import check_no_look_ahead
from mmattn._helpers import default
from mmattn.attention._modifiers import ring_positions, step_modifiers
from mmattn.attention._positions import rotate
from mmattn.cache import ChunkCache, ContextCache, KVCache, LocalKVCache, check_cache_call
from mmattn.kernels.modifiers import Modifiers
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
    if isinstance(cache, ChunkCache):
        cache.check_owner(module)


def cached_step(
    module: nn.Module,
    q: Tensor,
    key: Tensor,
    value: Tensor,
    cache: KVCache | LocalKVCache | ContextCache | ChunkCache,
    key_padding_mask: Tensor | None,
    dropout_p: float,
    need_weights: bool,
    positions: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """One decoding step: new keys at ``offset = len(cache)`` (or at the new tokens' own
    ``positions``), then attend the cache.

    Shape:
        - q: (b, h, i, e); key: (b, i, kdim); value: (b, i, vdim)
        - positions: (b, i) or (b, i, a), checked
        - returns: (b, h, i, e) and weights (b, h, i, j), or None
    """
    cache.check_batch("query", q.shape[0])
    if isinstance(cache, ChunkCache):
        cache.check_self(q.shape[2], key.shape[1])
    if isinstance(cache, ContextCache):
        k = v = mask = None
        if not cache.filled:
            k, v = module._project_kv(key, value)
            mask = merge_masks(
                key_padding_mask, None, batch_size=q.shape[0], num_heads=module.num_heads,
                dtype=q.dtype,
            )
        k, v, mask = cache.update(k, v, mask)
        ring = None
    else:
        k, v = module._project_kv(key, value)
        if module.position is not None:
            q, k = rotate(module, q, k, cache.offset if positions is None else positions)
        ring = ring_positions(cache)
        padding = (key_padding_mask,) if isinstance(cache, ChunkCache) else ()
        k, v, mask = cache.update(k, v, *padding)
    modifiers = step_modifiers(module, cache, q.shape[2], k.shape[2], ring)
    return module._attend_cached(
        q, k, v, mask, dropout_p=dropout_p, need_weights=need_weights, modifiers=modifiers
    )


def refuse_chunk_cache(module: nn.Module, kwargs: dict) -> None:
    """Raise TypeError naming ``chunk`` (or ``left``/``right``) for a layer whose window
    crosses chunk borders: its make_cache has no chunk cache."""
    names = [name for name in ("chunk", "left", "right") if name in kwargs]
    if names:
        raise TypeError(
            f"{type(module).__name__}.make_cache does not take {names[0]}=: its window "
            "crosses chunk borders, so it cannot stream chunk by chunk; stream with "
            "MultiHeadAttention trained with attn_mask=P.chunked(...) (docs/streaming.md)"
        )


class Decoding:
    """The decoding surface every attention layer shares: :meth:`make_cache` and the hooks a
    variant overrides (``_cache_rules``, ``_check_cacheable``, ``_attend_cached``).

    Mixed into :class:`~mmattn.MultiHeadAttention`; the step itself is :func:`cached_step`.
    """

    def make_cache(
        self,
        batch_size: int,
        max_len: int | None = None,
        *,
        chunk: int | None = None,
        left: int = 0,
        right: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVCache | ChunkCache:
        """A cache for decoding step by step: ``forward(x_step, is_causal=True, cache=cache)``.

        Each call appends its keys and values (after ``position``, at ``offset =
        len(cache)``) and attends everything cached so far, causally. With ``chunk=c``
        the cache streams instead: ``forward(x_chunk, cache=cache)`` takes one chunk of
        ``c`` tokens, which attends itself and the ``left`` chunks before it, as the
        ``P.chunked(c, left=left)`` pattern (docs/streaming.md).

        Args:
            batch_size: the batch every decoding call has.
            max_len: the most tokens the cache takes (decoding; not with ``chunk``).
            chunk: tokens per chunk: make a :class:`~mmattn.cache.ChunkCache`.
            left: past chunks each chunk attends (with ``chunk``).
            right: future chunks; only 0 (a cache cannot look ahead).
            device, dtype: of the buffers (default: those of ``k_proj``'s weight).

        Returns:
            A :class:`~mmattn.cache.KVCache` with (B, num_kv_heads, max_len, head_dim) buffers,
            or with ``chunk`` a :class:`~mmattn.cache.ChunkCache` of (B, num_kv_heads,
            left * chunk, head_dim) buffers.

        Raises:
            ValueError: ``add_bias_kv`` / ``add_zero_attn`` modules (their appended keys have
                no position in a growing sequence); ``right > 0``; ``max_len`` with
                ``chunk``; bad sizes.
            TypeError: no ``max_len`` and no ``chunk``.
        """
        self._check_cacheable()
        weight = self.k_proj.weight
        if chunk is not None or left or right:
            return self._make_chunk_cache(
                batch_size, max_len, chunk, left, right, default(device, weight.device),
                default(dtype, weight.dtype),
            )
        if max_len is None:
            raise TypeError(
                f"{type(self).__name__}.make_cache needs max_len (decoding) or chunk= "
                "(streaming), got neither"
            )
        return KVCache(
            batch_size, max_len, self.num_kv_heads, self.head_dim,
            device=default(device, weight.device), dtype=default(dtype, weight.dtype),
        )

    def _make_chunk_cache(
        self, batch_size: int, max_len: int | None, chunk: int | None, left: int, right: int,
        device: torch.device | str, dtype: torch.dtype,
    ) -> ChunkCache:
        check_no_look_ahead(right)
        if chunk is None:
            raise TypeError(f"left={left} needs chunk= (the chunk size in tokens), got None")
        if max_len is not None:
            raise ValueError(
                f"max_len={max_len} does not apply with chunk=: a ChunkCache holds left * "
                "chunk keys, however long the stream"
            )
        return ChunkCache(
            batch_size, chunk, left, self.num_kv_heads, self.head_dim, device=device,
            dtype=dtype, owner=self,
        )

    def _cache_rules(self) -> tuple[int | None, bool]:
        """What a cache must match: (its window, or None for a full cache; always causal)."""
        return None, False

    def _check_cacheable(self) -> None:
        if self.bias_k is not None or self.add_zero_attn:
            raise ValueError(
                f"{type(self).__name__} with add_bias_kv or add_zero_attn has no cache: the "
                "appended key has no place in a sequence that grows step by step"
            )

    def _attend_cached(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, dropout_p: float,
        need_weights: bool, modifiers: Modifiers | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attention over what a cache returned; its mask already holds the causal rule, and
        ``modifiers`` the positions of the step (:func:`~._modifiers.step_modifiers`; passed
        only when there are any, so a variant's ``_attention`` without the keyword works)."""
        extra = {} if modifiers is None else {"modifiers": modifiers}
        return self._attention(
            q, k, v, mask, is_causal=False, dropout_p=dropout_p, need_weights=need_weights,
            **extra,
        )
