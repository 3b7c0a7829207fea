"""Draw docs/img/patterns_primitives.png and patterns_recipes.png from ``Pattern.dense``.

Every panel is ``pattern.dense(tokens)[0]`` of a small token layout: queries down, keys
across, a filled cell where the query may attend the key; the strips on the left and on top
colour each token by its modality. Run ``python -m examples.pattern_pictures [--out DIR]``
(default docs/img); the pictures are small and committed as documentation assets.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from mmattn import Tokens
from mmattn import patterns as P

os.environ.setdefault("MPLBACKEND", "Agg")

DOCS_IMG = Path(__file__).resolve().parents[1] / "docs" / "img"
#: The colour of each modality's strip (and of "-" for a token of none).
COLOURS = {"text": "#4c72b0", "image": "#dd8452", "graph": "#55a868", "audio": "#8172b3",
           "prompt": "#4c72b0", "answer": "#c44e52", "-": "#bbbbbb"}


def fused_tokens() -> Tokens:
    """text (5) · image (a 4 x 4 grid) · graph (5 nodes on a ring): one row of 26 tokens."""
    spans = {"text": (0, 5), "image": (5, 21), "graph": (21, 26)}
    ring = torch.tensor([[21, 22, 23, 24, 25], [22, 23, 24, 25, 21]])
    meta = {
        "spans": spans, "image": {"grid": (4, 4)},
        "edge_index": torch.cat([ring, ring.flip(0)], dim=1),
        "documents": torch.tensor([[0] * 11 + [1] * 15]),
    }
    return Tokens(torch.zeros(1, 26, 1), meta=meta)


def interleaved_tokens() -> Tokens:
    """text 4 · image 4 · text 3 · image 4 · text 3 (Gemma 3 / Transfusion, 18 tokens)."""
    types = torch.tensor([[0] * 4 + [1] * 4 + [0] * 3 + [1] * 4 + [0] * 3])
    images = torch.where(types == 1, P.runs(types) // 2, -1)  # image 0, image 1; text -1
    meta = {"modality_ids": types, "modalities": ("text", "image"), "segments": P.runs(types),
            "images": images}
    return Tokens(torch.zeros(1, 18, 1), meta=meta)


def prefix_tokens() -> Tokens:
    """A prompt of 7 tokens (attended both ways), then 9 answer tokens (causal)."""
    prefix = torch.tensor([[0] * 7 + [-1] * 9])
    meta = {"prefix": prefix, "modality_ids": (prefix < 0).long(),
            "modalities": ("prompt", "answer")}
    return Tokens(torch.zeros(1, 16, 1), meta=meta)


def packed_tokens() -> Tokens:
    """Three documents (6, 4, 7 tokens) packed in one row, then 3 padding tokens."""
    docs = torch.tensor([[0] * 6 + [1] * 4 + [2] * 7 + [-1] * 3])
    return Tokens(torch.zeros(1, 20, 1), mask=docs >= 0, meta={"documents": docs})


PRIMITIVES = [
    ("P.full()", P.full(), fused_tokens),
    ("P.causal()", P.causal(), fused_tokens),
    ("P.window(2)", P.window(2), fused_tokens),
    ("P.chunked(4, left=1)", P.chunked(4, left=1), lambda: Tokens(torch.zeros(1, 26, 1))),
    ('P.same("documents")', P.same("documents"), fused_tokens),
    ('P.modality("text", "image")', P.modality("text", "image"), fused_tokens),
    ("P.neighborhood(3)", P.neighborhood(3), fused_tokens),
    ("P.edges()", P.edges(), fused_tokens),
]

RECIPES = [
    ('Gemma 3\nP.causal() | P.same("images")', P.causal() | P.same("images"),
     interleaved_tokens),
    ("Transfusion\nper_modality(text causal,\nimage full; across causal)",
     P.per_modality(within={"text": P.causal(), "image": P.full()}, across=P.causal()),
     interleaved_tokens),
    ('prefix-LM\nP.causal() | P.same("prefix")', P.causal() | P.same("prefix"), prefix_tokens),
    ('packed documents\nP.same("documents") & P.causal()',
     P.same("documents") & P.causal(), packed_tokens),
    ("per modality\ntext causal, image 3x3,\ngraph edges; across full",
     P.per_modality(within={"text": P.causal(), "image": P.neighborhood(3),
                            "graph": P.edges()}, across=P.full()), fused_tokens),
]


def _modality_names(tokens: Tokens) -> list[str]:
    meta, length = tokens.meta, tokens.length
    names = ["-"] * length
    if "spans" in meta:
        for name, (start, stop) in meta["spans"].items():
            names[start:stop] = [name] * (stop - start)
    elif "modality_ids" in meta:
        names = [meta["modalities"][int(i)] for i in meta["modality_ids"][0]]
    return names


def draw(panels, path: Path, columns: int, title: str) -> Path:
    """One figure of ``(label, pattern, make_tokens)`` panels, saved as a PNG."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap, to_rgb

    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(2.35 * columns, 2.75 * rows), dpi=80,
                             squeeze=False)
    cmap = ListedColormap(["#f3f3f7", "#283593"])
    for ax, (label, pattern, make) in zip(axes.flat, panels):
        tokens = make()
        allowed = pattern.dense(tokens)[0].int()
        length = allowed.shape[-1]
        ax.imshow(allowed, cmap=cmap, vmin=0, vmax=1, extent=(0, length, length, 0))
        strip = torch.tensor([to_rgb(COLOURS[n]) for n in _modality_names(tokens)])
        if tokens.mask is not None:  # padding: grey
            strip[~tokens.mask[0]] = torch.tensor(to_rgb(COLOURS["-"]))
        ax.imshow(strip[None], extent=(0, length, -0.4, -1.4), aspect="auto")
        ax.imshow(strip[:, None], extent=(-1.4, -0.4, length, 0), aspect="auto")
        ax.set_xlim(-1.5, length)
        ax.set_ylim(length, -1.5)
        ax.set_xticks([])
        ax.set_yticks([])
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_title(label, fontsize=8.5, family="monospace")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[n])
               for n in ("text", "image", "graph", "answer", "-")]
    fig.legend(handles, ["text / prompt", "image", "graph", "answer", "none / padding"],
               loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(DOCS_IMG), help="output folder (default docs/img)")
    out = Path(p.parse_args(argv).out)
    made = [
        draw(PRIMITIVES, out / "patterns_primitives.png", 4,
             "The primitives (queries down, keys across; filled = may attend)"),
        draw(RECIPES, out / "patterns_recipes.png", 3, "Recipes (docs/patterns.md)"),
    ]
    for path in made:
        print(f"{path} ({path.stat().st_size // 1024} kB)")
    return made


if __name__ == "__main__":
    main()
