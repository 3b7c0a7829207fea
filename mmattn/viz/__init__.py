"""Pictures of attention: heatmaps with token labels, maps over image patches, spectrogram
frames, graph nodes and video tubelets, per-head grids, one patch's neighbourhood window,
and the modality-to-modality attention mass of every layer.

Axis key: ``h`` heads, ``i`` query length, ``j`` key length, ``r``/``c`` patch-grid rows and
columns, ``m`` mel bins, ``n`` graph nodes.

Needs matplotlib (the ``examples`` extra: ``pip install "mmattn[examples]"``); it is not
imported by ``import mmattn`` — use ``import mmattn.viz``. Every function draws on a fresh
``matplotlib.figure.Figure`` (no pyplot, so no window and no global state), returns it, and
also writes it to ``path`` when one is given (the format follows the suffix, e.g. ``.png``).

Labels in Chinese, Japanese or Korean are drawn with any CJK-capable font installed on the
system (Noto Sans CJK, Source Han, WenQuanYi, PingFang, Microsoft YaHei, ...; see
``docs/debugging.md`` for how to install one); without one, a character that no installed
font can draw is written as its ``\\uXXXX`` escape rather than as an empty box, with a
warning once.
"""

from __future__ import annotations

try:
    import matplotlib  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised by hiding matplotlib in a test
    raise ImportError(
        'mmattn.viz needs matplotlib: pip install "mmattn[examples]"'
    ) from error

from mmattn.viz._common import label_font
from mmattn.viz.maps import attention_heatmap, head_grid
from mmattn.viz.mass import modality_mass
from mmattn.viz.modalities import audio_attention, graph_attention, image_attention
from mmattn.viz.neighborhood import neighborhood_attention
from mmattn.viz.video import video_attention

__all__ = [
    "attention_heatmap",
    "audio_attention",
    "graph_attention",
    "head_grid",
    "image_attention",
    "label_font",
    "modality_mass",
    "neighborhood_attention",
    "video_attention",
]
