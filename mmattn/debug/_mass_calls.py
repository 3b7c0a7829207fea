"""Recording the attention calls of one :func:`~mmattn.debug.attention_mass` /
:func:`~mmattn.debug.top_keys` run, and measuring them.

Axis key: ``b`` items, ``h`` heads, ``l`` positions, ``t`` flat tokens, ``M`` groups.

Hooks note the :class:`~mmattn.tokens.Tokens` every module is given, so an attention call
(a forward, or ``attend_rows`` for packed Tokens) finds the modality facts of its block,
read by the patterns' ``TokenContext``. Every attention step of a layer runs through its
``_step`` whatever the kernel or engine (DESIGN, "One implementation of each kernel's
math"): there the values take the keys' one-hot groups as M more columns, and a query's
last M output columns are its weight on each group. Top keys: each kernel report goes back
to its kernel (:func:`mmattn.kernels._report_tiles.weight_tiles`) for its weight tiles.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmattn import _checks as checks
from mmattn._helpers import exporting
from mmattn._jagged import contiguous_parts, is_jagged
from mmattn.attention.mha import MultiHeadAttention
from mmattn.debug._mass_tally import Layout, Tally
from mmattn.kernels import engines
from mmattn.kernels._tiles import Unsupported
from mmattn.kernels.dense import add_listener, current_facts
from mmattn.patterns._attributes import runs
from mmattn.patterns._context import TokenContext
from mmattn.tokens import Tokens


def _ignore(report: dict[str, Any]) -> None:
    """A listener that reads nothing (see Session.run)."""


def token_groups(tokens: Tokens, by: str) -> tuple[list[str], Tensor | None, Tensor]:
    """The group names, the (B, L) group of every token (-1: padding or none; None without
    modality facts) and the (B, L) real tokens, in the Tokens' padded layout.

    Raises:
        ValueError: malformed modality facts (the patterns' messages).
    """
    ctx = TokenContext(tokens)
    if ctx.meta.get("spans") is None and "modality_ids" not in ctx.meta:
        return [], None, ctx.real
    ids, names = ctx.modalities()
    ids = torch.where(ctx.real, ids, -1)
    if by == "modality":
        return list(names), ids, ctx.real
    segments = ctx.segments()
    segments = runs(ids) if segments is None else torch.where(ids < 0, -1, segments)
    labels: dict[str, int] = {}
    out = []
    for mods, segs in zip(ids.tolist(), segments.tolist()):
        seen: dict[int, int] = {}  # segment -> label index
        ranks: dict[int, int] = {}  # modality -> segments so far
        for m, s in zip(mods, segs):
            if s >= 0 and s not in seen:
                ranks[m] = ranks.get(m, -1) + 1
                seen[s] = labels.setdefault(f"{names[m]}[{ranks[m]}]", len(labels))
            out.append(seen[s] if s >= 0 else -1)
    group = torch.tensor(out, dtype=torch.long, device=ids.device).view_as(ids)
    return list(labels), group, ctx.real


@dataclass
class Call:
    """One attention module call: its name, tokens and groups (or why it is skipped), and
    what was measured: ``sums`` (h, M, M) or the top keys' ``tally``."""

    name: str
    module: nn.Module | None = None
    layout: Layout | None = None
    names: list[str] = field(default_factory=list)
    group: Tensor | None = None  # (t,) the group of every token, -1: none
    sums: Tensor | None = None
    tally: Tally | None = None
    skip: str | None = None


class Session:
    """Hooks, the Tokens stack and the calls of one attention_mass / top_keys run."""

    def __init__(self, by: str | None, topk: int | None, block: int | None) -> None:
        if block is not None:
            checks.check_positive_int("block_size", block)
        self.by, self.topk, self.block = by, topk, block
        self.calls: list[Call] = []
        self.skipped: list[tuple[str, str]] = []
        self.tokens: list[Tokens | None] = []
        self.active: list[Call] = []
        self._seen: dict[int, tuple[Tokens, tuple]] = {}  # the Tokens kept: ids stay valid

    def run(self, model: nn.Module, tokens: Any, args: tuple, kwargs: dict, what: str) -> Any:
        """``model(tokens, *args, **kwargs)`` with the hooks on; what it returned."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        with contextlib.ExitStack() as undo:
            for step in self.install(model):
                undo.callback(step)
            # a listener also turns on report_facts, which the step wrapper reads (a packed
            # bucket's items); without top-k it only has to be there
            undo.callback(add_listener(self.listener if self.topk else _ignore))
            if self.topk:  # engines report no tiles: mmattn's own kernels run the calls
                undo.enter_context(engines.use("fallback"))
            if isinstance(model, MultiHeadAttention) and isinstance(tokens, Tokens):
                self.tokens.append(tokens)  # a bare layer: called on the Tokens' tensors
                extra = {**model.geometry({**tokens.meta, **kwargs}), **kwargs}
                if not tokens.is_packed:
                    extra.setdefault("key_padding_mask", tokens.key_padding_mask)
                output = model(tokens.x, *args, **extra)
            else:
                output = model(tokens, *args, **kwargs)
        if not self.calls:
            why = "; ".join(f"{name or '(model)'}: {reason}" for name, reason in self.skipped)
            raise ValueError(f"{what} found no self-attention call of an mmattn attention "
                             "module to measure" + (f" (skipped: {why})" if why else ""))
        return output

    def open(self, name: str, module: nn.Module, query: Any, self_attention: bool,
             key_padding_mask: Tensor | None, offsets: Tensor | None = None,
             cached: bool = False) -> None:
        call = Call(name, module)
        self.active.append(call)
        reasons = ((cached, "a decoding step (cache=): the keys are the cache, not the tokens"),
                   (not self_attention, "cross-attention: the keys are another sequence"),
                   (module._packed_weights_width() is not None,
                    "the keys are projected slots (Linformer), not tokens"),
                   (exporting(), "exporting"))
        try:
            for bad, why in reasons:
                if bad:
                    raise Unsupported(why)
            self._prepare(call, module, query, key_padding_mask, offsets)
        except Unsupported as why:
            call.skip = str(why)

    def _prepare(self, call: Call, module: nn.Module, query: Any,
                 key_padding_mask: Tensor | None, offsets: Tensor | None) -> None:
        if offsets is not None or is_jagged(query):
            layout = Layout.make(offsets if offsets is not None else contiguous_parts(query)[1])
        elif isinstance(query, Tensor) and not query.is_nested and query.dim() in (2, 3):
            batched, first = query.dim() == 3, module.batch_first
            batch = query.shape[0 if first else 1] if batched else 1
            length = query.shape[1 if first else 0] if batched else query.shape[0]
            real = None
            if key_padding_mask is not None:
                kpm = key_padding_mask.reshape(batch, -1)
                real = ~kpm if kpm.dtype == torch.bool else ~torch.isneginf(kpm)
            offsets = torch.arange(batch + 1, device=query.device) * length
            layout = Layout.make(offsets, real, length)
        else:
            raise Unsupported("a nested query that is not jagged")
        found = next((self._groups(t) for t in reversed(self.tokens)
                      if t is not None and layout.fits(t)), None)
        if found is not None:
            names, group, real = found
            layout.real = layout.real & real[layout.item, layout.pos]
            if group is not None:
                call.names = names
                call.group = torch.where(layout.real, group[layout.item, layout.pos], -1)
        if self.by is not None and call.group is None:
            raise Unsupported("its Tokens carry no modality facts (meta['spans'] or "
                              "meta['modality_ids'] with meta['modalities'])")
        call.layout = layout
        if self.topk is not None:
            call.tally = Tally(layout, self.topk)

    def _groups(self, tokens: Tokens) -> tuple:
        """:func:`token_groups` of Tokens, once per Tokens object (blocks share theirs)."""
        if id(tokens) not in self._seen:
            self._seen[id(tokens)] = (tokens, token_groups(tokens, self.by or "modality"))
        return self._seen[id(tokens)][1]

    def close(self) -> None:
        call = self.active.pop()
        measured = call.sums is not None or (call.tally is not None and call.tally.top is not None)
        if call.skip is None and measured:
            self.calls.append(call)
        else:
            self.skipped.append((call.name, call.skip or "nothing attended"))

    def _step_wrapper(self, module: MultiHeadAttention, step):
        """The module's attention step, taking the keys' groups with the values."""
        def run(kernel, q, k, v, *args, **kwargs):
            call = self.active[-1] if self.active else None
            if call is None or call.module is not module or call.skip or call.group is None:
                return step(kernel, q, k, v, *args, **kwargs)
            try:
                items = current_facts().get("items")
                q_tok, k_tok = (call.layout.rows(x, items) for x in (q, v))
            except Unsupported as why:
                call.skip = str(why)
                return step(kernel, q, k, v, *args, **kwargs)
            count = len(call.names)
            keys = torch.where(k_tok >= 0, call.group[k_tok.clamp(min=0)], -1)
            groups = F.one_hot(keys + 1, count + 1)[:, 1:].to(v.dtype)  # none: a zero row
            groups = groups.view(v.shape[0], 1, *v.shape[2:-1], count).expand(
                *v.shape[:-1], count)  # (b, k, j, M) or (t, k, M): the same for every head
            # without dropout one call on [v | groups]; with it the call as it was, then one on
            # the groups alone without dropout (the mass of the weights before dropout)
            dropout, width = kwargs.get("dropout_p", 0.0) != 0, v.shape[-1]
            wide = v if dropout else torch.cat([v, groups], dim=-1)
            result = step(kernel, q, k, wide, *args, **kwargs)
            out = result[0] if isinstance(result, tuple) else result
            if out is None:  # an engine that did not take the call
                return result
            if dropout:
                mass = step(kernel, q, k, groups, *args, **{**kwargs, "dropout_p": 0.0})
                mass = mass[0] if isinstance(mass, tuple) else mass
            else:
                mass, out = out[..., width:], out[..., :width]
                result = (out, *result[1:]) if isinstance(result, tuple) else out
            with torch.no_grad():
                rows = mass.transpose(1, 2) if mass.dim() == 4 else mass  # (b, l, h, M)
                self._add(call, q_tok, rows.reshape(-1, *rows.shape[-2:]))
            return result
        return run

    @staticmethod
    def _add(call: Call, q_tok: Tensor, per_row: Tensor) -> None:
        """Add each real query's (h, M) row of group masses into ``call.sums`` (h, M, M)."""
        rows = torch.where(q_tok >= 0, call.group[q_tok.clamp(min=0)], -1)
        keep = rows >= 0
        if call.sums is None:
            call.sums = torch.zeros(per_row.shape[1], len(call.names), len(call.names),
                                    dtype=torch.float64, device=per_row.device)
        call.sums.index_add_(1, rows[keep], per_row[keep].transpose(0, 1).double())

    def listener(self, record: dict) -> None:
        if not self.active:
            self.skipped.append(("", f"a {record['path']} kernel call outside an mmattn "
                                     "attention module"))
            return
        call = self.active[-1]
        if call.skip is not None or call.tally is None:
            return
        try:
            with torch.no_grad():
                call.tally.feed(record, self.block)
        except Unsupported as why:
            call.skip = str(why)

    def install(self, model: nn.Module) -> list:
        """Put the hooks on; returns the functions that take them off."""
        def pre(name, signature, module, args, kwargs):
            self.tokens.append(next((value for value in (*args, *kwargs.values())
                                     if isinstance(value, Tokens)), None))
            if signature is not None:  # an mmattn attention module
                try:
                    bound = signature.bind(*args, **kwargs).arguments
                except TypeError:  # the forward itself will say what is wrong
                    bound = {"key": False}
                query, key = bound.get("query"), bound.get("key")
                self.open(name, module, query, key is None or key is query,
                          bound.get("key_padding_mask"), cached=bound.get("cache") is not None)

        def post(module, args, kwargs, output):
            if isinstance(module, MultiHeadAttention) and self.active:
                self.close()
            if self.tokens:
                self.tokens.pop()

        undo = []
        for name, module in model.named_modules():
            attention = isinstance(module, MultiHeadAttention)
            signature = inspect.signature(module.forward) if attention else None
            undo.append(module.register_forward_pre_hook(
                lambda *a, name=name, signature=signature: pre(name, signature, *a),
                with_kwargs=True).remove)
            undo.append(module.register_forward_hook(post, with_kwargs=True,
                                                     always_call=True).remove)
            if attention:
                module.attend_rows = self._rows_wrapper(name, module, module.attend_rows)
                if self.by is not None:
                    module._step = self._step_wrapper(module, module._step)
                undo.append(lambda m=module: [m.__dict__.pop(a, None)
                                              for a in ("attend_rows", "_step")])
        return undo

    def _rows_wrapper(self, name: str, module: MultiHeadAttention, rows):
        def attend_rows(qv, q_off, kv, k_off, vv, *, self_attention=False, **kwargs):
            self.open(name, module, qv, bool(self_attention), None, offsets=q_off)
            try:
                return rows(qv, q_off, kv, k_off, vv, self_attention=self_attention, **kwargs)
            finally:
                self.close()

        return attend_rows

