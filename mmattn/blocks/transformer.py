"""Transformer blocks that take and return :class:`~mmattn.tokens.Tokens`.

Axis key: ``b`` batch, ``i`` query length, ``j`` key (context) length, ``d`` model width,
``h`` heads.

Every block is pre-norm (``x + f(norm(x))``) and respects ``Tokens.mask`` end to end: padded
keys are never attended, padded positions are zeroed on entry and on exit, so changing the
values at padded positions never moves a real output, and padded outputs are exactly 0.

- :class:`TransformerBlock` — self-attention (any variant: a name from
  :mod:`mmattn.registry`, a class or a callable) and an MLP.
- :class:`CrossAttentionBlock` — query Tokens attend context Tokens, then an MLP.
- :class:`Encoder` — a stack of :class:`TransformerBlock` and a final LayerNorm.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from mmattn import _checks as checks
from mmattn.attention._fx import FX_ROOT, fx_leaf
from mmattn.attention.cross import CrossAttention
from mmattn.attention.mha import MultiHeadAttention
from mmattn.blocks._packed import attend_packed, check_same_layout
from mmattn.blocks._parts import MLP, block_attn_mask, check_common
from mmattn.blocks._pattern import block_forward, check_pattern, encoder_forward, uses_pattern
from mmattn.blocks._streaming import StreamingEncoder
from mmattn.cache import ContextCache, EncoderCache
from mmattn.kernels.packed import contiguous_parts, jagged
from mmattn.patterns import Pattern
from mmattn.registry import AttentionSpec, build_attention, resolve_attention
from mmattn.tokens import Tokens, check_tokens

__all__ = ["TransformerBlock", "CrossAttentionBlock", "Encoder", "MLP"]


class TransformerBlock(nn.Module):
    r"""Pre-norm transformer block on Tokens: self-attention then an MLP, both residual.

    .. math::
        x' = x + \mathrm{Attn}(\mathrm{LN}_1(x)), \qquad y = x' + \mathrm{MLP}(\mathrm{LN}_2(x'))

    Attention never looks at padded keys (``tokens.key_padding_mask``); padded positions are
    zeroed on entry and exit, so the output at a padded position is exactly 0 and the values
    stored there never reach a real token.

    Args:
        embed_dim: model width D.
        num_heads: attention heads H; must divide ``embed_dim``.
        dropout: dropout on the attention weights and in the MLP.
        bias: biases in the attention projections and the MLP.
        mlp_ratio: MLP hidden width as a multiple of ``embed_dim``.
        attention: a registered name — "full" (:class:`~mmattn.MultiHeadAttention`),
            "local" (:class:`~mmattn.LocalAttention`), "additive", "linformer", or any
            name given to :func:`~mmattn.registry.register_attention` — an attention class,
            or a callable; called as ``attention(embed_dim, num_heads, dropout=, bias=,
            device=, dtype=, **attention_kwargs)``.
        window_size: the local window, passed to the attention (required for "local");
            the same as ``attention_kwargs={"window_size": w}``.
        causal: query i sees only keys j <= i — ``is_causal=True`` on every call, for every
            variant (one that cannot be causal, e.g. "linformer", raises in ``forward``).
        norm_eps: LayerNorm epsilon.
        device, dtype: factory arguments.
        attention_kwargs: more arguments for the attention (``num_kv_heads``, ``position``,
            ``seq_len``/``proj_len`` for "linformer", ...).
        pattern: a :mod:`mmattn.patterns` Pattern, compiled on each call's Tokens and run
            block-sparse (MultiHeadAttention only; packed Tokens run padded; docs/patterns.md).

    Shape:
        - tokens: Tokens with x (B, L, D), mask (B, L)
        - attn_mask: module direction (True = not allowed) or additive, (L, L), (B, L, L)
          or (B * H, L, L); or a :class:`~mmattn.patterns.SparseMask`
        - returns: Tokens with x (B, L, D), the same mask and meta

    Raises:
        TypeError: ``tokens`` is not Tokens or has another dtype than the parameters; bad
            argument types.
        ValueError: ``tokens`` width differs from ``embed_dim``, or it lives on another
            device; ``norm_eps`` < 0 or ``mlp_ratio`` <= 0; an unknown ``attention`` name
            (the message lists the known ones); an argument the attention does not take,
            or a required one missing (``window_size`` for "local"); ``attn_mask`` of the
            wrong shape.

    Examples:
        >>> block = TransformerBlock(embed_dim=16, num_heads=2)
        >>> t = Tokens(torch.randn(2, 5, 16), torch.tensor([[1, 1, 1, 0, 0], [1] * 5]).bool())
        >>> out = block(t)
        >>> out.x.shape, out.x[0, 3:].abs().sum().item()
        (torch.Size([2, 5, 16]), 0.0)
    """

    _fx_root = FX_ROOT  # torch.fx: this module is a leaf, also as the traced root

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        *,
        mlp_ratio: float = 4.0,
        attention: AttentionSpec = "full",
        window_size: int | None = None,
        causal: bool = False,
        norm_eps: float = 1e-5,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        attention_kwargs: Mapping[str, Any] | None = None,
        pattern: Pattern | None = None,
    ) -> None:
        super().__init__()
        hidden = check_common(embed_dim, num_heads, dropout, mlp_ratio, norm_eps)
        label, _ = resolve_attention(attention)
        kwargs = checks.check_meta("attention_kwargs", attention_kwargs)
        if window_size is not None:
            checks.check_positive_int("window_size", window_size, minimum=0)
            kwargs["window_size"] = window_size
        factory = checks.check_factory(device, dtype)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.mlp_ratio = mlp_ratio
        self.attention = label
        self.causal = checks.check_bool("causal", causal)
        self.window_size = window_size
        self.pattern = check_pattern(pattern)
        self.norm1 = nn.LayerNorm(embed_dim, eps=norm_eps, **factory)
        self.attn = build_attention(
            attention, embed_dim, num_heads, dropout=dropout, bias=bias, attention_kwargs=kwargs,
            **factory,
        )
        self.norm2 = nn.LayerNorm(embed_dim, eps=norm_eps, **factory)
        self.mlp = MLP(embed_dim, hidden, dropout, bias, **factory)

    def reset_parameters(self) -> None:
        for module in (self.norm1, self.attn, self.norm2, self.mlp):
            module.reset_parameters()

    def extra_repr(self) -> str:
        parts = [
            f"embed_dim={self.embed_dim}",
            f"num_heads={self.num_heads}",
            f"mlp_ratio={self.mlp_ratio}",
            f"attention={self.attention!r}",
        ]
        if self.window_size is not None:
            parts.append(f"window_size={self.window_size}")
        if self.causal:
            parts.append("causal=True")
        return ", ".join(parts)

    def geometry(self, meta: dict[str, Any]) -> dict[str, Any]:
        """What the attention layer takes from ``Tokens.meta`` (its ``geometry(meta)``)."""
        if isinstance(self.attn, MultiHeadAttention):
            return self.attn.geometry(meta)
        return {}

    def packed_rows(
        self,
        values: Tensor,
        offsets: Tensor,
        attn_mask: Tensor | None,
        geometry: dict[str, Any] | None = None,
    ) -> Tensor:
        """The block on packed rows (t, D) with item ``offsets`` (b + 1,); returns (t, D).

        ``attn_mask`` is already in the shape :func:`block_attn_mask` returns; ``geometry``
        is what :meth:`geometry` returned for the Tokens' meta.
        """
        kwargs = {"is_causal": True} if self.causal else {}
        kwargs.update(geometry or {})
        h = self.norm1(values)
        values = values + attend_packed(self.attn, h, offsets, attn_mask=attn_mask, **kwargs)
        return values + self.mlp(self.norm2(values))

    def forward(
        self, tokens: Tokens, attn_mask: Tensor | None = None, *, cache: Any = None
    ) -> Tokens:
        """Self-attend and transform ``tokens``; see the class docstring.

        ``cache`` (``block.attn.make_cache(...)``) decodes step by step (causal blocks) or
        streams one chunk (a ChunkCache): ``tokens`` are the new tokens (docs/streaming.md).
        """
        traced = fx_leaf(self, (tokens,), {"attn_mask": attn_mask, "cache": cache})
        if traced is not None:  # torch.fx: one call_module node (attention/_fx.py)
            return traced
        check_tokens("tokens", tokens, self.embed_dim, like=checks.first_param(self))
        if uses_pattern(self.pattern, attn_mask):  # block-sparse: blocks/_pattern.py
            return block_forward(self, tokens, attn_mask, cache)
        attn_mask = block_attn_mask(
            attn_mask, tokens.batch_size, self.num_heads, tokens.length, tokens.length
        )
        if tokens.is_packed:  # norms and MLP on the (t, d) values; attention per item
            if cache is not None:
                raise ValueError("cache= does not take packed Tokens; decode padded Tokens")
            values, offsets = contiguous_parts(tokens.x)
            rows = self.packed_rows(values, offsets, attn_mask, self.geometry(tokens.meta))
            return tokens.replace(jagged(rows, offsets))
        return self._padded(tokens, attn_mask, cache=cache)

    def _padded(self, tokens: Tokens, attn_mask: Any, *, own: bool = False,
                cache: Any = None, attend: Any = None) -> Tokens:
        """The block on padded Tokens; ``own``: ``attn_mask`` was compiled from these Tokens
        with the causal rule (no key padding or ``is_causal`` to add). ``attend``: what runs
        the attention with ``self.attn``'s call (default ``self.attn``; context parallelism,
        :mod:`mmattn.distributed`, gives its own)."""
        x = tokens.zero_padding()
        h = self.norm1(x)
        kwargs = {"is_causal": True} if self.causal and not own else {}
        kwargs.update(self.geometry(tokens.meta))
        if cache is not None:
            kwargs["cache"] = cache
        padding = None if own else tokens.key_padding_mask
        attend = self.attn if attend is None else attend
        attn, _ = attend(h, h, h, key_padding_mask=padding, attn_mask=attn_mask, **kwargs)
        x = x + attn
        x = x + self.mlp(self.norm2(x))
        return tokens.replace(tokens.zero_padding(x))


class CrossAttentionBlock(nn.Module):
    r"""Pre-norm cross-attention block: query Tokens attend context Tokens, then an MLP.

    .. math::
        x' = x + \mathrm{CrossAttn}(\mathrm{LN}_q(x), \mathrm{LN}_c(c)), \qquad
        y = x' + \mathrm{MLP}(\mathrm{LN}_2(x'))

    Padded context tokens are never attended; padded query positions come out as 0. A query
    whose context is entirely padding receives a zero attention result (never NaN).

    Args:
        embed_dim: query (and output) width D.
        num_heads: attention heads H; must divide ``embed_dim``.
        dropout: dropout on the attention weights and in the MLP.
        bias: biases in the projections and the MLP.
        kdim: context width (default ``embed_dim``).
        mlp_ratio: MLP hidden width as a multiple of ``embed_dim``.
        norm_eps: LayerNorm epsilon.
        device, dtype: factory arguments.

    Shape:
        - query: Tokens with x (B, L, D); context: Tokens with x (B, S, kdim)
        - attn_mask: module direction or additive, (L, S), (B, L, S) or (B * H, L, S)
        - returns: Tokens with x (B, L, D), the query's mask and meta

    Raises:
        TypeError: ``query`` or ``context`` is not Tokens.
        ValueError: widths differ from ``embed_dim`` / ``kdim``; batch sizes differ;
            ``attn_mask`` of the wrong shape.

    Examples:
        >>> block = CrossAttentionBlock(embed_dim=16, num_heads=2, kdim=8)
        >>> out = block(Tokens(torch.randn(2, 3, 16)), Tokens(torch.randn(2, 7, 8)))
        >>> out.x.shape
        torch.Size([2, 3, 16])
    """

    _fx_root = FX_ROOT  # torch.fx: this module is a leaf, also as the traced root

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        *,
        kdim: int | None = None,
        mlp_ratio: float = 4.0,
        norm_eps: float = 1e-5,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        hidden = check_common(embed_dim, num_heads, dropout, mlp_ratio, norm_eps)
        kdim = checks.check_positive_int("kdim", embed_dim if kdim is None else kdim)
        factory = checks.check_factory(device, dtype)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.kdim = kdim
        self.mlp_ratio = mlp_ratio
        self.norm_query = nn.LayerNorm(embed_dim, eps=norm_eps, **factory)
        self.norm_context = nn.LayerNorm(kdim, eps=norm_eps, **factory)
        self.attn = CrossAttention(embed_dim, num_heads, dropout, bias, kdim=kdim, **factory)
        self.norm2 = nn.LayerNorm(embed_dim, eps=norm_eps, **factory)
        self.mlp = MLP(embed_dim, hidden, dropout, bias, **factory)

    def reset_parameters(self) -> None:
        for module in (self.norm_query, self.norm_context, self.attn, self.norm2, self.mlp):
            module.reset_parameters()

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, kdim={self.kdim}, "
            f"mlp_ratio={self.mlp_ratio}"
        )

    def forward(
        self,
        query: Tokens,
        context: Tokens,
        attn_mask: Tensor | None = None,
        *,
        cache: ContextCache | None = None,
    ) -> Tokens:
        """Let ``query`` attend ``context``; see the class docstring.

        ``cache`` (from ``block.attn.make_cache(...)``) keeps the projected context of the
        first call, so decoding steps do not project it again.
        """
        traced = fx_leaf(self, (query, context), {"attn_mask": attn_mask, "cache": cache})
        if traced is not None:  # torch.fx: one call_module node (attention/_fx.py)
            return traced
        param = checks.first_param(self)
        check_tokens("query", query, self.embed_dim, like=param)
        check_tokens("context", context, self.kdim, "kdim", like=param)
        check_same_layout("query", query, "context", context)
        if query.batch_size != context.batch_size:
            raise ValueError(
                f"query and context must have the same batch size, got {query.batch_size} "
                f"and {context.batch_size}"
            )
        attn_mask = block_attn_mask(
            attn_mask, query.batch_size, self.num_heads, query.length, context.length
        )
        if query.is_packed:
            if cache is not None:
                raise ValueError("cache= does not take packed Tokens; decode padded Tokens")
            values, offsets = contiguous_parts(query.x)
            c_values, c_offsets = contiguous_parts(context.x)
            values = values + attend_packed(
                self.attn, self.norm_query(values), offsets,
                (self.norm_context(c_values), c_offsets), attn_mask=attn_mask,
            )
            values = values + self.mlp(self.norm2(values))
            return query.replace(jagged(values, offsets))
        x = query.zero_padding()
        c = self.norm_context(context.zero_padding())
        kwargs = {} if cache is None else {"cache": cache}
        attn, _ = self.attn(
            self.norm_query(x), c, c, key_padding_mask=context.key_padding_mask,
            attn_mask=attn_mask, **kwargs,
        )
        x = x + attn
        x = x + self.mlp(self.norm2(x))
        return query.replace(query.zero_padding(x))


class Encoder(StreamingEncoder, nn.Module):
    """A stack of :class:`TransformerBlock` and a final LayerNorm, Tokens in and out.

    Args:
        embed_dim: model width D.
        depth: number of blocks.
        num_heads: attention heads per block.
        dropout: dropout in every block.
        bias: biases in every block.
        mlp_ratio, attention, window_size, causal, norm_eps, attention_kwargs: passed to
            every block (each block builds its own attention).
        pattern: a :mod:`mmattn.patterns` Pattern, compiled once per forward on the input
            Tokens and shared by every block (see :class:`TransformerBlock`).
        final_norm: apply a LayerNorm after the last block.
        device, dtype: factory arguments.

    Shape:
        - tokens: Tokens with x (B, L, D); attn_mask as in :class:`TransformerBlock` (or a
          SparseMask), shared by every block
        - returns: Tokens with x (B, L, D), the same mask and meta; padded rows are 0

    Raises:
        TypeError / ValueError: as :class:`TransformerBlock`; ``depth`` not a positive int.

    Examples:
        >>> enc = Encoder(embed_dim=16, depth=2, num_heads=2)
        >>> enc(Tokens(torch.randn(2, 5, 16))).x.shape
        torch.Size([2, 5, 16])
    """

    _fx_root = FX_ROOT  # torch.fx: this module is a leaf, also as the traced root

    def __init__(
        self,
        embed_dim: int,
        depth: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        *,
        mlp_ratio: float = 4.0,
        attention: AttentionSpec = "full",
        window_size: int | None = None,
        causal: bool = False,
        norm_eps: float = 1e-5,
        final_norm: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        attention_kwargs: Mapping[str, Any] | None = None,
        pattern: Pattern | None = None,
    ) -> None:
        super().__init__()
        self.depth = checks.check_positive_int("depth", depth)
        self.embed_dim = embed_dim
        self.pattern = check_pattern(pattern)
        self.blocks = nn.ModuleList(
            TransformerBlock(
                embed_dim, num_heads, dropout, bias, mlp_ratio=mlp_ratio, attention=attention,
                window_size=window_size, causal=causal, norm_eps=norm_eps, device=device,
                dtype=dtype, attention_kwargs=attention_kwargs,
            )
            for _ in range(depth)
        )
        self.norm = (
            nn.LayerNorm(embed_dim, eps=norm_eps, device=device, dtype=dtype)
            if final_norm
            else nn.Identity()
        )

    def reset_parameters(self) -> None:
        for block in self.blocks:
            block.reset_parameters()
        if isinstance(self.norm, nn.LayerNorm):
            self.norm.reset_parameters()

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, depth={self.depth}"

    def forward(self, tokens: Tokens, attn_mask: Tensor | None = None, *,
                cache: EncoderCache | None = None) -> Tokens:
        """Run every block, then the final norm (with ``cache``: one chunk of a stream)."""
        traced = fx_leaf(self, (tokens,), {"attn_mask": attn_mask, "cache": cache})
        if traced is not None:  # torch.fx: one call_module node (attention/_fx.py)
            return traced
        if cache is not None:
            return self._stream(tokens, cache, attn_mask)
        check_tokens("tokens", tokens, self.embed_dim, like=checks.first_param(self))
        if uses_pattern(self.pattern, attn_mask):  # compiled once for every block
            return encoder_forward(self, tokens, attn_mask)
        if tokens.is_packed:  # unwrap once: every block works on the packed rows
            values, offsets = contiguous_parts(tokens.x)
            attn_mask = block_attn_mask(
                attn_mask, tokens.batch_size, self.blocks[0].num_heads, tokens.length,
                tokens.length,
            )
            for block in self.blocks:
                values = block.packed_rows(
                    values, offsets, attn_mask, block.geometry(tokens.meta)
                )
            return tokens.replace(jagged(self.norm(values), offsets))
        for block in self.blocks:
            tokens = block(tokens, attn_mask)
        return tokens.replace(tokens.zero_padding(self.norm(tokens.x)))
