"""Hook-based debugging aids: shapes, traces, recorded attention maps and gradient norms.

Axis key: ``b`` batch, ``h`` heads, ``i`` query length, ``j`` key length.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch  # noqa: F401 - the Examples blocks run in this namespace
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from mmattn.debug.explain import AttentionCall, Explanation, explain
from mmattn.tokens import Tokens

__all__ = [
    "AttentionCall",
    "Explanation",
    "ShapeRecord",
    "debug_shape",
    "explain",
    "grad_norm_hook",
    "record_attention",
    "record_qkv_grad_norms",
    "trace_shapes",
]

T = TypeVar("T")
Shape = tuple[int, ...]


def _check_module(model: object) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return model


def debug_shape(value: T, name: str = "tensor", *, print_fn: Callable[[str], Any] = print) -> T:
    """Print ``"{name} shape: {shape}"`` and return ``value`` unchanged.

    Drop it into an expression to see a shape without breaking the line: ``Q =
    debug_shape(q_proj(x), "Q")``. Tokens print their ``x`` shape and lengths.

    Args:
        value: a tensor or :class:`~mmattn.tokens.Tokens`.
        name: the label printed before the shape.
        print_fn: where the line goes (default ``print``).

    Returns:
        ``value``, the very same object.

    Raises:
        TypeError: ``value`` is neither a tensor nor Tokens.

    Examples:
        >>> q = debug_shape(torch.zeros(3, 4), "Q")
        Q shape: torch.Size([3, 4])
    """
    if isinstance(value, Tokens):
        print_fn(f"{name} shape: {value.x.shape}, lengths: {value.lengths.tolist()}")
    elif isinstance(value, Tensor):
        print_fn(f"{name} shape: {value.shape}")
    else:
        raise TypeError(f"value must be a torch.Tensor or Tokens, got {type(value).__name__}")
    return value


def _shapes(value: Any) -> list[Shape]:
    """Shapes of every tensor in a nested structure of tensors, Tokens, tuples and dicts."""
    if isinstance(value, Tensor):
        return [tuple(value.shape)]
    if isinstance(value, Tokens):
        return [tuple(value.x.shape)]
    if isinstance(value, (tuple, list)):
        return [s for item in value for s in _shapes(item)]
    if isinstance(value, dict):
        return [s for item in value.values() for s in _shapes(item)]
    return []


@dataclass
class ShapeRecord:
    """One module call seen by :func:`trace_shapes`.

    Attributes:
        name: the module's qualified name in the model ("" for the model itself).
        module: the module's class name.
        inputs: shapes of the tensors (and Tokens) among its positional and keyword inputs.
        outputs: shapes of the tensors (and Tokens) in its output.
        depth: how many traced modules were running around this call (0 for the model).

    Printed (``str``), it is one line of the module tree: indented by ``depth``, the
    module's own name (the last part of ``name``), its class and its shapes.
    """

    name: str
    module: str
    inputs: list[Shape] = field(default_factory=list)
    outputs: list[Shape] = field(default_factory=list)
    depth: int = 0

    def __str__(self) -> str:
        def fmt(shapes: list[Shape]) -> str:
            return ", ".join(str(s) for s in shapes) or "-"

        name = self.name.rsplit(".", 1)[-1] if self.name else "(model)"
        indent = "  " * self.depth
        return f"{indent}{name} [{self.module}]: {fmt(self.inputs)} -> {fmt(self.outputs)}"


@contextmanager
def trace_shapes(
    model: nn.Module,
    *,
    print_fn: Callable[[str], Any] | None = None,
    leaves_only: bool = False,
) -> Iterator[list[ShapeRecord]]:
    """Record the input and output shapes of every module call inside the ``with`` block.

    Records come in the order the calls start, each parent before its children, with its
    nesting ``depth``; printed one per line they form the indented module tree.

    Args:
        model: the model to trace; every submodule gets forward hooks.
        print_fn: at the end of the block, print the tree through it, one line a call
            (e.g. ``print``); None prints nothing.
        leaves_only: trace only modules without children.

    Returns:
        A context manager yielding the list of :class:`ShapeRecord` it fills.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    Examples:
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 2)))
        >>> with trace_shapes(net, print_fn=print) as records:
        ...     _ = net(torch.zeros(3, 4))
        (model) [Sequential]: (3, 4) -> (3, 2)
          0 [Linear]: (3, 4) -> (3, 8)
          1 [Sequential]: (3, 8) -> (3, 2)
            0 [ReLU]: (3, 8) -> (3, 8)
            1 [Linear]: (3, 8) -> (3, 2)
        >>> records[4].name, records[4].depth
        ('1.1', 2)
    """
    _check_module(model)
    records: list[ShapeRecord] = []
    running: list[ShapeRecord] = []
    handles: list[RemovableHandle] = []

    def make_hooks(name: str):
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            record = ShapeRecord(name, type(module).__name__, _shapes(args) + _shapes(kwargs),
                                 depth=len(running))
            records.append(record)
            running.append(record)

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if running:
                running.pop().outputs = _shapes(output)

        return pre_hook, hook

    try:
        for name, module in model.named_modules():
            if leaves_only and next(module.children(), None) is not None:
                continue
            pre_hook, hook = make_hooks(name)
            handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
            handles.append(
                module.register_forward_hook(hook, with_kwargs=True, always_call=True)
            )
        yield records
        if print_fn is not None:
            for record in records:
                print_fn(str(record))
    finally:
        for handle in handles:
            handle.remove()


def _takes_need_weights(module: nn.Module) -> inspect.Signature | None:
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return None
    return signature if "need_weights" in signature.parameters else None


@contextmanager
def record_attention(
    model: nn.Module,
    *,
    average_attn_weights: bool | None = None,
    detach: bool = True,
) -> Iterator[dict[str, list[Tensor]]]:
    """Record the attention weights of every attention module called inside the block.

    An attention module is any submodule whose ``forward`` takes ``need_weights`` (every
    mmattn attention class, ``torch.nn.MultiheadAttention``). Each call is made with
    ``need_weights=True`` so the explicit softmax path runs and returns its weights; the
    weights are stored, and a caller that did not ask for them still receives ``None``. A
    module whose ``forward`` returns a bare tensor unless asked for weights (timm's
    convention) says so with the class attribute ``bare_output_without_weights = True``
    (:class:`mmattn.integrations.timm.Attention` does); its caller then gets the bare tensor,
    so the maps inside timm models are recorded, fused path or not.

    Recording forces the explicit path: inside the block every attention call computes
    softmax(QKᵀ/√e)V step by step instead of the fused SDPA kernel, so it is slower and
    holds the (b, h, i, j) weights in memory, and outputs may differ from a run outside the
    block by rounding. Measured on a 2-block Encoder (width 64, 4 heads, L = 50, CPU):
    float32 1e-7 relative (1e-6 largest absolute), float16 4e-4, bfloat16 3e-3 relative.
    Nothing else changes.

    Args:
        model: the model whose attention modules are recorded (may itself be one).
        average_attn_weights: force averaging over heads (True) or per-head maps (False);
            None keeps what each call asks for.
        detach: store detached weights (default) or keep them in the graph.

    Returns:
        A context manager yielding ``{module_name: [weights of each call]}``; weights are
        (B, L, S) averaged, or (B, H, L, S) per head.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    Examples:
        >>> from mmattn import MultiHeadAttention
        >>> mha = MultiHeadAttention(8, 2)
        >>> with record_attention(mha) as maps:
        ...     out, weights = mha(torch.randn(1, 3, 8))
        >>> weights is None, maps[""][0].shape
        (True, torch.Size([1, 3, 3]))
    """
    _check_module(model)
    maps: dict[str, list[Tensor]] = {}
    handles: list[RemovableHandle] = []

    def make_hooks(name: str, signature: inspect.Signature):
        asked: list[bool] = []  # a stack: whether each pending call asked for weights

        def pre_hook(module: nn.Module, args: tuple, kwargs: dict):
            bound = signature.bind(*args, **kwargs)
            asked.append(bool(bound.arguments.get("need_weights", False)))
            bound.arguments["need_weights"] = True
            if average_attn_weights is not None and "average_attn_weights" in signature.parameters:
                bound.arguments["average_attn_weights"] = average_attn_weights
            return bound.args, bound.kwargs

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any):
            wanted = asked.pop() if asked else True
            if not (isinstance(output, tuple) and len(output) == 2):
                return None
            out, weights = output
            if weights is not None:
                maps.setdefault(name, []).append(weights.detach() if detach else weights)
            if wanted:
                return output
            return out if getattr(module, "bare_output_without_weights", False) else (out, None)

        return pre_hook, hook

    try:
        for name, module in model.named_modules():
            signature = _takes_need_weights(module)
            if signature is None:
                continue
            pre_hook, hook = make_hooks(name, signature)
            handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
            handles.append(module.register_forward_hook(hook, with_kwargs=True))
        yield maps
    finally:
        for handle in handles:
            handle.remove()


def grad_norm_hook(
    tensor: Tensor,
    name: str = "tensor",
    *,
    print_fn: Callable[[str], Any] | None = print,
    store: list[float] | None = None,
) -> RemovableHandle:
    """Register a hook that reports the L2 norm of ``tensor``'s gradient in backward.

    Args:
        tensor: a tensor that requires grad (e.g. the output of ``q_proj``).
        name: the label printed.
        print_fn: where ``"{name} gradient norm: {norm}"`` goes; None prints nothing.
        store: a list each norm is appended to.

    Returns:
        The hook's handle (``handle.remove()`` removes it).

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: ``tensor`` does not require grad.

    Examples:
        >>> q = torch.ones(2, 2, requires_grad=True)
        >>> _ = grad_norm_hook(q, "Q")
        >>> (2 * q).sum().backward()
        Q gradient norm: 4
    """
    if not isinstance(tensor, Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.requires_grad:
        raise ValueError(f"tensor {name!r} must require grad to have a gradient hook")

    def hook(grad: Tensor) -> None:
        norm = float(grad.detach().float().norm())
        if store is not None:
            store.append(norm)
        if print_fn is not None:
            print_fn(f"{name} gradient norm: {norm:.6g}")

    return tensor.register_hook(hook)


@contextmanager
def record_qkv_grad_norms(
    model: nn.Module,
    *,
    names: tuple[str, ...] = ("q_proj", "k_proj", "v_proj"),
    print_fn: Callable[[str], Any] | None = None,
) -> Iterator[dict[str, list[float]]]:
    """Record the gradient norm of every Q/K/V projection output during backward.

    Forward hooks on each submodule whose own name is in ``names`` register a tensor hook
    on its output; in the backward pass that hook records ``‖∂loss/∂output‖₂``. Run both the
    forward and the backward pass inside the ``with`` block.

    Args:
        model: the model; its ``q_proj``/``k_proj``/``v_proj`` submodules are hooked.
        names: the submodule names to hook.
        print_fn: also print ``"{module} gradient norm: {norm}"`` for each.

    Returns:
        A context manager yielding ``{qualified_name: [norm per backward]}``, e.g.
        ``{"blocks.0.attn.q_proj": [0.42]}``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    Examples:
        >>> from mmattn import MultiHeadAttention
        >>> mha = MultiHeadAttention(8, 2)
        >>> with record_qkv_grad_norms(mha) as norms:
        ...     mha(torch.randn(1, 3, 8))[0].sum().backward()
        >>> sorted(norms)
        ['k_proj', 'q_proj', 'v_proj']
    """
    _check_module(model)
    norms: dict[str, list[float]] = {}
    handles: list[RemovableHandle] = []

    def make_hook(name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if isinstance(output, Tensor) and output.requires_grad:
                store = norms.setdefault(name, [])
                grad_norm_hook(output, name, print_fn=print_fn, store=store)

        return hook

    try:
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in names:
                handles.append(module.register_forward_hook(make_hook(name)))
        yield norms
    finally:
        for handle in handles:
            handle.remove()
