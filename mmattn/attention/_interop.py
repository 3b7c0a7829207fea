"""Interop with ``torch.nn.MultiheadAttention`` inside models that somebody else wrote.

Axis key: ``b`` batch, ``i`` query length, ``j`` key length, ``d`` model width.

- :func:`mmattn.integrations.torch.replace_attention` (its own module, which imports the attention
  class) swaps every ``nn.MultiheadAttention`` of a model for ours.
- The helpers here serve :class:`mmattn.MultiHeadAttention`: reading an
  ``nn.MultiheadAttention``'s settings and weights (``from_torch``), rewriting its
  ``state_dict`` keys on load, and running on the NestedTensor that
  ``nn.TransformerEncoder``'s fast path hands its layers.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from mmattn import _checks as checks
from mmattn._helpers import default

if TYPE_CHECKING:
    from mmattn.attention.mha import MultiHeadAttention

__all__: list[str] = []

_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


# ---------------------------------------------------------------------- from_torch


def constructor_kwargs(cls: type, module: nn.MultiheadAttention, extra: dict[str, Any]) -> dict:
    """The keyword arguments that build a ``cls`` with ``module``'s settings.

    ``extra`` holds ``cls``'s own arguments (``window_size`` ...). A setting ``cls`` does not
    take is dropped when the source uses torch's default, else it is an error. The settings
    read from ``module`` include those its weights fix (``num_kv_heads``: one key/value head
    per query head for torch's module) and, for an mmattn source, its ``position`` module.

    Raises:
        TypeError: ``extra`` repeats a setting taken from ``module`` (``num_kv_heads``
            included: the copied key/value weights fix it), names an argument ``cls`` does
            not have, or misses one that ``cls`` requires.
        ValueError: ``module`` uses a setting that ``cls`` does not have.
    """
    weight = module.out_proj.weight
    settings = {
        "embed_dim": module.embed_dim,
        "num_heads": module.num_heads,
        "dropout": module.dropout,
        "bias": module.out_proj.bias is not None,
        "add_bias_kv": module.bias_k is not None,
        "add_zero_attn": bool(module.add_zero_attn),
        "kdim": module.kdim,
        "vdim": module.vdim,
        "batch_first": module.batch_first,
        "device": weight.device,
        "dtype": weight.dtype,
        # fixed by the key/value weights: torch's module has one key/value head per head
        "num_kv_heads": getattr(module, "num_kv_heads", module.num_heads),
    }
    if getattr(module, "position", None) is not None:  # an mmattn source's positions
        settings["position"] = module.position
    taken = sorted(set(extra) & set(settings))
    if taken:
        shown = ", ".join(f"{name}={settings[name]!r}" for name in taken)
        hint = (
            "; grouped-query attention needs key/value projections of another shape than "
            "the source's, so it cannot take over its weights"
            if "num_kv_heads" in taken else ""
        )
        raise TypeError(
            f"{cls.__name__}.from_torch takes {', '.join(taken)} from the source module "
            f"({shown}){hint}; pass only the class's own arguments as keywords"
        )
    neutral = {
        "dropout": 0.0, "bias": True, "add_bias_kv": False, "add_zero_attn": False,
        "kdim": module.embed_dim, "vdim": module.embed_dim, "num_kv_heads": module.num_heads,
    }
    params = inspect.signature(cls.__init__).parameters
    own = [name for name in params if name != "self" and name not in settings]
    unknown = sorted(set(extra) - set(params))
    if unknown and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        raise TypeError(
            f"{cls.__name__}.from_torch got {', '.join(unknown)}, which {cls.__name__} does "
            f"not take; its own arguments are {', '.join(own) or 'none'}"
        )
    kwargs = dict(extra)
    for name, value in settings.items():
        if name in params:
            kwargs[name] = value
        elif name not in neutral or value != neutral[name]:
            raise ValueError(
                f"{cls.__name__} has no {name} argument, but the source module has "
                f"{name}={value!r}"
            )
    required = [
        name for name, p in params.items()
        if name != "self" and p.default is p.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and name not in kwargs
    ]
    if required:
        raise TypeError(
            f"{cls.__name__}.from_torch needs {', '.join(required)} as keyword argument(s), "
            f"e.g. {cls.__name__}.from_torch(m, {required[0]}=...)"
        )
    return kwargs


def copy_weights(source: nn.MultiheadAttention, target: nn.Module) -> None:
    """Copy the q/k/v/out projections (and ``bias_k``/``bias_v``) of ``source`` into ours.

    ``source`` is an ``nn.MultiheadAttention`` (packed or separate layout) or an mmattn
    module; ``target`` an mmattn module of the same sizes. ``requires_grad`` travels along.
    """
    weights, biases = _projections(source)
    pairs = [(getattr(target, n).weight, w) for n, w in zip(_PROJECTIONS, weights)]
    pairs += [
        (getattr(target, n).bias, b) for n, b in zip(_PROJECTIONS, biases) if b is not None
    ]
    pairs.append((target.out_proj.weight, source.out_proj.weight))
    if source.out_proj.bias is not None:
        pairs.append((target.out_proj.bias, source.out_proj.bias))
    if source.bias_k is not None:
        pairs += [(target.bias_k, source.bias_k), (target.bias_v, source.bias_v)]
    with torch.no_grad():
        for param, value in pairs:
            param.copy_(value)
    for param, value in pairs:
        param.requires_grad_(value.requires_grad)


def _projections(
    module: nn.MultiheadAttention,
) -> tuple[tuple[Tensor, ...], tuple[Tensor | None, ...]]:
    """(q, k, v) weights and biases of torch's module (either layout) or of ours."""
    if all(isinstance(getattr(module, n, None), nn.Linear) for n in _PROJECTIONS):
        linears = [getattr(module, n) for n in _PROJECTIONS]
        return tuple(p.weight for p in linears), tuple(p.bias for p in linears)
    if module._qkv_same_embed_dim:
        weights = module.in_proj_weight.chunk(3)
    else:
        weights = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
    bias = module.in_proj_bias
    return tuple(weights), (bias.chunk(3) if bias is not None else (None,) * 3)


def copy_into_torch(source: MultiHeadAttention, target: nn.MultiheadAttention) -> None:
    """Copy our projections into an ``nn.MultiheadAttention`` of the same settings."""
    projections = [getattr(source, n) for n in _PROJECTIONS]
    if target._qkv_same_embed_dim:
        pairs = [(target.in_proj_weight, torch.cat([p.weight for p in projections]))]
        grads = [source.q_proj.weight.requires_grad]
    else:
        pairs = [
            (getattr(target, f"{n}_weight"), p.weight) for n, p in zip(_PROJECTIONS, projections)
        ]
        grads = [p.weight.requires_grad for p in projections]
    if target.in_proj_bias is not None:
        pairs += [
            (target.in_proj_bias, torch.cat([p.bias for p in projections])),
            (target.out_proj.bias, source.out_proj.bias),
        ]
        grads += [source.q_proj.bias.requires_grad, source.out_proj.bias.requires_grad]
    pairs.append((target.out_proj.weight, source.out_proj.weight))
    grads.append(source.out_proj.weight.requires_grad)
    if source.bias_k is not None:
        pairs += [(target.bias_k, source.bias_k), (target.bias_v, source.bias_v)]
        grads += [source.bias_k.requires_grad, source.bias_v.requires_grad]
    with torch.no_grad():
        for param, value in pairs:
            param.copy_(value)
    for (param, _), grad in zip(pairs, grads):
        param.requires_grad_(grad)


# ---------------------------------------------------------------------- state_dict keys


def convert_torch_keys(
    module: MultiHeadAttention, state_dict: dict[str, Any], prefix: str, error_msgs: list[str]
) -> None:
    """Rewrite ``nn.MultiheadAttention``'s keys under ``prefix`` into ours, in place.

    ``in_proj_weight`` (3D, D) and ``in_proj_bias`` (3D,) are cut into ``q_proj``/``k_proj``/
    ``v_proj``; ``q_proj_weight``/``k_proj_weight``/``v_proj_weight`` are renamed. A wrong
    shape is reported as ``nn.Module.load_state_dict`` does, naming the checkpoint's key.
    ``out_proj.*`` and ``bias_k``/``bias_v`` (1, 1, D) share torch's names already. A bias
    key for a module without biases is left alone, so it is reported as unexpected.
    """
    linears = [getattr(module, n) for n in _PROJECTIONS]
    for attr in ("weight", "bias"):
        key = f"{prefix}in_proj_{attr}"
        if key not in state_dict or getattr(linears[0], attr) is None:
            continue
        value = state_dict.pop(key)
        parts = [getattr(p, attr) for p in linears]
        if any(p.shape != parts[0].shape for p in parts):  # kdim / vdim differ: never packed
            shape = " / ".join(str(tuple(p.shape)) for p in parts) + " (q_proj / k_proj / v_proj)"
        else:
            shape = torch.Size([3 * parts[0].shape[0], *parts[0].shape[1:]])
        if value.shape != shape:
            _size_mismatch(state_dict, error_msgs, key, value, shape, prefix, attr, linears)
            continue
        for proj, part in zip(_PROJECTIONS, value.chunk(3)):
            state_dict[f"{prefix}{proj}.{attr}"] = part
    for proj, linear in zip(_PROJECTIONS, linears):
        key = f"{prefix}{proj}_weight"
        if key not in state_dict:
            continue
        value = state_dict.pop(key)
        if value.shape != linear.weight.shape:
            _size_mismatch(state_dict, error_msgs, key, value, linear.weight.shape, prefix,
                           "weight", [linear], (proj,))
            continue
        state_dict[f"{prefix}{proj}.weight"] = value


def _size_mismatch(
    state_dict: dict[str, Any], error_msgs: list[str], key: str, value: Tensor,
    shape: object, prefix: str, attr: str, linears: list[nn.Linear],
    names: tuple[str, ...] = _PROJECTIONS,
) -> None:
    """Report a wrong shape in torch's words; the current values stand in for the key's
    targets, so they are not also reported as missing."""
    error_msgs.append(
        f"size mismatch for {key}: copying a param with shape {value.shape} from checkpoint, "
        f"the shape in current model is {shape}."
    )
    for name, linear in zip(names, linears):
        state_dict.setdefault(f"{prefix}{name}.{attr}", getattr(linear, attr).detach())


# ---------------------------------------------------------------------- nested input


def nested_forward(
    module: MultiHeadAttention,
    query: Tensor,
    key: Tensor | None,
    value: Tensor | None,
    key_padding_mask: Tensor | None,
    need_weights: bool,
    attn_mask: Tensor | None,
    average_attn_weights: bool,
    is_causal: bool,
) -> tuple[Tensor, Tensor | None]:
    """``module.forward`` on nested (B, j*, D) tensors: pad, attend with a key padding mask,
    and return a nested output of the query's layout and lengths.

    This is what ``nn.TransformerEncoder``'s inference fast path hands its layers (a strided
    NestedTensor built by ``torch._nested_tensor_from_mask``); jagged tensors work the same.
    Weights, when asked for, come back padded: (B, L_max, S_max), zero at padding.

    Raises:
        ValueError: key/value not nested like the query, a mask given (the nested lengths
            are the padding), ``batch_first=False``, or lengths/batch sizes that disagree.
    """
    key = default(key, query)
    value = default(value, key)
    if not module.batch_first:
        raise ValueError(
            "nested input needs batch_first=True (a nested tensor is (batch, length*, "
            "embed_dim)), got a module with batch_first=False"
        )
    for name, t in (("key", key), ("value", value)):
        checks.check_tensor(name, t)
        if not t.is_nested:
            raise ValueError(
                f"{name} must be a nested tensor when query is one, got a regular tensor of "
                f"shape {tuple(t.shape)}"
            )
    for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
        if mask is not None:
            raise ValueError(
                f"{name} must be None for nested input (the nested lengths mark the padding); "
                "pass padded tensors to use masks"
            )
    (q, q_lens), (k, k_lens), (v, v_lens) = (_to_padded(n, t) for n, t in
                                             (("query", query), ("key", key), ("value", value)))
    if not len(q_lens) == len(k_lens) == len(v_lens):
        raise ValueError(
            f"query, key and value must have the same batch size, got {len(q_lens)}, "
            f"{len(k_lens)} and {len(v_lens)}"
        )
    if k_lens != v_lens:
        raise ValueError(f"key and value must have the same lengths, got {k_lens} and {v_lens}")
    positions = torch.arange(k.shape[1], device=k.device)
    key_padding = positions >= torch.tensor(k_lens, device=k.device)[:, None]  # (b, j)
    out, weights = module.forward(  # not module(...): the hooks already ran for this call
        q, k, v, key_padding_mask=key_padding, need_weights=need_weights,
        average_attn_weights=average_attn_weights, is_causal=is_causal,
    )
    if weights is not None:
        rows = torch.arange(q.shape[1], device=q.device)
        query_padding = rows >= torch.tensor(q_lens, device=q.device)[:, None]  # (b, i)
        shape = (-1, q.shape[1], 1) if weights.dim() == 3 else (-1, 1, q.shape[1], 1)
        weights = weights.masked_fill(query_padding.view(shape), 0.0)
    return _to_nested(out, q_lens, query.layout), weights


def _to_padded(name: str, t: Tensor) -> tuple[Tensor, list[int]]:
    """Nested (B, j*, D) -> padded (B, max j, D) with zeros, and the B lengths."""
    if t.dim() != 3:
        raise ValueError(
            f"nested {name} must be 3-D (batch, length*, embed_dim), got {t.dim()}-D"
        )
    lengths = [part.shape[0] for part in t.unbind()]
    return t.to_padded_tensor(0.0), lengths


def _to_nested(x: Tensor, lengths: list[int], layout: torch.layout) -> Tensor:
    """Padded (B, L, D) -> nested (B, j*, D) of ``layout`` keeping each sample's length."""
    return torch.nested.as_nested_tensor(
        [x[b, :n] for b, n in enumerate(lengths)], layout=layout
    )
