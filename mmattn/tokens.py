"""``Tokens``: the common currency between adapters, attention and blocks.

Axis key: ``b`` batch, ``l`` sequence length, ``d`` model width.

A batch of token sequences ``x`` of shape (b, l, d) travels with a boolean ``mask`` of shape
(b, l) where **True marks a real token** (the direction of
``torch.nn.functional.scaled_dot_product_attention``). ``key_padding_mask`` gives the opposite
direction that ``torch.nn.MultiheadAttention`` and our attention modules take.

A *packed* batch instead holds a jagged ``torch.nested`` tensor ``x`` of shape (b, l*, d)
(``values()`` (t, d) and ``offsets()`` (b + 1,)) and no mask: every stored token is real.
:meth:`Tokens.pack`, :meth:`Tokens.unpack` and :meth:`Tokens.from_packed` convert (see
docs/packed.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from mmattn import _jagged, _pytree, _token_meta
from mmattn._checks import (
    check_has_data,
    check_matches_params,
    check_meta,
    check_packed_has_data,
    check_rank,
    check_same_device,
    check_shape,
    check_tensor,
)

#: meta keys that ``Tokens.cat`` of a mapping writes itself; no part may be named so.
RESERVED_NAMES = ("spans",)


@dataclasses.dataclass(init=False, repr=False, eq=False)  # fields visible to DDP/FSDP
class Tokens:
    """A padded batch of token sequences with its mask and adapter facts.

    Args:
        x: token features.
        mask: True where a token is real, False where it is padding. ``None`` means every
            token is real.
        meta: a dict of facts an adapter wants to pass on (image grid, audio hop, graph batch
            vector, modality spans). Copied shallowly.

    Shape:
        - x: (B, L, D)
        - mask: (B, L), bool

    Raises:
        TypeError: ``x`` is not a floating tensor, ``mask`` is not bool, ``meta`` is not a
            dict.
        ValueError: wrong rank, mask shape differs from (B, L), or devices differ.

    Examples:
        >>> t = Tokens(torch.randn(2, 5, 8), torch.tensor([[1, 1, 1, 0, 0], [1] * 5]).bool())
        >>> t.batch_size, t.length, t.dim, t.lengths.tolist()
        (2, 5, 8, [3, 5])
        >>> t.key_padding_mask[0].tolist()
        [False, False, False, True, True]
    """

    __slots__ = ("x", "mask", "meta")
    x: Tensor
    mask: Tensor | None
    meta: dict[str, Any]

    def __init__(self, x: Tensor, mask: Tensor | None = None, meta: dict | None = None) -> None:
        if _jagged.is_jagged(x):
            _check_packed_x(x, mask)
        else:
            check_tensor("Tokens.x", x)
            if x.is_nested:  # torch.nested's default (strided) layout: torch ops fail deep down
                raise ValueError(
                    f"Tokens.x must be a dense tensor or a jagged nested tensor, got a nested "
                    f"tensor of layout {x.layout}; make it with torch.nested.nested_tensor("
                    "tensors, layout=torch.jagged) or Tokens.pack"
                )
            check_rank("Tokens.x", x, (3,), "(batch, length, dim)")
        if not x.dtype.is_floating_point:
            raise TypeError(f"Tokens.x must have a floating-point dtype, got {x.dtype}")
        if mask is not None:
            check_tensor("Tokens.mask", mask)
            if mask.dtype != torch.bool:
                raise TypeError(
                    f"Tokens.mask must have dtype torch.bool (True = real token), got {mask.dtype}"
                )
            check_shape("Tokens.mask", mask, x.shape[:2], "(batch, length)")
            check_same_device("Tokens.mask", mask, "Tokens.x", x)
        self.x = x
        self.mask = mask
        self.meta: dict[str, Any] = check_meta("Tokens.meta", meta)

    @property
    def batch_size(self) -> int:
        return self.x.shape[0]

    @property
    def is_packed(self) -> bool:
        """True when ``x`` is a jagged nested tensor (b, l*, d) without padding."""
        return _jagged.is_jagged(self.x)

    @property
    def length(self) -> int:
        """The padded length L; for packed tokens the longest sequence."""
        if self.is_packed:
            lengths = self.lengths
            return int(lengths.max()) if lengths.numel() else 0
        return self.x.shape[1]

    @property
    def dim(self) -> int:
        return self.x.shape[2]

    @property
    def device(self) -> torch.device:
        return self.x.device

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    @property
    def key_padding_mask(self) -> Tensor | None:
        """(B, L) bool, True at padding: the ``nn.MultiheadAttention`` direction."""
        return None if self.mask is None else ~self.mask

    @property
    def lengths(self) -> Tensor:
        """(B,) long: the number of real tokens of each sequence."""
        if self.is_packed:
            return self.x.offsets().diff()
        if self.mask is None:
            return torch.full((self.batch_size,), self.length, dtype=torch.long, device=self.device)
        return self.mask.sum(dim=1)

    def full_mask(self) -> Tensor:
        """(B, L) bool mask, all True when ``mask`` is None (for packed tokens: unpack's)."""
        if self.is_packed:
            return self.unpack().mask
        if self.mask is None:
            return torch.ones(self.x.shape[:2], dtype=torch.bool, device=self.device)
        return self.mask

    def zero_padding(self, x: Tensor | None = None) -> Tensor:
        """``x`` (default ``self.x``) with the rows at padded positions set to exactly 0.

        Selects with ``torch.where``, so whatever the padded rows hold (NaN, Inf) is gone.

        Shape:
            - x: (B, L, ...) with (B, L) the shape of ``mask``; returns the same shape.
        """
        x = self.x if x is None else x
        if self.mask is None:
            return x
        return torch.where(self.mask[..., None], x, x.new_zeros(()))

    def replace(self, x: Tensor | None = None, **meta: Any) -> Tokens:
        """A new Tokens with ``x`` swapped (same mask) and ``meta`` updated."""
        return Tokens(self.x if x is None else x, self.mask, {**self.meta, **meta})

    def to(self, *args: Any, **kwargs: Any) -> Tokens:
        """Move or cast like ``Tensor.to``; the mask follows the device, never the dtype."""
        x = self.x.to(*args, **kwargs)
        mask = None if self.mask is None else self.mask.to(device=x.device)
        return Tokens(x, mask, self.meta)

    def pack(self) -> Tokens:
        """The real tokens as a packed batch (itself when already packed).

        Each sequence keeps its real tokens in order; padding is dropped, wherever it sits.
        A ``meta["edge_index"]`` (graph edges in the flat token order) follows the tokens to
        their packed rows; edges touching padding are dropped. ``meta["spans"]`` become
        per-item (B,) bounds around each span's real tokens, and every (B, L) tensor of
        ``meta`` (``modality_ids``, ``segments``, ids) is moved to the (B, max lᵢ) positions
        of ``unpack()`` (docs/packed.md).

        Shape:
            - returns: Tokens with x (B, l*, D) jagged, ``lengths`` as before, mask None

        Examples:
            >>> t = Tokens(torch.randn(2, 3, 4), torch.tensor([[1, 1, 0], [1, 1, 1]]).bool())
            >>> p = t.pack()
            >>> p.is_packed, p.x.values().shape, p.lengths.tolist()
            (True, torch.Size([5, 4]), [2, 3])
        """
        if self.is_packed:
            return self
        batch, length, dim = self.x.shape
        if self.mask is None:
            values = self.x.reshape(batch * length, dim)
            lengths = torch.full((batch,), length, dtype=torch.long, device=self.device)
        else:
            check_has_data("Tokens.mask", self.mask)  # packing reads which tokens are real
            values = self.x[self.mask]
            lengths = self.mask.sum(dim=1)
        offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
        meta = self.meta
        if self.mask is not None:  # without padding every position stays where it is
            meta = _token_meta.to_packed(meta, self.mask, lengths)
        meta = _edges_to_packed(meta, self.full_mask())
        return Tokens(_jagged.jagged(values, offsets), None, meta)

    def unpack(self) -> Tokens:
        """A padded batch (zeros at padding, left-aligned) with its mask; itself if padded.

        A ``meta["edge_index"]`` follows the tokens to their padded rows ``b·L + i``.

        Shape:
            - returns: Tokens with x (B, max lᵢ, D) and mask (B, max lᵢ)
        """
        if not self.is_packed:
            return self
        values, offsets = _jagged.contiguous_parts(self.x)
        x, mask = _jagged.pad_values(values, offsets)
        return Tokens(x, mask, _edges_to_padded(self.meta, offsets, x.shape[1]))

    @staticmethod
    def from_packed(values: Tensor, offsets: Tensor, meta: dict | None = None) -> Tokens:
        """Packed Tokens viewing ``values`` (zero-copy), e.g. PyG's ``x`` and ``ptr``.

        Args:
            values: the tokens of every sequence, back to back.
            offsets: where each sequence starts, then the total: ``offsets[0] == 0``,
                non-decreasing (an empty sequence repeats its offset), ``offsets[-1] == t``.
            meta: adapter facts.

        Shape:
            - values: (t, D); offsets: (B + 1,) integer
            - returns: Tokens with x (B, l*, D) jagged whose ``values()`` is ``values``

        Raises:
            TypeError: ``values`` is not floating or ``offsets`` not an integer tensor.
            ValueError: wrong ranks, offsets not starting at 0, decreasing, or not ending
                at ``values.shape[0]``; devices differ.

        Examples:
            >>> t = Tokens.from_packed(torch.randn(5, 8), torch.tensor([0, 2, 2, 5]))
            >>> t.is_packed, t.lengths.tolist()
            (True, [2, 0, 3])
        """
        check_rank("values", values, (2,), "(total_tokens, dim)")
        check_rank("offsets", offsets, (1,), "(batch + 1,)")
        if offsets.is_floating_point() or offsets.dtype == torch.bool:
            raise TypeError(f"offsets must have an integer dtype, got {offsets.dtype}")
        check_same_device("offsets", offsets, "values", values)
        check_has_data("offsets", offsets)
        if offsets.numel() == 0:
            raise ValueError("offsets must hold at least one entry (0), got an empty tensor")
        steps = offsets.diff()
        first, last = int(offsets[0]), int(offsets[-1])
        if first != 0 or last != values.shape[0] or bool((steps < 0).any()):
            raise ValueError(
                f"offsets must start at 0, be non-decreasing and end at values.shape[0]="
                f"{values.shape[0]}, got {offsets.tolist()}"
            )
        return Tokens(_jagged.jagged(values, offsets.long()), None, meta)

    @staticmethod
    def cat(parts: Sequence[Tokens] | Mapping[str, Tokens]) -> Tokens:
        """Concatenate along the length axis, masks and all.

        Given a mapping ``{name: Tokens}``, the result's ``meta["spans"][name]`` is the
        ``(start, stop)`` slice of that part and ``meta[name]`` its own meta. Packed parts
        are concatenated per sequence (sequence m of the result is sequence m of every part,
        with no padding in between); their spans are (B,) tensors of starts and stops inside
        each sequence.

        Raises:
            TypeError: ``parts`` is not a sequence or mapping of Tokens (a single Tokens
                must be wrapped: ``Tokens.cat([t])``); parts disagree on dtype (nothing is
                promoted silently: cast them first); packed and padded parts are mixed.
            ValueError: no parts; parts disagree on batch size, width or device; a part is
                named ``"spans"``.
        """
        if isinstance(parts, Tokens) or not isinstance(parts, (Sequence, Mapping)):
            raise TypeError(
                "parts must be a list or a dict of Tokens (wrap a single one: "
                f"Tokens.cat([tokens])), got {type(parts).__name__}"
            )
        named = isinstance(parts, Mapping)
        items = list(parts.items()) if named else list(enumerate(parts))
        if not items:
            raise ValueError("Tokens.cat needs at least one part, got none")
        first = items[0][1]
        for key, part in items:
            if not isinstance(part, Tokens):
                raise TypeError(
                    f"Tokens.cat part {key!r} must be Tokens, got {type(part).__name__}"
                )
            if named and key in RESERVED_NAMES:
                raise ValueError(
                    f"Tokens.cat part names must not be one of {RESERVED_NAMES} (the result's "
                    f"meta uses them), got {key!r}"
                )
            if part.dtype != first.dtype:
                raise TypeError(
                    f"Tokens.cat part {key!r} has dtype {part.dtype} but the first part has "
                    f"{first.dtype}; cast the parts to one dtype first (nothing is promoted)"
                )
            if (part.batch_size, part.dim) != (first.batch_size, first.dim):
                raise ValueError(
                    f"Tokens.cat part {key!r} has (batch, dim)={part.batch_size, part.dim}, "
                    f"expected {first.batch_size, first.dim}"
                )
            check_same_device(f"Tokens.cat part {key!r}", part.x, "the first part", first.x)
        packed = [key for key, part in items if part.is_packed]
        if packed and len(packed) < len(items):
            padded = [key for key, part in items if not part.is_packed]
            raise TypeError(
                f"Tokens.cat parts {packed!r} are packed but parts {padded!r} are padded; "
                "pack() or unpack() them all first"
            )
        if packed:
            values, offsets, bounds = _jagged.cat_values(
                [_jagged.contiguous_parts(part.x) for _, part in items]
            )
            meta = {}
            if named:
                meta = {name: part.meta for name, part in items}
                meta["spans"] = {name: b for (name, _), b in zip(items, bounds)}
            return Tokens(_jagged.jagged(values, offsets), None, meta)
        x = torch.cat([p.x for _, p in items], dim=1)
        mask = None
        if any(p.mask is not None for _, p in items):
            mask = torch.cat([p.full_mask() for _, p in items], dim=1)
        meta: dict[str, Any] = {}
        if named:
            spans, start = {}, 0
            for name, part in items:
                spans[name] = (start, start + part.length)
                meta[name] = part.meta
                start += part.length
            meta["spans"] = spans
        return Tokens(x, mask, meta)

    def __repr__(self) -> str:
        if self.is_packed:
            return (
                f"Tokens(x=packed({self.batch_size}, l*, {self.dim}), dtype={self.dtype}, "
                f"device={self.device}, lengths="
                f"{'meta' if self.x.is_meta else self.lengths.tolist()}, "
                f"meta_keys={sorted(self.meta)})"
            )
        mask = "None" if self.mask is None else (
            "meta" if self.mask.is_meta else f"lengths={self.lengths.tolist()}")
        keys = sorted(self.meta)
        return (
            f"Tokens(x={tuple(self.x.shape)}, dtype={self.dtype}, device={self.device}, "
            f"mask={mask}, meta_keys={keys})"
        )


def check_tokens(
    name: str,
    value: object,
    dim: int | None = None,
    what: str = "embed_dim",
    *,
    like: Tensor | None = None,
) -> Tokens:
    """Raise unless ``value`` is Tokens of width ``dim`` matching the parameter ``like``.

    Raises:
        TypeError: ``value`` is not Tokens; its dtype differs from ``like``'s (outside
            autocast).
        ValueError: its width is not ``dim``; it lives on another device than ``like``; it
            is packed on the meta device (no lengths to read).
    """
    if not isinstance(value, Tokens):
        raise TypeError(f"{name} must be mmattn.Tokens, got {type(value).__name__}")
    if value.is_packed:
        check_packed_has_data(name, value.x)
    if dim is not None and value.dim != dim:
        raise ValueError(
            f"{name} must have width {what}={dim}, got Tokens of shape {tuple(value.x.shape)}"
        )
    check_matches_params(name, value.x, like)
    return value


def _edges_to_packed(meta: dict, mask: Tensor) -> dict:
    """``meta["edge_index"]`` from padded rows (b·L + i) to packed rows; padding edges go."""
    edges = meta.get("edge_index")
    if not isinstance(edges, Tensor):
        return meta
    flat = mask.reshape(-1)
    rows = flat.long().cumsum(0) - 1  # packed row of every real padded slot
    edges = edges.long()
    edges = edges[:, flat[edges].all(dim=0)]
    return {**meta, "edge_index": rows[edges]}


def _edges_to_padded(meta: dict, offsets: Tensor, length: int) -> dict:
    """``meta["edge_index"]`` from packed rows to padded rows ``b·L + i``."""
    edges = meta.get("edge_index")
    if not isinstance(edges, Tensor):
        return meta
    edges = edges.long()
    item = torch.searchsorted(offsets[1:], edges.reshape(-1), right=True).view_as(edges)
    return {**meta, "edge_index": item * length + edges - offsets[item]}


def _check_packed_x(x: Tensor, mask: Tensor | None) -> None:
    """A packed Tokens.x: (batch, length*, dim) jagged, ragged on the length, no mask."""
    if x.dim() != 3 or x._ragged_idx != 1:
        raise ValueError(
            f"Tokens.x must be a (batch, length*, dim) jagged tensor ragged on the length, got "
            f"shape {tuple(x.shape)}"
        )
    if mask is not None:
        raise ValueError(
            "Tokens.mask must be None when x is packed (jagged): every stored token is real"
        )


# torch.export, torch.compile, DDP, FSDP and checkpoint see through Tokens: mmattn/_pytree.py
_pytree.register_tokens(Tokens)
