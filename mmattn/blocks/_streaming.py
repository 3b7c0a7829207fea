"""Streaming an ``Encoder`` built with the ``P.chunked`` pattern, one chunk at a time.

Axis key: ``b`` batch, ``c`` tokens per chunk, ``d`` model width.

Training runs whole clips under ``pattern=P.chunked(c, left=l)``; running, ``cache =
encoder.make_cache(batch_size)`` holds one :class:`~mmattn.cache.ChunkCache` per block and
``encoder(chunk_tokens, cache=cache)`` returns the chunk's output Tokens, equal to the
whole-clip run at those positions (docs/streaming.md).
"""

from __future__ import annotations

from typing import Any

import torch

from mmattn import _checks as checks
from mmattn._chunk_cache import EncoderCache, check_no_look_ahead
from mmattn.tokens import Tokens, check_tokens

__all__ = ["StreamingEncoder", "chunk_rule"]


def chunk_rule(pattern: object, need: str = "make_cache") -> tuple[int, int, int]:
    """``(chunk, left, right)`` of a ``P.chunked`` pattern (``need`` names the caller in the
    error: ``Encoder.make_cache``, or a block given ``cache=``).

    Raises:
        ValueError: no pattern, or one that is not a single ``P.chunked`` (a cache holds
            past chunks only: any other rule may need keys it has dropped).
    """
    if pattern is None:
        raise ValueError(
            "make_cache needs an Encoder built with pattern=P.chunked(chunk, left=...), got "
            "pattern=None; decode causal blocks with block.attn.make_cache(batch, max_len)"
        )
    if not all(hasattr(pattern, name) for name in ("chunk", "left", "right")):
        raise ValueError(
            f"{need} needs pattern=P.chunked(chunk, left=...) alone (a cache keeps the last "
            f"left chunks; other patterns may attend anywhere), got pattern={pattern!r}"
        )
    return pattern.chunk, pattern.left, pattern.right


class StreamingEncoder:
    """The streaming surface of :class:`~mmattn.Encoder` (mixed in): :meth:`make_cache`."""

    def make_cache(
        self,
        batch_size: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> EncoderCache:
        """One :class:`~mmattn.cache.ChunkCache` per block, for ``encoder(chunk, cache=)``.

        The encoder must be built with ``pattern=P.chunked(chunk, left=l)``: each call then
        takes Tokens of ``chunk`` tokens (the last chunk may be shorter, a mask marks
        padding) and returns their outputs, equal to the whole-clip run at those positions.
        Memory is ``depth * 2 * l * chunk`` keys and values, however long the stream.

        Args:
            batch_size: the batch every call has.
            device, dtype: of the buffers (default: those of the parameters).

        Returns:
            An :class:`~mmattn.cache.EncoderCache` (``.layers``: the blocks' caches).

        Raises:
            ValueError: the encoder has no ``P.chunked`` pattern, or it looks ahead
                (``right > 0``: a cache holds past chunks only).

        Examples:
            >>> from mmattn import Encoder, Tokens, patterns as P
            >>> enc = Encoder(16, 2, 2, pattern=P.chunked(4, left=1)).eval()
            >>> cache = enc.make_cache(batch_size=2)
            >>> out = enc(Tokens(torch.randn(2, 4, 16)), cache=cache)
            >>> out.x.shape, len(cache), len(cache.layers)
            (torch.Size([2, 4, 16]), 4, 2)
        """
        chunk, left, right = chunk_rule(getattr(self, "pattern", None))
        check_no_look_ahead(right)
        layers = [
            block.attn.make_cache(batch_size, chunk=chunk, left=left, device=device,
                                  dtype=dtype)
            for block in self.blocks
        ]
        return EncoderCache(layers, owner=self)

    def _stream(self, tokens: Tokens, cache: Any, attn_mask: Any) -> Tokens:
        """One chunk through every block with its cache, then the final norm."""
        if attn_mask is not None:
            raise ValueError("attn_mask is not supported with cache=: the cache builds the mask")
        if not isinstance(cache, EncoderCache):
            raise TypeError(
                "cache must come from Encoder.make_cache(batch_size) (an EncoderCache), got "
                f"{type(cache).__name__}"
            )
        cache.check_owner(self)
        check_tokens("tokens", tokens, self.embed_dim, like=checks.first_param(self))
        if tokens.is_packed:
            raise ValueError("cache= does not take packed Tokens; stream padded chunks")
        cache.layers[0].check_batch("tokens", tokens.batch_size)
        for block, layer in zip(self.blocks, cache.layers):
            tokens = block(tokens, cache=layer)
        return tokens.replace(tokens.zero_padding(self.norm(tokens.x)))
