"""Plugins build on the core's public backend API only, so that a third party builds on
exactly what the first-party plugins use: from the core, a plugin imports ``pallas_core.backend``
(everything a backend needs that is not user-facing), the kernel-author API ``pallas_core``
(``import pallas_core as pl`` and the names of its ``__all__``) and the conformance suite
``pallas_core.testing``, and nothing else: no other core module, public (``pallas_core.errors``,
``pallas_core.primitives``, ...) or private (``pallas_core._jax``), and no underscored name.
From another plugin it may import public names only (SparseCore builds on Mosaic TPU's), never
a private module or name; its own private names are its own.

The check reads each plugin package's source with ``ast``: imports anywhere in a module
(function-local ones too) and attribute reads through an imported module (``alias._y``,
``pl.primitives``) are checked, and each forbidden one fails, naming the file and the line.
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

CORE_API = frozenset(pallas_core.__all__)
"""The kernel-author API: the names a plugin may import from ``pallas_core`` itself."""


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def _core(dotted: str) -> bool:
    return dotted == "pallas_core" or dotted.startswith("pallas_core.")


def _allowed_core_module(dotted: str) -> bool:
    """``pallas_core.backend``, or the conformance suite ``pallas_core.testing`` (and its
    public submodules)."""
    return not _private(dotted) and (
        dotted == "pallas_core.backend" or dotted == "pallas_core.testing"
        or dotted.startswith("pallas_core.testing."))


def _plugin(top: str, own: str | None) -> bool:
    """Whether ``top`` (a top-level package) is another plugin than ``own``."""
    return top.startswith("pallas_") and top != "pallas_core" and top != own


def private_uses(source: str, filename: str = "<source>", package: str | None = None
                 ) -> list[str]:
    """``file:line: what`` for every forbidden import in ``source``, a module of the plugin
    package ``package``: a core module other than ``pallas_core`` (names of its ``__all__``),
    ``pallas_core.backend`` and ``pallas_core.testing``; an underscored core name; another
    plugin's private module or name. Imports anywhere count (function-local ones too), and
    so do attribute reads through an imported module (``alias._name``, ``pl.primitives``)."""
    found: list[str] = []
    # local name -> what it is bound to: "api" (the pallas_core package), "core" (an allowed
    # core module), "plugin" (a module or name of another plugin)
    aliases: dict[str, str] = {}

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{getattr(node, 'lineno', 0)}: {what}")

    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                if _core(a.name):
                    if a.name != "pallas_core" and not _allowed_core_module(a.name):
                        report(node, f"import {a.name}")
                    elif a.asname:
                        aliases[a.asname] = "api" if a.name == "pallas_core" else "core"
                    else:
                        aliases["pallas_core"] = "api"
                elif _plugin(top, package):
                    if _private(a.name):
                        report(node, f"import {a.name}")
                    aliases[a.asname or top] = "plugin"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            top = node.module.split(".")[0]
            if node.module == "pallas_core":
                for a in node.names:
                    if _allowed_core_module(f"pallas_core.{a.name}"):
                        aliases[a.asname or a.name] = "core"
                    elif a.name not in CORE_API:
                        report(node, f"from pallas_core import {a.name}")
            elif _core(node.module):
                if not _allowed_core_module(node.module):
                    report(node, f"from {node.module} import ...")
                    continue
                for a in node.names:
                    if _private(a.name):
                        report(node, f"from {node.module} import {a.name}")
                    else:
                        aliases[a.asname or a.name] = "core"
            elif _plugin(top, package):
                if _private(node.module):
                    report(node, f"from {node.module} import ...")
                    continue
                for a in node.names:
                    if _private(a.name):
                        report(node, f"from {node.module} import {a.name}")
                    aliases[a.asname or a.name] = "plugin"
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        chain: list[str] = []  # the outermost attribute chain ``root.a.b``, read backwards
        part: ast.expr = node
        while isinstance(part, ast.Attribute):
            chain.insert(0, part.attr)
            part = part.value
        if not isinstance(part, ast.Name) or part.id not in aliases:
            continue
        kind, attrs = aliases[part.id], chain
        if kind == "api":
            first = attrs[0]
            if _allowed_core_module(f"pallas_core.{first}"):
                kind, attrs = "core", attrs[1:]
            elif first not in CORE_API and not first.startswith("__"):
                report(node, f"{part.id}.{first}")
                continue
        for k, attr in enumerate(attrs):
            if attr.startswith("_") and not attr.startswith("__"):
                report(node, ".".join([part.id, *chain[:len(chain) - len(attrs) + k + 1]]))
                break
    return found


def _package_of(path: pathlib.Path) -> str:
    """The top-level package that ``path`` (a module of a plugin package) belongs to:
    ``plugins/<dist>/<package>/...`` or ``tests/third_party_backend/<package>/...``."""
    return path.relative_to(ROOT).parts[2]


def test_plugins_import_only_the_backend_api_and_public_plugin_names() -> None:
    assert len(PACKAGES) >= 6, PACKAGES
    found = []
    for package in PACKAGES:
        for path in sorted(package.rglob("*.py")):
            found += private_uses(path.read_text(), str(path.relative_to(ROOT)),
                                  _package_of(path))
    assert not found, (
        "plugins import from the core only pallas_core.backend, pallas_core (the names of its "
        "__all__) and pallas_core.testing, and only other plugins' public names; forbidden "
        "uses:\n" + "\n".join(found))


@pytest.mark.parametrize("lines", [
    # private core modules and names
    ["from pallas_core import _jax"],
    ["import pallas_core._jax as j"],
    ["from pallas_core._jax import Primitive"],
    ["from pallas_core.backend import _ref_and_transforms"],
    ["import pallas_core", "pallas_core._jax.Primitive"],
    ["import pallas_core.backend as b", "b._primitives"],
    # public core modules other than pallas_core.backend, and names taken from them
    ["from pallas_core.errors import PallasError"],
    ["from pallas_core.primitives import _ref_and_transforms"],
    ["from pallas_core import primitives as prims"],
    ["import pallas_core.primitives"],
    ["import pallas_core.emulation.machine as m"],
    ["import pallas_core as pl", "pl.primitives.get_p"],
    ["import pallas_core as pl", "pl.core_map"],
    ["from pallas_core import DeviceIdType"],
    ["def f():", "    from pallas_core.semantics import fresh_buffer"],
    # another plugin's private modules and names
    ["from pallas_mosaic_tpu.lowering import _view"],
    ["from pallas_mosaic_tpu._private import view"],
    ["import pallas_mosaic_tpu.lowering as l", "l._view"],
    ["import pallas_mosaic_tpu", "pallas_mosaic_tpu.lowering._view"],
    ["from pallas_mosaic_tpu import lowering", "lowering.Lowering._state"],
    ["def f():", "    from pallas_triton.ir import _helper"],
])
def test_each_kind_of_forbidden_use_is_reported_with_its_line(lines: list[str]) -> None:
    source = "\n".join(["import jax", "from pallas_core import backend as plb", *lines, ""])
    found = private_uses(source, "plugin.py", "pallas_sparsecore")
    line = 2 + len(lines)
    assert found and all(f.startswith(f"plugin.py:{line}: ") for f in found), found


@pytest.mark.parametrize("lines", [
    ["import pallas_core as pl", "pl.BlockSpec", "pl.when", "pl.__version__"],
    ["from pallas_core import ANY, PallasError, kernel"],
    ["from pallas_core import backend as plb", "plb.Primitive", "plb.EmulatorRule"],
    ["import pallas_core.backend as plb", "plb.get_p"],
    ["import pallas_core.backend", "pallas_core.backend.get_p"],
    ["from pallas_core.backend import PallasError, get_p"],
    ["from pallas_core.testing import ConformanceSuite"],
    ["from pallas_core import testing", "testing.ConformanceSuite"],
    ["from pallas_mosaic_tpu.lowering import ref_view", "import pallas_mosaic_tpu as pltpu",
     "pltpu.VMEM", "pltpu.lowering.ref_view"],
    ["from pallas_sparsecore.lowering import _scratch_type",
     "from pallas_sparsecore import emulator", "emulator._alloca"],
    ["def f():", "    from . import _own", "    _own._x"],
])
def test_public_uses_pass(lines: list[str]) -> None:
    source = "\n".join(lines) + "\n"
    assert private_uses(source, "plugin.py", "pallas_sparsecore") == []


def jax_internal_imports(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: what`` for every import of JAX's internals (``jax._src``) in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        found += [f"{filename}:{node.lineno}: {n}" for n in names
                  if n == "jax._src" or n.startswith("jax._src.")][:1]
    return found


def test_only_the_adapter_package_imports_jax_internals() -> None:
    """``jax._src`` is imported in ``pallas_core/_jax/`` alone (the core's adapter to JAX's
    internals, re-exported by ``pallas_core.backend``): nowhere else in the core, nor in a
    plugin."""
    adapter = ROOT / "pallas_core" / "_jax"
    assert jax_internal_imports("from jax import _src\nimport jax._src.core\n") == [
        "<source>:1: jax._src", "<source>:2: jax._src.core"]
    assert jax_internal_imports((adapter / "base.py").read_text())
    found = []
    for package in [ROOT / "pallas_core", *PACKAGES]:
        for path in sorted(package.rglob("*.py")):
            if adapter not in path.parents:
                found += jax_internal_imports(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "only pallas_core/_jax/ may import jax._src:\n" + "\n".join(found)


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
