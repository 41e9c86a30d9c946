"""Names JAX moved or removed, kept working here on every supported JAX version.

``jax.experimental.pallas`` and its backend modules move names between releases
(``pl.reciprocal`` went to ``pltpu`` in 0.11, ``pl.core_map`` gave way to ``pl.kernel``, ...).
Code written for any supported release runs here unchanged: the old spelling keeps working
and, from the JAX release on which JAX itself warns, warns the same way (a
``DeprecationWarning`` that says what to write instead). A module lists its moved names in a
:class:`Deprecations` and takes its ``__getattr__`` and ``__dir__`` from it; the names stay in
``dir()``, so code that enumerates the module finds them, as it does in the JAX releases that
still list them.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pallas_core import _jax

__all__ = ["Deprecated", "Deprecations"]


@dataclasses.dataclass(frozen=True)
class Deprecated:
    """One moved or removed name.

    ``where`` is ``"module:attribute"``, what the name still means; ``message`` says what to
    write instead; ``since`` is the JAX release (major, minor) from which JAX warns for it (a
    JAX that does not warn yet gets no warning here either).
    """

    where: str
    message: str
    since: tuple[int, int] = (0, 0)

    def resolve(self) -> Any:
        module, _, attribute = self.where.partition(":")
        return getattr(importlib.import_module(module), attribute)

    def warns(self) -> bool:
        """Whether the installed JAX warns for this name."""
        return _jax.JAX_VERSION[:2] >= self.since


class Deprecations:
    """A module's moved names: its ``__getattr__`` (:meth:`getattr`) and ``__dir__``
    (:meth:`dir`). Names the module does not have go to ``missing(name)``, which returns or
    raises (an ``AttributeError`` by default)."""

    def __init__(self, module: str, module_globals: Mapping[str, Any],
                 names: Mapping[str, Deprecated],
                 missing: Callable[[str], Any] | None = None) -> None:
        self.module = module
        self.names = dict(names)
        self._globals = module_globals
        self._missing = missing

    def getattr(self, name: str) -> Any:
        found = self.names.get(name)
        if found is not None:
            if found.warns():
                warnings.warn(found.message, DeprecationWarning, stacklevel=2)
            return found.resolve()
        if self._missing is not None:
            return self._missing(name)
        raise AttributeError(f"module {self.module!r} has no attribute {name!r}")

    def dir(self, extra: Iterable[str] = ()) -> list[str]:
        return sorted({*self._globals, *self.names, *extra})
