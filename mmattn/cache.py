"""Key/value caches for incremental decoding: static buffers plus a length counter.

Axis key: ``b`` batch, ``k`` key/value heads, ``i`` new (query) tokens of one call, ``j``
keys attended, ``n`` capacity (``max_len``), ``w`` window, ``e`` head width.

An attention module makes its cache (``cache = module.make_cache(batch_size, max_len)``)
and takes it in ``forward(x_step, is_causal=True, cache=cache)``. The module projects the
new tokens, applies its ``position`` module at ``offset = cache.offset`` and hands the new
keys and values to :meth:`update`, which stores them and returns what to attend — keys,
values and one SDPA-direction mask (True = may attend). Three kinds:

- :class:`KVCache` (full causal self-attention): (b, k, n, e) buffers; call ``t`` attends
  the first ``t`` keys. O(n) memory.
- :class:`LocalKVCache` (causal :class:`~mmattn.LocalAttention`): a ring of the last ``w``
  keys and their positions; a call attends the ring plus its own new keys, so memory is
  O(w) whatever the length decoded.
- :class:`ContextCache` (:class:`~mmattn.CrossAttention`): the projected context, stored by
  the first call and reused by every later one.
- :class:`ChunkCache` (streaming, ``make_cache(batch_size, chunk=c, left=l)``): the last
  ``l`` chunks of ``c`` keys; each call takes one chunk (docs/streaming.md). An ``Encoder``
  built with ``P.chunked`` makes an :class:`EncoderCache`, one ChunkCache per block.

The buffers never change shape and the counter is a 0-D tensor, so ``torch.compile`` traces
one graph for every decoding step. Eagerly, :class:`KVCache` reads the counter and attends
only the filled part (O(t) per step); under compile it attends all ``n`` slots with a mask
(static shapes). Both give the same numbers. Checks of sizes and dtypes run always; the
full-cache check reads the counter eagerly and runs as an in-graph assertion under compile.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmattn import _checks as checks
from mmattn._cache_buffers import BufferCache
from mmattn._cache_checks import check_cache_call as check_cache_call  # moved; importable
from mmattn._chunk_cache import ChunkCache, EncoderCache

__all__ = ["ChunkCache", "ContextCache", "EncoderCache", "KVCache", "LocalKVCache"]


def _compiling() -> bool:
    return torch.compiler.is_compiling()


class _Cache(BufferCache):
    """Shared sizes, counter and checks of the caches (not for direct use)."""

    #: True for caches of self-attention (decoding needs the causal rule).
    causal: bool = True

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        slots: int,
        value_dim: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        # batch 0 is an empty batch (docs/edge_cases.md): decoding it gives empty results
        self.batch_size = checks.check_positive_int("batch_size", batch_size, minimum=0)
        self.max_len = checks.check_positive_int("max_len", max_len)
        self.num_kv_heads = checks.check_positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = checks.check_positive_int("head_dim", head_dim)
        self.value_dim = checks.check_positive_int("value_dim", value_dim or head_dim)
        # an integer cache would round every key and value it stores
        self.dtype = checks.check_dtype("dtype", dtype or torch.get_default_dtype(),
                                        floating=True)
        shape = (batch_size, num_kv_heads, slots)
        self.k = torch.zeros(*shape, head_dim, device=device, dtype=self.dtype)
        self.v = torch.zeros(*shape, self.value_dim, device=device, dtype=self.dtype)
        #: Tokens seen so far (a 0-D long tensor, so compiled code does not specialise on it).
        self.size = torch.zeros((), dtype=torch.long, device=device)

    def reset(self) -> None:
        """Forget every token (buffers keep their memory)."""
        self.size.zero_()

    def check_batch(self, name: str, batch_size: int) -> None:
        """Raise ValueError unless a call's ``name`` has the batch size the cache was made for
        (a filled :class:`ContextCache` would otherwise broadcast one query over its batch)."""
        if batch_size != self.batch_size:
            raise ValueError(
                f"cache was made for batch_size={self.batch_size}, got {name} with batch size "
                f"{batch_size}"
            )

    def check_step(self, name: str, k: Tensor, v: Tensor) -> None:
        """Raise ValueError unless ``k``/``v`` fit this cache (batch, heads, widths, dtype)."""
        want = (self.batch_size, self.num_kv_heads)
        if tuple(k.shape[:2]) != want:
            raise ValueError(
                f"cache was made for batch_size={self.batch_size} and "
                f"num_kv_heads={self.num_kv_heads}, got {name} with batch size {k.shape[0]} "
                f"and {k.shape[1]} key/value heads"
            )
        if k.shape[-1] != self.head_dim or v.shape[-1] != self.value_dim:
            raise ValueError(
                f"cache was made for head widths (key {self.head_dim}, value "
                f"{self.value_dim}), got key {k.shape[-1]} and value {v.shape[-1]}"
            )
        if k.dtype != self.dtype or v.dtype != self.dtype:
            raise ValueError(
                f"cache was made for dtype {self.dtype}, got {name} of dtype {k.dtype}; make "
                f"the cache with make_cache(..., dtype={k.dtype})"
            )
        if k.device != self.device:
            raise ValueError(f"cache is on device {self.device}, got {name} on {k.device}")

    def check_room(self, new: int) -> int | None:
        """The current length, after checking that ``new`` more tokens fit. Compiled, an
        in-graph assertion (``torch._check`` takes no tensor; reading it breaks the graph)."""
        if _compiling():  # RuntimeError rather than a write past the buffers
            torch._assert_async(self.size + new <= self.max_len, f"cache is full: {new} more "
                                f"token(s) do not fit max_len={self.max_len}; make a larger cache")
            return None
        length = int(self.size)
        if length + new > self.max_len:
            raise ValueError(f"cache is full: it holds {length} of max_len={self.max_len} "
                             f"tokens and cannot take {new} more; make a larger cache "
                             f"(make_cache(batch_size, max_len)) or reset() it")
        return length

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(batch_size={self.batch_size}, max_len={self.max_len}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype})"
        )


class KVCache(_Cache):
    """Preallocated keys and values of causal self-attention, with a length counter.

    Args:
        batch_size: B, the batch every call must have.
        max_len: n, the most tokens the cache takes.
        num_kv_heads: key/value heads of the module.
        head_dim: key width per head. value_dim: value width per head (default head_dim).
        device, dtype: of the buffers.

    Shape:
        - buffers ``k``: (B, num_kv_heads, n, head_dim), ``v``: (B, num_kv_heads, n, value_dim)

    Examples:
        >>> from mmattn import MultiHeadAttention
        >>> attn = MultiHeadAttention(16, 4)
        >>> cache = attn.make_cache(batch_size=2, max_len=8)
        >>> for _ in range(3):
        ...     out, _ = attn(torch.randn(2, 1, 16), is_causal=True, cache=cache)
        >>> len(cache), cache.k.shape
        (3, torch.Size([2, 4, 8, 4]))
    """

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            batch_size, max_len, num_kv_heads, head_dim, slots=max_len, value_dim=value_dim,
            device=device, dtype=dtype,
        )

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Append ``i`` new keys and values; return everything to attend and the mask.

        Shape:
            - k: (b, k, i, e); v: (b, k, i, e_v)
            - returns: keys (b, k, j, e), values (b, k, j, e_v) and a (i, j) bool mask
              (True = may attend: key position <= query position), or None when every key
              may be attended. Eagerly ``j`` is the filled length; compiled, ``j = n``.

        Raises:
            ValueError: wrong batch size, heads, widths or dtype; the cache is full.
        """
        self.check_step("keys", k, v)
        new = k.shape[2]
        if _compiling():
            self.check_room(new)
            positions = self.size + torch.arange(new, device=self.device)
            self.k.index_copy_(2, positions, k)
            self.v.index_copy_(2, positions, v)
            self.size.add_(new)
            slots = torch.arange(self.max_len, device=self.device)
            return self.k, self.v, slots[None, :] <= positions[:, None]
        length = self.check_room(new)
        total = length + new
        self.k[:, :, length:total] = k
        self.v[:, :, length:total] = v
        self.size.fill_(total)
        mask = None
        if new > 1:  # the new tokens among themselves: causal
            slots = torch.arange(total, device=self.device)
            mask = slots[None, :] <= (slots[length:])[:, None]
        return self.k[:, :, :total], self.v[:, :, :total], mask


class LocalKVCache(_Cache):
    """The last ``window_size`` keys and values of causal local attention, in a ring.

    Query position p attends keys p - w ... p. The ring keeps the w most recent keys with
    their positions; a call attends the ring plus its own new keys under the band mask, then
    overwrites the oldest slots. Memory is O(w), not O(t).

    Args:
        batch_size: B. max_len: the most tokens decoded in total (positions stay < max_len).
        window_size: w, the module's window.
        num_kv_heads, head_dim, value_dim, device, dtype: as :class:`KVCache`.

    Shape:
        - buffers ``k``: (B, num_kv_heads, w, head_dim); ``positions``: (w,), -1 = empty
    """

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        window_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.window_size = checks.check_positive_int("window_size", window_size, minimum=0)
        super().__init__(
            batch_size, max_len, num_kv_heads, head_dim, slots=window_size,
            value_dim=value_dim, device=device, dtype=dtype,
        )
        self.positions = torch.full((window_size,), -1, dtype=torch.long, device=device)

    def reset(self) -> None:
        super().reset()
        self.positions.fill_(-1)

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Attend the ring and the ``i`` new keys; then keep the last ``w`` keys in the ring.

        Shape:
            - k: (b, k, i, e); v: (b, k, i, e_v)
            - returns: keys (b, k, w + i, e), values (b, k, w + i, e_v) and the (i, w + i)
              bool band mask (True = may attend)

        Raises:
            ValueError: wrong batch size, heads, widths or dtype; more than ``max_len``
                tokens in total.
        """
        self.check_step("keys", k, v)
        new, window = k.shape[2], self.window_size
        self.check_room(new)
        query_pos = self.size + torch.arange(new, device=self.device)  # (i,)
        keys = torch.cat([self.k, k], dim=2)
        values = torch.cat([self.v, v], dim=2)
        key_pos = torch.cat([self.positions, query_pos])  # (w + i,)
        distance = query_pos[:, None] - key_pos[None, :]
        mask = (key_pos >= 0) & (distance >= 0) & (distance <= window)
        if window:
            keep = min(new, window)
            kept = query_pos[new - keep:]
            slots = kept % window
            self.k.index_copy_(2, slots, k[:, :, new - keep:])
            self.v.index_copy_(2, slots, v[:, :, new - keep:])
            self.positions.index_copy_(0, slots, kept)
        self.size.add_(new)
        return keys, values, mask

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", window_size={self.window_size})"


class ContextCache(_Cache):
    """The projected context of cross-attention, computed by the first call and reused.

    The first ``forward`` with this cache projects its ``key``/``value`` (and takes its
    ``key_padding_mask``); every later call attends the stored keys and values and ignores
    the context it is given — pass the same one, as the uncached module would need.

    Args:
        batch_size: B. max_len: the longest context it can hold.
        num_kv_heads, head_dim, value_dim, device, dtype: as :class:`KVCache`.
    """

    causal = False

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            batch_size, max_len, num_kv_heads, head_dim, slots=max_len, value_dim=value_dim,
            device=device, dtype=dtype,
        )
        self.context_len: int | None = None
        self.mask: Tensor | None = None

    @property
    def filled(self) -> bool:
        """Whether the context has been stored (later calls skip the key/value projections)."""
        return self.context_len is not None

    def reset(self) -> None:
        super().reset()
        self.context_len = None
        self.mask = None

    def update(
        self, k: Tensor | None, v: Tensor | None, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Store the context on the first call; return the stored keys, values and mask.

        Shape:
            - k: (b, k, s, e) and v: (b, k, s, e_v) on the first call (None later)
            - mask: the context's merged key mask, broadcastable to (b, 1, 1, s), or None
            - returns: keys (b, k, s, e), values (b, k, s, e_v) and the mask

        Raises:
            ValueError: the context is longer than ``max_len``; wrong sizes or dtype.
        """
        if not self.filled:
            if k is None or v is None:
                raise ValueError("ContextCache is empty: the first call must pass the context")
            self.check_step("context keys", k, v)
            length = k.shape[2]
            if length > self.max_len:
                raise ValueError(
                    f"context of length {length} does not fit the cache: max_len="
                    f"{self.max_len}; make a larger cache (make_cache(batch_size, max_len))"
                )
            self.k[:, :, :length] = k
            self.v[:, :, :length] = v
            self.size.fill_(length)
            self.context_len, self.mask = length, mask
        length = self.context_len
        return self.k[:, :, :length], self.v[:, :, :length], self.mask
