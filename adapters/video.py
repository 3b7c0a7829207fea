"""Video: ``VideoPatcher``, clips (B, C, T, H, W) -> tubelets -> linear -> + positions.

Axis key: ``b`` batch, ``c`` channels, ``t`` frames, ``h``/``w`` pixel rows/columns,
``kt``/``kh``/``kw`` the tubelet (frames, rows, columns), ``gt``/``gh``/``gw`` the tubelet
grid, ``l = gt * gh * gw`` tokens (row-major: time, then rows, then columns), ``d`` model width.

    video (b, c, t, h, w) ──zero frames past lengths, pad──▶ tubelets (b, l, c*kt*kh*kw)
      ──linear──▶ (b, l, d) ──+ spatial (gh, gw) table + temporal (gt) table──▶ Tokens

A tubelet is ``kt`` consecutive frames of a ``kh x kw`` patch: the patch embedding of
ViViT / VideoMAE / torchvision's ``swin3d`` (a Conv3d whose kernel and stride are the
tubelet). The explicit path is an einops rearrange and the linear layer; on CUDA the fast
path is that Conv3d, channels-last (same numbers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import Tensor, nn

from adapters._pixels import grid_and_pad, to_pixels
from adapters.base import ModalityAdapter
from mmattn._checks import (
    check_choice,
    check_factory_dtype,
    check_has_data,
    check_lengths,
    check_pair,
    check_positive_int,
    check_rank,
)
from mmattn._helpers import surely
from mmattn.functional import use_fused_attn
from mmattn.position import LearnedPositionalEmbedding2d, sinusoidal_1d, sinusoidal_2d
from mmattn.tokens import Tokens

__all__ = ["VideoPatcher"]

Grid3 = tuple[int, int, int]


def _check_tubelet(value: object) -> Grid3:
    """An int (every axis) or (frames, rows, cols) of positive ints."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value, value, value)
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise TypeError(f"tubelet must be an int or (frames, rows, cols), got {value!r}")
    return tuple(check_positive_int(f"tubelet[{i}]", n) for i, n in enumerate(value))


class VideoPatcher(ModalityAdapter):
    r"""Video clips to tubelet tokens: a linear projection of each tubelet, plus positions.

    Tubelet ``(i, j, k)`` holds frames ``[i·kt, (i+1)·kt)``, rows ``[j·kh, (j+1)·kh)`` and
    columns ``[k·kw, (k+1)·kw)`` of every channel, flattened channel-major as a Conv3d
    kernel (``(c, kt, kh, kw)``), so

    .. math:: x_{b,\,(i \cdot gh + j) \cdot gw + k} = W\,\mathrm{tubelet}_{b,i,j,k} + \mathrm{bias}
        + S_{j,k} + T_i

    equals ``nn.Conv3d(C, D, kernel_size=tubelet, stride=tubelet)`` with the weight
    ``proj.weight.view(D, C, kt, kh, kw)`` (torchvision's ``swin3d`` patch embedding), tokens
    in row-major (time, row, column) order. Sizes the tubelet does not tile are padded with
    zeros after the last frame, row and column, as ``ImagePatcher`` pads images:
    ``gt = ceil(T / kt)`` (at least 1), likewise ``gh``, ``gw``.

    Clips of different lengths: ``lengths[b]`` real frames; frames past it are zeroed (by
    selection, so NaN there vanishes too) and the tubelets holding no real frame are padding
    (``mask`` False): item b has ``ceil(lengths[b] / kt)`` real time steps, and its tokens
    equal the clip cut to its real frames and run alone. Without ``lengths`` every tubelet
    is real (``mask`` None).

    Positions ("learned"): a learned spatial table ``S`` over the (gh, gw) grid of
    ``img_size`` plus a learned temporal table ``T`` with one row per time step of
    ``num_frames`` (separable, as MAE-ST and TimeSformer). Other frame sizes get ``S``
    resampled bicubically, as ``ImagePatcher`` does; ``T`` is indexed, never resampled, so a
    clip's tokens do not depend on how long the batch it is padded in is, and clips longer
    than ``num_frames`` raise. "sincos": the fixed 2-D sine/cosine of ``ImagePatcher`` plus
    a 1-D sinusoid over time. None: a token depends on its own tubelet only.

    uint8 video is scaled to [0, 1]; float video is taken as it is (normalize it first).
    Inputs are cast to the module's dtype.

    Args:
        embed_dim: token width ``D``.
        tubelet: (kt, kh, kw) frames, rows and columns of a tubelet, or an int for all three.
        in_channels: video channels ``C``.
        positional: "learned", "sincos" or None.
        num_frames: the longest clip (frames) the learned temporal table covers.
        img_size: frame size (int or (H, W)) the learned spatial table is built for.
        bias: bias of the projection.
        device: parameter device.
        dtype: parameter dtype; the tokens come out in it.

    Attributes:
        fused: None (default) follows the library's switch at call time
            (:func:`mmattn.functional.use_fused_attn`); True runs the fast path
            (:meth:`patches_fused`), False the explicit rearrange + linear; same numbers.

    Shape:
        - video: (B, C, T, H, W), float or uint8, as torchvision's video models take it
          (a (T, C, H, W) clip from ``torchvision.io`` / ``transforms.v2`` is
          ``clip.permute(1, 0, 2, 3)[None]``)
        - lengths: (B,) integer, 1 <= lengths <= T, or None
        - Output: ``Tokens`` x (B, gt·gh·gw, D), mask (B, L) or None; meta ``modality``
          "video", ``grid=(gt, gh, gw)``, ``frames`` (B, L) long (each token's tubelet time
          index), ``padding=(pad_t, pad_h, pad_w)``, ``tubelet``

    Raises:
        TypeError: ``video`` not a tensor, or neither floating nor uint8; ``lengths`` not
            integer; a list without ``packed=True``.
        ValueError: ``video`` not 5-D, the wrong channel count, an empty side, or a meta
            tensor; more time steps than the learned table of ``num_frames``; ``lengths`` of
            the wrong shape or outside [1, T]; ``sincos`` with ``embed_dim`` not divisible
            by 4.

    Examples:
        >>> patcher = VideoPatcher(32, tubelet=(2, 8, 8), num_frames=8, img_size=32)
        >>> out = patcher(torch.rand(2, 3, 8, 32, 32), lengths=torch.tensor([8, 3]))
        >>> out.x.shape, out.meta["grid"], out.lengths.tolist()
        (torch.Size([2, 64, 32]), (4, 4, 4), [64, 32])
        >>> out.meta["frames"][0, ::16].tolist()  # every 16th token: one per time step
        [0, 1, 2, 3]
    """

    modality = "video"

    @classmethod
    def example(cls) -> tuple[dict[str, Any], tuple[Any, ...]]:
        """Two short clips of different lengths (see :meth:`ModalityAdapter.example`)."""
        kwargs = dict(embed_dim=16, tubelet=(2, 4, 4), num_frames=6, img_size=8)
        return kwargs, (torch.rand(2, 3, 5, 8, 9), torch.tensor([5, 2]))

    def __init__(
        self,
        embed_dim: int,
        tubelet: int | Sequence[int] = (2, 16, 16),
        in_channels: int = 3,
        positional: str | None = "learned",
        num_frames: int = 16,
        img_size: int | tuple[int, int] = 224,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(embed_dim)
        dtype = check_factory_dtype("dtype", dtype)
        self.tubelet = _check_tubelet(tubelet)
        self.in_channels = check_positive_int("in_channels", in_channels)
        self.num_frames = check_positive_int("num_frames", num_frames)
        self.img_size = check_pair("img_size", img_size)
        kt, kh, kw = self.tubelet
        self.grid_size = (
            grid_and_pad(self.num_frames, kt, kt)[0],
            *(grid_and_pad(n, k, k)[0] for n, k in zip(self.img_size, (kh, kw))),
        )
        check_choice("positional", positional, ("learned", "sincos", None))
        if positional == "sincos" and embed_dim % 4:
            raise ValueError(f"embed_dim must be divisible by 4 for 'sincos', got {embed_dim}")
        self.positional = positional
        self.fused: bool | None = None
        factory = {"device": device, "dtype": dtype}
        self.proj = nn.Linear(in_channels * kt * kh * kw, embed_dim, bias=bias, **factory)
        self.position = self.temporal = None
        if positional == "learned":
            self.position = LearnedPositionalEmbedding2d(self.grid_size[1:], embed_dim, **factory)
            self.temporal = nn.Parameter(torch.empty(self.grid_size[0], embed_dim, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # like a Conv3d patch embedding: fan-in uniform for the weight and the bias; the
        # tables as the learned 2-D one (truncated normal, std 0.02)
        self.proj.reset_parameters()
        if self.position is not None:
            self.position.reset_parameters()
            nn.init.trunc_normal_(self.temporal, std=0.02)

    # ----------------------------------------------------------------------------- paths
    def _check(self, video: Tensor, lengths: Tensor | None) -> None:
        check_rank("video", video, (5,), "(batch, channels, frames, height, width)")
        if video.shape[1] != self.in_channels:
            raise ValueError(
                f"video must have in_channels={self.in_channels} channels (dim 1), got shape "
                f"{tuple(video.shape)}"
            )
        if any(n == 0 for n in video.shape[2:]):
            raise ValueError(
                "video must have at least 1 frame of 1 x 1 pixels, got shape "
                f"{tuple(video.shape)}"
            )
        check_has_data("video", video)
        if lengths is not None:
            check_lengths("lengths", lengths, video.shape[0], video.shape[2], "frames", "video")

    def _prepare(
        self, video: Tensor, lengths: Tensor | None
    ) -> tuple[Tensor, Grid3, Grid3, Tensor | None]:
        """Checked, zeroed past ``lengths``, padded, float video; its grid, padding and the
        lengths on the module's device."""
        self._check(video, lengths)
        dtype, device = self._param_dtype_device()
        video = to_pixels("video", video, dtype, device)
        if lengths is not None:
            lengths = lengths.to(device=device, dtype=torch.long)
            real = torch.arange(video.shape[2], device=device) < lengths[:, None]  # (b, t)
            video = torch.where(rearrange(real, "b t -> b 1 t 1 1"), video, 0.0)
        sides = [grid_and_pad(n, k, k) for n, k in zip(video.shape[2:], self.tubelet)]
        grid, padding = tuple(g for g, _ in sides), tuple(p for _, p in sides)
        if not all(surely(p == 0) for p in padding):  # traced sizes: always pad
            pad_t, pad_h, pad_w = padding
            video = F.pad(video, (0, pad_w, 0, pad_h, 0, pad_t))
        return video, grid, padding, lengths

    def patches_linear(self, video: Tensor) -> Tensor:
        """The explicit path on prepared (padded, float) video: tubelets, then linear.

        Shape:
            - video: (B, C, T', H', W') already padded
            - Output: (B, gt * gh * gw, D), before positions
        """
        kt, kh, kw = self.tubelet
        tubelets = rearrange(
            video, "b c (gt kt) (gh kh) (gw kw) -> b (gt gh gw) (c kt kh kw)",
            kt=kt, kh=kh, kw=kw,
        )
        return self.proj(tubelets)

    def patches_conv(self, video: Tensor, channels_last: bool = False) -> Tensor:
        """Conv3d with the linear weight as its (D, C, kt, kh, kw) kernel.

        Shape: as :meth:`patches_linear`.
        """
        kt, kh, kw = self.tubelet
        kernel = rearrange(self.proj.weight, "d (c kt kh kw) -> d c kt kh kw",
                           kt=kt, kh=kh, kw=kw)
        if channels_last:
            video = video.contiguous(memory_format=torch.channels_last_3d)
            kernel = kernel.contiguous(memory_format=torch.channels_last_3d)
        out = F.conv3d(video, kernel, self.proj.bias, stride=self.tubelet)
        return rearrange(out, "b d gt gh gw -> b (gt gh gw) d")

    def patches_fused(self, video: Tensor) -> Tensor:
        """The fast path: channels-last Conv3d on CUDA (cuDNN), the rearrange + linear of
        :meth:`patches_linear` on the CPU (no output transpose). Same numbers."""
        if video.is_cuda:
            return self.patches_conv(video, channels_last=True)
        return self.patches_linear(video)

    def position_table(self, grid: Grid3) -> Tensor | None:
        """The (gt * gh * gw, D) positions added for ``grid``, or None without positions."""
        steps, rows, cols = grid
        dtype, device = self._param_dtype_device()
        if self.position is not None:
            if not surely(steps <= self.grid_size[0]):
                raise ValueError(
                    f"video gives {steps} time steps of {self.tubelet[0]} frames, more than "
                    f"the learned temporal table of num_frames={self.num_frames} "
                    f"({self.grid_size[0]} steps); build the patcher with a larger num_frames"
                )
            space = self.position.table((rows, cols))  # (gh * gw, d)
            time = self.temporal[:steps]  # indexed: a clip's positions ignore the padding
        elif self.positional == "sincos":
            space = sinusoidal_2d(rows, cols, self.embed_dim, device=device, dtype=dtype)
            time = sinusoidal_1d(steps, self.embed_dim, device=device, dtype=dtype)
        else:
            return None
        return rearrange(time[:, None] + space[None], "gt s d -> (gt s) d")

    # --------------------------------------------------------------------------- forward
    def forward(
        self,
        video: Tensor | Sequence[Tensor],
        lengths: Tensor | None = None,
        *,
        packed: bool = False,
    ) -> Tokens:
        """Tubelet tokens of a (B, C, T, H, W) batch, or packed tokens of a list of clips.

        Args:
            video: a (B, C, T, H, W) batch, or (with ``packed=True``) a list of
                (C, T_m, H_m, W_m) clips of any sizes.
            lengths: real frames per clip of a batch (None: all T).
            packed: return packed Tokens (jagged x, no mask): a batch keeps only its real
                tubelets; a list is patched clip by clip at its own size, each on its own
                grid (``meta["grids"]``, ``meta["paddings"]``; ``meta["frames"]`` in the
                (B, max lᵢ) layout of packed Tokens, -1 past each clip).
        """
        if not isinstance(video, Tensor):
            if not isinstance(video, (list, tuple)):
                check_rank("video", video, (5,), "(batch, channels, frames, height, width)")
            if not packed:
                raise TypeError(
                    "video must be a (batch, channels, frames, height, width) tensor; a list "
                    "of clips of different sizes needs packed=True"
                )
            if lengths is not None:
                raise TypeError("lengths must be None for a list of clips (each is its length)")
            return self._packed_list(video)
        tokens = self._padded(video, lengths)
        return tokens.pack() if packed else tokens

    def _padded(self, video: Tensor, lengths: Tensor | None) -> Tokens:
        video, grid, padding, lengths = self._prepare(video, lengths)
        fused = use_fused_attn() if self.fused is None else self.fused
        x = self.patches_fused(video) if fused else self.patches_linear(video)
        table = self.position_table(grid)
        if table is not None:
            x = x + table
        steps, rows, cols = grid
        step = repeat(torch.arange(steps, device=x.device), "gt -> (gt s)", s=rows * cols)
        frames = step.expand(x.shape[0], -1).contiguous()  # (b, l)
        mask = None
        if lengths is not None:  # a tubelet is real when it holds a real frame
            mask = step[None, :] * self.tubelet[0] < lengths[:, None]
        meta = {"modality": self.modality, "grid": grid, "frames": frames, "padding": padding,
                "tubelet": self.tubelet}
        return Tokens(x, mask, meta)

    def _packed_list(self, clips: Sequence[Tensor]) -> Tokens:
        """One tubelet sequence per clip at its own grid, packed (see :meth:`forward`)."""
        if isinstance(clips, (str, bytes)) or not isinstance(clips, Sequence) or not clips:
            raise TypeError(
                "video must be a non-empty list of (channels, frames, height, width) tensors, "
                f"got {type(clips).__name__}"
            )
        rows, grids, paddings = [], [], []
        for i, clip in enumerate(clips):
            check_rank(f"video[{i}]", clip, (4,), "(channels, frames, height, width)")
            tokens = self._padded(clip[None], None)
            rows.append(tokens.x[0])
            grids.append(tokens.meta["grid"])
            paddings.append(tokens.meta["padding"])
        counts = [r.shape[0] for r in rows]
        device = rows[0].device
        offsets = F.pad(torch.tensor(counts, device=device).cumsum(0), (1, 0))
        frames = torch.full((len(rows), max(counts)), -1, dtype=torch.long, device=device)
        for m, (steps, height, width) in enumerate(grids):
            frames[m, : counts[m]] = torch.arange(steps, device=device).repeat_interleave(
                height * width
            )
        meta = {"modality": self.modality, "grids": grids, "paddings": paddings,
                "frames": frames, "tubelet": self.tubelet}
        return Tokens.from_packed(torch.cat(rows), offsets, meta)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, tubelet={self.tubelet}, "
            f"in_channels={self.in_channels}, num_frames={self.num_frames}, "
            f"img_size={self.img_size}, grid_size={self.grid_size}, "
            f"positional={self.positional!r}, fused={self.fused}"
        )
