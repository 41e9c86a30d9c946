"""The contract between the core and its backend plugins (pluggy hook specifications).

A backend is a module (or object) with hook implementations, registered under the entry-point
group ``pallas.backends``::

    [project.entry-points."pallas.backends"]
    mybackend = "my_package.plugin"

Every hook below is optional except ``pallas_describe``. Hooks that receive a request for a
named backend must answer ``None`` for requests addressed to another backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from pallas_core.emulation.call import EmulatedCall
    from pallas_core.plugins import BackendInfo
    from pallas_core.request import KernelCall, LoweringRequest
    from pallas_core.semantics import PrimitiveSemantics
    from pallas_core.spec import MemorySpace

PROJECT = "pallas"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
"""Decorator for a plugin's hook implementations: ``@hookimpl def pallas_describe(): ...``."""


@hookspec
def pallas_describe() -> BackendInfo:
    """Describe this backend: name, version, platforms, CompilerParams type, capabilities.

    Required. Called once, when the plugin is loaded.

    :return: a :class:`pallas_core.BackendInfo`.
    Since 0.1.
    """
    raise NotImplementedError


@hookspec(firstresult=True)
def pallas_lower(request: LoweringRequest) -> Sequence[Any] | None:
    """Lower one ``pallas_call`` for ``request.backend``.

    :param request: the frozen :class:`pallas_core.LoweringRequest` (the kernel jaxpr, the
        grid mapping, compiler params, the MLIR lowering context and operands).
    :return: the MLIR values of the call's outputs, or ``None`` if ``request.backend`` is not
        this plugin. First non-``None`` result wins.
    Since 0.1.
    """


@hookspec(firstresult=True)
def pallas_stages(call: KernelCall, backend: str, target: str | None) -> Mapping[str, Any] | None:
    """Named compilation stages of ``call`` for ``backend`` (``None`` if not this plugin).

    :param call: the kernel and its grid mapping, as bound in the program.
    :param target: a backend-specific target (e.g. ``"sm_90"``), or ``None`` for the default.
    :return: stage name -> text or bytes, in pipeline order (e.g. ``stablehlo``, ``ttir``,
        ``ptx``). The core adds ``jaxpr`` itself. First non-``None`` result wins.
    Since 0.1.
    """


@hookspec
def pallas_memory_spaces() -> Sequence[MemorySpace]:
    """The memory spaces this plugin defines for Refs and scratch buffers.

    :return: the spaces (``MemorySpace(name, backend=...)``); the first is the default.
    Since 0.1.
    """
    raise NotImplementedError


@hookspec
def pallas_meshes() -> Mapping[str, Any]:
    """Constructors of meshes for ``pl.kernel``/``pl.core_map`` on this plugin's hardware.

    :return: constructor name -> callable returning a :class:`pallas_core.Mesh`.
    Since 0.1.
    """
    raise NotImplementedError


@hookspec
def pallas_primitives() -> Sequence[PrimitiveSemantics]:
    """The primitives this plugin adds, each with its reference semantics.

    The interpreter runs a kernel that uses them through these semantics, without importing
    the plugin that defines them.

    :return: :class:`pallas_core.PrimitiveSemantics` records.
    Since 0.1.
    """
    raise NotImplementedError


@hookspec
def pallas_validate(call: KernelCall, backend: str) -> None:
    """Check ``call`` against ``backend``'s hardware before lowering; raise a ``PallasError``.

    Plugins other than ``backend`` do nothing. Messages must say what was expected, what was
    found, and the fix (e.g. "block shape (7, 100): last two dims must be divisible by (8, 128)
    ... pad to (8, 128)").
    Since 0.1.
    """


@hookspec(firstresult=True)
def pallas_emulate(call: EmulatedCall) -> Sequence[Any] | None:
    """Execute one custom call emitted for this plugin's hardware, on CPU, with numpy.

    ``pl.emulate`` lowers every kernel of a function for a hardware backend and hands each
    custom call it finds to this hook: the calls this plugin emits, and those
    ``jax.experimental.pallas`` emits for the same hardware (the same call target).

    :param call: the :class:`pallas_core.emulation.EmulatedCall`: call target, configuration,
        operands as numpy arrays, result shapes, aliases, options.
    :return: the results as numpy arrays, in order, or ``None`` if the call target (or the
        configuration's device) is not this plugin's. First non-``None`` result wins.
    Since 0.1.
    """
