"""The detected facts of the engines (:func:`available`): which engines, arguments and
spellings the running torch has, and the device facts :func:`mmattn.kernels.engines.select`
decides from. Features are detected by signature and attribute, never by version string; a
missing one means the fallback (or the older spelling), never an error.

Re-exported by :mod:`mmattn.kernels.engines` (``engines.available()``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["Available", "available", "capability", "recompile_limit"]


@dataclass(frozen=True)
class Available:
    """Which engines, arguments and spellings this torch has (detected by :func:`available`).

    Attributes:
        varlen: ``torch.nn.attention.varlen.varlen_attn`` exists.
        varlen_window: it takes ``window_size``.
        varlen_gqa: it takes ``enable_gqa``.
        flex: ``torch.nn.attention.flex_attention`` exists with ``BlockMask.from_kv_blocks``.
        flex_aux: ``flex_attention(return_aux=AuxRequest(lse=True))`` (the newer spelling).
        flex_lse: ``flex_attention(return_lse=True)`` (the older one, deprecated where
            ``return_aux`` exists); sinks on flex need one of the two.
        flex_seq_lengths: ``BlockMask.from_kv_blocks`` takes ``seq_lengths``.
        mask_compile_flag: ``create_block_mask`` still takes ``_compile`` (deprecated: the
            block masks are built by ``torch.compile(create_block_mask)``, the flag only where
            that fails).
        triton: Triton is installed (flex compiles for CUDA with it).
        limit_name: the name of dynamo's recompile limit in ``torch._dynamo.config``
            ("recompile_limit", or "cache_size_limit" in older torch; "" when neither).
        limit_errors: the exceptions dynamo raises when a ``fullgraph`` function reaches it.
    """

    varlen: bool = False
    varlen_window: bool = False
    varlen_gqa: bool = False
    flex: bool = False
    flex_aux: bool = False
    flex_lse: bool = False
    flex_seq_lengths: bool = False
    mask_compile_flag: bool = False
    triton: bool = True
    limit_name: str = ""
    limit_errors: tuple[type[BaseException], ...] = ()

    @property
    def flex_sinks(self) -> bool:
        """flex returns its logsumexp (sinks run on flex)."""
        return self.flex_aux or self.flex_lse


def _parameters(fn: object) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(fn).parameters
    except (ValueError, TypeError):
        return {}


@functools.cache
def available() -> Available:
    """The engines of the running torch, detected once from their signatures and attributes
    (never from version strings): a missing feature means the fallback, never an error."""
    found: dict[str, object] = {}
    try:
        from torch.nn.attention.varlen import varlen_attn

        params = _parameters(varlen_attn)
        found.update(varlen=True, varlen_window="window_size" in params,
                     varlen_gqa="enable_gqa" in params)
    except (ImportError, AttributeError):
        pass
    try:
        from torch.nn.attention import flex_attention as flex

        params = _parameters(flex.flex_attention)
        found.update(
            flex=hasattr(flex.BlockMask, "from_kv_blocks"),
            flex_aux="return_aux" in params and hasattr(flex, "AuxRequest"),
            flex_lse="return_lse" in params,
            flex_seq_lengths="seq_lengths" in _parameters(
                getattr(flex.BlockMask, "from_kv_blocks", None)),
            mask_compile_flag="_compile" in _parameters(flex.create_block_mask),
        )
    except (ImportError, AttributeError):
        pass
    try:
        from torch.utils._triton import has_triton

        found["triton"] = bool(has_triton())
    except (ImportError, AttributeError):
        found["triton"] = False
    try:
        import torch._dynamo as dynamo

        found["limit_name"] = next((n for n in ("recompile_limit", "cache_size_limit")
                                    if hasattr(dynamo.config, n)), "")
        found["limit_errors"] = tuple(
            getattr(dynamo.exc, n) for n in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")
            if isinstance(getattr(dynamo.exc, n, None), type))
    except (ImportError, AttributeError):
        pass
    return Available(**found)


def recompile_limit(have: Available | None = None) -> int | None:
    """Dynamo's recompile limit now (``torch._dynamo.config``), or None where unknown."""
    have = available() if have is None else have
    if not have.limit_name:
        return None
    import torch._dynamo

    return getattr(torch._dynamo.config, have.limit_name, None)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA ``device`` (read once per device, no sync); None
    elsewhere."""
    if device.type != "cuda":
        return None
    return _capability(torch.cuda.current_device() if device.index is None else device.index)
