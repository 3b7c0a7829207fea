"""Position encodings shared by the adapters and the attention blocks.

Axis key: ``b`` batch, ``l`` sequence length, ``d`` model width, ``h``/``w`` rows and columns
of a 2D grid, ``e`` the width a rotary encoding rotates (usually a head's width).

Five kinds, each a pure function plus a small module:

- sinusoidal 1D (Vaswani et al., 2017): :func:`sinusoidal_1d`,
  :class:`SinusoidalPositionalEncoding`;
- sinusoidal 2D (half the width encodes the row, half the column, as in MAE):
  :func:`sinusoidal_2d`;
- learned, 1D and 2D, the 2D table resampled to other grids with :func:`resample_2d`:
  :class:`LearnedPositionalEmbedding`, :class:`LearnedPositionalEmbedding2d`;
- rotary (Su et al., RoFormer), "rotate half" layout: :func:`rotary_cos_sin`,
  :func:`apply_rotary`, :class:`RotaryEmbedding`, and on several axes (Qwen2-VL's M-RoPE)
  :class:`MultiAxisRotary` with :func:`mrope_positions` (defined in :mod:`mmattn.rotary`,
  re-exported here);
- Swin's learned relative-position bias table, for windows and neighbourhoods:
  :class:`RelativePositionBias` (defined in :mod:`mmattn.relative_position`).

The additive modules return ``x + position``; they never change the dtype of ``x`` and take
only floating ``x``. Every length may be 0 (an empty table, ``x`` returned unchanged); grids
and widths must be >= 1; offsets are ints >= 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from mmattn._checks import (
    check_choice,
    check_dtype,
    check_factory_dtype,
    check_floating,
    check_index,
    check_last_dim,
    check_number,
    check_pair,
    check_positive_int,
    check_rank,
    check_same_device,
)
from mmattn._helpers import surely
from mmattn.relative_position import (
    RelativePositionBias,
    relative_position_bias,
    relative_position_index,
)
from mmattn.rotary import (
    MultiAxisRotary,
    RotaryEmbedding,
    apply_rotary,
    mrope_positions,
    rotary_cos_sin,
)

__all__ = [
    "LearnedPositionalEmbedding",
    "LearnedPositionalEmbedding2d",
    "MultiAxisRotary",
    "RelativePositionBias",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "apply_rotary",
    "mrope_positions",
    "position_1d",
    "relative_position_bias",
    "relative_position_index",
    "resample_2d",
    "rotary_cos_sin",
    "sinusoidal_1d",
    "sinusoidal_2d",
]

#: ``F.interpolate`` modes for a 2-D grid; only the interpolating ones take align_corners.
RESAMPLE_MODES = ("bicubic", "bilinear", "nearest", "nearest-exact", "area")
POSITIONAL_1D = ("sinusoidal", "learned", None)


def _check_even(name: str, value: int, multiple: int = 2) -> None:
    if value % multiple:
        raise ValueError(f"{name} must be divisible by {multiple}, got {value}")


def _check_grid(name: str, grid: object) -> tuple[int, int]:
    return check_pair(name, grid, what="(rows, cols)")


def _table_dtype(dtype: object) -> torch.dtype:
    if dtype is None:
        return torch.get_default_dtype()
    return check_dtype("dtype", dtype, floating=True)


def sinusoidal_1d(
    length: int,
    dim: int,
    *,
    base: float = 10000.0,
    offset: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    r"""The fixed sine/cosine table of "Attention Is All You Need".

    .. math::
        PE_{p, 2i} = \sin(p / base^{2i/d}), \qquad PE_{p, 2i+1} = \cos(p / base^{2i/d})

    for positions :math:`p = offset, \dots, offset + length - 1` (sine and cosine interleaved).
    Computed in float32, then cast to ``dtype``.

    Args:
        length: number of positions (0 gives an empty table).
        dim: encoding width, even.
        base: the wavelength base, > 0.
        offset: first position, an int >= 0.
        device: where to build the table.
        dtype: a floating dtype of the result (default: the default float dtype).

    Shape:
        - Output: (length, dim)

    Raises:
        TypeError / ValueError: ``length`` not an int >= 0, ``dim`` not a positive even int,
            ``base`` not a positive number, ``offset`` not an int >= 0, ``dtype`` not floating.

    Examples:
        >>> sinusoidal_1d(5, 8).shape
        torch.Size([5, 8])
    """
    check_positive_int("length", length, minimum=0)
    check_positive_int("dim", dim)
    _check_even("dim", dim)
    if not torch.compiler.is_compiling():  # dynamic=True traces a module's float as a SymFloat
        check_number("base", base, positive=True)
    offset = check_index("offset", offset)
    dtype = _table_dtype(dtype)
    pos = torch.arange(length, device=device, dtype=torch.float32) + offset
    inv_freq = base ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    angles = torch.outer(pos, inv_freq)  # (l, d/2)
    table = torch.stack((angles.sin(), angles.cos()), dim=-1)
    table = rearrange(table, "l half two -> l (half two)")
    return table.to(dtype)


def sinusoidal_2d(
    rows: int,
    cols: int,
    dim: int,
    *,
    base: float = 10000.0,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """2D sine/cosine table: the first half of the width encodes the row, the second the column.

    ``out[r * cols + c] = cat(sinusoidal_1d(rows, dim/2)[r], sinusoidal_1d(cols, dim/2)[c])``,
    so the rows of the result follow the row-major order of image patches.

    Args:
        rows: grid rows.
        cols: grid columns.
        dim: encoding width, divisible by 4.
        base: the wavelength base.
        device: where to build the table.
        dtype: dtype of the result.

    Shape:
        - Output: (rows * cols, dim)

    Raises:
        TypeError / ValueError: ``rows`` or ``cols`` not an int >= 0 (0 gives an empty
            table), ``dim`` not a positive int divisible by 4.

    Examples:
        >>> sinusoidal_2d(2, 3, 8).shape
        torch.Size([6, 8])
    """
    check_positive_int("rows", rows, minimum=0)
    check_positive_int("cols", cols, minimum=0)
    check_positive_int("dim", dim)
    _check_even("dim", dim, 4)
    row = sinusoidal_1d(rows, dim // 2, base=base, device=device, dtype=dtype)
    col = sinusoidal_1d(cols, dim // 2, base=base, device=device, dtype=dtype)
    row = rearrange(row, "h d -> h 1 d").expand(rows, cols, dim // 2)
    col = rearrange(col, "w d -> 1 w d").expand(rows, cols, dim // 2)
    return rearrange(torch.cat((row, col), dim=-1), "h w d -> (h w) d")


def resample_2d(
    table: Tensor,
    old_grid: tuple[int, int],
    new_grid: tuple[int, int],
    *,
    mode: str = "bicubic",
) -> Tensor:
    """Resample a (rows * cols, dim) position table to another grid by interpolation.

    Used when an image is larger or smaller than the size a learned table was built for
    (as timm's ``resample_abs_pos_embed``). The grid is treated as an image with ``dim``
    channels and interpolated with ``F.interpolate(mode, align_corners=False)``, in float32.

    Args:
        table: the table, row-major.
        old_grid: (rows, cols) of ``table``.
        new_grid: the wanted (rows, cols).
        mode: an ``F.interpolate`` mode: "bicubic", "bilinear", "nearest", "nearest-exact"
            or "area".

    Shape:
        - table: (old_rows * old_cols, dim)
        - Output: (new_rows * new_cols, dim)

    Returns:
        ``table`` itself when the grids are equal, else the resampled table in its dtype.

    Raises:
        TypeError: ``table`` is not a floating tensor; a grid is not an int or a pair.
        ValueError: ``table`` is not 2-D or does not have ``old_rows * old_cols`` rows; a grid
            side < 1; an unknown ``mode``.

    Examples:
        >>> resample_2d(torch.randn(4, 8), (2, 2), (3, 5)).shape
        torch.Size([15, 8])
    """
    old_grid = _check_grid("old_grid", old_grid)
    new_grid = _check_grid("new_grid", new_grid)
    check_choice("mode", mode, RESAMPLE_MODES)
    check_rank("table", table, (2,), "(rows * cols, dim)")
    check_floating("table", table)
    if table.shape[0] != old_grid[0] * old_grid[1]:
        raise ValueError(
            f"table must have old_grid rows*cols={old_grid[0] * old_grid[1]} rows, "
            f"got shape {tuple(table.shape)}"
        )
    if surely(old_grid[0] == new_grid[0]) and surely(old_grid[1] == new_grid[1]):
        return table
    grid = rearrange(table.float(), "(h w) d -> 1 d h w", h=old_grid[0])
    kwargs = {"align_corners": False} if mode in ("bilinear", "bicubic") else {}
    grid = F.interpolate(grid, size=new_grid, mode=mode, **kwargs)
    return rearrange(grid, "1 d h w -> (h w) d").to(table.dtype)


class SinusoidalPositionalEncoding(nn.Module):
    """Adds the fixed 1D sine/cosine table of :func:`sinusoidal_1d` (no parameters).

    Args:
        dim: width of the inputs, even.
        base: the wavelength base.

    Shape:
        - x: (B, L, dim)
        - Output: (B, L, dim), dtype of ``x``

    Examples:
        >>> SinusoidalPositionalEncoding(8)(torch.zeros(2, 5, 8)).shape
        torch.Size([2, 5, 8])
    """

    def __init__(self, dim: int, *, base: float = 10000.0) -> None:
        super().__init__()
        check_positive_int("dim", dim)
        _check_even("dim", dim)
        self.dim = dim
        self.base = check_number("base", base, positive=True)

    def reset_parameters(self) -> None:
        """Nothing to reset: the table is fixed."""

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        check_rank("x", x, (3,), "(batch, length, dim)")
        check_floating("x", x)
        check_last_dim("x", x, self.dim, "dim")
        table = sinusoidal_1d(
            x.shape[1], self.dim, base=self.base, offset=offset, device=x.device, dtype=x.dtype
        )
        return x + table

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}"


class LearnedPositionalEmbedding(nn.Module):
    """Adds a learned table of ``max_len`` positions (trunc-normal init, std 0.02).

    Args:
        max_len: the longest sequence it can encode.
        dim: width of the inputs.
        max_len_name: how errors name ``max_len`` (an adapter calls it ``max_frames``).
        device: parameter device.
        dtype: parameter dtype.

    Shape:
        - x: (B, L, dim) with offset + L <= max_len, floating
        - Output: (B, L, dim), dtype of ``x`` (the table is cast to it)

    Raises:
        TypeError: ``x`` is not floating; ``offset`` is not an int.
        ValueError: ``offset + L > max_len``, a negative ``offset``, or the width of ``x``
            differs from ``dim``.

    Examples:
        >>> LearnedPositionalEmbedding(16, 8)(torch.zeros(2, 5, 8)).shape
        torch.Size([2, 5, 8])
    """

    def __init__(
        self,
        max_len: int,
        dim: int,
        *,
        max_len_name: str = "max_len",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.max_len = check_positive_int(max_len_name, max_len)
        self.max_len_name = max_len_name
        self.dim = check_positive_int("dim", dim)
        dtype = check_factory_dtype("dtype", dtype)
        self.weight = nn.Parameter(torch.empty(max_len, dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.weight, std=0.02)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        check_rank("x", x, (3,), "(batch, length, dim)")
        check_floating("x", x)
        check_last_dim("x", x, self.dim, "dim")
        check_same_device("x", x, "the module's parameters", self.weight)
        offset = check_index("offset", offset)
        if offset + x.shape[1] > self.max_len:
            raise ValueError(
                f"x has length {x.shape[1]} (offset {int(offset)}), more than the "
                f"{self.max_len_name}={self.max_len} learned positions"
            )
        return x + self.weight[offset : offset + x.shape[1]].to(x.dtype)

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, dim={self.dim}"


class LearnedPositionalEmbedding2d(nn.Module):
    """Adds a learned (rows, cols) grid of positions, resampled for other grids.

    The table is built for ``grid_size``; inputs on another grid get the table resampled by
    :func:`resample_2d` (bicubic), so an image patcher built for 224 px still runs at 320 px.

    Args:
        grid_size: (rows, cols) the table is built for (an int means square).
        dim: width of the inputs.
        mode: interpolation mode for other grids.
        device: parameter device.
        dtype: parameter dtype.

    Shape:
        - x: (B, rows * cols, dim), row-major
        - Output: same as ``x``

    Raises:
        ValueError: the length of ``x`` is not ``rows * cols`` of the given ``grid``.

    Examples:
        >>> pos = LearnedPositionalEmbedding2d((2, 2), 8)
        >>> pos(torch.zeros(1, 12, 8), grid=(3, 4)).shape
        torch.Size([1, 12, 8])
    """

    def __init__(
        self,
        grid_size: int | tuple[int, int],
        dim: int,
        *,
        mode: str = "bicubic",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.grid_size = _check_grid("grid_size", grid_size)
        self.dim = check_positive_int("dim", dim)
        self.mode = check_choice("mode", mode, RESAMPLE_MODES)
        dtype = check_factory_dtype("dtype", dtype)
        rows, cols = self.grid_size
        self.weight = nn.Parameter(torch.empty(rows * cols, dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.weight, std=0.02)

    def table(self, grid: tuple[int, int]) -> Tensor:
        """The (rows * cols, dim) table for ``grid``: the weight itself or its resampling."""
        return resample_2d(self.weight, self.grid_size, _check_grid("grid", grid), mode=self.mode)

    def forward(self, x: Tensor, grid: tuple[int, int] | None = None) -> Tensor:
        check_rank("x", x, (3,), "(batch, rows * cols, dim)")
        check_floating("x", x)
        check_last_dim("x", x, self.dim, "dim")
        check_same_device("x", x, "the module's parameters", self.weight)
        grid = self.grid_size if grid is None else _check_grid("grid", grid)
        if x.shape[1] != grid[0] * grid[1]:
            raise ValueError(
                f"x must have length rows*cols={grid[0] * grid[1]} for grid {grid}, "
                f"got shape {tuple(x.shape)}"
            )
        return x + self.table(grid).to(x.dtype)

    def extra_repr(self) -> str:
        return f"grid_size={self.grid_size}, dim={self.dim}, mode={self.mode!r}"


def position_1d(
    kind: str | None,
    dim: int,
    max_len: int | None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    max_len_name: str = "max_len",
) -> nn.Module:
    """The additive 1D position module for ``kind``: "sinusoidal", "learned" or None.

    Args:
        kind: "sinusoidal" (:class:`SinusoidalPositionalEncoding`), "learned"
            (:class:`LearnedPositionalEmbedding` of ``max_len`` positions) or None
            (``nn.Identity``).
        dim: width of the inputs.
        max_len: the longest sequence, required by "learned".
        device, dtype: factory arguments of the learned table.
        max_len_name: how errors name ``max_len`` (an adapter may call it ``max_frames``).

    Raises:
        ValueError: unknown ``kind``; "learned" without ``max_len``.

    Examples:
        >>> position_1d("learned", 8, 16)
        LearnedPositionalEmbedding(max_len=16, dim=8)
    """
    check_choice("positional", kind, POSITIONAL_1D)
    if kind is None:
        return nn.Identity()
    if kind == "sinusoidal":
        return SinusoidalPositionalEncoding(dim)
    if max_len is None:
        raise ValueError(f"{max_len_name} must be given when positional='learned', got None")
    return LearnedPositionalEmbedding(
        max_len, dim, max_len_name=max_len_name, device=device, dtype=dtype
    )
