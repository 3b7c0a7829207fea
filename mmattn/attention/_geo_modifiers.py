"""Score modifiers of the geometric layers: NeighborhoodAttention's grid ALiBi and NAT's
relative-position bias table (``relative_position_bias=``).

Axis key: ``b`` items, ``h`` heads, ``l`` tokens of an item.

The math is in :mod:`mmattn.kernels._neighborhood_terms`; :class:`mmattn.NeighborhoodAttention`
calls these at construction and per call. docs/variants.md ("Score modifiers") has the
formulas.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from mmattn.kernels._neighborhood_terms import pair_terms, static_coords
from mmattn.kernels.neighborhood import padded_items
from mmattn.relative_position import RelativePositionBias


def init_position_bias(
    module: nn.Module, relative_position_bias: bool | RelativePositionBias,
    device: torch.device | str | None, dtype: torch.dtype | None,
) -> None:
    """Give ``module`` its ``relative_position_bias`` submodule (or None).

    ``True`` builds a :class:`RelativePositionBias` for the layer's kernel (Swin's
    ``trunc_normal_(std=0.02)`` draw, after the projections' draws); a
    ``RelativePositionBias`` (e.g. ``RelativePositionBias.from_nat(rpb)``) is used as it is.

    Raises:
        TypeError: neither a bool nor a RelativePositionBias.
        ValueError: a table for another window than ``kernel_size``, or other heads.
    """
    wanted = relative_position_bias is True or isinstance(
        relative_position_bias, RelativePositionBias)
    if wanted and len(module.kernel_size) != 2:
        raise ValueError(
            f"relative_position_bias (NAT's table) needs a 2-D kernel_size (kh, kw), got "
            f"{module.kernel_size}; use alibi=True for 1-D and 3-D grids"
        )
    if isinstance(relative_position_bias, RelativePositionBias):
        check_table(module, relative_position_bias)
        module.relative_position_bias = relative_position_bias
    elif not isinstance(relative_position_bias, bool):
        raise TypeError(
            "relative_position_bias must be a bool or a mmattn.position.RelativePositionBias, "
            f"got {type(relative_position_bias).__name__}"
        )
    elif relative_position_bias:
        module.relative_position_bias = RelativePositionBias(
            module.num_heads, module.kernel_size, device=device, dtype=dtype
        )
    else:
        module.relative_position_bias = None


def check_table(module: nn.Module, table: RelativePositionBias) -> None:
    """Raise ValueError unless ``table`` fits the layer: window = kernel, one column a head."""
    if tuple(table.window) != tuple(module.kernel_size):
        raise ValueError(
            f"relative_position_bias must have the window of kernel_size {module.kernel_size} "
            f"(a table of {(2 * module.kernel_size[0] - 1) * (2 * module.kernel_size[1] - 1)} "
            f"offsets), got a table for the window {tuple(table.window)}"
        )
    if table.num_heads != module.num_heads:
        raise ValueError(
            f"relative_position_bias must have num_heads={module.num_heads} columns, got "
            f"{table.num_heads}"
        )


def position_table(module: nn.Module) -> Tensor | None:
    """The layer's ((2 kh − 1)(2 kw − 1), h) table for this call (checked), or None."""
    table = getattr(module, "relative_position_bias", None)
    if table is None:
        return None
    check_table(module, table)  # also after an assignment to the attribute
    return table.relative_position_bias_table


def dense_terms(
    module: nn.Module, grid: Any, grid_start: Any, batch: int, length: int,
    slopes: Tensor | None, table: Tensor | None, device: torch.device, dtype: torch.dtype,
) -> Tensor | None:
    """(b, h, l, l) ALiBi and table terms of every pair of tokens, for the dense fallback
    (an ``attn_mask``); None without either. ``batch`` 1 stands for every item."""
    if slopes is None and table is None:
        return None
    items = padded_items(batch, length, grid, num_global_tokens=module.num_global_tokens,
                         grid_start=grid_start)
    coords = static_coords(batch * length, items, str(device))  # a constant when traced
    rows = torch.arange(batch * length, device=device).view(batch, length)
    return pair_terms(coords, rows, rows, slopes=slopes, table=table, kernel=module.kernel_size,
                      dilation=module.dilation, dtype=dtype)
