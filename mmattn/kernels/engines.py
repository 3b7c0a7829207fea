"""Which engine runs an attention call: torch's ``varlen_attn``, compiled ``flex_attention``,
or mmattn's own kernel (the fallback), and why.

Axis key: ``b`` batch, ``h`` query heads, ``l`` length, ``e`` head width.

On a CUDA tensor, on the fused path (no weights requested, no dropout, ``MMATTN_FUSED_ATTN``
on, not exporting), each structured kernel hands the call to the fastest engine torch has
(DESIGN, fifth wave, "Which engine runs what on CUDA")::

    kind        call                                           engine
    "segments"  packed Tokens; a SparseMask of P.same(key)     varlen_attn (cu_seqlens)
                (& P.causal() / & P.window(w)), contiguous runs
    "window"    LocalAttention without global tokens           varlen_attn(window_size)
    "blocks"    any other SparseMask, LocalAttention with      compiled flex_attention with a
                global tokens, NeighborhoodAttention           BlockMask

``varlen_attn`` is flash attention: half precision only, no score modifiers, no key mask (the
lengths are the mask), GQA only where its signature has ``enable_gqa``, a window only where it
has ``window_size``. A call it cannot take goes to flex (which takes a key mask, sinks,
softcap and ALiBi as a ``score_mod``), and a call neither takes runs today's kernel. The CPU
paths never change unless a test or a user forces an engine with :func:`use`: flex then runs
its CPU forward (torch compiles no CPU backward for it, so only without autograd).

:func:`select` is a pure function of the call's facts (:class:`Call`) and the engines
present (:class:`Available`), so the routing is tested without a GPU; :func:`available`
detects the engines once (features, never version strings).

Examples:
    >>> call = Call(kind="window", device="cuda", dtype=torch.bfloat16, head_dim=64)
    >>> select(call, Available(varlen=True, varlen_window=True, varlen_gqa=True, flex=True))
    Choice(engine='varlen', reason='varlen_attn: flash on the real lengths')
    >>> select(call, Available()).engine
    'fallback'
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = [
    "Available", "Call", "Choice", "ENGINES", "available", "considered", "forced", "select", "use",
]

#: The engines, fastest first; "fallback" is mmattn's own kernel.
ENGINES = ("varlen", "flex", "fallback")
#: The kinds of call (see the module docstring).
KINDS = ("segments", "window", "blocks")
_HALF = (torch.float16, torch.bfloat16)
#: ``MMATTN_ENGINE=flex,fallback``: the engines allowed by default (as :func:`use`).
ENV = "MMATTN_ENGINE"


@dataclass(frozen=True)
class Available:
    """Which engines (and which of their arguments) this torch has.

    Attributes:
        varlen: ``torch.nn.attention.varlen.varlen_attn`` exists.
        varlen_window: it takes ``window_size`` (torch 2.11+).
        varlen_gqa: it takes ``enable_gqa`` (2.12+).
        flex: ``torch.nn.attention.flex_attention`` exists with ``BlockMask.from_kv_blocks``
            and ``return_lse``.
    """

    varlen: bool = False
    varlen_window: bool = False
    varlen_gqa: bool = False
    flex: bool = False


@functools.cache
def available() -> Available:
    """The engines of the running torch, detected once from their signatures."""
    varlen = window = gqa = flex = False
    try:
        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
        varlen, window, gqa = True, "window_size" in params, "enable_gqa" in params
    except (ImportError, AttributeError, ValueError, TypeError):
        pass
    try:
        from torch.nn.attention import flex_attention as flex_module

        flex = hasattr(flex_module.BlockMask, "from_kv_blocks") and "return_lse" in (
            inspect.signature(flex_module.flex_attention).parameters)
    except (ImportError, AttributeError, ValueError, TypeError):
        pass
    return Available(varlen, window, gqa, flex)


@dataclass(frozen=True)
class Call:
    """The facts of one attention call that decide its engine.

    Attributes:
        kind: "segments", "window" or "blocks" (module docstring).
        device: the tensors' device type ("cuda", "cpu", ...).
        dtype: the queries' dtype.
        head_dim: e (flash takes up to 256, a multiple of 8).
        groups: query heads per key head (GQA when > 1).
        need_weights, dropout: weights requested; dropout on the weights (> 0).
        fused: the fused path is on (``MMATTN_FUSED_ATTN``).
        key_mask: the call has a key padding mask.
        modifiers: names of its score modifiers ("sinks", "softcap", "alibi").
        grad: autograd will run backward through the call.
        traced: exporting or a symbolic shape (the engines take concrete data).
        global_tokens: a "window" call with global tokens (flex, not varlen).
        banded: a "segments" call that passes varlen a ``window_size`` too (the causal rule
            or a window inside the runs); every "window" call does.
    """

    kind: str
    device: str
    dtype: torch.dtype
    head_dim: int
    groups: int = 1
    need_weights: bool = False
    dropout: bool = False
    fused: bool = True
    key_mask: bool = False
    modifiers: tuple[str, ...] = ()
    grad: bool = False
    traced: bool = False
    global_tokens: bool = False
    banded: bool = False


@dataclass(frozen=True)
class Choice:
    """An engine and why (for a fallback: why not an engine)."""

    engine: str
    reason: str


_STATE = threading.local()


def _check_names(names: tuple[str, ...]) -> tuple[str, ...]:
    for name in names:
        if name not in ENGINES:
            raise ValueError(f"engine: expected one of {ENGINES}, got {name!r}")
    return names


def _from_env() -> tuple[str, ...] | None:
    env = os.environ.get(ENV, "").strip()
    return _check_names(tuple(n.strip() for n in env.split(",") if n.strip())) if env else None


_DEFAULT = _from_env()  # read once, at import (as MMATTN_FUSED_ATTN)


def forced() -> tuple[str, ...] | None:
    """The engines :func:`use` (or ``MMATTN_ENGINE``) allows now, in order; None = automatic."""
    names = getattr(_STATE, "allowed", None)
    return _DEFAULT if names is None else names


def considered(device: torch.device | str) -> bool:
    """Whether a call on ``device`` asks :func:`select` at all (the CPU path skips it unless
    an engine is forced, so its cost does not change)."""
    kind = device if isinstance(device, str) else device.type
    return kind == "cuda" or forced() is not None


@contextlib.contextmanager
def use(*engines: str) -> Iterator[None]:
    """Allow only these engines inside the block (as ``torch.nn.attention.sdpa_kernel``).

    ``use("fallback")`` refuses every engine (today's kernels); ``use("flex")`` runs flex
    wherever it can express the call, on the CPU too (forward without autograd only), and
    today's kernel elsewhere; ``use("varlen", "flex")`` tries them in this order. A call
    that no allowed engine can take runs the fallback, and ``explain`` says why. The
    environment variable ``MMATTN_ENGINE=flex,fallback`` sets the default the same way.

    Raises:
        ValueError: a name other than "varlen", "flex", "fallback", or none.
    """
    if not engines:
        raise ValueError(f"engine: name at least one of {ENGINES}")
    previous = getattr(_STATE, "allowed", None)
    _STATE.allowed = _check_names(tuple(engines))
    try:
        yield
    finally:
        _STATE.allowed = previous


def _varlen_refusal(call: Call, have: Available) -> str | None:
    """Why varlen_attn cannot run the call (None: it can)."""
    if call.kind == "blocks" or call.global_tokens:
        return "varlen_attn runs segments and windows only (this mask is blocks)"
    if not have.varlen:
        return "torch has no torch.nn.attention.varlen.varlen_attn"
    if call.device != "cuda":
        return "varlen_attn is CUDA-only"
    if (call.kind == "window" or call.banded) and not have.varlen_window:
        return "varlen_attn has no window_size in this torch"
    if call.dtype not in _HALF:
        return f"varlen_attn (flash) takes float16/bfloat16, not {str(call.dtype)[6:]}"
    if call.head_dim % 8 or call.head_dim > 256:
        return f"varlen_attn (flash) takes head widths 8..256 in steps of 8, not {call.head_dim}"
    if call.groups > 1 and not have.varlen_gqa:
        return "varlen_attn has no enable_gqa in this torch (grouped-query heads)"
    if call.modifiers:
        return f"varlen_attn takes no score modifiers ({', '.join(call.modifiers)})"
    if call.key_mask:
        return "varlen_attn takes no key padding mask (its lengths are the mask)"
    return None


def _flex_refusal(call: Call, have: Available, forced_here: bool) -> str | None:
    """Why flex_attention cannot run the call (None: it can)."""
    if not have.flex:
        return "torch has no flex_attention with BlockMask.from_kv_blocks"
    if call.device == "cuda" and call.head_dim < 16:
        return f"flex_attention's CUDA kernel takes head widths >= 16, not {call.head_dim}"
    if call.device != "cuda":
        if not forced_here:
            return f"on {call.device} mmattn's own kernels run (flex only when forced)"
        if call.grad:
            return f"flex_attention has no backward on {call.device}"
    return None


def select(call: Call, have: Available | None = None,
           allowed: tuple[str, ...] | None = None) -> Choice:
    """The engine for ``call`` (pure: availability and the allowed engines are inputs).

    Args:
        call: the facts of the call.
        have: the engines present (default :func:`available`).
        allowed: the engines allowed, in order (default :func:`forced`; None = automatic:
            varlen, then flex, on CUDA only).

    Returns:
        The :class:`Choice`; "fallback" with the reason no allowed engine takes the call.
    """
    have = available() if have is None else have
    allowed = forced() if allowed is None else allowed
    if call.kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {call.kind!r}")
    order = ENGINES[:2] if allowed is None else tuple(e for e in allowed if e != "fallback")
    if not order:
        return Choice("fallback", "engines refused (mmattn.kernels.engines.use('fallback'))")
    if call.need_weights:
        return Choice("fallback", "attention weights were requested (need_weights=True)")
    if call.dropout:
        return Choice("fallback", "dropout on the weights (training mode)")
    if not call.fused:
        return Choice("fallback", "the fused path is off (MMATTN_FUSED_ATTN=0)")
    if call.traced:
        return Choice("fallback", "exporting or a symbolic shape (the engines take data)")
    refusals = []
    for engine in order:
        if engine == "varlen":
            why = _varlen_refusal(call, have)
            reason = "varlen_attn: flash on the real lengths"
        else:
            why = _flex_refusal(call, have, allowed is not None)
            reason = "flex_attention with a BlockMask"
        if why is None:
            return Choice(engine, reason + "".join(f" ({r})" for r in refusals))
        refusals.append(why)
    return Choice("fallback", "; ".join(refusals))
