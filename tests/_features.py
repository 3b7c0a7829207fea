"""Skips by feature name, never by version string (STYLE, sixth wave: "features by
signature").

``needs("sdpa_gqa")`` skips a test on a torch without that feature of
:func:`mmattn._features.features`, and says which feature and the torch that brings it. Facts
of the other libraries that only the tests read live here too, detected the same way.
"""

from __future__ import annotations

import pytest

from mmattn._features import SINCE, features


def reason(name: str) -> str:
    """The skip reason for a missing feature of :mod:`mmattn._features`."""
    return f"needs feature {name!r} ({SINCE[name]})"


def needs(name: str) -> pytest.MarkDecorator:
    """Skip unless this torch has the boolean feature ``name`` of :class:`Features`."""
    return pytest.mark.skipif(getattr(features(), name) is not True, reason=reason(name))


def recompile_limits(per_code: int, accumulated: int) -> dict[str, int]:
    """Dynamo's two recompile limits under this torch's names (``recompile_limit`` and
    ``accumulated_recompile_limit``; ``cache_size_limit`` and ``accumulated_cache_size_limit``
    before), for ``torch._dynamo.config.patch(**...)``."""
    name = features().recompile_limit
    return {name: per_code, f"accumulated_{name}": accumulated}


def fsdp2() -> bool:
    """FSDP2 under its public name, ``torch.distributed.fsdp.fully_shard`` (torch 2.6+), which
    runs on the CPU (gloo); torch 2.5's private one (``torch.distributed._composable``)
    requires CUDA streams."""
    import torch.distributed.fsdp as fsdp

    return hasattr(fsdp, "fully_shard")


FSDP2_REASON = "needs feature 'torch.distributed.fsdp.fully_shard' (FSDP2 on the CPU, torch 2.6+)"


def hf_attention_interface(model_class: type) -> bool:
    """Whether a transformers model class sends its attention through transformers'
    ``AttentionInterface`` (which is where mmattn's backend is reached): transformers' own
    check, ``_can_set_attn_implementation`` (T5 has it from transformers 5.x releases after
    5.0; 5.0's T5 computes its attention itself)."""
    check = getattr(model_class, "_can_set_attn_implementation", None)
    return bool(check is not None and check())
