"""``Tokens`` as a pytree node: torch.export, torch.compile, DDP, FSDP and checkpoint see
through it.

Children are ``x``, ``mask`` and every tensor found in ``meta`` (through dicts, lists,
tuples and nested Tokens, e.g. the latent fusion's ``meta["context"]``), and every symbolic
size there (``torch.SymInt``, while torch.export traces); the rest of ``meta`` (numbers,
strings, tuples of them) is the constant context. Rule: meta holds
tensors, Tokens, or Python constants that compare with ``==``; a constant that changes
between calls changes the tree spec (and recompiles a compiled caller). ``Tokens`` is also
a dataclass (``eq=False``) because ``DistributedDataParallel``'s search for output tensors
(``find_unused_parameters=True``) walks dataclasses, not pytrees.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree
from torch import Tensor

#: meta leaves that are children, not context: tensors, and the symbolic sizes that
#: torch.export traces (an image grid, a modality span), so they leave an exported program
#: as its outputs instead of freezing into its output spec.
_CHILDREN = (Tensor, torch.SymInt)


def _flatten_tokens(tokens) -> tuple[list[Any], tuple[Any, ...]]:
    leaves, spec = pytree.tree_flatten(tokens.meta)
    tensor_at = tuple(isinstance(leaf, _CHILDREN) for leaf in leaves)
    consts = tuple(None if is_t else leaf for leaf, is_t in zip(leaves, tensor_at))
    tensors = [leaf for leaf, is_t in zip(leaves, tensor_at) if is_t]
    return [tokens.x, tokens.mask, *tensors], (spec, tensor_at, consts)


def _flatten_tokens_with_keys(tokens) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
    children, context = _flatten_tokens(tokens)
    paths = [
        path for path, leaf in pytree.tree_flatten_with_path(tokens.meta)[0]
        if isinstance(leaf, _CHILDREN)
    ]
    keys = [pytree.GetAttrKey("x"), pytree.GetAttrKey("mask")]
    keys += [pytree.GetAttrKey("meta" + pytree.keystr(path)) for path in paths]
    return list(zip(keys, children)), context


def _unflatten_tokens(children: Sequence[Any], context: tuple[Any, ...]) -> Any:
    spec, tensor_at, consts = context
    tensors = iter(children[2:])
    leaves = [next(tensors) if is_t else c for is_t, c in zip(tensor_at, consts)]
    tokens = object.__new__(_TOKENS[0])  # no checks: children may be fakes or proxies
    tokens.x, tokens.mask = children[0], children[1]
    tokens.meta = pytree.tree_unflatten(leaves, spec)
    return tokens


def _flatten_tokens_spec(tokens, spec) -> list[Any]:
    """The children of ``tokens`` for torch.fx's ``tree_flatten_spec`` (the spec's
    structure is the one :func:`_flatten_tokens` gives)."""
    return _flatten_tokens(tokens)[0]


def _dump_context(context: tuple[Any, ...]) -> str:
    spec, tensor_at, consts = context
    return json.dumps([pytree.treespec_dumps(spec), list(tensor_at), repr(consts)])


def _load_context(dumped: str) -> tuple[Any, ...]:
    spec, tensor_at, consts = json.loads(dumped)
    return pytree.treespec_loads(spec), tuple(tensor_at), ast.literal_eval(consts)


_TOKENS: list[type] = []


def register_tokens(cls: type) -> None:
    """Register ``cls`` (:class:`mmattn.Tokens`) as a pytree node, once."""
    if _TOKENS:
        return
    _TOKENS.append(cls)
    pytree.register_pytree_node(
        cls,
        _flatten_tokens,
        _unflatten_tokens,
        serialized_type_name="mmattn.tokens.Tokens",
        to_dumpable_context=_dump_context,
        from_dumpable_context=_load_context,
        flatten_with_keys_fn=_flatten_tokens_with_keys,
    )
    # an exported program's module flattens its inputs by torch.fx's own table, which
    # torch releases before 2.6 do not fill from the pytree registration above
    fx_pytree.register_pytree_flatten_spec(cls, _flatten_tokens_spec)
