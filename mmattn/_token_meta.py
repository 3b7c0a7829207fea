"""Per-token facts of ``Tokens.meta`` that must follow the tokens: spans and (b, l) tensors.

Axis key: ``b`` batch, ``l`` padded length, ``j`` longest real length (``max lᵢ``).

``meta["spans"]`` is ``{name: (start, stop)}``, each bound an int or a (b,) integer tensor
(per item); :func:`check_spans` is the one reading of it (patterns, ``Tokens.pack``).
:func:`to_packed` moves the spans and every (b, l, ...) tensor of ``meta`` (``modality_ids``,
``segments``, the ids of ``P.same``, the (b, l, a) ``positions``) from padded positions to the
left-aligned positions that packing keeps (those of ``tokens.pack().unpack()``). It imports
nothing of mmattn but the checks, so :mod:`mmattn.tokens` can use it.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mmattn._checks import is_integer_dtype

#: meta keys whose tensors are not one value per token, even when shaped (b, l).
NOT_PER_TOKEN = ("edge_index", "edge_bias", "grids")


def check_spans(
    name: str, value: object, batch: int, length: int, device: torch.device | None = None
) -> dict[str, tuple[Tensor, Tensor]]:
    """``meta["spans"]`` checked: ``{name: (start, stop)}``, 0 <= start <= stop <= length.

    Each bound is an int or a (batch,) integer tensor (per item). Nothing is clipped: a
    negative start or a stop past ``length`` is refused. Int bounds are compared in Python;
    tensor bounds are read once for all spans (skipped while ``torch.compile`` traces and on
    the meta device, as ``_checks.check_range``).

    Returns:
        ``{name: (start, stop)}`` with (batch,) int64 tensors on ``device``.

    Raises:
        TypeError: ``value`` is not a mapping; an entry is not a (start, stop) pair; a bound
            is neither an int nor an integer tensor.
        ValueError: a per-item bound of another shape than (batch,); a bound outside
            [0, length]; start > stop.
    """
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{name} must map names to (start, stop), got {type(value).__name__} {value!r}"
        )
    out = {}
    for key, bounds in value.items():
        where = f"{name}[{key!r}]"
        if not isinstance(bounds, (tuple, list)) or len(bounds) != 2:
            raise TypeError(f"{where} must be a (start, stop) pair, got {bounds!r}")
        start, stop = (_bound(f"{where}[{i}]", v, batch, device) for i, v in enumerate(bounds))
        out[key] = (start, stop)
    _check_bounds(name, value, out, length)
    return out


def _check_bounds(
    name: str, value: Mapping, spans: dict[str, tuple[Tensor, Tensor]], length: int
) -> None:
    """0 <= start <= stop <= length for every span: Python ints are compared directly, the
    tensor bounds with one read for all of them (then each is named)."""
    tensors = [key for key, bounds in value.items() if any(isinstance(v, Tensor)
                                                            for v in bounds)]
    for key, (start, stop) in value.items():
        if key not in tensors and not 0 <= start <= stop <= length:
            raise ValueError(
                f"{name}[{key!r}] must satisfy 0 <= start <= stop <= length={length}, got "
                f"({start}, {stop})"
            )
    if not tensors or torch.compiler.is_compiling():
        return
    bounds = [spans[key] for key in tensors]
    if bounds[0][0].device.type == "meta" or not bounds[0][0].numel():
        return
    start, stop = (torch.stack(side) for side in zip(*bounds))  # (spans, B)
    if bool(((start < 0) | (start > stop) | (stop > length)).any()):
        for key, (start, stop) in zip(tensors, bounds):
            if bool(((start < 0) | (start > stop) | (stop > length)).any()):
                raise ValueError(
                    f"{name}[{key!r}] must satisfy 0 <= start <= stop <= length={length} in "
                    f"every item, got start {start.tolist()} and stop {stop.tolist()}"
                )


def _bound(name: str, value: object, batch: int, device: Any) -> Tensor:
    """One span bound as a (batch,) int64 tensor: an int, a 0-D or a (batch,) int tensor."""
    if isinstance(value, Tensor):
        if not is_integer_dtype(value.dtype):
            raise TypeError(f"{name} must be an int or an integer tensor, got {value.dtype}")
        if value.dim() > 0 and tuple(value.shape) != (batch,):
            raise ValueError(
                f"{name} must be an int or a per-item (batch,)=({batch},) tensor, got shape "
                f"{tuple(value.shape)}"
            )
        return value.to(device=device, dtype=torch.long).expand(batch)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be an int or a per-item (batch,) tensor, got {type(value).__name__} "
            f"{value!r}"
        )
    return torch.full((batch,), int(value), dtype=torch.long, device=device)


def to_packed(meta: dict, mask: Tensor, lengths: Tensor | None = None) -> dict:
    """``meta`` with its spans and (b, l) per-token tensors moved to the packed positions.

    After packing, the real tokens of a span are contiguous: span ``(start, stop)`` of item
    ``m`` becomes (real tokens before ``start``, real tokens before ``stop``), as (b,)
    tensors. A (b, l, ...) tensor becomes (b, j, ...), left-aligned, its tail ``-1`` (signed
    integers) or 0; keys in :data:`NOT_PER_TOKEN` and nested dicts stay as they are.

    Shape:
        - mask: (b, l) bool, True at real tokens; lengths: (b,) its sums, when known
    """
    batch, length = mask.shape
    moving = [key for key, value in meta.items()
              if key not in NOT_PER_TOKEN and key != "spans" and isinstance(value, Tensor)
              and value.dim() >= 2 and tuple(value.shape[:2]) == (batch, length)
              and not value.is_nested]
    if meta.get("spans") is None and not moving:
        return meta  # nothing per token: no work, no host read
    out = dict(meta)
    if meta.get("spans") is not None:
        before = F.pad(mask.long().cumsum(1), (1, 0))  # (b, l + 1) real tokens before p
        spans = check_spans("meta['spans']", meta["spans"], batch, length, mask.device)
        out["spans"] = {
            key: tuple(before.gather(1, bound[:, None])[:, 0] for bound in bounds)
            for key, bounds in spans.items()
        }
    if not moving:
        return out
    lengths = mask.sum(dim=1) if lengths is None else lengths
    longest = int(lengths.max()) if batch else 0
    kept = torch.arange(longest, device=mask.device) < lengths[:, None]  # (b, j)
    for key in moving:
        value = meta[key]
        signed = is_integer_dtype(value.dtype) and value.dtype != torch.uint8
        moved = value.new_full((batch, longest, *value.shape[2:]), -1 if signed else 0)
        moved[kept.to(value.device)] = value[mask.to(value.device)]
        out[key] = moved
    return out
