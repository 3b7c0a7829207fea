"""The docs stay true: every Python block of the tutorial pages runs, in order, and prints
exactly the output shown under it; the QKV walkthrough (English and 中文) matches
``examples/qkv_walkthrough.py`` step by step."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

from mmattn import registry
from mmattn.kernels import dense as _kernel

DOCS = Path(__file__).resolve().parents[1] / "docs"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)

#: Pages whose Python blocks are run (each page in one namespace, top to bottom).
PAGES = [
    "qkv_walkthrough.md",
    "qkv_walkthrough.zh.md",
    "quickstart.md",
    "quickstart.zh.md",
    "concepts.md",
    "custom_adapter.md",
    "debugging.md",
    "adapters/text.md",
    "adapters/image.md",
    "adapters/video.md",
    "adapters/audio.md",
    "adapters/graph.md",
    "adapters/index.md",
    "variants.md#writing-your-own-attention-variant",
    "variants.md#score-modifiers",
    "decoding.md",
    "streaming.md",
    "packed.md",
    "patterns.md",
    "integrations.md#timm",
    "integrations.md#torchvision",
    "integrations.md#hugging-face-transformers",
    "deploy.md",
]
NEEDS = {
    "adapters/audio.md": "torchaudio",
    "streaming.md": "torchaudio",
    "adapters/graph.md": "torch_geometric",
    "debugging.md": "matplotlib",
    "integrations.md#timm": "timm",
    "integrations.md#torchvision": "torchvision",
    "integrations.md#hugging-face-transformers": "transformers",
    "deploy.md": "onnxruntime",
}


def blocks(page: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block, in order; ``page#anchor``: that section only."""
    page, _, anchor = page.partition("#")
    text = (DOCS / page).read_text("utf-8")
    if anchor:
        headings = list(re.finditer(r"^## (.+)$", text, re.M))
        slug = [m for m in headings if re.sub(r"[^a-z0-9]+", "-", m.group(1).lower()) == anchor]
        assert slug, f"{page} has no section #{anchor}"
        start = slug[0].start()
        following = [m.start() for m in headings if m.start() > start]
        text = text[start : following[0] if following else len(text)]
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def run_page(page: str) -> list[tuple[str, str, str | None]]:
    """Run the page's Python blocks; return (code, printed, shown) per block."""
    fenced = blocks(page)
    namespace: dict = {"__name__": f"docs_{page}"}
    results = []
    # the pages show the defaults: the fused path on, whatever MMATTN_FUSED_ATTN says
    previous = _kernel.use_fused_attn()
    _kernel.set_fused_attn(True)
    registered = dict(registry._REGISTRY)  # a page's register_attention stays on the page
    try:
        for n, (language, code) in enumerate(fenced):
            if language != "python":
                continue
            following = fenced[n + 1] if n + 1 < len(fenced) else ("", "")
            shown = following[1] if following[0] == "text" else None
            buffer = io.StringIO()
            with contextlib.redirect_stdout(buffer):
                exec(compile(code, f"{page} block {n}", "exec"), namespace)
            results.append((code, buffer.getvalue(), shown))
    finally:
        torch.set_printoptions(profile="default")
        _kernel.set_fused_attn(previous)
        registry._REGISTRY.clear()
        registry._REGISTRY.update(registered)
    return results


def _clean(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


@pytest.mark.parametrize("page", PAGES)
def test_page_blocks_run_and_print_what_is_shown(page):
    if page in NEEDS:
        pytest.importorskip(NEEDS[page])
    results = run_page(page)
    assert results, f"{page} has no python blocks"
    for code, printed, shown in results:
        if shown is not None:
            assert _clean(printed) == _clean(shown), f"in {page}:\n{code}"


def _code_only(code: str) -> str:
    return "\n".join(line.split("#", 1)[0].rstrip() for line in code.splitlines())


def test_chinese_walkthrough_runs_the_same_code_as_the_english():
    english = [c for lang, c in blocks("qkv_walkthrough.md") if lang == "python"]
    chinese = [c for lang, c in blocks("qkv_walkthrough.zh.md") if lang == "python"]
    assert [_code_only(c) for c in chinese] == [_code_only(c) for c in english]
    text = (DOCS / "qkv_walkthrough.zh.md").read_text("utf-8")
    assert len(re.findall(r"[\u4e00-\u9fff]", text)) > 1000  # written in Chinese
    headings = [h for h in re.findall(r"^## (\d+)\.", text, re.M)]
    assert headings == [str(n) for n in range(1, 9)]


def test_chinese_quickstart_is_the_english_one_in_chinese():
    english, chinese = blocks("quickstart.md"), blocks("quickstart.zh.md")
    assert [(lang, _code_only(c)) for lang, c in chinese if lang != "bash"] == [
        (lang, _code_only(c)) for lang, c in english if lang != "bash"
    ]  # the same code and the same outputs shown, comments translated
    text = (DOCS / "quickstart.zh.md").read_text("utf-8")
    assert len(re.findall(r"[\u4e00-\u9fff]", text)) > 400  # written in Chinese
    sections = [len(re.findall(r"^## ", (DOCS / page).read_text("utf-8"), re.M))
                for page in ("quickstart.md", "quickstart.zh.md")]
    assert sections[0] == sections[1]
    nav = (DOCS.parent / "mkdocs.yml").read_text("utf-8")
    assert "quickstart.zh.md" in nav


@pytest.mark.parametrize("page", ["qkv_walkthrough.md", "qkv_walkthrough.zh.md"])
def test_walkthrough_outputs_are_the_example_outputs(page, tmp_path):
    from examples import qkv_walkthrough

    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            qkv_walkthrough.run(quick=True, out_dir=tmp_path, show_progress=False)
    finally:
        torch.set_printoptions(profile="default")
    example = {line.rstrip() for line in buffer.getvalue().splitlines()}
    shown = [text for lang, text in blocks(page) if lang == "text"]
    assert len(shown) >= 10
    for text in shown:
        for line in _clean(text).splitlines():
            assert line in example, f"{page} shows {line!r}, which the example does not print"
    # every step of the example is a section of the page, in the same order
    steps = re.findall(r"^== (\d+)\.", buffer.getvalue(), re.M)
    sections = re.findall(r"^## (\d+)\.", (DOCS / page).read_text("utf-8"), re.M)
    assert sections == steps
