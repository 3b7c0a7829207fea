"""The unchecked attention kernel shared by every module, and the fused-path switch.

Axis key: ``b`` batch, ``h`` query heads, ``k`` key/value heads (grouped-query attention),
``g`` query heads per key head (``h = k * g``), ``i`` query length, ``j`` key length, ``e``
head width.

Masks here are in the SDPA direction: a boolean mask is **True where query i may attend key
j**; a float mask is added to the scores. Callers validate; nothing here checks its input.

Two interchangeable paths compute the same numbers:

- fused: ``F.scaled_dot_product_attention`` (flash / memory-efficient / math kernels);
- explicit: ``softmax(q kᵀ · scale + mask) v`` spelled out, which can return the weights.

Padding never leaks, whatever the padded positions hold: a key that no query may attend is
replaced by zeros (``torch.where``, not a multiplication, so a NaN stored there vanishes), and
a query row with no allowed key is opened before the softmax and set to zero afterwards, so
neither the forward nor the backward pass forms a NaN.

The explicit path runs when weights are requested or the switch is off: the environment
variable ``MMATTN_FUSED_ATTN=0`` (read at import) or :func:`set_fused_attn`. Every module and
adapter reads the switch through :func:`use_fused_attn` at call time.

A listener registered with :func:`add_listener` (``mmattn.debug.explain`` does) is told about
every attention call: which path ran and why. With no listener the cost is one list check.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from mmattn._checks import autocast_on
from mmattn._helpers import exporting
from mmattn.kernels import _inputs
from mmattn.kernels import modifiers as _mods
from mmattn.kernels._scores import default_scale, dot_scores, group_mask
from mmattn.kernels.modifiers import Modifiers
from mmattn.masks import causal_mask

_FUSED_ATTN = os.environ.get("MMATTN_FUSED_ATTN", "1").strip().lower() not in ("0", "false", "no")


def use_fused_attn() -> bool:
    """Whether attention without requested weights takes the fused SDPA path."""
    return _FUSED_ATTN


def set_fused_attn(enable: bool) -> None:
    """Switch the fused path on or off for the whole process (``MMATTN_FUSED_ATTN``)."""
    global _FUSED_ATTN
    _FUSED_ATTN = bool(enable)


@contextmanager
def fused_attn(enable: bool) -> Iterator[None]:
    """Context manager form of :func:`set_fused_attn`; restores the old setting on exit."""
    previous = use_fused_attn()
    set_fused_attn(enable)
    try:
        yield
    finally:
        set_fused_attn(previous)


# ---------------------------------------------------------------------- path reports

Listener = Callable[[dict[str, Any]], None]
# Per context (so per thread): two threads that explain at once each see their own calls.
_LISTENERS: ContextVar[tuple[Listener, ...]] = ContextVar("mmattn_listeners", default=())
# the facts every report inside a call adds (report_facts); never mutated, replaced
_FACTS: ContextVar[Mapping[str, Any]] = ContextVar("mmattn_report_facts",
                                                   default=MappingProxyType({}))


def add_listener(listener: Listener) -> Callable[[], None]:
    """Call ``listener(record)`` for every attention call; returns the function that removes it.

    Listeners are per context (``contextvars``): a listener added in one thread hears the
    calls of that thread only.

    A record holds ``path`` (``"fused"``, ``"explicit"``, ``"local"``, ``"packed"``, ...),
    ``reasons`` (why not fused; empty when fused) and the call's tensors and settings
    (``q``, ``k``, ``v``, ``mask``, ``dropout_p``, ``is_causal``, ``scale``) and, when the
    call has score modifiers, ``modifiers`` (a :class:`~mmattn.kernels.modifiers.Modifiers`):
    its weights are then softmax over softcap(q kᵀ · scale) + ``mask`` (the reported mask
    holds the ALiBi term) and the sink logit of each head.
    """
    _LISTENERS.set((*_LISTENERS.get(), listener))

    def remove() -> None:
        current = _LISTENERS.get()
        if listener in current:
            _LISTENERS.set(tuple(other for other in current if other is not listener))

    return remove


def reporting() -> bool:
    """True while a listener wants path reports (so callers can skip building them)."""
    return bool(_LISTENERS.get())


def report(path: str, reasons: list[str] | None = None, **facts: Any) -> None:
    """Tell every listener that an attention call took ``path``, and why (see add_listener)."""
    record = {"path": path, "reasons": list(reasons or []), **_FACTS.get(), **facts}
    for listener in _LISTENERS.get():
        listener(record)


def current_facts() -> Mapping[str, Any]:
    """The facts :func:`report_facts` adds around the step running now (a packed bucket's
    ``items``, ...); empty outside every block."""
    return _FACTS.get()


@contextmanager
def report_facts(**facts: Any) -> Iterator[None]:
    """Add ``facts`` to every path report made inside the block (the bucket a layer's own
    kernel runs on, for the listeners that map its rows back to the items; the engine and
    why, for a fallback)."""
    token = _FACTS.set(MappingProxyType({**_FACTS.get(), **facts}))
    try:
        yield
    finally:
        _FACTS.reset(token)


def explicit_reasons(need_weights: bool, modifiers: Modifiers | None = None) -> list[str]:
    """Why a call runs the explicit path instead of the fused one (empty: it does not)."""
    reasons = []
    if modifiers is not None and modifiers.softcap is not None:
        reasons.append("softcap caps the scores before the softmax (no fused kernel does)")
    if need_weights:
        reasons.append("attention weights were requested (need_weights=True)")
    if not _FUSED_ATTN:
        reasons.append("the fused path is switched off (MMATTN_FUSED_ATTN=0 / set_fused_attn)")
    return reasons


# ---------------------------------------------------------------------- mask helpers


def with_causal(mask: Tensor | None, q_len: int, k_len: int, device: torch.device) -> Tensor:
    """Combine a "may attend" mask with the causal rule (key j <= query i, top-left)."""
    causal = causal_mask(q_len, k_len, device=device)
    if mask is None:
        return causal
    if mask.dtype == torch.bool:
        return mask & causal
    return mask.masked_fill(~causal, float("-inf"))


def allowed(mask: Tensor) -> Tensor:
    """The boolean "may attend" pattern of a bool or additive mask."""
    return mask if mask.dtype == torch.bool else ~torch.isneginf(mask)


def live_rows(mask: Tensor) -> Tensor:
    """(..., i, 1) bool: True where the row has at least one allowed key."""
    return allowed(mask).any(dim=-1, keepdim=True)


def open_dead_rows(mask: Tensor, live: Tensor) -> Tensor:
    """Let rows without any allowed key attend everything, so the softmax stays finite.

    Their results are zeroed afterwards; opening them keeps forward and backward NaN-free.
    """
    if mask.dtype == torch.bool:
        return mask | ~live
    return mask.masked_fill(~live, 0.0)


def num_groups(q: Tensor, k: Tensor, groups: int | None = None) -> int:
    """Query heads per key head, as a Python int.

    Modules pass ``groups`` from their configuration (``num_heads // num_kv_heads``), so no
    shape comparison reaches SDPA's ``enable_gqa`` as a SymBool under dynamic shapes; the
    functional API derives it from the (then specialised) head counts.
    """
    if groups is not None:
        return groups
    if q.dim() < 3 or k.dim() < 3 or not k.shape[-3]:
        return 1
    return int(q.shape[-3]) // int(k.shape[-3])


def sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    *,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    groups: int = 1,
    dead_rows: bool = True,
    sinks: Tensor | None = None,
) -> Tensor:
    """``F.scaled_dot_product_attention`` under the one dead-row policy of every path.

    A query row with no allowed key is opened before the softmax (so neither pass forms a
    NaN) and its result set to zero with ``torch.where``. The dense, blocked and packed
    kernels all call SDPA through here. ``dead_rows=False`` is the caller's promise that
    every row has a key (e.g. a band with no key mask): the guard's passes are then skipped.
    ``sinks`` (h,): sink logits joining every softmax (:func:`~.modifiers.sink_sdpa`).
    Values of a head width of their own (``e_v != e``) take zero columns up to one width
    (:func:`one_width`), so torch's flash kernels, which take one width, still run.

    Shape:
        - q: (b, h, i, e); k: (b, k, j, e); v: (b, k, j, e_v); mask broadcastable to
          (b, h, i, j), SDPA direction
        - returns: (b, h, i, e_v)
    """
    if is_causal and scale is not None and scale <= 0:
        # torch's CPU flash kernel writes the causal -inf before it scales: at scale 0 that
        # is 0 · -inf = NaN, at a negative scale +inf. An explicit mask has no such step.
        mask = with_causal(mask, q.shape[-2], k.shape[-2], q.device)
        is_causal = False
    live = None
    if mask is not None and dead_rows:
        live = live_rows(mask)
        mask = open_dead_rows(mask, live)
    if mask is not None and mask.dim() >= 2 and exporting():
        # ONNX Attention (opset 23) takes a mask with one row per query, never one row for
        # all; an additive mask spares ONNX's lowering of a boolean one two (b, h, i, j)
        # passes (Where before the softmax, IsNaN after). Every row is open: no -inf row.
        if mask.dtype == torch.bool:
            mask = torch.where(mask, 0.0, float("-inf")).to(q.dtype)
        mask = mask.expand(*mask.shape[:-2], q.shape[-2], mask.shape[-1])
    value_width = v.shape[-1]
    if value_width != q.shape[-1]:
        q, k, v, scale = one_width(q, k, v, scale)
    if sinks is not None:
        out = _mods.sink_sdpa(q, k, v, mask, sinks, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, groups=groups)
    else:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=_mods.gqa_flag(groups),
        )
    if out.shape[-1] != value_width:
        out = out[..., :value_width]
    return out if live is None else torch.where(live, out, 0.0)


def one_width(
    q: Tensor, k: Tensor, v: Tensor, scale: float | None
) -> tuple[Tensor, Tensor, Tensor, float]:
    """q, k and v brought to one head width with zero columns, and the scale made explicit.

    A zero column adds an exact zero to every score, so the scores, the weights and the
    first ``e_v`` output columns are those of the call as given, within float rounding (a
    product of another width may group its sums otherwise; at e = 32 on torch's CPU flash
    kernel they were bit for bit the same). torch's flash kernels take one width; without
    this a value width of its own (an attention call with extra value columns, such as
    :func:`mmattn.debug.attention_mass`'s groups) would run SDPA's math path, which forms
    the (i, j) scores.

    Shape:
        - q: (..., i, e); k: (..., j, e); v: (..., j, e_v)
        - returns: q, k, v of width max(e, e_v) (the caller keeps the first e_v output
          columns), and the scale (default ``1 / sqrt(e)``)
    """
    width, value_width = q.shape[-1], v.shape[-1]
    scale = default_scale(q, scale)
    if value_width > width:
        q, k = F.pad(q, (0, value_width - width)), F.pad(k, (0, value_width - width))
    else:
        v = F.pad(v, (0, width - value_width))
    return q, k, v, scale


def clear_dead_keys(mask: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Zero the keys and values that no query may attend (padding), whatever they hold.

    A masked key gets weight 0, but 0 · NaN is NaN: without this a NaN or Inf stored at a
    padded position would spread to every real output of the sample.

    Shape:
        - mask: broadcastable to (b, h, i, j); k: (b, k, j, e); v: (b, k, j, e_v)
    """
    seen = allowed(mask).any(dim=-2, keepdim=True)  # (..., 1, j)
    if seen.dim() >= 3 and k.dim() >= 3 and seen.shape[-3] not in (1, k.shape[-3]):
        seen = seen.any(dim=-3, keepdim=True)  # grouped heads: dead only if dead in all
    seen = seen.transpose(-1, -2)  # (..., j, 1)
    return torch.where(seen, k, 0.0), torch.where(seen, v, 0.0)


# ---------------------------------------------------------------------- explicit path


def weights_dtype(v: Tensor) -> torch.dtype:
    """The dtype of the attention weights a kernel returns: that of torch's softmax of a
    ``v.dtype`` tensor here.

    Outside autocast that is ``v.dtype``. Under autocast it follows the device's op lists, as
    torch's ``F.multi_head_attention_forward`` does (``bmm`` in low precision, then
    ``softmax``): CUDA runs softmax in float32 (float32 weights), CPU keeps bfloat16 / float16.
    The op is asked on an empty tensor, so no device's list is written down here.
    """
    if not autocast_on(v.device):
        return v.dtype
    return torch.softmax(v.new_empty(0), dim=-1).dtype


def softmax_attend(
    scores: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The explicit path for any score function: softmax(scores + mask) v, and the weights.

    ``scores`` (..., i, j) may be overwritten when it is a contiguous buffer and nothing that
    feeds it (``scores``, a float ``mask``: a learned bias) needs a gradient. A row with no
    allowed key is opened before the softmax and zeroed after. Half-precision scores get a
    float32 softmax. ``sinks`` (broadcastable to (..., i, 1)) join each row's softmax as a key
    of value zero; the weights returned leave the sink out. The product with ``v`` takes the
    weights in ``v``'s dtype; the weights returned have :func:`weights_dtype` (float32 under
    CUDA autocast, as torch's ``nn.MultiheadAttention``).

    Shape:
        - scores: (..., i, j); v: (..., j, e_v); mask: broadcastable to (..., i, j)
        - returns: (..., i, e_v) and the weights (..., i, j)
    """
    in_place = (
        not scores.requires_grad and not (mask is not None and mask.requires_grad)
        and scores.is_contiguous()
    )
    live = None
    if mask is not None:
        live = live_rows(mask)
        mask = open_dead_rows(mask, live)
        if mask.dtype == torch.bool:
            scores = (
                scores.masked_fill_(~mask, float("-inf")) if in_place
                else scores.masked_fill(~mask, float("-inf"))
            )
        else:
            scores = scores.add_(mask) if in_place else scores + mask
    if sinks is not None:
        weights = _mods.sink_softmax(scores, sinks)
    elif scores.dtype in (torch.float16, torch.bfloat16):
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
    elif in_place:
        # Inference: softmax in place. A fresh (..., i, j) buffer costs page faults that take
        # longer than the softmax itself on the CPU.
        weights = torch._softmax(scores, -1, False, out=scores)
    else:
        weights = torch.softmax(scores, dim=-1)
    weights = weights.to(weights_dtype(v))
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    out = torch.matmul(weights.to(v.dtype), v)
    if live is not None:
        out = torch.where(live, out, 0.0)
        weights = torch.where(live, weights, 0.0)
    return out, weights


def grouped_softmax_attend(
    scores: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float,
    modifiers: Modifiers | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`softmax_attend` when ``v`` has fewer heads than ``scores`` (grouped queries).

    The g query heads of a key head are folded into the query axis, as in the explicit path,
    so values are never repeated per query head. ``modifiers``: softcap, ALiBi (at
    ``0 .. i - 1`` / ``0 .. j - 1`` unless set) and sinks on these scores.

    Shape:
        - scores: (b, h, i, j); v: (b, k, j, e_v) with ``k`` dividing ``h``
        - returns: (b, h, i, e_v) and the weights (b, h, i, j)
    """
    groups = scores.shape[-3] // v.shape[-3]
    rows = scores.shape[-2]
    sinks = None
    if modifiers:
        bias = modifiers.terms(rows, scores.shape[-1], scores.device, scores.dtype)
        scores, sinks = modifiers.hook(scores, bias), modifiers.row_sinks(groups, rows)
    if groups == 1:
        return softmax_attend(scores, v, mask, dropout_p, sinks)
    folded = rearrange(scores, "b (k g) i j -> b k (g i) j", g=groups)
    mask = None if mask is None else group_mask(mask, groups, rows)
    out, weights = softmax_attend(folded, v, mask, dropout_p, sinks)
    out = rearrange(out, "b k (g i) e -> b (k g) i e", g=groups, i=rows)
    weights = rearrange(weights, "b k (g i) j -> b (k g) i j", g=groups, i=rows)
    return out, weights


# ---------------------------------------------------------------------- the kernel


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    *,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    need_weights: bool = False,
    report_path: bool = True,
    groups: int | None = None,
    modifiers: Modifiers | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Attention on head-split tensors: the fused or the explicit path.

    Checked in O(1) (ranks, head widths, heads, the mask's dtype); batch dimensions and the
    mask's shape broadcast as in SDPA. The checked public face with full shape checks is
    :func:`mmattn.functional.scaled_dot_product_attention`.

    Args:
        q, k, v: queries, keys, values. ``k`` and ``v`` may have fewer heads than ``q``
            (grouped-query attention): query head ``n`` uses key head ``n // (h / k)``.
        mask: None, or bool (True = may attend) / float (added), broadcastable to
            (b, h, i, j).
        dropout_p: dropout on the attention weights (the caller passes 0 in eval mode).
        is_causal: key j <= query i (top-left aligned), combined with ``mask``.
        scale: score scale; default ``1 / sqrt(e)``.
        need_weights: also return the weights (forces the explicit path).
        report_path: tell the path listeners (callers that report for themselves pass False).
        groups: query heads per key head (modules pass ``num_heads // num_kv_heads``;
            default: from the shapes, see :func:`num_groups`).
        modifiers: sinks, softcap and ALiBi (:mod:`mmattn.kernels.modifiers`); softcap runs
            the explicit path, ALiBi joins the mask, sinks use the logsumexp identity.

    Shape:
        - q: (b, h, i, e); k: (b, k, j, e); v: (b, k, j, e_v)
        - returns: (b, h, i, e_v) and weights (b, h, i, j) or None
    """
    _inputs.check_attention(q, k, v, mask)
    scale = default_scale(q, scale)
    groups = num_groups(q, k, groups)
    mods = modifiers if modifiers else None
    explicit = need_weights or not _FUSED_ATTN or (mods is not None and mods.explicit)
    bias = None if mods is None else mods.terms(q.shape[-2], k.shape[-2], q.device, q.dtype)
    if is_causal and (mask is not None or explicit or bias is not None):
        mask = with_causal(mask, q.shape[-2], k.shape[-2], q.device)
        is_causal = False
    if report_path and _LISTENERS.get():
        report(
            "explicit" if explicit else "fused", explicit_reasons(need_weights, mods), q=q, k=k,
            v=v, mask=_mods.with_bias(mask, bias), dropout_p=dropout_p, is_causal=is_causal,
            scale=scale, modifiers=mods,
        )
    if q.numel() == 0 or k.numel() == 0:
        return _empty(q, k, v, need_weights)
    if mask is not None:
        k, v = clear_dead_keys(mask, k, v)
    if explicit:  # softmax_attend opens and zeroes the rows without an allowed key
        out, weights = _explicit(q, k, v, mask, dropout_p, scale, groups, mods, bias)
        return out, (weights if need_weights else None)
    out = sdpa(
        q, k, v, _mods.with_bias(mask, bias), dropout_p=dropout_p, is_causal=is_causal,
        scale=scale, groups=groups, sinks=None if mods is None else mods.sinks,
    )
    return out, None


def _explicit(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float, scale: float,
    groups: int, mods: Modifiers | None = None, bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """softmax(hook(q kᵀ · scale) + mask) v; grouped query heads share their key head's K, V.

    The g query heads of each key head are folded into the query axis: no repeated K/V."""
    rows = q.shape[-2]
    if groups > 1:
        q = rearrange(q, "b (k g) i e -> b k (g i) e", g=groups)
        mask = None if mask is None else group_mask(mask, groups, rows)
        bias = None if bias is None else group_mask(bias, groups, rows)
    scores, sinks = dot_scores(q, k, scale), None
    if mods is not None:
        scores, sinks = mods.hook(scores, bias), mods.row_sinks(groups, rows)
    out, weights = softmax_attend(scores, v, mask, dropout_p, sinks)
    if groups == 1:
        return out, weights
    out = rearrange(out, "b k (g i) e -> b (k g) i e", g=groups, i=rows)
    weights = rearrange(weights, "b k (g i) j -> b (k g) i j", g=groups, i=rows)
    return out, weights


def _empty(q: Tensor, k: Tensor, v: Tensor, need_weights: bool) -> tuple[Tensor, Tensor | None]:
    """A zero-length query or key axis: zeros of the right shape, still attached to autograd.

    The zero comes from empty slices of the inputs, so gradients are zeros (never None or
    NaN), whatever the inputs hold.
    """
    touch = sum(t.flatten()[:0].sum() for t in (q, k, v))
    out = q.new_zeros(*q.shape[:-1], v.shape[-1]) + touch
    weights = q.new_zeros(*q.shape[:-1], k.shape[-2], dtype=weights_dtype(v)) if need_weights \
        else None
    return out, weights
