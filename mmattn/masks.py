"""Mask builders and lossless conversions between the conventions users meet.

Axis key: ``b`` batch, ``h`` heads, ``i`` query length, ``j`` key length.

Three directions of boolean mask exist in PyTorch code, and mmattn names each:

================================  =====================  ==========================
where                             True means             shape
================================  =====================  ==========================
``Tokens.mask``, PyG              a real token           (b, j)
``to_dense_batch``'s mask
SDPA ``attn_mask``,               query i may attend     (..., i, j)
``mmattn.functional``             key j
``nn.MultiheadAttention`` and     NOT allowed / padding  (b, j) or (i, j) or
our modules' ``key_padding_mask``                        (b*h, i, j)
and ``attn_mask``
================================  =====================  ==========================

Float masks mean the same everywhere: they are added to the attention scores, ``-inf``
forbids a pair. The builders here return the SDPA direction ("may attend"); :func:`invert`
turns any boolean mask into the opposite direction.
"""

from __future__ import annotations

import warnings

import torch
from einops import rearrange, repeat
from torch import Tensor

from mmattn._checks import (
    check_bool,
    check_device,
    check_dtype,
    check_has_data,
    check_integer_dtype,
    check_mask_dtype,
    check_positive_int,
    check_rank,
    check_same_device,
    check_tensor,
)
from mmattn._masks_grid import neighborhood_mask

__all__ = [
    "padding_mask",
    "causal_mask",
    "band_mask",
    "local_allowed",
    "neighborhood_mask",
    "invert",
    "to_additive",
    "to_bool",
    "merge_masks",
    "expand_heads",
    "k_hop_edges",
]


def padding_mask(lengths: Tensor, max_len: int | None = None) -> Tensor:
    """Real-token mask from sequence lengths (the ``Tokens.mask`` direction).

    Args:
        lengths: number of real tokens per sequence.
        max_len: padded length L; defaults to ``lengths.max()``.

    Shape:
        - lengths: (B,) integer
        - returns: (B, L) bool, True at real tokens.

    Raises:
        TypeError: ``lengths`` is not an integer tensor.
        ValueError: ``lengths`` is not 1-D, is negative, exceeds ``max_len``, or is on the
            meta device (the mask depends on its values).

    Examples:
        >>> padding_mask(torch.tensor([2, 4])).int().tolist()
        [[1, 1, 0, 0], [1, 1, 1, 1]]
    """
    check_rank("lengths", lengths, (1,), "(batch,)")
    check_integer_dtype("lengths", lengths)
    check_has_data("lengths", lengths)  # the mask's length and its checks read the values
    longest = int(lengths.max()) if lengths.numel() else 0
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"lengths must be >= 0, got {lengths.tolist()}")
    if max_len is None:
        max_len = longest
    check_positive_int("max_len", max_len, minimum=0)
    if longest > max_len:
        raise ValueError(f"lengths must be <= max_len={max_len}, got a length of {longest}")
    positions = torch.arange(max_len, device=lengths.device)
    return positions < lengths[:, None]


def causal_mask(
    q_len: int, k_len: int | None = None, *, device: torch.device | str | None = None
) -> Tensor:
    """Causal "may attend" mask: query i sees keys j <= i (top-left aligned, like SDPA).

    Shape:
        - returns: (q_len, k_len) bool, True where attention is allowed.

    Examples:
        >>> causal_mask(3).int().tolist()
        [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """
    check_positive_int("q_len", q_len, minimum=0)
    k_len = q_len if k_len is None else check_positive_int("k_len", k_len, minimum=0)
    device = check_device("device", device)
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()


def band_mask(
    q_len: int,
    window_size: int,
    *,
    k_len: int | None = None,
    causal: bool = False,
    device: torch.device | str | None = None,
) -> Tensor:
    """Local "may attend" mask: query i sees key j iff ``|i - j| <= window_size``.

    With ``causal=True`` additionally ``j <= i``.

    Shape:
        - returns: (q_len, k_len) bool, True where attention is allowed.

    Raises:
        TypeError: ``window_size`` is not an int.
        ValueError: ``window_size`` is negative.

    Examples:
        >>> band_mask(4, 1).int().tolist()
        [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]]
    """
    check_positive_int("window_size", window_size, minimum=0)
    check_positive_int("q_len", q_len, minimum=0)
    k_len = q_len if k_len is None else check_positive_int("k_len", k_len, minimum=0)
    check_bool("causal", causal)
    device = check_device("device", device)
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(k_len, device=device)[None, :]
    offset = i - j
    allowed = offset.abs() <= window_size
    if causal:
        allowed &= offset >= 0
    return allowed


def local_allowed(
    length: int,
    window_size: int,
    *,
    causal: bool = False,
    num_global_tokens: int = 0,
    device: torch.device | str | None = None,
) -> Tensor:
    """The dense "may attend" pattern of :class:`~mmattn.LocalAttention` (SDPA direction).

    ``band_mask`` plus the global rows and columns: True where ``|i - j| <= window_size``,
    or ``i < g`` or ``j < g``; with ``causal`` additionally ``j <= i``.

    Shape:
        - returns: (length, length) bool.

    Examples:
        >>> local_allowed(4, 0, num_global_tokens=1).int().tolist()
        [[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]]
    """
    check_positive_int("num_global_tokens", num_global_tokens, minimum=0)
    allowed = band_mask(length, window_size, device=device)
    allowed[:num_global_tokens] = True
    allowed[:, :num_global_tokens] = True
    if causal:
        allowed = allowed.tril()
    return allowed


def invert(mask: Tensor) -> Tensor:
    """Flip a boolean mask between directions (module ``True = masked`` <-> SDPA/Tokens).

    Raises:
        TypeError: ``mask`` is not bool (a float mask has no direction to flip).

    Examples:
        >>> invert(torch.tensor([True, False])).tolist()
        [False, True]
    """
    check_tensor("mask", mask)
    check_mask_dtype("mask", mask, allow_float=False)
    return ~mask


def to_additive(mask: Tensor, dtype: torch.dtype | str = torch.float32) -> Tensor:
    """SDPA-direction boolean mask -> additive float mask (0 where allowed, -inf elsewhere).

    Args:
        mask: bool, True where attention is allowed.
        dtype: a floating dtype, or its name (``"float16"``).

    Raises:
        TypeError: ``mask`` is not bool; ``dtype`` is not a floating dtype or its name.

    Examples:
        >>> to_additive(torch.tensor([True, False])).tolist()
        [0.0, -inf]
    """
    check_tensor("mask", mask)
    check_mask_dtype("mask", mask, allow_float=False)
    dtype = check_dtype("dtype", dtype, floating=True)
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill_(~mask, float("-inf"))


def to_bool(mask: Tensor) -> Tensor:
    """Additive float mask of 0 / -inf -> SDPA-direction bool (True where the value is 0).

    The inverse of :func:`to_additive`. Any other value cannot be represented by a boolean
    mask, so it raises instead of losing information.

    Raises:
        TypeError: ``mask`` is not floating.
        ValueError: ``mask`` holds values other than 0 and -inf, or is on the meta device
            (it has no values to convert).
    """
    check_tensor("mask", mask)
    if not mask.is_floating_point():
        raise TypeError(f"mask must have a floating dtype, got {mask.dtype}")
    check_has_data("mask", mask)  # whether the conversion is lossless depends on the values
    allowed = mask == 0
    if not bool((allowed | torch.isneginf(mask)).all()):
        raise ValueError("mask must hold only 0 and -inf to convert to bool losslessly")
    return allowed


def expand_heads(mask: Tensor, num_heads: int) -> Tensor:
    """Repeat a per-sample (B, L, S) mask for every head: (B * num_heads, L, S).

    The order matches ``nn.MultiheadAttention``'s 3-D ``attn_mask`` (batch-major).
    """
    check_rank("mask", mask, (3,), "(batch, query_len, key_len)")
    check_positive_int("num_heads", num_heads)
    return repeat(mask, "b i j -> (b h) i j", h=num_heads)


def merge_masks(
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    *,
    batch_size: int,
    num_heads: int,
    dtype: torch.dtype,
) -> Tensor | None:
    """Merge the module masks (True = NOT allowed) into one SDPA mask (True = may attend).

    Two boolean masks merge into a boolean mask; when either is a float mask, the result is
    additive in ``dtype`` (booleans become 0 / -inf). An integer mask is refused, as the
    modules refuse it: taken as additive, a 0/1 padding mask would add +1 to the padded keys
    instead of masking them.

    Args:
        key_padding_mask: (B, S), True (or -inf) at padded keys.
        attn_mask: (L, S) or (B * num_heads, L, S), True (or -inf) where not allowed.
        batch_size: B. num_heads: H. dtype: floating dtype of an additive result.

    Shape:
        - returns: (B, 1 or H, L or 1, S), or None when both inputs are None.

    Raises:
        TypeError: a mask that is not a tensor, or neither bool nor floating (an integer
            mask); ``dtype`` is not a floating dtype.
        ValueError: a mask of the wrong rank, or whose batch (B, or B * num_heads) or key
            length does not fit; the two masks on different devices.

    Examples:
        >>> kpm = torch.tensor([[False, True]])
        >>> merge_masks(kpm, None, batch_size=1, num_heads=2, dtype=torch.float32).tolist()
        [[[[True, False]]]]
    """
    _check_merge_inputs(key_padding_mask, attn_mask, batch_size, num_heads, dtype)
    parts = []
    if key_padding_mask is not None:
        parts.append(rearrange(key_padding_mask, "b j -> b 1 1 j"))
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            parts.append(rearrange(attn_mask, "i j -> 1 1 i j"))
        else:
            parts.append(rearrange(attn_mask, "(b h) i j -> b h i j", b=batch_size, h=num_heads))
    if not parts:
        return None
    if all(p.dtype == torch.bool for p in parts):
        merged = parts[0] if len(parts) == 1 else parts[0] | parts[1]
        return ~merged
    additive = [
        to_additive(~p, dtype) if p.dtype == torch.bool else p.to(dtype) for p in parts
    ]
    return additive[0] if len(additive) == 1 else additive[0] + additive[1]


def k_hop_edges(edge_index: Tensor, num_hops: int, num_nodes: int | None = None) -> Tensor:
    """The edges ``(j, i)`` of every path of 1 to ``num_hops`` edges from ``j`` to ``i``.

    The edge-list form of a k-hop neighbourhood: :class:`~mmattn.EdgeAttention` (with its
    default self loops) along ``k_hop_edges(edge_index, k)`` attends exactly what the dense
    ``adapters.neighbourhood_mask(edge_index, batch, num_hops=k)`` allows. The result is
    unique and sorted by (target, source); a cycle back to ``i`` within ``k`` hops gives the
    pair ``(i, i)``. Paths never leave a connected component, so edges of a batch of graphs
    stay inside their graphs. Memory grows as the number of k-hop pairs.

    Args:
        edge_index: (2, E) integer ``(source, target)`` ids.
        num_hops: k >= 1 (1 gives the unique edges).
        num_nodes: number of nodes (default ``edge_index.max() + 1``).

    Shape:
        - returns: (2, E_k) int64

    Raises:
        TypeError / ValueError: ``edge_index`` not an integer (2, E) tensor, negative ids or
            ids >= ``num_nodes``; ``num_hops`` not a positive int.

    Examples:
        >>> path = torch.tensor([[0, 1], [1, 2]])  # 0 -> 1 -> 2
        >>> k_hop_edges(path, 2).tolist()
        [[0, 0, 1], [1, 2, 2]]
    """
    check_integer_dtype("edge_index", edge_index, "node ids")
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(
            f"edge_index must have shape (2, num_edges), got {tuple(edge_index.shape)}"
        )
    check_positive_int("num_hops", num_hops)
    edge_index = edge_index.long()
    if num_nodes is None:
        num_nodes = int(edge_index.max()) + 1 if edge_index.numel() else 0
    check_positive_int("num_nodes", num_nodes, minimum=0)
    if edge_index.numel() and (int(edge_index.min()) < 0 or int(edge_index.max()) >= num_nodes):
        raise ValueError(
            f"edge_index must lie in [0, num_nodes={num_nodes}), got values in "
            f"[{int(edge_index.min())}, {int(edge_index.max())}]"
        )
    size = (num_nodes, num_nodes)

    def pattern(index: Tensor) -> Tensor:  # rows = target, columns = source, values 1
        ones = torch.ones(index.shape[1], device=index.device)
        return torch.sparse_coo_tensor(index, ones, size, check_invariants=False).coalesce()

    step = pattern(edge_index.flip(0))
    reach = step
    with warnings.catch_warnings():  # torch.sparse.mm warns that its CSR support is beta
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(num_hops - 1):
            reach = pattern((reach + torch.sparse.mm(reach, step)).coalesce().indices())
    return reach.indices().flip(0)


def _check_merge_inputs(
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    batch_size: int,
    num_heads: int,
    dtype: torch.dtype,
) -> None:
    """Python-level checks of :func:`merge_masks`' arguments (no tensor values are read)."""
    check_positive_int("batch_size", batch_size, minimum=0)
    check_positive_int("num_heads", num_heads)
    check_dtype("dtype", dtype, floating=True)
    if key_padding_mask is not None:
        check_rank("key_padding_mask", key_padding_mask, (2,), "(batch, key_len)")
        check_mask_dtype("key_padding_mask", key_padding_mask)
        if key_padding_mask.shape[0] != batch_size:
            raise ValueError(
                f"key_padding_mask must have batch size batch_size={batch_size}, got shape "
                f"{tuple(key_padding_mask.shape)}"
            )
    if attn_mask is not None:
        check_rank("attn_mask", attn_mask, (2, 3),
                   "(query_len, key_len) or (batch * num_heads, query_len, key_len)")
        check_mask_dtype("attn_mask", attn_mask)
        if attn_mask.dim() == 3 and attn_mask.shape[0] != batch_size * num_heads:
            raise ValueError(
                f"a 3-D attn_mask must have batch_size * num_heads = {batch_size * num_heads} "
                f"masks, got shape {tuple(attn_mask.shape)}"
            )
    if key_padding_mask is None or attn_mask is None:
        return
    check_same_device("attn_mask", attn_mask, "key_padding_mask", key_padding_mask)
    if key_padding_mask.shape[1] != attn_mask.shape[-1]:
        raise ValueError(
            f"key_padding_mask and attn_mask must have the same key length, got shapes "
            f"{tuple(key_padding_mask.shape)} and {tuple(attn_mask.shape)}"
        )
