"""Shared pieces of :mod:`mmattn.viz`: label fonts (CJK included), input checks, figures.

Axis key: ``i`` query length, ``j`` key length.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import torch
from matplotlib import font_manager, ft2font
from matplotlib.figure import Figure
from torch import Tensor

#: Families tried, in order, for labels the default font cannot draw.
CJK_FAMILIES = (
    "Noto Sans CJK SC",
    "Noto Sans CJK JP",
    "Noto Sans SC",
    "Source Han Sans SC",
    "WenQuanYi Micro Hei",
    "WenQuanYi Zen Hei",
    "Droid Sans Fallback",
    "SimHei",
    "Microsoft YaHei",
    "PingFang SC",
    "Hiragino Sans GB",
    "AR PL UMing CN",
)
#: Python packages known to ship a CJK font file (registered with matplotlib when present).
FONT_PACKAGES = ("paperang_p2_fonts_cjk",)

PathLike = str | Path


# --- fonts ---------------------------------------------------------------------------------


def _register_package_fonts() -> None:
    for package in FONT_PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        for root in spec.submodule_search_locations:
            for file in sorted(Path(root).rglob("*")):
                if file.suffix.lower() in (".ttf", ".ttc", ".otf"):
                    font_manager.fontManager.addfont(str(file))


@cache
def _charmap(family: str) -> frozenset[int]:
    path = font_manager.findfont(family, fallback_to_default=False)
    return frozenset(ft2font.FT2Font(path).get_charmap())


@lru_cache(maxsize=1)
def _cjk_family() -> str | None:
    _register_package_fonts()
    installed = {f.name for f in font_manager.fontManager.ttflist}
    for family in CJK_FAMILIES:
        if family in installed:
            return family
    return None


def label_font() -> list[str]:
    """The font families labels are drawn with: the default sans-serif, then a CJK one.

    Returns:
        ``["DejaVu Sans"]`` plus the first installed CJK-capable family, if any;
        matplotlib falls back glyph by glyph along this list.

    Examples:
        >>> label_font()[0]
        'DejaVu Sans'
    """
    cjk = _cjk_family()
    return ["DejaVu Sans"] if cjk is None else ["DejaVu Sans", cjk]


def _drawable(text: str) -> str:
    """``text`` with every character no label font can draw replaced by its ``\\uXXXX``."""
    covered = frozenset().union(*(_charmap(f) for f in label_font()))
    return "".join(
        ch if ch.isspace() or ord(ch) in covered else ch.encode("unicode_escape").decode()
        for ch in text
    )


# --- helpers -------------------------------------------------------------------------------


def _array(value: Any, name: str, ndim: tuple[int, ...]) -> Tensor:
    if not isinstance(value, Tensor):
        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(f"{name} must be a tensor or array, got {type(value).__name__}") \
                from error
    if value.dim() not in ndim:
        dims = " or ".join(f"{d}-D" for d in ndim)
        raise ValueError(f"{name} must be {dims}, got shape {tuple(value.shape)}")
    return value.detach().float().cpu()


def _labels(labels: Sequence[str] | None, n: int, name: str, what: str) -> list[str] | None:
    if labels is None:
        return None
    labels = [_drawable(str(label)) for label in labels]
    if len(labels) != n:
        raise ValueError(f"{name} has {len(labels)} labels but the map has {n} {what}")
    return labels


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    return fig


def _finish(fig: Figure, title: str | None, path: PathLike | None, dpi: int = 110) -> Figure:
    if title:
        fig.suptitle(_drawable(title), fontsize=10, fontfamily=label_font())
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    return fig


def _draw_heatmap(ax, weights: Tensor, xlabels, ylabels, cmap: str, colorbar: bool,
                  vmax: float | None = None):
    image = ax.imshow(weights.numpy(), cmap=cmap, aspect="auto", interpolation="nearest",
                      vmin=0.0 if vmax is not None else None, vmax=vmax)
    family = label_font()
    for labels, set_ticks, set_labels in (
        (xlabels, ax.set_xticks, ax.set_xticklabels),
        (ylabels, ax.set_yticks, ax.set_yticklabels),
    ):
        if labels is None:
            continue
        set_ticks(range(len(labels)))
        rotation = 90 if labels is xlabels and max(map(len, labels), default=0) > 2 else 0
        set_labels(labels, fontfamily=family, fontsize=8, rotation=rotation)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if colorbar:
        ax.figure.colorbar(image, ax=ax, shrink=0.8)
    return image
