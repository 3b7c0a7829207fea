"""``in_proj_weight`` / ``in_proj_bias``: torch's packed names over our three projections.

Axis key: ``d`` model width, ``r`` rows of the packed projection (``3 · d``).

``nn.MultiheadAttention`` keeps one (3d, d) ``in_proj_weight`` parameter (and a (3d,)
``in_proj_bias``) and slices q, k and v out of it; we keep ``q_proj``, ``k_proj`` and
``v_proj`` (``nn.Linear`` each). Code written for torch's module reads the packed names
(torchaudio's WavLM runs ``F.linear`` on them), writes into them in place (``with
torch.no_grad(): mha.in_proj_bias.zero_()``, ``mha.in_proj_weight[:d].copy_(w)``,
``mha.in_proj_weight.data.mul_(2)``) and assigns them (``mha.in_proj_weight =
nn.Parameter(w)``, as torch's own test suite does). All three work here:

- **reading** gives a (r, d) tensor that *is* the three projections' memory: their weights
  live back to back in one buffer (packed there on the first read, by moving each
  parameter's ``.data``, which keeps the parameter objects, optimizers and hooks), and the
  tensor returned views that buffer, so an in-place write through it, a slice of it or its
  ``.data`` changes ``q_proj.weight`` ... With autograd on, it is the output of
  :class:`_Packed`, whose backward hands each projection its rows of the gradient, so code
  that trains through it trains our parameters;
- **assigning** a Parameter copies it into the three projections (cast to their dtype and
  device, as ``load_state_dict`` does) and takes over its ``requires_grad``; a shape that
  does not fit, a plain tensor (torch refuses those too) or ``None`` raise, naming the
  attribute and what to do instead.

Where the projections cannot share one buffer — under ``torch.compile`` / ``torch.export``
/ ``torch.jit.trace``, on the meta device, with parameters that are not plain
``nn.Parameter`` s (parametrized, functional calls) or that view someone else's buffer
(FSDP's flat parameter), or of different dtypes or devices — a read is a fresh
``torch.cat``: it computes and trains the same, but a write into it changes nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__: list[str] = []

_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
#: torch's packed names -> the attribute of each projection they pack.
PACKED = {"in_proj_weight": "weight", "in_proj_bias": "bias"}
#: torch's names for the separate layout -> our projection.
SEPARATE = {"q_proj_weight": "q_proj", "k_proj_weight": "k_proj", "v_proj_weight": "v_proj"}
#: every name :func:`assign` handles (``TorchInterop.__setattr__`` routes them here).
ASSIGNABLE = frozenset(PACKED) | frozenset(SEPARATE)


class _Packed(torch.autograd.Function):
    """The packed view of q/k/v parts that share one buffer; backward splits the gradient."""

    @staticmethod
    def forward(ctx, *parts: Tensor) -> Tensor:  # noqa: D102 - torch's protocol
        ctx.sizes = [p.shape[0] for p in parts]
        return _alias(parts)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, ...]:  # noqa: D102
        return grad.split(ctx.sizes)


def read(module: nn.Module, attr: str) -> Tensor:
    """``cat(q_proj.<attr>, k_proj.<attr>, v_proj.<attr>)``, as a view that writes through.

    The caller decides whether torch would have the attribute at all (None otherwise).
    """
    parts = tuple(getattr(getattr(module, name), attr) for name in _PROJECTIONS)
    if not _may_alias(parts):
        return torch.cat(parts)
    if not _one_buffer(parts):
        if not _own_buffers(parts):
            return torch.cat(parts)
        _pack(parts)
    if torch.is_grad_enabled() and any(p.requires_grad for p in parts):
        return _Packed.apply(*parts)
    return _alias(parts)


def _may_alias(parts: tuple[Tensor, ...]) -> bool:
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    first = parts[0]
    return all(
        type(p) is nn.Parameter and p.dtype == first.dtype and p.device == first.device
        for p in parts
    ) and first.device.type != "meta"


def _one_buffer(parts: tuple[Tensor, ...]) -> bool:
    """True when the parts lie back to back, in order, in one contiguous buffer."""
    storage = parts[0].untyped_storage().data_ptr()
    offset = parts[0].storage_offset()
    for part in parts:
        if (
            not part.is_contiguous() or part.untyped_storage().data_ptr() != storage
            or part.storage_offset() != offset
        ):
            return False
        offset += part.numel()
    return True


def _own_buffers(parts: tuple[Tensor, ...]) -> bool:
    """True when each part is alone in its own storage (safe to move into a shared one)."""
    seen = set()
    for part in parts:
        storage = part.untyped_storage()
        if (
            not part.is_contiguous() or part.storage_offset() != 0
            or storage.nbytes() != part.numel() * part.element_size()
            or storage.data_ptr() in seen
        ):
            return False
        seen.add(storage.data_ptr())
    return True


def _pack(parts: tuple[Tensor, ...]) -> None:
    """Move the parts' values into one buffer; each parameter object keeps its identity."""
    with torch.no_grad():
        buffer = torch.cat([p.detach() for p in parts])
    for part, rows in zip(parts, buffer.split([p.shape[0] for p in parts])):
        part.data = rows


def _alias(parts: tuple[Tensor, ...]) -> Tensor:
    """A plain tensor over the parts' shared buffer (not an autograd view of any of them)."""
    first = parts[0]
    rows = sum(p.shape[0] for p in parts)
    with torch.no_grad():
        return first.new_empty(0).set_(
            first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]),
            first.stride(),
        )


# ---------------------------------------------------------------------- assignment


def assign(module: nn.Module, name: str, value: object) -> None:
    """``module.<name> = value`` for torch's names of the in-projection (see the module doc).

    Raises:
        TypeError: ``value`` is a tensor but not an ``nn.Parameter`` (as torch), or not a
            tensor at all.
        ValueError: ``value`` has another shape than the attribute.
        AttributeError: ``value`` is None while the projections exist, or the attribute does
            not exist here (torch has no packed weight for these widths or heads).
    """
    cls = type(module).__name__
    current = getattr(module, name)
    if name in PACKED:
        attr = PACKED[name]
        targets = [getattr(getattr(module, n), attr) for n in _PROJECTIONS]
        where = " / ".join(f"{n}.{attr}" for n in _PROJECTIONS)
    else:
        targets = [getattr(module, SEPARATE[name]).weight]
        where = f"{SEPARATE[name]}.weight"
    if value is None:
        if current is None:
            return  # nothing to remove, as on torch's module
        raise AttributeError(
            f"{cls}.{name} cannot be set to None: it packs {where}, which the module needs; "
            f"assign an nn.Parameter of shape {tuple(current.shape)} or write into {where}"
        )
    if current is None:
        layout = (
            "grouped-query heads have no packed projection"
            if getattr(module, "num_kv_heads", None) != getattr(module, "num_heads", None)
            else "kdim or vdim differ from embed_dim, so torch has q_proj_weight / "
            "k_proj_weight / v_proj_weight instead"
        )
        raise AttributeError(
            f"{cls}.{name} does not exist for this module ({layout}); assign "
            f"q_proj_weight / k_proj_weight / v_proj_weight, or write into {where}"
        )
    if not isinstance(value, Tensor):
        raise TypeError(
            f"cannot assign {type(value).__name__} as {cls}.{name} (torch.nn.Parameter or None "
            "expected)"
        )
    if not isinstance(value, nn.Parameter):
        raise TypeError(
            f"cannot assign {value.type()} as {cls}.{name} (torch.nn.Parameter or None "
            f"expected, as on nn.MultiheadAttention); wrap it: nn.Parameter(tensor)"
        )
    if value.shape != current.shape:
        raise ValueError(
            f"{cls}.{name} must have shape {tuple(current.shape)} (it packs {where}), got "
            f"{tuple(value.shape)}"
        )
    with torch.no_grad():
        for target, part in zip(targets, value.split([t.shape[0] for t in targets])):
            target.copy_(part)
    for target in targets:
        target.requires_grad_(value.requires_grad)
