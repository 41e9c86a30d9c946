"""Which backend runs a kernel call, and the checks a call passes before that backend lowers it.

:func:`resolve_backend` applies the order of choice at call time (``backend=`` >
``interpret=``, a forced interpret mode counting as one > the type of ``compiler_params``); where
it chooses none, the primitive's lowering rule takes the platform's default backend.
:func:`validate` checks a call against the chosen backend's capabilities, memory spaces and
compiler params, then runs the backend's ``pallas_validate`` hook and every plugin's
``pallas_validate_call``; :func:`unvalidated` turns it off for ``pl.report``."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from pallas_core import _jax
from pallas_core.errors import ArgumentError, UnsupportedError
from pallas_core.plugins import Capability, manager
from pallas_core.request import KernelCall
from pallas_core.spec import BoundedSlice, Element

_COMPILER_PARAMS_KEYS = {"mosaic": "mosaic_tpu", "mosaic_tpu": "mosaic_tpu",
                         "triton": "triton", "mosaic_gpu": "mosaic_gpu"}


def resolve_backend(backend: str | None, compiler_params: Any, interpret: Any) -> str | None:
    """The backend chosen at call time: ``backend=`` > ``interpret=`` > params type.

    ``interpret=`` outranks the type of ``compiler_params`` as in JAX: kernels written for a
    backend pass its params together with ``interpret=True`` to run on CPU. A forced
    interpret mode (:func:`force_interpret_mode`, ``pltpu.force_tpu_interpret_mode()``) counts
    as ``interpret=`` its params, in place of the call's own (as in JAX).
    """
    if backend is not None:
        if not isinstance(backend, str):
            raise ArgumentError(f"backend= must be a backend name (str), found {backend!r}.")
        return manager.get(backend).info.name
    interpret = interpret_in_force(backend, interpret)
    if interpret is not None and interpret is not False:
        name = getattr(type(interpret), "BACKEND", None) if is_interpret_params(interpret) else None
        return manager.get(name if isinstance(name, str) else "interpret").info.name
    if compiler_params is not None:
        if isinstance(compiler_params, Mapping):
            keys = [_COMPILER_PARAMS_KEYS.get(str(k), str(k)) for k in compiler_params]
            if len(keys) == 1:
                return manager.get(keys[0]).info.name
        else:
            name = manager.backend_for_params(compiler_params)
            if name is None:
                raise ArgumentError(
                    f"compiler_params of type {type(compiler_params).__name__} belong to no "
                    f"installed backend (installed: {', '.join(sorted(manager.backends()))}). "
                    "Fix: pass the CompilerParams class of the backend you mean (e.g. "
                    "pallas_interpret.CompilerParams), or install the backend they belong to.")
            return manager.get(name).info.name
    return None


def is_interpret_params(interpret: Any) -> bool:
    """``interpret=`` is a params object (``pltpu.InterpretParams(...)``), not a flag."""
    return not isinstance(interpret, (bool, int, np.integer))


# Part of jax.jit's cache key: a function traced outside forced interpret mode is traced again
# inside it, instead of reusing a trace that lowers for the hardware.
_FORCED_INTERPRET = _jax.jit_keyed_setting("pallas_core_forced_interpret")


def forced_interpret_params() -> Any:
    """The ``interpret=`` value forced on every ``pallas_call`` now (``None``: none is)."""
    return _FORCED_INTERPRET.value


@contextlib.contextmanager
def force_interpret_mode(params: Any = True) -> Iterator[None]:
    """Within the block, every ``pallas_call`` and ``pl.kernel`` traced runs as if called with
    ``interpret=params`` (``True``, or an interpreter params object), in place of its own
    ``interpret=`` as in JAX: kernels run on CPU without editing their source. ``None`` turns
    it off."""
    prev = _FORCED_INTERPRET.swap_local(params)
    try:
        yield
    finally:
        _FORCED_INTERPRET.set_local(prev)


def interpret_in_force(backend: str | None, interpret: Any) -> Any:
    """The ``interpret=`` a call runs with: a forced interpret mode wins over the call's own, as
    in JAX, unless the call names its backend."""
    forced = forced_interpret_params()
    return forced if backend is None and forced is not None else interpret


def set_interpret_mode(params: Any = True) -> None:
    """Forces ``interpret=params`` on every later ``pallas_call`` in this process, until called
    again (``None`` turns it off); :func:`force_interpret_mode` is the scoped form."""
    _FORCED_INTERPRET.set_global(params)


def _check_grid_and_block_forms(call: KernelCall, backend: str,
                                capabilities: frozenset[Capability]) -> None:
    """Raises ``UnsupportedError`` for a dynamic grid, a symbolic block shape or an
    element-indexed block dimension that ``backend`` does not declare it lowers (capabilities
    ``DYNAMIC_GRID``, ``SYMBOLIC_BLOCKS``, ``ELEMENT_BLOCKS``, ``BOUNDED_SLICE_BLOCKS``)."""
    gm = call.grid_mapping
    found: list[tuple[Capability, str, str]] = []
    if gm.dynamic_axes:
        found.append((Capability.DYNAMIC_GRID, f"its grid {gm.user_grid} has dynamic sizes",
                      "give the grid Python int sizes (e.g. a static upper bound, skipping "
                      "the extra steps with pl.when)"))
    symbolic = [bm for bm in gm.block_mappings
                if not _jax.is_static_shape([b for b in bm.block_shape if b is not None])]
    if symbolic:
        found.append((Capability.SYMBOLIC_BLOCKS,
                      f"{symbolic[0].origin} has the symbolic block shape "
                      f"{symbolic[0].block_shape} (jax.export with shape polymorphism)",
                      "give every block static sizes (the backend compiles a kernel for "
                      "static block shapes), or export for TPU (backend='mosaic_tpu')"))
    for bm in gm.block_mappings:
        for d in bm.dims:
            if isinstance(d, Element):
                found.append((Capability.ELEMENT_BLOCKS, f"{bm.origin} has block dimension {d}",
                              "use block-indexed dimensions (ints), padding the array "
                              "yourself"))
            elif isinstance(d, BoundedSlice):
                found.append((Capability.BOUNDED_SLICE_BLOCKS,
                              f"{bm.origin} has block dimension {d}",
                              "use a full block and mask the unused part in the kernel"))
    for capability, what, fix in found:
        if capability not in capabilities:
            raise UnsupportedError(
                f"kernel {call.name!r}: {what}, which backend {backend!r} does not support. "
                f"Fix: {fix}, or run it with backend='interpret'.")


_UNCHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar("pallas_unchecked",
                                                                  default=False)


@contextlib.contextmanager
def unvalidated() -> Iterator[None]:
    """Inside, kernels are traced without their backend's checks (``pl.report`` checks each
    itself, and reports a refusal instead of raising it)."""
    token = _UNCHECKED.set(True)
    try:
        yield
    finally:
        _UNCHECKED.reset(token)


def validating() -> bool:
    """Whether kernels are validated for their backend as they are traced (outside
    :func:`unvalidated`)."""
    return not _UNCHECKED.get()


def _check_params_owner(call: KernelCall, backend: str, info: Any) -> None:
    """Refuses compiler params of a backend for another platform (Triton's on Mosaic TPU, and
    the reverse): the chosen backend would drop them without a word; JAX refuses them too. A
    backend for the same platform may read another's (SparseCore reads Mosaic TPU's)."""
    params = call.compiler_params
    if params is None or isinstance(params, Mapping):
        return  # {"triton": {...}, "mosaic_tpu": {...}}: each backend reads its own entry
    owner = manager.backend_for_params(params)
    if owner is None or owner == backend or owner not in manager.backends():
        return
    if set(manager.get(owner).info.platforms) & set(info.platforms):
        return
    raise UnsupportedError(
        f"kernel {call.name!r} ({call.source}) has compiler_params of the {owner!r} backend "
        f"({type(params).__module__}.{type(params).__name__}), but is compiled by {backend!r}, "
        f"which would ignore them (JAX refuses such params too). Fix: pass {backend!r}'s own "
        f"CompilerParams, or backend={owner!r}; to give both, pass a mapping "
        f"{{{owner!r}: ..., {backend!r}: ...}}.")


def validate(call: KernelCall, backend: str) -> None:
    """Checks ``call`` for ``backend``: memory spaces here, the hardware rules in the plugin."""
    info = manager.get(backend).info
    _check_grid_and_block_forms(call, backend, info.capabilities)
    if Capability.FOREIGN_MEMORY_SPACES not in info.capabilities:
        _check_params_owner(call, backend, info)
        spaces = [(bm.origin, bm.memory_space) for bm in call.grid_mapping.block_mappings]
        spaces += [(f"scratch {i}", a.memory_space)
                   for i, a in enumerate(call.grid_mapping.scratch_avals)]
        declared = manager.memory_spaces(backend)
        for origin, space in spaces:
            owner = getattr(space, "backend", None)
            # A backend may adopt another's memory spaces (SparseCore uses pltpu.VMEM, ...).
            if owner is not None and owner != backend and not any(space is d for d in declared):
                raise UnsupportedError(
                    f"kernel {call.name!r}: {origin} is in memory space {space}, which belongs "
                    f"to the {owner!r} backend, but the kernel is lowered by {backend!r}. Fix: "
                    f"pass backend={owner!r}, or use a memory space of {backend!r} (or pl.ANY)."
                )
    if Capability.PIPELINE_MODE not in info.capabilities:
        for bm in call.grid_mapping.block_mappings:
            if bm.pipeline_mode is not None:
                raise UnsupportedError(
                    f"kernel {call.name!r}: {bm.origin} has pipeline_mode={bm.pipeline_mode}, "
                    f"but the {backend!r} backend has no pipelines whose buffers pl.Buffered "
                    "could set. Fix: drop pipeline_mode= for this backend (it never changes "
                    "results).")
    manager.call_hook(backend, "pallas_validate", call=call)
    manager.broadcast("pallas_validate_call", call=call, backend=backend)
