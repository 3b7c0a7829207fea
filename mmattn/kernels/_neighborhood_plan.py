"""Tile plans of N-D neighbourhood attention (see :mod:`mmattn.kernels.neighborhood`).

Axis key: ``n`` tiles, ``s`` query slots of a tile (the product of its sides ``t_a``), ``t``
key slots of a tile (its slab of ``prod(t_a + k_a - 1)`` grid keys, then the item's global
keys), ``b`` items, ``g`` global tokens of an item.

A plan says, for a batch of items laid out as flat rows, which rows every tile gathers as
queries and keys and which (query, key) pairs of a tile are allowed. It depends only on the
geometry (grids, kernel, dilation, causal axes, tile shape), never on the values, so it is
built once on the CPU with integer tensors and cached per device. A padded batch whose
items share one grid uses the plan of ONE item for every item (:func:`shared_plan`, the
gathers run along the token axis); per-item grids and packed rows use a plan of all their
items. Plans and the additive tile masks made from them live in one LRU cache bounded in
bytes (:data:`CACHE`), never in a count of entries.

Grids have 1, 2 or 3 axes (a sequence, an image, a video's (t, h, w)); the tiles of a grid
are the product of each axis's tiles (:mod:`._neighborhood_tiles`). With dilation d an axis
splits into d subgrids ``{p : p = a mod d}``, each an ordinary (dilation 1) neighbourhood
problem; tiles never mix subgrids. Along an axis of a subgrid of size m a tile of ``t``
consecutive queries needs at most ``t + k - 1`` consecutive keys (centred windows are
clamped inward and causal ones end at their query, so the slab never leaves the grid); the
last tile of an axis is shifted inward to end on the border (it overlaps its neighbour; each
query's result is taken from its first tile). Slots beyond a small grid are empty: empty
query slots read a zero row and may attend every slot (so no row is dead), empty key slots
read the zero row and are never allowed.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import OrderedDict
from typing import Any, NamedTuple

import torch
from torch import Tensor

from mmattn._helpers import exporting
from mmattn.kernels._neighborhood_tiles import choose_tiles, grid_tiles


class Item(NamedTuple):
    """One item's geometry in the flat rows: rows ``[offset, offset + length)``.

    ``shape`` is its grid's sides (1 to 3 axes, row-major); ``start`` is the index of its
    first grid token; with ``tail_global`` the tokens after the grid are global, otherwise
    they are dead (padding: never attended, result zero). The tokens before ``start`` are
    global.
    """

    offset: int
    length: int
    shape: tuple[int, ...]
    start: int
    tail_global: bool

    @property
    def cells(self) -> int:
        """The grid's tokens: the product of its sides."""
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        """A 2-D grid's rows (the second to last axis; 1 for a 1-D grid)."""
        return self.shape[-2] if len(self.shape) > 1 else 1

    @property
    def cols(self) -> int:
        """A 2-D grid's columns (the last axis)."""
        return self.shape[-1]


class PlanKey(NamedTuple):
    """What a plan is built from (it keys the cache of plans and of their tile masks):
    the items in ``total`` flat rows, per-axis kernel, dilation and causal flags, the tile
    shape and the device (a string)."""

    total: int
    items: tuple[Item, ...]
    kernel: tuple[int, ...]
    dilation: tuple[int, ...]
    causal: tuple[bool, ...]
    tiles: tuple[int, ...]
    device: str


class Plan(NamedTuple):
    """Index tensors of one geometry (``z`` = the zero row = number of flat rows).

    - ``q_index`` (n·s,), ``k_index`` (n·t,): rows the tiles gather; ``allowed`` (n, s, t)
      bool: the exact window (and global) pattern of each tile;
    - ``gq_index`` (b', g'), ``gk_index`` (b', j') and ``gk_valid`` (b', j'): the global
      query rows of the b' items that have any, and every key row of those items;
    - ``pick`` (rows,): where each row's result lies in ``cat(tile results, global
      results, zero)``;
    - ``k_col`` (n, t) and ``gk_col`` (b', j'): each key slot's position inside its item
      (``width`` for empty slots), for the dense weights;
    - ``width``: the longest item; ``tile_shape`` (n, s, t) and ``global_shape`` (b', g')
      as ints (shapes of a traced constant are not read back under ``torch.compile``);
      ``key``: the :class:`PlanKey` it was built from (it keys the cached tile masks of
      :func:`tile_mask`).
    """

    q_index: Tensor
    k_index: Tensor
    allowed: Tensor
    gq_index: Tensor
    gk_index: Tensor
    gk_valid: Tensor
    pick: Tensor
    k_col: Tensor
    gk_col: Tensor
    width: int
    tile_shape: tuple[int, int, int]
    global_shape: tuple[int, int]
    key: PlanKey


class ByteCache:
    """A least-recently-used cache bounded by the bytes of what it holds (thread-safe).

    A value larger than the whole budget is returned to the caller but not kept.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.nbytes = 0
        self._entries: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Any) -> Any:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: Any, value: Any, nbytes: int) -> Any:
        with self._lock:
            if nbytes > self.limit or key in self._entries:
                return value
            self._entries[key] = (value, nbytes)
            self.nbytes += nbytes
            while self.nbytes > self.limit:
                _, (_, size) = self._entries.popitem(last=False)
                self.nbytes -= size
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0


#: Plans and tile masks of every device together: at most this many bytes (64 MiB).
CACHE = ByteCache(64 * 2**20)


def tile_mask(plan: Plan, dtype: torch.dtype, copies: int) -> Tensor:
    """``plan.allowed`` as an additive ((copies n), 1, s, t) mask of ``dtype`` (0 / -inf),
    repeated for ``copies`` items that share the plan; cached (SDPA runs faster on an
    additive mask than on a bool one it converts on every call)."""
    key = ("mask", plan.key, dtype, copies)
    mask = CACHE.get(key)
    if mask is None:
        mask = torch.zeros(plan.allowed.shape, dtype=dtype, device=plan.allowed.device)
        mask = mask.masked_fill_(~plan.allowed, float("-inf"))[:, None]
        if copies > 1:
            mask = mask.repeat(copies, 1, 1, 1)
        mask = CACHE.put(key, mask, mask.nbytes)
    return mask


def merge_key_mask(allowed: Tensor, key_rows: Tensor | None) -> Tensor:
    """Merge a bool pattern with gathered bool ("real key") or additive key values: bool
    stays bool (``&``), additive keeps the key's value where allowed and -inf elsewhere."""
    if key_rows is None:
        return allowed
    if key_rows.dtype == torch.bool:
        return allowed & key_rows
    return torch.where(allowed, key_rows, float("-inf"))


def _globals(item: Item) -> Tensor:
    """Positions (inside the item) of its global tokens."""
    before = torch.arange(item.start)
    if not item.tail_global:
        return before
    return torch.cat([before, torch.arange(item.start + item.cells, item.length)])


def _live_length(item: Item) -> int:
    """Tokens of the item that are not dead: every one with ``tail_global``."""
    return item.length if item.tail_global else item.start + item.cells


def cached_plan(
    total: int,
    items: tuple[Item, ...],
    kernel: tuple[int, ...],
    dilation: tuple[int, ...],
    tiles: tuple[int, ...],
    device: torch.device | str,
    causal: tuple[bool, ...] | None = None,
) -> Plan:
    """The plan of ``items`` in ``total`` flat rows (see :class:`Plan`), from :data:`CACHE`;
    ``causal`` None: no causal axis.

    Unchecked: :func:`mmattn.kernels.neighborhood.build_plan` checks the items first.
    """
    causal = causal or (False,) * len(kernel)
    key = PlanKey(total, items, kernel, dilation, causal, tiles, str(device))
    plan = CACHE.get(("plan", key))
    if plan is None:
        plan = _build_plan(key)
        size = sum(t.nbytes for t in plan if isinstance(t, Tensor))
        plan = CACHE.put(("plan", key), plan, size)
    return plan


@contextlib.contextmanager
def _outside_trace():
    """Run eager torch on real tensors while a tracer is active (results become constants)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        yield


def shared_plan(
    item: Item, kernel: tuple[int, ...], dilation: tuple[int, ...],
    tiles: tuple[int, ...] | None, device: torch.device | str,
    causal: tuple[bool, ...] | None = None,
) -> Plan:
    """The plan of one item (offset 0) that every item of a padded batch shares; ``tiles``
    None: :func:`choose_tiles`.

    Built outside any trace from the static sizes of the item: ``torch.export`` and
    ``torch.compile`` take its tensors as constants, so nothing is guarded on data and no
    plan (nor tile choice) is rebuilt inside a graph.
    """
    return _constant_plan(item.length, tuple(item.shape), item.start, item.tail_global,
                          tuple(kernel), tuple(dilation), causal or (False,) * len(kernel),
                          tuple(tiles or ()), str(device))


@torch.compiler.assume_constant_result  # under torch.compile: a constant of the graph
def _constant_plan(
    length: int, shape: tuple[int, ...], start: int, tail_global: bool,
    kernel: tuple[int, ...], dilation: tuple[int, ...], causal: tuple[bool, ...],
    tiles: tuple[int, ...], device: str,
) -> Plan:
    """:func:`shared_plan` on plain ints and tuples of them (what ``assume_constant_result``
    takes); ``tiles`` empty: :func:`choose_tiles`."""
    item = Item(0, length, shape, start, tail_global)
    tiles = tiles or choose_tiles((item,), kernel, dilation)
    build = (length, (item,), kernel, dilation, tiles, device, causal)
    if not exporting():
        return cached_plan(*build)
    with _outside_trace():
        return cached_plan(*build)


def _build_plan(key: PlanKey) -> Plan:
    total, items, tiles, device = key.total, key.items, key.tiles, key.device
    zero = total
    width = max((item.length for item in items), default=0)
    globs = [_globals(item) for item in items]
    g_max = max((len(g) for g in globs), default=0)
    q_idx, k_idx, k_cols, oks = [], [], [], []
    gq, gk, gk_cols = [], [], []
    pick = torch.full((zero,), -1, dtype=torch.long)
    n_tiles = 0
    slots = math.prod(tiles)
    tile_picks = []
    glob_items = 0
    grids: dict[tuple[int, ...], tuple[Tensor, Tensor, Tensor]] = {}
    for item, glob in zip(items, globs):
        if item.shape not in grids:
            grids[item.shape] = grid_tiles(item.shape, key.kernel, key.dilation, key.causal,
                                           tiles)
        q_cells, k_cells, ok = grids[item.shape]
        n = q_cells.shape[0]
        q_rel = torch.where(q_cells >= 0, item.start + q_cells, -1)
        k_rel = torch.where(k_cells >= 0, item.start + k_cells, -1)
        pad = g_max - len(glob)
        k_rel = torch.cat(
            [k_rel, glob.expand(n, -1), torch.full((n, pad), -1, dtype=torch.long)], dim=1
        )
        g_ok = torch.ones(n, slots, len(glob), dtype=torch.bool)
        ok = torch.cat([ok, g_ok, torch.zeros(n, slots, pad, dtype=torch.bool)], dim=2)
        q_idx.append(torch.where(q_rel >= 0, item.offset + q_rel, zero).flatten())
        k_idx.append(torch.where(k_rel >= 0, item.offset + k_rel, zero).flatten())
        k_cols.append(torch.where(k_rel >= 0, k_rel, width))
        oks.append(ok)
        # Each grid row's result comes from its first tile slot.
        flat = q_rel.flatten()
        real = flat >= 0
        slot = torch.arange(flat.numel()) + n_tiles * slots
        first = torch.full((item.length,), slot.numel() + n_tiles * slots, dtype=torch.long)
        first = first.scatter_reduce(0, flat[real], slot[real], reduce="amin")
        cells = item.start + torch.arange(item.cells)
        tile_picks.append((item.offset + cells, first[cells]))
        n_tiles += n
        if len(glob):
            live = _live_length(item)
            gq.append(torch.cat([item.offset + glob, torch.full((g_max - len(glob),), zero)]))
            gk.append(item.offset + torch.arange(live))
            gk_cols.append(torch.arange(live))
            glob_items += 1
    for rows_, slot in tile_picks:
        pick[rows_] = slot
    tile_total = n_tiles * slots
    # Global rows read the global results, dead rows the zero after everything.
    j_max = max((len(g) for g in gk), default=0)
    slot = 0
    for item, glob in zip(items, globs):
        if len(glob):
            pick[item.offset + glob] = tile_total + slot * g_max + torch.arange(len(glob))
            slot += 1
    dead = pick < 0
    pick[dead] = tile_total + glob_items * g_max
    gk_index = torch.full((glob_items, j_max), zero, dtype=torch.long)
    gk_col = torch.full((glob_items, j_max), width, dtype=torch.long)
    for m, (rows_, cols) in enumerate(zip(gk, gk_cols)):
        gk_index[m, : len(rows_)] = rows_
        gk_col[m, : len(cols)] = cols
    target = torch.device(device)

    def to(t: Tensor) -> Tensor:
        return t.to(device=target)

    def cat(parts: list[Tensor], shape: tuple[int, ...]) -> Tensor:
        return torch.cat(parts) if parts else torch.zeros(shape, dtype=torch.long)

    allowed = torch.cat(oks) if oks else torch.zeros(0, slots, 0, dtype=torch.bool)
    gq_index = torch.stack(gq) if gq else torch.zeros(0, 0, dtype=torch.long)
    return Plan(
        q_index=to(cat(q_idx, (0,))),
        k_index=to(cat(k_idx, (0,))),
        allowed=to(allowed),
        gq_index=to(gq_index),
        gk_index=to(gk_index),
        gk_valid=to(gk_col < width),
        pick=to(pick),
        k_col=to(cat(k_cols, (0, 0))),
        gk_col=to(gk_col),
        width=width,
        tile_shape=tuple(allowed.shape),
        global_shape=tuple(gq_index.shape),
        key=key,
    )
