"""``MultiHeadAttention``: a drop-in replacement for ``torch.nn.MultiheadAttention``.

Axis key: ``b`` batch, ``h`` heads, ``i`` query length, ``j`` key length, ``d`` model width,
``e`` head width (``d = h * e``).

Mask convention (the module direction, as ``nn.MultiheadAttention``): boolean
``key_padding_mask`` and ``attn_mask`` are **True where attention is NOT allowed**; float
masks are added to the scores. ``forward`` merges them once into one SDPA-direction mask
(True = may attend) and hands it, with the head-split q/k/v, to :meth:`_attention` — the one
hook a variant overrides. The default hook is the shared kernel :func:`mmattn.kernels.dense.attend`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from mmattn import _checks as checks
from mmattn._helpers import default
from mmattn.attention._appended import append_keys
from mmattn.attention._decoding import Decoding, cached_step, check_cache_step
from mmattn.attention._fx import FX_ROOT, fx_leaf
from mmattn.attention._init import draw_like_torch, undrawn_linear
from mmattn.attention._inputs import (
    check_inputs,
    from_batch_first,
    merge_heads,
    split_heads,
    to_batch_first,
)
from mmattn.attention._interop import TorchInterop
from mmattn.attention._modifiers import init_modifiers, modifier_repr, score_modifiers
from mmattn.attention._nested import nested_forward
from mmattn.attention._packed import attend_values, packed_forward
from mmattn.attention._positions import check_positions, positions_from_meta, rotate
from mmattn.attention._sparse import is_sparse_mask, sparse_forward
from mmattn.cache import ChunkCache, ContextCache, KVCache, LocalKVCache
from mmattn.kernels.dense import attend
from mmattn.kernels.modifiers import Modifiers
from mmattn.kernels.packed import is_jagged
from mmattn.masks import merge_masks
from mmattn.rotary import resolve_position

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(TorchInterop, Decoding, nn.MultiheadAttention):
    r"""Multi-head attention, a drop-in replacement for ``torch.nn.MultiheadAttention``.

    .. math::
        \mathrm{out} = W_o\,\mathrm{concat}_h\!\left(
            \mathrm{softmax}\!\left(\frac{(q W_q^h)(k W_k^h)^\top}{\sqrt{e}} + M\right) v W_v^h
        \right)

    The constructor and ``forward`` take the same arguments in the same order as
    ``nn.MultiheadAttention``, and :meth:`from_torch` copies one exactly. Differences, on
    purpose: ``batch_first=True`` and ``need_weights=False`` by default; ``key`` defaults to
    ``query`` and ``value`` to ``key``; ``is_causal=True`` alone applies a causal mask (with an
    ``attn_mask`` both apply); a query row with no allowed key gives a zero attention result
    and zero weights (its output is ``out_proj.bias``) instead of NaN. Projections are always
    separate ``nn.Linear`` modules ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``.

    Without weights requested the fused ``F.scaled_dot_product_attention`` path runs; with
    ``need_weights=True`` (or ``MMATTN_FUSED_ATTN=0``) the explicit softmax path runs.

    Args:
        embed_dim: model width D (query width and output width).
        num_heads: number of heads H; must divide ``embed_dim``.
        dropout: dropout probability on the attention weights (training only).
        bias: add biases to the four projections.
        add_bias_kv: append a learned key and value (``bias_k``, ``bias_v``) to the sequence.
        add_zero_attn: append an all-zero key and value after the heads are split.
        kdim: key width (default ``embed_dim``).
        vdim: value width (default ``embed_dim``).
        batch_first: inputs are (B, L, D) when True, (L, B, D) when False.
        device, dtype: factory arguments for the parameters.
        num_kv_heads: key/value heads for grouped-query attention (must divide
            ``num_heads``; 1 = multi-query; default ``num_heads``). ``k_proj``/``v_proj``
            output ``num_kv_heads * head_dim``; K/V are never repeated per query head.
        position: applied to q and k after the head split as ``position(x, offset)``
            (``offset`` = tokens already cached, else 0), or ``position(x, positions)``
            when ``forward`` gets per-token ``positions``: a module such as
            :class:`~mmattn.rotary.RotaryEmbedding` or
            :class:`~mmattn.rotary.MultiAxisRotary`, or ``"rotary"`` to build a
            RotaryEmbedding of the head width (which must then be even).
        sinks, softcap, alibi: score modifiers: a learned sink logit per head (parameter
            ``sinks``), scores ``softcap·tanh(s/softcap)``, ALiBi's ``-slope_h·|i - j|``
            (docs/variants.md, "Score modifiers").

    Decoding: ``cache = module.make_cache(batch_size, max_len)`` and
    ``forward(x_step, is_causal=True, cache=cache)`` append this call's keys and values and
    attend everything cached so far (see :mod:`mmattn.cache`).

    Positions: ``forward(..., positions=)`` rotates the queries and keys at per-token
    positions instead of 0, 1, 2, ...: (B, L, A) for a multi-axis module
    (:class:`~mmattn.rotary.MultiAxisRotary`, e.g. from
    :func:`~mmattn.rotary.mrope_positions`), (B, L) for a 1-D rotary module. They are the
    tokens' own, so key and query are the same tokens (self-attention, or one decoding step
    with a cache: the new tokens' positions). Blocks pass ``Tokens.meta["positions"]``.

    Shape:
        - query: (B, L, D), or (L, D) unbatched, or (L, B, D) with ``batch_first=False``
        - key: (B, S, kdim); value: (B, S, vdim)
        - positions: (B, L, A) or (B, L), batch-first in every layout ((L, A) / (L,)
          unbatched; (B, max lᵢ, A) for packed input), integer or floating
        - key_padding_mask: (B, S) bool or float, or (S,) unbatched
        - attn_mask: (L, S) or (B * H, L, S) bool or float, or (H, L, S) unbatched
        - returns: output (B, L, D) in the input layout, and weights (B, L, S) averaged over
          heads or (B, H, L, S) per head when ``need_weights`` (else None)

    Raises:
        ValueError / TypeError: at construction for bad sizes (``num_kv_heads`` that does
            not divide ``num_heads``, a ``position`` of another width or an odd head width
            for ``"rotary"``), and in ``forward`` for inputs or masks of the wrong rank,
            shape, dtype or device, or a cache made for another batch size or dtype, or full
            — the message names the argument and the expected and actual values.

    Examples:
        >>> mha = MultiHeadAttention(embed_dim=16, num_heads=4)
        >>> x = torch.randn(2, 5, 16)
        >>> out, weights = mha(x, need_weights=True)
        >>> out.shape, weights.shape
        (torch.Size([2, 5, 16]), torch.Size([2, 5, 5]))
    """

    # A subclass of nn.MultiheadAttention, so client code that dispatches on the class
    # (PyG's GPSConv, FSDP's wrap policy) calls ours; nn.MultiheadAttention.__init__ never
    # runs. PyTorch's Transformer layers probe _qkv_same_embed_dim first for their
    # packed-weight fast paths; our projections are never packed, so they all decline and
    # call our forward. in_proj_weight / in_proj_bias and q_proj_weight ... are read-only
    # views of the nn.Linear modules (TorchInterop).
    _qkv_same_embed_dim = False
    _fx_root = FX_ROOT  # torch.fx: a traced root holds itself under this name (see _fx.py)

    #: The caches ``forward(..., cache=)`` takes: what :meth:`make_cache` makes, and the
    #: projected context of cross-attention.
    cache_kinds: ClassVar[tuple[type, ...]] = (KVCache, ContextCache, ChunkCache)

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        num_kv_heads: int | None = None,
        position: nn.Module | Callable[..., Tensor] | str | None = None,
        sinks: bool = False,
        softcap: float | None = None,
        alibi: bool = False,
    ) -> None:
        nn.Module.__init__(self)  # not nn.MultiheadAttention's: it would build packed weights
        checks.check_positive_int("embed_dim", embed_dim)
        checks.check_positive_int("num_heads", num_heads)
        if embed_dim % num_heads:
            raise ValueError(
                f"num_heads must divide embed_dim, got embed_dim={embed_dim}, "
                f"num_heads={num_heads}"
            )
        num_kv_heads = checks.check_positive_int("num_kv_heads", default(num_kv_heads, num_heads))
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_kv_heads must divide num_heads, got num_heads={num_heads}, "
                f"num_kv_heads={num_kv_heads}"
            )
        kdim = checks.check_positive_int("kdim", default(kdim, embed_dim))
        vdim = checks.check_positive_int("vdim", default(vdim, embed_dim))
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.num_kv_heads = num_kv_heads
        kv_dim = num_kv_heads * self.head_dim
        self.dropout = checks.check_probability("dropout", dropout)
        self.kdim = kdim
        self.vdim = vdim
        self.batch_first = checks.check_bool("batch_first", batch_first)
        self.add_zero_attn = bool(add_zero_attn)
        factory = checks.check_factory(device, dtype)
        # Allocated without drawing: reset_parameters draws in nn.MultiheadAttention's order.
        self.q_proj = undrawn_linear(embed_dim, embed_dim, bias, **factory)
        self.k_proj = undrawn_linear(kdim, kv_dim, bias, **factory)
        self.v_proj = undrawn_linear(vdim, kv_dim, bias, **factory)
        self.out_proj = undrawn_linear(embed_dim, embed_dim, bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, kv_dim, **factory))
            self.bias_v = nn.Parameter(torch.empty(1, 1, kv_dim, **factory))
        else:
            self.bias_k = self.bias_v = None
        self.position = resolve_position(position, self.head_dim)
        self._check_position_supported()
        init_modifiers(self, sinks=sinks, softcap=softcap, alibi=alibi, **factory)
        # The base initialiser on purpose: a subclass's reset_parameters may touch
        # parameters that do not exist yet; subclasses initialise their own at the end.
        MultiHeadAttention.reset_parameters(self)

    def reset_parameters(self) -> None:
        """Initialise as ``nn.MultiheadAttention``'s constructor: same draws, same order.

        ``out_proj`` Kaiming-uniform (as ``nn.Linear``), then the in-projection Xavier-uniform
        (one packed (3D, D) draw when the widths are equal, else q, k, v in turn), zero
        biases, Xavier-normal ``bias_k``/``bias_v``. Under the same seed the weights and the
        generator state afterwards are torch's (see :mod:`mmattn.attention._init`).
        """
        draw_like_torch(self)

    def extra_repr(self) -> str:
        parts = [f"embed_dim={self.embed_dim}", f"num_heads={self.num_heads}"]
        if self.dropout:
            parts.append(f"dropout={self.dropout}")
        if self.kdim != self.embed_dim or self.vdim != self.embed_dim:
            parts.append(f"kdim={self.kdim}, vdim={self.vdim}")
        if self.bias_k is not None:
            parts.append("add_bias_kv=True")
        if self.add_zero_attn:
            parts.append("add_zero_attn=True")
        parts.append(f"batch_first={self.batch_first}")
        if self.num_kv_heads != self.num_heads:
            parts.append(f"num_kv_heads={self.num_kv_heads}")
        return ", ".join(parts + modifier_repr(self))

    def _check_position_supported(self) -> None:
        """Hook: a variant where ``position=`` makes no sense raises ValueError here."""

    # ------------------------------------------------------------------ what runners ask

    def _check_lengths(
        self,
        q_lens: Sequence[int],
        k_lens: Sequence[int],
        *,
        is_causal: bool,
        attn_mask: Tensor | None,
    ) -> None:
        """Hook: a variant's rules on lengths and options, raised as ValueError.

        Called once per call with one length per item: ``[L]``/``[S]`` for a padded batch,
        every item's lengths for a packed one, so a rule lives once, in its layer.
        """

    def _plain_attention(self) -> bool:
        """Whether this class keeps the base :meth:`_attention` (plain SDPA): the packed
        runner may then call SDPA on its buckets directly."""
        return type(self)._attention is MultiHeadAttention._attention

    def _packed_cost_key(self) -> tuple:
        """What the packed planner needs to know of this layer's cost: () for full attention
        (a band returns its window, block and global tokens)."""
        return ()

    def _packed_weights_width(self) -> int | None:
        """Key columns of the packed weights when not the item's keys (Linformer's slots)."""
        return None

    # ------------------------------------------------------------------ what blocks ask

    def geometry(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        """The forward keywords this layer takes from ``Tokens.meta``: ``positions`` when it
        has a ``position`` module and ``meta["positions"]`` exists, else none.

        Blocks call it with their input's ``meta`` and pass the result to ``forward`` (and to
        :meth:`attend_rows`), so a layer that needs geometry (an image grid, a graph's edges,
        the tokens' positions) gets it without the user doing anything. A layer that needs a
        key raises a ValueError naming it when ``meta`` lacks it.
        """
        return positions_from_meta(self, meta)

    def attend_rows(
        self,
        qv: Tensor,
        q_off: Tensor,
        kv: Tensor,
        k_off: Tensor,
        vv: Tensor,
        *,
        self_attention: bool = False,
        **kwargs: Any,
    ) -> Tensor:
        """Packed attention on the rows of a jagged batch (no nested tensor in or out).

        Blocks call this for packed Tokens; ``kwargs`` are ``forward``'s (``attn_mask``,
        ``is_causal`` and whatever :meth:`geometry` returned).

        Shape:
            - qv: (t_q, embed_dim); kv: (t_k, kdim); vv: (t_k, vdim); offsets (b + 1,)
            - returns: (t_q, embed_dim)
        """
        out, _ = attend_values(
            self, qv, q_off, kv, k_off, vv, self_attention=self_attention, **kwargs
        )
        return out

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = False,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        cache: KVCache | LocalKVCache | ContextCache | ChunkCache | None = None,
        positions: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend ``query`` over ``key``/``value``; see the class docstring for shapes.

        With ``cache`` (from :meth:`make_cache`) the call is one decoding step: its keys and
        values are appended to the cache and the queries attend everything cached. With
        ``positions`` the ``position`` module rotates each token at its own position.
        """
        traced = fx_leaf(self, (query,), {
            "key": key, "value": value, "key_padding_mask": key_padding_mask,
            "need_weights": need_weights, "attn_mask": attn_mask,
            "average_attn_weights": average_attn_weights, "is_causal": is_causal, "cache": cache,
            "positions": positions,
        })
        if traced is not None:  # torch.fx: one call_module node, as for torch.nn's modules
            return traced
        if is_sparse_mask(attn_mask):  # a compiled pattern, block-sparse: attention/_sparse.py
            return sparse_forward(self, query, key, value, key_padding_mask, need_weights,
                                  attn_mask, average_attn_weights, is_causal, cache, positions)
        if is_jagged(query) or is_jagged(key) or is_jagged(value):  # packed: mmattn/_packed*
            if cache is not None:
                raise ValueError("cache= does not take packed (jagged) input; decode padded")
            key = default(key, query)
            return packed_forward(
                self, query, key, default(value, key), key_padding_mask, need_weights,
                attn_mask, average_attn_weights, is_causal, positions,
            )
        if isinstance(query, Tensor) and query.is_nested:
            if cache is not None:
                raise ValueError("cache= does not take nested (jagged) input; decode padded")
            return nested_forward(
                self, query, key, value, key_padding_mask, need_weights, attn_mask,
                average_attn_weights, is_causal, positions,
            )
        key = default(key, query)
        value = default(value, key)
        batched = self._check_inputs(query, key, value, key_padding_mask, attn_mask, is_causal)
        if cache is not None:
            check_cache_step(self, cache, batched, key_padding_mask, attn_mask, is_causal)
        query, key, value, key_padding_mask = to_batch_first(
            self, batched, query, key, value, key_padding_mask
        )
        positions = check_positions(
            self, positions, query.shape[0] if batched else None, query.shape[1], query,
            key_length=key.shape[1],
        )

        q = split_heads(self.q_proj(query), self.num_heads)
        dropout_p = self.dropout if self.training else 0.0
        if cache is None:
            out, weights = self._uncached(
                q, key, value, key_padding_mask, attn_mask, is_causal, dropout_p, need_weights,
                positions,
            )
        else:
            out, weights = cached_step(
                self, q, key, value, cache, key_padding_mask, dropout_p, need_weights, positions
            )
        out = self.out_proj(merge_heads(out))
        return from_batch_first(self, batched, out, weights, average_attn_weights)

    def _project_kv(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Key and value projections, split into the ``num_kv_heads`` heads."""
        k = split_heads(self.k_proj(key), self.num_kv_heads)
        v = split_heads(self.v_proj(value), self.num_kv_heads)
        return k, v

    def _uncached(
        self,
        q: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        is_causal: bool,
        dropout_p: float,
        need_weights: bool,
        positions: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """One whole-sequence call: positions from 0 (or the call's ``positions``), appended
        keys, merged mask, the hook."""
        k, v = self._project_kv(key, value)
        q, k = rotate(self, q, k, default(positions, 0))
        k, v, key_padding_mask, attn_mask, is_causal = append_keys(
            self, q, k, v, key_padding_mask, attn_mask, is_causal
        )
        mask = merge_masks(
            key_padding_mask, attn_mask, batch_size=q.shape[0], num_heads=self.num_heads,
            dtype=q.dtype,
        )
        return self._step(
            self._attention, q, k, v, mask, is_causal=is_causal, dropout_p=dropout_p,
            need_weights=need_weights,
        )

    def _step(self, kernel: Any, q: Tensor, k: Tensor, v: Tensor, *args: Any,
              **kwargs: Any) -> Any:
        """``kernel(q, k, v, *args, **kwargs)``: every attention step of a whole call
        (padded, a packed bucket, packed rows, a block-sparse mask, windows, edges) runs
        through here, on head-split tensors in the kernel's own layout, so a tool sees the
        step whatever kernel or engine runs it (:func:`mmattn.debug.attention_mass` gives the
        values more columns). ``dropout_p`` is a keyword of every kernel it passes.

        Shape:
            - q: (b, h, i, e) or rows (t, h, e); k, v: (b, k, j, e) or (t, k, e)
        """
        return kernel(q, k, v, *args, **kwargs)

    def _attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        *,
        is_causal: bool,
        dropout_p: float,
        need_weights: bool,
        modifiers: Modifiers | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The attention step on head-split tensors: the one hook a variant overrides.

        ``forward`` has already projected and split the heads, appended ``bias_k``/zero keys,
        merged ``key_padding_mask`` and ``attn_mask`` into ``mask``, and chosen ``dropout_p``
        (0 in eval mode). An override returns the per-head result; ``forward`` merges the
        heads and applies ``out_proj``.

        Args:
            q, k, v: projected queries, keys and values.
            mask: None, or one mask in the SDPA direction — bool True = may attend, or float
                added to the scores. (b, 1, 1, j) when only key padding was given.
            is_causal: also apply the causal rule (key j <= query i).
            dropout_p: dropout probability on the attention weights.
            need_weights: also return the per-head weights.
            modifiers: the score modifiers (None: the module's own, ``score_modifiers``).

        Shape:
            - q: (b, h, i, e); k, v: (b, h, j, e)
            - mask: broadcastable to (b, h, i, j)
            - returns: (b, h, i, e) and weights (b, h, i, j), or None
        """
        return attend(
            q, k, v, mask, dropout_p=dropout_p, is_causal=is_causal, need_weights=need_weights,
            groups=self.num_heads // self.num_kv_heads,
            modifiers=default(modifiers, score_modifiers(self)),
        )

    def _check_inputs(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        is_causal: bool = False,
    ) -> bool:
        """Validate shapes, dtypes and devices; return whether the input is batched."""
        return check_inputs(self, query, key, value, key_padding_mask, attn_mask, is_causal)
