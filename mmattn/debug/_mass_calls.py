"""The machinery of :func:`mmattn.debug.attention_mass` and :func:`~mmattn.debug.top_keys`:
recording the attention calls of one run, and measuring them.

Axis key: ``b`` items, ``h`` heads, ``l`` positions, ``t`` flat tokens, ``d`` model width,
``e`` head width, ``M`` groups.

A :class:`Session` puts hooks on the model: every module's forward pre-hook notes the
:class:`~mmattn.tokens.Tokens` it was given (an attention call finds the Tokens, and their
modality facts, of its block), and every mmattn attention module's forward (and its
``attend_rows``, which blocks call for packed Tokens) opens a :class:`Call`.

The mass of a call is an attention call (DESIGN, "One implementation of each kernel's
math") with the keys' one-hot groups as values (the same for every key head): a query's
output row is its weight on each group, from the call's own kernel, engine and score
modifiers; a sink's share and that of appended ``bias_k`` / zero keys go nowhere (their
group columns are zero), dead rows give zero. No weight is formed here.

One pass where it can: the attention step (``_attention``, head-split q, k, v) of a padded
call without dropout takes ``[v | groups]`` per key head (M <= e columns more; the kernels
take a value width of its own, :func:`mmattn.kernels.dense.one_width`); its first ``e``
output columns go on to ``out_proj`` (those of the narrow call within float rounding), the
rest are the mass. Elsewhere (packed calls, dropout, more groups than ``e``, a layer that
attends outside ``_attention``, a kernel that refuses the width) the module runs the call
again when it returns: the recorded ``q_proj`` / ``k_proj`` outputs, the groups as values
(``e`` at a time, zero columns after), eval mode, ``bias_v`` zero.

Top keys: a kernel path listener hands each kernel report of the call back to its kernel
(:func:`mmattn.kernels._report_tiles.weight_tiles`) and keeps the best keys of each row
(:class:`~._mass_tally.Tally`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from mmattn._helpers import exporting
from mmattn._jagged import contiguous_parts, is_jagged, jagged
from mmattn.attention.mha import MultiHeadAttention
from mmattn.debug._mass_groups import Layout, token_groups
from mmattn.debug._mass_tally import Tally, Unsupported
from mmattn.tokens import Tokens


@dataclass
class Call:
    """One attention module call: its name, tokens and groups, how to run it again (or why
    it is skipped), and what was measured: ``sums`` (h, M, M) or the top keys' ``tally``."""

    name: str
    module: nn.Module | None = None
    layout: Layout | None = None
    names: list[str] = field(default_factory=list)
    group: Tensor | None = None  # (t,) the group of every token, -1: none
    rerun: Callable[[Tensor], Any] | None = None  # the call on other (t, d) input rows
    projected: dict[str, list[Tensor]] = field(default_factory=lambda: {"q": [], "k": []})
    sums: Tensor | None = None
    tally: Tally | None = None
    skip: str | None = None
    one_pass: bool = False  # the attention step may take the groups with the values
    steps: int = 0  # attention steps of the call (one pass counts only with exactly one)


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


class Session:
    """Hooks, the Tokens stack and the calls of one attention_mass / top_keys run."""

    def __init__(self, by: str | None, topk: int | None, block: int | None) -> None:
        self.by, self.topk, self.block = by, topk, block
        self.calls: list[Call] = []
        self.skipped: list[tuple[str, str]] = []
        self.tokens: list[Tokens | None] = []
        self.active: list[Call] = []
        self.replaying = False
        self._layouts: dict[int, tuple[Tokens, Layout]] = {}  # the Tokens kept: ids stay valid
        self._group_cache: dict[tuple, tuple[dict, Any]] = {}

    # -------------------------------------------------------------- opening calls

    def open(self, name: str, module: nn.Module, query: Any, self_attention: bool,
             key_padding_mask: Tensor | None, rerun: Callable[[Any], Any] | None,
             offsets: Tensor | None = None, cached: bool = False) -> None:
        call = Call(name, module)
        self.active.append(call)
        try:
            self._prepare(call, module, query, self_attention, key_padding_mask, offsets, cached)
        except Unsupported as why:
            call.skip = str(why)
            return
        # a padded query: its layout is padded too (the Tokens matched, or moved there)
        call.one_pass = (self.by is not None and offsets is None and not is_jagged(query)
                         and 0 < len(call.names) <= module.head_dim)
        if rerun is not None:
            as_input, dtype = _input_form(module, query, offsets), query.dtype
            call.rerun = lambda rows: rerun(as_input(rows.to(dtype)))

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
        elif offsets is None and not is_jagged(query):  # packed Tokens a block runs padded
            size = (layout.batch, layout.length)  # (a pattern's block-sparse kernel)
            tokens = next((t for t in reversed(self.tokens) if t is not None and t.is_packed
                           and (self._layout(t).batch, self._layout(t).length) == size), None)
            if tokens is not None:
                packed = self._layout(tokens)
                found = self._groups(tokens, packed)
                layout, groups = _as_padded(packed, found)
        if self.by is not None and groups is None:
            raise Unsupported("its Tokens carry no modality facts (meta['spans'] or "
                              "meta['modality_ids'] with meta['modalities'])")
        call.layout = layout
        call.names, call.group = groups if groups is not None else ([], None)
        if self.topk is not None:
            call.tally = Tally(layout, self.topk)

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

    def close(self, failed: bool = False) -> None:
        call = self.active.pop()
        if call.steps != 1 or failed:
            call.sums = None  # several attention steps (which rows is each?): the second run
        if call.skip is None and self.by is not None and not failed and call.sums is None:
            try:
                with torch.no_grad():
                    call.sums = self._measure(call)
            except Unsupported as why:
                call.skip = str(why)
            except (RuntimeError, ValueError, TypeError) as error:
                call.skip = f"its second run (the groups as values) failed: {error}"
        call.projected = {}
        if call.skip is not None:
            self.skipped.append((call.name, call.skip))
        elif call.sums is not None or (call.tally is not None and call.tally.top is not None):
            self.calls.append(call)
        else:
            self.skipped.append((call.name, "nothing attended"))

    # -------------------------------------------------------------- the mass: a second call

    def _measure(self, call: Call) -> Tensor:
        """(h, M, M) float64: over the real queries of group m, the summed weight on the keys
        of group n, from the module run on the one-hot groups as values."""
        module, group, count = call.module, call.group, len(call.names)
        width, heads = module.head_dim, module.num_heads
        if not call.projected["q"] or call.rerun is None:
            raise Unsupported("the call projected no queries (nothing attended)")
        like = call.projected["q"][0]
        sums = torch.zeros(heads, count, count, dtype=torch.float64, device=like.device)
        for start in range(0, count, width):  # head width e: e groups a run
            stop = min(count, start + width)
            values = _onehot(group, start, stop, width, like.dtype)  # (t, e), exact
            values = values.repeat(1, module.num_kv_heads)  # (t, k e): every key head
            out = self._run_again(call, F.pad(values, (0, module.embed_dim - values.shape[1])))
            per_row = rearrange(out, "... (h e) -> (...) h e", h=heads)[:, :, :stop - start]
            _add_rows(sums[:, :, start:stop], call, per_row)
        return sums

    # -------------------------------------------------------------- the mass: one pass

    def _step_wrapper(self, module: MultiHeadAttention, step):
        """The module's attention step, taking the groups with the values in the first step
        of a call that allows it (:attr:`Call.one_pass`)."""
        def attention(q, k, v, mask, *args, **kwargs):
            call = self.active[-1] if self.active and not self.replaying else None
            if call is None or call.module is not module:
                return step(q, k, v, mask, *args, **kwargs)
            call.steps += 1
            wide = None
            if call.one_pass and call.steps == 1 and kwargs.get("dropout_p", 1.0) == 0:
                wide = _with_groups(call, q, v)
            if wide is None:
                return step(q, k, v, mask, *args, **kwargs)
            try:
                out, weights = step(q, k, wide, mask, *args, **kwargs)
            except (RuntimeError, ValueError, TypeError):  # the kernel refused the width
                return step(q, k, v, mask, *args, **kwargs)
            width, count = v.shape[-1], len(call.names)
            with torch.no_grad():
                sums = torch.zeros(q.shape[1], count, count, dtype=torch.float64,
                                   device=q.device)
                per_row = rearrange(out[..., width:], "b h l m -> (b l) h m")
                _add_rows(sums, call, per_row[:call.layout.real.shape[0]])
            call.sums = sums
            return out[..., :width], weights
        return attention

    def _run_again(self, call: Call, rows: Tensor) -> Tensor:
        """The module's input to ``out_proj`` when it runs the call on ``rows`` with the
        recorded q and k projections and the first ``k e`` input columns as v."""
        module = call.module
        queue = {name: list(found) for name, found in call.projected.items()}
        captured: list[Tensor] = []

        def recorded(name: str):
            def forward(x: Tensor) -> Tensor:
                if not queue[name]:
                    raise Unsupported(f"the second run projected {name} more often")
                return queue[name].pop(0)
            return forward

        dtype = call.projected["k"][0].dtype if call.projected["k"] else rows.dtype

        def values(x: Tensor) -> Tensor:  # as k_proj's output (autocast: half precision)
            return x[..., :module.num_kv_heads * module.head_dim].to(dtype)

        def out(x: Tensor) -> Tensor:
            captured.append(x)
            return x

        # projections swapped, eval mode (no dropout), ``bias_v`` zero, no hook of ours
        swaps = {module.q_proj: recorded("q"), module.k_proj: recorded("k"),
                 module.v_proj: values, module.out_proj: out}
        training, bias_v = module.training, getattr(module, "bias_v", None)
        saved = None if bias_v is None else bias_v.data
        for proj, forward in swaps.items():
            proj.forward = forward
        module.training, self.replaying = False, True
        if bias_v is not None:
            bias_v.data = torch.zeros_like(saved)
        try:
            call.rerun(rows)
        finally:
            for proj in swaps:
                del proj.forward
            module.training, self.replaying = training, False
            if bias_v is not None:
                bias_v.data = saved
        if not captured:
            raise Unsupported("the second run did not reach out_proj")
        return captured[-1]

    # -------------------------------------------------------------- reports

    def listener(self, record: dict) -> None:
        if self.replaying:
            return
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
        handles = []
        patched = []

        def push(module, args, kwargs):
            if not self.replaying:
                self.tokens.append(next((value for value in (*args, *kwargs.values())
                                         if isinstance(value, Tokens)), None))

        def pop(module, args, kwargs, output):
            if self.tokens and not self.replaying:
                self.tokens.pop()

        for name, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(push, with_kwargs=True))
            handles.append(module.register_forward_hook(pop, with_kwargs=True, always_call=True))
            if isinstance(module, MultiHeadAttention):
                handles.extend(self._attention_hooks(name, module))
                module.attend_rows = self._rows_wrapper(name, module, module.attend_rows)
                if self.by is not None:
                    module._attention = self._step_wrapper(module, module._attention)
                patched.append(module)
        return [handle.remove for handle in handles] + [
            (lambda m=m: [m.__dict__.pop(a, None) for a in ("attend_rows", "_attention")])
            for m in patched
        ]

    def _record(self, module: nn.Module, name: str):
        def hook(proj, args, output):
            if self.active and not self.replaying and self.active[-1].module is module:
                found = self.active[-1].projected
                if name in found:
                    found[name].append(output)
        return hook

    def _attention_hooks(self, name: str, module: MultiHeadAttention) -> list:
        signature = inspect.signature(module.forward)

        def pre(mod, args, kwargs):
            if self.replaying:
                return
            try:
                bound = signature.bind(*args, **kwargs).arguments
            except TypeError:  # the forward itself will say what is wrong
                self.open(name, mod, None, False, None, None)
                return
            query, key = bound.get("query"), bound.get("key")
            self_attention = key is None or key is query
            self.open(name, mod, query, self_attention, bound.get("key_padding_mask"),
                      _again(mod.forward, signature, bound) if self_attention else None,
                      cached=bound.get("cache") is not None)

        def post(mod, args, kwargs, output):
            if self.active and not self.replaying:
                self.close(failed=output is None)  # None: the forward raised

        hooks = [module.register_forward_pre_hook(pre, with_kwargs=True),
                 module.register_forward_hook(post, with_kwargs=True, always_call=True)]
        if self.by is not None:
            hooks += [module.q_proj.register_forward_hook(self._record(module, "q")),
                      module.k_proj.register_forward_hook(self._record(module, "k"))]
        return hooks

    def _rows_wrapper(self, name: str, module: MultiHeadAttention, rows):
        def attend_rows(qv, q_off, kv, k_off, vv, *, self_attention=False, **kwargs):
            if self.replaying:
                return rows(qv, q_off, kv, k_off, vv, self_attention=self_attention, **kwargs)

            def again(x):
                return rows(x, q_off, x, k_off, x, self_attention=True, **kwargs)

            self.open(name, module, qv, bool(self_attention), None, again, offsets=q_off)
            failed = True
            try:
                out = rows(qv, q_off, kv, k_off, vv, self_attention=self_attention, **kwargs)
                failed = False
                return out
            finally:
                self.close(failed)

        return attend_rows


def _onehot(group: Tensor, start: int, stop: int, width: int, dtype) -> Tensor:
    """(t, width) the one-hot groups ``start .. stop - 1`` of every token (zero columns
    past them, a zero row for a token of no group or another group)."""
    cols = torch.where((group >= start) & (group < stop), group - start, width)
    return F.one_hot(cols, width + 1)[:, :width].to(dtype)


def _add_rows(sums: Tensor, call: Call, per_row: Tensor) -> None:
    """Add each real query's (h, n) row of group masses into ``sums`` (h, M, n)."""
    rows = torch.where(call.layout.real, call.group, -1)
    if per_row.shape[0] != rows.shape[0]:
        raise Unsupported(f"the call's output has {per_row.shape[0]} rows for "
                          f"{rows.shape[0]} tokens")
    keep = rows >= 0
    sums.index_add_(1, rows[keep], per_row[keep].transpose(0, 1).double())


def _with_groups(call: Call, q: Tensor, v: Tensor) -> Tensor | None:
    """v (b, k, j, e) with the keys' one-hot groups as M more columns, (b, k, j, e + M);
    None when q and v are not the call's tokens in order (b items of l positions, then
    ``j - l`` appended keys, which get zero columns)."""
    layout, module = call.layout, call.module
    batch, length = layout.batch, layout.length
    if q.dim() != 4 or v.dim() != 4 or tuple(q.shape[:3]) != (batch, module.num_heads, length) \
            or tuple(v.shape[:2]) != (batch, module.num_kv_heads) or v.shape[2] < length:
        return None
    count = len(call.names)
    groups = _onehot(call.group, 0, count, count, v.dtype).view(batch, 1, length, count)
    groups = F.pad(groups, (0, 0, 0, v.shape[2] - length)).expand(-1, v.shape[1], -1, -1)
    return torch.cat([v, groups], dim=-1)


def _again(forward, signature: inspect.Signature, bound: dict):
    """The forward call of ``bound`` again, on another query (and key and value, which were
    the query or None), without weights."""
    def run(x):
        args = dict(bound)
        for name in ("query", "key", "value"):
            if name == "query" or args.get(name) is bound["query"]:
                args[name] = x
        if "need_weights" in signature.parameters:
            args["need_weights"] = False
        again = signature.bind_partial()
        again.arguments.update(args)
        return forward(*again.args, **again.kwargs)
    return run


def _input_form(module: nn.Module, query: Any, offsets: Tensor | None):
    """(t, d) flat rows -> the form of ``query``: packed rows, jagged, (B, L, d), (L, B, d)
    or (L, d)."""
    if offsets is not None:
        return lambda rows: rows
    if is_jagged(query):
        found = contiguous_parts(query)[1]
        return lambda rows: jagged(rows, found)
    shape = tuple(query.shape[:-1])
    if query.dim() == 3 and not module.batch_first:
        return lambda rows: rows.view(shape[1], shape[0], -1).transpose(0, 1)
    return lambda rows: rows.view(*shape, -1)
