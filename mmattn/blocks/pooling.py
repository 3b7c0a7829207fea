"""Masked pooling: one vector per sequence from Tokens, padding ignored.

Axis key: ``b`` batch, ``l`` sequence length, ``d`` model width.

- :func:`masked_mean` / :func:`masked_max` — the mean / max over real tokens;
- :class:`MaskedPool` — either of those, or the first token (a class token), as a module;
- :class:`AttentionPool` — a learned query attends the real tokens (one cross-attention).

A sequence with no real token (all padding, or length 0) pools to a zero vector, never NaN;
padded positions never influence the result, whatever they hold (NaN and Inf included).
Packed Tokens (a jagged ``x``) pool per item with segment reductions over the (t, d) values,
no padding built.
"""

from __future__ import annotations

import torch
from einops import repeat
from torch import Tensor, nn

from mmattn import _checks as checks
from mmattn.attention._fx import FX_ROOT, fx_leaf
from mmattn.attention.cross import CrossAttention
from mmattn.kernels.packed import contiguous_parts, jagged, owners
from mmattn.tokens import Tokens, check_tokens

__all__ = ["masked_mean", "masked_max", "MaskedPool", "AttentionPool"]

_MODES = ("mean", "max", "first")


def masked_mean(tokens: Tokens) -> Tensor:
    r"""The mean of the real tokens of each sequence.

    .. math:: y_b = \frac{\sum_l m_{b,l}\, x_{b,l}}{\max(1, \sum_l m_{b,l})}

    Shape:
        - tokens: x (B, L, D), mask (B, L)
        - returns: (B, D)

    Raises:
        TypeError: ``tokens`` is not Tokens.

    Examples:
        >>> t = Tokens(torch.tensor([[[1.0], [3.0], [100.0]]]), torch.tensor([[1, 1, 0]]).bool())
        >>> masked_mean(t).tolist()
        [[2.0]]
    """
    check_tokens("tokens", tokens)
    if tokens.is_packed:
        values, offsets = contiguous_parts(tokens.x)
        owner = owners(offsets, values.shape[0])
        sums = values.new_zeros(offsets.shape[0] - 1, values.shape[1]).index_add(0, owner, values)
        return sums / offsets.diff().clamp_min(1)[:, None].to(values.dtype)
    if tokens.mask is None:
        return tokens.x.sum(dim=1) / max(tokens.length, 1)
    count = tokens.mask.sum(dim=1, keepdim=True).clamp_min(1).to(tokens.dtype)  # (b, 1)
    return tokens.zero_padding().sum(dim=1) / count


def masked_max(tokens: Tokens) -> Tensor:
    """The elementwise max over the real tokens of each sequence (0 when there are none).

    Shape:
        - tokens: x (B, L, D), mask (B, L)
        - returns: (B, D)

    Raises:
        TypeError: ``tokens`` is not Tokens.

    Examples:
        >>> t = Tokens(torch.tensor([[[1.0], [3.0], [100.0]]]), torch.tensor([[1, 1, 0]]).bool())
        >>> masked_max(t).tolist()
        [[3.0]]
    """
    check_tokens("tokens", tokens)
    if tokens.is_packed:
        values, offsets = contiguous_parts(tokens.x)
        owner = owners(offsets, values.shape[0])[:, None].expand_as(values)
        out = values.new_zeros(offsets.shape[0] - 1, values.shape[1])
        return out.scatter_reduce(0, owner, values, "amax", include_self=False)
    if tokens.length == 0:
        return tokens.x.new_zeros(tokens.batch_size, tokens.dim)
    if tokens.mask is None:
        return tokens.x.amax(dim=1)
    real = tokens.mask[..., None]
    out = torch.where(real, tokens.x, float("-inf")).amax(dim=1)
    return torch.where(real.any(dim=1), out, out.new_zeros(()))


class MaskedPool(nn.Module):
    """Pool Tokens to one vector per sequence: "mean", "max" or "first" (class token).

    Args:
        mode: "mean" (:func:`masked_mean`), "max" (:func:`masked_max`) or "first" (the token
            at position 0, e.g. a prepended class token; 0 when it is padding or L = 0).

    Shape:
        - tokens: x (B, L, D), mask (B, L); returns (B, D)

    Raises:
        ValueError: unknown ``mode``.
        TypeError: ``tokens`` is not Tokens.

    Examples:
        >>> MaskedPool("mean")(Tokens(torch.ones(2, 4, 8))).shape
        torch.Size([2, 8])
    """

    _fx_root = FX_ROOT  # torch.fx: this module is a leaf, also as the traced root

    def __init__(self, mode: str = "mean") -> None:
        super().__init__()
        self.mode = checks.check_choice("mode", mode, _MODES)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}"

    def forward(self, tokens: Tokens) -> Tensor:
        traced = fx_leaf(self, (tokens,), {})
        if traced is not None:  # torch.fx: one call_module node (attention/_fx.py)
            return traced
        if self.mode == "mean":
            return masked_mean(tokens)
        if self.mode == "max":
            return masked_max(tokens)
        check_tokens("tokens", tokens)
        if tokens.is_packed:  # the first token of each item; zeros for an empty item
            values, offsets = contiguous_parts(tokens.x)
            if values.shape[0] == 0:
                return values.new_zeros(offsets.shape[0] - 1, values.shape[1])
            first = values[offsets[:-1].clamp(max=values.shape[0] - 1)]
            return torch.where((offsets.diff() > 0)[:, None], first, 0.0)
        if tokens.length == 0:
            return tokens.x.new_zeros(tokens.batch_size, tokens.dim)
        return tokens.zero_padding()[:, 0]


class AttentionPool(nn.Module):
    r"""A learned query attends the real tokens: attention-weighted pooling.

    .. math:: y_b = \mathrm{CrossAttn}(q, x_b)

    Args:
        embed_dim: token width D.
        num_heads: attention heads; must divide ``embed_dim``.
        device, dtype: factory arguments.

    Shape:
        - tokens: x (B, L, D), mask (B, L); returns (B, D)

    Raises:
        TypeError: ``tokens`` is not Tokens, or its dtype differs from the parameters'.
        ValueError: ``tokens`` width differs from ``embed_dim``, or it is on another device.

    Examples:
        >>> AttentionPool(16, 2)(Tokens(torch.randn(3, 5, 16))).shape
        torch.Size([3, 16])
    """

    _fx_root = FX_ROOT  # torch.fx: this module is a leaf, also as the traced root

    def __init__(
        self,
        embed_dim: int,
        num_heads: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        checks.check_positive_int("embed_dim", embed_dim)
        dtype = checks.check_factory_dtype("dtype", dtype)
        self.embed_dim = embed_dim
        self.query = nn.Parameter(torch.empty(1, 1, embed_dim, device=device, dtype=dtype))
        self.attn = CrossAttention(embed_dim, num_heads, device=device, dtype=dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.query, std=0.02)
        self.attn.reset_parameters()

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.attn.num_heads}"

    def forward(self, tokens: Tokens) -> Tensor:
        traced = fx_leaf(self, (tokens,), {})
        if traced is not None:  # torch.fx: one call_module node (attention/_fx.py)
            return traced
        check_tokens("tokens", tokens, self.embed_dim, like=self.query)
        if tokens.is_packed:  # one query per item, as a packed batch of length-1 items
            batch = tokens.batch_size
            offsets = torch.arange(batch + 1, device=tokens.device)
            query = jagged(repeat(self.query, "1 1 d -> b d", b=batch), offsets)
            out, _ = self.attn(query, tokens.x, tokens.x)
            return out.values()
        query = repeat(self.query, "1 1 d -> b 1 d", b=tokens.batch_size)
        x = tokens.zero_padding()
        out, _ = self.attn(query, x, x, key_padding_mask=tokens.key_padding_mask)
        return out[:, 0]
