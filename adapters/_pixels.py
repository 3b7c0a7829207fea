"""Pixel grids shared by the image and video adapters: how a side is cut into patches, and
pixels to the module's floating dtype.

Axis key: ``n`` pixels along one side, ``p`` patch (or tubelet) side, ``s`` stride.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def grid_and_pad(size: int, patch: int, stride: int) -> tuple[int, int]:
    """Number of patches along one side and the zero padding that makes them fit.

    Patches start at 0, s, 2s, ... while the start is inside the image; the last one may
    stick out, and the image is padded (bottom/right, or after the last frame) to cover it.
    """
    # sym_max, not a branch, so a traced size (torch.export) stays symbolic; a non-negative
    # numerator where it counts, as ONNX divides integers toward zero, not down. Plain ints
    # take the builtin (torch 2.5's dynamo cannot fold sym_max of ints)
    count = math.ceil((size - patch) / stride) + 1
    count = max(1, count) if isinstance(count, int) else torch.sym_max(1, count)
    return count, (count - 1) * stride + patch - size


def to_pixels(name: str, pixels: Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    """uint8 pixels scaled to [0, 1], floating ones as they are, in ``dtype`` on ``device``.

    Raises:
        TypeError: ``pixels`` is neither floating nor uint8 (the message names ``name``).
    """
    if pixels.dtype == torch.uint8:
        return pixels.to(device=device, dtype=dtype) / 255
    if pixels.is_floating_point():
        return pixels.to(device=device, dtype=dtype)
    raise TypeError(f"{name} must be floating or torch.uint8, got {pixels.dtype}")
