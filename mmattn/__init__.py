"""mmattn: multi-modal attention components for PyTorch."""

from mmattn import functional, masks
from mmattn.attention import CrossAttention, MultiHeadAttention
from mmattn.tokens import Tokens

__version__ = "0.1.0"

__all__ = [
    "CrossAttention",
    "MultiHeadAttention",
    "Tokens",
    "functional",
    "masks",
]
