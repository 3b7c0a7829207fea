"""Copy the demo's attention pictures that the README and the docs show into docs/img/.

Run ``make demo`` first (it writes ``out/demo/*_attention.png``), then
``python -m examples.docs_pictures [--from out/demo]``. The pictures are small (tens of kB)
and are committed as documentation assets; everything else under ``out/`` is not.
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Sequence
from pathlib import Path

#: The pictures the README and the docs show.
PICTURES = (
    "image_digits_attention.png",
    "text_recall_attention.png",
    "audio_dtmf_attention.png",
    "image_canvas_window.png",
    "multimodal_match_mass.png",
    "video_digits_frame.png",
)
DOCS_IMG = Path(__file__).resolve().parents[1] / "docs" / "img"


def main(argv: Sequence[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="source", default="out/demo", help="the demo's output folder")
    args = p.parse_args(argv)
    DOCS_IMG.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in PICTURES:
        source = Path(args.source) / name
        if not source.exists():
            raise SystemExit(f"{source} is missing: run `make demo` first")
        copied.append(Path(shutil.copyfile(source, DOCS_IMG / name)))
        print(f"{source} -> {copied[-1]} ({copied[-1].stat().st_size // 1024} kB)")
    return copied


if __name__ == "__main__":
    main()
