"""What models are built from: transformer blocks, multi-modal fusion and pooling.

- :mod:`~mmattn.blocks.transformer` — :class:`TransformerBlock`, :class:`CrossAttentionBlock`,
  :class:`Encoder`;
- :mod:`~mmattn.blocks.fusion` — :class:`MultiModalEncoder`;
- :mod:`~mmattn.blocks.pooling` — masked pooling and attention pooling.

Blocks take any attention layer by name, class or callable (:mod:`mmattn.registry`).
"""

from mmattn.blocks.fusion import MultiModalEncoder
from mmattn.blocks.pooling import AttentionPool, MaskedPool, masked_max, masked_mean
from mmattn.blocks.transformer import MLP, CrossAttentionBlock, Encoder, TransformerBlock

__all__ = [
    "MLP",
    "AttentionPool",
    "CrossAttentionBlock",
    "Encoder",
    "MaskedPool",
    "MultiModalEncoder",
    "TransformerBlock",
    "masked_max",
    "masked_mean",
]
