"""The score-modifier arguments every attention layer takes: ``sinks=``, ``softcap=``, ``alibi=``.

Axis key: ``h`` query heads, ``i`` query rows, ``j`` key columns.

``MultiHeadAttention.__init__`` hands its three keyword arguments to :func:`init_modifiers`
(checks, the ``sinks`` parameter, the ``alibi_slopes`` buffer); each call's kernel gets
:func:`score_modifiers` (a :class:`~mmattn.kernels.modifiers.Modifiers`), and a decoding step
gets the positions of its queries and cached keys from :func:`step_modifiers`. The math is
in :mod:`mmattn.kernels.modifiers`; docs/variants.md ("Score modifiers") has the formulas.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from mmattn import _checks as checks
from mmattn.cache import ChunkCache, ContextCache, KVCache, LocalKVCache
from mmattn.kernels.modifiers import Modifiers, alibi_slopes, sequence_positions


def init_modifiers(
    module: nn.Module,
    *,
    sinks: bool,
    softcap: float | None,
    alibi: bool,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
) -> None:
    """Check the three arguments and give ``module`` its ``sinks`` parameter (zeros, (H,)),
    ``softcap`` and the ``alibi_slopes`` buffer (not in the state dict: it is a constant).

    Raises:
        TypeError: ``sinks`` or ``alibi`` is not a bool; ``softcap`` is not a number.
        ValueError: ``softcap`` <= 0 (or not finite); ``alibi=True`` on a layer whose keys
            have no distance to the queries (the message says why), or with
            ``add_bias_kv`` / ``add_zero_attn`` (appended keys have no position); any of
            them on a variant whose ``_attention`` takes no ``modifiers`` (it would ignore
            them).
    """
    checks.check_bool("sinks", sinks)
    checks.check_bool("alibi", alibi)
    if softcap is not None:
        softcap = checks.check_number("softcap", softcap, positive=True)
    if sinks or alibi or softcap is not None:
        hook = inspect.signature(type(module)._attention).parameters
        if "modifiers" not in hook and not any(p.kind is p.VAR_KEYWORD for p in hook.values()):
            raise ValueError(
                f"{type(module).__name__} does not apply score modifiers (sinks, softcap, "
                "alibi): its _attention takes no modifiers= keyword, so it would ignore them"
            )
    if alibi:
        refusal = getattr(type(module), "alibi_refusal", None)
        if refusal is None and (module.bias_k is not None or module.add_zero_attn):
            refusal = ("the keys appended by add_bias_kv / add_zero_attn have no position, "
                       "so no distance to a query")
        if refusal is not None:
            raise ValueError(f"alibi=True is not supported by {type(module).__name__}: {refusal}")
    module.softcap = softcap
    heads = module.num_heads
    if sinks:
        module.sinks = nn.Parameter(torch.zeros(heads, device=device, dtype=dtype))
    else:
        module.register_parameter("sinks", None)
    slopes = None
    if alibi:
        slopes = torch.tensor(alibi_slopes(heads), device=device,
                              dtype=dtype or torch.get_default_dtype())
    module.register_buffer("alibi_slopes", slopes, persistent=False)


def score_modifiers(module: nn.Module) -> Modifiers | None:
    """The module's modifiers for one call (None when it has none)."""
    mods = Modifiers(
        sinks=getattr(module, "sinks", None), slopes=getattr(module, "alibi_slopes", None),
        softcap=getattr(module, "softcap", None),
    )
    return mods if mods else None


def modifier_repr(module: nn.Module) -> list[str]:
    """``extra_repr`` parts: ``sinks=True``, ``softcap=30.0``, ``alibi=True``."""
    parts = ["sinks=True"] if getattr(module, "sinks", None) is not None else []
    if getattr(module, "softcap", None) is not None:
        parts.append(f"softcap={module.softcap}")
    if getattr(module, "alibi_slopes", None) is not None:
        parts.append("alibi=True")
    return parts


def modifier_settings(module: nn.Module) -> dict:
    """The constructor arguments of a source module's modifiers (``from_torch`` of an mmattn
    module keeps them; a torch module has none)."""
    settings = {}
    if getattr(module, "sinks", None) is not None:
        settings["sinks"] = True
    if getattr(module, "softcap", None) is not None:
        settings["softcap"] = module.softcap
    if getattr(module, "alibi_slopes", None) is not None:
        settings["alibi"] = True
    return settings


def check_no_modifiers(module: nn.Module, method: str) -> None:
    """Raise NotImplementedError where torch has no twin for the module's modifiers."""
    names = modifier_repr(module)
    if names:
        raise NotImplementedError(
            f"{method} is not available with {', '.join(names)}: nn.MultiheadAttention has "
            "no score modifiers (attention sinks, soft-capping, ALiBi)"
        )


def ring_positions(cache: object) -> Tensor | None:
    """The positions a ring cache holds before this step overwrites them (else None)."""
    return cache.positions.clone() if isinstance(cache, LocalKVCache) else None


def step_modifiers(
    module: nn.Module, cache: object, new: int, keys: int, ring: Tensor | None
) -> Modifiers | None:
    """The module's modifiers for one decoding step, ALiBi measured at the step's positions.

    A :class:`~mmattn.cache.KVCache` returns keys at positions ``0 .. keys - 1`` and the new
    queries sit at the last ``new`` positions written; a :class:`~mmattn.cache.LocalKVCache`
    returns its ring (``ring``: its positions before the step) and then the new keys; a
    :class:`~mmattn.cache.ChunkCache` returns its ``left * chunk`` slots, which hold the
    tokens just before the chunk (every chunk but the last is full), and then the chunk
    (slots not filled yet sit at negative positions; the cache's mask hides them).

    Raises:
        ValueError: ALiBi with a cache whose key positions are not known here.
    """
    mods = score_modifiers(module)
    if mods is None or mods.slopes is None or isinstance(cache, ContextCache):
        return mods
    if not isinstance(cache, (KVCache, LocalKVCache, ChunkCache)):
        raise ValueError(
            f"alibi=True is not supported with a {type(cache).__name__}: its key positions "
            "are not known to the ALiBi term"
        )
    device = cache.device
    queries = sequence_positions(new, device, cache.size - new)  # size: after the update
    if isinstance(cache, KVCache):
        return mods.at(queries, sequence_positions(keys, device))
    if isinstance(cache, ChunkCache):
        return mods.at(queries, sequence_positions(keys, device, cache.size - keys))
    return mods.at(queries, torch.cat([ring[:, None], queries]))
