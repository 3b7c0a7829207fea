"""``mmattn.debug.explain``: which attention kernel each call ran, and why not the fused one.

Axis key: ``b`` batch, ``h`` heads, ``i`` query length, ``j`` key length, ``e`` head width.

How it works: :mod:`mmattn.kernels.dense` tells registered listeners about every attention call
(the path taken, the reasons when it is not the fused one, and the tensors). ``explain``
registers a listener, puts forward pre/post hooks on every submodule (and wraps the
``attend_rows`` that blocks call directly for packed Tokens) so that each report is
attributed to the innermost module running, runs one forward, and removes everything again.
For a fused call it asks torch which SDPA backend (flash / efficient / math / cuDNN) these
tensors get; when that is the slow math kernel it asks why: on CUDA torch's own
``can_use_flash_attention(..., debug=True)`` messages, on every device a counterfactual
(would the backend change without the mask, without dropout, in another dtype, with the
backend enabled?).
"""

from __future__ import annotations

import os
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend

from mmattn.kernels import dense as _kernel

Shape = tuple[int, ...]

BACKENDS = {
    SDPBackend.MATH: "math",
    SDPBackend.FLASH_ATTENTION: "flash",
    SDPBackend.EFFICIENT_ATTENTION: "efficient",
    SDPBackend.CUDNN_ATTENTION: "cudnn",
    SDPBackend.OVERRIDEABLE: "overrideable",
}

#: Words for the paths that the kernel (and the variants) report.
PATH_NOTES = {
    "local": "blocked local band: O(L·window), each block through the kernel below",
    "chunked": "additive scores, chunked over queries (no fused kernel exists for them)",
    "torch": "torch.nn.MultiheadAttention's own kernels (not seen by mmattn)",
    "edge": "along the edges: SDDMM scores + CSR SpMM per head, O(E·h) kept for backward",
    "edge-explicit": "along the edges, the explicit gather / index_add twin (O(E·h·e))",
    "block-sparse": "a compiled pattern (SparseMask): only its non-empty tiles, one batched "
                    "call per bucket of query tiles",
    "varlen": "torch's varlen_attn (flash on the real lengths; mmattn.kernels.engines)",
    "flex": "torch's compiled flex_attention with a BlockMask (mmattn.kernels.engines)",
}


@dataclass
class AttentionCall:
    """One attention call seen by :func:`explain`.

    Attributes:
        module: the qualified name of the module that ran it ("" for the model itself).
        cls: that module's class name.
        path: "fused" (``F.scaled_dot_product_attention``), "explicit" (softmax spelled
            out), "local" (blocked band kernel), "chunked" (additive scores), "packed",
            "block-sparse" (a compiled pattern), "varlen" / "flex" (a torch engine chosen by
            :mod:`mmattn.kernels.engines`) or "torch" (an ``nn.MultiheadAttention`` of
            torch's own).
        backend: the SDPA backend torch picks for these tensors ("flash", "efficient",
            "math", "cudnn"), when SDPA runs; None otherwise.
        reasons: why the call did not run a fused kernel (empty when it did).
        q, k, v: shapes of the head-split queries, keys and values, (b, h, i, e), of the
            call that runs: for a local call the blocks ((b·n), h, s, e) against their key
            slabs; for a packed call one bucket (n, h, i_max, e) (one record per bucket).
        mask: the mask that call saw, in words ("none", "bool (2, 1, 1, 7)", ...; the band
            mask of a local call, the real-key mask of a bucket).
        dtype: the queries' dtype.
        device: the queries' device.
        dropout_p: dropout on the weights in this call (0 in eval mode).
        modifiers: the score modifiers of the call (``["sinks", "softcap=30", "alibi"]``;
            :mod:`mmattn.kernels.modifiers`), empty without.
        density: for a "block-sparse" call, the share of tiles it computed (else None).
        engine: on CUDA (or with an engine forced), the engine that ran: "varlen", "flex"
            or "fallback" (mmattn's own kernel, ``path`` says which); None where no engine
            was considered (the CPU).
        engine_reason: why that engine (for "fallback": why no engine took the call).
    """

    module: str
    cls: str
    path: str
    backend: str | None = None
    reasons: list[str] = field(default_factory=list)
    q: Shape = ()
    k: Shape = ()
    v: Shape = ()
    mask: str = "none"
    dtype: str = ""
    device: str = ""
    dropout_p: float = 0.0
    modifiers: list[str] = field(default_factory=list)
    density: float | None = None
    engine: str | None = None
    engine_reason: str = ""

    @property
    def fused(self) -> bool:
        """True when an SDPA kernel other than the math fallback ran."""
        if self.path in ("varlen", "flex"):
            return True
        return self.path in ("fused", "local", "packed") and self.backend not in (None, "math")


class Explanation(list):
    """The list of :class:`AttentionCall` from :func:`explain`; prints as a table.

    Attributes:
        output: what the model's forward returned.
    """

    output: Any = None

    def __str__(self) -> str:
        if not self:
            return "no attention calls"
        rows = [("module", "class", "path", "backend", "q (b,h,i,e)", "mask", "dtype")]
        for call in self:
            rows.append((call.module or "(model)", call.cls, call.path, call.backend or "-",
                         "x".join(map(str, call.q)), call.mask, call.dtype))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        for number, call in enumerate(self):
            if call.modifiers:
                lines.append(f"  [{number}] {call.module or '(model)'}: score modifiers "
                             f"{', '.join(call.modifiers)}")
            for reason in call.reasons:
                lines.append(f"  [{number}] {call.module or '(model)'}: {reason}")
            if call.engine is not None:
                lines.append(f"  [{number}] {call.module or '(model)'}: engine {call.engine}: "
                             f"{call.engine_reason}")
        return "\n".join(lines)


# ---------------------------------------------------------------- backend and reasons


def _gqa(q: Tensor, k: Tensor, groups: int | None = None) -> bool:
    """SDPA's ``enable_gqa`` for a call: from the caller's ``groups`` when it reported them,
    else from the (eager, concrete) head counts."""
    if groups is not None:
        return groups > 1
    return q.dim() == 4 and k.dim() == 4 and q.shape[1] != k.shape[1]


def _choice(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float,
            is_causal: bool, scale: float | None, groups: int | None = None) -> str | None:
    try:
        index = torch._fused_sdp_choice(
            q, k, v, mask, dropout_p, is_causal, scale=scale, enable_gqa=_gqa(q, k, groups),
        )
    except (RuntimeError, TypeError, ValueError):
        return None
    return BACKENDS.get(SDPBackend(index))


def _describe_mask(mask: Tensor | None, is_causal: bool) -> str:
    if mask is None:
        return "causal" if is_causal else "none"
    kind = "bool" if mask.dtype == torch.bool else f"float {str(mask.dtype).split('.')[-1]}"
    text = f"{kind} {tuple(mask.shape)}"
    return text + " + causal" if is_causal else text


def _torch_debug_messages(check, params) -> list[str]:
    """torch's own reasons from ``can_use_*(params, debug=True)``.

    torch emits them as C++ warnings: on stderr, or as Python warnings where its warning
    handler turns them into ones. Both are caught.
    """
    with tempfile.TemporaryFile(mode="w+b") as sink, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saved = os.dup(2)
        try:
            os.dup2(sink.fileno(), 2)
            check(params, True)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        sink.seek(0)
        text = sink.read().decode(errors="replace")
    messages = [str(w.message).strip() for w in caught]
    for line in text.splitlines():
        if "Warning:" in line:
            message = line.split("Warning:", 1)[1].split(" (function", 1)[0].strip()
            messages.append(message)
    return messages


def _math_reasons(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float,
                  is_causal: bool, scale: float | None, groups: int | None = None) -> list[str]:
    """Why torch's SDPA falls back to its math kernel for these tensors, in words."""
    reasons = []
    backends = torch.backends.cuda
    if not (backends.flash_sdp_enabled() or backends.mem_efficient_sdp_enabled()
            or backends.cudnn_sdp_enabled()):
        reasons.append("the flash, efficient and cuDNN SDPA backends are disabled "
                       "(torch.backends.cuda.enable_*_sdp / torch.nn.attention.sdpa_kernel)")
    if q.device.type == "cuda":
        params = backends.SDPAParams(q, k, v, mask, dropout_p, is_causal, _gqa(q, k, groups))
        for name, check in (("flash", backends.can_use_flash_attention),
                            ("efficient", backends.can_use_efficient_attention)):
            for message in _torch_debug_messages(check, params):
                reasons.append(f"{name} unavailable: {message}")
    if mask is not None and _choice(q, k, v, None, dropout_p, is_causal, scale, groups) not in (
        None, "math"
    ):
        reasons.append(f"the mask ({_describe_mask(mask, is_causal)}) rules out the fused "
                       f"kernels on {q.device.type}")
    if dropout_p > 0 and _choice(q, k, v, mask, 0.0, is_causal, scale, groups) not in (
        None, "math"
    ):
        reasons.append(f"dropout_p={dropout_p:g} (training mode) rules out the fused kernels "
                       f"on {q.device.type}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        half = torch.float16 if q.device.type == "cuda" else torch.bfloat16
        cast = [t.to(half) for t in (q, k, v)]
        hmask = mask.to(half) if mask is not None and mask.is_floating_point() else mask
        faster = _choice(*cast, hmask, dropout_p, is_causal, scale, groups)
        if faster not in (None, "math"):
            reasons.append(f"dtype {str(q.dtype).split('.')[-1]}: the {faster} kernel on "
                           f"{q.device.type} needs {str(half).split('.')[-1]}")
    if not reasons:
        reasons.append(f"no fused SDPA kernel on {q.device.type} accepts these inputs")
    return reasons


# ---------------------------------------------------------------- explain


def _record(report: dict, module: str, cls: str) -> AttentionCall:
    q, k, v = report.get("q"), report.get("k"), report.get("v")
    mask, is_causal = report.get("mask"), bool(report.get("is_causal", False))
    dropout_p, scale = float(report.get("dropout_p") or 0.0), report.get("scale")
    path = report["path"]
    reasons = list(report.get("reasons", []))
    groups = report.get("groups")
    backend = None
    if isinstance(q, Tensor) and path in ("fused", "local", "packed") and not reasons:
        # Local and packed calls run SDPA underneath when nothing forces the explicit path;
        # they report the tensors and mask of that call (per block, per bucket).
        backend = _choice(q, k, v, mask, dropout_p, is_causal, scale, groups)
        if backend == "math":
            reasons = _math_reasons(q, k, v, mask, dropout_p, is_causal, scale, groups)
    if path == "explicit" and dropout_p > 0 and any("need_weights" in r for r in reasons):
        reasons.append(f"dropout_p={dropout_p:g} with weights requested: dropout is applied to "
                       "the explicit weights that are returned")
    if path == "fused" and cls == "LocalAttention":
        reasons.append("LocalAttention was given an (L, L) attn_mask: it ran dense O(L²) "
                       "attention with the band AND that mask")
    tensor = q if isinstance(q, Tensor) else None
    density = report.get("density")
    described = _describe_mask(mask if isinstance(mask, Tensor) else None, is_causal)
    if density is not None:
        described = f"block-sparse {report.get('block')}: density {density:.3f}"
    return AttentionCall(
        module=module, cls=cls, path=path, backend=backend, reasons=reasons,
        q=tuple(q.shape) if tensor is not None else (),
        k=tuple(k.shape) if isinstance(k, Tensor) else (),
        v=tuple(v.shape) if isinstance(v, Tensor) else (),
        mask=described,
        dtype=str(tensor.dtype).replace("torch.", "") if tensor is not None else "",
        device=str(tensor.device) if tensor is not None else "",
        dropout_p=dropout_p, density=density,
        modifiers=report["modifiers"].names() if report.get("modifiers") else [],
        engine=report.get("engine"), engine_reason=report.get("engine_reason", ""),
    )


def _is_torch_mha(module: nn.Module) -> bool:
    return isinstance(module, nn.MultiheadAttention) and \
        type(module).__module__.startswith("torch.")


def explain(module: nn.Module, *args: Any, **kwargs: Any) -> Explanation:
    """Run ``module(*args, **kwargs)`` once and say which kernel each attention call ran.

    Every attention call inside (nested modules too) becomes an :class:`AttentionCall`: the
    module that made it, the path (``"fused"`` = ``F.scaled_dot_product_attention``,
    ``"explicit"`` = softmax spelled out, ``"local"`` = the blocked band kernel,
    ``"chunked"`` = additive scores, ``"packed"``, or ``"torch"`` for a
    ``torch.nn.MultiheadAttention`` of torch's own), the SDPA backend torch picks for the
    tensors (``"flash"``, ``"efficient"``, ``"math"``, ``"cudnn"``), shapes, dtype, and
    — when the call did not run a fused kernel — the reasons in words: weights requested,
    the ``MMATTN_FUSED_ATTN`` switch, the mask, dropout, the dtype, a backend disabled or
    unavailable on this device (on CUDA, torch's own ``can_use_flash_attention`` messages).

    The forward runs in the caller's grad mode and training mode (wrap it in
    ``torch.no_grad()`` for inference; in training mode dropout is part of the answer).
    Afterwards the model is as it was: hooks removed, training flags and buffers (e.g.
    BatchNorm statistics) restored, and the random number generators reset, so the dropout
    draws of this forward leave no trace.

    Args:
        module: the model (or a single attention module).
        *args: its forward's positional arguments.
        **kwargs: its forward's keyword arguments.

    Returns:
        An :class:`Explanation`: a list of :class:`AttentionCall` in call order that prints
        as a table (reasons below it), with the forward's result in ``.output``.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.

    Examples:
        >>> from mmattn import MultiHeadAttention
        >>> mha = MultiHeadAttention(8, 2).eval()
        >>> report = explain(mha, torch.randn(1, 5, 8), need_weights=True)
        >>> report[0].path, report[0].q
        ('explicit', (1, 2, 5, 4))
        >>> print(report[0].reasons[0])
        attention weights were requested (need_weights=True)
        >>> explain(mha, torch.randn(1, 5, 8))[0].path
        'fused'
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    calls = Explanation()
    stack: list[tuple[str, nn.Module, int]] = []  # (name, module, calls before it started)
    handles = []

    def listener(report: dict) -> None:
        name, owner, _ = stack[-1] if stack else ("", module, 0)
        calls.append(_record(report, name, type(owner).__name__))

    def make_hooks(name: str):
        def pre_hook(mod: nn.Module, hook_args: tuple) -> None:
            stack.append((name, mod, len(calls)))

        def post_hook(mod: nn.Module, hook_args: tuple, output: Any) -> None:
            if not stack:
                return
            _, _, before = stack.pop()
            if _is_torch_mha(mod) and len(calls) == before and hook_args:
                query = hook_args[0]
                calls.append(AttentionCall(
                    module=name, cls=type(mod).__name__, path="torch",
                    reasons=[PATH_NOTES["torch"] + "; mmattn.replace_attention(model) swaps "
                             "in mmattn's MultiHeadAttention with the same weights"],
                    q=tuple(query.shape), dtype=str(query.dtype).replace("torch.", ""),
                    device=str(query.device),
                ))

        return pre_hook, post_hook

    def attributed(name: str, mod: nn.Module, rows):
        """``mod.attend_rows`` that puts ``mod`` on the stack: blocks call it directly for
        packed Tokens, past the module's forward hooks."""

        def attend_rows(*rows_args: Any, **rows_kwargs: Any) -> Any:
            stack.append((name, mod, len(calls)))
            try:
                return rows(*rows_args, **rows_kwargs)
            finally:
                stack.pop()

        return attend_rows

    training = {name: m.training for name, m in module.named_modules()}
    saved = {name: b.detach().clone() for name, b in module.named_buffers()}
    devices = sorted({p.device.index or 0 for p in module.parameters() if p.is_cuda})
    patched: list[nn.Module] = []
    remove = _kernel.add_listener(listener)
    try:
        for name, sub in module.named_modules():
            pre_hook, post_hook = make_hooks(name)
            handles.append(sub.register_forward_pre_hook(pre_hook))
            handles.append(sub.register_forward_hook(post_hook, always_call=True))
            if callable(getattr(type(sub), "attend_rows", None)) and \
                    "attend_rows" not in vars(sub):
                sub.attend_rows = attributed(name, sub, sub.attend_rows)
                patched.append(sub)
        with torch.random.fork_rng(devices=devices):  # dropout draws leave no trace
            calls.output = module(*args, **kwargs)
    finally:
        remove()
        for handle in handles:
            handle.remove()
        for sub in patched:
            del sub.attend_rows
        with torch.no_grad():
            for name, buffer in module.named_buffers():
                if name in saved and buffer.shape == saved[name].shape:
                    buffer.copy_(saved[name])
        for name, sub in module.named_modules():
            sub.training = training.get(name, sub.training)
    return calls
