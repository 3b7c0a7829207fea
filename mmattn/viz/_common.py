"""Shared pieces of :mod:`mmattn.viz`: label fonts (CJK included), input checks, figures.

Axis key: ``i`` query length, ``j`` key length.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Sequence
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import torch
from matplotlib import font_manager, ft2font
from matplotlib.figure import Figure
from torch import Tensor

#: Families preferred, in order, for labels the default font cannot draw.
CJK_FAMILIES = (
    "Noto Sans CJK SC",
    "Noto Sans CJK JP",
    "Noto Sans CJK TC",
    "Noto Sans CJK KR",
    "Noto Sans SC",
    "Source Han Sans SC",
    "Source Han Sans CN",
    "Source Han Sans",
    "WenQuanYi Micro Hei",
    "WenQuanYi Zen Hei",
    "PingFang SC",
    "Microsoft YaHei",
    "Hiragino Sans GB",
    "SimHei",
    "Droid Sans Fallback",
    "AR PL UMing CN",
)
#: Any other installed family whose name says it covers CJK (after the preferred ones).
CJK_NAME = re.compile(
    r"CJK|Source Han|WenQuanYi|PingFang|YaHei|JhengHei|Hiragino|SimHei|SimSun|Droid Sans "
    r"Fallback|AR PL|Noto (Sans|Serif) (SC|TC|HK|JP|KR)\b|Sarasa|Unifont"
)

PathLike = str | Path
_warned: list[bool] = []  # the no-CJK-font warning is given once a process


# --- fonts ---------------------------------------------------------------------------------


@cache
def _charmap(family: str) -> frozenset[int]:
    path = font_manager.findfont(family, fallback_to_default=False)
    return frozenset(ft2font.FT2Font(path).get_charmap())


def pick_cjk_family(installed: Iterable[str]) -> str | None:
    """The CJK-capable family to use among the ``installed`` family names, or None.

    The first of :data:`CJK_FAMILIES` that is installed, else the first installed family
    (sorted) whose name matches :data:`CJK_NAME`.
    """
    installed = set(installed)
    for family in CJK_FAMILIES:
        if family in installed:
            return family
    return next((f for f in sorted(installed) if CJK_NAME.search(f)), None)


@lru_cache(maxsize=1)
def _cjk_family() -> str | None:
    return pick_cjk_family(f.name for f in font_manager.fontManager.ttflist)


def label_font() -> list[str]:
    """The font families labels are drawn with: the default sans-serif, then a CJK one.

    The CJK family is any one installed on the system that matplotlib's font manager knows
    (Noto Sans CJK, Source Han, WenQuanYi, PingFang, Microsoft YaHei, ...; see
    :func:`pick_cjk_family`). Without one, labels are drawn with the default font and a
    character it cannot draw is written as its ``\\uXXXX`` escape (with a warning, once).

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
    """``text`` with every character no label font can draw replaced by its ``\\uXXXX``.

    The first time a character cannot be drawn because no CJK font is installed, a warning
    says how to get one (once a process).
    """
    fonts = label_font()
    covered = frozenset().union(*(_charmap(f) for f in fonts))
    missing = [ch for ch in text if not ch.isspace() and ord(ch) not in covered]
    if missing and len(fonts) == 1 and not _warned:
        _warned.append(True)
        warnings.warn(
            f"mmattn.viz found no CJK font, so {''.join(missing[:5])!r} is drawn as \\uXXXX "
            "escapes with the default font; install one (e.g. apt-get install "
            "fonts-noto-cjk, or pip install mplfonts && mplfonts init), see "
            "docs/debugging.md",
            stacklevel=4,  # the caller of the viz function
        )
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
