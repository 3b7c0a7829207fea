"""timm's ``Attention`` on mmattn's kernel: same constructor, same state-dict names.

Axis key: ``b`` batch, ``i`` tokens, ``h`` heads, ``e`` head width, ``d`` model width.

:class:`Attention` takes every argument of ``timm.layers.Attention`` (timm 1.0.31) and owns
the same submodules — ``qkv``, ``q_norm``, ``k_norm``, ``attn_drop``, ``norm``, ``gate``,
``proj``, ``proj_drop`` — so a timm checkpoint loads into it with ``strict=True`` and
``timm.create_model(name, attn_layer=Attention)`` builds a timm model on mmattn's kernel
(:func:`mmattn.kernels.dense.attend`: fused SDPA or the explicit twin, padding-safe).
:func:`replace_timm_attention` swaps the ``timm.layers.Attention`` modules of a built model;
:func:`mmattn.replace_attention` calls it when timm is loaded.

timm is needed only by this module: ``import mmattn`` does not import it, and importing this
module without timm raises ImportError naming the ``mmattn[timm]`` extra.
"""

from __future__ import annotations

from typing import ClassVar

try:
    import timm.layers as _timm_layers
    from timm.layers.config import use_fused_attn as _timm_use_fused_attn
except ImportError as error:  # pragma: no cover - exercised by hiding timm in a test
    raise ImportError(
        'mmattn.integrations.timm needs timm: pip install "mmattn[timm]"'
    ) from error

import torch
from einops import rearrange
from torch import Tensor, nn

from mmattn import _checks as checks
from mmattn.integrations import _timm_models as _models
from mmattn.integrations._swap import swap_modules
from mmattn.integrations._timm_models import (
    MHSA,
    Attention2d,
    AttentionCl,
    EvaAttention,
    RelPosAttention,
    WindowAttention,
)
from mmattn.kernels.dense import attend, explicit_reasons, report, reporting

__all__ = [
    "MHSA",
    "Attention",
    "Attention2d",
    "AttentionCl",
    "EvaAttention",
    "RelPosAttention",
    "WindowAttention",
    "replace_timm_attention",
]

TimmAttention = _timm_layers.Attention


def _norm_layer(norm_layer: object) -> type[nn.Module] | None:
    """``norm_layer`` as a constructor: a name (``"LayerNorm"``, ``"rmsnorm"``, as timm's
    models take it) resolved by timm's own ``get_norm_layer`` where this timm has it.

    Raises:
        ValueError: a name timm does not know (or a timm without ``get_norm_layer``).
        TypeError: neither None, a name nor a callable.
    """
    if norm_layer is None or callable(norm_layer):
        return norm_layer
    if not isinstance(norm_layer, str):
        raise TypeError(
            f"norm_layer must be a norm constructor (e.g. nn.LayerNorm), a timm norm name "
            f"(e.g. 'layernorm') or None, got {type(norm_layer).__name__}"
        )
    resolve = getattr(_timm_layers, "get_norm_layer", None)
    try:
        return resolve(norm_layer)  # timm's rule ('' = no norm)
    except (KeyError, AssertionError, TypeError) as error:
        raise ValueError(
            f"norm_layer={norm_layer!r} is not a norm layer name timm knows "
            f"(timm.layers.get_norm_layer{'' if resolve else ' is missing in this timm'}); "
            "give the class instead, e.g. norm_layer=nn.LayerNorm"
        ) from error


_NOT_FUSED = "the module's fused_attn flag is False (timm's per-module switch)"


class Attention(nn.Module):
    r"""timm's multi-head self-attention, computed by mmattn's attention kernel.

    .. math::
        \mathrm{out} = \mathrm{proj}\big(\mathrm{norm}(\mathrm{softmax}(
        \mathrm{q\_norm}(q)\,\mathrm{k\_norm}(k)^\top \cdot s + M)\,v) \odot g\big)

    with ``q, k, v`` from ``qkv(x)``, ``s = head_dim ** -0.5``, ``M`` the ``attn_mask`` and
    ``g = sigmoid(gate(x))`` when ``gated`` (else 1). The constructor, attributes
    (``num_heads``, ``head_dim``, ``attn_dim``, ``scale``, ``fused_attn``) and submodule names
    are those of ``timm.layers.Attention``; pass the class as ``attn_layer`` to a timm model,
    or swap a built model with :func:`mmattn.replace_attention`.

    Paths. The fused SDPA path runs unless weights are requested, mmattn's switch is off
    (``MMATTN_FUSED_ATTN=0``, :func:`mmattn.functional.set_fused_attn` /
    :func:`~mmattn.functional.fused_attn`) or this module's ``fused_attn`` is False; else the
    explicit softmax path, which can return the weights. ``fused_attn`` starts as timm's
    ``use_fused_attn()`` (so ``TIMM_FUSED_ATTN=0``, ``timm.layers.set_fused_attn(False)`` and
    ``timm.layers.set_exportable(True)`` before building still turn it off) and, as in timm,
    may be set per module afterwards. Both paths give the same numbers.

    Differences from timm. A query row whose keys are all masked gives zeros (timm: NaN), and
    keys no query may attend never leak NaN or Inf into real outputs. ``attn_mask`` together
    with ``is_causal=True`` raises (timm's fused path rejects the pair, its unfused path
    drops the mask). ``need_weights=True`` also returns the (post-dropout) weights, so
    :func:`mmattn.debug.record_attention` sees the maps on either path; timm's
    ``AttentionExtract`` does not see this module (there is no ``softmax`` node and
    ``attn_drop`` is not called: the kernel applies the dropout).

    Args:
        dim: input width ``d`` of the tokens.
        num_heads: number of attention heads.
        attn_head_dim: width of each head; default ``dim // num_heads``.
        dim_out: output width; default ``dim``.
        qkv_bias: bias in the ``qkv`` projection (and in ``gate``).
        qk_norm: normalise queries and keys per head with ``norm_layer(head_dim)``.
        scale_norm: normalise the merged heads with ``norm_layer(attn_dim)`` before ``proj``.
        proj_bias: bias in the output projection.
        gated: multiply the merged heads by ``sigmoid(gate(x))`` before ``proj``.
        attn_drop: dropout on the attention weights (training mode only).
        proj_drop: dropout after the output projection.
        norm_layer: constructor of the norms, or its timm name (``"LayerNorm"``,
            ``"rmsnorm"``: resolved by ``timm.layers.get_norm_layer``, as timm's models do);
            needed when ``qk_norm`` or ``scale_norm``.
        device, dtype: where and in what dtype the parameters are created.

    Shape:
        - x: (b, i, dim); attn_mask: broadcastable to (b, num_heads, i, i), bool (True = may
          attend) or float (added to the scores)
        - returns: (b, i, dim_out), and the weights (b, num_heads, i, i) — or (b, i, i) with
          ``average_attn_weights=True`` — when ``need_weights``

    Raises:
        TypeError: an argument of the wrong type (the message names it).
        ValueError: ``dim`` not divisible by ``num_heads`` without ``attn_head_dim``;
            ``qk_norm`` or ``scale_norm`` without ``norm_layer``; a dropout outside [0, 1).

    Examples:
        >>> attn = Attention(16, num_heads=2, qkv_bias=True)
        >>> attn(torch.randn(3, 5, 16)).shape
        torch.Size([3, 5, 16])
        >>> out, weights = attn(torch.randn(3, 5, 16), need_weights=True)
        >>> weights.shape
        torch.Size([3, 2, 5, 5])
        >>> sorted(attn.state_dict())
        ['proj.bias', 'proj.weight', 'qkv.bias', 'qkv.weight']
    """

    #: For :func:`mmattn.debug.record_attention`: ``forward`` returns a bare tensor unless
    #: ``need_weights=True`` (timm's convention), so a recorded call hands back the tensor.
    bare_output_without_weights: ClassVar[bool] = True

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        attn_head_dim: int | None = None,
        dim_out: int | None = None,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        scale_norm: bool = False,
        proj_bias: bool = True,
        gated: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        norm_layer: type[nn.Module] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dim = checks.check_positive_int("dim", dim)
        num_heads = checks.check_positive_int("num_heads", num_heads)
        dim_out = dim if dim_out is None else checks.check_positive_int("dim_out", dim_out)
        for name, flag in (("qkv_bias", qkv_bias), ("qk_norm", qk_norm),
                           ("scale_norm", scale_norm), ("proj_bias", proj_bias),
                           ("gated", gated)):
            checks.check_bool(name, flag)
        attn_drop = checks.check_probability("attn_drop", attn_drop)
        proj_drop = checks.check_probability("proj_drop", proj_drop)
        if attn_head_dim is None:
            if dim % num_heads:
                raise ValueError(
                    f"dim must be divisible by num_heads when attn_head_dim is None, got "
                    f"dim={dim}, num_heads={num_heads}"
                )
            head_dim = dim // num_heads
        else:
            head_dim = checks.check_positive_int("attn_head_dim", attn_head_dim)
        norm_layer = _norm_layer(norm_layer)
        if (qk_norm or scale_norm) and norm_layer is None:
            raise ValueError(
                f"norm_layer must be given when qk_norm or scale_norm is True, got "
                f"qk_norm={qk_norm}, scale_norm={scale_norm}, norm_layer=None"
            )
        dd = {"device": device, "dtype": dtype}
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.attn_dim = num_heads * head_dim
        self.scale = head_dim**-0.5
        self.fused_attn = bool(_timm_use_fused_attn())

        # built in timm's order, so a seeded build draws the same initial weights as timm's
        self.qkv = nn.Linear(dim, self.attn_dim * 3, bias=qkv_bias, **dd)
        self.q_norm = norm_layer(head_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(head_dim, **dd) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.norm = norm_layer(self.attn_dim, **dd) if scale_norm else nn.Identity()
        self.gate = nn.Linear(dim, self.attn_dim, bias=qkv_bias, **dd) if gated else None
        self.proj = nn.Linear(self.attn_dim, dim_out, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    @classmethod
    def from_timm(cls, module: nn.Module) -> Attention:
        """An :class:`Attention` that takes over a ``timm.layers.Attention``'s submodules.

        The new module holds the very same submodules (so the same parameters: weights,
        device, dtype and ``requires_grad`` are kept, and an optimizer built before keeps
        training them), the same ``fused_attn`` flag and the same train/eval mode. Hooks
        registered on the old module itself are not carried over.

        Args:
            module: a ``timm.layers.Attention`` (or a subclass with its attributes).

        Returns:
            The new module; ``module`` is left as it was.

        Raises:
            TypeError: ``module`` is not a ``timm.layers.Attention``.

        Examples:
            >>> import timm.layers
            >>> old = timm.layers.Attention(16, num_heads=4)
            >>> new = Attention.from_timm(old)
            >>> new.qkv is old.qkv, torch.allclose(new(x := torch.randn(1, 3, 16)), old(x))
            (True, True)
        """
        if not isinstance(module, TimmAttention):
            raise TypeError(
                f"module must be a timm.layers.Attention, got {type(module).__name__}"
            )
        gate = getattr(module, "gate", None)
        new = cls(
            module.qkv.in_features,
            num_heads=module.num_heads,
            attn_head_dim=module.head_dim,
            dim_out=module.proj.out_features,
            gated=gate is not None,
            attn_drop=float(module.attn_drop.p),
            proj_drop=float(module.proj_drop.p),
            device="meta",  # a shell: every submodule with parameters is replaced below
        )
        for name in ("qkv", "q_norm", "k_norm", "attn_drop", "norm", "proj", "proj_drop"):
            setattr(new, name, getattr(module, name))
        new.gate = gate
        new.scale = module.scale
        new.fused_attn = bool(module.fused_attn)
        return new.train(module.training)

    def reset_parameters(self) -> None:
        """Re-initialise the projections and norms as their constructors do."""
        for module in (self.qkv, self.q_norm, self.k_norm, self.norm, self.gate, self.proj):
            if module is not None and hasattr(module, "reset_parameters"):
                module.reset_parameters()

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"fused_attn={self.fused_attn}"
        )

    def forward(
        self,
        x: Tensor,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        *,
        need_weights: bool = False,
        average_attn_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Self-attention over ``x``; see the class docstring for the paths and shapes.

        Args:
            x: the tokens.
            attn_mask: None, or bool (True = may attend) / float (added to the scores) in
                timm's (SDPA's) convention; a float mask is cast to the queries' dtype.
            is_causal: token i attends tokens j <= i only.
            need_weights: also return the attention weights (runs the explicit path).
            average_attn_weights: with ``need_weights``, average the weights over heads.

        Returns:
            The output, or ``(output, weights)`` when ``need_weights``.

        Raises:
            TypeError: ``x`` or ``attn_mask`` of the wrong type or dtype.
            ValueError: ``x`` not (b, i, dim); a mask that does not broadcast to
                (b, num_heads, i, i) or lives on another device; ``attn_mask`` given with
                ``is_causal=True``.
        """
        self._check_input(x, attn_mask, is_causal)
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        q, k, v = rearrange(
            self.qkv(x), "b i (three h e) -> three b h i e", three=3, h=self.num_heads
        ).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        attn_mask = _at_least_2d(attn_mask)
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(q.dtype)
        dropout_p = self.attn_drop.p if self.training else 0.0
        forced = not need_weights and not self.fused_attn
        if forced and reporting():
            report(
                "explicit", [*explicit_reasons(False), _NOT_FUSED], q=q, k=k, v=v,
                mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=self.scale,
            )
        out, weights = attend(
            q, k, v, attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=self.scale,
            need_weights=need_weights or forced, report_path=not forced, groups=1,
        )
        out = self.norm(rearrange(out, "b h i e -> b i (h e)"))
        if gate is not None:
            out = out * gate
        out = self.proj_drop(self.proj(out))
        if not need_weights:
            return out
        return out, (weights.mean(dim=1) if average_attn_weights else weights)

    def _check_input(self, x: Tensor, attn_mask: Tensor | None, is_causal: bool) -> None:
        checks.check_tensor("x", x)
        checks.check_floating("x", x)
        checks.check_rank("x", x, (3,), "(batch, tokens, dim)")
        checks.check_last_dim("x", x, self.qkv.in_features, "dim")
        checks.check_bool("is_causal", is_causal)
        if attn_mask is None:
            return
        checks.check_tensor("attn_mask", attn_mask)
        checks.check_mask_dtype("attn_mask", attn_mask)
        checks.check_same_device("attn_mask", attn_mask, "x", x)
        if is_causal:
            raise ValueError(
                "attn_mask must be None when is_causal=True (timm's fused path rejects the "
                "pair and its unfused path ignores the mask); fold the causal rule into "
                "attn_mask instead"
            )
        target = (x.shape[0], self.num_heads, x.shape[1], x.shape[1])
        if attn_mask.dim() > 4 or not all(
            m in (1, t) for m, t in zip(attn_mask.shape[::-1], target[::-1])
        ):
            raise ValueError(
                f"attn_mask must broadcast to (batch, num_heads, tokens, tokens) = {target}, "
                f"got {tuple(attn_mask.shape)}"
            )


def _at_least_2d(mask: Tensor | None) -> Tensor | None:
    """A (j,) mask as (1, j): the kernel's mask helpers index the last two axes."""
    return mask if mask is None or mask.dim() >= 2 else mask.reshape(1, -1)


def replace_timm_attention(model: nn.Module) -> int:
    """Swap the attention modules of timm's models inside ``model`` for ours, in place.

    Each ``timm.layers.Attention`` becomes ``Attention.from_timm(m)``: the same submodules
    and parameters (so weights, device, dtype, ``requires_grad`` and the state-dict keys are
    kept), mode and ``fused_attn`` flag. Swin's ``WindowAttention``, EVA's ``EvaAttention``,
    ``RelPosAttention`` (``vit_relpos_*``), MaxViT's ``AttentionCl`` / ``Attention2d`` and
    ConViT's ``MHSA`` become our subclasses of them (:class:`WindowAttention`, ...), holding
    the very same parameters, buffers and settings. A module shared by several parents stays
    shared. Skipped with a warning that names the module and the reason: a subclass that
    overrides ``forward`` (its behaviour is not timm's), ConViT's ``GPSA`` (two softmax maps
    mixed by a gate: no single softmax over biased scores computes it), and a
    ``RelPosAttention`` / MaxViT attention whose ``rel_pos`` is not one of timm's bias
    modules. :func:`mmattn.replace_attention` calls this when timm is loaded.

    Args:
        model: any ``nn.Module``; it is modified in place.

    Returns:
        How many modules were replaced (0 when there are none).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``model`` is itself a timm attention module (no parent to put the new
            one in: use ``from_timm`` of the matching class).

    Examples:
        >>> from timm.models.vision_transformer import VisionTransformer
        >>> vit = VisionTransformer(img_size=16, patch_size=8, embed_dim=16, depth=2,
        ...                         num_heads=2, num_classes=3)
        >>> replace_timm_attention(vit)
        2
        >>> type(vit.blocks[0].attn).__module__
        'mmattn.integrations.timm'
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    stock = (TimmAttention, *(c for c, rule in _models.RULES.items() if callable(rule)))
    if isinstance(model, stock) and not isinstance(model, (Attention, *_models.OURS)):
        ours = "Attention" if isinstance(model, TimmAttention) else type(model).__name__
        raise ValueError(
            f"model is itself a timm {type(model).__name__} and cannot be replaced in place; "
            f"use mmattn.integrations.timm.{ours}.from_timm(model)"
        )
    rules = {TimmAttention: Attention.from_timm, **_models.RULES}
    return swap_modules(model, rules, ours=(Attention, *_models.OURS))
