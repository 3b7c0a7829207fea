"""Score modifiers: terms of the attention score that every kernel applies where it forms its
scores — attention sinks, soft-capping and ALiBi — each with its explicit twin.

Axis key: ``b`` batch (or tiles, blocks, buckets), ``h`` query heads, ``k`` key/value heads,
``g`` query heads per key head, ``i`` query rows, ``j`` key columns, ``p`` coordinates of a
position, ``e`` head width.

For head ``h``, with the scores ``s = q kᵀ · scale`` of a call::

    softcap   s ← c · tanh(s / c)                       Gemma 2; before any bias or mask
    ALiBi     s ← s − m_h · d(i, j)                     Press et al. (2022); d = |i − j| on
                                                        a sequence, Euclidean on a grid
    mask      s ← s + M                                 −inf where the pair is not allowed
    sinks     w_ij = exp(s_ij) / (Σ_j exp(s_ij) + exp(σ_h))     gpt-oss's ``s_aux``

A sink is a key whose value is zero and whose score is the learned logit ``σ_h`` for every
query: the weights of a row sum to ``1 − exp(σ_h − ℓ')`` (``ℓ'`` below), and a row with no
allowed key still gives 0.

How each runs on a fused kernel:

- ALiBi is additive: :meth:`Modifiers.terms` evaluates it at the call's positions and it
  joins the float mask of the SDPA call (one broadcast (h, i, j) tensor where it can).
- Sinks need no explicit path. With ``ℓ = logsumexp_j s_ij`` of the call,
  ``out_sink = out · σ(ℓ − σ_h) = out · exp(ℓ − ℓ')`` with ``ℓ' = logaddexp(ℓ, σ_h)``
  (:func:`sink_sdpa`). On the CPU torch's flash kernel returns ``ℓ``; its own backward run
  with ``ℓ'`` and ``out_sink`` is exactly the backward with the sink (the weights it
  recomputes, ``exp(s − ℓ')``, are the sinked ones) and ``dσ_h = −Σ_i exp(σ_h − ℓ'_i) ·
  Σ_e dout_ie · out_sink_ie``. Elsewhere (CUDA, ``torch.export``, dropout, a float mask that
  needs a gradient) the sink is one more key: a zero key and value whose mask column holds
  ``σ_h``, through the public SDPA.
- Softcap is not linear in ``s``: no SDPA kernel applies it, so a call with it runs the
  explicit path (:meth:`Modifiers.hook` on the scores).

Nothing here imports a layer or another kernel: :mod:`mmattn.kernels.dense` and every kernel
above it call these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mmattn._features import features
from mmattn._helpers import exporting

__all__ = ["Modifiers", "alibi_slopes", "distance", "sink_sdpa", "sink_softmax", "with_bias"]

#: torch's CPU flash kernel (it returns the logsumexp) and its backward, and the dtypes it
#: takes: the one place the kernels (here, :mod:`mmattn.kernels._block_sparse_cpu`) name them.
FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward",
                         None)
FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi's head slopes ``m_h`` (Press et al. 2022, and their reference code).

    For ``n`` a power of two the geometric sequence ``2^(-8/n), 2^(-16/n), ..., 2^-8``; for
    another ``n`` the paper's interpolation: the slopes of the closest smaller power of two
    ``p``, then every other slope of ``2p`` for the remaining ``n - p`` heads (as BLOOM and
    MPT build them).

    Examples:
        >>> alibi_slopes(4)
        [0.25, 0.0625, 0.015625, 0.00390625]
    """

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (index + 1) for index in range(n)]

    if num_heads & (num_heads - 1) == 0:
        return power_of_two(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    return power_of_two(closest) + alibi_slopes(2 * closest)[0::2][: num_heads - closest]


def distance(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """Distances between query and key positions: ``|Δ|`` for one coordinate, else Euclidean.

    Shape:
        - q_pos: (..., i, p); k_pos: (..., j, p) (broadcastable leading dims)
        - returns: (..., i, j) float
    """
    delta = q_pos[..., :, None, :].float() - k_pos[..., None, :, :].float()
    if delta.shape[-1] == 1:
        return delta[..., 0].abs()
    return delta.square().sum(-1).sqrt()


def sequence_positions(length: int, device: torch.device, start: int | Tensor = 0) -> Tensor:
    """(length, 1) positions ``start, start + 1, ...`` of a sequence, as :func:`distance`
    takes them."""
    return (torch.arange(length, device=device) + start)[:, None]


@dataclass(frozen=True, eq=False)
class Modifiers:
    """The score modifiers of one attention call (the per-head values and, where a kernel
    knows them better than ``0 .. i - 1``, the positions).

    Attributes:
        sinks: (h,) sink logits ``σ_h`` in the query heads' order, or None.
        slopes: (h,) ALiBi slopes ``m_h`` (the bias is ``−m_h · d``), or None.
        softcap: ``c`` of ``c · tanh(s / c)``, or None.
        q_pos, k_pos: (..., i, p) / (..., j, p) positions of the call's query rows and key
            columns for ALiBi (default: ``0 .. i - 1`` and ``0 .. j - 1``, top-left).
        bias: the ALiBi term already evaluated for this call, (..., h, i, j) broadcastable
            to the scores; kernels that lay out tiles set it (:meth:`terms` returns it).
    """

    sinks: Tensor | None = None
    slopes: Tensor | None = None
    softcap: float | None = None
    q_pos: Tensor | None = None
    k_pos: Tensor | None = None
    bias: Tensor | None = None

    def __bool__(self) -> bool:
        return self.sinks is not None or self.slopes is not None or self.softcap is not None

    @property
    def explicit(self) -> bool:
        """Whether the call must run the explicit path (softcap has no fused kernel)."""
        return self.softcap is not None

    def names(self) -> list[str]:
        """The modifiers in words, as :func:`mmattn.debug.explain` prints them."""
        found = ["sinks"] if self.sinks is not None else []
        if self.softcap is not None:
            found.append(f"softcap={self.softcap:g}")
        if self.slopes is not None:
            found.append("alibi")
        return found

    def replace(self, **changes: object) -> Modifiers:
        """The same modifiers with these fields changed: ``dataclasses.replace`` written out,
        which every torch.compile traces (torch 2.5's dynamo skips ``dataclasses.replace``).
        """
        fields = {"sinks": self.sinks, "slopes": self.slopes, "softcap": self.softcap,
                  "q_pos": self.q_pos, "k_pos": self.k_pos, "bias": self.bias}
        return Modifiers(**{**fields, **changes})

    def at(self, q_pos: Tensor | None, k_pos: Tensor | None) -> Modifiers:
        """The same modifiers with ALiBi measured between these positions."""
        return self.replace(q_pos=q_pos, k_pos=k_pos, bias=None)

    def with_terms(self, bias: Tensor | None) -> Modifiers:
        """The same modifiers with the ALiBi term already evaluated (see :attr:`bias`)."""
        return self.replace(bias=bias)

    def heads(self, start: int, stop: int) -> Modifiers:
        """The modifiers of query heads ``start .. stop - 1`` (a rank's heads)."""
        return self.replace(
            sinks=None if self.sinks is None else self.sinks[start:stop],
            slopes=None if self.slopes is None else self.slopes[start:stop],
        )

    def alibi(self, q_pos: Tensor, k_pos: Tensor, dtype: torch.dtype) -> Tensor | None:
        """``−m_h · d(i, j)`` between positions, (..., h, i, j); None without ALiBi."""
        return None if self.slopes is None else self.from_distance(distance(q_pos, k_pos), dtype)

    def from_distance(self, dist: Tensor, dtype: torch.dtype) -> Tensor:
        """``−m_h · d`` from distances (..., i, j): (..., h, i, j)."""
        return dist.to(dtype).unsqueeze(-3) * -self.slopes.to(dtype)[:, None, None]

    def terms(
        self, q_len: int, k_len: int, device: torch.device, dtype: torch.dtype
    ) -> Tensor | None:
        """The additive ALiBi term of a call, (..., h, i, j), or None: :attr:`bias` when set,
        else measured between :attr:`q_pos` and :attr:`k_pos` (default ``0 ..``)."""
        if self.bias is not None or self.slopes is None:
            return None if self.bias is None else self.bias.to(dtype)
        q_pos = self.q_pos if self.q_pos is not None else sequence_positions(q_len, device)
        k_pos = self.k_pos if self.k_pos is not None else sequence_positions(k_len, device)
        return self.alibi(q_pos, k_pos, dtype)

    def cap(self, scores: Tensor) -> Tensor:
        """``c · tanh(s / c)`` (unchanged without softcap)."""
        if self.softcap is None:
            return scores
        return torch.tanh(scores / self.softcap) * self.softcap

    def hook(self, scores: Tensor, bias: Tensor | None) -> Tensor:
        """The explicit score hook on a tile: softcap, then the additive term (no mask)."""
        scores = self.cap(scores)
        return scores if bias is None else scores + bias

    def row_sinks(self, groups: int = 1, rows: int = 1) -> Tensor | None:
        """The sink logit of every score row: (1, h, 1, 1), or (1, k, g · i, 1) when the ``g``
        query heads of a key head are folded into the query axis (``b (k g) i -> b k (g i)``).
        """
        if self.sinks is None:
            return None
        if groups == 1:
            return self.sinks[None, :, None, None]
        sinks = self.sinks.view(-1, groups, 1).expand(-1, groups, rows)
        return sinks.reshape(1, -1, groups * rows, 1)


def with_bias(mask: Tensor | None, bias: Tensor | None) -> Tensor | None:
    """A bool ("may attend") or float mask with an additive term folded in (float result)."""
    if bias is None:
        return mask
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return torch.where(mask, bias, float("-inf"))
    return mask + bias.to(mask.dtype)


# ---------------------------------------------------------------------- the sink identity


def join_sink(lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """A sink joined to the logsumexp of a row: ``(σ(ℓ − σ_h), ℓ')`` with ``ℓ' =
    logaddexp(ℓ, σ_h)``; the row's output times the first is its sinked output, and a row
    without keys (``ℓ = −inf``) gives 0. Every kernel that merges a sink into a logsumexp
    (the fused sink here, the block-sparse tiles, the sequence-parallel global rows) calls
    this.

    Shape:
        - lse: (..., i); sinks: broadcastable to it
        - returns: two tensors like ``lse`` (its dtype)
    """
    total = torch.logaddexp(lse, sinks.to(lse.dtype))
    return torch.exp(lse - total), total


def sink_grad(sinks: Tensor, total: Tensor, grad: Tensor, out: Tensor) -> Tensor:
    """The gradient of each row's sink logit: ``dσ_h = −exp(σ_h − ℓ') · Σ_e dout_e · out_e``
    (``out`` the sinked output, ``total`` = ℓ' from :func:`join_sink`); the caller sums it
    over the rows.

    Shape:
        - sinks: broadcastable to total; total: (..., i); grad, out: (..., i, e)
        - returns: like ``total``
    """
    rowsum = (grad.to(total.dtype) * out.to(total.dtype)).sum(-1)
    return -(torch.exp(sinks.to(total.dtype) - total) * rowsum)


# ---------------------------------------------------------------------- sinks, explicit


def sink_softmax(scores: Tensor, sinks: Tensor) -> Tensor:
    """Softmax over a row and its sink, the sink column dropped:
    ``exp(s − logaddexp(logsumexp(s), σ))``; float32 for half-precision scores.

    Shape:
        - scores: (..., i, j); sinks: broadcastable to (..., i, 1)
        - returns: (..., i, j)
    """
    if scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()
    _, total = join_sink(torch.logsumexp(scores, -1, keepdim=True), sinks)
    return torch.exp(scores - total)


# ---------------------------------------------------------------------- sinks, fused


def sink_sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    sinks: Tensor,
    *,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    groups: int,
) -> Tensor:
    """Fused attention with a sink per query head (see the module docstring for the math).

    The caller (:func:`mmattn.kernels.dense.sdpa`) has opened the rows without an allowed
    key and zeroes them afterwards.

    Shape:
        - q: (b, h, i, e); k: (b, k, j, e); v: (b, k, j, e_v); sinks: (h,)
        - mask: bool (True = may attend) or float, broadcastable to (b, h, i, j), or None
        - returns: (b, h, i, e_v)
    """
    if mask is not None:
        if mask.dtype == torch.bool:
            mask = torch.where(mask, 0.0, float("-inf")).to(q.dtype)
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    rows = sinks[None, :, None, None]
    if cpu_flash_ok(q, mask, dropout_p):
        if not features().cpu_flash_gqa:  # the kernel would read key heads out of bounds
            k, v = repeat_kv(k, v, groups)
        return _LseSink.apply(q, k, v, rows, mask, is_causal, scale)
    return _sink_key(q, k, v, mask, rows, dropout_p, is_causal, scale, groups)


def cpu_flash_ok(q: Tensor, mask: Tensor | None, dropout_p: float) -> bool:
    """Whether torch's CPU flash kernel (which returns the logsumexp) takes this call: the
    one test of it (the sinks' path here, block-sparse's CPU path). Grouped key heads are
    the caller's (:func:`repeat_kv` where the kernel has none, ``features().cpu_flash_gqa``).
    """
    return (
        features().cpu_flash and q.device.type == "cpu" and dropout_p == 0.0
        and q.dtype in FLASH_DTYPES and not exporting()
        and not (mask is not None and mask.requires_grad)
    )


def repeat_kv(k: Tensor, v: Tensor, groups: int) -> tuple[Tensor, Tensor]:
    """Each key and value head repeated for its ``groups`` query heads (for a kernel without
    grouped heads; autograd sums the repeats' gradients back).

    Shape:
        - k: (b, k, j, e); v: (b, k, j, f)
        - returns: (b, k g, j, e), (b, k g, j, f)
    """
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def gqa_flag(groups: int) -> bool:
    """SDPA's ``enable_gqa`` for ``groups`` query heads per key head, a Python bool.

    Head counts can be symbolic (torch 2.5's ``torch.compile(dynamic=True)`` makes a
    module's ints symbolic), and ``groups > 1`` then a SymBool, which that torch's SDPA
    refuses; a branch on it is a guard instead, and the flag a constant.
    """
    if groups > 1:
        return True
    return False


class _LseSink(torch.autograd.Function):
    """out · exp(ℓ − ℓ') from torch's CPU flash kernel; its own backward with ℓ' (exact)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, mask, is_causal, scale):  # noqa: D102
        out, lse = FLASH(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
        share, total = join_sink(lse, sinks[..., 0])  # (b, h, i), float32 for half inputs
        out = out * share[..., None].to(out.dtype)
        ctx.save_for_backward(q, k, v, mask, out, total, sinks)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        q, k, v, mask, out, total, sinks = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dk, dv = FLASH_BACKWARD(
            grad, q, k, v, out, total, 0.0, ctx.is_causal, attn_mask=mask, scale=ctx.scale,
        )
        dsinks = sink_grad(sinks[..., 0], total, grad, out)[..., None]
        return dq, dk, dv, dsinks.sum_to_size(sinks.shape).to(sinks.dtype), None, None, None


def _sink_key(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, rows: Tensor, dropout_p: float,
    is_causal: bool, scale: float, groups: int,
) -> Tensor:
    """The sink as one more key: zero key and value, its mask column ``σ_h`` (public SDPA)."""
    heads, q_len, k_len = q.shape[1], q.shape[2], k.shape[2]
    k = torch.cat([k, k.new_zeros(*k.shape[:2], 1, k.shape[3])], dim=2)
    v = torch.cat([v, v.new_zeros(*v.shape[:2], 1, v.shape[3])], dim=2)
    base = mask if mask is not None else q.new_zeros(1, 1, 1, k_len)
    if is_causal:  # top-left, over the real keys only: the sink stays visible
        causal = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril()
        base = torch.where(causal, base, float("-inf"))
    lead, span = base.shape[0], (q_len if exporting() else base.shape[2])  # ONNX: row per query
    base = base.expand(lead, heads, span, k_len)
    column = rows.to(q.dtype).expand(lead, heads, span, 1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.cat([base, column], dim=-1), dropout_p=dropout_p, scale=scale,
        enable_gqa=gqa_flag(groups),
    )
