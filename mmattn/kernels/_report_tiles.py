"""The weights of a kernel report's call, tile by tile: each report is handed to the kernel
module that made it (their ``weight_tiles``; :mod:`mmattn.kernels._tiles` for the tiles,
their rows and their weights).
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor

from mmattn.kernels import block_sparse, blocked, neighborhood, packed
from mmattn.kernels._segment_modifiers import edge_weights
from mmattn.kernels._tiles import (
    TILE_ELEMENTS,
    Tile,
    Unsupported,
    Weights,
    chunks,
    dense_tiles,
    modifiers_of,
    weights,
)


def _dense_report(record: dict, block: int) -> Iterator[Tile]:
    return dense_tiles(
        record["q"], record["k"], record.get("mask"), is_causal=bool(record.get("is_causal")),
        scale=record.get("scale"), block=block, score_weight=record.get("score_weight"),
        mods=modifiers_of(record))


def weight_tiles(record: dict, block: int = 64, elements: int = TILE_ELEMENTS
                 ) -> Iterator[Weights]:
    """The weights of the call a kernel report describes, tile by tile, each part at most
    ``elements`` scores (edges: all at once), from the kernel that made the report.

    Args:
        record: a kernel report (the facts a path listener receives).
        block: query rows per tile of a dense call (a local band uses its own blocks).
        elements: scores per part.

    Raises:
        Unsupported: the report's kernel path has no weight tiles.
    """
    path = record["path"]
    if path == "local":
        tiles = blocked.weight_tiles(record)
    elif path == "neighborhood":
        tiles = neighborhood.weight_tiles(record)
    elif path == "block-sparse" and "plan" in record:
        tiles = block_sparse.weight_tiles(record)
    elif path in ("edge", "edge-explicit") and "src" in record:
        yield edge_weights(record)
        return
    elif path == "packed" and record.get("kernel") == "jagged-sdpa":
        tiles = packed.weight_tiles(record, block)
    elif path in ("fused", "explicit", "chunked") or (
        path == "packed" and record.get("kernel") == "buckets"
    ):
        tiles = _dense_report(record, block)
    else:
        raise Unsupported(f"the {path!r} kernel path has no weight tiles")
    for tile in tiles:
        for part in chunks(tile, elements):
            yield Weights(part.q_ids, part.k_ids, weights(part))


def call_tensors(record: dict) -> tuple[Tensor | None, Tensor | None]:
    """The query and key tensors whose rows the tiles of a report name: (b, h, L, e) for a
    batched call (row ``b·L + i``), flat or jagged otherwise (a local call's are its inputs
    before blocking)."""
    if "inputs" in record:
        return record["inputs"][0], record["inputs"][1]
    return record.get("q"), record.get("k")
