"""The kernels behind the Hugging Face backend, and how a mask earns a fast one.

Axis key: ``b`` batch, ``h`` query heads, ``k`` key/value heads, ``g`` query heads per key
head, ``i`` query length, ``j`` key length, ``t`` tokens of a packed row, ``e`` head width,
``n`` items in a bucket.

transformers hands the backend a dense boolean mask (True = may attend) built by its own
``sdpa_mask``, so every pattern its models describe (causal, padding, sliding windows,
packed sequences, chunks, image blocks) arrives exactly as transformers means it. A faster
kernel runs only where the mask is *proved* to be the pattern that kernel computes:

- **sliding window**: the module passes ``sliding_window=w``; the mask must equal transformers'
  ``kv > q - w and kv <= q`` (``|q - kv| <= w`` for bidirectional windows) AND the real-key
  row read off the diagonal, bit for bit. Then :func:`mmattn.kernels.blocked.local_attend`
  runs it in O(L·w).
- **packed sequences** (``DataCollatorWithFlattening``): ``position_ids`` restart at 0 and the
  mask must equal "same sequence and causal". Then the bucketed packed kernel
  (:mod:`mmattn.kernels.packed`) runs each sequence on its own, never a (t, t) attention.
- **mostly empty tiles** (any other (b, 1, l, l) bool mask: Gemma 3's bidirectional images,
  a window over them, chunks, documents): when at least half of the mask's 64 × 64 tiles
  hold no allowed pair, :mod:`mmattn.integrations._hf_sparse` reads it once into a
  SparseMask and :mod:`mmattn.kernels.block_sparse` runs the non-empty tiles only, the
  partial ones masked exactly, so the numbers are the dense kernel's on the same mask.

The proof is one pass over the mask, remembered on the mask tensor (every layer of a forward
shares it). Anything else runs the dense kernel on the mask as given.

What is remembered is keyed on values, never on ``id()`` (Python reuses an id once its
object is collected): a proof is remembered on the mask it read (and that mask's in-place
version), with the ``position_ids`` it used compared by identity (a weak reference) and
else by value; the (l, l) bands compared with a window mask are kept by (length, window,
causality, device), at most :data:`BAND_CACHE_BYTES` of them.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from einops import rearrange
from torch import Tensor

from mmattn import _checks as checks
from mmattn.kernels import dense as _kernel
from mmattn.kernels._neighborhood_plan import ByteCache
from mmattn.kernels.blocked import local_attend
from mmattn.kernels.modifiers import Modifiers
from mmattn.kernels.packed import layout
from mmattn.kernels.packed import report as report_packed

_MEMO = "_mmattn_patterns"


def memo(mask: Tensor, key: tuple, compute) -> Any:
    """``compute()`` once per mask tensor (and in-place version), remembered on the tensor:
    the proofs here and the block-sparse plan of :mod:`mmattn.integrations._hf_sparse`."""
    store = getattr(mask, _MEMO, None)
    if store is None or store[0] != mask._version:
        store = (mask._version, {})
        try:
            setattr(mask, _MEMO, store)
        except (AttributeError, RuntimeError):  # a tensor that takes no attributes: no memo
            return compute()
    found = store[1]
    if key not in found:
        found[key] = compute()
    return found[key]


# ---------------------------------------------------------------------- padding only


def key_rows(mask: Tensor) -> Tensor:
    """``mask`` as (b, 1, 1, j) when every query row of it is the same (a padding-only mask).

    BERT-style models hand a (b, 1, i, j) mask that only says which keys are real; one row
    per item is the same mask for every kernel, and the dead-row bookkeeping then reads j
    entries per item instead of i·j.
    """
    if mask.dim() != 4 or mask.shape[-2] <= 1:
        return mask
    same = memo(mask, ("rows",), lambda: torch.equal(mask, mask[:, :, :1].expand_as(mask)))
    return mask[:, :, :1] if same else mask


# ---------------------------------------------------------------------- sliding window


def window_pattern(mask: Tensor, window: int) -> tuple[int, bool, Tensor | None] | None:
    """``(window_size, causal, key_mask)`` for local_attend when ``mask`` is a band, else None.

    Shape:
        - mask: (b, 1, l, l) bool, True = may attend
        - key_mask: (b, l) bool (True = real key), or None when every key is real
    """
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] != mask.shape[-2]:
        return None
    return memo(mask, ("window", window), lambda: _find_window(mask, window))


def _find_window(mask: Tensor, window: int) -> tuple[int, bool, Tensor | None] | None:
    length = mask.shape[-1]
    real = mask[:, 0].diagonal(dim1=-2, dim2=-1)  # (b, l): key j is real iff j sees itself
    all_real = bool(real.all())
    keys = None if all_real else rearrange(real, "b j -> b 1 1 j")
    # transformers' causal window: kv > q - w and kv <= q, i.e. 0 <= i - j <= w - 1; its
    # bidirectional window: |i - j| <= w
    for size, causal in ((window - 1, True), (window, False)):
        if size < 0:
            continue
        band = _band(length, size, causal, mask.device)
        if all_real:
            same = all(torch.equal(row, band) for row in mask[:, 0])
        else:
            same = torch.equal(mask, band & keys)
        if same:
            return size, causal, (None if all_real else real)
    return None


#: Bytes of (l, l) bands kept for the next forward (a band is 1 byte per entry: l = 4096
#: is 16 MiB). A band larger than this is built for its call and not kept.
BAND_CACHE_BYTES = 64 * 2**20
_BANDS = ByteCache(BAND_CACHE_BYTES)  # thread-safe, least recently used first out


def _band(length: int, size: int, causal: bool, device: torch.device) -> Tensor:
    """(l, l) bool: ``0 <= i - j <= size`` (causal) or ``|i - j| <= size``; kept for reuse
    (least recently used first out) while the kept bands fit in :data:`BAND_CACHE_BYTES`."""
    key = (length, size, causal, torch.device(device))
    band = _BANDS.get(key)
    if band is None:
        full = torch.ones(length, length, dtype=torch.bool, device=device)
        band = _BANDS.put(key, full.tril(0 if causal else size).triu_(-size), length * length)
    return band


def run_window(
    q: Tensor, k: Tensor, v: Tensor, pattern: tuple[int, bool, Tensor | None], *,
    dropout_p: float, scale: float, groups: int, modifiers: Modifiers | None = None,
) -> Tensor:
    """The blocked band kernel (with the call's sinks / softcap); (b, h, l, e) in and out."""
    size, causal, key_mask = pattern
    out, _ = local_attend(
        q, k, v, size, causal=causal, key_mask=key_mask, dropout_p=dropout_p, scale=scale,
        groups=groups, modifiers=modifiers,
    )
    return out


# ---------------------------------------------------------------------- packed sequences


def packed_lengths(mask: Tensor, position_ids: Tensor) -> list[int] | None:
    """Per-sequence lengths, row by row, when ``mask`` is transformers' packed causal mask.

    A sequence starts where ``position_ids`` does not step by one (transformers'
    ``find_packed_sequence_indices``). None when no row holds two sequences or the mask is
    anything else.

    Shape:
        - mask: (b, 1, t, t) bool; position_ids: (b | 1, t) integer
    """
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] != mask.shape[-2]:
        return None
    if position_ids.dim() != 2 or position_ids.shape[-1] != mask.shape[-1]:
        return None
    if position_ids.shape[0] not in (1, mask.shape[0]):
        return None
    key = ("packed", tuple(position_ids.shape), position_ids.dtype, position_ids.device)
    entry = memo(mask, key, lambda: _PackedProof(mask, position_ids))
    return entry.lengths(mask, position_ids)


class _PackedProof:
    """The lengths proved for one mask, and the ``position_ids`` they were read from.

    A later call hits when it passes the same tensor (same object, by weak reference, at the
    same in-place version: what every layer of one forward passes) or an equal one; any
    other ``position_ids`` is proved anew. Never an ``id()``, which Python reuses.
    """

    def __init__(self, mask: Tensor, position_ids: Tensor) -> None:
        self._prove(mask, position_ids)

    def _prove(self, mask: Tensor, position_ids: Tensor) -> None:
        self.result = _find_packed(mask, position_ids)
        self.values = position_ids.detach().clone()
        self._remember(position_ids)

    def _remember(self, position_ids: Tensor) -> None:
        try:
            self.ref: Any = weakref.ref(position_ids)
        except TypeError:  # pragma: no cover - every Tensor takes weak references
            self.ref = lambda: None
        self.version = position_ids._version

    def lengths(self, mask: Tensor, position_ids: Tensor) -> list[int] | None:
        if self.ref() is position_ids and self.version == position_ids._version:
            return self.result
        if torch.equal(self.values, position_ids):
            self._remember(position_ids)
        else:
            self._prove(mask, position_ids)
        return self.result


def _find_packed(mask: Tensor, position_ids: Tensor) -> list[int] | None:
    batch, _, length, _ = mask.shape
    pos = position_ids.to(mask.device).expand(batch, -1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos.diff(dim=-1) != 1
    if not bool(starts[:, 1:].any()):
        return None
    first = starts.flatten().nonzero().flatten()
    ends = torch.cat([first[1:], first.new_tensor([batch * length])])
    lengths = (ends - first).tolist()
    # Each sequence's diagonal block must be causal (lower-triangular, all of it), and nothing
    # else may be allowed: the blocks hold all of the mask's allowed entries.
    expected = sum(n * (n + 1) // 2 for n in lengths)
    if int(torch.count_nonzero(mask)) != expected:
        return None
    triangle = torch.ones(max(lengths), max(lengths), dtype=torch.bool, device=mask.device)
    triangle = triangle.tril_()
    for start, n in zip(first.tolist(), lengths):
        row, col = divmod(start, length)
        if not torch.equal(mask[row, 0, col:col + n, col:col + n], triangle[:n, :n]):
            return None
    return lengths


def run_packed(
    q: Tensor, k: Tensor, v: Tensor, lengths: list[int], *, dropout_p: float, scale: float,
    groups: int, modifiers: Modifiers | None = None,
) -> Tensor:
    """Causal attention of each packed sequence alone, bucket by bucket (no (t, t) scores).

    The rows of every row of the batch are one list of sequences; the bucket plan of
    :mod:`mmattn.kernels.packed` gathers sequences of similar length, pads each to its
    bucket (repeating its own last row), and runs one causal call per bucket.

    Shape:
        - q: (b, h, t, e); k, v: (b, k, t, e); returns (b, h, t, e)
    """
    batch, heads, _, width = q.shape
    rows = [rearrange(x, "b h t e -> (b t) h e") for x in (q, k, v)]
    lens = tuple(lengths)
    plan = layout(lens, lens, lens, (), heads * width, q.device)
    if _kernel.reporting():
        sizes = [(len(b.items), b.q_len, b.k_len) for b in plan.buckets]
        report_packed("hf-buckets", [], buckets=sizes, q_lengths=list(lens), is_causal=True)
    sizes = [len(b.items) * b.q_len for b in plan.buckets]
    qs = rows[0].index_select(0, plan.q_index).split(sizes)
    ks = rows[1].index_select(0, plan.k_index).split(sizes)
    vs = rows[2].index_select(0, plan.k_index).split(sizes)
    outs = []
    for index, bucket in enumerate(plan.buckets):
        n = len(bucket.items)
        qb, kb, vb = (
            rearrange(x[index], "(n i) h e -> n h i e", n=n) for x in (qs, ks, vs)
        )
        out, _ = _kernel.attend(
            qb, kb, vb, plan.key_masks[index], dropout_p=dropout_p, is_causal=True,
            scale=scale, report_path=False, groups=groups, modifiers=modifiers,
        )
        outs.append(rearrange(out, "n h i e -> (n i) h e"))
    outs.append(q.new_zeros(1, heads, v.shape[-1]))  # the row of sequences left out (none)
    out = torch.cat(outs).index_select(0, plan.rows)
    return rearrange(out, "(b t) h e -> b h t e", b=batch)


# ---------------------------------------------------------------------- score modifiers


def score_modifiers(
    who: str, query: Tensor, s_aux: object, softcap: float | None
) -> Modifiers | None:
    """gpt-oss's sinks (``s_aux``) and Gemma 2's cap as the kernels' score modifiers (None:
    neither); ``softcap`` was checked with the other inputs (a number > 0).

    ``s_aux`` is one logit per query head of ``query`` (b, h, i, e): a floating tensor of
    shape (h,) on query's device, of any floating dtype (under autocast a float32 sink
    parameter meets bf16 queries). Its values are not read (no host sync): ``-inf`` is a sink
    that takes nothing, NaN gives NaN rows as in transformers' eager path.

    Raises:
        TypeError: ``s_aux`` is not a tensor, or not of a floating dtype.
        ValueError: ``s_aux`` is not one logit per query head, shape (h,), or lies on
            another device than query.
    """
    if s_aux is not None:
        heads = query.shape[1]
        if not isinstance(s_aux, Tensor) or not s_aux.is_floating_point():
            got = s_aux.dtype if isinstance(s_aux, Tensor) else type(s_aux).__name__
            raise TypeError(
                f"{who}: s_aux (attention sinks) must be a floating tensor of one logit per "
                f"query head, shape ({heads},), got {got}"
            )
        if s_aux.shape != (heads,):
            raise ValueError(
                f"{who}: s_aux (attention sinks) must be one logit per query head, shape "
                f"({heads},), got {tuple(s_aux.shape)}"
            )
        checks.check_same_device(f"{who}: s_aux (attention sinks)", s_aux, "query", query)
    mods = Modifiers(sinks=s_aux, softcap=None if softcap is None else float(softcap))
    return mods if mods else None
