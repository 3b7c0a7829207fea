r"""torchvision's Swin attention on mmattn's kernel: same class, same state dict.

Axis key: ``b`` batch, ``r``/``c`` window rows/columns of the (padded) feature map, ``w``
windows (``r c``), ``n`` tokens in a window (``wh ww``), ``h`` heads, ``e`` head width,
``d`` channels.

:class:`ShiftedWindowAttention` and :class:`ShiftedWindowAttentionV2` subclass torchvision's
classes of the same names (``torchvision.models.swin_transformer``) and replace only
``forward``: the feature map is padded, cyclically shifted and cut into windows as
torchvision does, the bias of each window is Swin's table gathered by
:func:`mmattn.position.relative_position_bias` (V2: ``16 · sigmoid`` of the ``cpb_mlp`` of
the log-spaced offsets) plus the ``-100`` shift mask, and the attention is
:func:`mmattn.kernels.biased.biased_attend` (V2: cosine attention, the normalised queries
scaled by ``exp(min(logit_scale, log 100))``). Parameters, buffers and attributes are
torchvision's, so a stock state dict loads with ``strict=True``.
:func:`replace_torchvision_attention` swaps them in a built model (``swin_t``,
``swin_v2_t``, ...); :func:`mmattn.replace_attention` calls it when torchvision's Swin is
loaded.

torchvision is needed only by this module: ``import mmattn`` does not import it, and
importing this module without torchvision raises ImportError naming the ``mmattn[vision]``
extra.
"""

from __future__ import annotations

import math

try:
    from torchvision.models import swin_transformer as _swin
except ImportError as error:  # pragma: no cover - exercised by hiding torchvision in a test
    raise ImportError(
        'mmattn.integrations.torchvision needs torchvision: pip install "mmattn[vision]"'
    ) from error

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from mmattn import _checks as checks
from mmattn.integrations._swap import adopt, swap_modules
from mmattn.kernels.biased import biased_attend
from mmattn.relative_position import gather_bias

__all__ = [
    "ShiftedWindowAttention",
    "ShiftedWindowAttentionV2",
    "replace_torchvision_attention",
    "shift_mask",
    "shifted_window_attention",
]

#: Swin's score for a pair of tokens that the cyclic shift put in one window from two
#: regions of the map (added, not -inf, so the numbers are torchvision's).
SHIFT_MASK_VALUE = -100.0


def shift_mask(
    padded: tuple[int, int], window: tuple[int, int], shift: tuple[int, int],
    device: torch.device | None = None, dtype: torch.dtype | None = None,
) -> Tensor:
    """Swin's shifted-window mask: ``-100`` between tokens of a window from two regions.

    After the cyclic shift, a window at the map's bottom or right edge holds tokens from up
    to three regions along each axis (``[0, n - ws)``, ``[n - ws, n - s)``, ``[n - s, n)``);
    tokens of different regions must not attend each other.

    Shape:
        - returns: (windows, n, n) with ``windows = (rows / wh) · (cols / ww)``, row-major
    """
    labels = []
    for size, ws, s in zip(padded, window, shift):
        pos = torch.arange(size, device=device)
        labels.append((pos >= size - ws).long() + (pos >= size - s).long() if s else pos * 0)
    region = labels[0][:, None] * 3 + labels[1][None, :]  # (rows, cols)
    region = rearrange(region, "(r wh) (c ww) -> (r c) (wh ww)", wh=window[0], ww=window[1])
    differ = region[:, :, None] != region[:, None, :]
    return torch.where(differ, SHIFT_MASK_VALUE, 0.0).to(dtype)


def shifted_window_attention(
    x: Tensor,
    qkv_weight: Tensor,
    qkv_bias: Tensor | None,
    proj_weight: Tensor,
    proj_bias: Tensor | None,
    table: Tensor,
    index: Tensor,
    window: list[int],
    shift: list[int],
    num_heads: int,
    logit_scale: Tensor | None = None,
    attention_dropout: float = 0.0,
    dropout: float = 0.0,
    training: bool = True,
) -> Tensor:
    """Swin's (shifted) window attention over a (b, rows, cols, d) map, on mmattn's kernel.

    The map is padded to whole windows, cyclically shifted by ``shift`` (no shift along an
    axis one window covers, torchvision's rule) and cut into windows; each window attends
    itself with the bias ``table[index]`` (+ the shift mask) through
    :func:`mmattn.kernels.biased.biased_attend`. With ``logit_scale`` (Swin V2) the scores
    are cosine similarities times ``exp(min(logit_scale, log 100))`` and the key part of
    ``qkv_bias`` is left out. Wrapped for ``torch.fx`` (a leaf of symbolic tracing, as
    torchvision's own function), so torchvision's feature extraction traces a swapped model.

    Shape:
        - x: (b, rows, cols, d); qkv_weight: (3 d_a, d); proj_weight: (d, d_a);
          table: (t, h); index: (n, n) or (n * n,) with ``n = wh ww``;
          logit_scale: (h, 1, 1)
        - returns: (b, rows, cols, d)
    """
    rows, cols = x.shape[1], x.shape[2]
    wh, ww = int(window[0]), int(window[1])
    x = F.pad(x, (0, 0, 0, (-cols) % ww, 0, (-rows) % wh))
    padded = (x.shape[1], x.shape[2])
    shift = [0 if w >= p else int(s) for w, p, s in zip((wh, ww), padded, shift)]
    if any(shift):
        x = torch.roll(x, shifts=(-shift[0], -shift[1]), dims=(1, 2))
    windows = rearrange(x, "b (r wh) (c ww) d -> b (r c) (wh ww) d", wh=wh, ww=ww)
    if logit_scale is not None and qkv_bias is not None:  # torchvision leaves the key bias out
        q_bias, _, v_bias = qkv_bias.chunk(3)
        qkv_bias = torch.cat((q_bias, torch.zeros_like(q_bias), v_bias))
    q, k, v = rearrange(
        F.linear(windows, qkv_weight, qkv_bias), "b w n (three h e) -> three b w h n e",
        three=3, h=num_heads,
    ).unbind(0)
    scale = None
    if logit_scale is not None:  # cosine attention, a learned temperature per head
        tau = torch.clamp(logit_scale, max=math.log(100.0)).exp()
        q, k, scale = F.normalize(q, dim=-1) * tau.to(q.dtype), F.normalize(k, dim=-1), 1.0
    bias = gather_bias(table, index)
    if any(shift):  # (w, 1, n, n) + (h, n, n) -> (w, h, n, n)
        bias = bias + shift_mask(padded, (wh, ww), tuple(shift), x.device, bias.dtype)[:, None]
    dropout_p = attention_dropout if training else 0.0
    out, _ = biased_attend(q, k, v, bias.to(q.dtype), dropout_p=dropout_p, scale=scale)
    out = F.linear(rearrange(out, "b w h n e -> b w n (h e)"), proj_weight, proj_bias)
    out = F.dropout(out, p=dropout, training=training)
    out = rearrange(
        out, "b (r c) (wh ww) d -> b (r wh) (c ww) d", r=padded[0] // wh, wh=wh, ww=ww
    )
    if any(shift):
        out = torch.roll(out, shifts=(shift[0], shift[1]), dims=(1, 2))
    return out[:, :rows, :cols].contiguous()


torch.fx.wrap("shifted_window_attention")


class ShiftedWindowAttention(_swin.ShiftedWindowAttention):
    r"""torchvision's ``ShiftedWindowAttention`` (Swin V1) on mmattn's kernel.

    .. math::
        \mathrm{out} = \mathrm{proj}\big(\mathrm{softmax}(q k^\top / \sqrt{e} + B + M)\,v\big)

    per window, with ``B`` Swin's relative-position bias and ``M`` the shift mask. Built
    like torchvision's class (same constructor, parameters and buffers), or from a built one
    with :meth:`from_torchvision`; only ``forward`` differs: it runs
    :func:`shifted_window_attention` (mmattn's kernel; on the CPU its explicit twin, the
    faster path for 49-token windows there).

    Shape:
        - x: (b, rows, cols, d), channels last
        - returns: (b, rows, cols, d)

    Raises:
        TypeError: ``x`` is not a floating tensor.
        ValueError: ``x`` is not 4-D or its last dimension is not the module's width.

    Examples:
        >>> attn = ShiftedWindowAttention(16, window_size=[3, 3], shift_size=[1, 1],
        ...                               num_heads=2)
        >>> attn(torch.randn(2, 5, 7, 16)).shape
        torch.Size([2, 5, 7, 16])
    """

    _stock = _swin.ShiftedWindowAttention

    @classmethod
    def from_torchvision(cls, module: nn.Module) -> ShiftedWindowAttention:
        """Our class holding a built torchvision module's parameters, buffers and settings.

        Args:
            module: a ``torchvision.models.swin_transformer.ShiftedWindowAttention`` (for
                :class:`ShiftedWindowAttentionV2`, a ``ShiftedWindowAttentionV2``).

        Returns:
            The new module (the same tensors: state dict, ``requires_grad`` and an
            optimizer built before are kept); ``module`` is left as it was.

        Raises:
            TypeError: ``module`` is not of the matching torchvision class.
        """
        if not isinstance(module, cls._stock):
            raise TypeError(
                f"module must be a torchvision {cls._stock.__name__}, got "
                f"{type(module).__name__}"
            )
        return adopt(cls, module)

    def _table(self) -> Tensor:
        return self.relative_position_bias_table

    def forward(self, x: Tensor) -> Tensor:
        """Windowed attention over the (b, rows, cols, d) map ``x``; see the class docstring."""
        if not isinstance(x, torch.fx.Proxy):  # checks need values; FX traces a leaf
            checks.check_tensor("x", x)
            checks.check_floating("x", x)
            checks.check_rank("x", x, (4,), "(batch, rows, cols, channels)")
            checks.check_last_dim("x", x, self.qkv.in_features, "dim")
        return shifted_window_attention(
            x, self.qkv.weight, self.qkv.bias, self.proj.weight, self.proj.bias,
            self._table(), self.relative_position_index, self.window_size, self.shift_size,
            self.num_heads, logit_scale=getattr(self, "logit_scale", None),
            attention_dropout=self.attention_dropout, dropout=self.dropout,
            training=self.training,
        )


class ShiftedWindowAttentionV2(ShiftedWindowAttention, _swin.ShiftedWindowAttentionV2):
    r"""torchvision's ``ShiftedWindowAttentionV2`` (Swin V2) on mmattn's kernel.

    .. math::
        \mathrm{out} = \mathrm{proj}\big(\mathrm{softmax}(\tau_h \cos(q, k) + 16\,
        \sigma(B) + M)\,v\big), \quad \tau_h = \exp(\min(\mathrm{logit\_scale}_h, \log 100))

    per window, with ``B`` the ``cpb_mlp`` of Swin V2's log-spaced offsets gathered by Swin's
    index, ``M`` the shift mask, and the key part of the ``qkv`` bias left out (as in
    torchvision). Built like torchvision's class or with :meth:`from_torchvision`.

    Shape:
        - x: (b, rows, cols, d), channels last
        - returns: (b, rows, cols, d)

    Examples:
        >>> attn = ShiftedWindowAttentionV2(16, window_size=[3, 3], shift_size=[1, 1],
        ...                                 num_heads=2)
        >>> attn(torch.randn(2, 6, 6, 16)).shape
        torch.Size([2, 6, 6, 16])
    """

    _stock = _swin.ShiftedWindowAttentionV2

    def _table(self) -> Tensor:  # the sigmoid on the table: the same as on the gathered bias
        table = self.cpb_mlp(self.relative_coords_table).view(-1, self.num_heads)
        return 16 * torch.sigmoid(table)


#: The rules of :func:`replace_torchvision_attention`: stock class -> builder.
RULES = {
    _swin.ShiftedWindowAttention: ShiftedWindowAttention.from_torchvision,
    _swin.ShiftedWindowAttentionV2: ShiftedWindowAttentionV2.from_torchvision,
}


def replace_torchvision_attention(model: nn.Module) -> int:
    """Swap every torchvision Swin attention inside ``model`` for ours, in place.

    ``ShiftedWindowAttention`` becomes :class:`ShiftedWindowAttention` and
    ``ShiftedWindowAttentionV2`` :class:`ShiftedWindowAttentionV2`, each holding the stock
    module's parameters, buffers and settings (so the state-dict keys, ``requires_grad`` and
    the train/eval mode are kept). A module shared by several parents stays shared; a
    subclass that overrides ``forward`` is skipped with a warning.
    :func:`mmattn.replace_attention` calls this when torchvision's Swin is loaded.

    Args:
        model: any ``nn.Module``; it is modified in place.

    Returns:
        How many modules were replaced (0 when there are none).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``model`` is itself a Swin attention (no parent to put the new one in:
            use ``from_torchvision``).

    Examples:
        >>> from torchvision.models.swin_transformer import SwinTransformer
        >>> model = SwinTransformer([4, 4], 16, depths=[2, 2], num_heads=[2, 4],
        ...                         window_size=[3, 3], num_classes=5)
        >>> replace_torchvision_attention(model)
        4
        >>> model(torch.randn(1, 3, 32, 32)).shape
        torch.Size([1, 5])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, tuple(RULES)) and not isinstance(model, ShiftedWindowAttention):
        raise ValueError(
            f"model is itself a torchvision {type(model).__name__} and cannot be replaced in "
            "place; use mmattn.integrations.torchvision."
            f"{type(model).__name__}.from_torchvision(model)"
        )
    return swap_modules(model, RULES, ours=(ShiftedWindowAttention,))
