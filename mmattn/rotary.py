"""Rotary position encoding (RoPE, Su et al., RoFormer), "rotate half" layout.

Axis key: ``b`` batch, ``h`` heads, ``l`` sequence length, ``e`` the rotated width (a head's
width).

Position ``p`` rotates the pair of columns ``(i, i + e/2)`` of a query or key by the angle
:math:`\\theta_{p,i} = p \\cdot base^{-2i/e}`. Rotating both queries and keys makes
:math:`\\langle q_m, k_n \\rangle` depend only on :math:`m - n`.

:class:`RotaryEmbedding` is the module an attention class takes as ``position=``: it is
called as ``position(x, offset)`` on head-split queries and keys, ``offset`` being the
position of the first row (the cache length while decoding). ``offset`` may be an int or a
0-D integer tensor, so a compiled decoder does not recompile for every new position.
Everything here is re-exported by :mod:`mmattn.position`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from mmattn._checks import (
    check_floating,
    check_index,
    check_last_dim,
    check_positive_int,
    check_same_device,
)

__all__ = ["RotaryEmbedding", "apply_rotary", "resolve_position", "rotary_cos_sin"]


def _check_even(name: str, value: int) -> None:
    if value % 2:
        raise ValueError(f"{name} must be divisible by 2, got {value}")


def _check_base(base: object) -> float:
    if isinstance(base, bool) or not isinstance(base, (int, float)):
        raise TypeError(f"base must be a number > 0, got {type(base).__name__} ({base!r})")
    if not base > 0 or base == 1:
        raise ValueError(f"base must be a number > 0 and != 1, got {base}")
    return float(base)


def _check_offset(
    offset: object, device: torch.device | str | None
) -> tuple[int | Tensor, torch.device | str | None]:
    """An int >= 0, or a 0-D integer tensor (its value is not read, so compile stays quiet),
    and the device to build on: a tensor offset's own when none is given. A 0-D CPU tensor
    goes with any device (as in torch); one on another device raises ValueError."""
    offset = check_index("offset", offset)
    if isinstance(offset, Tensor):
        if device is None:
            return offset, offset.device
        target = torch.device(device)
        same = offset.device.type == target.type and (
            target.index is None or offset.device.index == target.index  # "cuda" = "cuda:0"
        )
        if offset.device.type != "cpu" and not same:
            raise ValueError(
                f"offset is on device {offset.device} but the positions are built on "
                f"{target}; move the offset (or pass an int)"
            )
    return offset, device


def rotary_cos_sin(
    length: int,
    dim: int,
    *,
    base: float = 10000.0,
    offset: int | Tensor = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Cosines and sines of the rotary angles :math:`\theta_{p,i} = p \cdot base^{-2i/e}`.

    Laid out for the "rotate half" convention: the angle of pair ``i`` sits at columns ``i``
    and ``i + e/2``.

    Args:
        length: number of positions (0 gives empty tables).
        dim: rotated width ``e`` (even), usually the head width.
        base: the wavelength base (> 0, != 1).
        offset: first position: an int >= 0 or a 0-D integer tensor (on ``device``, or a
            CPU tensor).
        device: where to build them (default: the tensor offset's device, else torch's).
        dtype: dtype of the result.

    Shape:
        - Output: two tensors (length, dim)

    Raises:
        TypeError: ``length``, ``dim`` or ``offset`` is not an int (or ``offset`` not a 0-D
            integer tensor); ``base`` is not a number.
        ValueError: ``dim`` is odd; ``length`` < 0; ``offset`` < 0 or a tensor on another
            device; ``base`` <= 0 or 1.

    Examples:
        >>> cos, sin = rotary_cos_sin(5, 8)
        >>> cos.shape, sin.shape
        (torch.Size([5, 8]), torch.Size([5, 8]))
    """
    check_positive_int("length", length, minimum=0)
    check_positive_int("dim", dim)
    _check_even("dim", dim)
    base = _check_base(base)
    offset, device = _check_offset(offset, device)
    pos = torch.arange(length, device=device, dtype=torch.float32) + offset
    inv_freq = base ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    angles = torch.outer(pos, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)  # (l, e)
    dtype = dtype or torch.get_default_dtype()
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    r"""Rotate pairs ``(x_i, x_{i+e/2})`` by the angles given as ``cos``/``sin``.

    .. math:: \mathrm{rot}(x) = x \cos\theta + \mathrm{rotate\_half}(x) \sin\theta

    Rotating queries and keys this way makes :math:`\langle q_m, k_n \rangle` depend only on
    :math:`m - n`.

    Args:
        x: queries or keys.
        cos: from :func:`rotary_cos_sin`, broadcast over the leading axes of ``x``.
        sin: same.

    Shape:
        - x: (..., L, e)
        - cos, sin: (L, e)
        - Output: same as ``x``

    ``cos``/``sin`` are cast to ``x``'s dtype (fp32 tables rotate fp16 queries).

    Raises:
        TypeError: ``x``, ``cos`` or ``sin`` is not a floating-point tensor.
        ValueError: ``x`` has fewer than 2 dims or an odd last dim; ``cos``/``sin`` do not
            have shape (L, e) or are on another device than ``x``.

    Examples:
        >>> cos, sin = rotary_cos_sin(5, 8)
        >>> apply_rotary(torch.randn(2, 4, 5, 8), cos, sin).shape
        torch.Size([2, 4, 5, 8])
    """
    for name, value in (("x", x), ("cos", cos), ("sin", sin)):
        if not isinstance(value, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        check_floating(name, value)
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dims (..., L, e), got shape {tuple(x.shape)}")
    _check_even("x.shape[-1]", x.shape[-1])
    want = tuple(x.shape[-2:])
    for name, table in (("cos", cos), ("sin", sin)):
        if tuple(table.shape) != want:
            raise ValueError(f"{name} must have shape (L, e)={want}, got {tuple(table.shape)}")
        check_same_device(name, table, "x", x)
    return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position encoding applied to queries or keys (no parameters).

    Give one to an attention class as ``position=RotaryEmbedding(head_dim)`` (or
    ``position="rotary"``): it rotates the head-split queries and keys, with ``offset`` =
    the number of tokens already cached when decoding.

    Args:
        dim: rotated width (the head width), even.
        base: the wavelength base (> 0, != 1).

    Shape:
        - x: (..., L, dim), e.g. (B, H, L, dim)
        - offset: int >= 0 or a 0-D integer tensor, the position of row 0
        - Output: same as ``x``

    Raises:
        TypeError / ValueError: ``dim`` not a positive even int; bad ``base``; in
            ``forward``: ``x`` not a floating (..., L, dim) tensor; bad ``offset`` (or one
            on another device than ``x``, a CPU tensor aside).

    Examples:
        >>> rope = RotaryEmbedding(8)
        >>> rope(torch.randn(2, 4, 5, 8), offset=3).shape
        torch.Size([2, 4, 5, 8])
    """

    def __init__(self, dim: int, *, base: float = 10000.0) -> None:
        super().__init__()
        check_positive_int("dim", dim)
        _check_even("dim", dim)
        self.dim = dim
        self.base = _check_base(base)

    def reset_parameters(self) -> None:
        """Nothing to reset: the angles are fixed."""

    def forward(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        check_floating("x", x)
        if x.dim() < 2:
            raise ValueError(f"x must have at least 2 dims (..., L, dim), got {tuple(x.shape)}")
        check_last_dim("x", x, self.dim, "dim")
        cos, sin = rotary_cos_sin(
            x.shape[-2], self.dim, base=self.base, offset=offset, device=x.device, dtype=x.dtype
        )
        return apply_rotary(x, cos, sin)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}"


def resolve_position(
    position: nn.Module | Callable[..., Tensor] | str | None, head_dim: int
) -> nn.Module | Callable[..., Tensor] | None:
    """The ``position=`` argument as a callable ``position(x, offset)`` (or None).

    ``"rotary"`` builds :class:`~mmattn.rotary.RotaryEmbedding` of the head width. A module
    with a ``dim`` attribute must rotate exactly ``head_dim`` columns.

    Raises:
        TypeError: not None, "rotary" or a callable.
        ValueError: an unknown name; a width that is not ``head_dim``; an odd ``head_dim``
            for a rotary encoding.
    """
    if position is None:
        return None
    if isinstance(position, str):
        if position != "rotary":
            raise ValueError(f"position must be 'rotary' or a module, got {position!r}")
        if head_dim % 2:
            raise ValueError(
                f"position='rotary' needs an even head width (embed_dim // num_heads), got "
                f"head_dim={head_dim}"
            )
        return RotaryEmbedding(head_dim)
    if not callable(position):
        raise TypeError(
            f"position must be a module called as position(x, offset), 'rotary' or None, got "
            f"{type(position).__name__}"
        )
    width = getattr(position, "dim", head_dim)
    if width != head_dim:
        raise ValueError(
            f"position must act on the head width head_dim={head_dim} (embed_dim // "
            f"num_heads), got {type(position).__name__} with dim={width}"
        )
    return position
