"""``torch.fx.symbolic_trace``: our attention modules are leaves, as ``torch.nn``'s are.

Axis key: none (no tensor is touched here).

FX's default tracer keeps a module as one ``call_module`` node when its class lives in
``torch.nn``; any other module is traced through, and our ``forward`` (input checks, masks
merged in Python, einops) cannot run on a ``Proxy``. So ``forward`` asks
:func:`fx_tracer` first and, under tracing, records itself with :func:`leaf_call`: one
``call_module`` node with the call's arguments, exactly what the tracer records for
``nn.MultiheadAttention``. The traced ``GraphModule`` calls the module itself, so it
computes what eager does; any ``Tracer`` subclass (torchvision's ``create_feature_extractor``,
FX quantization) sees the same node. See docs/decisions.md.
"""

from __future__ import annotations

from typing import Any

from torch import fx, nn

#: The attribute under which a traced root holds itself (see :func:`leaf_call`).
ROOT_NAME = "_fx_root"
#: ``module._fx_root`` is the module: a ``GraphModule`` traced from it copies it in there.
FX_ROOT = property(lambda self: self, doc="The module itself (the leaf of its own FX graph).")


def fx_tracer(*values: object) -> fx.Tracer | None:
    """The FX tracer of the first ``Proxy`` among ``values`` (None outside FX tracing)."""
    for value in values:
        if isinstance(value, fx.Proxy):
            return value.tracer
    return None


def fx_leaf(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> fx.Proxy | None:
    """Under FX tracing (a ``Proxy`` among the arguments): :func:`leaf_call`; else None.

    ``forward`` starts with it, so the module is a leaf wherever a Proxy reaches it (our
    blocks too: their ``Tokens`` input is a placeholder Proxy when traced).
    """
    tracer = fx_tracer(*args, *kwargs.values())
    return None if tracer is None else leaf_call(module, tracer, args, kwargs)


def leaf_call(
    module: nn.Module, tracer: fx.Tracer, args: tuple, kwargs: dict[str, Any]
) -> fx.Proxy:
    """Record ``module(*args, **kwargs)`` as one ``call_module`` node and return its Proxy.

    The traced root itself (``symbolic_trace(MultiHeadAttention(...))``) has no path in its
    own hierarchy; its node calls ``_fx_root``, which ``GraphModule`` copies from the root
    (the module itself), so the graph module holds it as a submodule.
    """
    state = kwargs.get("cache")
    if state is not None and not isinstance(state, fx.Proxy):
        raise TypeError(
            f"torch.fx cannot trace {type(module).__name__} with cache=: a cache is state "
            "updated in place; trace the call without it"
        )
    if kwargs.get("cache", 0) is None:
        del kwargs["cache"]
    path = ROOT_NAME if module is tracer.root else tracer.path_of_module(module)
    return tracer.create_proxy("call_module", path, args, kwargs)

