"""mmattn as an attention backend of Hugging Face transformers.

Axis key: ``b`` batch, ``h`` query heads, ``k`` key/value heads, ``i`` query length, ``j`` key
length, ``e`` head width.

transformers (v5) calls attention through two registries: ``AttentionInterface`` maps a name
to the function every attention module calls, ``AttentionMaskInterface`` maps it to the
function that builds the mask the model hands that function. :func:`register` fills both::

    model.set_attn_implementation("mmattn")
      mask:      create_causal_mask / create_bidirectional_mask / sliding ─▶ attention_mask()
                 (transformers' own sdpa_mask: bool, True = may attend, or None)
      attention: module(q (b, h, i, e), k, v (b, k, j, e), mask, **kwargs) ─▶ attention_forward()
                 ─▶ out (b, i, h, e), weights (b, h, i, j) | None

Both are needed: a name registered without a mask function gets *no* mask at all (causal,
padding and windows are silently dropped), and only the class-wide ``register`` call counts —
writing ``ALL_MASK_ATTENTION_FUNCTIONS[name] = fn`` puts it where transformers never looks.

``attention_forward`` runs mmattn's kernels: the dense one (fused SDPA or its explicit twin,
``MMATTN_FUSED_ATTN``), the O(L·w) blocked band for sliding windows, the bucketed packed
kernel for ``DataCollatorWithFlattening`` batches and the block-sparse one for masks whose
64-tiles are at least half empty (``_hf_patterns``, ``_hf_sparse`` say when each runs).
gpt-oss's sinks (``s_aux``) and Gemma 2's ``softcap`` are score modifiers of the dense, band
and packed kernels, with ``sliding_window``. An argument it cannot honour raises, naming the
model and the argument; nothing is silently ignored.

``import mmattn`` never imports transformers; :func:`register` does, and raises ImportError
naming the ``mmattn[hf]`` extra when it is missing.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn

from mmattn.integrations import _hf_patterns as _patterns
from mmattn.integrations import _hf_sparse as _sparse
from mmattn.integrations import _hf_switch as _switch
from mmattn.kernels import dense as _kernel

#: The name :func:`register` uses by default.
DEFAULT_NAME = "mmattn"

#: Substrings transformers treats specially in a backend name (flash-attention dispatch and
#: padding-free inputs, SDPA capability checks, BlockMask creation).
RESERVED_PARTS = ("flash", "sdpa", "flex_attention")

#: Keyword arguments models pass that do not change the attention numbers (bookkeeping for
#: other layers, for output capture, or packing metadata that the mask already states).
IGNORED_KWARGS = frozenset({
    "position_ids",  # read for packed batches
    "output_attentions",  # read: weights only when asked
    "output_hidden_states", "output_router_logits", "return_dict", "use_cache",
    "cache_position", "past_key_values", "past_key_value", "layer_idx",
    "encoder_hidden_states", "encoder_attention_mask", "num_items_in_batch",
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",
})

#: Arguments that change the numbers in ways mmattn does not implement, and what they are.
UNSUPPORTED_KWARGS = {
    "sinks": "attention sinks in another layout than s_aux's one logit per head (h,)",
    "cache": "a paged KV cache (continuous batching)",
    "head_mask": "a per-head multiplier on the attention weights",
}


def register(name: str = DEFAULT_NAME) -> str:
    """Register mmattn in transformers' attention and mask registries under ``name``.

    Afterwards ``model.set_attn_implementation(name)`` (or ``from_pretrained(...,
    attn_implementation=name)``) runs every attention call of a model, T5's nested stacks
    too (:mod:`._hf_switch`), through :func:`attention_forward`, with masks from
    :func:`attention_mask`. Registering again is harmless.

    Args:
        name: the backend name; names transformers treats specially are refused (containing
            ``"flash"``, ``"sdpa"`` or ``"flex_attention"``; ``"paged|..."``, hub kernels
            ``"org/repo"``, its own fallback ``"eager"``).

    Returns:
        ``name``, to pass to ``set_attn_implementation``.

    Raises:
        ImportError: transformers is not installed (``pip install 'mmattn[hf]'``).
        TypeError: ``name`` is not a string.
        ValueError: ``name`` is empty or reserved by transformers.

    Examples:
        >>> from mmattn.integrations.huggingface import register
        >>> register()  # doctest: +SKIP
        'mmattn'
    """
    _check_name(name)
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as error:
        raise ImportError(
            "mmattn.integrations.huggingface needs transformers; install the extra: "
            "pip install 'mmattn[hf]'"
        ) from error
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    _switch.install()
    return name


def _check_name(name: object) -> None:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    lowered = name.lower()
    reason = None
    if not name.strip():
        reason = "it is empty"
    elif lowered == "eager":
        reason = "'eager' is transformers' built-in fallback"
    elif lowered.startswith("paged|"):
        reason = "transformers routes 'paged|' names to its paged-cache backends"
    elif "/" in name or ":" in name:
        reason = "transformers reads 'org/repo' names as hub kernels to download"
    else:
        for part in RESERVED_PARTS:
            if part in lowered:
                reason = f"transformers gives names containing {part!r} special handling"
    if reason:
        raise ValueError(f"name {name!r} cannot be registered: {reason}; use e.g. 'mmattn'")


def attention_mask(**kwargs: Any) -> Tensor | None:
    """The mask function registered in ``AttentionMaskInterface``: transformers' own SDPA mask.

    A (b, 1, i, j) bool mask, True = may attend, or None where plain ``is_causal`` (or no
    mask) says the same. transformers calls it with keyword arguments (``batch_size``,
    ``q_length``, ``kv_length``, ``mask_function``, ``attention_mask``, ...).
    """
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(**kwargs)


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    position_bias: Tensor | None = None,
    s_aux: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """The function transformers calls for every attention of a model set to mmattn.

    Args:
        module: the calling attention module (its ``is_causal`` is the default causality).
        query, key, value: projected heads; key and value may have fewer heads (GQA: each
            key head serves ``h / k`` query heads, never repeated).
        attention_mask: bool (True = may attend) or float (added), broadcastable to
            (b, h, i, j); None = no mask (causal when ``is_causal``).
        dropout: dropout on the weights (transformers passes 0 in eval mode).
        scaling: score scale; default ``1 / sqrt(e)``.
        is_causal: overrides ``module.is_causal``.
        sliding_window: the module's window (key j visible from query i iff
            ``i - w < j <= i``); runs on the blocked band kernel.
        softcap: Gemma 2's cap: scores become ``softcap · tanh(scores / softcap)``.
        position_bias: T5's additive (1 | b, h, i, j) bias.
        s_aux: gpt-oss's attention sinks, one logit per query head (h,): each softmax gets
            a key of value zero with that score.
        **kwargs: ``output_attentions`` (return the weights), ``position_ids`` (packed
            batches) and bookkeeping that does not change numbers; anything else raises.

    Shape:
        - query: (b, h, i, e); key, value: (b, k, j, e)
        - returns: (b, i, h, e), and the weights (b, h, i, j) when ``output_attentions``, in
          the query's dtype as transformers' eager backend (also under autocast)

    Raises:
        TypeError: an unknown keyword argument; query, key and value not floating tensors
            of one dtype; a mask (or ``position_bias``) that is not a tensor, or neither bool
            nor float in query's dtype or float32 (an integer 0/1 mask is refused, not added);
            ``dropout``, ``scaling`` or ``softcap`` not a number; ``s_aux`` not a float tensor.
        ValueError: an argument mmattn cannot honour (a paged cache, ...), an ``s_aux`` that
            is not one logit per query head or not on query's device;
            tensors not (b, h, l, e), on different devices, of different batch sizes, head
            widths or key/value lengths; head counts that do not divide; a mask that does not
            broadcast to (b, h, i, j); ``dropout`` outside [0, 1); a NaN or infinite
            ``scaling``; ``softcap`` <= 0.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
        >>> layer = nn.Module(); layer.is_causal = True
        >>> out, weights = attention_forward(layer, q, k, v, None)
        >>> tuple(out.shape), weights
        ((2, 5, 4, 8), None)
    """
    _check_kwargs(module, kwargs)
    groups = _check_inputs(
        module, query, key, value, attention_mask, dropout, scaling, softcap, position_bias
    )
    need_weights = bool(kwargs.get("output_attentions"))
    mask = attention_mask
    q_len, k_len = query.shape[-2], key.shape[-2]
    if scaling is None:
        scaling = 1.0 / math.sqrt(query.shape[-1]) if query.shape[-1] else 1.0
    elif type(scaling) is not float:  # an int or a NumPy scalar: SDPA takes a float
        scaling = float(scaling)
    dropout = dropout if type(dropout) is float else float(dropout)
    # Causality as transformers' SDPA backend decides it: the mask wins when there is one.
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_len > 1 and mask is None and causal)
    if causal and k_len > q_len:  # an empty static cache at prefill: drop the unused tail
        key, value = key[:, :, :q_len], value[:, :, :q_len]
        position_bias = None if position_bias is None else position_bias[..., :q_len]
    if position_bias is not None:
        mask = _with_bias(position_bias, mask, causal, q_len, key.shape[-2])
        causal = False
    mods = _patterns.score_modifiers(_who(module), query, s_aux, softcap)
    if not need_weights and mask is not None and mask.dtype == torch.bool and q_len == k_len:
        position_ids = kwargs.get("position_ids")
        if isinstance(position_ids, Tensor) and sliding_window is None:
            lengths = _patterns.packed_lengths(mask, position_ids)
            if lengths is not None:
                out = _patterns.run_packed(
                    query, key, value, lengths, dropout_p=dropout, scale=scaling, groups=groups,
                    modifiers=mods,
                )
                return heads_last(out), None
        if sliding_window is not None:
            pattern = _patterns.window_pattern(mask, int(sliding_window))
            if pattern is not None:
                out = _patterns.run_window(
                    query, key, value, pattern, dropout_p=dropout, scale=scaling, groups=groups,
                    modifiers=mods,
                )
                return heads_last(out), None
    sparse = _sparse.try_sparse(query, key, value, mask, mods, dropout_p=dropout, scale=scaling,
                                need_weights=need_weights, groups=groups)
    if sparse is None and mask is not None and mask.dtype == torch.bool:
        mask = _patterns.key_rows(mask)
    # sparse: a bool mask whose 64-tiles are at least half empty
    out, weights = sparse if sparse is not None else _kernel.attend(
        query, key, value, mask, dropout_p=dropout, is_causal=causal, scale=scaling,
        need_weights=need_weights, groups=groups, modifiers=mods,
    )
    return heads_last(out), None if weights is None else weights.to(query.dtype)


def heads_last(out: Tensor) -> Tensor:
    """(b, h, i, e) → (b, i, h, e), contiguous: the layout transformers expects back."""
    return rearrange(out, "b h i e -> b i h e").contiguous()


def _with_bias(
    bias: Tensor, mask: Tensor | None, causal: bool, q_len: int, k_len: int
) -> Tensor:
    """T5's position bias folded into one additive mask (-inf where not allowed)."""
    if mask is None:
        return _kernel.with_causal(bias, q_len, k_len, bias.device) if causal else bias
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, float("-inf"))
    return bias + mask


def _who(module: nn.Module) -> str:
    """``LlamaAttention (model type 'llama')``: the module and model a message is about."""
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    suffix = f" (model type {model_type!r})" if model_type else ""
    return f"{type(module).__name__}{suffix}"


def _check_kwargs(module: nn.Module, kwargs: dict[str, Any]) -> None:
    for name, value in kwargs.items():
        if name in IGNORED_KWARGS or value is None:
            continue
        if name in UNSUPPORTED_KWARGS:
            raise ValueError(
                f"{_who(module)} passed {name}: {UNSUPPORTED_KWARGS[name]}, which the mmattn "
                f"attention backend does not implement; use attn_implementation='eager'"
            )
        raise TypeError(
            f"{_who(module)} passed the keyword argument {name}={_short(value)}, which the "
            f"mmattn attention backend does not know; rather than ignore something that may "
            f"change the result it refuses (use attn_implementation='eager', or report it)"
        )


def _short(value: object) -> str:
    if isinstance(value, Tensor):
        return f"<tensor {tuple(value.shape)} {value.dtype}>"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_inputs(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: object,
    dropout: object, scaling: object, softcap: object, position_bias: object,
) -> int:
    """Check one call's tensors and numbers; return query heads per key head.

    The checks read only shapes, dtypes and devices (no pass over any tensor). What
    transformers sends (bool or float masks, float numbers) passes one combined test, a few
    microseconds; anything else goes to :func:`_explain_inputs`, which raises naming the
    model, the argument and expected vs got (or lets an unusual valid input through).
    """
    ok = (
        type(query) is Tensor and type(key) is Tensor and type(value) is Tensor
        and query.dim() == 4 and key.dim() == 4 and value.dim() == 4
        and query.is_floating_point()
    )
    if ok:
        dtype, device = query.dtype, query.device
        batch, heads, q_len, width = query.shape
        kv_batch, kv_heads, k_len, key_width = key.shape
        v_batch, v_heads, v_len, _ = value.shape
        target = (batch, heads, q_len, k_len)
        ok = (
            key.dtype == dtype and value.dtype == dtype and key.device == device
            and value.device == device and kv_batch == batch and v_batch == batch
            and key_width == width and v_len == k_len and kv_heads > 0
            and heads % kv_heads == 0 and v_heads == kv_heads
            and (mask is None or _fits(mask, dtype, device, target))
            and (position_bias is None or _fits(position_bias, dtype, device, target))
            and type(dropout) in (float, int) and 0.0 <= dropout < 1.0
            and (scaling is None or (type(scaling) is float and math.isfinite(scaling)))
            and (softcap is None or (type(softcap) is float and 0.0 < softcap < math.inf))
        )
    if not ok:
        _explain_inputs(
            module, query, key, value, mask, dropout, scaling, softcap, position_bias
        )
    return int(query.shape[1]) // int(key.shape[1])


def _fits(mask: object, dtype: torch.dtype, device: torch.device, target: tuple) -> bool:
    """A bool or float (query's dtype or float32) tensor on ``device`` broadcasting to
    ``target`` (the fast test of :func:`_check_scores_operand`)."""
    if type(mask) is not Tensor or mask.dim() != 4:  # transformers' masks are 4-D
        return False
    kind = mask.dtype
    if kind != torch.bool and kind != dtype and kind != torch.float32:
        return False
    b, h, i, j = mask.shape
    return (
        j == target[3] and (i == 1 or i == target[2]) and (h == 1 or h == target[1])
        and (b == 1 or b == target[0]) and mask.device == device
    )


def _explain_inputs(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: object,
    dropout: object, scaling: object, softcap: object, position_bias: object,
) -> None:
    """Raise for the first argument of one call that is wrong; return if none is."""
    who = _who(module)
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{who}: {name} must be a tensor, got {type(tensor).__name__}")
        if not tensor.is_floating_point():
            raise TypeError(f"{who}: {name} must be floating point, got {tensor.dtype}")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"{who}: query, key and value must be (b, h, l, e), got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(
            f"{who}: query, key and value must share a dtype, got query {query.dtype}, key "
            f"{key.dtype}, value {value.dtype}"
        )
    if key.device != query.device or value.device != query.device:
        raise ValueError(
            f"{who}: query, key and value must be on one device, got query {query.device}, "
            f"key {key.device}, value {value.device}"
        )
    batch, heads, q_len, width = query.shape
    kv_batch, kv_heads, k_len, key_width = key.shape
    if kv_batch != batch or value.shape[0] != batch:
        raise ValueError(
            f"{who}: query, key and value must share the batch size, got query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    if key_width != width:
        raise ValueError(
            f"{who}: key must have the head width of query ({width}), got key "
            f"{tuple(key.shape)} (b, h, j, e)"
        )
    if value.shape[2] != k_len:
        raise ValueError(
            f"{who}: value must have the length of key ({k_len}), got value "
            f"{tuple(value.shape)} (b, h, j, e)"
        )
    if kv_heads == 0 or heads % kv_heads or value.shape[1] != kv_heads:
        raise ValueError(
            f"{who}: key/value heads must divide the query heads, got {heads} query, "
            f"{kv_heads} key and {value.shape[1]} value heads"
        )
    target = (batch, heads, q_len, k_len)
    if mask is not None:
        _check_scores_operand(who, "attention_mask", mask, query, target)
    if position_bias is not None:
        _check_scores_operand(who, "position_bias", position_bias, query, target)
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real):
        raise TypeError(f"{who}: dropout must be a float in [0, 1), got {dropout!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"{who}: dropout must be in [0, 1), got {dropout}")
    for name, number in (("scaling", scaling), ("softcap", softcap)):
        if number is None:
            continue
        if isinstance(number, bool) or not isinstance(number, numbers.Real):
            raise TypeError(f"{who}: {name} must be a number or None, got {number!r}")
        if not math.isfinite(number) or (name == "softcap" and number <= 0):
            expected = "a finite number > 0" if name == "softcap" else "a finite number"
            raise ValueError(f"{who}: {name} must be {expected}, got {number}")


def _check_scores_operand(
    who: str, name: str, mask: object, query: Tensor, target: tuple[int, ...]
) -> None:
    """A mask or bias for the (b, h, i, j) scores: bool (True = may attend) or float (added,
    in query's dtype or float32, as SDPA takes it), broadcastable to ``target``."""
    if not isinstance(mask, Tensor):
        raise TypeError(
            f"{who}: {name} must be a tensor or None, got {type(mask).__name__} (was the "
            "model built for another attention backend?)"
        )
    if mask.dtype != torch.bool and mask.dtype not in (query.dtype, torch.float32):
        hint = (
            "; a 0/1 padding mask must be converted (mask.bool(): True = may attend)"
            if not mask.is_floating_point() else ""
        )
        raise TypeError(
            f"{who}: {name} must be bool (True = may attend) or float in query's dtype "
            f"({query.dtype}) or float32 (added to the scores), got {mask.dtype}{hint}"
        )
    if mask.device != query.device:
        raise ValueError(
            f"{who}: {name} must be on query's device ({query.device}), got {mask.device}"
        )
    if mask.dim() > 4 or not all(m in (1, t) for m, t in zip(mask.shape[::-1], target[::-1])):
        raise ValueError(
            f"{who}: {name} must broadcast to (batch, heads, query length, key length) = "
            f"{target}, got {tuple(mask.shape)}"
        )
