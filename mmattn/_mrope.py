"""Multi-axis positions of a fused sequence (Qwen2-VL's M-RoPE position ids), from ``Tokens``.

Axis key: ``b`` batch, ``l`` length, ``a`` the three axes (time, row, column), ``p`` parts.

The rule is transformers' ``Qwen2VLModel.get_rope_index`` (5.x) with spatial merge 1 and
time interval 1, read from the Tokens' ``meta["spans"]`` and each part's grid instead of
token type ids:

- a part without a grid (text, audio frames, graph nodes) is a sequence: its n real tokens
  take ``s, s + 1, ..., s + n - 1`` on every axis, and the next part starts at ``s + n``;
- a part with a grid (rows, cols) (an image) or (frames, rows, cols) (a video) takes
  ``(s + t, s + r, s + c)`` at cell (t, r, c), and the next part starts at
  ``s + max(rows, cols)``, whatever the number of frames (transformers' rule: a long video's
  time positions run past the next part's start);
- padding neither takes a position (it holds 0, as in transformers) nor counts; a part
  without a real token in an item does not count in that item.

Positions are where the tokens sit, so :func:`mmattn.rotary.MultiAxisRotary` reads them
through ``Tokens.meta["positions"]`` (STYLE, sixth wave: positions are data).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from einops import rearrange
from torch import Tensor

from mmattn._token_meta import check_spans


def mrope_positions(tokens: Any) -> Tensor:
    r"""(B, L, 3) int64 multi-modal RoPE positions (time, row, column) of ``tokens``.

    ``tokens`` is a fused sequence (``Tokens.cat({name: part})`` or
    :class:`~mmattn.MultiModalEncoder`: ``meta["spans"]`` and each part's meta under its
    name) or a single part (its own ``meta["grid"]``, or none: text). A part's grid is its
    ``meta["grid"]`` ((rows, cols) from ``ImagePatcher``, (frames, rows, cols) from
    ``VideoPatcher``) or ``meta["grids"]`` (one per item). The rule, transformers'
    Qwen2-VL ``get_rope_index`` with spatial merge 1 and time interval 1:

    - a text token advances all three axes by one;
    - a part with grid (h, w) starting at s takes (s, s + r, s + c) at cell (r, c); with grid
      (t, h, w), (s + t, s + r, s + c) at cell (t, r, c);
    - the next part starts at s + max(h, w);
    - padding is skipped (and holds 0).

    Packed Tokens give (B, max lᵢ, 3), the layout of ``tokens.unpack()`` (as every per-token
    ``meta`` entry of packed Tokens). Put the result in ``tokens.meta["positions"]`` and
    blocks hand it to their attention's :class:`~mmattn.rotary.MultiAxisRotary`.

    Args:
        tokens: :class:`~mmattn.Tokens`.

    Shape:
        - Output: (B, L, 3) int64 on the tokens' device

    Raises:
        TypeError: ``tokens`` is not Tokens; malformed spans.
        ValueError: spans out of range; a grid that is not 2 or 3 positive ints, or whose
            cells are fewer than its span's tokens; interleaved ``meta["modality_ids"]``
            without spans (no parts to read).

    Examples:
        >>> from mmattn import Tokens
        >>> text, image = Tokens(torch.randn(1, 2, 8)), Tokens(torch.randn(1, 6, 8))
        >>> image.meta["grid"] = (2, 3)
        >>> fused = Tokens.cat({"text": text, "image": image, "answer": text})
        >>> time, row, col = mrope_positions(fused)[0].unbind(-1)  # text, 2 x 3 image, text
        >>> row.tolist()
        [0, 1, 2, 2, 2, 3, 3, 3, 5, 6]
        >>> col.tolist()
        [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]
    """
    from mmattn.tokens import Tokens  # mmattn.tokens does not import this module

    if not isinstance(tokens, Tokens):
        raise TypeError(f"tokens must be mmattn.Tokens, got {type(tokens).__name__}")
    padded = tokens.unpack()
    real = padded.full_mask()  # (b, l)
    batch, length = real.shape
    device = real.device
    meta = padded.meta
    if meta.get("spans") is not None:
        spans = check_spans("meta['spans']", meta["spans"], batch, length, device)
        parts = [(start, stop, _grid(f"meta[{name!r}]", meta.get(name), batch, device))
                 for name, (start, stop) in spans.items()]
    elif meta.get("modality_ids") is not None:
        raise ValueError(
            "mrope_positions reads the parts from meta['spans'] (Tokens.cat, "
            "MultiModalEncoder); interleaved meta['modality_ids'] without spans are not "
            "supported: concatenate the parts with Tokens.cat({name: part})"
        )
    else:  # one part: the whole sequence
        whole = (torch.zeros(batch, dtype=torch.long, device=device),
                 torch.full((batch,), length, dtype=torch.long, device=device))
        parts = [(*whole, _grid("meta", meta, batch, device))]
    index = torch.arange(length, device=device)
    places, advances = [], []
    for start, stop, grid in parts:
        inside = (index >= start[:, None]) & (index < stop[:, None]) & real  # (b, l)
        local = index - start[:, None]  # the token's index inside its span
        if grid is None:  # a sequence: its real tokens one after another
            rank = inside.long().cumsum(1) - 1
            places.append(rearrange(rank, "b l -> b l 1").expand(-1, -1, 3))
            advances.append(inside.sum(1))
            continue
        t, h, w = grid.unbind(-1)  # (b,) each
        _check_fits(inside, local, t * h * w)
        cell = torch.stack(
            [local // (h * w)[:, None], (local // w[:, None]) % h[:, None], local % w[:, None]],
            dim=-1,
        )  # (b, l, a)
        places.append(cell)
        advances.append(torch.maximum(h, w) * inside.any(1))
    starts = torch.stack([start for start, _, _ in parts])  # (p, b)
    advance = torch.stack(advances)  # (p, b)
    before = starts[None, :, :] < starts[:, None, :]  # (p, q, b): part q lies before part p
    offset = (before * advance[None]).sum(1)  # (p, b) where each part starts counting
    out = torch.zeros(batch, length, 3, dtype=torch.long, device=device)
    for (start, stop, _), place, s in zip(parts, places, offset):
        inside = (index >= start[:, None]) & (index < stop[:, None]) & real
        out = torch.where(inside[..., None], place + s[:, None, None], out)
    return out


def _grid(name: str, meta: object, batch: int, device: torch.device) -> Tensor | None:
    """A part's grid as (b, 3) int64 (t, h, w), t = 1 for a 2-D grid; None without one."""
    if not isinstance(meta, Mapping):
        return None
    if meta.get("grids") is not None:
        grids = list(meta["grids"])
        if len(grids) != batch:
            raise ValueError(
                f"{name}['grids'] must hold one grid per item ({batch}), got {len(grids)}"
            )
        rows = [_cells(f"{name}['grids'][{m}]", g) for m, g in enumerate(grids)]
        return torch.tensor(rows, dtype=torch.long, device=device)
    if meta.get("grid") is not None:
        cells = _cells(f"{name}['grid']", meta["grid"])
        return torch.tensor([cells], dtype=torch.long, device=device).expand(batch, 3)
    return None


def _cells(name: str, grid: object) -> tuple[int, int, int]:
    """(rows, cols) or (frames, rows, cols) of positive ints as (t, h, w)."""
    sides = tuple(grid) if isinstance(grid, (tuple, list, torch.Size)) else ()
    if len(sides) not in (2, 3) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sides
    ):
        raise ValueError(
            f"{name} must be (rows, cols) or (frames, rows, cols) of positive ints, got {grid!r}"
        )
    return (1, *sides) if len(sides) == 2 else sides


def _check_fits(inside: Tensor, local: Tensor, cells: Tensor) -> None:
    """Raise unless every real token of a part lies on its grid (one read; skipped while
    torch.compile traces and on the meta device)."""
    if torch.compiler.is_compiling() or inside.device.type == "meta" or not inside.numel():
        return
    beyond = inside & (local >= cells[:, None])
    if bool(beyond.any()):
        raise ValueError(
            f"a part's grid must hold all its tokens: its span has a real token at index "
            f"{int(local[beyond].max())} but the grid has {cells.tolist()} cells per item"
        )
