"""Input validation at the public boundary.

Every check raises ``ValueError`` (wrong value or shape) or ``TypeError`` (wrong type or
dtype) with a message that names the argument and gives the expected and the actual value.
Checks only look at Python-level facts (shapes, dtypes, devices), never at tensor values, so
they cost nothing at run time and do not break ``torch.compile`` graphs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def check_tensor(name: str, value: object) -> Tensor:
    """Raise TypeError unless ``value`` is a tensor."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_rank(name: str, value: Tensor, ranks: Sequence[int], layout: str = "") -> None:
    """Raise ValueError unless ``value.dim()`` is one of ``ranks``."""
    check_tensor(name, value)
    if value.dim() not in ranks:
        want = " or ".join(str(r) for r in ranks)
        hint = f" {layout}" if layout else ""
        raise ValueError(
            f"{name} must be a {want}-D tensor{hint}, got {value.dim()}-D with shape "
            f"{tuple(value.shape)}"
        )


def check_floating(name: str, value: Tensor) -> None:
    """Raise TypeError unless ``value`` has a floating-point dtype."""
    if not value.is_floating_point():
        raise TypeError(f"{name} must have a floating-point dtype, got {value.dtype}")


def check_same_dtype(name: str, value: Tensor, ref_name: str, ref: Tensor) -> None:
    """Raise TypeError when two floating tensors disagree on dtype."""
    if value.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {value.dtype} but {ref_name} has dtype {ref.dtype}")


def check_same_device(name: str, value: Tensor, ref_name: str, ref: Tensor) -> None:
    """Raise ValueError when two tensors live on different devices."""
    if value.device != ref.device:
        raise ValueError(
            f"{name} is on device {value.device} but {ref_name} is on device {ref.device}"
        )


def check_last_dim(name: str, value: Tensor, size: int, what: str = "embed_dim") -> None:
    """Raise ValueError unless ``value.shape[-1] == size``."""
    if value.shape[-1] != size:
        raise ValueError(
            f"{name} must have last dimension {what}={size}, got shape {tuple(value.shape)}"
        )


def check_shape(name: str, value: Tensor, expected: Sequence[int], layout: str = "") -> None:
    """Raise ValueError unless ``value.shape == expected``."""
    if tuple(value.shape) != tuple(expected):
        hint = f" {layout}" if layout else ""
        raise ValueError(
            f"{name} must have shape {tuple(expected)}{hint}, got {tuple(value.shape)}"
        )


def check_mask_dtype(name: str, mask: Tensor, allow_float: bool = True) -> None:
    """Raise TypeError unless ``mask`` is bool (or floating when ``allow_float``)."""
    if mask.dtype == torch.bool:
        return
    if allow_float and mask.is_floating_point():
        return
    want = "torch.bool or a floating dtype" if allow_float else "torch.bool"
    raise TypeError(f"{name} must have dtype {want}, got {mask.dtype}")


def check_positive_int(name: str, value: object, minimum: int = 1) -> int:
    """Raise TypeError for non-integers and ValueError for integers below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_probability(name: str, value: object) -> float:
    """Raise unless ``value`` is a number in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float in [0, 1), got {type(value).__name__}")
    if not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    return float(value)
