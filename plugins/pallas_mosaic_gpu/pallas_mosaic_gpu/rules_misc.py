"""Lowering rules of the Mosaic GPU backend for debugging and timing (registered in
:data:`pallas_mosaic_gpu.registry.RULES`): ``pl.debug_print``, checks (``checkify.debug_check``
and ``pl.debug_check``), ``pl.delay`` and the grid-dependency instructions
(``plgpu.griddepcontrol_wait``, ``plgpu.griddepcontrol_launch_dependents``).

Each emits what JAX's Mosaic GPU lowering emits for the same operation: ``printf`` from one
thread of the warpgroup (or warp) for scalars and from every thread for an array's elements,
``cf.assert`` of a check's condition, ``nanosleep.u32`` and PTX's ``griddepcontrol``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.experimental.mosaic import gpu as mgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, cf, llvm

from pallas_core import backend as plb
from pallas_mosaic_gpu import primitives as gp
from pallas_mosaic_gpu.registry import rule
from pallas_mosaic_gpu.values import FA, Expanded, GPULowering, i32


def _ptx(asm: str) -> None:
    """An instruction of no operands, executed by every thread (it has side effects)."""
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [], asm, "", has_side_effects=True)


@rule(gp.griddepcontrol_wait_p)
def _griddepcontrol_wait(state: GPULowering, eqn: Any, **_: Any) -> Any:
    _ptx("griddepcontrol.wait;")
    return []


@rule(gp.griddepcontrol_launch_dependents_p)
def _griddepcontrol_launch_dependents(state: GPULowering, eqn: Any, **_: Any) -> Any:
    _ptx("griddepcontrol.launch_dependents;")
    return []


@rule(plb.delay_p)
def _delay(state: GPULowering, eqn: Any, nanos: Any) -> Any:
    if isinstance(nanos, FA):
        raise state.fail("pl.delay of an array")
    mgpu.nanosleep(i32(nanos))
    return []


@rule(plb.debug_print_p)
def _debug_print(state: GPULowering, eqn: Any, *args: Any, fmt: str) -> Any:
    """Scalars are printed by one thread of the warpgroup (of the warp in a ``WarpMesh``
    region); one array is printed element by element, each thread printing the elements it
    holds with their indices (``fmt``'s placeholder standing for ``[i, j]: value``)."""
    avals = [v.aval for v in eqn.invars]
    if all(not a.shape for a in avals):
        args = tuple(_scalar(state, a, "pl.debug_print of a scalar") for a in args)
        scope = (mgpu.ThreadSubset.WARP if state.warp_axis is not None
                 else mgpu.ThreadSubset.WARPGROUP)
        try:
            mgpu.debug_print(fmt, *args, scope=scope)
        except NotImplementedError as e:
            dtypes = ", ".join(np.dtype(a.dtype).name for a in avals)
            raise state.fail(f"pl.debug_print of scalars of {dtypes} ({e})") from None
        return []
    if len(args) != 1:
        raise state.fail("pl.debug_print of an array together with other values (Mosaic GPU "
                         "prints scalars, or one array)")
    if state.warp_axis is not None:
        raise state.fail("pl.debug_print of an array in a warp's code (a warp prints scalars)")
    (x,) = args
    if isinstance(x, Expanded):
        raise state.fail("pl.debug_print of an array with unit dimensions added (x[:, None])")
    try:
        x.debug_print(fmt)
    except (NotImplementedError, ValueError) as e:
        raise state.fail(f"pl.debug_print of an array in layout {x.layout} ({e})") from None
    return []


def _scalar(state: GPULowering, v: Any, what: str) -> Any:
    """A scalar's value (an array of one element, such as a reduction over every axis, gives
    its register)."""
    if isinstance(v, FA):
        if v.registers.size != 1:
            raise state.fail(f"{what} held as an array of {v.registers.size} registers")
        return v.registers.flat[0]
    return v


@rule(plb.check_p)
def _check(state: GPULowering, eqn: Any, *args: Any, **_: Any) -> Any:
    """``checkify.debug_check`` as JAX lowers it: ``cf.assert`` that the failure predicate is
    False, while ``pl.enable_debug_checks`` is on (nothing otherwise)."""
    found = plb.debug_check_to_assert(state, eqn)
    if found is None:
        return []
    index, message = found
    true = arith.constant(ir.IntegerType.get_signless(1), 1)
    fails = _scalar(state, args[index], "a check's condition")
    cf.assert_(arith.xori(fails, true), message)
    return []


@rule(plb.debug_check_p)
def _debug_check(state: GPULowering, eqn: Any, ok: Any, *, message: str) -> Any:
    """``pl.debug_check`` (traced only while ``pl.enable_debug_checks`` is on): ``cf.assert``,
    as JAX lowers its ``pl.debug_check``."""
    cf.assert_(_scalar(state, ok, "a check's condition"), message)
    return []
