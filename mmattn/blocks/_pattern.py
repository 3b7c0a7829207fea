"""``pattern=`` on the blocks: compile once per forward, share the SparseMask, run padded.

Axis key: ``b`` batch, ``l`` length, ``d`` model width.

``TransformerBlock(pattern=p)`` and ``Encoder(pattern=p)`` compile ``p`` (with the causal
rule folded in when the block is causal) on each call's Tokens: the Encoder once for all its
blocks. A mask compiled from the call's own Tokens already excludes their padding, so the
attention gets no ``key_padding_mask`` and no ``is_causal`` besides it. A SparseMask given
as ``attn_mask`` instead is used as it is, with the Tokens' padding and causal rule added.

Packed Tokens run padded (``tokens.unpack()``, then packed again): a tile of padding alone
is empty, so the kernel skips it and the cost stays close to the packed one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from mmattn._chunk_cache import ChunkCache, check_no_look_ahead
from mmattn._helpers import exporting
from mmattn.attention._sparse import is_sparse_mask
from mmattn.blocks._streaming import chunk_rule
from mmattn.patterns import Pattern, SparseMask
from mmattn.patterns import causal as causal_pattern
from mmattn.tokens import Tokens

#: The tile width the blocks compile their pattern with.
BLOCK_SIZE = 64


def check_pattern(pattern: object) -> Pattern | None:
    """The ``pattern=`` argument: None or a Pattern (TypeError otherwise)."""
    if pattern is not None and not isinstance(pattern, Pattern):
        raise TypeError(
            f"pattern must be a mmattn.patterns.Pattern (e.g. P.causal()) or None, got "
            f"{type(pattern).__name__}"
        )
    return pattern


def uses_pattern(pattern: Pattern | None, attn_mask: object) -> bool:
    """Whether this call runs block-sparse (a pattern, or a SparseMask as ``attn_mask``)."""
    return pattern is not None or is_sparse_mask(attn_mask)


def compile_for(pattern: Pattern, tokens: Tokens, attn_mask: object, causal: bool,
                block_size: int = BLOCK_SIZE) -> SparseMask:
    """``pattern`` (``& P.causal()`` when ``causal``) compiled on ``tokens``."""
    if exporting():
        raise NotImplementedError(
            "pattern= does not export: compiling a pattern classifies tiles from the data. "
            "Export the model without pattern= and pass attn_mask=~pattern.dense(tokens) "
            "(a tensor input) instead"
        )
    if attn_mask is not None:
        raise ValueError(
            "attn_mask and pattern= were both given; fold the mask into the pattern "
            "(P.same(key), &, |, ~) or drop one of them"
        )
    if causal:
        pattern = pattern & causal_pattern()
    return pattern.compile(tokens, block_size)


def on_padded(tokens: Tokens, run: Callable[[Tokens], Tokens]) -> Tokens:
    """``run(tokens)``; packed Tokens run as their padded form and come back packed."""
    if not tokens.is_packed:
        return run(tokens)
    out = run(tokens.unpack())
    return tokens.replace(Tokens(out.x, out.mask).pack().x)  # only x: its meta is tokens'


def block_forward(block: nn.Module, tokens: Tokens, attn_mask: Any, cache: Any) -> Tokens:
    """``TransformerBlock.forward`` with ``pattern=`` or a SparseMask ``attn_mask``; with
    ``cache`` (a block built with ``P.chunked``) one chunk of a stream."""
    if cache is not None:
        if is_sparse_mask(attn_mask):
            raise ValueError("attn_mask: a SparseMask does not take cache= (the cache builds "
                             "the mask)")
        check_stream(block, cache)
        return block._padded(tokens, attn_mask, cache=cache)
    if block.pattern is not None:
        mask = compile_for(block.pattern, tokens, attn_mask, block.causal)
        return on_padded(tokens, lambda t: block._padded(t, mask, own=True))
    return on_padded(tokens, lambda t: block._padded(t, attn_mask))


def check_stream(block: nn.Module, cache: Any) -> None:
    """Raise unless ``cache`` streams ``block``'s pattern: a ChunkCache of its ``P.chunked``
    rule (the same ``chunk`` and ``left``, :func:`~mmattn.blocks._streaming.chunk_rule`) on
    a non-causal block."""
    pattern = block.pattern
    chunk, left, right = chunk_rule(pattern, need="cache=")
    if block.causal:
        raise ValueError(
            "cache= with pattern=P.chunked(...) needs causal=False: a chunk cache attends "
            "each chunk both ways, the causal rule inside a chunk it does not keep"
        )
    check_no_look_ahead(right)
    if not isinstance(cache, ChunkCache):
        raise TypeError(
            f"cache must be a ChunkCache from block.attn.make_cache(batch_size, "
            f"chunk={chunk}, left={left}) for pattern={pattern!r}, got "
            f"{type(cache).__name__}"
        )
    if (cache.chunk, cache.left) != (chunk, left):
        raise ValueError(
            f"cache was made with chunk={cache.chunk}, left={cache.left}, but the block's "
            f"pattern is {pattern!r}; make it with block.attn.make_cache(batch_size, "
            f"chunk={chunk}, left={left})"
        )


def encoder_forward(encoder: nn.Module, tokens: Tokens, attn_mask: Any) -> Tokens:
    """``Encoder.forward`` with ``pattern=`` (compiled once, shared by every block) or a
    SparseMask ``attn_mask`` (used as it is by every block)."""
    own = encoder.pattern is not None
    mask = compile_for(encoder.pattern, tokens, attn_mask, encoder.blocks[0].causal) if own \
        else attn_mask
    return on_padded(tokens, lambda padded: run_blocks(encoder, padded, mask, own=own))


def run_blocks(encoder: nn.Module, padded: Tokens, mask: Any, *, own: bool,
               attend: Callable[[nn.Module], Any] | None = None) -> Tokens:
    """An Encoder's blocks and final norm on padded Tokens with this mask (``own``: see
    ``TransformerBlock._padded``); ``attend(block)``: what runs each block's attention
    (default: the block's own ``attn``)."""
    for block in encoder.blocks:
        padded = block._padded(padded, mask, own=own,
                               attend=None if attend is None else attend(block))
    return padded.replace(padded.zero_padding(encoder.norm(padded.x)))
