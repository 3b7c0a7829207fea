"""Every slot of a model's module tree, ties included (for the ``replace_*`` functions).

``named_children()`` skips a module it has met before in the same parent, so the second
slot of a tied ``nn.ModuleList([a, a])`` would keep the old module; this walks each distinct
parent's ``_modules`` instead.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn


def module_slots(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Module]]:
    """``(parent_path, parent, name, child)`` for every child slot of every distinct parent.

    A module held in several slots (two parents, or twice in one parent) is yielded once per
    slot, so ``setattr(parent, name, new)`` over all of them keeps the tie. The tree is read
    before anything is yielded, so a caller may replace children as it goes.
    """
    slots = [
        (parent_path, parent, name, child)
        for parent_path, parent in model.named_modules()
        for name, child in parent._modules.items()
        if child is not None
    ]
    yield from slots
