"""Rotary position encoding (RoPE, Su et al., RoFormer), "rotate half" layout, on one axis
or on several (Qwen2-VL's multi-modal RoPE).

Axis key: ``b`` batch, ``h`` heads, ``l`` sequence length, ``e`` the rotated width (a head's
width), ``f = e / 2`` frequency pairs, ``a`` position axes (time, row, column).

Position ``p`` rotates the pair of columns ``(i, i + e/2)`` of a query or key by the angle
:math:`\\theta_{p,i} = p \\cdot base^{-2i/e}`. Rotating both queries and keys makes
:math:`\\langle q_m, k_n \\rangle` depend only on :math:`m - n`.

:class:`RotaryEmbedding` is the module an attention class takes as ``position=``: it is
called as ``position(x, offset)`` on head-split queries and keys, ``offset`` being the
position of the first row (the cache length while decoding). ``offset`` may be an int or a
0-D integer tensor, so a compiled decoder does not recompile for every new position, or a
(B, L) tensor of per-token positions (``forward(..., positions=)`` of the attention layers).

:class:`MultiAxisRotary` gives each axis of a (B, L, A) position tensor its own share of the
frequency pairs (``sections``), so a video token at (frame, row, column) is rotated by all
three; :func:`mrope_positions` lays such positions out for a fused sequence of text, images
and video, as transformers' Qwen2-VL does. Everything here is re-exported by
:mod:`mmattn.position`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from mmattn._checks import (
    check_floating,
    check_index,
    check_last_dim,
    check_positive_int,
    check_same_device,
    is_integer_dtype,
)
from mmattn._mrope import mrope_positions

__all__ = [
    "MultiAxisRotary",
    "RotaryEmbedding",
    "apply_rotary",
    "mrope_positions",
    "resolve_position",
    "rotary_cos_sin",
]


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
    angles = pos[:, None] * inverse_frequencies(dim, base, device)  # (l, f)
    return _cos_sin(angles, dtype or torch.get_default_dtype())


def inverse_frequencies(dim: int, base: float, device: torch.device | str | None) -> Tensor:
    r"""(dim / 2,) float32: :math:`1 / base^{2i/e}`, written as transformers writes it (so
    the angles, and the rotations, are the very same floats as its RoPE's)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))


def _cos_sin(angles: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(..., f) angles -> cos and sin (..., 2f) in the rotate-half layout, as ``dtype``."""
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _check_positions(
    positions: Tensor, x: Tensor, axes: int | None, owner: str, name: str = "positions"
) -> Tensor:
    """Per-token positions for ``x`` (..., L, e): (L,) or (B, L) for one axis (``axes``
    None), (L, A) or (B, L, A) for ``axes`` = A; integer or floating, on ``x``'s device.
    Returns them as float32 (the angles are computed in float32, as transformers does).
    Errors call the argument ``name``."""
    if positions.dtype == torch.bool or not (
        positions.is_floating_point() or is_integer_dtype(positions.dtype)
    ):
        raise TypeError(f"{name} must hold integers or floats, got {positions.dtype}")
    check_same_device(name, positions, "x", x)
    tail = () if axes is None else (axes,)
    length = x.shape[-2]
    shared = (length, *tail)
    batched = (x.shape[0], length, *tail)
    want = "(L,) or (B, L)" if axes is None else "(L, A) or (B, L, A)"
    shape = tuple(positions.shape)
    if shape != shared and not (x.dim() == 4 and shape == batched):
        raise ValueError(
            f"{name} for {owner} must have shape {want}={shared} or {batched} (for x of "
            f"shape (B, H, L, e)={tuple(x.shape)}), got {shape}"
        )
    return positions.to(torch.float32)


def _check_x(x: object, dim: int, what: str) -> None:
    """Raise unless ``x`` is a floating (..., L, dim) tensor (``what`` names ``dim``)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    check_floating("x", x)
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dims (..., L, {what}), got {tuple(x.shape)}")
    check_last_dim("x", x, dim, what)


def _at_offset(x: Tensor, dim: int, base: float, offset: int | Tensor) -> Tensor:
    """``x`` (..., L, dim) rotated at positions ``offset, offset + 1, ...``."""
    cos, sin = rotary_cos_sin(
        x.shape[-2], dim, base=base, offset=offset, device=x.device, dtype=x.dtype
    )
    return apply_rotary(x, cos, sin)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x`` rotated by per-token tables: (L, e) broadcast, or (B, L, e) over the heads."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]  # (b, 1, l, e) against x (b, h, l, e)
    return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)


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
    return _rotate(x, cos, sin)


class RotaryEmbedding(nn.Module):
    """Rotary position encoding applied to queries or keys (no parameters).

    Give one to an attention class as ``position=RotaryEmbedding(head_dim)`` (or
    ``position="rotary"``): it rotates the head-split queries and keys, with ``offset`` =
    the number of tokens already cached when decoding, or at the per-token positions given
    to the layer as ``forward(..., positions=)`` (a (B, L) tensor: padded or packed
    sequences whose tokens do not sit at 0, 1, 2, ...).

    Args:
        dim: rotated width (the head width), even.
        base: the wavelength base (> 0, != 1).

    Shape:
        - x: (..., L, dim), e.g. (B, H, L, dim)
        - offset: int >= 0 or a 0-D integer tensor, the position of row 0; or per-token
          positions (L,), or (B, L) for x (B, H, L, dim), integer or floating
        - Output: same as ``x``

    Raises:
        TypeError / ValueError: ``dim`` not a positive even int; bad ``base``; in
            ``forward``: ``x`` not a floating (..., L, dim) tensor; bad ``offset`` (or one
            on another device than ``x``, a CPU tensor aside); per-token positions of
            another shape than (L,) / (B, L).

    Examples:
        >>> rope = RotaryEmbedding(8)
        >>> rope(torch.randn(2, 4, 5, 8), offset=3).shape
        torch.Size([2, 4, 5, 8])
        >>> at = torch.tensor([[0, 1, 2, 7, 8], [4, 5, 6, 7, 8]])  # per-token positions
        >>> torch.allclose(rope(torch.ones(2, 4, 5, 8), at)[1], rope(torch.ones(4, 5, 8), 4))
        True
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
        _check_x(x, self.dim, "dim")
        if isinstance(offset, Tensor) and offset.dim() > 0:  # per-token positions
            positions = _check_positions(
                offset, x, None, "RotaryEmbedding", "offset (per-token positions)"
            )
            angles = positions[..., None] * inverse_frequencies(self.dim, self.base, x.device)
            return _rotate(x, *_cos_sin(angles, x.dtype))
        return _at_offset(x, self.dim, self.base, offset)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}"


class MultiAxisRotary(nn.Module):
    r"""Rotary positions on several axes at once: Qwen2-VL's multi-modal RoPE (M-RoPE).

    The ``e / 2`` frequency pairs of a head, :math:`\omega_i = base^{-2i/e}` as in
    :class:`RotaryEmbedding`, are cut into consecutive chunks of ``sections[a]`` pairs; the
    pairs of chunk ``a`` turn with axis ``a`` of the token's position:

    .. math:: \theta_{l,i} = p_{l,\,a(i)} \, \omega_i, \qquad
        a(i) = a \text{ for } \textstyle\sum_{a' < a} s_{a'} \le i < \sum_{a' \le a} s_{a'}

    and pair ``i`` rotates columns ``(i, i + e/2)`` (rotate-half layout). With
    ``sections=(16, 24, 24)`` and positions (time, row, column) this is exactly
    transformers' ``Qwen2VLRotaryEmbedding`` with ``mrope_section=[16, 24, 24]`` followed
    by ``apply_multimodal_rotary_pos_emb``. A token whose axes all hold the same position p
    is rotated exactly as :class:`RotaryEmbedding` rotates position p, so text keeps 1-D
    RoPE; :func:`mrope_positions` lays out such positions for fused text, images and video.

    Give it to an attention layer as ``position=MultiAxisRotary(head_dim, sections)`` and
    the positions as ``forward(..., positions=)`` (blocks pass ``Tokens.meta["positions"]``).
    Called with an int (or 0-D tensor) offset instead, every axis holds ``offset + l``:
    text positions, the same numbers as :class:`RotaryEmbedding`.

    Args:
        head_dim: rotated width ``e`` (the head width), even.
        sections: frequency pairs per axis, positive, summing to ``head_dim / 2``
            (Qwen2-VL's ``mrope_section``).
        base: the wavelength base (> 0, != 1).

    Attributes:
        num_axes: ``A = len(sections)``, the last dimension of the positions.

    Shape:
        - x: (B, H, L, e), or (..., L, e) with positions shared by the batch
        - positions: (B, L, A) or (L, A), integer or floating; or an int / 0-D tensor
          offset
        - Output: same as ``x``

    Raises:
        TypeError / ValueError: ``head_dim`` not a positive even int; ``sections`` not
            positive ints summing to ``head_dim / 2``; bad ``base``; in ``forward``: ``x``
            not a floating (..., L, e) tensor; ``positions`` of another shape, dtype or
            device (the message gives the expected and the actual shape).

    Examples:
        >>> rope = MultiAxisRotary(16, sections=(2, 3, 3))
        >>> x = torch.randn(2, 4, 6, 16)
        >>> positions = torch.randint(0, 9, (2, 6, 3))  # (time, row, column) per token
        >>> rope(x, positions).shape
        torch.Size([2, 4, 6, 16])
        >>> text = torch.arange(6).expand(2, 3, 6).transpose(1, 2)  # every axis at l
        >>> torch.allclose(rope(x, text), RotaryEmbedding(16)(x))
        True
    """

    def __init__(self, head_dim: int, sections: Sequence[int], base: float = 10000.0) -> None:
        super().__init__()
        check_positive_int("head_dim", head_dim)
        _check_even("head_dim", head_dim)
        if isinstance(sections, (str, bytes)) or not isinstance(sections, Sequence) or not (
            sections
        ):
            raise TypeError(
                f"sections must be a non-empty sequence of ints (frequency pairs per axis), "
                f"got {sections!r}"
            )
        sections = tuple(
            check_positive_int(f"sections[{a}]", count) for a, count in enumerate(sections)
        )
        if sum(sections) != head_dim // 2:
            raise ValueError(
                f"sections must sum to head_dim / 2 = {head_dim // 2} (one entry per frequency "
                f"pair), got {sections} (sum {sum(sections)})"
            )
        self.dim = head_dim
        self.sections = sections
        self.num_axes = len(sections)
        self.base = _check_base(base)
        # (f,) the axis each frequency pair turns with; an integer buffer, so it follows the
        # module's device and is never cast by .to(dtype); not in the state_dict
        axis = torch.repeat_interleave(torch.arange(self.num_axes), torch.tensor(sections))
        self.register_buffer("axis_index", axis, persistent=False)

    def reset_parameters(self) -> None:
        """Nothing to reset: the angles are fixed."""

    def forward(self, x: Tensor, positions: Tensor | int = 0) -> Tensor:
        _check_x(x, self.dim, "head_dim")
        if not isinstance(positions, Tensor) or positions.dim() == 0:  # an offset: text
            return _at_offset(x, self.dim, self.base, positions)
        positions = _check_positions(positions, x, self.num_axes, "MultiAxisRotary")
        axis = self.axis_index.to(x.device)  # a no-op where the module already lives
        angles = positions[..., axis] * inverse_frequencies(self.dim, self.base, x.device)
        return _rotate(x, *_cos_sin(angles, x.dtype))

    def extra_repr(self) -> str:
        return f"head_dim={self.dim}, sections={self.sections}, base={self.base}"


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
