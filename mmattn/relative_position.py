r"""Swin's learned relative-position bias table (Liu et al., 2021), for windows and neighbourhoods.

Axis key: ``h`` heads, ``i``/``j`` query/key positions in a window (``n = rows * cols`` of
them), ``t`` table rows, one per relative offset: ``(2 * rows - 1) * (2 * cols - 1)``.

A token at (r, c) attending a token at (r', c') of the same window gets the learned score
``table[index(r - r', c - c'), h]`` added, with Swin's index

.. math::
    \mathrm{index}(\Delta r, \Delta c) = (\Delta r + \mathrm{rows} - 1)(2\,\mathrm{cols} - 1)
        + (\Delta c + \mathrm{cols} - 1),

so a table trained by Swin (torchvision, timm, Microsoft's release) is used as it is.
:class:`RelativePositionBias` owns the table and Swin's ``relative_position_index`` buffer;
the functions here are its parameter-free core, also used by the integrations that keep
their own parameter names (:mod:`mmattn.integrations.torchvision`,
:mod:`mmattn.integrations.timm`). Everything public here is re-exported by
:mod:`mmattn.position`.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn

from mmattn._checks import (
    check_factory_dtype,
    check_floating,
    check_grid,
    check_integer_dtype,
    check_pair,
    check_positive_int,
    check_rank,
    check_same_device,
    check_tensor,
)

__all__ = ["RelativePositionBias", "relative_position_bias", "relative_position_index"]

Window = tuple[int, int]


def relative_position_index(
    window: int | Window, device: torch.device | str | None = None
) -> Tensor:
    """Swin's ``relative_position_index``: the table row of every (query, key) pair of a window.

    Args:
        window: (rows, cols) of the window (an int means square).
        device: where to build the index.

    Shape:
        - returns: (rows * cols, rows * cols), int64; entry [i, j] is
          ``index(r_i - r_j, c_i - c_j)`` for the row-major positions i, j

    Examples:
        >>> relative_position_index((1, 2))
        tensor([[1, 0],
                [2, 1]])
    """
    rows, cols = check_pair("window", window, what="(rows, cols)")
    r, c = torch.meshgrid(
        torch.arange(rows, device=device), torch.arange(cols, device=device), indexing="ij"
    )
    r, c = r.flatten(), c.flatten()
    dr = r[:, None] - r[None, :] + (rows - 1)
    dc = c[:, None] - c[None, :] + (cols - 1)
    return dr * (2 * cols - 1) + dc


def relative_position_bias(table: Tensor, index: Tensor) -> Tensor:
    """The (h, i, j) bias of a window from a (t, h) table and Swin's (i, j) or flat index.

    Shape:
        - table: ((2 rows - 1)(2 cols - 1), h); index: (n, n) or (n * n,)
        - returns: (h, n, n), contiguous

    Raises:
        TypeError: ``table`` is not a floating tensor, ``index`` not an integer one.
        ValueError: ``table`` is not 2-D, ``index`` not (n, n) or (n * n,), or the two are
            on different devices.

    Examples:
        >>> table = torch.arange(3.0).reshape(3, 1)  # a (1, 2) window, one head
        >>> relative_position_bias(table, relative_position_index((1, 2)))
        tensor([[[1., 0.],
                 [2., 1.]]])
    """
    check_tensor("table", table)
    check_floating("table", table)
    check_rank("table", table, (2,), "(offsets, heads)")
    check_tensor("index", index)
    check_integer_dtype("index", index)
    n = int(round(index.numel() ** 0.5))
    if n * n != index.numel() or index.dim() not in (1, 2) or (
        index.dim() == 2 and index.shape[0] != index.shape[1]
    ):
        raise ValueError(f"index must be (n, n) or (n * n,), got {tuple(index.shape)}")
    check_same_device("index", index, "table", table)
    return gather_bias(table, index)


def gather_bias(table: Tensor, index: Tensor) -> Tensor:
    """:func:`relative_position_bias` unchecked (the per-call form inside modules)."""
    n = int(round(index.numel() ** 0.5))
    bias = table[index.reshape(-1)]  # ((i j), h)
    return rearrange(bias, "(i j) h -> h i j", i=n, j=n).contiguous()


def table_rows(window: Window) -> int:
    """How many relative offsets, so table rows, a (rows, cols) window has."""
    return (2 * window[0] - 1) * (2 * window[1] - 1)


class RelativePositionBias(nn.Module):
    r"""A learned additive score per head and relative offset: Swin's bias table.

    .. math::
        \mathrm{bias}_{h,i,j} = T[\mathrm{index}(r_i - r_j,\ c_i - c_j),\ h]

    for the row-major positions (r, c) of a ``window``; add it to the scores of the window's
    tokens (it is a float mask in the SDPA direction:
    ``mmattn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias())``).
    The parameter and buffer names are Swin's (``relative_position_bias_table``,
    ``relative_position_index``), so a Swin attention's state dict loads with
    ``strict=True``, whether it keeps the index as (n, n) (Microsoft's Swin), flat
    (torchvision) or not at all (timm keeps it out of its state dicts); the index is
    always rebuilt from the window, never taken from a checkpoint. The table starts as
    ``trunc_normal_(std=0.02)``, as in Swin.

    With ``window = kernel_size`` the same table serves a neighbourhood: in
    :class:`mmattn.NeighborhoodAttention` a query and a key of its k × k window differ by at
    most k − 1 (in units of the dilation) along each axis, and :meth:`lookup` gives the bias
    of any such offsets (NAT's ``rpb``, in Swin's layout).

    Args:
        num_heads: H, one column of the table per head.
        window: (rows, cols) of the window, or of the neighbourhood kernel (an int means
            square).
        device, dtype: factory arguments for the table.

    Shape:
        - forward: returns (H, rows * cols, rows * cols)
        - lookup: ``d_rows``, ``d_cols`` integer tensors of one shape S, returns (H, *S)

    Raises:
        TypeError: ``window`` is not an int or a pair of ints.
        ValueError: ``num_heads`` or a window side < 1; in ``forward``, a ``grid`` other than
            the window; in ``load_state_dict``, a table or index for another window.

    Examples:
        >>> rpb = RelativePositionBias(num_heads=2, window=3)
        >>> rpb.relative_position_bias_table.shape, rpb().shape
        (torch.Size([25, 2]), torch.Size([2, 9, 9]))
        >>> bool(torch.equal(rpb()[:, 4, 4], rpb.lookup(torch.tensor(0), torch.tensor(0))))
        True
    """

    def __init__(
        self,
        num_heads: int,
        window: int | Window,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = check_positive_int("num_heads", num_heads)
        self.window = check_pair("window", window, what="(rows, cols)")
        dtype = check_factory_dtype("dtype", dtype)
        self.relative_position_bias_table = nn.Parameter(
            torch.empty(table_rows(self.window), self.num_heads, device=device, dtype=dtype)
        )
        self.register_buffer(
            "relative_position_index", relative_position_index(self.window, device=device)
        )
        self.reset_parameters()

    @classmethod
    def from_nat(cls, rpb: Tensor) -> RelativePositionBias:
        """The table of a NAT / DiNAT checkpoint's ``rpb`` parameter (NATTEN's layout).

        NATTEN indexes its (H, 2kh - 1, 2kw - 1) ``rpb`` by key minus query; Swin's table by
        query minus key, flattened: the same numbers, flipped along both offset axes.

        Args:
            rpb: NAT's (num_heads, 2 kh - 1, 2 kw - 1) bias, for a (kh, kw) kernel.

        Raises:
            ValueError: ``rpb`` is not 3-D with odd offset axes.

        Examples:
            >>> nat = torch.randn(2, 5, 5)  # NAT's rpb for a 3 x 3 kernel, 2 heads
            >>> ours = RelativePositionBias.from_nat(nat)
            >>> ours.window, bool(ours.lookup(torch.tensor(1), torch.tensor(-2))[0] == nat[0, 1, 4])
            ((3, 3), True)
        """
        if not isinstance(rpb, Tensor) or rpb.dim() != 3 or rpb.shape[1] % 2 == 0 or (
            rpb.shape[2] % 2 == 0
        ):
            shape = tuple(rpb.shape) if isinstance(rpb, Tensor) else type(rpb).__name__
            raise ValueError(
                f"rpb must be NAT's (num_heads, 2 kh - 1, 2 kw - 1) tensor, got {shape}"
            )
        heads, rows, cols = rpb.shape
        new = cls(heads, ((rows + 1) // 2, (cols + 1) // 2), device=rpb.device, dtype=rpb.dtype)
        with torch.no_grad():
            new.relative_position_bias_table.copy_(
                rearrange(rpb.flip(1, 2), "h r c -> (r c) h")
            )
        return new

    def reset_parameters(self) -> None:
        """Draw the table as Swin does: ``trunc_normal_(std=0.02)``."""
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, window={self.window}"

    def forward(self, grid: Window | None = None) -> Tensor:
        """The (H, n, n) bias of the window's ``n = rows * cols`` tokens, row-major.

        Args:
            grid: the (rows, cols) of the tokens it is added to; must be the window (a check
                that the table fits the tokens). Default: the window.

        Raises:
            ValueError: ``grid`` is not the window.
        """
        if grid is not None and check_grid("grid", grid) != self.window:
            raise ValueError(
                f"grid must match the table's window {self.window} (a table of "
                f"{table_rows(self.window)} offsets), got {tuple(grid)}"
            )
        return gather_bias(self.relative_position_bias_table, self.relative_position_index)

    def lookup(self, d_rows: Tensor, d_cols: Tensor) -> Tensor:
        """The bias of relative offsets (query minus key, in rows and columns), per head.

        Unchecked (kernels call it per tile): the offsets must be integer tensors of one
        shape, each within ``[-(rows - 1), rows - 1]`` and ``[-(cols - 1), cols - 1]``.
        """
        rows, cols = self.window
        index = (d_rows + (rows - 1)) * (2 * cols - 1) + (d_cols + (cols - 1))
        return self.relative_position_bias_table[index].movedim(-1, 0)

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        # The index is a function of the window: a checkpoint's copy, flat (torchvision),
        # square (Microsoft's Swin) or absent (timm), is checked and replaced by ours.
        table = state_dict.get(prefix + "relative_position_bias_table")
        want = tuple(self.relative_position_bias_table.shape)
        if table is not None and tuple(table.shape) != want:
            raise ValueError(
                f"{prefix}relative_position_bias_table must have shape {want} for the window "
                f"{self.window} and {self.num_heads} heads, got {tuple(table.shape)}"
            )
        key = prefix + "relative_position_index"
        ours = self.relative_position_index
        theirs = state_dict.get(key)
        if theirs is not None and (
            theirs.numel() != ours.numel()
            or not torch.equal(theirs.reshape(ours.shape).cpu(), ours.cpu())
        ):
            raise ValueError(
                f"{key} must be Swin's index for the window {self.window}, shape "
                f"{tuple(ours.shape)} or flat; got shape {tuple(theirs.shape)}, other entries"
            )
        state_dict[key] = ours
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
