"""This rank's input errors for :class:`~mmattn.distributed.ContextParallel` (as a message,
"" when fine): raised only after every rank has checked (:mod:`mmattn.distributed._agree`).

Axis key: ``r`` this rank's rows, ``d`` model width, ``a`` position axes.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from mmattn.distributed.context_plan import ContextPlan
from mmattn.distributed.sequence_parallel import _local_error
from mmattn.rotary import RotaryEmbedding
from mmattn.tokens import Tokens


def attention_error(attn: nn.Module, plan: ContextPlan, query: Any, key: Any, value: Any,
                    key_padding_mask: Any, need_weights: bool, positions: Any) -> str:
    """The error of an attention call on this rank's rows, or ""."""
    for name, other in (("key", key), ("value", value)):
        if other is not None and other is not query:
            return (f"ContextParallel is self-attention on the plan's rows: {name} must be "
                    "None (or the query itself)")
    error = _local_error(attn, query, query, query, key_padding_mask, need_weights, None,
                         "ContextParallel")
    if error:
        return error
    rows = query.shape[:2] if attn.batch_first else query.shape[1::-1]
    return _rows_error(plan, "query", tuple(rows), query.device) or _position_error(
        [attn], plan, positions, tuple(rows))


def tokens_error(module: nn.Module, plan: ContextPlan, tokens: Any) -> str:
    """The error of a block / Encoder call on this rank's Tokens, or ""."""
    if not isinstance(tokens, Tokens):
        return f"tokens must be mmattn.Tokens (plan.scatter(tokens)), got {type(tokens).__name__}"
    if tokens.is_packed:
        return "tokens: ContextParallel takes padded Tokens (plan.scatter(tokens)), not packed"
    weight = next(module.parameters())
    x = tokens.x
    if x.dim() != 3 or x.shape[-1] != module.embed_dim:
        return (f"tokens.x must be (1, R, {module.embed_dim}) (plan.scatter(tokens)), got "
                f"shape {tuple(x.shape)}")
    if x.device != weight.device or x.dtype != weight.dtype:
        return (f"tokens.x must have the module's dtype {weight.dtype} and device "
                f"{weight.device}, got {x.dtype} on {x.device}")
    blocks = module.blocks if hasattr(module, "blocks") else [module]
    return _rows_error(plan, "tokens.x", tuple(x.shape[:2]), x.device) or _position_error(
        [block.attn for block in blocks], plan, tokens.meta.get("positions"),
        tuple(x.shape[:2]))


def _rows_error(plan: ContextPlan, name: str, rows: tuple[int, int], device) -> str:
    want = (1, plan.rows.shape[0])
    if rows != want:
        return (f"{name}: this rank holds {want[1]} rows of the plan (1, R) = {want} (use "
                f"plan.scatter on the full sequence), got {rows}")
    if plan.mask.device != device:
        return (f"attn_mask: the SparseMask is on device {plan.mask.device} but the rows are "
                f"on {device}; use mask.to(device)")
    return ""


def rotary_ok(attn: nn.Module) -> bool:
    """Whether ContextParallel places ``attn.position`` without given positions (a rotary
    embedding, at the rows' positions in their items)."""
    return attn.position is None or isinstance(attn.position, RotaryEmbedding)


def _position_error(layers: list[nn.Module], plan: ContextPlan, positions: Any,
                    rows: tuple[int, int]) -> str:
    if positions is not None:
        if not isinstance(positions, Tensor) or tuple(positions.shape[:2]) != rows or \
                positions.dim() not in (2, 3):
            got = tuple(positions.shape) if isinstance(positions, Tensor) else \
                type(positions).__name__
            return (f"positions must be this rank's per-token positions (1, R) or (1, R, A) "
                    f"with (1, R) = {rows} (plan.scatter(positions)), got {got}")
        return ""
    for attn in layers:
        if not rotary_ok(attn):
            return (f"ContextParallel places position={type(attn.position).__name__} only "
                    "with per-token positions (its rows are not contiguous): give "
                    "positions= (plan.scatter of the full-sequence positions), or use "
                    "position='rotary'")
    return ""
