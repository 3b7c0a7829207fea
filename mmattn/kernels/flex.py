"""The FlexAttention engine: one compiled ``flex_attention`` for every structured kernel.

Axis key: ``b`` batch, ``h`` query heads, ``k`` key/value heads, ``l`` length, ``e`` head
width, ``p`` coordinates of a position.

A kernel that :func:`mmattn.kernels.engines.select` sends to flex hands over its geometry as
a ``BlockMask`` (which tiles to visit, and the exact rule inside the partial ones) and the
call's other terms go into one ``score_mod``, in mmattn's order (kernels/modifiers.py)::

    s ← c · tanh(s / c)             softcap
    s ← s − m_h · d(i, j)           ALiBi; d from position tables (|Δ| or Euclidean on a grid)
    s ← s + key_bias[b, j]          the key padding mask (−inf where padded, or its floats)

Sinks use flex's logsumexp ``ℓ`` and the identity of kernels/modifiers.py:
``out_sink = out · σ(ℓ − σ_h)``; flex differentiates through ``ℓ``. A row without any
allowed key gives 0 (flex returns 0 and ``ℓ = −inf`` there; σ(−inf) = 0).

``flex_attention`` is compiled once per process (:func:`compiled`): the score_mod and
mask_mod closures keep one code object and read every per-call fact from tensors, so a new
mask or batch is new data, not a new graph. On the CPU (forced engines only) torch compiles
the forward alone and without the logsumexp, so a CPU call with sinks runs flex eagerly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from mmattn.kernels import dense as _kernel
from mmattn.kernels._scores import default_scale
from mmattn.kernels.modifiers import Modifiers, join_sink

__all__ = ["compiled", "flex_attend", "key_bias", "score_mod"]


@functools.cache
def compiled(device_type: str = "cuda") -> Callable:
    """``torch.compile(flex_attention)``, made once per process and device type (eager flex
    is a slow reference implementation; compiled, it is the fused kernel). On the CPU with
    static shapes: torch 2.14's CPU flex kernel does not compile with dynamic sizes (its C++
    names an undeclared ``cur_qSplitSize8``), so each new size is one more graph there."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cpu":
        return torch.compile(flex_attention, fullgraph=True, dynamic=False)
    return torch.compile(flex_attention, fullgraph=True)


def key_bias(key_mask: Tensor | None, dtype: torch.dtype = torch.float32) -> Tensor | None:
    """A (b, j) key mask as the additive (b, j) term of the score_mod: bool True = may
    attend → 0 / −inf; float → itself."""
    if key_mask is None:
        return None
    if key_mask.dtype == torch.bool:
        return torch.zeros(key_mask.shape, dtype=dtype, device=key_mask.device).masked_fill(
            ~key_mask, float("-inf"))
    return key_mask.to(dtype)


def score_mod(
    softcap: Tensor | None = None,
    slopes: Tensor | None = None,
    rows: Tensor | None = None,
    cols: Tensor | None = None,
    flat: Tensor | None = None,
    bias: Tensor | None = None,
    causal: bool = False,
) -> Callable | None:
    """The score_mod of a call (None when it adds nothing).

    Args:
        softcap: ``c`` of ``c · tanh(s / c)``, a 0-d tensor (a Python number would be a
            constant of the graph: one compile per value).
        slopes: (h,) ALiBi slopes (the term is ``−m_h · d``).
        rows, cols: (l,) float positions of the tokens; ``d = |Δrow|`` without ``cols``,
            Euclidean with them (a grid).
        flat: (l,) bool tokens whose distance to every token is 0 (global tokens).
        bias: (b, l) added per key (:func:`key_bias`).
        causal: also −inf where the key comes after the query (a causal flag on top of a
            BlockMask that does not hold it).
    """
    if softcap is None and slopes is None and bias is None and not causal:
        return None

    def mod(score, b, h, q_idx, kv_idx):
        if softcap is not None:
            score = torch.tanh(score / softcap) * softcap
        if slopes is not None:
            dist = (rows[q_idx] - rows[kv_idx]).abs()
            if cols is not None:
                dist = torch.sqrt(dist * dist + (cols[q_idx] - cols[kv_idx]) ** 2)
            if flat is not None:
                dist = torch.where(flat[q_idx] | flat[kv_idx], 0.0, dist)
            score = score - slopes[h] * dist
        if bias is not None:
            score = score + bias[b, kv_idx]
        if causal:
            score = torch.where(kv_idx <= q_idx, score, float("-inf"))
        return score

    return mod


def flex_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_mask,
    *,
    key_mask: Tensor | None = None,
    scale: float | None = None,
    groups: int = 1,
    modifiers: Modifiers | None = None,
    rows: Tensor | None = None,
    cols: Tensor | None = None,
    flat: Tensor | None = None,
    causal: bool = False,
    seen: Tensor | None = None,
) -> Tensor:
    """Attention through the compiled flex_attention (unchecked: the kernels validate).

    Args:
        q, k, v: head-split tensors, ``k``/``v`` with ``h / groups`` heads.
        block_mask: the call's ``BlockMask`` (its mask_mod holds the geometry).
        key_mask: (b, l) bool (True = may attend) or float (added).
        scale: score scale (default 1/√e).
        groups: query heads per key head.
        modifiers: sinks, softcap and ALiBi; ALiBi's distance from ``rows`` / ``cols``
            (default: the token index) with ``flat`` tokens at distance 0.
        causal: also key j <= query i (when the BlockMask does not hold it).
        seen: (b, l) bool, the keys some query may attend; the others (and the keys the key
            mask excludes) are replaced by zeros first, so a NaN stored there cannot reach a
            real output (flex's zero weight times NaN would be NaN).

    Shape:
        - q: (b, h, l, e); k: (b, k, l, e); v: (b, k, l, e_v)
        - returns: (b, h, l, e_v)
    """
    mods = modifiers if modifiers else None
    softcap = None if mods is None or mods.softcap is None else torch.tensor(
        float(mods.softcap), device=q.device)
    slopes = None if mods is None or mods.slopes is None else mods.slopes.float()
    if slopes is not None and rows is None:
        rows = torch.arange(q.shape[2], device=q.device, dtype=torch.float32)
    if key_mask is not None:  # padding never leaks: 0 · NaN is NaN inside flex too
        ok = _kernel.allowed(key_mask)
        seen = ok if seen is None else seen & ok
    if seen is not None:
        k = torch.where(seen[:, None, :, None], k, 0.0)
        v = torch.where(seen[:, None, :, None], v, 0.0)
    mod = score_mod(softcap, slopes, rows, cols, flat, key_bias(key_mask), causal)
    scale = default_scale(q, scale)
    sinks = None if mods is None else mods.sinks
    run = compiled(q.device.type)
    if sinks is not None and q.device.type == "cpu":  # no compiled CPU logsumexp: eager flex
        from torch.nn.attention.flex_attention import flex_attention as run
    out = run(q, k, v, score_mod=mod, block_mask=block_mask, scale=scale,
                     enable_gqa=groups > 1, return_lse=sinks is not None)
    if sinks is None:
        return out
    out, lse = out
    keep, _ = join_sink(lse.float(), sinks.float()[:, None])  # σ(ℓ − σ_h), (b, h, l)
    return out * keep[..., None].to(out.dtype)
