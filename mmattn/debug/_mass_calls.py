"""The machinery of :func:`mmattn.debug.attention_mass` and :func:`~mmattn.debug.top_keys`:
recording the attention calls of one run, and measuring them.

Axis key: ``b`` items, ``h`` heads, ``l`` positions, ``t`` flat tokens, ``M`` groups.

Hooks note the :class:`~mmattn.tokens.Tokens` every module is given (an attention call finds
the Tokens, and their modality facts, of its block); an mmattn attention module's forward,
or its ``attend_rows`` (blocks call it for packed Tokens), opens a :class:`Call`.

The mass (DESIGN, "One implementation of each kernel's math"): every attention step of a
layer runs through its ``_step``, whatever the kernel or engine; there the values take the
keys' one-hot groups as M more columns (zero for padding and appended keys), and a query's
last M output columns are its weight on each group (a sink's share goes nowhere, dead rows
give zero). With dropout the step runs as it was, then on the groups alone without dropout.

Top keys: a kernel path listener hands each kernel report back to its kernel
(:func:`mmattn.kernels._report_tiles.weight_tiles`) and keeps the best keys of each row.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmattn._helpers import exporting
from mmattn._jagged import contiguous_parts, is_jagged
from mmattn.attention.mha import MultiHeadAttention
from mmattn.debug._mass_groups import Layout, token_groups
from mmattn.debug._mass_tally import Tally, Unsupported
from mmattn.kernels.dense import current_facts
from mmattn.tokens import Tokens


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
        self.by, self.topk, self.block = by, topk, block
        self.calls: list[Call] = []
        self.skipped: list[tuple[str, str]] = []
        self.tokens: list[Tokens | None] = []
        self.active: list[Call] = []
        self._seen: dict[int, tuple[Tokens, Layout, tuple]] = {}  # ids stay valid: kept

    # -------------------------------------------------------------- calls

    def open(self, name: str, module: nn.Module, query: Any, self_attention: bool,
             key_padding_mask: Tensor | None, offsets: Tensor | None = None,
             cached: bool = False) -> None:
        call = Call(name, module)
        self.active.append(call)
        try:
            if cached:
                raise Unsupported("a decoding step (cache=): the keys are the cache, not the "
                                  "tokens")
            if not self_attention:
                raise Unsupported("cross-attention: the keys are another sequence")
            if module._packed_weights_width() is not None:
                raise Unsupported("the keys are projected slots (Linformer), not tokens")
            if exporting():
                raise Unsupported("exporting")
            self._prepare(call, module, query, key_padding_mask, offsets)
        except Unsupported as why:
            call.skip = str(why)

    def _prepare(self, call: Call, module: nn.Module, query: Any,
                 key_padding_mask: Tensor | None, offsets: Tensor | None) -> None:
        if offsets is not None or is_jagged(query):
            layout = Layout.packed(offsets if offsets is not None else
                                   contiguous_parts(query)[1])
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
        found = next((self._facts(t) for t in reversed(self.tokens)
                      if t is not None and layout.fits(self._facts(t)[1])), None)
        if found is not None:
            names, group, real = found[2]
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

    def _facts(self, tokens: Tokens) -> tuple[Tokens, Layout, tuple]:
        """The layout and groups of Tokens, once per Tokens object (blocks share theirs)."""
        if id(tokens) not in self._seen:
            self._seen[id(tokens)] = (tokens, Layout.of(tokens),
                                      token_groups(tokens, self.by or "modality"))
        return self._seen[id(tokens)]

    def close(self, failed: bool = False) -> None:
        call = self.active.pop()
        if call.skip is not None:
            self.skipped.append((call.name, call.skip))
        elif not failed and (call.sums is not None or (call.tally is not None
                                                       and call.tally.top is not None)):
            self.calls.append(call)
        elif not failed:
            self.skipped.append((call.name, "nothing attended"))

    # -------------------------------------------------------------- the mass

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
            groups = F.one_hot(torch.where(keys >= 0, keys, count), count + 1)[:, :count]
            groups = groups.to(v.dtype).view(*v.shape[:1], *v.shape[2:-1], 1, count)
            groups = groups.transpose(1, -2) if v.dim() == 4 else groups  # (b, 1, j, M)
            groups = groups.expand(*v.shape[:-1], count)
            width = v.shape[-1]
            if kwargs.get("dropout_p", 0.0) == 0:
                result = step(kernel, q, k, torch.cat([v, groups], dim=-1), *args, **kwargs)
                out = result[0] if isinstance(result, tuple) else result
                if out is None:  # an engine that did not take the call
                    return result
                mass, out = out[..., width:], out[..., :width]
                result = (out, *result[1:]) if isinstance(result, tuple) else out
            else:  # the mass of the weights before dropout
                result = step(kernel, q, k, v, *args, **kwargs)
                again = {**kwargs, "dropout_p": 0.0}
                if "need_weights" in again:
                    again["need_weights"] = False
                mass = step(kernel, q, k, groups, *args, **again)
                mass = mass[0] if isinstance(mass, tuple) else mass
                if mass is None:
                    return result
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

    # -------------------------------------------------------------- top keys

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

    # -------------------------------------------------------------- hooks

    def install(self, model: nn.Module) -> list:
        """Put the hooks on; returns the functions that take them off."""
        def pre(name, module, args, kwargs):
            self.tokens.append(next((value for value in (*args, *kwargs.values())
                                     if isinstance(value, Tokens)), None))
            if isinstance(module, MultiHeadAttention):
                try:
                    bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
                except TypeError:  # the forward itself will say what is wrong
                    bound = {"key": False}
                query, key = bound.get("query"), bound.get("key")
                self.open(name, module, query, key is None or key is query,
                          bound.get("key_padding_mask"), cached=bound.get("cache") is not None)

        def post(module, args, kwargs, output):
            if isinstance(module, MultiHeadAttention) and self.active:
                self.close(failed=output is None)  # None: the forward raised
            if self.tokens:
                self.tokens.pop()

        undo = []
        for name, module in model.named_modules():
            undo.append(module.register_forward_pre_hook(
                lambda *a, name=name: pre(name, *a), with_kwargs=True).remove)
            undo.append(module.register_forward_hook(post, with_kwargs=True,
                                                     always_call=True).remove)
            if isinstance(module, MultiHeadAttention):
                module.attend_rows = self._rows_wrapper(name, module, module.attend_rows)
                if self.by is not None:
                    module._step = self._step_wrapper(module, module._step)
                undo.append(lambda m=module: [m.__dict__.pop(a, None)
                                              for a in ("attend_rows", "_step")])
        return undo

    def _rows_wrapper(self, name: str, module: MultiHeadAttention, rows):
        def attend_rows(qv, q_off, kv, k_off, vv, *, self_attention=False, **kwargs):
            self.open(name, module, qv, bool(self_attention), None, offsets=q_off)
            failed = True
            try:
                out = rows(qv, q_off, kv, k_off, vv, self_attention=self_attention, **kwargs)
                failed = False
                return out
            finally:
                self.close(failed)

        return attend_rows
