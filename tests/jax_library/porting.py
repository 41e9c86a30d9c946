"""Loads JAX's own kernel library (``jax.experimental.pallas.ops``, inside the installed ``jax``)
with its Pallas imports rewritten to this project's modules, as a porting user would.

Nothing of JAX's code is stored here: the sources are read from the installed package at test
time. ``ported("tpu.flash_attention")`` returns the module ``jax.experimental.pallas.ops.tpu.
flash_attention`` as it runs against ``pallas_core`` and its plugins; sibling imports inside
the library (``from jax.experimental.pallas.ops.tpu.megablox import gmm``) get the ported
sibling too.

One more line changes: the random modules register their PRNG implementations with JAX under a
name, which JAX allows once per process. The ported ones register as ``ported_<name>`` (tag
``p<tag>``), so that JAX's own modules and the ported ones can be imported side by side (the
benchmark does); pass the implementation object itself (``jax.random.key(0,
impl=threefry.plthreefry_prng_impl)``) or its new name.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import pathlib
import re
import sys
import types

import jax.experimental.pallas.ops as _jax_ops

PREFIX = "pallas_ported_ops"
"""The package the ported library is imported under (``pallas_ported_ops.tpu.matmul``)."""

LIBRARY = pathlib.Path(_jax_ops.__file__).parent

# (pattern, replacement): only Pallas imports (and PRNG names) change; the rest is JAX's code.
REWRITES = [
    (r"^from jax\.experimental import pallas as (\w+)", r"import pallas_core as \1"),
    (r"^from jax\.experimental\.pallas import tpu as (\w+)", r"import pallas_mosaic_tpu as \1"),
    (r"^from jax\.experimental\.pallas import tpu_sc as (\w+)",
     r"import pallas_sparsecore as \1"),
    (r"^from jax\.experimental\.pallas import triton as (\w+)", r"import pallas_triton as \1"),
    (r"^from jax\.experimental\.pallas import mosaic_gpu as (\w+)",
     r"import pallas_mosaic_gpu as \1"),
    # The same imports spelled ``import jax.experimental.pallas[.backend] as name``.
    (r"^import jax\.experimental\.pallas as (\w+)", r"import pallas_core as \1"),
    (r"^import jax\.experimental\.pallas\.tpu as (\w+)", r"import pallas_mosaic_tpu as \1"),
    (r"^import jax\.experimental\.pallas\.triton as (\w+)", r"import pallas_triton as \1"),
    (r"^import jax\.experimental\.pallas\.mosaic_gpu as (\w+)",
     r"import pallas_mosaic_gpu as \1"),
    (r"jax\.experimental\.pallas\.ops\b", PREFIX),
    # A PRNG name can be registered once per process: the ported one gets its own.
    (r"^prng\.register_prng\((\w+)\)",
     r'\1 = \1._replace(name="ported_" + \1.name, tag="p" + \1.tag)\nprng.register_prng(\1)'),
]


def rewrite(source: str) -> str:
    """``source`` with its Pallas imports pointing at this project's modules."""
    for pattern, repl in REWRITES:
        source = re.sub(pattern, repl, source, flags=re.MULTILINE)
    return source


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != PREFIX and not fullname.startswith(PREFIX + "."):
            return None
        rel = fullname.split(".")[1:]
        base = LIBRARY.joinpath(*rel)
        if base.is_dir():
            return importlib.util.spec_from_loader(fullname, self, is_package=True,
                                                   origin=str(base / "__init__.py"))
        if base.with_suffix(".py").is_file():
            return importlib.util.spec_from_loader(fullname, self,
                                                   origin=str(base.with_suffix(".py")))
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        origin = pathlib.Path(module.__spec__.origin)
        if module.__spec__.submodule_search_locations is not None:
            module.__path__ = [str(origin.parent)]
        source = rewrite(origin.read_text()) if origin.is_file() else ""
        module.__file__ = str(origin)
        exec(compile(source, str(origin), "exec"), module.__dict__)


def install() -> None:
    """Makes ``pallas_ported_ops.*`` importable (idempotent)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def ported(name: str) -> types.ModuleType:
    """The library module ``jax.experimental.pallas.ops.<name>``, ported."""
    install()
    return importlib.import_module(f"{PREFIX}.{name}")
