"""Mosaic TPU's rules for debugging a kernel: ``pl.debug_print`` (``tpu.log`` and
``tpu.log_buffer``), ``checkify.debug_check`` and ``pl.debug_check`` (``cf.assert``), and
``jax.debug.callback``, which a TPU kernel cannot run (dropped with a warning)."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, cf, memref, vector
from jaxlib.mosaic.python import tpu

from pallas_core import backend as plb
from pallas_mosaic_tpu import ir as mir
from pallas_mosaic_tpu.registry import Lowering, rule


@rule(plb.debug_callback_p)
def _debug_callback(lowering: Lowering, eqn: Any, *args: Any) -> list[Any]:
    """``jax.debug.callback`` (and ``jax.debug.print``): a TPU kernel cannot call the host,
    so nothing is emitted, as in JAX's lowering; a warning says so where the kernel is
    lowered (``pl.debug_print`` prints from a TPU kernel)."""
    warnings.warn(f"jax.debug.callback in Mosaic TPU kernel {lowering.call.name!r} at "
                  f"{plb.source_line(eqn)} does nothing on a TPU (a kernel cannot call the "
                  "host; JAX's lowering drops it too). Fix: print with pl.debug_print, or run "
                  "the kernel with backend='interpret', where the callback runs.",
                  stacklevel=2)
    return []


def _assert(ok: ir.Value, message: str) -> None:
    """``cf.assert`` of a scalar ``ok`` (an ``i1``, or a vector of one element)."""
    if mir.shape_of(ok):
        ok = vector.ExtractOp(ok, [], [0] * len(mir.shape_of(ok))).result
    cf.AssertOp(ok, message)


@rule(plb.check_p)
def _check(lowering: Lowering, eqn: Any, *args: ir.Value) -> list[Any]:
    """``checkify.debug_check`` as JAX lowers it: ``cf.assert`` that the failure predicate is
    False, while ``pl.enable_debug_checks`` is on (nothing otherwise)."""
    found = plb.debug_check_to_assert(lowering, eqn)
    if found is None:
        return []
    index, message = found
    fails = args[index]
    _assert(arith.XOrIOp(fails, mir.constant(True, np.bool_, ())).result, message)
    return []


@rule(plb.debug_check_p)
def _debug_check(lowering: Lowering, eqn: Any, ok: ir.Value) -> list[Any]:
    """``pl.debug_check`` (traced only while ``pl.enable_debug_checks`` is on): ``cf.assert``,
    as JAX lowers it."""
    _assert(ok, eqn.params["message"])
    return []


_TYPED_LOG = jax.__version_info__ >= (0, 11)
"""Whether ``tpu.log`` placeholders name their type (``$s0``, ``$f1``: JAX 0.11 on, which logs
floats too) or are bare (``$0``: JAX 0.10, 32-bit integers only)."""


def _log_spec(dtype: Any) -> str | None:
    """How ``tpu.log`` formats a 32-bit scalar (``f``, ``s``, ``u``; ``""`` before JAX 0.11),
    else ``None``."""
    dt = np.dtype(dtype)
    if dt.itemsize != 4 or dt.kind not in ("fiu" if _TYPED_LOG else "iu"):
        return None
    return {"f": "f", "i": "s", "u": "u"}[dt.kind] if _TYPED_LOG else ""


@rule(plb.debug_print_p)
def _debug_print(lowering: Lowering, eqn: Any, *args: ir.Value) -> list[Any]:
    """``pl.debug_print`` as JAX lowers it: scalars through ``tpu.log`` (placeholders become
    ``$s0``, ``$u1``, ``$f2``...), one array (its placeholder last) copied into a VMEM buffer
    for ``tpu.log_buffer``."""
    fmt = eqn.params["fmt"]
    avals = [v.aval for v in eqn.invars]
    if all(a.shape == () for a in avals):
        specs = [_log_spec(a.dtype) for a in avals]
        if None in specs:
            bad = next(a.dtype for a, sp in zip(avals, specs) if sp is None)
            what = "32-bit integers and floats" if _TYPED_LOG else "32-bit integers (and floats " \
                "from JAX 0.11 on)"
            raise lowering.fail(f"pl.debug_print of a {np.dtype(bad).name} scalar (TPUs log "
                                f"{what})", eqn)
        pieces = fmt.split("{}")
        tag = "".join(f"{p}${sp}{k}" for k, (p, sp) in enumerate(zip(pieces, specs)))
        tpu.LogOp(list(args), tag + pieces[-1], formatted=bool(args))
        return []
    if len(args) != 1 or not fmt.endswith("{}"):
        raise lowering.fail("pl.debug_print of an array with other values, or with its "
                            "placeholder not at the end (TPUs log scalars, or one array "
                            "after a prefix)", eqn)
    (aval,), (value,) = avals, args
    region = tpu.RegionOp([])
    with ir.InsertionPoint(region.body):
        buf = memref.AllocaOp(mir.memref(aval.shape, aval.dtype, "vmem"), [], []).result
        vector.StoreOp(value, buf, [mir.index(0)] * len(aval.shape))
        tpu.LogBufferOp(buf, list(aval.shape), fmt[:-2])
        tpu.YieldOp([])
    return []
