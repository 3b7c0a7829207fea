"""``ModalityAdapter``: the base class every adapter derives from, and the registry.

Axis key: ``b`` batch, ``l`` token sequence length, ``d`` model width (``embed_dim``).

An adapter turns one modality's raw input into ``Tokens(x (b, l, d), mask (b, l))`` with
``mask`` True at real tokens. Defining a subclass with a ``modality`` name registers it, so
``create("image", embed_dim=64)`` builds it by name.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from mmattn._checks import check_positive_int, first_param
from mmattn.tokens import Tokens

__all__ = ["ModalityAdapter", "adapter_class", "available", "create"]

_REGISTRY: dict[str, type[ModalityAdapter]] = {}


class ModalityAdapter(nn.Module):
    """Base class of the adapters: a module from raw input to :class:`mmattn.tokens.Tokens`.

    A subclass sets the class attribute ``modality`` (a short lower-case name), calls
    ``super().__init__(embed_dim)`` and returns ``Tokens`` with ``x`` of shape
    (B, L, embed_dim) from ``forward``. Defining the subclass registers it under its
    ``modality``; pass ``register=False`` in the class statement to opt out (for abstract
    intermediates, or a throwaway class in a notebook).

    Args:
        embed_dim: width ``D`` of the tokens.

    Raises:
        TypeError / ValueError: ``embed_dim`` is not a positive int.

    Examples:
        >>> class Scalar(ModalityAdapter):
        ...     modality = "scalar_doc"
        ...     def __init__(self, embed_dim):
        ...         super().__init__(embed_dim)
        ...         self.proj = nn.Linear(1, embed_dim)
        ...     def forward(self, values):  # (B, L) floats
        ...         return Tokens(self.proj(values.unsqueeze(-1)))
        >>> "scalar_doc" in available()
        True
        >>> create("scalar_doc", embed_dim=8)(torch.randn(2, 3)).x.shape
        torch.Size([2, 3, 8])
    """

    modality: ClassVar[str]

    def __init_subclass__(cls, register: bool = True, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("modality")
        if not register or name is None:
            return
        if not isinstance(name, str) or not name:
            raise TypeError(f"{cls.__qualname__}.modality must be a non-empty str, got {name!r}")
        previous = _REGISTRY.get(name)
        same = previous is not None and (previous.__module__, previous.__qualname__) == (
            cls.__module__,
            cls.__qualname__,
        )
        if previous is not None and not same:
            raise ValueError(
                f"modality {name!r} is already registered by "
                f"{previous.__module__}.{previous.__qualname__}; pick another name"
            )
        _REGISTRY[name] = cls  # a redefinition of the same class replaces it

    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.embed_dim = check_positive_int("embed_dim", embed_dim)

    def forward(self, *args: Any, **kwargs: Any) -> Tokens:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement forward")

    @classmethod
    def example(cls) -> tuple[dict[str, Any], tuple[Any, ...]]:
        """A small working configuration: ``(constructor kwargs, forward inputs)``.

        ``cls(**kwargs)(*inputs)`` must return Tokens. The contract test
        (``tests/adapters/test_contract.py``) runs every registered adapter from its
        example — shape, mask, dtype/device, padding and gradient checks, CPU and CUDA — so
        a subclass defines one to be checked; the base raises NotImplementedError.

        Examples:
            >>> from adapters import ImagePatcher
            >>> kwargs, inputs = ImagePatcher.example()
            >>> ImagePatcher(**kwargs)(*inputs).x.shape
            torch.Size([2, 9, 16])
        """
        raise NotImplementedError(
            f"{cls.__name__}.example() is not defined: return (constructor kwargs, forward "
            f"inputs) so the contract test can check the adapter"
        )

    def _param_dtype_device(self) -> tuple[torch.dtype, torch.device]:
        """dtype and device of the module's first parameter (the tokens follow them).

        An adapter without parameters uses its first floating buffer, else the default
        dtype on the CPU.
        """
        param = first_param(self)
        if param is None:
            return torch.get_default_dtype(), torch.device("cpu")
        return param.dtype, param.device


def available() -> list[str]:
    """Sorted names of the registered modalities.

    Examples:
        >>> {"audio", "graph", "image", "text"} <= set(available())
        True
    """
    return sorted(_REGISTRY)


def adapter_class(name: str) -> type[ModalityAdapter]:
    """The adapter class registered as ``name``.

    Raises:
        ValueError: no adapter is registered under ``name``.

    Examples:
        >>> adapter_class("text").__name__
        'TextTokenEmbedder'
    """
    if not isinstance(name, str):
        raise TypeError(
            f"name must be a str, one of {available()}, got {type(name).__name__} ({name!r})"
        )
    if name not in _REGISTRY:
        raise ValueError(
            f"name must be one of the registered modalities {available()}, got {name!r}"
        )
    return _REGISTRY[name]


def create(name: str, **kwargs: Any) -> ModalityAdapter:
    """Build the adapter registered as ``name`` with ``kwargs``.

    Args:
        name: a modality name from :func:`available`.
        **kwargs: the adapter's constructor arguments.

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: no adapter is registered under ``name``.
        ImportError: the adapter's library is missing (the message names the pip extra).

    Examples:
        >>> create("text", vocab_size=259, embed_dim=16).embed_dim
        16
    """
    return adapter_class(name)(**kwargs)
