"""``pltpu.LoweringException``: what lowering a kernel for Mosaic TPU raises when it fails."""

from __future__ import annotations

from pallas_core.backend import PallasError


class LoweringException(PallasError):  # noqa: N818 (JAX's name)
    """What lowering a kernel for Mosaic TPU raises when it fails (JAX's
    ``pltpu.LoweringException``). The error keeps its own kind too: an unsupported primitive
    is both a ``LoweringException`` and a ``pl.UnsupportedError``. (Not a ``pl.LoweringError``:
    that one marks a backend crash the core wrapped.)"""


_KINDS: dict[type, type] = {}


def as_lowering_exception(error: PallasError) -> PallasError:
    """``error`` as a :class:`LoweringException` of its own kind (same message)."""
    if isinstance(error, LoweringException):
        return error
    kind = LoweringException if issubclass(LoweringException, type(error)) else _KINDS.get(
        type(error))
    if kind is None:
        kind = _KINDS[type(error)] = type(type(error).__name__, (type(error), LoweringException),
                                          {"__module__": type(error).__module__})
    converted = kind(*error.args)
    converted.__cause__ = error.__cause__
    return converted  # type: ignore[no-any-return]
