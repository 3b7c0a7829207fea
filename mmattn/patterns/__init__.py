"""Attention patterns: which token may attend which, compiled to a block-sparse kernel.

``from mmattn import patterns as P``, then build a pattern from the primitives and ``&``,
``|``, ``~``::

    P.same("documents") & P.causal()                     # packed documents, causal in each
    P.per_modality(within={"text": P.causal(), "image": P.neighborhood(7)},
                   across=P.modality(query="text") | P.modality(key="text"))

A :class:`Pattern` reads token attributes from ``Tokens.meta`` (spans, modality ids,
segments, grids, ``edge_index``); ``pattern.dense(tokens)`` is the (B, L, L) reference,
``pattern.compile(tokens)`` the :class:`SparseMask` that ``MultiHeadAttention(...,
attn_mask=mask)`` and ``Encoder(..., pattern=...)`` run on the non-empty tiles only, and
``pattern.mask_mod(tokens)`` the same rule for FlexAttention. See docs/patterns.md.
"""

from mmattn.patterns._attributes import modality, per_modality, runs, same
from mmattn.patterns._base import Pattern
from mmattn.patterns._geometry import edges, neighborhood
from mmattn.patterns._positions import causal, chunked, full, window
from mmattn.patterns._sparse_mask import SparseMask

__all__ = [
    "Pattern",
    "SparseMask",
    "causal",
    "chunked",
    "edges",
    "full",
    "modality",
    "neighborhood",
    "per_modality",
    "runs",
    "same",
    "window",
]
