"""``replace_attention``: swap every ``nn.MultiheadAttention`` of a model for ours, in place.

Weights are kept and what would route around the new module is turned off. It lives apart
from :mod:`mmattn.attention._interop` (the helpers :class:`~mmattn.MultiHeadAttention`
itself uses) so that imports go one way: ``integrations -> attention -> attention._interop``.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
from collections.abc import Callable

from torch import nn
from torch.nn.utils import parametrize

from mmattn._helpers import default
from mmattn.attention.mha import MultiHeadAttention
from mmattn.integrations._slots import module_slots

__all__ = ["replace_attention"]


def replace_attention(
    model: nn.Module,
    factory: Callable[[nn.MultiheadAttention], nn.Module] | None = None,
) -> int:
    """Replace every ``nn.MultiheadAttention`` inside ``model`` by an mmattn module, in place.

    Each one becomes ``MultiHeadAttention.from_torch(m)`` (same weights, same settings, same
    outputs), or ``factory(m)`` when given, e.g. a variant that takes over the projection
    weights. The new module keeps the old one's device, dtype and train/eval mode. Ties are
    kept: a module that appears in several slots (shared by several parents, or twice in one
    ``nn.ModuleList([a, a])``) is replaced by one new module, put in every slot where it
    appeared, and the factory is called once for it. Modules that are already mmattn ones are
    left alone. A module is skipped with a warning naming it and the reason where the swap
    would change what the model computes or trains: a subclass that overrides ``forward``
    (its behaviour is not torch's), a parametrized module, parameters shared with another
    module (the swap would untie them), and, with a ``factory``, a parent that reads
    ``in_proj_weight`` and attends by itself (torchaudio's ``WavLMSelfAttention``: the
    factory's module would never run; the default swap gives the same numbers there, as
    ``in_proj_weight``/``in_proj_bias`` are views of our projections). Hooks registered on
    an old module are not carried over (a warning says so). Finally every
    ``nn.TransformerEncoder`` gets ``use_nested_tensor = False``, so its inference fast path
    does not convert the batch to a NestedTensor around our module (our module would accept
    it, but padding and the key padding mask are faster).

    When timm is loaded, every ``timm.layers.Attention`` is swapped too, for
    :class:`mmattn.integrations.timm.Attention` (same submodules and parameters, so a timm
    state_dict still loads with ``strict=True``; see
    :func:`~mmattn.integrations.timm.replace_timm_attention`); ``factory`` applies to
    ``nn.MultiheadAttention`` modules only.

    Args:
        model: any ``nn.Module``; it is modified in place.
        factory: ``factory(m) -> nn.Module`` called with each ``nn.MultiheadAttention``; it
            must return a module with the same ``embed_dim`` (and ``batch_first``, if it has
            one). Default: ``MultiHeadAttention.from_torch``.

    Returns:
        How many distinct modules were replaced, timm ones included (a tied module counts
        once, however many slots hold it; 0 when there are none).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``factory`` is not callable or returned
            something that is not an ``nn.Module`` (the message names the submodule).
        ValueError: ``model`` is itself an ``nn.MultiheadAttention`` or a timm ``Attention``
            (there is no parent to put the new one in: use ``from_torch`` / ``from_timm``);
            the factory's module has another ``embed_dim`` or ``batch_first`` (the message
            names the submodule).

    Examples:
        >>> layer = nn.TransformerEncoderLayer(16, 4, batch_first=True)
        >>> encoder = nn.TransformerEncoder(layer, num_layers=2)
        >>> replace_attention(encoder)
        2
        >>> type(encoder.layers[0].self_attn).__name__
        'MultiHeadAttention'
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if factory is not None and not callable(factory):
        raise TypeError(f"factory must be callable or None, got {type(factory).__name__}")
    if isinstance(model, nn.MultiheadAttention) and not isinstance(model, MultiHeadAttention):
        raise ValueError(
            "model is itself an nn.MultiheadAttention and cannot be replaced in place; "
            "use MultiHeadAttention.from_torch(model)"
        )
    build = default(factory, MultiHeadAttention.from_torch)
    replaced: dict[int, nn.Module] = {}
    skipped: set[int] = set()
    for parent_name, parent, name, child in module_slots(model):  # every slot: ties kept
        if not _is_torch_attention(child, MultiHeadAttention):
            continue
        path = f"{parent_name}.{name}" if parent_name else name
        reason = _cannot_swap(child, parent, model, custom=factory is not None)
        if reason is not None:
            if id(child) not in skipped:
                skipped.add(id(child))
                warnings.warn(f"replace_attention skipped {path}: {reason}", stacklevel=2)
            continue
        if id(child) not in replaced and _has_hooks(child):
            warnings.warn(
                f"replace_attention: the hooks registered on {path} are not carried over "
                "to the new module; register them again on it",
                stacklevel=2,
            )
        if id(child) not in replaced:
            replaced[id(child)] = _build(build, child, path, custom=factory is not None)
        setattr(parent, name, replaced[id(child)])
    count = len(replaced)
    if sys.modules.get("timm") is not None:  # a timm module exists only once timm is loaded
        from mmattn.integrations.timm import replace_timm_attention

        count += replace_timm_attention(model)
    if sys.modules.get("torchvision.models.swin_transformer") is not None:
        from mmattn.integrations.torchvision import replace_torchvision_attention

        count += replace_torchvision_attention(model)
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoder):
            module.use_nested_tensor = False
    return count


def _cannot_swap(
    child: nn.MultiheadAttention, parent: nn.Module, model: nn.Module, custom: bool
) -> str | None:
    """Why swapping ``child`` would change what ``model`` computes or trains (None: it
    would not)."""
    name = type(child).__name__
    if type(child).forward is not nn.MultiheadAttention.forward:
        return f"{name} overrides nn.MultiheadAttention.forward"
    if any(parametrize.is_parametrized(m) for m in child.modules()):
        return "it is parametrized (torch.nn.utils.parametrize); the swap would freeze its value"
    own = {id(p) for p in child.parameters()}
    shared = [
        f"{m_name}.{p_name}" if m_name else p_name
        for m_name, module in model.named_modules(remove_duplicate=False)
        if not any(m is module for m in child.modules())
        for p_name, p in module.named_parameters(recurse=False)
        if id(p) in own
    ]
    if shared:
        return f"its parameters are shared with {', '.join(shared)}; the swap would untie them"
    if custom and _reads_in_proj(type(parent)):
        return (
            f"{type(parent).__name__} reads its in_proj_weight / in_proj_bias and computes "
            "the attention itself, so the factory's module would never run"
        )
    return None


def _has_hooks(module: nn.Module) -> bool:
    return any(getattr(module, attr) for attr in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
    ))


@functools.cache
def _reads_in_proj(cls: type) -> bool:
    """Whether ``cls``'s source reads ``.in_proj_weight``/``.in_proj_bias`` of a child
    (torchaudio's WavLMSelfAttention does); False when the source is not available."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return False
    return ".in_proj_weight" in source or ".in_proj_bias" in source


def _is_torch_attention(module: nn.Module, ours: type) -> bool:
    return isinstance(module, nn.MultiheadAttention) and not isinstance(module, ours)


def _build(
    build: Callable[[nn.MultiheadAttention], nn.Module],
    old: nn.MultiheadAttention,
    path: str,
    custom: bool,
) -> nn.Module:
    new = build(old)
    if not custom:
        return new
    if not isinstance(new, nn.Module):
        raise TypeError(
            f"factory must return an nn.Module, got {type(new).__name__} for {path!r}"
        )
    embed_dim = getattr(new, "embed_dim", None)
    if embed_dim != old.embed_dim:
        raise ValueError(
            f"factory must return a module with embed_dim={old.embed_dim} for {path!r}, "
            f"got {type(new).__name__} with embed_dim={embed_dim}"
        )
    batch_first = getattr(new, "batch_first", old.batch_first)
    if batch_first != old.batch_first:
        raise ValueError(
            f"factory must return a module with batch_first={old.batch_first} for {path!r} "
            f"(the model passes its inputs in that layout), got batch_first={batch_first}"
        )
    weight = old.out_proj.weight
    return new.to(device=weight.device, dtype=weight.dtype).train(old.training)
