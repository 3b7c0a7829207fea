"""mmattn: multi-modal attention components for PyTorch."""

from mmattn import cache, debug, distributed, functional, masks, position, registry, rotary
from mmattn.additive import AdditiveAttention
from mmattn.attention import MultiHeadAttention
from mmattn.blocks import CrossAttentionBlock, Encoder, TransformerBlock
from mmattn.cross import CrossAttention
from mmattn.fusion import MultiModalEncoder
from mmattn.linformer import LinformerAttention
from mmattn.local import LocalAttention
from mmattn.pooling import AttentionPool, MaskedPool, masked_max, masked_mean
from mmattn.registry import available_attention, register_attention
from mmattn.replace import replace_attention
from mmattn.tokens import Tokens

__version__ = "0.1.0"

__all__ = [
    "AdditiveAttention",
    "AttentionPool",
    "CrossAttention",
    "CrossAttentionBlock",
    "Encoder",
    "LinformerAttention",
    "LocalAttention",
    "MaskedPool",
    "MultiHeadAttention",
    "MultiModalEncoder",
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
    "position",
    "register_attention",
    "registry",
    "replace_attention",
    "rotary",
]
