"""Initialisation in ``nn.MultiheadAttention``'s draw order, so a seed gives torch's weights.

Axis key: ``d`` model width, ``k``/``v`` key/value widths.

``nn.MultiheadAttention(...)`` draws, in this order: its ``out_proj`` (an ``nn.Linear``,
whose own constructor draws Kaiming-uniform weights and a uniform bias), then
``_reset_parameters``: one Xavier-uniform (3d, d) ``in_proj_weight`` when the widths are
equal, else ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight`` one after the other;
zero biases; Xavier-normal ``bias_k`` and ``bias_v``. We build our ``nn.Linear`` modules
without drawing (:func:`undrawn_linear`) and then draw the same tensors, in the same order,
of the same shapes: the same values, and the same generator state afterwards.
"""

from __future__ import annotations

import torch
from torch import nn


def undrawn_linear(
    in_features: int,
    out_features: int,
    bias: bool,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> nn.Linear:
    """An ``nn.Linear`` whose parameters are allocated but not drawn (no random numbers).

    Built on the meta device, then moved to ``device`` (default: the current default device,
    which a ``with torch.device(...)`` block sets); the values are whatever memory held.
    """
    layer = nn.Linear(in_features, out_features, bias=bias, device="meta", dtype=dtype)
    return layer.to_empty(device=default_device() if device is None else device)


def default_device() -> torch.device:
    """Where a factory call without ``device=`` allocates now: ``torch.set_default_device``
    or an enclosing ``with torch.device(...)`` block (an empty tensor tells, on every torch;
    torch 2.5's ``torch.get_default_device`` does not see the ``with`` block)."""
    return torch.empty(0).device


def draw_like_torch(module: nn.Module, out_proj: bool = True) -> None:
    """Draw ``module``'s projections as ``nn.MultiheadAttention`` does.

    ``out_proj=True``: as its constructor (``out_proj``'s Kaiming draw first);
    ``out_proj=False``: as its ``_reset_parameters`` (``out_proj.weight`` is kept).

    With ``num_kv_heads < num_heads`` (no torch twin) and equal widths the packed buffer is
    (d + 2 * kv_dim, d), Xavier-uniform over that shape: the packed projection torch would
    hold if it had grouped heads.
    """
    projections = (module.q_proj, module.k_proj, module.v_proj)
    if out_proj:
        module.out_proj.reset_parameters()
    with torch.no_grad():
        if module.kdim == module.vdim == module.embed_dim:
            weights = [p.weight for p in projections]
            packed = torch.empty(
                sum(w.shape[0] for w in weights), module.embed_dim,
                device=weights[0].device, dtype=weights[0].dtype,
            )
            nn.init.xavier_uniform_(packed)
            for weight, part in zip(weights, packed.split([w.shape[0] for w in weights])):
                weight.copy_(part)
        else:
            for proj in projections:
                nn.init.xavier_uniform_(proj.weight)
        if module.q_proj.bias is not None:  # torch: constant 0 on in_proj_bias, out_proj.bias
            for proj in (*projections, module.out_proj):
                proj.bias.zero_()
    if module.bias_k is not None:
        nn.init.xavier_normal_(module.bias_k)
        nn.init.xavier_normal_(module.bias_v)
    if getattr(module, "sinks", None) is not None:  # no draw: torch's generator state stays
        nn.init.zeros_(module.sinks)
