"""The docs site as a reader gets it, the parts that need no browser (issue 30): the
docstrings' reST math becomes formulas the site typesets, the built pages load their
renderer, styles and pictures from the site itself (no CDN), every class and function has
its own heading, and the layer protocol stays out of the user API.
``make docs-check`` (docs/_tools/docs_check.py) opens the same pages in Chromium."""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("griffe")  # the docs extra
_spec = importlib.util.spec_from_file_location(
    "griffe_docstrings", ROOT / "docs" / "_tools" / "mkdocs" / "griffe_docstrings.py")
griffe_docstrings = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(griffe_docstrings)
rst_to_markdown = griffe_docstrings.rst_to_markdown

REST_LEFT = re.compile(r"\.\. math::|:(?:py:)?[a-z]+:`")


def test_math_directive_becomes_one_display_formula_per_equation():
    text = (
        "Scores.\n"
        "\n"
        "    .. math:: a = b\n"
        "        + c\n"
        "\n"
        "    .. math::\n"
        "\n"
        "        x = 1\n"
        "\n"
        "        y = 2\n"
        "    after\n"
    )
    assert rst_to_markdown(text) == (
        "Scores.\n"
        "\n"
        "    $$\n    a = b\n    + c\n    $$\n"
        "\n"
        "    $$\n    x = 1\n    $$\n"
        "\n"
        "    $$\n    y = 2\n    $$\n"
        "\n"
        "    after\n"
    )


def test_roles_become_inline_math_and_code():
    text = (
        "With :math:`|i-j| \\le w`, see :class:`MultiHeadAttention`, :meth:`~a.b.C.forward`,"
        " :func:`title <mmattn.f>` and :py:mod:`.kernels`."
    )
    assert rst_to_markdown(text) == (
        "With $|i-j| \\le w$, see `MultiHeadAttention`, `forward`, `title` and `kernels`."
    )
    assert rst_to_markdown("no roles\n  kept   as is\n") == "no roles\n  kept   as is\n"


@functools.cache
def _docstrings() -> list[tuple[str, str]]:
    found = []
    for package in ("mmattn", "adapters"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text("utf-8"))):
                if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef):
                    if (doc := ast.get_docstring(node, clean=False)) is not None:
                        found.append((f"{path.relative_to(ROOT)}:{getattr(node, 'name', '')}",
                                      doc))
    return found


def test_no_docstring_keeps_a_rest_construct_the_site_would_show_raw():
    docstrings = _docstrings()
    directives = sum(doc.count(".. math::") for _, doc in docstrings)
    assert directives >= 15  # the formulas of the layers, blocks, positions and adapters
    left = {where: REST_LEFT.findall(rst_to_markdown(doc)) for where, doc in docstrings}
    assert not {where: found for where, found in left.items() if found}
    blocks = sum(rst_to_markdown(doc).count("$$") for _, doc in docstrings)
    assert blocks >= 2 * directives


class _Page(HTMLParser):
    """The tags of one page that load something, the headings' ids and the visible text."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: list[tuple[str, str]] = []
        self.scripts: list[str] = []
        self.ids: list[str] = []
        self.text: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "script" and a.get("src"):
            self.scripts.append(a["src"])
            self.loads.append((tag, a["src"]))
        elif tag == "link" and a.get("rel") in ("stylesheet", "icon", "preconnect"):
            self.loads.append((tag, a["href"] or ""))
        elif tag == "img":
            self.loads.append((tag, a.get("src") or ""))
        if re.fullmatch(r"h[1-6]", tag) and a.get("id"):
            self.ids.append(a["id"])
        if tag in ("code", "pre", "script", "style"):
            self._skip += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in ("code", "pre", "script", "style"):
            self._skip -= 1

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.text.append(data)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:  # about 8 s of one core
    """The site, built as ``make docs`` builds it (--strict)."""
    pytest.importorskip("mkdocs")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                    "--site-dir", str(out)], cwd=ROOT, env=env, check=True)
    return out


@functools.cache
def _pages(site: Path) -> dict[Path, _Page]:
    pages = {}
    for path in sorted(site.rglob("*.html")):
        if "assets" not in path.relative_to(site).parts:
            pages[path] = parser = _Page()
            parser.feed(path.read_text("utf-8"))
    return pages


@pytest.mark.slow
def test_every_page_loads_its_renderer_styles_and_pictures_from_the_site(site):
    pages = _pages(site)
    assert len(pages) >= 25
    for path, page in pages.items():
        for tag, url in page.loads:
            parts = urlsplit(url)
            assert not parts.scheme and not parts.netloc, f"{path}: <{tag}> loads {url}"
            # a relative URL, or one from the site's root (404.html is served anywhere)
            base = site if parts.path.startswith("/") else path.parent
            target = (base / parts.path.lstrip("/")).resolve()
            if target.is_dir():
                target = target / "index.html"
            assert target.is_file(), f"{path}: <{tag}> {url} is not in the site"
        mathjax = [s for s in page.scripts if "mathjax" in s]
        assert [Path(s).name for s in mathjax] == ["mathjax.js", "tex-chtml.js"], (path, mathjax)
        assert not REST_LEFT.search("".join(page.text)), path
    renderer = site / "assets" / "mathjax"
    # what tex-chtml.js loads on demand: its fonts, the TeX extensions of autoload, the menu
    assert (renderer / "output/chtml/fonts/woff-v2/MathJax_Main-Regular.woff").is_file()
    assert (renderer / "input/tex/extensions/boldsymbol.js").is_file()
    assert (renderer / "ui/menu.js").is_file() and (renderer / "LICENSE").is_file()


@pytest.mark.slow
def test_formulas_of_pages_and_docstrings_are_marked_for_the_renderer(site):
    walkthrough = (site / "qkv_walkthrough" / "index.html").read_text("utf-8")
    assert '<div class="arithmatex">\\[\\mathrm{Attention}(Q, K, V)' in walkthrough
    api = (site / "api" / "index.html").read_text("utf-8")
    directives = sum(doc.count(".. math::") for _, doc in _docstrings())
    assert api.count('<div class="arithmatex">') >= directives - 3  # a few are not rendered
    assert '<span class="arithmatex">\\(|i-j| \\le w\\)</span>' in api


@pytest.mark.slow
def test_api_reference_heads_every_object_and_keeps_the_layer_protocol_apart(site):
    page = _pages(site)[site / "api" / "index.html"]
    ids = page.ids
    for name in ("mmattn.Tokens", "mmattn.MultiHeadAttention", "mmattn.CrossAttention",
                 "mmattn.replace_attention", "mmattn.LocalAttention", "mmattn.EdgeAttention",
                 "mmattn.NeighborhoodAttention", "mmattn.cache", "mmattn.functional",
                 "mmattn.debug", "adapters", "mmattn.Tokens.pack", "mmattn.cache.KVCache"):
        assert name in ids, name
    authors = ids.index("for-layer-authors")
    protocol = re.compile(r"\.(geometry|attend_rows|packed_rows|check_cache_call|_check_\w+)$")
    assert not [i for i in ids[:authors] if protocol.search(i)]
    after = ids[authors:]
    assert "mmattn.MultiHeadAttention.geometry" in after
    assert "mmattn.MultiHeadAttention._check_lengths" in after
    assert "mmattn.blocks.transformer.TransformerBlock.packed_rows" in after


#: How the home page names a registered attention when not by its registry name.
CALLED = {"linformer": "low-rank", "neighborhood": "neighbourhood"}


def test_home_page_names_every_attention_pattern():
    from mmattn.registry import _REGISTRY

    # Only the library's own variants: other test modules register their own
    # names (e.g. test_registry's "test-scaled") in this same process.
    builtin = [n for n, f in _REGISTRY.items() if getattr(f, "__module__", "").startswith("mmattn")]
    text = (ROOT / "docs" / "index.md").read_text("utf-8")
    line = re.search(r"^\* \[Attention variants\]\(variants\.md\):(.*?)(?=^\* )", text,
                     re.S | re.M)
    assert line, "the home page lists the variants"
    named = " ".join(line.group(1).split())
    missing = [n for n in sorted(builtin) if n != "full" and CALLED.get(n, n) not in named]
    assert not missing, f"docs/index.md does not name {missing}"
