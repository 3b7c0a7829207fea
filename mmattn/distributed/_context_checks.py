"""This rank's input errors for :class:`~mmattn.distributed.ContextParallel` (as a message,
"" when fine): raised only after every rank has checked (:mod:`mmattn.distributed._agree`).

Axis key: ``r`` this rank's rows, ``d`` model width, ``a`` position axes.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from mmattn.attention._positions import check_positions
from mmattn.distributed.context_plan import ContextPlan
from mmattn.distributed.sequence_parallel import _local_error
from mmattn.rotary import MultiAxisRotary, RotaryEmbedding
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
        [attn], plan, positions, tuple(rows), query)


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
    positions = tokens.meta.get("positions")
    layers = [block.attn for block in blocks]
    return _rows_error(plan, "tokens.x", tuple(x.shape[:2]), x.device) or _position_error(
        [a for a in layers if a.position is not None or positions is None], plan, positions,
        tuple(x.shape[:2]), x)


def _rows_error(plan: ContextPlan, name: str, rows: tuple[int, int], device) -> str:
    want = (1, plan.rows.shape[0])
    if rows != want:
        return (f"{name}: this rank holds {want[1]} rows of the plan (1, R) = {want} (use "
                f"plan.scatter on the full sequence), got {rows}")
    if plan.mask.device != device:
        return (f"attn_mask: the SparseMask is on device {plan.mask.device} but the rows are "
                f"on {device}; use mask.to(device)")
    return ""


def takes_positions(attn: nn.Module) -> bool:
    """Whether ``attn.position`` places per-token positions (a rotary embedding, one axis
    or several), so that ContextParallel can give it the rows' own."""
    return attn.position is None or isinstance(attn.position, (RotaryEmbedding,
                                                               MultiAxisRotary))


def _position_error(layers: list[nn.Module], plan: ContextPlan, positions: Any,
                    rows: tuple[int, int], like: Tensor) -> str:
    for attn in layers:
        if positions is not None:
            try:  # the layers' own check of forward(positions=), on this rank's rows
                check_positions(attn, positions, rows[0], rows[1], like)
            except (ValueError, TypeError) as error:
                return str(error)
        elif not takes_positions(attn):
            return (f"ContextParallel places position={type(attn.position).__name__} only "
                    "with per-token positions (its rows are not contiguous): give "
                    "positions= (plan.scatter of the full-sequence positions), or use "
                    "position='rotary' or a MultiAxisRotary")
    return ""
