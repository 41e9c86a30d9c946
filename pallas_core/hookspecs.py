"""The contract between the core and its backend plugins (pluggy hook specifications).

A backend is a module (or object) with hook implementations, registered under the entry-point
group ``pallas.backends``::

    [project.entry-points."pallas.backends"]
    mybackend = "my_package.plugin"

Every hook below is optional except ``pallas_describe``. The core resolves the backend of a
call once (``backend=`` > ``interpret=`` > the type of ``compiler_params`` > the platform's
default) and calls the *backend hooks* (``pallas_describe``, ``pallas_memory_spaces``,
``pallas_validate``, ``pallas_lower``, ``pallas_stages``, ``pallas_footprint``) on that
backend's plugin only, so an implementation never checks which backend it is asked for. They
go through pluggy's hook callers (``PluginManager.call_hook``), so ``firstresult``, hook
wrappers of any plugin (``@hookimpl(wrapper=True)``, registered on
``pallas_core.plugins.manager.pluggy_manager``) and pluggy's tracing see them; only
``pallas_describe`` is called directly, once, before the plugin is registered. The
*broadcast hooks* are called on every plugin: ``pallas_primitives`` (semantics of every
primitive, for every backend that interprets), ``pallas_validate_call`` (a plugin's checks of
calls that other backends run) and ``pallas_emulate`` (answered by the plugin that owns the
custom call's target).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from pallas_core.emulation.call import EmulatedCall
    from pallas_core.plugins import BackendInfo
    from pallas_core.report_work import OpCost
    from pallas_core.request import KernelCall, LoweringRequest
    from pallas_core.roofline import Chip
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
def pallas_lower(request: LoweringRequest) -> Sequence[Any]:
    """Lower one ``pallas_call`` (a backend hook: called on ``request.backend``'s plugin only).

    :param request: the frozen :class:`pallas_core.LoweringRequest` (the kernel jaxpr, the
        grid mapping, compiler params, the MLIR lowering context and operands).
    :return: the MLIR values of the call's outputs.
    Since 0.1.
    """
    raise NotImplementedError


@hookspec(firstresult=True)
def pallas_stages(call: KernelCall, target: str | None) -> Mapping[str, Any]:
    """Named compilation stages of ``call`` (a backend hook: called on the chosen plugin only).

    :param call: the kernel and its grid mapping, as bound in the program.
    :param target: a backend-specific target (e.g. ``"sm_90"``), or ``None`` for the default.
    :return: stage name -> text or bytes (or a zero-argument callable making it, run when the
        stage is first read), in pipeline order (e.g. ``stablehlo``, ``ttir``, ``ptx``). The
        core adds ``jaxpr`` itself.
    Since 0.1.
    """
    raise NotImplementedError


@hookspec(firstresult=True)
def pallas_footprint(call: KernelCall, chip: Chip | None) -> tuple[Sequence[tuple[str, int]],
                                                                   int]:
    """The on-chip memory this backend allocates for ``call`` (a backend hook, for
    ``pl.report``): its parts, as ``(what, bytes)`` (each operand's buffers, scratch, the
    backend's own internal buffers), and the limit the kernel may use on ``chip`` (one of
    this backend's ``BackendInfo.chips``; ``None`` for its default), as its lowering counts
    them: a kernel whose parts exceed the limit is the one the lowering refuses.
    Since 0.2.
    """
    raise NotImplementedError


@hookspec(firstresult=True)
def pallas_op_cost(eqn: Any) -> OpCost | None:
    """What one equation of a kernel body costs (a backend hook, for ``pl.report`` and
    ``kernel_cost``), for this backend's own primitives the core cannot count: a matrix
    instruction's flops, the HBM bytes of a copy the kernel makes (DMA, TMA). ``None`` for
    equations the core counts itself (``dot_general``, elementwise ``lax`` ops, loops).
    Since 0.2.
    """
    raise NotImplementedError


@hookspec(firstresult=True)
def pallas_op_value(eqn: Any) -> Any:
    """The value one of this backend's scalar primitives has on the hardware, where it is
    known ahead of time (a query its lowering folds to a constant, such as Mosaic GPU's
    ``warpgroups_run_concurrently``), so that ``pl.report`` decides the branches that test it;
    ``None`` where it is not known.
    Since 0.2.
    """
    raise NotImplementedError


@hookspec
def pallas_memory_spaces() -> Sequence[MemorySpace]:
    """The memory spaces this plugin defines for Refs and scratch buffers.

    :return: the spaces (``MemorySpace(name, backend=...)``); the first is the default.
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
def pallas_validate(call: KernelCall) -> None:
    """Check ``call`` against this backend's hardware before lowering; raise a ``PallasError``.

    A backend hook: called on the chosen backend's plugin only, after the core's own checks
    (platforms, memory spaces, capabilities) and before ``pallas_lower`` or ``pallas_stages``.
    Messages must say what was expected, what was found, and the fix (e.g. "block shape
    (7, 100): last two dims must be divisible by (8, 128) ... pad to (8, 128)").
    Since 0.1.
    """


@hookspec
def pallas_validate_call(call: KernelCall, backend: str) -> None:
    """Check a call that ``backend`` (possibly another plugin's) will run; raise a
    ``PallasError``.

    A broadcast hook: called on every plugin for every call, after ``backend``'s own
    ``pallas_validate``. A plugin uses it for calls that carry its own parameters but run
    elsewhere: the SparseCore plugin checks a kernel given ``plsc.CompilerParams`` against its
    chip even when the interpreter runs it (``interpret=True``), as JAX does. Calls that carry
    nothing of this plugin's must pass unchecked.
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
