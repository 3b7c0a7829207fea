"""The Hugging Face backend's block-sparse path: a mask whose tiles are mostly empty.

Axis key: ``b`` batch, ``h`` query heads, ``k`` key/value heads, ``l`` length (query = key),
``e`` head width.

transformers hands the backend one dense (b, 1, l, l) bool mask per kind of layer and
forward: causal with images bidirectional (Gemma 3, PaliGemma), sliding windows over
such a mask, chunks, packed documents, padding. When at least half of its 64 × 64 tiles
hold no allowed pair (:data:`MAX_DENSITY`), the mask is read once into a
:class:`~mmattn.patterns.SparseMask` (:func:`mmattn.patterns._dense_tiles.sparse_from_dense`)
and every layer given that mask runs :mod:`mmattn.kernels.block_sparse` on its non-empty
tiles, with the partial tiles masked exactly: the numbers of the dense kernel on the same
mask. Classification and the kernel's bucket plan are remembered on the mask tensor (as the
proofs of :mod:`mmattn.integrations._hf_patterns`); a mask denser than that, a per-head
mask, or a call under ``torch.compile`` / ``torch.export`` runs the dense kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmattn.integrations._hf_patterns import memo
from mmattn.kernels import block_sparse
from mmattn.patterns._dense_tiles import sparse_from_dense

#: The tile width the mask is classified at.
BLOCK = 64
#: A mask runs block-sparse when at most this share of its tiles is non-empty.
MAX_DENSITY = 0.5


def sparse_plan(mask: Tensor, query: Tensor) -> block_sparse.TilePlan | None:
    """The block-sparse kernel's plan for ``mask``, or None when it should run dense.

    Shape:
        - mask: (b | 1, 1, l, l) bool, True = may attend; query: (b, h, l, e)
    """
    batch, heads, length, width = query.shape
    if mask.dim() != 4 or mask.shape[1] != 1 or tuple(mask.shape[-2:]) != (length, length):
        return None
    if length <= BLOCK or mask.shape[0] not in (1, batch):
        return None
    if torch.compiler.is_compiling() or mask.device.type == "meta":
        return None
    sparse = memo(mask, ("block-sparse", BLOCK, batch), lambda: _classify(mask, batch))
    return None if sparse is None else sparse.plan(heads * width)


def _classify(mask: Tensor, batch: int):
    rows = mask[:, 0]
    if rows.shape[0] > 1 and rows.stride(0) == 0:  # one item expanded over the batch
        rows = rows[:1]
    return sparse_from_dense(rows, BLOCK, batch=batch, max_density=MAX_DENSITY)


def try_sparse(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, modifiers: object, *,
    dropout_p: float, scale: float, need_weights: bool, groups: int,
) -> tuple[Tensor, Tensor | None] | None:
    """Attention over the non-empty tiles of a bool self-attention ``mask`` that is at least
    half empty: (b, h, l, e) in and out, weights (b, h, l, l); None where the call runs on
    another kernel (no such mask). ``modifiers`` (gpt-oss's ``s_aux``, a softcap) run on
    the tiles."""
    if mask is None or mask.dtype != torch.bool:
        return None
    if q.shape[-2] != k.shape[-2]:
        return None
    plan = sparse_plan(mask, q)
    if plan is None:
        return None
    return block_sparse.attend(
        q, k, v, plan, dropout_p=dropout_p, scale=scale, need_weights=need_weights,
        groups=groups, modifiers=modifiers,
    )
