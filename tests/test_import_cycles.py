"""No import cycles in any package: the core (``pallas_core`` and its subpackages), every
first-party plugin package (``plugins/*/pallas_*``) and the test backend
(``tests/third_party_backend``).

The import graph is read statically with ``ast``; nothing is imported. An edge ``a -> b`` means
that running module ``a`` at import time imports module ``b``:

- Counted: imports anywhere in a module's top-level code, including inside module-level ``if``,
  ``try`` and ``with`` blocks, class bodies, and imports placed at the end of a module (a module
  that imports its rule modules after defining ``rule`` is still in a cycle with them).
- Not counted: imports inside a function or lambda body (a lazy import runs only when called, after
  both modules have finished importing, so it cannot create an import-time cycle), and imports
  under ``if TYPE_CHECKING:`` (never run).
- ``from pkg import name`` is an edge to ``pkg.name`` where that is a module of these packages,
  and to ``pkg`` otherwise; relative imports are resolved against the importing module's package.
  Importing ``a.b.c`` runs the ``__init__`` of ``a`` and ``a.b`` first, so it is also an edge to
  each of those packages, except the importer's own parent packages: they are already being
  initialised when it runs (an explicit ``from a import name`` of a name defined in
  ``a/__init__.py`` is still an edge to ``a``).

The test finds the strongly connected components of the graph (Tarjan) and fails on each one with
more than one module, printing a cycle through it as a chain.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = sorted([ROOT / "pallas_core", *ROOT.glob("plugins/*/pallas_*"),
                   *ROOT.glob("tests/third_party_backend/pallas_*")])
"""The directory of every top-level package checked."""


def package_modules(package: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of ``package`` and its subpackages."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def import_time_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module is imported (see the module docstring)."""
    stack: list[ast.AST] = list(reversed(tree.body))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
            continue
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(reversed(node.orelse))
            continue
        if isinstance(node, ast.stmt):
            # Statement bodies (if/try/with/for/class/match); expressions hold no imports.
            stack.extend(reversed(list(ast.iter_child_nodes(node))))
        elif isinstance(node, ast.excepthandler | ast.match_case):
            stack.extend(reversed(node.body))


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def import_graph(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``modules`` it imports at import time."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in import_time_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
                continue
            source = _resolve(module, is_package, node)
            for a in node.names:
                sub = f"{source}.{a.name}"
                targets.add(sub if sub in modules else source)
        own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
        parents = {".".join(t.split(".")[:i]) for t in targets for i in range(1, t.count(".") + 1)}
        # A module importing itself gets its own partly run module back: no cycle.
        graph[module] = {t for t in targets | (parents - own) if t in modules} - {module}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def cycle_through(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle from the component's first module back to itself, as a chain."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    chain = [start]
                    while node != start:
                        chain.append(node)
                        node = previous[node]
                    return [start, *reversed(chain[1:]), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {component}")


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """One line per import cycle: the modules in it, then a chain that closes it."""
    found = []
    for component in strongly_connected(graph):
        if len(component) > 1:
            chain = " -> ".join(cycle_through(graph, component))
            found.append(f"{len(component)} modules {{{', '.join(component)}}}: {chain}")
    return sorted(found)


def test_no_import_cycles_in_any_package() -> None:
    names = {p.name for p in PACKAGES}
    assert {"pallas_core", "pallas_interpret", "pallas_triton", "pallas_mosaic_tpu",
            "pallas_mosaic_gpu", "pallas_sparsecore", "pallas_xla_unrolled"} <= names, names
    modules: dict[str, pathlib.Path] = {}
    for package in PACKAGES:
        modules.update(package_modules(package))
    found = cycles(import_graph(modules))
    assert not found, "import cycles (break each with a module that imports neither side):\n" + (
        "\n".join(found))


def _graph_of(sources: dict[str, str], tmp_path: pathlib.Path) -> dict[str, set[str]]:
    for name, text in sources.items():
        path = tmp_path.joinpath(*name.split("."))
        path = path / "__init__.py" if name == "pkg" else path.with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return import_graph(package_modules(tmp_path / "pkg"))


def test_the_check_finds_a_cycle_closed_at_a_module_end(tmp_path: pathlib.Path) -> None:
    # The mosaic_gpu shape: the registry imports its rule modules at its end.
    graph = _graph_of({
        "pkg": "",
        "pkg.rules": "def rule(): ...\nfrom pkg import rules_a  # noqa\n",
        "pkg.rules_a": "from .rules import rule\n",
    }, tmp_path)
    assert cycles(graph) == [
        "2 modules {pkg.rules, pkg.rules_a}: pkg.rules -> pkg.rules_a -> pkg.rules"]


def test_the_check_finds_a_longer_cycle_through_relative_and_absolute_imports(
        tmp_path: pathlib.Path) -> None:
    graph = _graph_of({
        "pkg": "",
        "pkg.a": "from . import b\n",
        "pkg.b": "try:\n    import pkg.c\nexcept ImportError:\n    pass\n",
        "pkg.c": "class C:\n    from pkg.a import x\n",
    }, tmp_path)
    assert cycles(graph) == [
        "3 modules {pkg.a, pkg.b, pkg.c}: pkg.a -> pkg.b -> pkg.c -> pkg.a"]


def test_lazy_and_type_checking_imports_make_no_cycle(tmp_path: pathlib.Path) -> None:
    graph = _graph_of({
        "pkg": "from pkg import a\n",
        "pkg.a": ("from typing import TYPE_CHECKING\nfrom pkg import b\n"
                  "if TYPE_CHECKING:\n    from pkg import c\n"),
        "pkg.b": "def f():\n    from pkg import a\n    return a\n",
        "pkg.c": "import pkg.a\n",
    }, tmp_path)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": set(),
                     "pkg.c": {"pkg.a"}}
    assert cycles(graph) == []
