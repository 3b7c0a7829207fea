"""The machinery of :func:`mmattn.debug.attention_mass` and :func:`~mmattn.debug.top_keys`.

Axis key: ``b`` items, ``h`` heads, ``l`` positions, ``t`` flat tokens, ``G`` groups (one
more, the last, for "no group": padding, appended keys), ``k`` top keys.

A :class:`Session` puts hooks on the model: every module's forward pre-hook notes the
:class:`~mmattn.tokens.Tokens` it was given (so an attention call finds the Tokens, and
their modality facts, of its block), and every mmattn attention module's forward (and its
``attend_rows``, which blocks call for packed Tokens) opens a :class:`Call`. A kernel path
listener receives each kernel report of the call, turns it into exact weight tiles
(:mod:`._mass_views`) and adds them to the call's :class:`Tally`: per-group sums and the
running top keys. Nothing is kept of a tile once it is added.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from mmattn._helpers import exporting
from mmattn.attention.mha import MultiHeadAttention
from mmattn.debug import _mass_views as views
from mmattn.debug._mass_groups import Layout, token_groups
from mmattn.kernels import dense as _kernel
from mmattn.kernels.packed import contiguous_parts, is_jagged
from mmattn.tokens import Tokens


class Unsupported(Exception):
    """A report this module cannot turn into weights (the call is then skipped)."""


class Tally:
    """Per-group weight sums and the top keys of one call, fed tile by tile."""

    def __init__(self, layout: Layout, group: Tensor | None, num_groups: int, topk: int | None):
        self.layout, self.num_groups, self.topk = layout, num_groups, topk
        none = num_groups
        if group is None:
            group = torch.full_like(layout.pos, -1)
        self.k_group = torch.where(group >= 0, group, none)
        self.q_group = torch.where((group >= 0) & layout.real, group, none)
        self.sums: Tensor | None = None  # (h, G + 1, G + 1) float64
        self.top: tuple[Tensor, Tensor] | None = None  # (b, h, l, k) weights and indices

    def counts(self) -> Tensor:
        """(G,) real query tokens of every group."""
        return torch.bincount(self.q_group, minlength=self.num_groups + 1)[: self.num_groups]

    def _start(self, heads: int, like: Tensor) -> None:
        groups = self.num_groups + 1
        if self.sums is None:
            self.sums = torch.zeros(heads, groups, groups, dtype=torch.float64, device=like.device)
        if self.topk and self.top is None:
            shape = (self.layout.batch, heads, self.layout.length, self.topk)
            self.top = (torch.zeros(shape, device=like.device),
                        torch.full(shape, -1, dtype=torch.long, device=like.device))
        if self.sums.shape[0] != heads:
            raise Unsupported(f"the call's kernels disagree on heads ({self.sums.shape[0]}, "
                              f"{heads})")

    def rows(self, tile: views.Tile) -> None:
        """Add a tile (:class:`~mmattn.debug._mass_views.Tile`) of query rows."""
        heads, groups = tile.q.shape[1], self.num_groups + 1
        self._start(heads, tile.q)
        q_tok, k_tok = tile.q_tok, tile.k_tok
        k_group = torch.where(k_tok >= 0, self.k_group[k_tok.clamp(min=0)], groups - 1)
        q_group = torch.where(q_tok >= 0, self.q_group[q_tok.clamp(min=0)], groups - 1)
        if self.topk or tile.score_weight is not None:
            per_row = []
            for part, kg in zip(views.chunks(tile, SUM_ELEMENTS),
                                views.split_slots(k_group, tile, SUM_ELEMENTS)):
                w = views.weights(part)
                onehot = F.one_hot(kg, groups).to(w.dtype)[:, None]  # (n, 1, j, G + 1)
                per_row.append(torch.matmul(w, onehot))
                if self.topk:
                    self._top_rows(w, part.q_tok, part.k_tok)
            per_row = torch.cat(per_row)
        else:
            per_row = _tile_sums(tile, k_group, groups)
        per_row = rearrange(per_row, "n h r g -> h (n r) g")
        self.sums.index_add_(1, q_group.reshape(-1), per_row.double())

    def _top_rows(self, w: Tensor, q_tok: Tensor, k_tok: Tensor) -> None:
        """Keep the k best keys of every row: weight first, then the lower key index."""
        k = min(self.topk, w.shape[-1])
        key = torch.where((k_tok >= 0)[:, None, None, :] & (w > 0), w, -1.0)
        if not _ascending(k_tok):  # ties go to the lower index: columns in index order
            order = k_tok.argsort(dim=-1, stable=True)
            k_tok = k_tok.gather(-1, order)
            key = key.gather(-1, order[:, None, None, :].expand_as(key))
        values, at = _best(key, k)
        ids = k_tok[:, None, None, :].expand_as(key).gather(-1, at)
        keep = values > 0
        index = torch.where(keep, self.layout.pos[ids.clamp(min=0)], -1)
        values = torch.where(keep, values, 0.0)
        if k < self.topk:
            extra = self.topk - k
            values, index = F.pad(values, (0, extra)), F.pad(index, (0, extra), value=-1)
        real = (q_tok >= 0) & self.layout.real[q_tok.clamp(min=0)]
        rows = q_tok[real]
        b, i = self.layout.item[rows], self.layout.pos[rows]
        top_w, top_i = self.top
        top_w[b, :, i] = rearrange(values, "n h r k -> n r h k")[real].to(top_w.dtype)
        top_i[b, :, i] = rearrange(index, "n h r k -> n r h k")[real]

    def edges(self, w: Tensor, q_tok: Tensor, k_tok: Tensor) -> None:
        """Add edge weights: w (E, h), q_tok / k_tok (E,) the query and key token of each."""
        heads, groups = w.shape[1], self.num_groups + 1
        self._start(heads, w)
        cell = self.q_group[q_tok] * groups + self.k_group[k_tok]
        self.sums.view(heads, -1).index_add_(1, cell, w.t().double())
        if self.top is None or not w.numel():
            return
        order = k_tok.argsort(stable=True)  # sort by (query, weight desc, key) per head
        w, q_tok, k_tok = w[order], q_tok[order], k_tok[order]
        by_w = w.sort(dim=0, descending=True, stable=True).indices  # (E, h)
        by_q = q_tok[by_w].sort(dim=0, stable=True).indices
        at = by_w.gather(0, by_q)
        wq, qq, kq = w.gather(0, at), q_tok[at], k_tok[at]
        steps = torch.arange(wq.shape[0], device=w.device)[:, None].expand_as(qq)
        start = torch.ones_like(qq, dtype=torch.bool)
        start[1:] = qq[1:] != qq[:-1]
        rank = steps - torch.where(start, steps, 0).cummax(dim=0).values
        keep = (rank < self.topk) & (wq > 0) & self.layout.real[qq]
        edge, head = keep.nonzero(as_tuple=True)
        rows = qq[edge, head]
        top_w, top_i = self.top
        b, i, r = self.layout.item[rows], self.layout.pos[rows], rank[edge, head]
        top_w[b, head, i, r] = wq[edge, head].to(top_w.dtype)
        top_i[b, head, i, r] = self.layout.pos[kq[edge, head]]


def _tile_sums(tile: views.Tile, k_group: Tensor, groups: int) -> Tensor:
    """(n, h, r, G + 1) the weight each row of a tile gives to each key group.

    A row's weights over its allowed keys sum to 1 (0 for a dead row), so where every key a
    slot's rows may attend is of one group, that group gets all of it and no score is
    needed; only the slots whose allowed keys mix groups are computed
    (:func:`_group_sums`). In a fused sequence that is the few tiles at a border.
    """
    n, heads, rows, _ = tile.q.shape
    allowed, bias = tile.allowed, tile.bias
    ok = torch.ones(n, 1, 1, k_group.shape[1], dtype=torch.bool, device=k_group.device)
    if allowed is not None:
        ok = ok & allowed
    if bias is not None:
        ok = ok & ~torch.isneginf(bias)
    live = ok.any(dim=-1)  # (n, h | 1, r | 1)
    cols = ok.flatten(1, 2).any(dim=1)  # (n, j): a key some row of the slot may attend
    low = torch.where(cols, k_group, groups).amin(dim=-1)
    high = torch.where(cols, k_group, -1).amax(dim=-1)
    single = (low == high) | ~cols.any(dim=-1)
    sums = torch.zeros(n, heads, rows, groups, device=k_group.device,
                       dtype=torch.promote_types(tile.q.dtype, torch.float32))
    one = F.one_hot(low.clamp(max=groups - 1), groups).to(sums.dtype)[:, None, None]
    sums += live.expand(n, heads, rows)[..., None] * one
    mixed = (~single).nonzero().flatten()
    if mixed.numel() == n:  # every slot: no copy of the tile
        return _flash_sums(tile, k_group, groups)
    if mixed.numel():
        part = tile._replace(
            q=tile.q[mixed], k=tile.k[mixed],
            allowed=None if allowed is None else _slots_of(allowed, mixed),
            bias=None if bias is None else _slots_of(bias, mixed),
        )
        sums[mixed] = _flash_sums(part, k_group[mixed], groups)
    return sums


def _flash_sums(tile: views.Tile, k_group: Tensor, groups: int) -> Tensor:
    """:func:`_group_sums` through SDPA: the keys' one-hot groups as values (padded to the
    head width, which the CPU flash kernel needs); rows without keys give zeros."""
    q, k = tile.q, tile.k
    width = q.shape[-1]
    if groups > width or q.dtype != torch.float32:  # half precision: float32 scores
        return _group_sums(tile, k_group, groups)
    values = F.pad(F.one_hot(k_group, groups).to(q.dtype), (0, width - groups))
    values = values[:, None].expand(-1, k.shape[1], -1, -1)
    mask = tile.allowed
    if tile.bias is not None:
        bias = tile.bias.to(q.dtype)
        mask = bias if mask is None else bias.masked_fill(~mask, -math.inf)
    out = _kernel.sdpa(q, k, values, mask, scale=tile.scale,
                       groups=q.shape[1] // max(k.shape[1], 1))
    return out[..., :groups].float()


def _slots_of(t: Tensor, index: Tensor) -> Tensor:
    return t if t.shape[0] == 1 else t[index]


#: Scores per step of :func:`_group_sums` (small enough to stay in the CPU's cache).
SUM_ELEMENTS = 1 << 17


def _best(key: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest of every row, best first, ties to the lower column (columns in index
    order): k passes of ``max`` (which returns the first maximum) for small k, else topk
    with the ties at the k-th value settled by column."""
    if k <= 16:
        key = key.clone()
        values, at = [], []
        for _ in range(k):
            value, index = key.max(dim=-1, keepdim=True)
            values.append(value)
            at.append(index)
            key.scatter_(-1, index, -2.0)  # below every weight and every "no key" (-1)
        return torch.cat(values, dim=-1), torch.cat(at, dim=-1)
    kth = key.topk(k, dim=-1).values[..., -1:]
    above, tied = key > kth, key == kth
    need = k - above.sum(dim=-1, keepdim=True)
    chosen = above | (tied & (tied.cumsum(dim=-1) <= need))  # exactly k a row
    at = chosen.nonzero(as_tuple=True)[-1].view(*key.shape[:-1], k)  # ascending
    values, order = key.gather(-1, at).sort(dim=-1, descending=True, stable=True)
    return values, at.gather(-1, order)


def _ascending(k_tok: Tensor) -> bool:
    """Whether the real key columns of every slot come in increasing token order."""
    ids = torch.where(k_tok >= 0, k_tok, -1)
    return bool(((ids >= ids.cummax(dim=-1).values) | (ids < 0)).all())


def _group_sums(tile: views.Tile, k_group: Tensor, groups: int) -> Tensor:
    """(n, h, r, G + 1) the weight each row gives to each key group: the softmax of each
    step's scores, in place, times the keys' one-hot groups; dead rows give zeros."""
    q, k = tile.q, tile.k
    n, heads, rows, _ = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    kv_heads, keys = k.shape[1], k.shape[2]
    g = heads // max(kv_heads, 1)
    onehot = F.one_hot(k_group, groups).to(acc)[:, None]  # (n, 1, j, G + 1)
    allowed, bias = tile.allowed, tile.bias
    live = None
    if allowed is not None:
        live = allowed.any(dim=-1, keepdim=True)
    if bias is not None:
        seen = ~torch.isneginf(bias).all(dim=-1, keepdim=True)
        live = seen if live is None else live & seen
    qs = rearrange(q.to(acc) * tile.scale, "n (k g) r e -> n k (g r) e", g=g)
    step = max(1, SUM_ELEMENTS // max(1, heads * rows * keys))
    out = []
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        scores = torch.matmul(qs[n0:n1], k[n0:n1].to(acc).transpose(-1, -2))
        scores = rearrange(scores, "n k (g r) j -> n (k g) r j", g=g)
        add = None if bias is None else views._part(bias, n0, n1).to(acc)
        if allowed is not None:  # a small additive mask: adding beats masked_fill_ here
            ok = views._part(allowed, n0, n1)
            blocked = torch.zeros(ok.shape, dtype=acc, device=q.device).masked_fill_(
                ~ok, -math.inf)
            add = blocked if add is None else add + blocked
        if add is not None:
            scores.add_(add)
        torch._softmax(scores, -1, False, out=scores)
        sums = torch.matmul(scores, onehot[n0:n1])
        if live is not None and bias is not None and allowed is not None:
            sums = torch.where(~torch.isneginf(add).all(dim=-1, keepdim=True), sums, 0.0)
        out.append(sums)
    sums = torch.cat(out)
    return sums if live is None else torch.where(live, sums, 0.0)


@dataclass
class Call:
    """One attention module call: its name, tokens, groups and tally (or why skipped)."""

    name: str
    layout: Layout | None = None
    names: list[str] = field(default_factory=list)
    tally: Tally | None = None
    skip: str | None = None


def _first_tokens(args: tuple, kwargs: dict) -> Tokens | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tokens):
            return value
    return None


class Session:
    """Hooks, the Tokens stack and the listener of one attention_mass / top_keys run."""

    def __init__(self, by: str | None, topk: int | None, block: int | None) -> None:
        self.by, self.topk, self.block = by, topk, block
        self.calls: list[Call] = []
        self.skipped: list[tuple[str, str]] = []
        self.tokens: list[Tokens | None] = []
        self.active: list[Call] = []
        self._layouts: dict[int, tuple[Tokens, Layout]] = {}  # the Tokens kept: ids stay valid
        self._group_cache: dict[tuple, tuple[dict, Any]] = {}

    # -------------------------------------------------------------- opening calls

    def open(self, name: str, module: nn.Module, query: Any, self_attention: bool,
             key_padding_mask: Tensor | None, offsets: Tensor | None = None,
             cached: bool = False) -> None:
        call = Call(name)
        self.active.append(call)
        try:
            self._prepare(call, module, query, self_attention, key_padding_mask, offsets, cached)
        except Unsupported as why:
            call.skip = str(why)

    def _prepare(self, call: Call, module: nn.Module, query: Any, self_attention: bool,
                 key_padding_mask: Tensor | None, offsets: Tensor | None, cached: bool) -> None:
        if cached:
            raise Unsupported("a decoding step (cache=): the keys are the cache, not the tokens")
        if not self_attention:
            raise Unsupported("cross-attention: the keys are another sequence")
        if module._packed_weights_width() is not None:
            raise Unsupported("the keys are projected slots (Linformer), not tokens")
        if exporting():
            raise Unsupported("exporting")
        if offsets is not None:
            layout = Layout.packed(offsets)
        elif is_jagged(query):
            layout = Layout.packed(contiguous_parts(query)[1])
        elif isinstance(query, Tensor) and not query.is_nested and query.dim() in (2, 3):
            batched = query.dim() == 3
            batch = query.shape[0 if module.batch_first else 1] if batched else 1
            length = query.shape[1 if module.batch_first else 0] if batched else query.shape[0]
            real = None
            if key_padding_mask is not None:
                kpm = key_padding_mask.reshape(batch, -1)
                real = ~kpm if kpm.dtype == torch.bool else ~torch.isneginf(kpm)
            layout = Layout.padded(batch, length, real, query.device)
        else:
            raise Unsupported("a nested query that is not jagged")
        tokens = next((t for t in reversed(self.tokens)
                       if t is not None and self._layout(t).matches(layout)), None)
        groups = None
        if tokens is not None:
            layout = self._layout(tokens)
            groups = self._groups(tokens, layout)
        if self.by is not None and groups is None:
            raise Unsupported("its Tokens carry no modality facts (meta['spans'] or "
                              "meta['modality_ids'] with meta['modalities'])")
        names, group = groups if groups is not None else ([], None)
        call.layout, call.names = layout, names
        call.tally = Tally(layout, group, len(names), self.topk)

    def _layout(self, tokens: Tokens) -> Layout:
        """The layout of Tokens, once per Tokens object (the blocks share theirs)."""
        key = id(tokens)
        if key not in self._layouts:
            self._layouts[key] = (tokens, Layout.of(tokens))
        return self._layouts[key][1]

    def _groups(self, tokens: Tokens, layout: Layout):
        key = (id(tokens.meta), layout.batch, layout.length)
        if key not in self._group_cache:
            self._group_cache[key] = (tokens.meta, token_groups(tokens, layout,
                                                                self.by or "modality"))
        return self._group_cache[key][1]

    def close(self) -> None:
        call = self.active.pop()
        if call.skip is not None:
            self.skipped.append((call.name, call.skip))
        elif call.tally is not None and call.tally.sums is not None:
            self.calls.append(call)
        else:
            self.skipped.append((call.name, "no kernel report (nothing attended)"))

    # -------------------------------------------------------------- reports

    def listener(self, record: dict) -> None:
        if not self.active:
            self.skipped.append(("", f"a {record['path']} kernel call outside an mmattn "
                                     "attention module"))
            return
        call = self.active[-1]
        if call.skip is not None:
            return
        try:
            with torch.no_grad():
                kind, tiles = self._tiles(record, call)
                for tile in tiles:
                    if kind == "edges":
                        call.tally.edges(*tile)
                    else:
                        call.tally.rows(tile)
        except Unsupported as why:
            call.skip = str(why)

    def _slots(self, record: dict, call: Call, q: Tensor) -> views.Slots:
        layout = call.layout
        starts, lengths = layout.offsets[:-1], layout.lengths
        if "items" in record:  # a packed bucket: slot n is item items[n]
            items = torch.tensor(record["items"], dtype=torch.long, device=starts.device)
            starts, lengths = starts[items], lengths[items]
        elif q.shape[0] != layout.batch or q.shape[2] != layout.length:
            raise Unsupported(f"a kernel call of shape {tuple(q.shape)} on tokens "
                              f"{(layout.batch, layout.length)}")
        return views.Slots(starts, lengths, starts, lengths)

    def _tiles(self, record: dict, call: Call) -> tuple[str, Iterator]:
        path, block = record["path"], self.block
        q, k = record.get("q"), record.get("k")
        if path == "local":  # its blocks and slabs; "inputs" are the tensors before blocking
            if "inputs" not in record:  # an empty sequence or batch: nothing attended
                return "rows", iter(())
            slots = self._slots(record, call, record["inputs"][0])
            return "rows", views.band_tiles(record, slots)
        if path == "neighborhood":
            return "rows", self._neighborhood(record, call)
        if path in ("edge", "edge-explicit") and "src" in record:
            w = views.edge_weights(q, k, record["src"], record["dst"], record.get("bias"),
                                   record.get("scale"))
            return "edges", iter([(w, record["dst"], record["src"])])
        if path == "packed" and record.get("kernel") == "jagged-sdpa":
            return "rows", self._jagged(record, call)
        if path in ("fused", "explicit", "chunked") or (
            path == "packed" and record.get("kernel") == "buckets"
        ):
            return "rows", views.dense_tiles(
                q, k, record.get("mask"), self._slots(record, call, q),
                is_causal=bool(record.get("is_causal")), scale=record.get("scale"),
                block=block or 64, score_weight=record.get("score_weight"),
            )
        raise Unsupported(f"the {path!r} kernel path is not known to attention_mass")

    def _neighborhood(self, record: dict, call: Call) -> Iterator:
        from mmattn.kernels._neighborhood_plan import build_plan
        from mmattn.kernels.neighborhood import choose_tiles, padded_items

        q, k, key_mask = record["q"], record["k"], record.get("mask")
        plan = record.get("plan")
        if plan is None:  # the padded form: the kernel's own (cached) plan of this geometry
            batch, _, length, _ = q.shape
            kernel, dilation = tuple(record["kernel_size"]), tuple(record["dilation"])
            items = padded_items(batch, length, record["grid"],
                                 num_global_tokens=record["num_global_tokens"],
                                 grid_start=record["grid_start"])
            tiles = choose_tiles(items, kernel, dilation)
            plan = build_plan(batch * length, items, kernel, dilation, tiles, q.device)
            q, k = (rearrange(t, "b h l e -> (b l) h e") for t in (q, k))
            key_mask = None if key_mask is None else key_mask.reshape(-1)
        return views.plan_tiles(q, k, key_mask, plan, scale=record.get("scale"))

    def _jagged(self, record: dict, call: Call) -> Iterator:
        starts, lengths = call.layout.offsets[:-1], call.layout.lengths
        for m, (qm, km) in enumerate(zip(record["q"].unbind(), record["k"].unbind())):
            slots = views.Slots(starts[m:m + 1], lengths[m:m + 1], starts[m:m + 1],
                                lengths[m:m + 1])
            yield from views.dense_tiles(qm[None], km[None], None, slots,
                                         is_causal=bool(record.get("is_causal")),
                                         block=self.block or 64)

    # -------------------------------------------------------------- hooks

    def install(self, model: nn.Module) -> list:
        handles = []
        patched = []

        def push(module, args, kwargs):
            self.tokens.append(_first_tokens(args, kwargs))

        def pop(module, args, kwargs, output):
            if self.tokens:
                self.tokens.pop()

        for name, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(push, with_kwargs=True))
            handles.append(module.register_forward_hook(pop, with_kwargs=True, always_call=True))
            if isinstance(module, MultiHeadAttention):
                handles.extend(self._attention_hooks(name, module))
                module.attend_rows = self._rows_wrapper(name, module, module.attend_rows)
                patched.append(module)
        return [handle.remove for handle in handles] + [
            (lambda m=m: m.__dict__.pop("attend_rows", None)) for m in patched
        ]

    def _attention_hooks(self, name: str, module: MultiHeadAttention) -> list:
        signature = inspect.signature(module.forward)

        def pre(mod, args, kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            query, key = bound.get("query"), bound.get("key")
            self.open(name, mod, query, key is None or key is query,
                      bound.get("key_padding_mask"), cached=bound.get("cache") is not None)

        def post(mod, args, kwargs, output):
            if self.active:
                self.close()

        return [module.register_forward_pre_hook(pre, with_kwargs=True),
                module.register_forward_hook(post, with_kwargs=True, always_call=True)]

    def _rows_wrapper(self, name: str, module: MultiHeadAttention, rows):
        def attend_rows(qv, q_off, kv, k_off, vv, *, self_attention=False, **kwargs):
            self.open(name, module, qv, bool(self_attention), None, offsets=q_off)
            try:
                return rows(qv, q_off, kv, k_off, vv, self_attention=self_attention, **kwargs)
            finally:
                self.close()

        return attend_rows
