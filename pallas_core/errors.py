"""The error hierarchy of pallas: every mistake a user can make raises a ``PallasError``.

Messages follow one pattern: what was expected, what was found, and how to fix it.
"""

from __future__ import annotations


class PallasError(Exception):
    """Base class of every error pallas raises for a user's or a plugin's mistake."""


class BackendNotFoundError(PallasError, LookupError):
    """``backend=`` named a backend that is not installed (or is disabled)."""


class PluginLoadError(PallasError):
    """A backend plugin failed to import or implements a hook wrongly."""


class PluginConfigError(PallasError, ValueError):
    """An environment variable that controls plugin loading has a value it cannot take."""


class PluginLoadWarning(UserWarning):
    """Installed backend plugins failed to load (warned once, on first use of the plugins)."""


class UnsupportedError(PallasError, NotImplementedError):
    """A feature is not supported by the chosen backend."""


class UnsupportedNameError(UnsupportedError, AttributeError):
    """A name of ``jax.experimental.pallas`` that pallas does not provide (yet).

    Raised when the name is looked up (``pl.get_global``); an ``AttributeError`` too, so that
    ``hasattr(pl, name)`` is False.
    """


class ArgumentError(PallasError, ValueError):
    """An argument of a pallas function has a value it cannot take."""


class BlockSpecError(PallasError, ValueError):
    """A BlockSpec, GridSpec or index map does not fit the operands."""


class KernelSignatureError(PallasError, TypeError, ValueError):
    """The kernel's parameters do not match the operands, outputs and scratch buffers, or the
    kernel returns a value or captures arrays. Both a ``TypeError`` and a ``ValueError``: JAX
    raises one or the other for these mistakes, and ported code may catch either."""


class IndexMapSignatureError(BlockSpecError, TypeError):
    """An index map cannot be called with the grid indices (and scalar-prefetch Refs)."""


class KernelTraceError(PallasError, ValueError):
    """The kernel body raised while being traced (a shape mismatch, a bad index, ...)."""


class OutOfBoundsError(PallasError, IndexError):
    """An index map returned a block index outside its array, or a kernel indexes a Ref
    outside its bounds (a constant index or static slice at trace time; checked mode reports
    the others when the kernel runs)."""


class LoweringError(PallasError):
    """A backend could not lower a kernel."""


class AutodiffError(PallasError, TypeError):
    """Differentiation cannot go through a kernel: reverse mode (kernels have forward-mode
    derivatives only), or a kernel body with an operation that has no derivative."""


def unsupported(feature: str, backend: str, fix: str = "") -> UnsupportedError:
    """An ``UnsupportedError`` naming ``feature`` and ``backend``, with an optional fix."""
    msg = f"{feature} is not supported by the {backend!r} backend."
    if fix:
        msg += f" {fix}"
    return UnsupportedError(msg)
