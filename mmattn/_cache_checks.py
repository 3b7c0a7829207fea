"""The checks of a ``cache=`` call, shared by every kind of cache (re-exported by
:mod:`mmattn.cache`; moved here to keep that file short).

Sizes and dtypes are checked later, by the cache's ``update``; these checks decide whether a
cache of this kind can serve this call at all.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from mmattn._chunk_cache import ChunkCache
from mmattn._helpers import exporting

__all__ = ["check_cache_call"]


def check_cache_call(
    owner: str,
    cache: object,
    *,
    kinds: tuple[type, ...],
    device: torch.device,
    window_size: int | None = None,
    batched: bool,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    causal: bool,
    position: object,
) -> None:
    """Raise unless ``cache`` can serve an attention call (sizes and dtype: in ``update``).

    Args:
        owner: the module's class name, for the messages.
        cache: what the call got as ``cache=``.
        kinds: the cache classes the module decodes with (another kind would attend the
            wrong keys: a ring cache in full attention, a full cache in local attention).
        device: the module's parameters' device.
        window_size: the module's window (a ``LocalKVCache`` must have the same).

    Raises:
        TypeError: ``cache`` is not one of ``kinds``; torch.export traces a stateful cache
            (one not built from the traced inputs, as ``DecodeStep`` builds it; under
            ``strict=True`` every cache).
        ValueError: the cache is on another device or (a ring cache) for another window;
            unbatched input; an ``attn_mask``; a ``key_padding_mask`` or no causal rule with
            a causal self-attention cache; ``is_causal`` or ``position`` with a
            ``ContextCache``; ``is_causal`` or a float ``key_padding_mask`` with a
            :class:`~mmattn.cache.ChunkCache`.
    """
    if exporting() and (
        torch.compiler.is_dynamo_compiling() or not is_fake(cache.size)
    ):
        raise TypeError(
            f"cache is a stateful {type(cache).__name__} whose buffers live outside the "
            "exported program (they would be frozen in as constants); export the functional "
            "form mmattn.integrations.export.DecodeStep (ChunkStep for a ChunkCache; with "
            "strict=False, the default), which takes and returns the cache as tensors "
            "(docs/deploy.md)"
        )
    if not isinstance(cache, kinds):
        names = [kind.__name__ for kind in kinds]
        names = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
        raise TypeError(
            f"cache must come from {owner}.make_cache(...) (a {names}), got "
            f"{type(cache).__name__}"
        )
    if cache.device != device:
        raise ValueError(
            f"cache is on device {cache.device} but {owner}'s parameters are on {device}; "
            f"make it with make_cache(..., device={str(device)!r})"
        )
    ring = getattr(cache, "window_size", None)  # a LocalKVCache (mmattn.cache imports this)
    if ring is not None and ring != window_size:
        raise ValueError(
            f"cache was made for window_size={cache.window_size}, but this {owner} has "
            f"window_size={window_size}"
        )
    if not batched:
        raise ValueError(
            "cache= needs a batched query (batch, length, embed_dim), got an unbatched one"
        )
    if attn_mask is not None:
        raise ValueError("attn_mask is not supported with cache=: the cache builds the mask")
    if isinstance(cache, ChunkCache):
        _check_chunk_call(key_padding_mask, causal)
    elif cache.causal:
        if key_padding_mask is not None:
            raise ValueError(
                "key_padding_mask is not supported with a self-attention cache: every "
                "decoded token is real"
            )
        if not causal:
            raise ValueError(
                f"{type(cache).__name__} decodes causally: call with is_causal=True "
                "(a step cannot see tokens that are not decoded yet)"
            )
    elif causal:
        raise ValueError(
            "is_causal=True does not apply with a ContextCache as cache=: every query step "
            "attends the whole context"
        )
    elif position is not None:
        raise ValueError("position= does not apply to a ContextCache (cross-attention)")


def _check_chunk_call(key_padding_mask: Tensor | None, causal: bool) -> None:
    """A chunk attends itself both ways; its padding comes as a boolean mask."""
    if causal:
        raise ValueError(
            "is_causal=True does not apply with a ChunkCache: a chunk attends its own tokens "
            "both ways, as the P.chunked pattern it was trained with"
        )
    if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
        raise TypeError(
            "key_padding_mask must have dtype torch.bool with a ChunkCache (True = padding), "
            f"got {key_padding_mask.dtype}"
        )
