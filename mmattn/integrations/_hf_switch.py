"""``set_attn_implementation`` reaches every nested model, on every transformers 5.x.

transformers before 5.20 (read in 5.17 to 5.19, run on 5.17) skips, when a model switches
backend, each nested ``PreTrainedModel`` whose config is of the top config's class: it takes
it for the top model itself (``ForCausalLM`` around its ``Model``). T5 gives its encoder and
decoder stacks their own *copies* of that config, so
``T5ForConditionalGeneration.set_attn_implementation("mmattn")`` left every attention layer
on the backend the model was built with: 0 calls reached mmattn, on any device. 5.20 and
later compare the configs by identity and reach them. A model built with
``attn_implementation=`` (``from_pretrained``, ``_from_config``) is right on both: the
stacks copy the config after the backend is set.

:func:`install` (called by :func:`~mmattn.integrations.huggingface.register`) wraps
``PreTrainedModel.set_attn_implementation`` once: after transformers' own work, every
nested model with its own config of the top config's class gets the backend transformers
gives a nested model (``get_correct_attn_implementation`` of the requested name). Where
transformers already did so (5.20+) the wrapper changes nothing. A ``dict`` request (one
backend per sub-config) is transformers' alone.
"""

from __future__ import annotations

import functools
from typing import Any

#: Set on the wrapper, so that a second :func:`install` does not wrap it again.
_WRAPPED = "_mmattn_reaches_nested_models"


def install() -> None:
    """Wrap ``PreTrainedModel.set_attn_implementation`` (once per process)."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.set_attn_implementation
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def set_attn_implementation(self, attn_implementation, *args: Any, **kwargs: Any):
        result = original(self, attn_implementation, *args, **kwargs)
        if isinstance(attn_implementation, str):
            reach_nested_models(self, attn_implementation)
        return result

    setattr(set_attn_implementation, _WRAPPED, True)
    PreTrainedModel.set_attn_implementation = set_attn_implementation


def reach_nested_models(model: Any, requested: str) -> list[str]:
    """Give ``requested`` to the nested models that hold a copy of ``model``'s config class.

    Returns the names of the nested models it changed (empty where transformers reached
    them itself).
    """
    from transformers import PreTrainedModel

    changed = []
    for name, sub in model.named_modules():
        if (
            sub is model
            or not isinstance(sub, PreTrainedModel)
            or sub.config is model.config
            or type(sub.config) is not type(model.config)
            or not getattr(sub, "_can_set_attn_implementation", lambda: True)()
        ):
            continue
        correct = getattr(sub, "get_correct_attn_implementation", None)
        target = correct(requested) if correct is not None else requested
        if sub.config._attn_implementation != target:
            # the internal attribute, as transformers itself: the public setter recurses
            sub.config._attn_implementation_internal = target
            changed.append(name)
    return changed
