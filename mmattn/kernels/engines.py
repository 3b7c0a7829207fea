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

:func:`select` is a pure function of the call's facts (:class:`Call`: kind, device, its
compute capability, dtype, head width, flex's tile) and the engines present
(:class:`Available`), so the routing is tested without a GPU; an engine is chosen only where
torch's own checks would let it run (flash: compute capability 8.0+, half precision, head
widths 8..256; flex on CUDA: power-of-two tiles of 16+, head widths 16+). :func:`available`
is the one module of detected facts: engines, their arguments, the deprecated forms' new
spellings, dynamo's recompile limit (features, never version strings).

The promise (DESIGN, sixth wave): a call never raises because of an engine. :func:`attempt`
runs the chosen engine; dynamo's recompile limit runs the fallback with one warning, and any
other exception of an automatically chosen engine runs the fallback for that call, warns once
per engine and call signature (naming ``engines.use("fallback")`` / ``MMATTN_ENGINE``) and
keeps that engine off calls of the same signature. An engine forced with :func:`use` raises
its error.

Examples:
    >>> call = Call(kind="window", device="cuda", dtype=torch.bfloat16, head_dim=64)
    >>> select(call, Available(varlen=True, varlen_window=True, varlen_gqa=True, flex=True))
    Choice(engine='varlen', reason='varlen_attn: flash on the real lengths')
    >>> select(call, Available()).engine
    'fallback'
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

from mmattn.kernels._engine_facts import Available, available, capability, recompile_limit

__all__ = [
    "Available", "Call", "Choice", "ENGINES", "attempt", "available", "capability", "considered",
    "flex_block_refusal", "forced", "forget_failures", "recompile_limit", "select", "use",
]

#: The engines, fastest first; "fallback" is mmattn's own kernel.
ENGINES = ("varlen", "flex", "fallback")
#: The kinds of call (see the module docstring).
KINDS = ("segments", "window", "blocks")
_HALF = (torch.float16, torch.bfloat16)
#: ``MMATTN_ENGINE=flex,fallback``: the engines allowed by default (as :func:`use`).
ENV = "MMATTN_ENGINE"
#: The compute capability flash attention needs (torch's ``can_use_flash_attention``: sm80+).
FLASH_CAPABILITY = (8, 0)
#: Triton's floor (torch's inductor refuses older GPUs) and the floor of its bfloat16 dots.
TRITON_CAPABILITY, TRITON_BF16_CAPABILITY = (7, 0), (8, 0)
#: The smallest tile flex runs (its CPU kernel is not exact below; CUDA shrinks its tiles to
#: power-of-two block sizes of at least this).
FLEX_MIN_BLOCK = 16


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
        capability: the CUDA device's compute capability (None: not CUDA, or not known).
        block: the BlockMask tile flex would run (a SparseMask's ``block_size``), or None.
        packed: packed (jagged) rows, whose offsets are varlen's ``cu_seqlens`` (flex does
            not take them).
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
    capability: tuple[int, int] | None = None
    block: int | None = None
    packed: bool = False


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
    that no allowed engine can take runs the fallback, and ``explain`` says why. A forced
    engine's own error is raised (an automatic choice falls back, see :func:`attempt`). The
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


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _version(cap: tuple[int, int]) -> str:
    return f"{cap[0]}.{cap[1]}"


def flex_block_refusal(block: int, device: str) -> str | None:
    """Why flex cannot tile ``BLOCK_SIZE=block`` on this device type (None: it can): its
    CPU kernel is not exact below 16, and on CUDA torch fits its tiles only to powers of
    two ("Invalid FlexAttention forward kernel options" otherwise)."""
    if block % FLEX_MIN_BLOCK:
        return (f"flex_attention's BLOCK_SIZE must be a multiple of {FLEX_MIN_BLOCK} (below, "
                f"its compiled CPU kernel is not exact), not {block}")
    if device == "cuda" and not _power_of_two(block):
        return (f"flex_attention's CUDA kernel tiles BLOCK_SIZE powers of two >= "
                f"{FLEX_MIN_BLOCK}, not {block}")
    return None


def _varlen_refusal(call: Call, have: Available) -> str | None:
    """Why varlen_attn cannot run the call (None: it can)."""
    if call.kind == "blocks" or call.global_tokens:
        return "varlen_attn runs segments and windows only (this mask is blocks)"
    if not have.varlen:
        return "torch has no torch.nn.attention.varlen.varlen_attn"
    if call.device != "cuda":
        return "varlen_attn is CUDA-only"
    if call.capability is not None and call.capability < FLASH_CAPABILITY:
        return (f"varlen_attn (flash) needs compute capability {_version(FLASH_CAPABILITY)}+, "
                f"this GPU has {_version(call.capability)}")
    if (call.kind == "window" or call.banded) and not have.varlen_window:
        return "varlen_attn has no window_size in this torch"
    if call.dtype not in _HALF:
        return f"varlen_attn (flash) takes float16/bfloat16, not {str(call.dtype)[6:]}"
    if call.head_dim % 8 or not 8 <= call.head_dim <= 256:
        return f"varlen_attn (flash) takes head widths 8..256 in steps of 8, not {call.head_dim}"
    if call.groups > 1 and not have.varlen_gqa:
        return "varlen_attn has no enable_gqa in this torch (grouped-query heads)"
    if call.modifiers:
        return f"varlen_attn takes no score modifiers ({', '.join(call.modifiers)})"
    if call.key_mask:
        return ("varlen_attn takes no key padding mask (its lengths are the mask; a SparseMask "
                "already holds its tokens' padding: pass none with it)")
    return None


def _flex_cuda_refusal(call: Call, have: Available) -> str | None:
    """Why flex's CUDA (Triton) kernel cannot run the call (None: it can)."""
    if not have.triton:
        return "flex_attention compiles for CUDA with Triton, which is not installed"
    cap = call.capability
    if cap is not None and cap < TRITON_CAPABILITY:
        return (f"flex_attention (Triton) needs compute capability "
                f"{_version(TRITON_CAPABILITY)}+, this GPU has {_version(cap)}")
    if cap is not None and call.dtype == torch.bfloat16 and cap < TRITON_BF16_CAPABILITY:
        return (f"flex_attention in bfloat16 needs compute capability "
                f"{_version(TRITON_BF16_CAPABILITY)}+, this GPU has {_version(cap)}")
    if call.dtype not in (*_HALF, torch.float32):
        return (f"flex_attention's CUDA kernel takes float16/bfloat16/float32, not "
                f"{str(call.dtype)[6:]}")
    if call.head_dim < 16:
        return f"flex_attention's CUDA kernel takes head widths >= 16, not {call.head_dim}"
    return None


def _flex_refusal(call: Call, have: Available, forced_here: bool) -> str | None:
    """Why flex_attention cannot run the call (None: it can)."""
    if call.packed:
        return "flex_attention takes no packed (jagged) rows here (varlen_attn does)"
    if not have.flex:
        return "torch has no flex_attention with BlockMask.from_kv_blocks"
    if "sinks" in call.modifiers and not have.flex_sinks:
        return "flex_attention returns no logsumexp in this torch (sinks need it)"
    if call.block is not None and flex_block_refusal(call.block, call.device):
        return flex_block_refusal(call.block, call.device)
    if call.device == "cuda":
        return _flex_cuda_refusal(call, have)
    if not forced_here:
        return f"on {call.device} mmattn's own kernels run (flex only when forced)"
    if call.grad:
        return f"flex_attention has no backward on {call.device}"
    return None


def select(call: Call, have: Available | None = None,
           allowed: tuple[str, ...] | None = None,
           failed: Mapping[tuple[str, Call], str] | None = None) -> Choice:
    """The engine for ``call`` (pure: availability, the allowed engines and the failures seen
    are inputs).

    Args:
        call: the facts of the call.
        have: the engines present (default :func:`available`).
        allowed: the engines allowed, in order (default :func:`forced`; None = automatic:
            varlen, then flex, on CUDA only).
        failed: ``(engine, call) -> error`` of engines that raised on a call like this one
            (default: those :func:`attempt` saw); an automatic choice skips them.

    Returns:
        The :class:`Choice`; "fallback" with the reason no allowed engine takes the call.
    """
    have = available() if have is None else have
    allowed = forced() if allowed is None else allowed
    failed = _FAILED if failed is None else failed
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
        if why is None and allowed is None and (engine, call) in failed:
            why = f"{engine} raised on a call like this before ({failed[engine, call]})"
        if why is None:
            return Choice(engine, reason + "".join(f" ({r})" for r in refusals))
        refusals.append(why)
    return Choice("fallback", "; ".join(refusals))


# ------------------------------------------------------------ running an engine, safely

T = TypeVar("T")
#: (engine, call) -> the error it raised, for calls chosen automatically (:func:`attempt`).
_FAILED: dict[tuple[str, Call], str] = {}
_WARNED: set[tuple] = set()
_LOCK = threading.Lock()
_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def forget_failures() -> None:
    """Forget the engines' failures and warnings (a fresh start: each may fail and warn
    again)."""
    with _LOCK:
        _FAILED.clear()
        _WARNED.clear()


def _warn_once(key: tuple, message: str) -> None:
    with _LOCK:
        if key in _WARNED:
            return
        _WARNED.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def _error_text(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:200]}{'...' if len(text) > 200 else ''}"


def attempt(choice: Choice, call: Call, run: Callable[[], T],
            have: Available | None = None) -> tuple[T | None, Choice]:
    """``run()`` the chosen engine; ``(None, fallback choice)`` when the caller must run its
    own kernel instead.

    Dynamo's recompile limit (``have.limit_errors``) is not an engine failure: the call runs
    the fallback with one warning naming the limit, forced or not. Any other exception of an
    automatically chosen engine runs the fallback, warns once per engine and call signature
    and keeps the engine off that signature (:func:`select`'s ``failed``); a forced engine
    (:func:`use`, ``MMATTN_ENGINE``) raises it. Out-of-memory errors are raised (the
    fallback would need the memory too).
    """
    have = available() if have is None else have
    try:
        return run(), choice
    except _OUT_OF_MEMORY:
        raise
    except Exception as error:  # noqa: BLE001 - the engine's own failure: see the docstring
        name = {"flex": "flex_attention", "varlen": "varlen_attn"}.get(choice.engine,
                                                                       choice.engine)
        if have.limit_errors and isinstance(error, have.limit_errors):
            limit = recompile_limit(have)
            reason = (f"dynamo's recompile limit (torch._dynamo.config.{have.limit_name} = "
                      f"{limit}) is reached for mmattn's compiled {name}: this call ran "
                      "mmattn's own kernel")
            _warn_once(("limit", choice.engine, call), f"mmattn: {reason} (and will for "
                       "calls like it that need another graph; raise the limit to compile "
                       "more)")
            return None, Choice("fallback", reason)
        if forced() is not None:
            raise
        text = _error_text(error)
        with _LOCK:
            _FAILED[choice.engine, call] = text
        _warn_once(("failed", choice.engine, call), (
            f"mmattn: the {choice.engine} engine ({name}) raised {text}; this call and calls "
            f"like it ({call.kind}, {str(call.dtype)[6:]}, head width {call.head_dim}) run "
            "mmattn's own kernel instead. Refuse the engines with "
            "mmattn.kernels.engines.use('fallback') or MMATTN_ENGINE=fallback; force this "
            f"one with engines.use({choice.engine!r}) to see its error."))
        return None, Choice("fallback", f"{choice.engine} raised {text}")
