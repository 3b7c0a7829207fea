"""Local (sliding-window) multi-head attention whose cost grows as O(L·window).

Axis key: ``b`` batch, ``h`` heads, ``i`` query length, ``j`` key length, ``d`` model width,
``e`` head width (``d = h * e``), ``g`` global tokens.

The module shares projections, layout handling and the forward contract with
:class:`mmattn.MultiHeadAttention`; only the kernel differs: :mod:`mmattn.kernels.blocked` cuts the
sequence into query blocks that each attend a key slab of ``block + 2·window`` keys, all in
one batched attention call, so no (L, L) score matrix is built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from mmattn import _checks as checks
from mmattn._helpers import default
from mmattn.attention._decoding import refuse_chunk_cache
from mmattn.attention._modifiers import score_modifiers
from mmattn.attention.mha import MultiHeadAttention
from mmattn.cache import LocalKVCache
from mmattn.kernels.blocked import default_block_size, local_attend
from mmattn.kernels.dense import attend
from mmattn.kernels.modifiers import Modifiers
from mmattn.masks import local_allowed

__all__ = ["LocalAttention"]


class LocalAttention(MultiHeadAttention):
    r"""Multi-head sliding-window attention: query i attends key j iff :math:`|i-j| \le w`.

    .. math::
        \mathrm{out}_i = \sum_{j:\,|i-j| \le w} \mathrm{softmax}_j\!\left(
            \frac{q_i k_j^\top}{\sqrt{e}}\right) v_j

    Exactly :class:`MultiHeadAttention` with the same weights and
    ``attn_mask=~band_mask(L, window_size)``, but computed blockwise: time and memory grow as
    O(L·w) instead of O(L²). With ``causal=True`` (or ``forward(..., is_causal=True)``) key j
    must also satisfy ``j <= i``. With ``num_global_tokens=g`` the first g tokens attend to,
    and are attended by, every token (Longformer style), still without an (L, L) tensor.

    Key padding is respected; a query whose band holds no real key gets a zero attention
    result (its output is ``out_proj.bias``), never NaN. ``need_weights=True`` returns the
    dense (L, L) map (O(L²) memory, on request only). An extra ``attn_mask`` is honoured
    exactly by a dense fallback (band AND attn_mask); the mask itself is already (L, L), so
    that path is O(L²). ``MMATTN_FUSED_ATTN=0`` switches every block from
    ``F.scaled_dot_product_attention`` to the explicit softmax twin.

    Args:
        embed_dim: model width D.
        num_heads: number of heads H; must divide ``embed_dim``.
        window_size: w >= 0; how far a query sees to each side. 0 = only itself.
        dropout: dropout probability on the attention weights (training only).
        bias: add biases to the four projections.
        causal: only keys at or before the query (``j <= i``).
        num_global_tokens: g >= 0; the first g tokens are global.
        block_size: queries per block (tuning only; default ``max(32, window_size // 2)``).
        kdim, vdim: key and value widths (default ``embed_dim``).
        batch_first: inputs are (B, L, D) when True, (L, B, D) when False.
        device, dtype: factory arguments for the parameters.
        num_kv_heads: key/value heads (grouped-query attention), as
            :class:`MultiHeadAttention`; the blocked kernel never repeats K/V per query head.
        position: applied to q and k after the head split (e.g. ``"rotary"``), as
            :class:`MultiHeadAttention`.
        sinks, softcap, alibi: score modifiers, as :class:`MultiHeadAttention`; ALiBi's
            distance is ``|i - j|`` (global tokens included), sinks join every band's softmax.

    Decoding: :meth:`make_cache` returns a ring cache of the last ``window_size`` keys, so
    memory stays O(w) however many tokens are decoded.

    Shape:
        - query: (B, L, D) or (L, D); key: (B, L, kdim); value: (B, L, vdim) — one length L
        - key_padding_mask: (B, L) bool (True = padding) or float (added)
        - attn_mask: (L, L) or (B * H, L, L), module direction (dense fallback)
        - returns: (B, L, D), and weights (B, L, L) or (B, H, L, L) when ``need_weights``

    Raises:
        TypeError: ``window_size``, ``num_global_tokens`` or ``block_size`` is not an int;
            ``causal`` is not a bool.
        ValueError: ``window_size`` or ``num_global_tokens`` is negative; ``block_size`` < 1;
            in ``forward``: key and query lengths differ, plus every check of
            :class:`MultiHeadAttention`.

    Examples:
        >>> attn = LocalAttention(embed_dim=16, num_heads=4, window_size=2)
        >>> x = torch.randn(2, 10, 16)
        >>> out, weights = attn(x, need_weights=True)
        >>> out.shape, weights.shape
        (torch.Size([2, 10, 16]), torch.Size([2, 10, 10]))
    """

    no_torch_twin = (
        "nn.MultiheadAttention has no window; MultiHeadAttention(...).load_state_dict("
        "local.state_dict()) with ~masks.band_mask(L, window_size) as attn_mask computes the "
        "same, and its to_torch() works"
    )
    #: Only the ring cache of the module's window: a full cache would attend outside it.
    cache_kinds = (LocalKVCache,)

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        window_size: int,
        dropout: float = 0.0,
        bias: bool = True,
        *,
        causal: bool = False,
        num_global_tokens: int = 0,
        block_size: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        num_kv_heads: int | None = None,
        position: nn.Module | Callable[..., Tensor] | str | None = None,
        sinks: bool = False,
        softcap: float | None = None,
        alibi: bool = False,
    ) -> None:
        self.window_size = checks.check_positive_int("window_size", window_size, minimum=0)
        self.num_global_tokens = checks.check_positive_int(
            "num_global_tokens", num_global_tokens, minimum=0
        )
        if block_size is not None:
            checks.check_positive_int("block_size", block_size)
        self.block_size = block_size
        self.causal = checks.check_bool("causal", causal)
        super().__init__(
            embed_dim,
            num_heads,
            dropout=dropout,
            bias=bias,
            kdim=kdim,
            vdim=vdim,
            batch_first=batch_first,
            device=device,
            dtype=dtype,
            num_kv_heads=num_kv_heads,
            position=position,
            sinks=sinks,
            softcap=softcap,
            alibi=alibi,
        )

    def extra_repr(self) -> str:
        parts = [super().extra_repr(), f"window_size={self.window_size}"]
        if self.causal:
            parts.append("causal=True")
        if self.num_global_tokens:
            parts.append(f"num_global_tokens={self.num_global_tokens}")
        if self.block_size is not None:
            parts.append(f"block_size={self.block_size}")
        return ", ".join(parts)

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
        causal = self.causal or is_causal
        modifiers = default(modifiers, score_modifiers(self))
        key_mask = None
        if mask is not None:
            if mask.shape[-2] != 1 or mask.shape[-3] != 1:
                return self._attend_dense(
                    q, k, v, mask, causal, need_weights, dropout_p, modifiers
                )
            key_mask = mask[:, 0, 0]  # only key padding: (b, j), True = real key
        return local_attend(
            q,
            k,
            v,
            self.window_size,
            causal=causal,
            key_mask=key_mask,
            num_global_tokens=self.num_global_tokens,
            block_size=self.block_size,
            dropout_p=dropout_p,
            need_weights=need_weights,
            groups=self.num_heads // self.num_kv_heads,
            modifiers=modifiers,
        )

    def make_cache(
        self,
        batch_size: int,
        max_len: int | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **streaming: object,
    ) -> LocalKVCache:
        """A ring cache of the last ``window_size`` keys for causal decoding: O(w) memory.

        Use it as ``forward(x_step, is_causal=True, cache=cache)`` (or with ``causal=True``
        set at construction); ``max_len`` bounds the total number of decoded tokens.

        Raises:
            ValueError: ``num_global_tokens`` > 0 (global keys would need the whole past).
            TypeError: ``chunk=`` (or ``left``/``right``): a band has no chunk cache.
        """
        refuse_chunk_cache(self, streaming)
        if streaming or max_len is None:  # (max_len is optional only for that message)
            raise TypeError(f"LocalAttention.make_cache needs max_len, got max_len={max_len}"
                            + (f" and unexpected {sorted(streaming)}" if streaming else ""))
        self._check_cacheable()
        weight = self.k_proj.weight
        return LocalKVCache(
            batch_size, max_len, self.window_size, self.num_kv_heads, self.head_dim,
            device=device or weight.device, dtype=dtype or weight.dtype,
        )

    def _attend_cached(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, dropout_p: float,
        need_weights: bool, modifiers: Modifiers | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        # The ring cache's mask already is the causal band over at most w + i keys; the
        # sinks are parameters, so the ring drops no part of them.
        return attend(
            q, k, v, mask, dropout_p=dropout_p, need_weights=need_weights,
            groups=self.num_heads // self.num_kv_heads,
            modifiers=default(modifiers, score_modifiers(self)),
        )

    def _attend_dense(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor,
        causal: bool,
        need_weights: bool,
        dropout_p: float,
        modifiers: Modifiers | None,
    ) -> tuple[Tensor, Tensor | None]:
        """O(L²) fallback when the caller adds an (L, L) ``attn_mask``: band AND mask."""
        band = local_allowed(
            q.shape[2], self.window_size, causal=causal,
            num_global_tokens=self.num_global_tokens, device=q.device,
        )
        if mask.dtype == torch.bool:
            mask = mask & band
        else:
            mask = torch.where(band, mask, float("-inf"))
        return attend(
            q, k, v, mask, dropout_p=dropout_p, need_weights=need_weights,
            groups=self.num_heads // self.num_kv_heads, modifiers=modifiers,
        )

    def _check_lengths(
        self,
        q_lens: Sequence[int],
        k_lens: Sequence[int],
        *,
        is_causal: bool,
        attn_mask: Tensor | None,
    ) -> None:
        if list(q_lens) != list(k_lens):
            which = "" if len(q_lens) == 1 else " for every item"
            raise ValueError(
                f"LocalAttention needs key of the same length as query{which}, got query "
                f"length(s) {list(q_lens)} and key length(s) {list(k_lens)}; use "
                "CrossAttention for inputs of different lengths"
            )

    def _packed_cost_key(self) -> tuple:
        return (self.window_size, self.block_size or default_block_size(self.window_size),
                self.num_global_tokens)

    def _cache_rules(self) -> tuple[int | None, bool]:
        return self.window_size, self.causal

    def _check_cacheable(self) -> None:
        # also for a hand-made LocalKVCache: the ring would silently drop the global keys
        super()._check_cacheable()
        if self.num_global_tokens:
            raise ValueError(
                "LocalAttention with num_global_tokens > 0 has no cache: its global tokens "
                "attend every key"
            )
