"""Griffe extension for the API reference: the docstrings as a reader of the site sees them.

The docstrings are Google style with the reST roles PyTorch's own docstrings use, so that
``help()`` and an IDE read them as they read torch's. mkdocstrings renders Markdown, where
those roles would show raw. Before the docstrings are parsed, this extension rewrites them:

* a ``.. math::`` block (formula on the same line and/or on the indented lines under it; a
  blank line between formulas starts a new one, as in Sphinx) becomes a ``$$ … $$`` block
  of ``pymdownx.arithmatex``, which the site's MathJax typesets;
* ``:math:`x``` becomes ``$x$``;
* a cross-reference role (``:class:``, ``:func:``, ``:meth:``, ``:mod:``, ``:attr:``,
  ``:data:``, ``:exc:``, ``:obj:``) becomes inline code; ``~a.b.C`` shows ``C``.

(The methods that runners and blocks call, not users, are left out by mkdocs.yml's
``filters``; docs/api.md documents them once, for layer authors.)
"""

from __future__ import annotations

import re
from typing import Any

import griffe

MATH_DIRECTIVE = re.compile(r"^(?P<indent>[ \t]*)\.\. math::[ \t]*(?P<first>.*)$")
MATH_ROLE = re.compile(r":math:`([^`]+)`")
XREF_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj):`([^`]+)`")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _math_blocks(lines: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = MATH_DIRECTIVE.match(lines[i])
        if not match:
            out.append(lines[i])
            i += 1
            continue
        indent = match.group("indent")
        body = [match.group("first").strip()] if match.group("first").strip() else []
        i += 1
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > len(indent)):
            body.append(lines[i].strip())
            i += 1
        formulas: list[list[str]] = [[]]
        for line in body:
            if line:
                formulas[-1].append(line)
            elif formulas[-1]:
                formulas.append([])
        if out and out[-1].strip():
            out.append("")
        for formula in (f for f in formulas if f):
            out += [f"{indent}$$", *(f"{indent}{line}" for line in formula), f"{indent}$$", ""]
        if i < len(lines) and not lines[i].strip():
            i += 1  # the blank line that ended the block is already there
    return out


def _xref(match: re.Match[str]) -> str:
    target = match.group(1).strip()
    if "<" in target and target.endswith(">"):  # :class:`title <target>`
        return f"`{target.split('<', 1)[0].strip()}`"
    if target.startswith("~"):
        target = target[1:].rsplit(".", 1)[-1]
    return f"`{target.lstrip('.')}`"


def rst_to_markdown(text: str) -> str:
    """The docstring ``text`` with its reST math and cross-reference roles as Markdown."""
    if ".. math::" in text:
        text = "\n".join(_math_blocks(text.split("\n")))
    text = MATH_ROLE.sub(lambda m: f"${m.group(1).strip()}$", text)
    return XREF_ROLE.sub(_xref, text)


class ReaderDocstrings(griffe.Extension):
    """Rewrites the reST math and roles of every docstring to Markdown, before parsing."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)
