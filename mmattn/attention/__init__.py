"""Attention layers: one file a layer, each a module that owns its projections.

- :mod:`~mmattn.attention.mha` — :class:`MultiHeadAttention`, the drop-in core every other
  layer subclasses;
- :mod:`~mmattn.attention.cross`, :mod:`~mmattn.attention.local`,
  :mod:`~mmattn.attention.additive`, :mod:`~mmattn.attention.linformer`,
  :mod:`~mmattn.attention.edge`, :mod:`~mmattn.attention.neighborhood` — the variants.

Layers call the parameter-free kernels in :mod:`mmattn.kernels`; nothing here imports
:mod:`mmattn.blocks`. The private helpers beside them (``_interop``, ``_packed``, ...) are
the layer side of torch interop, packed input and decoding.
"""

from mmattn.attention.additive import AdditiveAttention
from mmattn.attention.cross import CrossAttention
from mmattn.attention.edge import EdgeAttention
from mmattn.attention.linformer import LinformerAttention
from mmattn.attention.local import LocalAttention
from mmattn.attention.mha import MultiHeadAttention
from mmattn.attention.neighborhood import NeighborhoodAttention

__all__ = [
    "AdditiveAttention",
    "CrossAttention",
    "EdgeAttention",
    "LinformerAttention",
    "LocalAttention",
    "MultiHeadAttention",
    "NeighborhoodAttention",
]
