"""The plan of context parallelism: which rank holds which rows, and which keys travel.

Axis key: ``b`` batch, ``l`` sequence length, ``n`` tiles per item, ``s`` tile width, ``t``
query tiles (flat ``b · n + i``), ``p`` ranks, ``r`` this rank's rows, ``u`` its frame rows.

A :class:`ContextPlan` is made once per :class:`~mmattn.patterns.SparseMask` and number of
ranks (:func:`context_plan`, cached on the mask) and shared by every layer::

    mask tiles ─work per query tile─▶ _dispatch.balance ─▶ owner (t,): the rank of each tile
    rank r:  rows   = its query tiles, whole, in sequence order               (r = tiles · s)
             needs  = the key rows its tiles' masks attend that it does not hold
             frame  = its tiles and those of the rows it receives, in order  (u = frame tiles · s)
             mask   = its query tiles against their key tiles, renumbered in the frame

Every rank builds the plan of every rank from the same mask (small integers), so each knows
what to send to whom without asking: the exchange is one ``all_to_all_single`` of exactly
the needed key/value rows, no more (:mod:`mmattn.distributed.context_parallel`).

Rows past the end of an item (the last tile's ``n · s - l`` rows) exist in the local
layout so that every tile is whole; they attend nothing, nothing attends them, and
:meth:`ContextPlan.restore` drops them (``plan.real`` is False there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mmattn.distributed import _dispatch
from mmattn.patterns import SparseMask
from mmattn.tokens import Tokens

__all__ = ["ContextPlan", "build_plan"]


@dataclass(eq=False)
class ContextPlan:
    """Where each row of a sequence lives under context parallelism, and what moves.

    Made by :func:`mmattn.distributed.context_plan` (or ``ContextParallel.plan``); the same
    object serves every layer and every call on this mask.

    Attributes:
        mask: the full-sequence SparseMask the plan was made from.
        ranks, rank: the group's size and this rank.
        owner: (B n,) int64, the rank of every query tile (flat ``b · n + i``).
        work: (P,) int64, the non-empty tiles of each rank's query tiles.
        exchange: (P, P) int64, the key/value rows rank p sends rank q per layer.
        rows: (R,) int64, this rank's rows as flat ``b · n s + i``, tile by tile in sequence
            order: the local layout of :meth:`scatter`.
        frame: this rank's query tiles against their key tiles, renumbered in its frame
            (its tiles and the tiles of the rows it receives, in sequence order): a
            SparseMask (1, U s, U s).
        frame_positions: (U s,) the position in its item of every frame row.
        send_index, send_splits: the local rows to send, peer after peer, and how many.
        recv_index, recv_splits: the frame rows the received rows go to, and how many.
        own_index: (R,) the frame rows of this rank's own rows.
        fingerprint: integers that differ between different masks (the ranks compare them).
    """

    mask: SparseMask
    ranks: int
    rank: int
    owner: Tensor
    work: Tensor
    exchange: Tensor
    rows: Tensor
    frame: SparseMask
    frame_positions: Tensor
    send_index: Tensor
    send_splits: list[int]
    recv_index: Tensor
    recv_splits: list[int]
    own_index: Tensor
    fingerprint: tuple[int, ...]

    @property
    def batch(self) -> int:
        return self.mask.batch

    @property
    def length(self) -> int:
        return self.mask.length

    @property
    def block(self) -> int:
        return self.mask.block_size

    @property
    def padded(self) -> int:
        """n · s: an item's length rounded up to whole tiles."""
        return self.mask.tiles_per_axis * self.block

    @property
    def positions(self) -> Tensor:
        """(R,) the position in its item of every local row."""
        return self.rows % self.padded

    @property
    def real(self) -> Tensor:
        """(R,) bool: local rows inside their item (False past its end)."""
        return self.positions < self.length

    @property
    def balance(self) -> float:
        """max / mean of the ranks' :attr:`work` (1.0 is perfect)."""
        return _dispatch.spread(self.work.tolist())

    @property
    def recv_rows(self) -> list[int]:
        """Key/value rows each rank receives per layer."""
        return self.exchange.sum(0).tolist()

    @property
    def send_rows(self) -> list[int]:
        """Key/value rows each rank sends per layer."""
        return self.exchange.sum(1).tolist()

    def rows_of(self, rank: int) -> Tensor:
        """(R_p,) the flat rows of ``rank`` (as :attr:`rows` is this rank's)."""
        return tile_rows((self.owner == rank).nonzero().squeeze(1), self.block)

    def __repr__(self) -> str:
        return (f"ContextPlan(ranks={self.ranks}, rank={self.rank}, rows={self.rows.shape[0]}, "
                f"work={self.work.tolist()}, balance={self.balance:.3f}, "
                f"recv_rows={self.recv_rows})")

    # ------------------------------------------------------------------ moving rows

    def scatter(self, x: Tensor | Tokens) -> Tensor | Tokens:
        """This rank's rows of a full-sequence tensor or Tokens.

        A tensor (B, L, ...) becomes (1, R, ...) (rows past an item's end are zeros, False
        for a bool tensor). Tokens become Tokens of x (1, R, D) whose mask is False at
        padding and past an item's end, with every per-token meta tensor ((B, L, ...), e.g.
        ``meta["positions"]``) scattered the same way; other meta (spans, grids: the mask
        already holds them) is left out.

        Raises:
            ValueError: a tensor whose first two axes are not (B, L) of the plan's mask.
        """
        if isinstance(x, Tokens):
            tokens = x.unpack() if x.is_packed else x
            meta = {key: self.scatter(value) for key, value in tokens.meta.items()
                    if self._per_token(value)}
            real = self.scatter(tokens.full_mask()) & self.real.to(tokens.device)[None]
            return Tokens(self.scatter(tokens.x), real, meta)
        if not self._per_token(x):
            raise ValueError(
                f"ContextPlan.scatter takes a tensor (B, L, ...) = ({self.batch}, "
                f"{self.length}, ...) or Tokens of that length, got "
                f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}"
            )
        pad = [0, 0] * (x.dim() - 2) + [0, self.padded - self.length]
        flat = F.pad(x, pad).flatten(0, 1)
        return flat.index_select(0, self.rows.to(x.device))[None]

    def _per_token(self, value: object) -> bool:
        return isinstance(value, Tensor) and tuple(value.shape[:2]) == (self.batch,
                                                                       self.length)

    def restore(self, parts: list[Tensor]) -> Tensor:
        """The full-sequence tensor (B, L, ...) from every rank's local rows (1, R_p, ...), in
        rank order; no communication."""
        tail = parts[0].shape[2:]
        out = parts[0].new_zeros(self.batch * self.padded, *tail)
        for rank, part in enumerate(parts):
            out = out.index_copy(0, self.rows_of(rank).to(part.device), part[0])
        return out.view(self.batch, self.padded, *tail)[:, : self.length]

    def gather(self, local: Tensor, group=None) -> Tensor:
        """The full-sequence tensor (B, L, ...) on every rank of ``group`` from each rank's
        local rows (1, R, ...): one all-gather (a collective: every rank calls it).
        Differentiable: the gradient of a rank's rows is the sum of every rank's gradient of
        them (so a loss that every rank computes on the whole output counts once per rank).
        """
        from mmattn.distributed import _halo

        sizes = (torch.bincount(self.owner, minlength=self.ranks) * self.block).tolist()
        rows = F.pad(local[0], [0, 0] * (local.dim() - 2) + [0, max(sizes) - local.shape[1]])
        every = _halo.all_gather_stack(rows, group=group)
        return self.restore([every[p, None, : sizes[p]] for p in range(self.ranks)])


def tile_rows(tiles: Tensor, block: int) -> Tensor:
    """(t · s,) the flat rows of flat tiles, tile by tile."""
    return (tiles[:, None] * block + torch.arange(block, device=tiles.device)).reshape(-1)


def fingerprint(mask: SparseMask, exchange: Tensor) -> tuple[int, ...]:
    """Integers that two ranks compare to know that they hold the same mask, hence the same
    exchange (its shape, tiles and the rows that travel; one host read)."""
    n, prime = mask.tiles_per_axis, (1 << 31) - 1

    def digest(values: Tensor) -> Tensor:
        spread = (values * 2654435761 + 97) % prime
        return (spread * torch.arange(1, values.shape[0] + 1, device=values.device)).sum() % prime

    def ids(tiles: Tensor) -> Tensor:
        return digest((tiles[:, 0] * n + tiles[:, 1]) * n + tiles[:, 2])

    sums = torch.stack([ids(mask.full_tiles), ids(mask.mixed_tiles),
                        digest(exchange.flatten().to(mask.device))]).tolist()
    return (mask.batch, mask.length, mask.block_size, int(mask.full_tiles.shape[0]),
            int(mask.mixed_tiles.shape[0]), *sums)


def needed_rows(mask: SparseMask, owner: Tensor, ranks: int) -> Tensor:
    """(P, B n s) bool: the key rows each rank's query tiles attend and another rank holds.

    A full tile needs its whole key tile; a mixed one the columns its mask attends (read
    only for the tiles whose key tile another rank holds). Rows past an item's end never.
    """
    n, s, batch, length = mask.tiles_per_axis, mask.block_size, mask.batch, mask.length
    count, device = batch * n, mask.device

    def split(tiles: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        query, key = tiles[:, 0] * n + tiles[:, 1], tiles[:, 0] * n + tiles[:, 2]
        far = owner[query] != owner[key]
        return far, owner[query[far]] * count + key[far], far.nonzero().squeeze(1)

    far, slot, _ = split(mask.full_tiles)
    whole = torch.zeros(ranks * count, dtype=torch.bool, device=device)
    whole[slot] = True
    far, slot, picked = split(mask.mixed_tiles)
    columns = mask.mixed_masks.index_select(0, picked).view(torch.uint8).amax(dim=1)
    hits = torch.zeros(ranks * count, s, dtype=torch.int32, device=device)
    hits.index_add_(0, slot, columns.int())
    rows = (hits > 0) | whole[:, None]
    inside = torch.arange(n * s, device=device) < length
    return (rows.view(ranks, batch, n * s) & inside).view(ranks, -1)


def build_plan(mask: SparseMask, ranks: int, rank: int, owner: Tensor | None = None,
               ) -> ContextPlan:
    """The plan of ``rank`` of ``ranks`` for ``mask`` (``owner``: another dispatch of the
    query tiles, (B n,), e.g. contiguous shards for a comparison; default the balanced
    one)."""
    n, s, batch, device = mask.tiles_per_axis, mask.block_size, mask.batch, mask.device
    full, mixed, masks = mask.full_tiles, mask.mixed_tiles, mask.mixed_masks
    work_per_tile, cross = _dispatch.tile_work(full, mixed, batch, n)
    if owner is None:
        owner = _dispatch.balance(work_per_tile, cross, batch, n, ranks)
    owner = owner.to(device)
    work = torch.zeros(ranks, dtype=torch.long, device=device).index_add_(0, owner,
                                                                          work_per_tile)
    row_owner = owner.repeat_interleave(s)
    full_rank = owner[full[:, 0] * n + full[:, 1]]
    mixed_rank = owner[mixed[:, 0] * n + mixed[:, 1]]
    needs = needed_rows(mask, owner, ranks)  # (p, b padded): the key rows each receives
    exchange = torch.stack([(needs & (row_owner == p)).sum(1) for p in range(ranks)])

    mine = (owner == rank).nonzero().squeeze(1)
    rows = tile_rows(mine, s)
    local_tile = torch.full((batch * n,), -1, dtype=torch.long, device=device)
    local_tile[mine] = torch.arange(mine.shape[0], device=device)
    sent = [(needs[q] & (row_owner == rank)).nonzero().squeeze(1) for q in range(ranks)]
    send = torch.cat(sent)
    send_index = local_tile[send // s] * s + send % s
    got = needs[rank].nonzero().squeeze(1)
    got = got[torch.argsort(row_owner[got], stable=True)]  # peer by peer, rows in order
    # the frame: its tiles and those it receives rows of, in sequence order (a run of key
    # tiles stays a run: the kernel's rectangles of full tiles stay long)
    frame_tiles = torch.unique(torch.cat([mine, got // s]))
    frame_tile = torch.full((batch * n,), -1, dtype=torch.long, device=device)
    frame_tile[frame_tiles] = torch.arange(frame_tiles.shape[0], device=device)
    recv_index = frame_tile[got // s] * s + got % s
    own_index = tile_rows(frame_tile[mine], s)
    splits = exchange.tolist()
    frame = _frame_mask(mask, full[full_rank == rank], mixed[mixed_rank == rank],
                        masks[mixed_rank == rank], frame_tile, frame_tiles.shape[0])
    plan = ContextPlan(
        mask=mask, ranks=ranks, rank=rank, owner=owner, work=work, exchange=exchange,
        rows=rows, frame=frame, frame_positions=tile_rows(frame_tiles % n, s),
        send_index=send_index, send_splits=[splits[rank][q] for q in range(ranks)],
        recv_index=recv_index, recv_splits=[splits[p][rank] for p in range(ranks)],
        own_index=own_index,
        fingerprint=fingerprint(mask, exchange),
    )
    return plan


def _frame_mask(mask: SparseMask, full: Tensor, mixed: Tensor, masks: Tensor,
                frame_tile: Tensor, count: int) -> SparseMask:
    """This rank's tiles renumbered in its frame, a SparseMask (1, count s, count s).

    A full tile that holds rows past the end of its item (the last tile, when s does not
    divide L) becomes a mixed one without them: in the frame those rows sit between other
    tiles, not past the end.
    """
    n, s, length = mask.tiles_per_axis, mask.block_size, mask.length
    last = length - (n - 1) * s  # real rows of an item's last tile
    partial = (full[:, 1] == n - 1) | (full[:, 2] == n - 1) if last < s else \
        torch.zeros(full.shape[0], dtype=torch.bool, device=full.device)
    offsets = torch.arange(s, device=full.device)
    cut = full[partial]
    rows_ok = (offsets < torch.where(cut[:, 1] == n - 1, last, s)[:, None])[:, :, None]
    cols_ok = (offsets < torch.where(cut[:, 2] == n - 1, last, s)[:, None])[:, None, :]
    mixed = torch.cat([mixed, cut])
    masks = torch.cat([masks, rows_ok & cols_ok])

    def renumber(tiles: Tensor) -> Tensor:
        base = tiles[:, 0] * n
        return torch.stack([torch.zeros_like(base), frame_tile[base + tiles[:, 1]],
                            frame_tile[base + tiles[:, 2]]], 1)

    return SparseMask(1, count * s, s, renumber(full[~partial]), renumber(mixed), masks)
