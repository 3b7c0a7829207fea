"""Images: ``ImagePatcher`` (patches by unfold -> linear -> + 2D positions) and
``image_transform`` (torchvision preprocessing).

Axis key: ``b`` batch, ``c`` channels, ``h``/``w`` pixel rows/columns, ``p`` patch size,
``s`` stride, ``gh``/``gw`` rows/columns of the patch grid, ``l = gh * gw`` tokens,
``d`` model width (``embed_dim``).

    images (b, c, h, w) ──pad──▶ unfold (b, c*p*p, l) ──linear──▶ (b, l, d) ──+ pos──▶ Tokens

The unfold path is the meaning; the fused path computes the same numbers the fastest way
(see ``ImagePatcher.patches_fused``): a channels-last ``conv2d`` whose kernel is the linear
weight reshaped to (d, c, p, p) on CUDA, an einops rearrange + linear on CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from adapters._imports import require
from adapters._pixels import grid_and_pad, to_pixels
from adapters.base import ModalityAdapter
from mmattn._checks import (
    check_choice,
    check_factory_dtype,
    check_has_data,
    check_pair,
    check_positive_int,
    check_rank,
)
from mmattn._helpers import surely
from mmattn.functional import use_fused_attn
from mmattn.position import LearnedPositionalEmbedding2d, sinusoidal_2d
from mmattn.tokens import Tokens

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "ImagePatcher", "image_transform"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class ImagePatcher(ModalityAdapter):
    r"""Images to patch tokens: unfold, a linear projection, and 2D positions.

    Patch ``(i, j)`` holds pixels ``[i*s, i*s + p) x [j*s, j*s + p)`` of every channel,
    flattened channel-major as ``torch.nn.functional.unfold`` does, so

    .. math:: x_{b, i \cdot gw + j} = W \,\mathrm{unfold}(\mathrm{img})_{b, :, i \cdot gw + j}
        + \mathrm{bias} + P_{i, j}

    Sizes the patches do not tile are padded with zeros at the bottom/right, so
    ``gh = ceil((H - p) / s) + 1`` (1 when ``H <= p``), likewise ``gw``. Every patch holds
    image pixels, so the tokens have ``mask=None`` (all real).

    uint8 images are scaled to [0, 1]; float images are taken as they are (normalize them
    first, e.g. with :func:`image_transform`). Inputs are cast to the module's dtype.

    Args:
        embed_dim: token width ``D``.
        patch_size: patch side ``p``.
        in_channels: image channels ``C``.
        stride: patch step ``s``; ``None`` means ``patch_size`` (no overlap); smaller values
            give overlapping patches.
        img_size: image size (int or (H, W)) that the learned position table is built for;
            other sizes get it resampled bicubically.
        positional: "learned" (2D table, resampled), "sincos" (fixed 2D sine/cosine,
            computed for any grid) or None.
        bias: bias of the projection.
        device: parameter device.
        dtype: parameter dtype; the tokens come out in it.

    Attributes:
        fused: None (default) follows the library's switch at call time
            (:func:`mmattn.functional.use_fused_attn`, ``MMATTN_FUSED_ATTN``); True runs the
            fast path (:meth:`patches_fused`), False the explicit unfold + linear path; both
            give the same numbers.

    Shape:
        - images: (B, C, H, W), float or uint8, H and W >= 1 (B may be 0), any memory
          format (channels-last included)
        - Output: ``Tokens`` x (B, gh * gw, D), mask None, meta ``grid=(gh, gw)``,
          ``padding=(pad_h, pad_w)``, ``patch_size``, ``stride``

    Raises:
        TypeError: ``images`` is not a tensor, or neither floating nor uint8.
        ValueError: ``images`` is not 4-D, has the wrong channel count, H = 0 or W = 0, or
            is a meta tensor (no data to move to the module's device).

    Examples:
        >>> patcher = ImagePatcher(64, patch_size=16, img_size=224)
        >>> out = patcher(torch.rand(2, 3, 224, 224))
        >>> out.x.shape, out.meta["grid"]
        (torch.Size([2, 196, 64]), (14, 14))
        >>> patcher(torch.rand(2, 3, 100, 70)).meta["grid"]  # padded to 112 x 80
        (7, 5)
    """

    modality = "image"

    @classmethod
    def example(cls) -> tuple[dict[str, Any], tuple[Any, ...]]:
        """A 12×12 image in 4-pixel patches (see :meth:`ModalityAdapter.example`)."""
        return dict(embed_dim=16, patch_size=4, img_size=12), (torch.rand(2, 3, 12, 12),)

    def __init__(
        self,
        embed_dim: int,
        patch_size: int = 16,
        in_channels: int = 3,
        stride: int | None = None,
        img_size: int | tuple[int, int] = 224,
        positional: str | None = "learned",
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(embed_dim)
        dtype = check_factory_dtype("dtype", dtype)
        self.patch_size = check_positive_int("patch_size", patch_size)
        self.in_channels = check_positive_int("in_channels", in_channels)
        self.stride = patch_size if stride is None else check_positive_int("stride", stride)
        if self.stride > self.patch_size:
            raise ValueError(
                f"stride must be <= patch_size={patch_size} (larger would skip pixels), "
                f"got {stride}"
            )
        self.img_size = check_pair("img_size", img_size)
        self.grid_size = tuple(
            grid_and_pad(n, self.patch_size, self.stride)[0] for n in self.img_size
        )
        check_choice("positional", positional, ("learned", "sincos", None))
        if positional == "sincos" and embed_dim % 4:
            raise ValueError(f"embed_dim must be divisible by 4 for 'sincos', got {embed_dim}")
        self.positional = positional
        self.fused: bool | None = None
        self.proj = nn.Linear(
            in_channels * patch_size * patch_size, embed_dim, bias=bias, device=device, dtype=dtype
        )
        self.position = (
            LearnedPositionalEmbedding2d(self.grid_size, embed_dim, device=device, dtype=dtype)
            if positional == "learned"
            else None
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # like a Conv2d patch embedding: fan-in uniform for the weight and the bias
        self.proj.reset_parameters()
        if self.position is not None:
            self.position.reset_parameters()

    # ----------------------------------------------------------------------------- paths
    def _prepare(self, images: Tensor) -> tuple[Tensor, tuple[int, int], tuple[int, int]]:
        check_rank("images", images, (4,), "(batch, channels, height, width)")
        if images.shape[1] != self.in_channels:
            raise ValueError(
                f"images must have in_channels={self.in_channels} channels (dim 1), got shape "
                f"{tuple(images.shape)}"
            )
        if images.shape[2] == 0 or images.shape[3] == 0:
            raise ValueError(
                "images must be at least 1 x 1 pixels (a patch needs a pixel), got shape "
                f"{tuple(images.shape)}"
            )
        check_has_data("images", images)
        images = to_pixels("images", images, *self._param_dtype_device())
        (rows, pad_h), (cols, pad_w) = (
            grid_and_pad(n, self.patch_size, self.stride) for n in images.shape[-2:]
        )
        if not surely(pad_h == 0) or not surely(pad_w == 0):  # traced sizes: always pad
            images = F.pad(images, (0, pad_w, 0, pad_h))
        return images, (rows, cols), (pad_h, pad_w)

    def patches_unfold(self, images: Tensor) -> Tensor:
        """The explicit path on prepared (padded, float) images: unfold, then linear.

        Shape:
            - images: (B, C, H', W') already padded
            - Output: (B, gh * gw, D), before positions
        """
        cols = F.unfold(images, kernel_size=self.patch_size, stride=self.stride)
        return self.proj(rearrange(cols, "b k l -> b l k"))

    def patches_fused(self, images: Tensor) -> Tensor:
        """The fast path: the same numbers as :meth:`patches_unfold`, computed the fastest way.

        - CUDA: one conv2d whose kernel is the linear weight reshaped to (D, C, p, p), in
          channels-last memory (cuDNN's fast layout for patch embeddings);
        - CPU, non-overlapping patches: an einops rearrange to (b, l, c*p*p) and the linear
          layer (no output transpose, unlike a Conv2d patch embedding);
        - CPU, overlapping patches: the conv2d in contiguous memory.

        Shape: as :meth:`patches_unfold`.
        """
        if images.is_cuda:
            return self.patches_conv(images, channels_last=True)
        if self.stride == self.patch_size:
            p = self.patch_size
            patches = rearrange(images, "b c (gh p1) (gw p2) -> b (gh gw) (c p1 p2)", p1=p, p2=p)
            return self.proj(patches)
        return self.patches_conv(images, channels_last=False)

    def patches_conv(self, images: Tensor, channels_last: bool = False) -> Tensor:
        """conv2d with the linear weight as its (D, C, p, p) kernel (part of the fast path).

        Shape: as :meth:`patches_unfold`.
        """
        p = self.patch_size
        kernel = rearrange(self.proj.weight, "d (c ph pw) -> d c ph pw", ph=p, pw=p)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
            kernel = kernel.contiguous(memory_format=torch.channels_last)
        out = F.conv2d(images, kernel, self.proj.bias, stride=self.stride)
        return rearrange(out, "b d gh gw -> b (gh gw) d")

    def position_table(self, grid: tuple[int, int]) -> Tensor | None:
        """The (gh * gw, D) positions added for ``grid``, or None without positions."""
        dtype, device = self._param_dtype_device()
        if self.position is not None:
            return self.position.table(grid)
        if self.positional == "sincos":
            return sinusoidal_2d(*grid, self.embed_dim, device=device, dtype=dtype)
        return None

    def forward(self, images: Tensor | Sequence[Tensor], *, packed: bool = False) -> Tokens:
        """Patch tokens of a (B, C, H, W) batch, or packed tokens of a list of images.

        Args:
            images: a (B, C, H, W) batch, or (with ``packed=True``) a list of (C, H_m, W_m)
                images of any sizes.
            packed: return packed Tokens. A list is patched NaViT-style at native
                resolution: each image on its own grid with its own 2D positions, nothing
                resized or padded to a common size; ``meta["grids"]`` and
                ``meta["paddings"]`` list each image's grid and edge padding.
        """
        if not isinstance(images, Tensor):
            if not isinstance(images, (list, tuple)):
                check_rank("images", images, (4,), "(batch, channels, height, width)")
            if not packed:
                raise TypeError(
                    "images must be a (batch, channels, height, width) tensor; a list of "
                    "images of different sizes needs packed=True"
                )
            return self._packed_list(images)
        tokens = self._padded(images)
        return tokens.pack() if packed else tokens

    def _packed_list(self, images: Sequence[Tensor]) -> Tokens:
        """One patch sequence per image at its own grid, packed (see :meth:`forward`)."""
        if isinstance(images, (str, bytes)) or not isinstance(images, Sequence) or not images:
            raise TypeError(
                f"images must be a non-empty list of (channels, height, width) tensors, got "
                f"{type(images).__name__}"
            )
        rows, grids, paddings = [], [], []
        for i, image in enumerate(images):
            check_rank(f"images[{i}]", image, (3,), "(channels, height, width)")
            tokens = self._padded(image[None])
            rows.append(tokens.x[0])
            grids.append(tokens.meta["grid"])
            paddings.append(tokens.meta["padding"])
        lengths = torch.tensor([r.shape[0] for r in rows], device=rows[0].device)
        offsets = F.pad(lengths.cumsum(0), (1, 0))
        meta = {
            "modality": self.modality,
            "grids": grids,
            "paddings": paddings,
            "patch_size": self.patch_size,
            "stride": self.stride,
        }
        return Tokens.from_packed(torch.cat(rows), offsets, meta)

    def _padded(self, images: Tensor) -> Tokens:
        images, grid, padding = self._prepare(images)
        fused = use_fused_attn() if self.fused is None else self.fused
        x = self.patches_fused(images) if fused else self.patches_unfold(images)
        table = self.position_table(grid)
        if table is not None:
            x = x + table
        meta = {
            "modality": self.modality,
            "grid": grid,
            "padding": padding,
            "patch_size": self.patch_size,
            "stride": self.stride,
        }
        return Tokens(x, None, meta)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, patch_size={self.patch_size}, "
            f"in_channels={self.in_channels}, stride={self.stride}, img_size={self.img_size}, "
            f"grid_size={self.grid_size}, positional={self.positional!r}, fused={self.fused}"
        )


def image_transform(
    size: int | tuple[int, int] = 224,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> Callable:
    """A torchvision.transforms.v2 pipeline: PIL / uint8 / float image to a normalized tensor.

    ``ToImage -> Resize(size, antialias=True) -> ToDtype(float32, scale=True) ->
    Normalize(mean, std)``; an int ``size`` means (size, size) so that a batch stacks.

    Args:
        size: output (H, W).
        mean: per-channel mean subtracted after scaling to [0, 1].
        std: per-channel std divided by.

    Returns:
        A callable: image (PIL, or a (C, H, W) / (B, C, H, W) tensor) -> float32 tensor.

    Raises:
        ImportError: torchvision is missing (``pip install "mmattn[vision]"``).
        ValueError: ``mean`` and ``std`` differ in length.

    Examples:
        >>> tf = image_transform(32)
        >>> tf(torch.randint(0, 256, (3, 40, 50), dtype=torch.uint8)).shape
        torch.Size([3, 32, 32])
    """
    v2 = require("torchvision.transforms.v2", "image_transform")
    size = check_pair("size", size)
    if len(mean) != len(std):
        raise ValueError(f"mean and std must have the same length, got {len(mean)} and {len(std)}")
    return v2.Compose(
        [
            v2.ToImage(),
            v2.Resize(size, antialias=True),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(list(mean), list(std)),
        ]
    )
