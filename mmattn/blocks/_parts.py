"""Parts the blocks share: the MLP, the block-level ``attn_mask`` shapes, argument checks.

Axis key: ``b`` batch, ``h`` heads, ``i`` query length, ``j`` key length, ``d`` model width.
"""

from __future__ import annotations

import torch
from einops import repeat
from torch import Tensor, nn

from mmattn import _checks as checks


def block_attn_mask(
    attn_mask: Tensor | None, batch_size: int, num_heads: int, q_len: int, k_len: int
) -> Tensor | None:
    """Accept a module-direction mask of shape (i, j), (b, i, j) or (b*h, i, j).

    A per-sample (b, i, j) mask is repeated for every head, as ``nn.MultiheadAttention``
    wants (b*h, i, j). Masks of other shapes raise ValueError naming ``attn_mask``.
    """
    if attn_mask is None:
        return None
    checks.check_tensor("attn_mask", attn_mask)
    checks.check_mask_dtype("attn_mask", attn_mask)
    shape = tuple(attn_mask.shape)
    if shape in ((q_len, k_len), (batch_size * num_heads, q_len, k_len)):
        return attn_mask
    if shape == (batch_size, q_len, k_len):
        return repeat(attn_mask, "b i j -> (b h) i j", h=num_heads)
    raise ValueError(
        f"attn_mask must have shape {(q_len, k_len)}, {(batch_size, q_len, k_len)} or "
        f"{(batch_size * num_heads, q_len, k_len)} (True = not allowed), got {shape}"
    )


class MLP(nn.Sequential):
    """The position-wise feed-forward network: Linear → GELU → Dropout → Linear → Dropout.

    Args:
        embed_dim: input and output width D.
        hidden_dim: inner width.
        dropout: dropout probability after the activation and after the output.
        bias: biases on both linear layers.
        device, dtype: factory arguments.

    Shape:
        - input: (..., D); returns (..., D)
    """

    def __init__(
        self,
        embed_dim: int,
        hidden_dim: int,
        dropout: float = 0.0,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        factory = checks.check_factory(device, dtype)
        super().__init__(
            nn.Linear(embed_dim, hidden_dim, bias=bias, **factory),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_dim, embed_dim, bias=bias, **factory),
            nn.Dropout(dropout),
        )

    def reset_parameters(self) -> None:
        self[0].reset_parameters()
        self[3].reset_parameters()


def check_common(
    embed_dim: object, num_heads: object, dropout: object, mlp_ratio: object, norm_eps: object
) -> int:
    checks.check_positive_int("embed_dim", embed_dim)
    checks.check_positive_int("num_heads", num_heads)
    checks.check_probability("dropout", dropout)
    checks.check_number("mlp_ratio", mlp_ratio, positive=True)
    checks.check_number("norm_eps", norm_eps, minimum=0.0)
    return max(1, round(embed_dim * mlp_ratio))
