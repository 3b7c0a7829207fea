"""Swap other libraries' attention classes for ours in a built model (for ``replace_*``).

A rule maps a stock class to a builder (``stock module -> our module``, or the string
saying why this module cannot be swapped faithfully) or to such a string for the whole class;
a module that cannot be swapped is left alone with a warning naming it and the reason.
Ties are kept: a module held in several slots is built once and put in every slot.
:func:`adopt` is the builder of the classes we subclass: the new module is an instance of
our subclass holding the stock module's very parameters, buffers, submodules and settings.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping

from torch import nn

from mmattn.integrations._slots import module_slots

__all__ = ["adopt", "swap_modules"]

Rule = Callable[[nn.Module], nn.Module | str] | str

# Registries of hooks on the module itself: not carried over (as replace_attention says).
_CALL_HOOKS = (
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
    "_backward_pre_hooks",
)


def adopt(cls: type[nn.Module], module: nn.Module) -> nn.Module:
    """An instance of ``cls`` (a subclass of ``type(module)``) that takes over ``module``.

    It holds the same parameters, buffers and submodules (so the same tensors: weights,
    device, dtype, ``requires_grad`` and the state-dict keys are kept, and an optimizer
    built before keeps training them), the same attributes and train/eval mode. ``module``
    itself is left as it was; hooks registered on it are not carried over.
    """
    new = cls.__new__(cls)
    state = dict(module.__dict__)
    for key, value in state.items():
        if key.startswith("_") and isinstance(value, (dict, set)):
            state[key] = type(value)(value)  # own registries, so the two modules stay apart
    for key in _CALL_HOOKS:
        if key in state:
            state[key] = type(state[key])()
    new.__dict__.update(state)
    return new


def has_call_hooks(module: nn.Module) -> bool:
    """Whether hooks are registered on ``module`` itself (forward or backward)."""
    return any(getattr(module, key, None) for key in _CALL_HOOKS)


def swap_modules(
    model: nn.Module, rules: Mapping[type, Rule], ours: tuple[type, ...]
) -> int:
    """Apply ``rules`` to every module of ``model`` in place; how many modules were swapped.

    A module of a stock class (or of a subclass that keeps the stock ``forward``) is built by
    its rule; one of our classes (``ours``) is left alone; a subclass that overrides
    ``forward``, and a class whose rule is a reason, are skipped with a warning naming the
    module's path and the reason.
    """
    replaced: dict[int, nn.Module] = {}
    skipped: set[int] = set()
    for parent_name, parent, name, child in module_slots(model):  # every slot: ties kept
        if isinstance(child, ours):
            continue
        stock = next((cls for cls in type(child).__mro__ if cls in rules), None)
        if stock is None:
            continue
        rule = rules[stock]
        reason = None
        if isinstance(rule, str):
            reason = rule
        elif type(child).forward is not stock.forward:
            reason = (
                f"{type(child).__name__} overrides {stock.__module__.split('.')[0]}'s "
                f"{stock.__name__}.forward"
            )
        path = f"{parent_name}.{name}" if parent_name else name
        if reason is not None or id(child) in skipped:
            if id(child) not in skipped:
                skipped.add(id(child))
                warnings.warn(f"replace_attention skipped {path}: {reason}", stacklevel=3)
            continue
        if id(child) not in replaced:
            new = rule(child)
            if isinstance(new, str):  # this module cannot be swapped faithfully
                skipped.add(id(child))
                warnings.warn(f"replace_attention skipped {path}: {new}", stacklevel=3)
                continue
            if has_call_hooks(child):
                warnings.warn(
                    f"replace_attention: the hooks registered on {path} are not carried over "
                    "to the new module; register them again on it",
                    stacklevel=3,
                )
            replaced[id(child)] = new
        setattr(parent, name, replaced[id(child)])
    return len(replaced)
