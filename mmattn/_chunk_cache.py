"""The chunk cache of streaming attention: the last ``left`` chunks of keys and values.

Axis key: ``b`` batch, ``k`` key/value heads, ``i`` tokens of one chunk (``c``, or fewer for
the last), ``s`` cached slots (``left * c``), ``e`` head width.

Training uses the pattern ``P.chunked(c, left=l)``: query q and key k lie in chunks
``q // c`` and ``k // c``, and q may attend k iff ``q // c - l <= k // c <= q // c`` (both
ways inside a chunk, plus the ``l`` chunks before it). Running, one call takes one chunk,
attends the cached ``l`` chunks and its own keys, then keeps its keys in place of the oldest
chunk. The buffers never grow, so memory and time per chunk do not depend on how long the
stream has run. Re-exported as :class:`mmattn.cache.ChunkCache` (docs/streaming.md).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import Tensor

from mmattn import _checks as checks
from mmattn._cache_buffers import BufferCache
from mmattn._helpers import exporting

__all__ = ["ChunkCache", "EncoderCache", "check_no_look_ahead"]


def _tracing() -> bool:
    return torch.compiler.is_compiling() or exporting()


def check_no_look_ahead(right: object) -> None:
    """Raise ValueError for ``right > 0``: a chunk cache holds past chunks, never future
    ones (the outputs of chunk n would wait for chunks n + 1 ... n + right, in every layer)."""
    right = checks.check_positive_int("right", right, minimum=0)
    if right:
        raise ValueError(
            f"right={right}: a ChunkCache cannot look ahead (it holds past chunks only, so "
            "chunk n cannot see chunk n + 1 before it arrives); stream a model trained with "
            "P.chunked(chunk, left=..., right=0), or run whole clips"
        )


class ChunkCache(BufferCache):
    """Keys and values of the last ``left`` chunks of one attention layer, for streaming.

    ``mha(x_chunk, cache=cache)`` (``cache = mha.make_cache(batch_size, chunk=c, left=l)``)
    projects the chunk, applies ``position`` at ``offset = len(cache)``, attends the cached
    chunks and the chunk itself (both ways) and then stores the chunk's keys in place of the
    oldest one. Outputs equal the whole-sequence call with the ``P.chunked(c, left=l)``
    pattern at those rows, also with padding (``key_padding_mask`` of the chunk; a padded
    query row attends nothing, as the pattern's dead rows).

    Every chunk holds ``c`` tokens except the last, which may be shorter: after it the stream
    has ended, and a further call raises until :meth:`reset`.

    Args:
        batch_size: B, the batch every call must have.
        chunk: c, tokens per chunk.
        left: l >= 0, past chunks each chunk attends.
        num_kv_heads, head_dim, value_dim: of the module (``value_dim`` default head_dim).
        device, dtype: of the buffers.
        owner: the module that made it (another module refuses the cache: its keys were
            projected by other weights).

    Shape:
        - buffers ``k``: (B, num_kv_heads, l * c, head_dim), ``v``: (..., value_dim),
          ``valid``: (B, l * c) bool (True = a real key), ``size``: () long (tokens seen)

    Examples:
        >>> from mmattn import MultiHeadAttention
        >>> attn = MultiHeadAttention(16, 4).eval()
        >>> cache = attn.make_cache(2, chunk=4, left=2)
        >>> for _ in range(5):
        ...     out, _ = attn(torch.randn(2, 4, 16), cache=cache)
        >>> len(cache), tuple(cache.k.shape), out.shape
        (20, (2, 4, 8, 4), torch.Size([2, 4, 16]))
    """

    #: Not a causal cache: a chunk attends itself both ways.
    causal = False

    def __init__(
        self,
        batch_size: int,
        chunk: int,
        left: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        owner: object | None = None,
    ) -> None:
        self.batch_size = checks.check_positive_int("batch_size", batch_size, minimum=0)
        self.chunk = checks.check_positive_int("chunk", chunk)
        self.left = checks.check_positive_int("left", left, minimum=0)
        self.num_kv_heads = checks.check_positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = checks.check_positive_int("head_dim", head_dim)
        self.value_dim = checks.check_positive_int("value_dim", value_dim or head_dim)
        self.dtype = checks.check_dtype("dtype", dtype or torch.get_default_dtype(),
                                        floating=True)
        slots = (batch_size, num_kv_heads, left * chunk)
        self.k = torch.zeros(*slots, head_dim, device=device, dtype=self.dtype)
        self.v = torch.zeros(*slots, self.value_dim, device=device, dtype=self.dtype)
        self.valid = torch.zeros(batch_size, left * chunk, dtype=torch.bool, device=device)
        #: Tokens seen so far (a 0-D long tensor, so compiled code does not specialise on it).
        self.size = torch.zeros((), dtype=torch.long, device=device)
        self._owner = None if owner is None else weakref.ref(owner)

    # ------------------------------------------------------------------ the cache protocol
    def reset(self) -> None:
        """Start a new stream (buffers keep their memory)."""
        self.size.zero_()
        self.valid.zero_()

    def __repr__(self) -> str:
        return (
            f"ChunkCache(batch_size={self.batch_size}, chunk={self.chunk}, left={self.left}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype})"
        )

    # ------------------------------------------------------------------ checks
    def check_owner(self, module: object) -> None:
        """Raise ValueError unless ``module`` made this cache."""
        if self._owner is not None and self._owner() is not module:
            owner = self._owner()
            which = "no longer alive" if owner is None else f"at {id(owner):#x}"
            raise ValueError(
                f"cache was made by another module ({which}), got {type(module).__name__} at "
                f"{id(module):#x}: its keys were projected by other weights; make the cache "
                "with this module's make_cache(...)"
            )

    def check_batch(self, name: str, batch_size: int) -> None:
        """Raise ValueError unless a call's ``name`` has the cache's batch size."""
        if batch_size != self.batch_size:
            raise ValueError(
                f"cache was made for batch_size={self.batch_size}, got {name} with batch size "
                f"{batch_size}"
            )

    def check_chunk(self, name: str, length: int) -> None:
        """Raise ValueError for a chunk longer than ``chunk``, or for any chunk after a short
        one (that one ended the stream). Compiled or exported, only the first check runs."""
        if length > self.chunk:
            raise ValueError(
                f"{name} holds {length} tokens, more than the cache's chunk={self.chunk}; "
                f"feed chunks of exactly {self.chunk} tokens (only the last may be shorter)"
            )
        if _tracing() or not length:
            return
        seen = int(self.size)
        if seen % self.chunk:
            raise ValueError(
                f"{name} of {length} tokens follows a chunk of {seen % self.chunk} < "
                f"chunk={self.chunk} tokens, which ended the stream: every chunk but the last "
                "must hold exactly chunk tokens; reset() the cache to start a new stream"
            )

    def check_self(self, query_len: int, key_len: int) -> None:
        """Raise ValueError unless a call's key holds the query's tokens: a chunk attends
        itself, so its keys and queries are the same ``length`` tokens (the cache would
        otherwise keep keys for positions no query had, and shift every later chunk)."""
        if key_len != query_len:
            raise ValueError(
                f"key holds {key_len} tokens but query holds {query_len}: with a ChunkCache "
                "a chunk attends itself, so key and value must be the chunk's own tokens "
                "(the same length as query; omit them for self-attention)"
            )

    def _check_step(self, k: Tensor, v: Tensor) -> None:
        want = (self.batch_size, self.num_kv_heads, self.head_dim, self.value_dim)
        got = (k.shape[0], k.shape[1], k.shape[-1], v.shape[-1])
        if got != want:
            raise ValueError(
                f"cache was made for batch_size={want[0]}, num_kv_heads={want[1]} and head "
                f"widths (key {want[2]}, value {want[3]}), got keys of batch size {got[0]}, "
                f"{got[1]} key/value heads and widths (key {got[2]}, value {got[3]})"
            )
        if k.dtype != self.dtype or v.dtype != self.dtype:
            raise ValueError(
                f"cache was made for dtype {self.dtype}, got keys of dtype {k.dtype}; make "
                f"the cache with make_cache(..., dtype={k.dtype})"
            )
        if k.device != self.device:
            raise ValueError(f"cache is on device {self.device}, got keys on {k.device}")

    # ------------------------------------------------------------------ the step
    def update(
        self, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Attend the cached chunks and this chunk; then keep this chunk in the cache.

        Args:
            k, v: the chunk's keys and values (after ``position``).
            key_padding_mask: True at the chunk's padded tokens, or None.

        Shape:
            - k: (b, k, i, e); v: (b, k, i, e_v); key_padding_mask: (b, i) bool
            - returns: keys (b, k, s + i, e), values (b, k, s + i, e_v) and the (b, 1, i,
              s + i) bool mask (True = may attend; a padded query row attends nothing), or
              None when every key may be attended

        Raises:
            ValueError: wrong batch size, heads, widths, dtype or device; a chunk longer
                than ``chunk``; a chunk after a short one.
        """
        self._check_step(k, v)
        new = k.shape[2]
        self.check_chunk("the chunk", new)
        keys = torch.cat([self.k, k], dim=2)
        values = torch.cat([self.v, v], dim=2)
        # eagerly, a stream past its first left chunks without padding attends every key:
        # no mask (the kernel skips its dead-row passes; the same numbers), and every slot
        # stays valid
        every = key_padding_mask is None and not _tracing() and bool(self.valid.all())
        mask = None
        if not every:
            real = (torch.ones(k.shape[0], new, dtype=torch.bool, device=self.device)
                    if key_padding_mask is None else ~key_padding_mask)
            key_ok = torch.cat([self.valid, real], dim=1)  # (b, s + i)
            mask = key_ok[:, None, None, :] & real[:, None, :, None]
            if self.left:
                self.valid.copy_(key_ok[:, new:])
        if self.left:  # this chunk takes the oldest chunk's slots (a new tensor: no alias)
            self.k.copy_(keys[:, :, new:])
            self.v.copy_(values[:, :, new:])
        self.size.add_(new)
        return keys, values, mask


class EncoderCache:
    """One :class:`ChunkCache` per block of an ``Encoder`` built with ``P.chunked``.

    ``encoder.make_cache(batch_size)`` makes it; ``encoder(chunk_tokens, cache=cache)``
    streams one chunk through every block. It follows the same protocol: ``len(cache)`` is
    the tokens streamed, ``nbytes`` the memory held, :meth:`reset` starts a new stream.

    Args:
        layers: the blocks' caches, in block order.
        owner: the encoder that made it.
    """

    def __init__(self, layers: Sequence[ChunkCache], owner: object | None = None) -> None:
        self.layers = tuple(layers)
        self._owner = None if owner is None else weakref.ref(owner)

    @property
    def batch_size(self) -> int:
        return self.layers[0].batch_size

    @property
    def chunk(self) -> int:
        return self.layers[0].chunk

    @property
    def left(self) -> int:
        return self.layers[0].left

    def __len__(self) -> int:
        return len(self.layers[0])

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def check_owner(self, module: object) -> None:
        """Raise ValueError unless ``module`` made this cache."""
        ChunkCache.check_owner(self, module)  # the same rule on the same attribute

    def __repr__(self) -> str:
        return (f"EncoderCache(layers={len(self.layers)}, batch_size={self.batch_size}, "
                f"chunk={self.chunk}, left={self.left})")
