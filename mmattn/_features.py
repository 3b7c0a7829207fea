"""What the running torch can do, detected once, when mmattn is imported, by signature,
attribute or torch's own dispatcher, never by its version string (DESIGN, sixth wave,
"Versions").

Every fact that more than one path depends on is detected here, once; the engines' own
facts (varlen's and flex's signatures, Triton, the GPU's capability) are detected by
:func:`mmattn.kernels.engines.available`, which reads the shared ones (``flex_cpu``,
``block_mask_seq_lengths``, ``recompile_limit``) from here. A path without its feature falls
back to one that gives the same numbers, or raises :class:`MissingFeature` naming the torch
release that brings it (:func:`require`). Tests skip by feature name
(``tests/_features.py``).

Examples:
    >>> isinstance(features().sdpa_gqa, bool)
    True
    >>> features().recompile_limit in ("recompile_limit", "cache_size_limit")
    True
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

__all__ = ["Features", "MissingFeature", "SINCE", "export_tracing", "features", "require"]

#: The first torch release with each feature: only for the messages that name it (the
#: detection itself never reads a version).
SINCE = {
    "sdpa_gqa": "torch >= 2.5",
    "cpu_flash": "torch >= 2.3",
    "cpu_flash_gqa": "a torch newer than 2.6",
    "is_exporting": "torch >= 2.7",
    "recompile_limit": "torch >= 2.7",
    "flex_cpu": "torch >= 2.6",
    "block_mask_seq_lengths": "torch >= 2.6",
}


class MissingFeature(RuntimeError):
    """A call needs a feature this torch lacks (the message names the torch that has it)."""


@dataclass(frozen=True)
class Features:
    """The facts of this torch that mmattn's paths depend on.

    Attributes:
        sdpa_gqa: ``F.scaled_dot_product_attention`` takes ``enable_gqa`` (grouped-query
            heads without repeating the key heads).
        cpu_flash: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward
            exist (the CPU flash kernel that returns the logsumexp: the fused sinks,
            block-sparse's CPU path).
        cpu_flash_gqa: that kernel takes fewer key heads than query heads. Detected from
            torch's own CPU dispatcher (``torch._fused_sdp_choice``): a torch whose
            dispatcher sends a grouped call to the math kernel has a flash kernel that
            reads every query head's own key head, out of bounds on grouped heads.
        is_exporting: ``torch.compiler.is_exporting`` exists; without it a traced call
            cannot tell ``torch.export`` from ``torch.compile``.
        flex_cpu: inductor has a CPU template for ``flex_attention`` (torch 2.5 lowers a
            CPU flex call to CUDA: "Found no NVIDIA driver").
        block_mask_seq_lengths: ``BlockMask.from_kv_blocks`` takes ``seq_lengths`` (a
            BlockMask whose shape is the sequence's, not a whole number of blocks).
        recompile_limit: the name of dynamo's per-code recompile limit in
            ``torch._dynamo.config`` (``"recompile_limit"``; ``"cache_size_limit"`` before).
    """

    sdpa_gqa: bool
    cpu_flash: bool
    cpu_flash_gqa: bool
    is_exporting: bool
    flex_cpu: bool
    block_mask_seq_lengths: bool
    recompile_limit: str

    def missing(self) -> tuple[str, ...]:
        """The names of the boolean features this torch lacks."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name) is False)


def _sdpa_gqa() -> bool:
    one = torch.zeros(1, 1, 1, 1)
    try:
        F.scaled_dot_product_attention(one, one, one, enable_gqa=False)
    except TypeError:
        return False
    return True


def _cpu_flash() -> bool:
    aten = torch.ops.aten
    return hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
        aten, "_scaled_dot_product_flash_attention_for_cpu_backward")


def _cpu_flash_gqa(sdpa_gqa: bool, cpu_flash: bool) -> bool:
    if not (sdpa_gqa and cpu_flash):
        return False
    from torch.nn.attention import SDPBackend

    q, kv = torch.zeros(1, 2, 4, 8), torch.zeros(1, 1, 4, 8)
    try:
        choice = torch._fused_sdp_choice(q, kv, kv, None, 0.0, False, scale=None,
                                         enable_gqa=True)
    except (RuntimeError, TypeError, AttributeError):
        return False
    return choice == SDPBackend.FLASH_ATTENTION.value


def _block_mask_seq_lengths() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask

        return "seq_lengths" in inspect.signature(BlockMask.from_kv_blocks).parameters
    except (ImportError, AttributeError, ValueError, TypeError):
        return False


def _detect() -> Features:
    sdpa_gqa, cpu_flash = _sdpa_gqa(), _cpu_flash()
    config = torch._dynamo.config
    return Features(
        sdpa_gqa=sdpa_gqa,
        cpu_flash=cpu_flash,
        cpu_flash_gqa=_cpu_flash_gqa(sdpa_gqa, cpu_flash),
        is_exporting=hasattr(torch.compiler, "is_exporting"),
        flex_cpu=importlib.util.find_spec(
            "torch._inductor.codegen.cpp_flex_attention_template") is not None,
        block_mask_seq_lengths=_block_mask_seq_lengths(),
        recompile_limit=(
            "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"),
    )


_FEATURES = _detect()  # once, at import (PyG's WITH_* flags): compiled code reads a constant


def features() -> Features:
    """The features of the running torch (detected once, when mmattn is imported)."""
    return _FEATURES


@torch._dynamo.assume_constant_result
def export_tracing() -> bool:
    """Whether ``torch.export`` traces now, on a torch without ``torch.compiler.is_exporting``
    (feature ``is_exporting``; :func:`mmattn._helpers.exporting` asks that one where it
    exists), so that the export-safe paths and the clear refusals of what cannot export run
    there too. Strict export traces with dynamo, whose translator says ``export``: this
    function runs at trace time (``assume_constant_result``), its answer a constant of the
    graph. Non-strict export runs the module under its own torch-function mode.
    """
    from torch._dynamo.symbolic_convert import InstructionTranslator
    from torch.overrides import _get_current_function_mode_stack

    try:
        tx = InstructionTranslator.current_tx()
    except (AttributeError, IndexError, RuntimeError, AssertionError):
        tx = None
    if tx is not None:
        return bool(getattr(tx, "export", False))
    return any(type(mode).__name__ == "_NonStrictTorchFunctionHandler"
               for mode in _get_current_function_mode_stack())


def require(name: str, what: str) -> None:
    """Raise :class:`MissingFeature` unless this torch has feature ``name``.

    Args:
        name: a boolean attribute of :class:`Features`.
        what: the call that needs it, for the message.

    Raises:
        MissingFeature: naming the call, the feature and the torch release that brings it.
    """
    if getattr(features(), name) is not True:
        raise MissingFeature(
            f"{what} needs {SINCE[name]} (feature {name!r}); this is torch "
            f"{torch.__version__}"
        )
