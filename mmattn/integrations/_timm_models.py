"""The attention of timm's models beyond ``timm.layers.Attention``, on mmattn's kernels.

Axis key: ``b`` batch (``(b w)`` windows of a batch), ``w`` windows, ``h`` heads, ``n``
tokens, ``e`` head width.

Each class subclasses timm's class of the same name and replaces only ``forward``: timm's
projections and norms (its submodules) make q, k and v, the attention is
:func:`mmattn.kernels.dense.attend` or, with a position bias,
:func:`mmattn.kernels.biased.biased_attend`. Parameters, buffers and attributes stay timm's,
so timm's state dicts load with ``strict=True``. :data:`RULES` is what
:func:`mmattn.integrations.timm.replace_timm_attention` applies; a rule that is a string is
the reason a class is skipped (ConViT's ``GPSA``).

- Swin ``WindowAttention`` (``swin_*``): Swin's table via
  :func:`mmattn.position.relative_position_bias`, plus the block's shift mask;
- EVA's ``EvaAttention`` (``eva02_*``): timm's rotary embedding (``rope``) on q and k after
  the prefix tokens, then ``attn_mask`` / ``is_causal`` as timm passes them to SDPA;
- ``RelPosAttention`` (``vit_relpos_*``) and MaxViT's ``AttentionCl`` / ``Attention2d``
  (``maxvit_*``, ``coatnet_*``): the bias of their ``rel_pos`` module (``get_bias()``) or the
  model's ``shared_rel_pos``;
- ConViT's ``MHSA`` (its last blocks): plain attention.

Only imported by :mod:`mmattn.integrations.timm` (which names the extra when timm is
missing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.layers import pos_embed_rel as _rel
from timm.layers.pos_embed_sincos import apply_rot_embed_cat
from timm.models import convit as _convit
from timm.models import eva as _eva
from timm.models import maxxvit as _maxxvit
from timm.models import swin_transformer as _swin
from timm.models import vision_transformer_relpos as _relpos
from torch import Tensor, nn

from mmattn.integrations._swap import adopt
from mmattn.kernels.biased import biased_attend
from mmattn.kernels.dense import attend
from mmattn.relative_position import gather_bias

__all__ = [
    "MHSA",
    "RULES",
    "Attention2d",
    "AttentionCl",
    "EvaAttention",
    "RelPosAttention",
    "WindowAttention",
]

#: ``rel_pos`` modules whose ``forward(attn)`` is ``attn + get_bias()``, so the bias alone
#: reproduces them.
_KNOWN_REL_POS = (_rel.RelPosBias, _rel.RelPosMlp, _rel.RelPosBiasTf)

GPSA_REASON = (
    "ConViT's GPSA mixes two softmax maps (content and position) with a learned per-head "
    "gate; no single softmax over biased scores computes it"
)


def _core(
    module: nn.Module, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None, *,
    finite: bool = False, attn_mask: Tensor | None = None, is_causal: bool = False,
) -> Tensor:
    """The attention of a timm module: its scale, dropout and ``fused_attn`` flag."""
    dropout_p = module.attn_drop.p if module.training else 0.0
    fused = bool(getattr(module, "fused_attn", True))
    if bias is not None:
        out, _ = biased_attend(
            q, k, v, bias.to(q.dtype), dropout_p=dropout_p, scale=module.scale,
            finite=finite, fused=None if fused else False,
        )
        return out
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.to(q.dtype)
    out, _ = attend(
        q, k, v, attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=module.scale,
        need_weights=not fused, groups=1,
    )
    return out


class _Adopting:
    """``from_timm``: our subclass holding a built timm module's tensors and settings."""

    _stock: type

    @classmethod
    def from_timm(cls, module: nn.Module) -> nn.Module:
        """Our class holding ``module``'s parameters, buffers, submodules and settings.

        Raises:
            TypeError: ``module`` is not of the matching timm class.
        """
        if not isinstance(module, cls._stock):
            raise TypeError(
                f"module must be a timm {cls._stock.__name__}, got {type(module).__name__}"
            )
        return adopt(cls, module)


class WindowAttention(_Adopting, _swin.WindowAttention):
    """timm's Swin ``WindowAttention`` on mmattn's kernel (same state dict, same numbers).

    ``softmax(q kᵀ · scale + B + mask) v`` per window, ``B`` Swin's relative-position bias
    and ``mask`` the block's shift mask (``-100`` between regions; a ``-inf`` mask is taken
    too: a row with no allowed key gives zeros).

    Shape:
        - x: ((b w), n, d); mask: (w, n, n) or None
        - returns: ((b w), n, d)

    Examples:
        >>> attn = WindowAttention(16, num_heads=2, window_size=3)
        >>> attn(torch.randn(4, 9, 16), mask=torch.zeros(2, 9, 9)).shape
        torch.Size([4, 9, 16])
    """

    _stock = _swin.WindowAttention

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        q, k, v = rearrange(
            self.qkv(x), "b n (three h e) -> three b h n e", three=3, h=self.num_heads
        ).unbind(0)
        bias = gather_bias(self.relative_position_bias_table, self.relative_position_index)
        if mask is not None:  # windows of one image share the mask: (b w) -> b w
            windows = mask.shape[0]
            q, k, v = (rearrange(t, "(b w) h n e -> b w h n e", w=windows) for t in (q, k, v))
            bias = bias + mask[:, None].to(bias.dtype)
        out = _core(self, q, k, v, bias, finite=mask is None)
        if mask is not None:
            out = rearrange(out, "b w h n e -> (b w) h n e")
        return self.proj_drop(self.proj(rearrange(out, "b h n e -> b n (h e)")))


class EvaAttention(_Adopting, _eva.EvaAttention):
    """timm's ``EvaAttention`` (EVA-02: rotary positions, no key bias) on mmattn's kernel.

    q and k get timm's rotary embedding ``rope`` after the ``num_prefix_tokens`` prefix
    tokens; ``attn_mask`` (bool: True = may attend, or float: added) and ``is_causal``
    follow SDPA, as in timm. A row with no allowed key gives zeros (timm: NaN).

    Shape:
        - x: (b, n, d); rope: timm's (n - prefix, 2 e) sin/cos table; attn_mask:
          broadcastable to (b, h, n, n)
        - returns: (b, n, d)

    Examples:
        >>> attn = EvaAttention(16, num_heads=2, norm_layer=torch.nn.LayerNorm)
        >>> attn(torch.randn(2, 5, 16), rope=torch.randn(4, 16)).shape
        torch.Size([2, 5, 16])
    """

    _stock = _eva.EvaAttention

    def forward(
        self, x: Tensor, rope: Tensor | None = None, attn_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        gate = getattr(self, "gate", None)
        gate = gate(x).sigmoid() if gate is not None else None
        if self.qkv is not None:
            qkv = self.qkv(x) if self.q_bias is None else self._biased_qkv(x)
            q, k, v = rearrange(
                qkv, "b n (three h e) -> three b h n e", three=3, h=self.num_heads
            ).unbind(0)
        else:
            q, k, v = (
                rearrange(proj(x), "b n (h e) -> b h n e", h=self.num_heads)
                for proj in (self.q_proj, self.k_proj, self.v_proj)
            )
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = (self._rotate(t, rope).type_as(v) for t in (q, k))
        out = _core(self, q, k, v, attn_mask=attn_mask, is_causal=is_causal)
        out = self.norm(rearrange(out, "b h n e -> b n (h e)"))
        if gate is not None:
            out = out * gate
        return self.proj_drop(self.proj(out))

    def _biased_qkv(self, x: Tensor) -> Tensor:
        bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
        if getattr(self, "qkv_bias_separate", False):
            return self.qkv(x) + bias
        return F.linear(x, self.qkv.weight, bias)

    def _rotate(self, t: Tensor, rope: Tensor) -> Tensor:
        prefix = self.num_prefix_tokens
        half = bool(getattr(self, "rotate_half", False))
        rotated = apply_rot_embed_cat(t[:, :, prefix:], rope, half=half)
        return torch.cat([t[:, :, :prefix], rotated], dim=2)


class _RelPosBiased(_Adopting):
    """The bias of ``rel_pos`` (or the model's ``shared_rel_pos``) on mmattn's kernel."""

    @classmethod
    def from_timm(cls, module: nn.Module) -> nn.Module | str:
        """Our class holding ``module``'s tensors, or why it cannot (an unknown ``rel_pos``).

        Raises:
            TypeError: ``module`` is not of the matching timm class.
        """
        rel_pos = getattr(module, "rel_pos", None)
        if rel_pos is not None and (
            not isinstance(rel_pos, _KNOWN_REL_POS)
            or type(rel_pos).forward not in {c.forward for c in _KNOWN_REL_POS}
        ):
            return (
                f"its rel_pos is a {type(rel_pos).__name__}, not one of timm's "
                f"{', '.join(c.__name__ for c in _KNOWN_REL_POS)} (whose forward adds "
                "get_bias() to the scores)"
            )
        return super().from_timm(module)

    def _bias(self, shared_rel_pos: Tensor | None) -> tuple[Tensor | None, bool]:
        if self.rel_pos is not None:
            return self.rel_pos.get_bias(), True
        return shared_rel_pos, False


class RelPosAttention(_RelPosBiased, _relpos.RelPosAttention):
    """timm's ``RelPosAttention`` (``vit_relpos_*``) on mmattn's kernel.

    ``softmax(q kᵀ · scale + B) v`` with ``B`` the bias of its ``rel_pos`` module, else the
    model's ``shared_rel_pos`` (taken as a float mask: a ``-inf`` row gives zeros).

    Shape:
        - x: (b, n, d); shared_rel_pos: broadcastable to (b, h, n, n)
        - returns: (b, n, d)

    Examples:
        >>> from functools import partial
        >>> from timm.layers import RelPosMlp
        >>> attn = RelPosAttention(16, num_heads=2,
        ...                        rel_pos_cls=partial(RelPosMlp, window_size=(2, 3)))
        >>> attn(torch.randn(2, 6, 16)).shape
        torch.Size([2, 6, 16])
    """

    _stock = _relpos.RelPosAttention

    def forward(self, x: Tensor, shared_rel_pos: Tensor | None = None) -> Tensor:
        q, k, v = rearrange(
            self.qkv(x), "b n (three h e) -> three b h n e", three=3, h=self.num_heads
        ).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        bias, finite = self._bias(shared_rel_pos)
        out = _core(self, q, k, v, bias, finite=finite)
        return self.proj_drop(self.proj(rearrange(out, "b h n e -> b n (h e)")))


class AttentionCl(_RelPosBiased, _maxxvit.AttentionCl):
    """timm's MaxViT ``AttentionCl`` (channels last, ``maxvit_*``) on mmattn's kernel.

    Shape:
        - x: (b, ..., d): every axis between the first and the last is a token axis
        - returns: (b, ..., d_out)

    Examples:
        >>> attn = AttentionCl(16, dim_head=8)
        >>> attn(torch.randn(2, 3, 3, 16)).shape
        torch.Size([2, 3, 3, 16])
    """

    _stock = _maxxvit.AttentionCl

    def forward(self, x: Tensor, shared_rel_pos: Tensor | None = None) -> Tensor:
        tokens = x.reshape(x.shape[0], -1, x.shape[-1])
        qkv = self.qkv(tokens)
        if self.head_first:  # per head: [q | k | v]
            pattern = "b n (h three e) -> three b h n e"
        else:
            pattern = "b n (three h e) -> three b h n e"
        q, k, v = rearrange(qkv, pattern, three=3, h=self.num_heads).unbind(0)
        bias, finite = self._bias(shared_rel_pos)
        out = _core(self, q, k, v, bias, finite=finite)
        out = rearrange(out, "b h n e -> b n (h e)").reshape(*x.shape[:-1], -1)
        return self.proj_drop(self.proj(out))


class Attention2d(_RelPosBiased, _maxxvit.Attention2d):
    """timm's MaxViT / CoAtNet ``Attention2d`` (NCHW, 1 x 1 convolutions) on mmattn's kernel.

    Shape:
        - x: (b, d, rows, cols)
        - returns: (b, d_out, rows, cols)

    Examples:
        >>> attn = Attention2d(16, dim_head=8)
        >>> attn(torch.randn(2, 16, 3, 3)).shape
        torch.Size([2, 16, 3, 3])
    """

    _stock = _maxxvit.Attention2d

    def forward(self, x: Tensor, shared_rel_pos: Tensor | None = None) -> Tensor:
        rows, cols = x.shape[-2], x.shape[-1]
        qkv = self.qkv(x).flatten(2)  # (b, channels, n)
        if self.head_first:
            pattern = "b (h three e) n -> three b h n e"
        else:
            pattern = "b (three h e) n -> three b h n e"
        q, k, v = rearrange(qkv, pattern, three=3, h=self.num_heads).unbind(0)
        bias, finite = self._bias(shared_rel_pos)
        out = _core(self, q, k, v, bias, finite=finite)
        out = rearrange(out, "b h (r c) e -> b (h e) r c", r=rows, c=cols)
        return self.proj_drop(self.proj(out))


class MHSA(_Adopting, _convit.MHSA):
    """ConViT's ``MHSA`` (its blocks after the GPSA ones) on mmattn's kernel.

    Shape:
        - x: (b, n, d)
        - returns: (b, n, d)

    Examples:
        >>> MHSA(16, num_heads=2)(torch.randn(2, 5, 16)).shape
        torch.Size([2, 5, 16])
    """

    _stock = _convit.MHSA

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = rearrange(
            self.qkv(x), "b n (three h e) -> three b h n e", three=3, h=self.num_heads
        ).unbind(0)
        out = _core(self, q, k, v)
        return self.proj_drop(self.proj(rearrange(out, "b h n e -> b n (h e)")))


#: stock timm class -> builder (or the reason it is skipped).
RULES = {
    _swin.WindowAttention: WindowAttention.from_timm,
    _eva.EvaAttention: EvaAttention.from_timm,
    _relpos.RelPosAttention: RelPosAttention.from_timm,
    _maxxvit.AttentionCl: AttentionCl.from_timm,
    _maxxvit.Attention2d: Attention2d.from_timm,
    _convit.MHSA: MHSA.from_timm,
    _convit.GPSA: GPSA_REASON,
}

#: Our classes: left alone by a second swap.
OURS = (WindowAttention, EvaAttention, RelPosAttention, AttentionCl, Attention2d, MHSA)
