"""Imports go one way: no cycle inside ``mmattn`` or ``adapters``, and none between them.

The graph is read from the source with ``ast`` — every ``import`` statement, at module level,
inside a function (a lazy import that dodges a cycle still counts) or under
``if TYPE_CHECKING:`` (a cycle hidden from the interpreter is still a cycle).
``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``
itself. A second test imports ``mmattn`` in a fresh interpreter and checks that no module is
loaded twice. The layering rules of the tree (docs/concepts.md) are checked here too: kernels
import no layer, layers import no block, no class is recognised by its name string, and no
file is longer than 600 lines (about 450 stays the size at which a file is reviewed for two
concepts).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mmattn", "adapters")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """{module: the package modules it imports} for mmattn and adapters."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")
                    anchor = anchor if is_package else anchor[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            for target in targets:
                while target and target not in modules:  # `import a.b.c` -> deepest module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [m0, m1, ..., m0], or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_package_imports_have_no_cycle():
    graph = import_graph()
    assert "mmattn.kernels.dense" in graph["mmattn.attention.mha"]  # the parser sees real edges
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_mmattn_never_imports_adapters():
    graph = import_graph()
    back = {m: sorted(t for t in ts if t.startswith("adapters"))
            for m, ts in graph.items() if m.startswith("mmattn")}
    assert not any(back.values()), back


#: (lower layer, higher layers it must not import): the arrows of docs/concepts.md.
LAYERS = [
    ("mmattn.kernels", ("mmattn.attention", "mmattn.blocks", "mmattn.integrations",
                        "mmattn.distributed", "mmattn.debug", "mmattn.registry",
                        "mmattn.patterns")),
    ("mmattn.patterns", ("mmattn.attention", "mmattn.blocks", "mmattn.integrations",
                         "mmattn.distributed", "mmattn.debug", "mmattn.registry")),
    ("mmattn.attention", ("mmattn.blocks", "mmattn.integrations", "mmattn.distributed",
                          "mmattn.debug", "mmattn.registry")),
    ("mmattn.blocks", ("mmattn.integrations", "mmattn.distributed", "mmattn.debug")),
    # the data type and the jagged helpers under it sit below every kernel and layer
    ("mmattn.tokens", ("mmattn.kernels", "mmattn.attention", "mmattn.blocks",
                       "mmattn.integrations", "mmattn.distributed", "mmattn.debug",
                       "mmattn.registry", "mmattn.functional")),
    ("mmattn._jagged", ("mmattn.tokens", "mmattn.kernels", "mmattn.attention",
                        "mmattn.blocks", "mmattn.integrations", "mmattn.distributed",
                        "mmattn.debug", "mmattn.registry", "mmattn.functional")),
]


@pytest.mark.parametrize(("lower", "higher"), LAYERS)
def test_arrows_point_down(lower, higher):
    graph = import_graph()
    up = {m: sorted(t for t in ts if t.startswith(higher))
          for m, ts in graph.items() if m == lower or m.startswith(lower + ".")}
    assert not any(up.values()), f"{lower} imports a layer above it: {up}"


def _name_string_checks(tree: ast.AST) -> list[str]:
    """Comparisons against a class's ``__qualname__``/``__name__``/``__module__`` string, or
    against a string spelling an mmattn module path: how a cycle hides an isinstance."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        text = ast.unparse(node)
        strings = [n.value for n in ast.walk(node)
                   if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        dunder = any(name in text for name in ("__qualname__", "__module__"))
        if (dunder and strings) or any(s.startswith("mmattn.") for s in strings):
            found.append(text)
    return found


def test_no_class_is_recognised_by_its_name_string():
    found = {name: checks for name, path in _modules().items()
             if (checks := _name_string_checks(ast.parse(path.read_text())))}
    assert not found, f"classes recognised by name strings: {found}"


def test_name_string_finder_finds_a_planted_check():
    planted = ast.parse(
        'ok = (cls.__module__, cls.__qualname__) == ("mmattn.attention.mha", "X")'
    )
    assert _name_string_checks(planted)
    assert not _name_string_checks(ast.parse("ok = isinstance(m, MultiHeadAttention)"))


def test_type_checking_imports_are_edges():
    assert find_cycle(_graph_of({
        "pkg.a": "from pkg import b\n",
        "pkg.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n",
    })) is not None


def _graph_of(sources: dict[str, str]) -> dict[str, set[str]]:
    """import_graph's edge rule on in-memory modules (for the planted-cycle tests)."""
    graph: dict[str, set[str]] = {name: set() for name in sources}
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module in ("pkg",):
                graph[name] |= {f"pkg.{a.name}" for a in node.names} & set(sources)
    return graph


#: The hard limit; about 450 lines stays the size at which a file is reviewed for holding two
#: concepts (STYLE.md), and only a file that is one concept grows past it.
MAX_LINES = 600


def test_no_file_is_over_the_line_limit():
    long = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if (lines := len(path.read_text().splitlines())) > MAX_LINES:
                long[str(path.relative_to(ROOT))] = lines
    assert not long, f"files over {MAX_LINES} lines (split them): {long}"


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


#: Run in a fresh interpreter: a finder first on sys.meta_path sees every module the import
#: system looks for, which it does only when the module is not loaded yet.
_COUNT_IMPORTS = """
import sys
seen = []
class Spy:
    @staticmethod
    def find_spec(name, path=None, target=None):
        seen.append(name)
        return None
sys.meta_path.insert(0, Spy)
import {package}
print("\\n".join(seen))
"""


@pytest.mark.parametrize("package", PACKAGES)
def test_import_executes_each_module_once(package):
    result = subprocess.run(
        [sys.executable, "-c", _COUNT_IMPORTS.format(package=package)],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )
    ours = [n for n in result.stdout.split() if n.split(".")[0] in PACKAGES]
    assert "mmattn.kernels.dense" in ours
    twice = sorted({n for n in ours if ours.count(n) > 1})
    assert not twice, f"imported more than once: {twice}"
