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

    def rows(self, w: Tensor, q_tok: Tensor, k_tok: Tensor) -> None:
        """Add a tile: w (n, h, r, j), q_tok (n, r), k_tok (n, j) token ids (-1: none)."""
        heads, groups = w.shape[1], self.num_groups + 1
        self._start(heads, w)
        k_group = torch.where(k_tok >= 0, self.k_group[k_tok.clamp(min=0)], groups - 1)
        q_group = torch.where(q_tok >= 0, self.q_group[q_tok.clamp(min=0)], groups - 1)
        onehot = F.one_hot(k_group, groups).to(w.dtype)[:, None]  # (n, 1, j, G + 1)
        per_row = rearrange(torch.matmul(w, onehot), "n h r g -> h (n r) g")
        self.sums.index_add_(1, q_group.reshape(-1), per_row.double())
        if self.top is not None:
            self._top_rows(w, q_tok, k_tok)

    def _top_rows(self, w: Tensor, q_tok: Tensor, k_tok: Tensor) -> None:
        order = k_tok.argsort(dim=-1, stable=True)  # ties: the lower key index first
        k_tok = k_tok.gather(-1, order)
        w = w.gather(-1, order[:, None, None, :].expand_as(w))
        key = torch.where((k_tok >= 0)[:, None, None, :] & (w > 0), w, -1.0)
        values, at = key.sort(dim=-1, descending=True, stable=True)
        values, at = values[..., : self.topk], at[..., : self.topk]
        ids = k_tok[:, None, None, :].expand_as(key).gather(-1, at)
        keep = values > 0
        index = torch.where(keep, self.layout.pos[ids.clamp(min=0)], -1)
        values = torch.where(keep, values, 0.0)
        if values.shape[-1] < self.topk:
            extra = self.topk - values.shape[-1]
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
                       if t is not None and Layout.of(t).matches(layout)), None)
        groups = None
        if tokens is not None:
            layout = Layout.of(tokens)
            groups = token_groups(tokens, layout, self.by or "modality")
        if self.by is not None and groups is None:
            raise Unsupported("its Tokens carry no modality facts (meta['spans'] or "
                              "meta['modality_ids'] with meta['modalities'])")
        names, group = groups if groups is not None else ([], None)
        call.layout, call.names = layout, names
        call.tally = Tally(layout, group, len(names), self.topk)

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
                    (call.tally.edges if kind == "edges" else call.tally.rows)(*tile)
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
        if path == "local" and "inputs" in record:
            q, k, key_mask = record["inputs"]
            return "rows", views.band_tiles(
                q, k, key_mask, self._slots(record, call, q), window=record["window_size"],
                causal=record["causal"], num_global=record["num_global_tokens"],
                scale=record.get("scale"), block=block,
            )
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
