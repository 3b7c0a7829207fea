"""Linformer attention: keys and values projected along the sequence axis (low rank).

Axis key: ``b`` batch, ``h`` heads, ``i`` query length, ``j`` key length, ``p`` projected
length (``proj_len``), ``d`` model width, ``e`` head width (``d = h * e``).

Keys and values of length ``j <= seq_len`` are mixed down to ``p`` slots by learned
(p, seq_len) matrices E and F (their first ``j`` columns), so attention costs O(i·p) instead of
O(i·j). Padded keys are zeroed before the projection, so they contribute nothing; a slot that
no real key feeds is masked out, and a sample without real keys gets a zero result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from einops import rearrange
from torch import Tensor, nn

from mmattn import _checks as checks
from mmattn._helpers import default
from mmattn.attention._modifiers import score_modifiers
from mmattn.attention.mha import MultiHeadAttention
from mmattn.kernels.dense import allowed, attend
from mmattn.kernels.modifiers import Modifiers

__all__ = ["LinformerAttention"]


class LinformerAttention(MultiHeadAttention):
    r"""Multi-head attention over keys and values projected to ``proj_len`` slots (Linformer).

    .. math::
        \mathrm{out} = W_o\,\mathrm{concat}_h\!\left(\mathrm{softmax}\!\left(
            \frac{(q W_q^h)\,(E\,k W_k^h)^\top}{\sqrt{e}}\right) F\,v W_v^h\right)

    with :math:`E, F \in \mathbb{R}^{p \times n}` (``key_seq_proj`` and ``value_seq_proj``,
    shared by the heads; one matrix when ``share_kv``). An input of length :math:`j < n`
    uses the first :math:`j` columns. Padded keys (``key_padding_mask``) are set to zero
    before projecting, so they contribute nothing and their values never leak; a slot fed by
    no real key is masked. With ``proj_len == seq_len`` and identity E, F this is exactly
    :class:`MultiHeadAttention`.

    Not supported, each raising ValueError: ``attn_mask`` (it addresses keys, which no longer
    exist after the projection), ``is_causal`` and :meth:`make_cache` (the projection mixes
    future keys), ``position=`` and ``alibi=True`` (no projected slot keeps a position), and float
    ``key_padding_mask`` values other than 0 / -inf. ``need_weights`` returns weights over the
    ``proj_len`` slots: (B, L, proj_len).

    Args:
        embed_dim: model width D.
        num_heads: number of heads H; must divide ``embed_dim``.
        seq_len: n, the longest key sequence accepted.
        proj_len: p, the number of projected slots (p < n for a speed-up).
        dropout: dropout probability on the attention weights (training only).
        bias: add biases to the four projections.
        share_kv: use one projection matrix for keys and values (E = F).
        kdim, vdim: key and value widths (default ``embed_dim``).
        batch_first: inputs are (B, L, D) when True, (L, B, D) when False.
        device, dtype: factory arguments for the parameters.
        num_kv_heads: key/value heads (grouped-query attention), as
            :class:`MultiHeadAttention`.
        position: must be None (see above).
        sinks, softcap: score modifiers on the scores over the slots, as
            :class:`MultiHeadAttention`.

    Shape:
        - query: (B, L, D); key: (B, S, kdim) and value: (B, S, vdim) with S <= seq_len
        - key_padding_mask: (B, S) bool (True = padding) or float 0 / -inf
        - returns: (B, L, D), and weights (B, L, proj_len) or (B, H, L, proj_len)

    Raises:
        TypeError / ValueError: bad sizes at construction; in ``forward`` a key longer than
            ``seq_len``, an ``attn_mask``, ``is_causal=True``, plus the checks of
            :class:`MultiHeadAttention` — each message names the argument.

    Examples:
        >>> attn = LinformerAttention(embed_dim=16, num_heads=2, seq_len=64, proj_len=8)
        >>> out, w = attn(torch.randn(2, 50, 16), need_weights=True)
        >>> out.shape, w.shape
        (torch.Size([2, 50, 16]), torch.Size([2, 50, 8]))
    """

    no_torch_twin = "nn.MultiheadAttention has no sequence projection"
    alibi_refusal = "the sequence projection mixes keys of every position into each slot"

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        seq_len: int,
        proj_len: int,
        dropout: float = 0.0,
        bias: bool = True,
        *,
        share_kv: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        num_kv_heads: int | None = None,
        position: None = None,
        sinks: bool = False,
        softcap: float | None = None,
        alibi: bool = False,
    ) -> None:
        self.seq_len = checks.check_positive_int("seq_len", seq_len)
        self.proj_len = checks.check_positive_int("proj_len", proj_len)
        self.share_kv = checks.check_bool("share_kv", share_kv)
        super().__init__(
            embed_dim, num_heads, dropout=dropout, bias=bias, kdim=kdim, vdim=vdim,
            batch_first=batch_first, device=device, dtype=dtype, num_kv_heads=num_kv_heads,
            position=position, sinks=sinks, softcap=softcap, alibi=alibi,
        )
        factory = {"device": device, "dtype": dtype}
        self.key_seq_proj = nn.Parameter(torch.empty(proj_len, seq_len, **factory))
        if self.share_kv:
            self.value_seq_proj = None
        else:
            self.value_seq_proj = nn.Parameter(torch.empty(proj_len, seq_len, **factory))
        self._reset_seq_proj()

    def reset_parameters(self) -> None:
        """Projections as :class:`MultiHeadAttention`; E and F ~ U(±1/√proj_len)."""
        super().reset_parameters()
        self._reset_seq_proj()

    def _reset_seq_proj(self) -> None:
        bound = 1.0 / math.sqrt(self.proj_len)
        for weight in (self.key_seq_proj, self.value_seq_proj):
            if weight is not None:
                nn.init.uniform_(weight, -bound, bound)

    def extra_repr(self) -> str:
        parts = [super().extra_repr(), f"seq_len={self.seq_len}", f"proj_len={self.proj_len}"]
        if self.share_kv:
            parts.append("share_kv=True")
        return ", ".join(parts)

    def _check_position_supported(self) -> None:
        if self.position is not None:
            raise ValueError(
                "position= is not supported by LinformerAttention: the sequence projection "
                "mixes keys of every position into each slot, so no key keeps a position"
            )

    def make_cache(self, batch_size: int, max_len: int, **kwargs) -> None:
        """Not available: decoding is causal, and Linformer's projection mixes future keys.

        Raises:
            ValueError: always.
        """
        self._check_cacheable()

    def _check_cacheable(self) -> None:
        # also for a hand-made KVCache (which would otherwise decode without the projection)
        raise ValueError(
            "LinformerAttention has no cache: decoding is causal, and the sequence projection "
            "mixes future keys into every slot"
        )

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
        length = k.shape[2]
        e_proj = self.key_seq_proj[:, :length].to(q.dtype)  # (p, j)
        f_proj = e_proj if self.value_seq_proj is None else self.value_seq_proj[:, :length]
        f_proj = f_proj.to(q.dtype)
        feeds = e_proj.abs() + f_proj.abs()  # (p, j): which keys reach which slot
        if mask is None:
            slot_live = rearrange(feeds.sum(dim=1) > 0, "p -> 1 1 1 p")
        else:
            real = _real_keys(mask)  # (b, j)
            keep = rearrange(real, "b j -> b 1 j 1")
            k, v = torch.where(keep, k, 0.0), torch.where(keep, v, 0.0)
            slot_live = torch.einsum("pj,bj->bp", feeds, real.to(q.dtype)) > 0
            slot_live = rearrange(slot_live, "b p -> b 1 1 p")
        k = torch.einsum("pj,bhje->bhpe", e_proj, k)
        v = torch.einsum("pj,bhje->bhpe", f_proj, v)
        return attend(q, k, v, slot_live, dropout_p=dropout_p, need_weights=need_weights,
                      modifiers=default(modifiers, score_modifiers(self)))

    def _check_lengths(
        self,
        q_lens: Sequence[int],
        k_lens: Sequence[int],
        *,
        is_causal: bool,
        attn_mask: Tensor | None,
    ) -> None:
        if is_causal:
            raise ValueError(
                "is_causal=True is not supported by LinformerAttention: the sequence "
                "projection mixes future keys into every slot"
            )
        if attn_mask is not None:
            raise ValueError(
                "attn_mask is not supported by LinformerAttention: keys are projected to "
                f"proj_len={self.proj_len} slots; use key_padding_mask for padding"
            )
        longest = max(k_lens) if k_lens else 0  # not default=: torch 2.5's dynamo refuses it
        if longest > self.seq_len:
            which = "" if len(k_lens) == 1 else " (the longest packed item)"
            raise ValueError(
                f"key length must be <= seq_len={self.seq_len}, got {longest}{which}"
            )

    def _packed_weights_width(self) -> int | None:
        return self.proj_len


def _real_keys(mask: Tensor) -> Tensor:
    """The merged key-padding mask (b, 1, 1, j), bool or 0/-inf additive -> (b, j) real keys."""
    real = allowed(mask)[:, 0, 0]
    # a meta mask has no values to read: its shape is what matters there
    if mask.dtype != torch.bool and not mask.is_meta and bool(
        ((mask != 0) & ~torch.isneginf(mask)).any()
    ):
        raise ValueError(
            "key_padding_mask for LinformerAttention must be bool or hold only 0 and -inf: "
            "other additive values cannot be applied after the sequence projection"
        )
    return real
