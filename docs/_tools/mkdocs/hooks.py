"""mkdocs hooks: the site carries its own formula renderer (issue 30).

MathJax 3 comes from the PyPI package ``django-static-mathjax`` (the docs extra; it needs no
Django to be installed, only its files are read). ``on_files`` adds the renderer's files to
the site under ``assets/mathjax/``, so a fresh clone's ``make docs`` builds a site that
typesets offline: no CDN, nothing committed. ``docs/javascripts/mathjax.js`` configures it
for ``pymdownx.arithmatex`` (generic mode); ``mkdocs.yml`` loads both.
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

#: Where the renderer lands in the site (mkdocs.yml's extra_javascript points there).
DEST = "assets/mathjax"
#: The one combined component the pages load; the other top-level bundles are alternatives
#: to it and stay out (the components it loads on demand, fonts, menu, a11y, speech, the
#: TeX extensions of ``autoload``, all lie in the subfolders and come along).
ENTRY = "tex-chtml.js"


def mathjax_root() -> Path:
    """The ``es5`` folder of the installed MathJax (``tex-chtml.js`` and its components)."""
    spec = find_spec("mathjax")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        root = Path(location) / "static" / "mathjax" / "es5"
        if (root / ENTRY).is_file():
            return root
    raise PluginError(
        "the docs need MathJax from the PyPI package django-static-mathjax (the docs extra: "
        "pip install -c constraints.txt -e '.[docs]'); found no mathjax/static/mathjax/es5/"
        f"{ENTRY} in {locations or 'any installed package'}"
    )


def renderer_files(root: Path) -> list[tuple[str, Path]]:
    """(site path, source) of every file the site needs from MathJax, license included."""
    keep = [(f"{DEST}/{ENTRY}", root / ENTRY)]
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.parent != root:
            keep.append((f"{DEST}/{path.relative_to(root).as_posix()}", path))
    keep.append((f"{DEST}/LICENSE", root.parent / "LICENSE"))
    return keep


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for dest, source in renderer_files(mathjax_root()):
        files.append(File.generated(config, dest, abs_src_path=str(source)))
    return files
