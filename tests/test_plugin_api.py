"""Plugins build on the core's public API only (``pallas_core.backend`` and the other public
modules), never on a private module (``pallas_core._jax``) or an underscored name, so that a
third party builds on exactly what the first-party plugins use.

The check reads each plugin package's source with ``ast``: imports of ``pallas_core._x``,
``from pallas_core import _x``, ``from pallas_core.x import _y``, and attribute reads
``alias._y`` of an imported core module all fail, naming the file and the line.
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

import pytest

import pallas_core
from pallas_core import backend as plb

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = sorted([*ROOT.glob("plugins/*/pallas_*"), ROOT / "tests/third_party_backend"])
"""The first-party plugin packages and the test backend."""


def _private(dotted: str) -> bool:
    return any(part.startswith("_") for part in dotted.split("."))


def private_uses(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: what`` for every use of a private core module or name in ``source``."""
    found: list[str] = []
    aliases: set[str] = set()  # local names bound to a core module

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{getattr(node, 'lineno', 0)}: {what}")

    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "pallas_core" or a.name.startswith("pallas_core."):
                    if _private(a.name):
                        report(node, f"import {a.name}")
                    aliases.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == "pallas_core" or node.module.startswith("pallas_core.")):
            if _private(node.module):
                report(node, f"from {node.module} import ...")
                continue
            for a in node.names:
                if a.name.startswith("_"):
                    report(node, f"from {node.module} import {a.name}")
                elif _is_core_module(f"{node.module}.{a.name}"):
                    aliases.add(a.asname or a.name)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
                and node.value.id in aliases):
            report(node, f"{node.value.id}.{node.attr}")
    return found


def _is_core_module(dotted: str) -> bool:
    rel = dotted.split(".")[1:]
    base = pathlib.Path(pallas_core.__file__).parent.joinpath(*rel)
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def test_plugins_import_nothing_private_from_the_core() -> None:
    assert len(PACKAGES) >= 6, PACKAGES
    found = []
    for package in PACKAGES:
        for path in sorted(package.rglob("*.py")):
            found += private_uses(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, (
        "plugins must import only the core's public API (pallas_core.backend and the other "
        "public modules); private uses:\n" + "\n".join(found))


@pytest.mark.parametrize("lines", [
    ["from pallas_core import _jax"],
    ["import pallas_core._jax as j"],
    ["from pallas_core._jax import Primitive"],
    ["from pallas_core.primitives import _ref_and_transforms"],
    ["from pallas_core import primitives as p", "p._ref_and_transforms(1, 2, 'f')"],
    ["import pallas_core", "pallas_core._jax.Primitive"],
])
def test_each_kind_of_private_use_is_reported_with_its_line(lines: list[str]) -> None:
    source = "\n".join(["import jax", "from pallas_core import backend as plb", *lines, ""])
    found = private_uses(source, "plugin.py")
    line = 2 + len(lines)
    assert found and all(f.startswith(f"plugin.py:{line}: ") for f in found), found


def test_public_uses_pass() -> None:
    source = ("import pallas_core as pl\nfrom pallas_core import backend as plb\n"
              "from pallas_core.spec import ANY\nplb.Primitive\npl.__version__\n")
    assert private_uses(source) == []


def test_the_backend_module_exports_only_public_documented_names() -> None:
    assert plb.__doc__
    for name in plb.__all__:
        assert not name.startswith("_"), name
        assert hasattr(plb, name), f"pallas_core.backend.__all__ names missing {name!r}"
        listed = re.search(rf"\b{name}\b", plb.__doc__) is not None
        assert listed or getattr(plb, name).__doc__, (
            f"pallas_core.backend.{name} is neither documented nor listed in the module's "
            "docstring")


@pytest.mark.parametrize("package", ["pallas_triton", "pallas_mosaic_tpu", "pallas_sparsecore",
                                     "pallas_mosaic_gpu"])
def test_every_mlir_backend_exposes_its_rule_table_with_the_shared_signature(
        package: str) -> None:
    """``<plugin>.plugin.lowering_rules()`` returns the full table, read-only, keyed by
    primitive, and every rule takes ``(state, eqn, *in_values)`` (``plb.Rule``)."""
    plugin = pytest.importorskip(f"{package}.plugin")
    rules = plugin.lowering_rules()
    assert len(rules) > 50
    with pytest.raises(TypeError):
        rules[object()] = None  # type: ignore[index]
    for prim, fn in rules.items():
        assert isinstance(prim, plb.Primitive), prim
        params = list(inspect.signature(fn).parameters.values())
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        assert len(positional) >= 2, (prim, fn)
        required_kw = [p.name for p in params
                       if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
        assert not required_kw, (prim, fn, required_kw)
