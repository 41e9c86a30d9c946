"""The error hierarchy of pallas: every mistake a user can make raises a ``PallasError``.

Messages follow one pattern: what was expected, what was found, and how to fix it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])


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


class StageNotFoundError(PallasError, KeyError, IndexError):
    """``pl.stages``' result for a kernel was asked for a stage it does not have (by name, a
    ``KeyError``, or by position, an ``IndexError``)."""

    def __str__(self) -> str:  # a KeyError would quote its message
        return str(self.args[0]) if self.args else ""


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


class PluginError(PallasError):
    """A plugin's hook failed: it raised an exception that is not a ``PallasError`` (a
    deliberate refusal passes through as it is), or returned what its specification does not
    allow. The message names the backend, its distribution and the hook; the original
    exception is the ``__cause__``."""


class PluginWarning(UserWarning):
    """A plugin's broadcast hook (one every plugin answers: ``pallas_primitives``,
    ``pallas_validate_call``, ``pallas_emulate``) failed; its answer is left out, and the
    other plugins and kernels go on."""


class LoweringError(PluginError):
    """A backend could not lower a kernel (its ``pallas_lower`` hook crashed or returned
    nothing): a ``PluginError``."""


class AutodiffError(PallasError, TypeError):
    """Differentiation cannot go through a kernel: reverse mode (kernels have forward-mode
    derivatives only), or a kernel body with an operation that has no derivative."""


def unsupported(feature: str, backend: str, fix: str = "") -> UnsupportedError:
    """An ``UnsupportedError`` naming ``feature`` and ``backend``, with an optional fix."""
    msg = f"{feature} is not supported by the {backend!r} backend."
    if fix:
        msg += f" {fix}"
    return UnsupportedError(msg)


# --- errors raised inside host callbacks ---------------------------------------------------------
#
# A PallasError raised in a host callback (checked mode's reports, pl.debug_check, the emulators)
# reaches the caller wrapped by the runtime, as ``JaxRuntimeError: INTERNAL: CpuCallback error``
# with the error's text inside. The callback remembers the error here; the entry points of pallas
# (a ``pallas_call``'d function, ``pl.emulate``) re-raise it in place of the runtime's error.
# Kept for the process, not the thread: under ``shard_map`` the callbacks of the devices run in
# the runtime's threads.

_reported: collections.deque[PallasError] = collections.deque(maxlen=32)
_reported_lock = threading.Lock()


def report_from_callback(error: PallasError) -> PallasError:
    """Remembers ``error``, about to be raised inside a host callback, so that
    :func:`reraising_reports` can raise it where the runtime's wrapper of it arrives.
    Returns ``error`` (``raise report_from_callback(SomeError(...))``)."""
    with _reported_lock:
        _reported.append(error)
    return error


def reported(callback: _F) -> _F:
    """``callback`` (a host callback), with each ``PallasError`` it raises remembered as
    :func:`report_from_callback` does."""
    @functools.wraps(callback)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return callback(*args, **kwargs)
        except PallasError as e:
            report_from_callback(e)
            raise

    return run  # type: ignore[return-value]


def unlogged_reports(record: logging.LogRecord) -> bool:
    """A logging filter: ``False`` for a record of an exception that is a ``PallasError``
    remembered by :func:`report_from_callback`. JAX logs an exception raised in a host
    callback with its traceback before the runtime wraps it; this error is raised again, on
    its own, at the entry point, so the log would only print it twice."""
    error = record.exc_info[1] if record.exc_info else None
    if not isinstance(error, PallasError):
        return True
    with _reported_lock:
        return not any(e is error for e in _reported)


def reported_cause(error: BaseException) -> PallasError | None:
    """The remembered ``PallasError`` whose message the runtime's ``error`` carries (it is
    forgotten then), else ``None``."""
    if isinstance(error, PallasError):
        return None
    text = str(error)
    with _reported_lock:
        found = [e for e in _reported if str(e) and str(e) in text]
        for e in found:  # each device's callback may have raised the same error
            _reported.remove(e)
    return found[-1] if found else None


@contextlib.contextmanager
def reraising_reports() -> Iterator[None]:
    """Within the block, a runtime error that wraps a ``PallasError`` raised in a host callback
    is replaced by that ``PallasError`` (the runtime's error, which only repeats it, is left
    out of the traceback)."""
    try:
        yield
    except Exception as e:
        cause = reported_cause(e)
        if cause is None:
            raise
        from pallas_core import _jax  # errors.py is imported by everything: no cycle here

        _jax.settle_runtime_tokens()
        raise cause.with_traceback(None) from None
