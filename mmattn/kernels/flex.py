"""The FlexAttention engine: compiled ``flex_attention`` for every structured kernel.

Axis key: ``b`` batch, ``h`` query heads, ``k`` key/value heads, ``l`` length, ``e`` head
width, ``p`` coordinates of a position.

A kernel that :func:`mmattn.kernels.engines.select` sends to flex hands over its geometry as
a ``BlockMask`` (which tiles to visit, and the exact rule inside the partial ones) and the
call's other terms go into one ``score_mod``, in mmattn's order (kernels/modifiers.py)::

    s ← c · tanh(s / c)             softcap
    s ← s − m_h · d(i, j)           ALiBi; d = |i − j|, or from position tables (|Δrow|, or
                                    Euclidean on a grid); "flat" tokens (global ones) at 0
                                    or at their own positions
    s ← s + key_bias[b, j]          the key padding mask (−inf where padded, or its floats)

Sinks use flex's logsumexp ``ℓ`` and the identity of kernels/modifiers.py:
``out_sink = out · σ(ℓ − σ_h)``; flex differentiates through ``ℓ``. A row without any
allowed key gives 0 (flex returns 0 and ``ℓ = −inf`` there; σ(−inf) = 0).

Graphs (:func:`compiled`): dynamo guards on what is not data (the mask_mod's and score_mod's
code and which of their terms exist, the BlockMask's tile, dtype, grad mode, GQA, the
logsumexp, the scale), so each such *signature* gets its own compiled copy of one small
function (its own code object: its own dynamo cache and recompile budget, apart from the
user's ``torch.compile(flex_attention)``). Every number inside the mods is a tensor (the
window, the softcap, the slopes, the tile tables), so a new mask, window or batch is new
data, and a new length makes the signature's graph dynamic once (torch.compile's automatic
dynamic shapes): at most two graphs a signature. Where dynamo's recompile limit is reached
anyway, :func:`mmattn.kernels.engines.attempt` runs the fallback with one warning. On the
CPU (forced engines only) torch compiles the forward alone and without the logsumexp, so a
CPU call with sinks runs flex eagerly.
"""

from __future__ import annotations

import functools
import itertools
import types
from collections.abc import Callable

import torch
from torch import Tensor

from mmattn.kernels import dense as _kernel
from mmattn.kernels._engine_facts import available
from mmattn.kernels._scores import default_scale
from mmattn.kernels.modifiers import Modifiers, join_sink

__all__ = [
    "compiled", "flex_attend", "graphs", "key_bias", "mod_facts", "own_copy", "score_mod",
]


def _flex_call(q, k, v, score_mod, block_mask, scale, enable_gqa, lse, aux):
    """flex_attention with the logsumexp asked the way this torch spells it (``aux``: the
    ``AuxRequest`` class of ``return_aux=``, None for the older ``return_lse=``)."""
    from torch.nn.attention.flex_attention import flex_attention

    if not lse:
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                              enable_gqa=enable_gqa)
    if aux is not None:
        out, extra = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                    scale=scale, enable_gqa=enable_gqa,
                                    return_aux=aux(lse=True))
        return out, extra.lse
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                          enable_gqa=enable_gqa, return_lse=True)


_NUMBER = itertools.count()


def own_copy(fn: Callable, name: str) -> Callable:
    """``fn`` with its own code object: dynamo keeps its compiled graphs (and counts its
    recompiles) per code object."""
    code = fn.__code__.replace(co_name=name, co_qualname=name) if hasattr(
        fn.__code__, "co_qualname") else fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


_COMPILED: dict[tuple, Callable] = {}


def compiled(signature: tuple = ("cuda",)) -> Callable:
    """The compiled flex call of one signature (see the module docstring): ``fn(q, k, v,
    score_mod, block_mask, scale, enable_gqa, lse, aux)``, made once per process and
    signature, ``fullgraph`` (eager flex is a slow reference implementation; compiled, it is
    the fused kernel). The signature's first element is the device type."""
    fn = _COMPILED.get(signature)
    if fn is None:
        own = own_copy(_flex_call, f"mmattn_flex_{next(_NUMBER)}")
        # the CPU compiles static sizes: inductor's CPU flex kernel fails to build when a
        # table the mods read has a dynamic size (docs/decisions.md)
        dynamic = False if signature[0] == "cpu" else None
        fn = _COMPILED.setdefault(signature, torch.compile(own, fullgraph=True, dynamic=dynamic))
    return fn


def graphs() -> dict[tuple, int | None]:
    """How many graphs dynamo holds for each signature compiled so far (None where this torch
    does not say): the count a model's flex calls made."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list as entries
    except ImportError:
        entries = None
    out = {}
    for signature, fn in list(_COMPILED.items()):
        inner = getattr(fn, "_torchdynamo_orig_callable", None)
        out[signature] = None if entries is None or inner is None else len(
            entries(inner.__code__))
    return out


def key_bias(key_mask: Tensor | None, dtype: torch.dtype = torch.float32) -> Tensor | None:
    """A (b, j) key mask as the additive (b, j) term of the score_mod: bool True = may
    attend → 0 / −inf; float → itself."""
    if key_mask is None:
        return None
    if key_mask.dtype == torch.bool:
        return torch.zeros(key_mask.shape, dtype=dtype, device=key_mask.device).masked_fill(
            ~key_mask, float("-inf"))
    return key_mask.to(dtype)


@functools.lru_cache(maxsize=256)
def _constant(value: float, device: torch.device) -> Tensor:
    """A 0-d float32 tensor of ``value`` on ``device``, made once (a fill, not a copy from
    the host)."""
    return torch.full((), value, dtype=torch.float32, device=device)


def score_mod(
    softcap: Tensor | None = None,
    slopes: Tensor | None = None,
    rows: Tensor | None = None,
    cols: Tensor | None = None,
    flat: Tensor | None = None,
    flat_rows: Tensor | None = None,
    bias: Tensor | None = None,
    causal: bool = False,
) -> Callable | None:
    """The score_mod of a call (None when it adds nothing).

    Args:
        softcap: ``c`` of ``c · tanh(s / c)``, a 0-d tensor (a Python number would be a
            constant of the graph: one compile per value).
        slopes: (h,) ALiBi slopes (the term is ``−m_h · d``).
        rows, cols: (l,) float positions of the tokens; ``d = |Δrow|`` without ``cols``,
            Euclidean with them (a grid); without ``rows`` ``d = |i − j|``.
        flat: (l,) bool tokens measured apart (global tokens): a pair with one of them is at
            distance 0, or at ``|flat_rows[i] − flat_rows[j]|`` with ``flat_rows`` (l,).
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
            if rows is None:
                dist = (q_idx - kv_idx).abs().to(torch.float32)
            else:
                dist = (rows[q_idx] - rows[kv_idx]).abs()
            if cols is not None:
                dist = torch.sqrt(dist * dist + (cols[q_idx] - cols[kv_idx]) ** 2)
            if flat is not None:
                apart = 0.0 if flat_rows is None else (flat_rows[q_idx] - flat_rows[kv_idx]).abs()
                dist = torch.where(flat[q_idx] | flat[kv_idx], apart, dist)
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
    flat_rows: Tensor | None = None,
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
        modifiers: sinks, softcap and ALiBi; ALiBi's distance as :func:`score_mod` measures
            it from ``rows`` / ``cols`` / ``flat`` / ``flat_rows`` (default: the token
            index).
        causal: also key j <= query i (when the BlockMask does not hold it).
        seen: (b, l) bool, the keys some query may attend; the others (and the keys the key
            mask excludes) are replaced by zeros first, so a NaN stored there cannot reach a
            real output (flex's zero weight times NaN would be NaN).

    Shape:
        - q: (b, h, l, e); k: (b, k, l, e); v: (b, k, l, e_v)
        - returns: (b, h, l, e_v)
    """
    mods = modifiers if modifiers else None
    softcap = None if mods is None or mods.softcap is None else _constant(
        float(mods.softcap), q.device)
    slopes = None if mods is None or mods.slopes is None else mods.slopes.float()
    if key_mask is not None:  # padding never leaks: 0 · NaN is NaN inside flex too
        ok = _kernel.allowed(key_mask)
        seen = ok if seen is None else seen & ok
    if seen is not None:
        k = torch.where(seen[:, None, :, None], k, 0.0)
        v = torch.where(seen[:, None, :, None], v, 0.0)
    if slopes is None:
        rows = cols = flat = flat_rows = None
    mod = score_mod(softcap, slopes, rows, cols, flat, flat_rows, key_bias(key_mask), causal)
    scale = default_scale(q, scale)
    sinks = None if mods is None else mods.sinks
    have = available()
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if sinks is not None and q.device.type == "cpu":  # no compiled CPU logsumexp: eager flex
        run = _flex_call
    else:
        run = compiled((q.device.type, q.dtype, grad, groups > 1, sinks is not None, scale,
                        causal, *mod_facts(block_mask.mask_mod), block_mask.BLOCK_SIZE,
                        *(t is not None for t in (softcap, slopes, rows, cols, flat, flat_rows)),
                        key_mask is None or key_mask.dtype))
    out = run(q, k, v, mod, block_mask, scale, groups > 1, sinks is not None,
              _aux_request() if have.flex_aux else None)
    if sinks is None:
        return out
    out, lse = out
    keep, _ = join_sink(lse.float(), sinks.float()[:, None])  # σ(ℓ − σ_h), (b, h, l)
    return out * keep[..., None].to(out.dtype)


def mod_facts(fn: Callable) -> tuple:
    """What dynamo guards on in a mask_mod besides its tensors: its code and the plain
    Python values it closes over (a causal flag, a tile width)."""
    cells = tuple(c.cell_contents for c in fn.__closure__ or ())
    return (fn.__code__, *(c for c in cells if isinstance(c, (bool, int, float, str))))


def _aux_request():
    from torch.nn.attention.flex_attention import AuxRequest

    return AuxRequest
