"""Context parallelism for pattern calls: the query tiles of a SparseMask spread over ranks.

Axis key: ``b`` batch, ``h`` query heads, ``k`` key/value heads, ``r`` this rank's rows,
``u`` its frame rows, ``d`` model width, ``e``/``f`` key/value head width, ``c`` columns
of the exchanged rows.

A :class:`~mmattn.distributed.ContextPlan` (once per mask) gives each rank whole query tiles,
balanced by their non-empty tiles. One attention call on a rank::

    its rows (1, r, d) ─project─▶ q, k, v ─rotary at the rows' positions─▶
    k, v (and padding flags) ─all_to_all_single of exactly the rows others need─▶ received
    frame = its rows and the received rows, in their tiles, in sequence order  (1, u, ...)
    block-sparse kernel: its query tiles x their key tiles, ALiBi and causal at the true
    positions ─▶ (1, r, d) after out_proj

The exchange is one ``all_to_all_single`` (:func:`~mmattn.distributed._halo.exchange_rows`),
whose backward is the reverse all-to-all: the key/value gradients of the rows a rank sent
come back to it and add to its own. A row is never split between ranks: all its keys
arrive before it is attended, so its softmax, sink and all
(:func:`~mmattn.kernels.modifiers.join_sink` inside the kernel), is the one-process
softmax, and no partial results cross ranks.

Each call of the wrapper first agrees (:mod:`mmattn.distributed._agree`): every rank's input
errors, a fingerprint of its mask, whether any rank pads and ``is_causal``, so bad input
raises the same ValueError on every rank instead of a hang.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn

from mmattn.attention._modifiers import score_modifiers
from mmattn.attention._positions import rotate
from mmattn.attention._sparse import takes_sparse_mask
from mmattn.attention.mha import MultiHeadAttention
from mmattn.blocks._pattern import BLOCK_SIZE, compile_for, run_blocks
from mmattn.blocks.transformer import Encoder, TransformerBlock
from mmattn.distributed import _halo
from mmattn.distributed._agree import agree, require_group
from mmattn.distributed._context_checks import attention_error, tokens_error
from mmattn.distributed.context_plan import ContextPlan, build_plan
from mmattn.distributed.sequence_parallel import _heads, refuse_extra_keys
from mmattn.kernels import block_sparse
from mmattn.patterns import SparseMask
from mmattn.tokens import Tokens

__all__ = ["ContextParallel", "context_plan"]

#: What the agreement compares: the plan's fingerprint (8), padding, causal, positions.
_FACTS = 11


def context_plan(mask: SparseMask, group=None) -> ContextPlan:
    """The :class:`~mmattn.distributed.ContextPlan` of ``mask`` on this rank of ``group``
    (built once per mask and number of ranks, then cached on the mask).

    Every rank builds it from the same mask, without communicating: compile the mask on
    every rank from the full-sequence Tokens (their meta is small integers), e.g.
    ``pattern.compile(tokens)``.

    Raises:
        TypeError: ``mask`` is not a SparseMask.
        RuntimeError: no initialised process group.
    """
    if not isinstance(mask, SparseMask):
        raise TypeError(f"mask must be a mmattn.patterns.SparseMask (pattern.compile(tokens)), "
                        f"got {type(mask).__name__}")
    dist = require_group("context_plan")
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    return mask.cached(("context", ranks, rank), lambda: build_plan(mask, ranks, rank))


class ContextParallel(nn.Module):
    r"""Run pattern attention on a sequence whose query tiles are spread over ranks.

    Wraps a :class:`~mmattn.MultiHeadAttention` called with ``attn_mask=SparseMask``, or a
    :class:`~mmattn.TransformerBlock` / :class:`~mmattn.Encoder` built with ``pattern=``
    (or called with a SparseMask). Every rank of ``group`` holds the same mask for the whole
    sequence and its own rows of it (``plan.scatter``); the result is its rows of what the
    wrapped module computes on the whole sequence, within float rounding. Backward gives
    each rank the gradient of its rows (key/value gradients come back from the ranks that
    used them) and its share of the parameter gradients: sum them over ranks
    (:func:`~mmattn.distributed.all_reduce_grads`).

    The forward contract is the wrapped module's, on this rank's rows, with the plan (or the
    mask) as ``attn_mask``:

    - attention: ``cp(x, attn_mask=plan, key_padding_mask=None, is_causal=False,
      positions=None)`` -> ``(out, None)``;
    - block or Encoder: ``cp(tokens, attn_mask=plan)`` -> Tokens. With ``pattern=`` the
      plan comes from :meth:`plan` on the full-sequence Tokens (the pattern, with the
      block's causal rule, compiled on them).

    Per attention call: one small all-gather (agreement; once per call of this wrapper),
    one ``all_to_all_single`` of exactly the key/value rows other ranks' queries need, and
    its reverse in backward. Every rank must call forward and backward.

    Args:
        module: a MultiHeadAttention that takes a SparseMask, a TransformerBlock or an
            Encoder of such blocks; its parameters are used as they are (not copied).
        group: the process group (None = the default group).

    Shape:
        - x: (1, R, D) this rank's rows (``plan.scatter(x)``), batch_first, or (R, 1, D)
        - key_padding_mask: (1, R) bool, True = padding; positions: (1, R) or (1, R, A)
          per-token positions for the position module (default: the rows' own positions)
        - tokens: Tokens with x (1, R, D) (``plan.scatter(tokens)``)
        - returns: (1, R, D) and None, or Tokens with x (1, R, D)

    Raises:
        TypeError: ``module`` is none of these, or a layer that takes no SparseMask.
        ValueError: bad input on any rank (the same error on every rank): rows that are not
            this rank's, ranks holding different masks, ``need_weights``, another key or
            value, ``add_bias_kv``/``add_zero_attn``, a position module without positions.
        RuntimeError: no initialised process group.

    Examples:
        >>> attn = MultiHeadAttention(512, 8)
        >>> cp = ContextParallel(attn)  # doctest: +SKIP
        >>> mask = pattern.compile(tokens)  # the same mask on every rank # doctest: +SKIP
        >>> plan = cp.plan(mask)  # doctest: +SKIP
        >>> out, _ = cp(plan.scatter(tokens.x), attn_mask=plan)  # doctest: +SKIP
        >>> full = plan.gather(out)  # == attn(tokens.x, attn_mask=mask)[0] # doctest: +SKIP
    """

    def __init__(self, module: nn.Module, group=None) -> None:
        super().__init__()
        blocks = _blocks_of(module)
        for attn in [module] if blocks is None else [block.attn for block in blocks]:
            if not isinstance(attn, MultiHeadAttention) or not takes_sparse_mask(attn):
                raise TypeError(
                    "ContextParallel wraps a MultiHeadAttention that takes a SparseMask, or a "
                    "TransformerBlock / Encoder whose attention does; got "
                    f"{type(attn).__name__} (a layer with its own geometry: use "
                    "SequenceParallel, or a pattern on MultiHeadAttention)"
                )
            refuse_extra_keys(attn, "ContextParallel", "rank's rows")
        self.module = module
        self.group = group

    def extra_repr(self) -> str:
        return "group=default" if self.group is None else f"group={self.group}"

    def plan(self, source: SparseMask | Tokens | ContextPlan,
             block_size: int = BLOCK_SIZE) -> ContextPlan:
        """The plan of a call: of a SparseMask, or (blocks built with ``pattern=``) of the
        pattern compiled on the full-sequence Tokens ``source`` with tiles of
        ``block_size`` (the blocks' own by default; a query tile is the unit of dispatch,
        so short sequences on many ranks want smaller ones). Every rank compiles the same
        mask from the same meta; the plan is cached on the mask."""
        if isinstance(source, ContextPlan):
            return source
        if isinstance(source, Tokens):
            pattern = getattr(self.module, "pattern", None)
            if pattern is None:
                raise ValueError(
                    "ContextParallel.plan(tokens) compiles the module's pattern=; this "
                    f"{type(self.module).__name__} has none: give the SparseMask instead"
                )
            source = compile_for(pattern, source, None, self._blocks()[0].causal,
                                 block_size)
        return context_plan(source, self.group)

    def _blocks(self) -> list[TransformerBlock] | None:
        return _blocks_of(self.module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """This rank's rows of the wrapped module's call; see the class docstring."""
        dist = require_group("ContextParallel")
        if self._blocks() is None:
            return self._attention_call(dist, *args, **kwargs)
        return self._blocks_call(dist, *args, **kwargs)

    # ------------------------------------------------------------------ attention

    def _attention_call(self, dist, query: Tensor, key: Tensor | None = None,
                        value: Tensor | None = None, key_padding_mask: Tensor | None = None,
                        need_weights: bool = False, attn_mask: Any = None,
                        average_attn_weights: bool = True, is_causal: bool = False, *,
                        positions: Tensor | None = None) -> tuple[Tensor, None]:
        attn, group = self.module, self.group
        error, plan = self._checked_plan(attn_mask, dist)
        error = error or attention_error(attn, plan, query, key, value, key_padding_mask,
                                         need_weights, positions)
        padded = key_padding_mask is not None
        any_padding = self._agree(error, plan, padded, is_causal, positions is not None)
        x = query if attn.batch_first else rearrange(query, "r b d -> b r d")
        real = None
        if any_padding:
            real = torch.ones_like(x[..., 0], dtype=torch.bool) if not padded else \
                ~key_padding_mask
        out = attend_rows(attn, plan, x, real, bool(is_causal), positions, group)
        return (out if attn.batch_first else rearrange(out, "b r d -> r b d")), None

    def _checked_plan(self, attn_mask: Any, dist) -> tuple[str, ContextPlan | None]:
        """(error, plan): this rank's plan of ``attn_mask``, or why there is none."""
        if not isinstance(attn_mask, (SparseMask, ContextPlan)):
            return ("ContextParallel needs attn_mask = the ContextPlan (cp.plan(mask)) or the "
                    "full-sequence SparseMask of the call, got "
                    f"{type(attn_mask).__name__}"), None
        ranks, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if isinstance(attn_mask, ContextPlan) and (attn_mask.ranks, attn_mask.rank) != (
                ranks, rank):
            return (f"attn_mask: this ContextPlan is rank {attn_mask.rank}'s of "
                    f"{attn_mask.ranks}, but this is rank {rank} of {ranks}: use "
                    "cp.plan(mask) on every rank"), None
        try:  # a mask that cannot be planned must not leave the other ranks waiting
            return "", self.plan(attn_mask)
        except (ValueError, TypeError, IndexError, RuntimeError) as error:
            return f"attn_mask: this SparseMask cannot be planned: {error}", None

    def _agree(self, error: str, plan: ContextPlan | None, padded: bool, causal: bool,
               positioned: bool) -> bool:
        """Agree with every rank (the same ValueError everywhere on bad input); whether any
        rank pads its keys."""
        facts = [] if error else [*plan.fingerprint, int(padded), int(causal),
                                  int(positioned)]
        table = agree(self.group, "ContextParallel", error, facts, _FACTS)
        prints = [tuple(row[:8]) for row in table]
        if len(set(prints)) > 1:
            raise ValueError(
                "ContextParallel: the ranks hold different SparseMasks (compile the same "
                "pattern on the same full-sequence Tokens on every rank); fingerprints "
                + ", ".join(f"rank {r}: {p}" for r, p in enumerate(prints))
            )
        for column, name in ((9, "is_causal"), (10, "whether positions are given")):
            if len({row[column] for row in table}) > 1:
                raise ValueError(f"ContextParallel: ranks disagree on {name}: "
                                 f"{[bool(row[column]) for row in table]}")
        return any(row[8] for row in table)

    # ------------------------------------------------------------------ blocks

    def _blocks_call(self, dist, tokens: Tokens, attn_mask: Any = None) -> Tokens:
        module, group = self.module, self.group
        error, plan = self._checked_plan(attn_mask, dist)
        error = error or tokens_error(module, plan, tokens)
        own = getattr(module, "pattern", None) is not None
        padded = not own and tokens.mask is not None if not error else False
        positioned = not error and tokens.meta.get("positions") is not None
        any_padding = self._agree(error, plan, padded, False, positioned)
        blocks = self._blocks()

        def attend(block: TransformerBlock) -> _BlockAttention:
            return _BlockAttention(block.attn, plan, any_padding, group)

        if isinstance(module, Encoder):
            return run_blocks(module, tokens, plan, own=own, attend=attend)
        return blocks[0]._padded(tokens, plan, own=own, attend=attend(blocks[0]))


class _BlockAttention:
    """A block's attention call (``attn(h, h, h, key_padding_mask=..., attn_mask=plan,
    is_causal=...)``) run context-parallel on the rows of a plan."""

    def __init__(self, attn: MultiHeadAttention, plan: ContextPlan, any_padding: bool,
                 group) -> None:
        self.attn, self.plan, self.any_padding, self.group = attn, plan, any_padding, group

    def __call__(self, query: Tensor, key: Tensor, value: Tensor,
                 key_padding_mask: Tensor | None = None, attn_mask: Any = None,
                 is_causal: bool = False, positions: Tensor | None = None,
                 ) -> tuple[Tensor, None]:
        real = None
        if self.any_padding:
            real = torch.ones_like(query[..., 0], dtype=torch.bool) \
                if key_padding_mask is None else ~key_padding_mask
        return attend_rows(self.attn, self.plan, query, real, is_causal, positions,
                           self.group), None


def _blocks_of(module: nn.Module) -> list[TransformerBlock] | None:
    """The blocks of a block or Encoder (None for an attention layer)."""
    if isinstance(module, Encoder):
        return list(module.blocks)
    if isinstance(module, TransformerBlock):
        return [module]
    return None


# ---------------------------------------------------------------------- one attention call


def attend_rows(attn: MultiHeadAttention, plan: ContextPlan, x: Tensor, real: Tensor | None,
                is_causal: bool, positions: Tensor | None, group) -> Tensor:
    """One attention call on this rank's rows (unchecked; every rank calls it together).

    Shape:
        - x: (1, r, d); real: (1, r) bool (True = may be attended) or None on every rank
        - returns: (1, r, d)
    """
    q, k, v = _heads(attn, x, x, x)  # (1, h, r, e), (1, k, r, e), (1, k, r, f)
    q, k = _position(attn, q, k, plan, positions)
    kv_heads, width = k.shape[1], k.shape[1] * k.shape[3]
    columns = [rearrange(k, "b k r e -> (b r) (k e)"), rearrange(v, "b k r f -> (b r) (k f)")]
    if real is not None:  # padding flags travel with the rows they belong to
        columns.append(real.reshape(-1, 1).to(k.dtype))
    rows = torch.cat(columns, dim=1)
    frame = _exchange(rows, plan, group)  # (u, c)
    k_frame, v_frame = (  # contiguous rows: the kernel views them tile by tile
        rearrange(t.contiguous(), "(b u) (k e) -> b k u e", b=1, k=kv_heads)
        for t in (frame[:, :width], frame[:, width:width + v.shape[1] * v.shape[3]]))
    key_mask = None if real is None else frame[None, :, -1] > 0.5
    mods = score_modifiers(attn)
    if not frame.shape[0]:  # no rows here: nothing to attend; the output still depends on
        # the frame, so that the exchange's backward (a collective) runs on this rank too,
        # and on every parameter, so that each has a (zero) gradient as on the other ranks
        touch = frame.sum() + q.sum() + (0 if mods is None or mods.sinks is None
                                         else mods.sinks.sum())
        out = v_frame.new_zeros(*q.shape[:3], v.shape[3]) + touch * 0
        return attn.out_proj(rearrange(out, "b h r e -> b r (h e)"))
    q_frame = q.new_zeros(*q.shape[:2], frame.shape[0], q.shape[3]).index_copy(
        2, plan.own_index, q)
    out, _ = block_sparse.attend(
        q_frame, k_frame, v_frame, plan.frame.plan(attn.embed_dim), key_mask=key_mask,
        is_causal=is_causal, dropout_p=attn.dropout if attn.training else 0.0,
        groups=q.shape[1] // kv_heads, modifiers=mods,
        positions=plan.frame_positions,
    )
    out = out.index_select(2, plan.own_index)
    return attn.out_proj(rearrange(out, "b h r e -> b r (h e)"))


def _exchange(rows: Tensor, plan: ContextPlan, group) -> Tensor:
    """This rank's frame (u, c): its own rows and the rows the others send it, in their
    tiles (rows nobody needs stay zero). Differentiable both ways (the all-to-all's
    backward returns the received rows' gradients to their owners)."""
    send = rows.index_select(0, plan.send_index)
    received = _halo.exchange_rows(send, plan.send_splits, plan.recv_splits, group=group)
    frame = rows.new_zeros(plan.frame.length, rows.shape[1])
    return frame.index_copy(0, plan.own_index, rows).index_copy(0, plan.recv_index, received)


def _position(attn: MultiHeadAttention, q: Tensor, k: Tensor, plan: ContextPlan,
              positions: Tensor | None) -> tuple[Tensor, Tensor]:
    """``attn.position`` on head-split queries and keys at their positions: the given
    per-token ``positions`` (as the layer's ``forward(positions=)``), or else the rows'
    positions in their items (what the one-process call's offset 0 gives them; every axis
    of a multi-axis module at that position, as its offset does)."""
    if attn.position is None:
        return q, k
    if positions is None:
        positions = plan.positions.to(q.device)[None]
        axes = getattr(attn.position, "num_axes", None)
        if axes is not None:
            positions = positions[..., None].expand(-1, -1, axes)
    return rotate(attn, q, k, positions)
