"""mmattn: multi-modal attention components for PyTorch."""

from mmattn import (
    cache,
    debug,
    distributed,
    functional,
    masks,
    patterns,
    position,
    registry,
    rotary,
)
from mmattn.attention.additive import AdditiveAttention
from mmattn.attention.cross import CrossAttention
from mmattn.attention.edge import EdgeAttention
from mmattn.attention.linformer import LinformerAttention
from mmattn.attention.local import LocalAttention
from mmattn.attention.mha import MultiHeadAttention
from mmattn.attention.neighborhood import NeighborhoodAttention
from mmattn.blocks.fusion import MultiModalEncoder
from mmattn.blocks.pooling import AttentionPool, MaskedPool, masked_max, masked_mean
from mmattn.blocks.transformer import CrossAttentionBlock, Encoder, TransformerBlock
from mmattn.integrations.torch import replace_attention
from mmattn.registry import available_attention, register_attention
from mmattn.tokens import Tokens

__version__ = "0.1.0"

__all__ = [
    "AdditiveAttention",
    "AttentionPool",
    "CrossAttention",
    "CrossAttentionBlock",
    "EdgeAttention",
    "Encoder",
    "LinformerAttention",
    "LocalAttention",
    "MaskedPool",
    "MultiHeadAttention",
    "MultiModalEncoder",
    "NeighborhoodAttention",
    "Tokens",
    "TransformerBlock",
    "available_attention",
    "cache",
    "debug",
    "distributed",
    "functional",
    "masked_max",
    "masked_mean",
    "masks",
    "patterns",
    "position",
    "register_attention",
    "registry",
    "replace_attention",
    "rotary",
]
