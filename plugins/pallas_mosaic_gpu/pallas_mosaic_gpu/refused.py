"""The names of ``jax.experimental.pallas.mosaic_gpu`` that this backend refuses, from one table.

``plgpu.<name>`` exists for each of them (the package's module ``__getattr__`` hands out
:class:`Refused` objects), so that ported code imports and fails where it uses the name:
calling it (a function), constructing it (a class) or reading one of its attributes (an enum
member such as ``plgpu.LoweringSemantics.Warpgroup``) raises
:class:`pallas_core.errors.UnsupportedError` naming ``plgpu.<name>``, why it is refused and the
fix. docs/backends/mosaic_gpu_api.md lists the same names as ``refused``.
"""

from __future__ import annotations

from typing import Any, NoReturn

from pallas_core import UnsupportedNameError
from pallas_core.backend import UnsupportedError

# name: (what it is in JAX, (why, fix)): the "refused" rows of docs/backends/mosaic_gpu_api.md,
# and its "core" and "not applicable" rows, whose fix names the equivalent.
REFUSED: dict[str, tuple[str, tuple[str, str]]] = {}
"""Empty since every name of JAX's module works here; kept for names a later JAX adds."""


def message(name: str) -> str:
    """The refusal of ``plgpu.<name>``: what it is, why it is refused and the fix."""
    what, (why, fix) = REFUSED[name]
    return (f"plgpu.{name} ({what} in jax.experimental.pallas.mosaic_gpu) is not supported by "
            f"the mosaic_gpu backend: {why}. Fix: {fix}.")


class Refused:
    """``plgpu.<name>`` for a refused name: using it raises ``UnsupportedError``."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise UnsupportedError(message(self._name))

    def __getattr__(self, attr: str) -> NoReturn:
        if attr.startswith("__"):
            raise AttributeError(attr)  # protocols (copy, pickle, inspect) see a plain object
        raise UnsupportedNameError(f"{message(self._name)} (reading .{attr})")

    def __getitem__(self, key: Any) -> NoReturn:
        raise UnsupportedError(message(self._name))

    def __repr__(self) -> str:
        return f"<plgpu.{self._name}: refused>"


_OBJECTS = {name: Refused(name) for name in REFUSED}


def module_getattr(name: str) -> Refused:
    """The ``__getattr__`` of ``pallas_mosaic_gpu``: a :class:`Refused` for refused names."""
    try:
        return _OBJECTS[name]
    except KeyError:
        raise AttributeError(f"module 'pallas_mosaic_gpu' has no attribute {name!r}") from None
