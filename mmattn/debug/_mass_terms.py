"""The score modifiers of a neighbourhood call, read from its kernel report, for the tiles
of :func:`mmattn.debug._mass_views.plan_tiles`.

Axis key: ``n`` tiles, ``s`` query slots, ``t`` key slots, ``h`` heads.

A neighbourhood report carries its modifiers (sinks, softcap, ALiBi slopes), the NAT table
(``position_bias``), the kernel and dilation, and the items of its plan (the padded form's
are rebuilt from its grid facts): the tiles' additive term is then the kernel's own
:func:`~mmattn.kernels._neighborhood_terms.pair_terms` between the grid cells of each
chunk's query and key rows, evaluated chunk by chunk (never for the whole plan at once).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmattn.debug._mass_views import Unsupported
from mmattn.kernels._neighborhood_terms import grid_coords, pair_terms


def neighborhood_terms(record: dict, items, total: int, q: Tensor) -> dict:
    """``plan_tiles`` keywords (``term``, ``softcap``, ``sinks``) of a neighbourhood report
    over ``total`` flat rows.

    Raises:
        Unsupported: the report has a grid term but not the items of its plan.
    """
    mods, table = record.get("modifiers"), record.get("position_bias")
    if not mods and table is None:
        return {}
    found = {"softcap": mods.softcap if mods else None, "sinks": mods.sinks if mods else None}
    slopes = mods.slopes if mods else None
    if slopes is None and table is None:
        return found
    if items is None:
        raise Unsupported("a neighbourhood report with ALiBi or a table but not its items")
    coords = grid_coords(total, tuple(items), q.device)
    kernel, dilation = tuple(record["kernel_size"]), tuple(record["dilation"])
    dtype = torch.promote_types(q.dtype, torch.float32)

    def term(q_rows: Tensor, k_rows: Tensor) -> Tensor:
        return pair_terms(coords, q_rows, k_rows, slopes=slopes, table=table, kernel=kernel,
                          dilation=dilation, dtype=dtype)

    return {**found, "term": term}
