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
from einops import rearrange
from torch import Tensor, nn

from mmattn._helpers import exporting
from mmattn._jagged import contiguous_parts, is_jagged
from mmattn.attention.mha import MultiHeadAttention
from mmattn.debug import _mass_views as views
from mmattn.debug._mass_groups import Layout, token_groups
from mmattn.debug._mass_tally import Tally, Unsupported
from mmattn.debug._mass_terms import neighborhood_terms
from mmattn.tokens import Tokens


@dataclass
class Call:
    """One attention module call: its name, tokens, groups and tally (or why skipped)."""

    name: str
    layout: Layout | None = None
    names: list[str] = field(default_factory=list)
    tally: Tally | None = None
    skip: str | None = None


def _padded_form(packed: Layout, padded: Layout) -> bool:
    """Whether ``padded`` (from a padded query) is the unpacked form of ``packed``."""
    return (packed.batch, packed.length) == (padded.batch, padded.length) and bool(
        torch.equal(padded.offsets.cpu(), torch.arange(padded.batch + 1) * padded.length))


def _as_padded(packed: Layout, groups):
    """The padded layout of packed tokens (item b's tokens first in row b), and their groups
    moved there."""
    real = torch.arange(packed.length, device=packed.pos.device) < packed.lengths[:, None]
    layout = Layout.padded(packed.batch, packed.length, real, packed.pos.device)
    if groups is None:
        return layout, None
    names, group = groups
    moved = torch.full_like(layout.pos, -1)
    moved[packed.item * packed.length + packed.pos] = group
    return layout, (names, moved)


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
        else:  # packed Tokens a block runs padded (a pattern's block-sparse kernel)
            tokens = next((t for t in reversed(self.tokens) if t is not None and t.is_packed
                           and _padded_form(self._layout(t), layout)), None)
            if tokens is not None:
                packed = self._layout(tokens)
                found = self._groups(tokens, packed)
                layout, groups = _as_padded(packed, found)
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
        if (record.get("modifiers") or record.get("position_bias") is not None) and (
            path not in ("local", "fused", "explicit", "chunked", "packed", "neighborhood",
                         "block-sparse", "edge", "edge-explicit")
        ):
            raise Unsupported(f"score modifiers on the {path!r} kernel are not applied by "
                              "attention_mass")
        if path == "neighborhood":
            return "rows", self._neighborhood(record, call)
        if path == "block-sparse" and "plan" in record:
            layout = call.layout
            if not torch.equal(layout.offsets.cpu(),
                               torch.arange(layout.batch + 1) * layout.length):
                raise Unsupported("a block-sparse call on packed tokens")
            return "rows", views.sparse_tiles(record)
        if path in ("edge", "edge-explicit") and "src" in record:
            w = views.edge_weights(q, k, record["src"], record["dst"], record.get("bias"),
                                   record.get("scale"), **views.modifiers_of(record))
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
                **views.modifiers_of(record),
            )
        raise Unsupported(f"the {path!r} kernel path is not known to attention_mass")

    def _neighborhood(self, record: dict, call: Call) -> Iterator:
        from mmattn.kernels.neighborhood import build_plan, choose_tiles, padded_items

        q, k, key_mask = record["q"], record["k"], record.get("mask")
        plan, items = record.get("plan"), record.get("items")
        if plan is None:  # the padded form: a plan over every item of the batch
            batch, _, length, _ = q.shape
            kernel, dilation = tuple(record["kernel_size"]), tuple(record["dilation"])
            items = padded_items(batch, length, record["grid"],
                                 num_global_tokens=record["num_global_tokens"],
                                 grid_start=record["grid_start"])
            tiles = choose_tiles(items, kernel, dilation)
            plan = build_plan(batch * length, items, kernel, dilation, tiles, q.device)
            q, k = (rearrange(t, "b h l e -> (b l) h e") for t in (q, k))
            key_mask = None if key_mask is None else key_mask.reshape(-1)
        return views.plan_tiles(q, k, key_mask, plan, scale=record.get("scale"),
                                **neighborhood_terms(record, items, q.shape[0], q))

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
            try:
                bound = signature.bind(*args, **kwargs).arguments
            except TypeError:  # the forward itself will say what is wrong
                self.open(name, mod, None, False, None)
                return
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
