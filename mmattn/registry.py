"""The attention registry: names for the attention variants a block can be built with.

``TransformerBlock(attention=...)`` (and ``Encoder``, ``MultiModalEncoder``) take a
registered name, an attention class, or any callable returning a module. All three are
called the same way::

    attention(embed_dim, num_heads, dropout=dropout, bias=bias, device=device, dtype=dtype,
              **attention_kwargs)

and the module they return is called like :class:`~mmattn.MultiHeadAttention`:
``attn(x, x, x, key_padding_mask=..., attn_mask=..., is_causal=...)`` → ``(out, weights)``.

Built in: ``"full"`` (:class:`~mmattn.MultiHeadAttention`), ``"local"``
(:class:`~mmattn.LocalAttention`, needs ``window_size``), ``"additive"``
(:class:`~mmattn.AdditiveAttention`), ``"linformer"``
(:class:`~mmattn.LinformerAttention`, needs ``seq_len`` and ``proj_len``), ``"edge"``
(:class:`~mmattn.EdgeAttention`, takes ``edge_index`` from ``Tokens.meta``) and
``"neighborhood"`` (:class:`~mmattn.NeighborhoodAttention`, needs ``kernel_size``; blocks
hand it the image grid from ``Tokens.meta``). Register your own
with :func:`register_attention`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from torch import nn

from mmattn._checks import check_bool, check_meta
from mmattn.attention.additive import AdditiveAttention
from mmattn.attention.edge import EdgeAttention
from mmattn.attention.linformer import LinformerAttention
from mmattn.attention.local import LocalAttention
from mmattn.attention.mha import MultiHeadAttention
from mmattn.attention.neighborhood import NeighborhoodAttention

__all__ = ["AttentionSpec", "available_attention", "build_attention", "register_attention"]

Factory = Callable[..., nn.Module]
#: What ``attention=`` accepts: a registered name, a class, or a callable returning a module.
AttentionSpec = str | Factory
F = TypeVar("F", bound=Factory)

_REGISTRY: dict[str, Factory] = {
    "full": MultiHeadAttention,
    "local": LocalAttention,
    "additive": AdditiveAttention,
    "linformer": LinformerAttention,
    "edge": EdgeAttention,
    "neighborhood": NeighborhoodAttention,
}


def available_attention() -> list[str]:
    """The registered attention names, sorted.

    Examples:
        >>> {"full", "local", "additive", "linformer"} <= set(available_attention())
        True
    """
    return sorted(_REGISTRY)


def register_attention(
    name: str, factory: F | None = None, *, override: bool = False
) -> F | Callable[[F], F]:
    """Register ``factory`` (an attention class or a callable) under ``name``.

    Usable directly, ``register_attention("mine", MyAttention)``, or as a class decorator,
    ``@register_attention("mine")``. A taken name is compared by identity: registering the
    same object again is a no-op; another object (another lambda, a class of the same name
    from another module, a reloaded module's new class) raises, unless ``override=True``
    replaces it.

    Args:
        name: the name blocks take as ``attention=name``.
        factory: the class or callable; None for the decorator form.
        override: replace whatever ``name`` is registered for.

    Raises:
        TypeError: ``name`` is not a string, ``factory`` not callable, ``override`` not a
            bool.
        ValueError: ``name`` is empty or already taken by another object (and not
            ``override``).

    Examples:
        >>> from mmattn import MultiHeadAttention
        >>> class Mine(MultiHeadAttention):
        ...     pass
        >>> register_attention("doc-mine", Mine) is register_attention("doc-mine", Mine)
        True
        >>> _ = register_attention("doc-mine", MultiHeadAttention, override=True)
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    check_bool("override", override)

    def add(factory: F) -> F:
        if not callable(factory):
            raise TypeError(f"factory must be a class or callable, got {type(factory).__name__}")
        known = _REGISTRY.get(name)
        if known is not None and known is not factory and not override:
            raise ValueError(
                f"attention name {name!r} is already registered for {_describe(known)}, got "
                f"another object, {_describe(factory)}; pick another name, or pass "
                "override=True to replace it"
            )
        _REGISTRY[name] = factory
        return factory

    return add if factory is None else add(factory)


def _describe(factory: object) -> str:
    module = getattr(factory, "__module__", None)
    label = getattr(factory, "__qualname__", None) or _label(factory)
    return f"{module}.{label}" if module else label


def _label(factory: object) -> str:
    return getattr(factory, "__name__", type(factory).__name__)


def resolve_attention(attention: AttentionSpec) -> tuple[str, Factory]:
    """``(label, factory)`` for a name, class or callable.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
        TypeError: neither a string nor callable.
    """
    if isinstance(attention, str):
        if attention not in _REGISTRY:
            raise ValueError(
                f"attention must be one of the registered names {available_attention()} (or "
                f"an attention class or callable), got {attention!r}"
            )
        return attention, _REGISTRY[attention]
    if not callable(attention):
        raise TypeError(
            f"attention must be a registered name, a class or a callable, got "
            f"{type(attention).__name__}"
        )
    return _label(attention), attention


def build_attention(
    attention: AttentionSpec,
    embed_dim: int,
    num_heads: int,
    *,
    dropout: float = 0.0,
    bias: bool = True,
    device: Any = None,
    dtype: Any = None,
    attention_kwargs: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Build the attention module named or given by ``attention``.

    Arguments the factory does not take, and required arguments left out, raise ValueError
    naming them before anything is built. A factory whose signature names ``batch_first``
    (``nn.MultiheadAttention``) gets ``batch_first=True`` unless ``attention_kwargs`` sets
    it: blocks pass (batch, length, dim).

    Raises:
        ValueError / TypeError: unknown name; ``attention_kwargs`` not a mapping or with
            bad keys; the factory did not return an ``nn.Module``, or returned one with
            ``batch_first=False``.
    """
    label, factory = resolve_attention(attention)
    kwargs = check_meta("attention_kwargs", attention_kwargs)
    for key in kwargs:
        if not isinstance(key, str):
            raise TypeError(f"attention_kwargs keys must be strings, got {key!r}")
    _check_arguments(label, factory, kwargs)
    if "batch_first" not in kwargs and _takes(factory, "batch_first"):
        kwargs["batch_first"] = True  # nn.MultiheadAttention defaults to (L, B, D)
    module = factory(
        embed_dim, num_heads, dropout=dropout, bias=bias, device=device, dtype=dtype, **kwargs
    )
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"attention={label!r} must build an nn.Module, got {type(module).__name__}"
        )
    if getattr(module, "batch_first", True) is False:
        raise ValueError(
            f"attention={label!r} built a module with batch_first=False, but blocks pass "
            "(batch, length, dim) inputs: build it with batch_first=True"
        )
    return module


def _takes(factory: Factory, name: str) -> bool:
    """Whether ``factory``'s signature names the parameter ``name`` (not via ``**kwargs``)."""
    try:
        return name in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def _check_arguments(label: str, factory: Factory, kwargs: dict[str, Any]) -> None:
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return
    params = list(signature.parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    names = {p.name for p in params if p.kind is not p.VAR_POSITIONAL}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise ValueError(
            f"{', '.join(unknown)} is not an argument of attention={label!r}; it takes "
            f"{sorted(names - {'self'})}"
        )
    given = {"embed_dim", "num_heads", "dropout", "bias", "device", "dtype", *kwargs}
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    given |= {p.name for p in positional[:2]}  # embed_dim and num_heads, whatever their names
    missing = [
        p.name for p in params
        if p.default is p.empty and p.name not in given
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if missing:
        raise ValueError(
            f"{', '.join(missing)} must be given for attention={label!r} (in "
            f"attention_kwargs), got None"
        )
