"""The traceable form of :func:`mmattn.kernels.neighborhood.neighborhood_attend`.

While ``torch.export`` traces (batch symbolic), the tile plan of ONE item is built in plain
Python and eager torch from the static sizes (grid, kernel, dilation, length) outside the
trace, so it enters the program as constant index tensors: no guard on data. Every item of
the batch shares that plan; gathers run along the token axis, tiles of all items are one
batched attention call (:func:`mmattn.kernels.dense.attend`, whose dead-row rule exports).

Axis key: ``b`` batch, ``h`` query heads, ``k`` key/value heads, ``l`` tokens, ``e`` head
width, ``n`` tiles of an item, ``s`` query slots, ``t`` key slots, ``g`` / ``j`` global
queries / keys of an item.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from mmattn.kernels import dense as _kernel
from mmattn.kernels._neighborhood_plan import Item, Plan, build_plan, merge_key_mask
from mmattn.kernels._neighborhood_terms import grid_coords, softmax_modifiers
from mmattn.kernels.modifiers import Modifiers, with_bias


@contextlib.contextmanager
def _outside_trace():
    """Run eager torch on real tensors while a tracer is active (results become constants)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        yield


def static_plan(
    item: Item, kernel: tuple[int, int], dilation: tuple[int, int], tiles: tuple[int, int],
    device: torch.device,
) -> Plan:
    """The plan of one item (offset 0) built outside any trace."""
    with _outside_trace():
        return build_plan(item.length, (item,), kernel, dilation, tiles, device)


def static_coords(item: Item, device: torch.device) -> Tensor:
    """The grid cells of one item's rows (:func:`~._neighborhood_terms.grid_coords`), built
    outside any trace."""
    with _outside_trace():
        return grid_coords(item.length, (item,), device)


def export_attend(
    q: Tensor, k: Tensor, v: Tensor, item: Item, kernel: tuple[int, int],
    dilation: tuple[int, int], tiles: tuple[int, int], key_mask: Tensor | None, *,
    dropout_p: float = 0.0, scale: float | None = None, modifiers: Modifiers | None = None,
    term: Tensor | None = None,
) -> tuple[Tensor, None]:
    """Neighbourhood attention of a padded batch whose items share ``item``'s geometry.

    ``modifiers`` (sinks, softcap) join every attention call, ``term`` (n, h, s, t), the
    tiles' ALiBi / table term (:mod:`._neighborhood_terms`), every tile's mask.

    Shape:
        - q: (b, h, l, e); k, v: (b, k, l, e); key_mask: (b, l) bool (True = real) or float
        - returns: (b, h, l, e) and None
    """
    mods = softmax_modifiers(modifiers)
    plan = static_plan(item, kernel, dilation, tiles, q.device)
    n, slots, keys = plan.allowed.shape
    qz, kz, vz = (F.pad(t, (0, 0, 0, 1)) for t in (q, k, v))  # the zero row at index l
    km = None
    if key_mask is not None:
        fill = False if key_mask.dtype == torch.bool else float("-inf")
        km = torch.cat([key_mask, key_mask.new_full((key_mask.shape[0], 1), fill)], dim=1)
    qt = rearrange(qz.index_select(2, plan.q_index), "b h (n s) e -> (b n) h s e", n=n)
    kt = rearrange(kz.index_select(2, plan.k_index), "b k (n t) e -> (b n) k t e", n=n)
    vt = rearrange(vz.index_select(2, plan.k_index), "b k (n t) e -> (b n) k t e", n=n)
    batch = q.shape[0]
    km_t = None
    if km is not None:
        km_t = rearrange(km.index_select(1, plan.k_index), "b (n t) -> b n 1 t", n=n)
    mask = merge_key_mask(plan.allowed[None], km_t)  # (b or 1, n, s, t)
    mask = rearrange(mask.expand(batch, n, slots, keys), "b n s t -> (b n) 1 s t")
    if term is not None:  # the same term for every item
        term = rearrange(term.expand(batch, *term.shape), "b n h s t -> (b n) h s t")
    out_t, _ = _kernel.attend(qt, kt, vt, with_bias(mask, term), dropout_p=dropout_p,
                              scale=scale, report_path=False, modifiers=mods)
    parts = [rearrange(out_t, "(b n) h s e -> b h (n s) e", b=batch)]
    if plan.gq_index.numel():  # the item's global queries attend every live key
        gq = qz.index_select(2, plan.gq_index[0])
        gk = kz.index_select(2, plan.gk_index[0])
        gv = vz.index_select(2, plan.gk_index[0])
        gm = plan.gk_valid[:, None, None, :]  # (1, 1, 1, j)
        if km is not None:
            gm = merge_key_mask(gm, km.index_select(1, plan.gk_index[0])[:, None, None, :])
        out_g, _ = _kernel.attend(gq, gk, gv, gm, dropout_p=dropout_p, scale=scale,
                                  report_path=False, modifiers=mods)
        parts.append(out_g)
    parts.append(out_t.new_zeros(batch, q.shape[1], 1, v.shape[-1]))
    return torch.cat(parts, dim=2).index_select(2, plan.pick), None
