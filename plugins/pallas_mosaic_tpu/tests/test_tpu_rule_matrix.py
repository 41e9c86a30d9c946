"""The shared dtype-by-operation matrix (``pallas_core.testing.rule_matrix``) on Mosaic TPU:
every entry lowers to a module that verifies and, emulated, matches ``jax.numpy``, or is
refused naming the operation, the dtype and the backend."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest
from pallas_mosaic_tpu import lowering

import pallas_core as pl
from pallas_core.stages import kernel_calls
from pallas_core.testing import rule_matrix

_emulate = rule_matrix.pallas_call_emulation("mosaic_tpu", (8, 128))


@pytest.mark.parametrize("case", rule_matrix.CASES, ids=str)
def test_rule_matrix_emulated(case: rule_matrix.Case) -> None:
    """Each entry lowers to a module that verifies and, run by ``pl.emulate`` (the module
    executed by the TPU emulator), matches ``jax.numpy``; or it is refused naming the
    operation, the dtype and the backend."""
    rule_matrix.check(case, _emulate, "mosaic_tpu")


def _module(op: Any, x: jax.Array) -> str:
    out = jax.eval_shape(op, x)

    def body(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = op(x_ref[...])

    f = pl.pallas_call(body, jax.ShapeDtypeStruct(out.shape, out.dtype), backend="mosaic_tpu")
    (call,) = kernel_calls(jax.make_jaxpr(f)(x).jaxpr)
    module, _ = lowering.lower_kernel(call)
    return lowering.module_text(module)


# Defects the shared rules fixed (issue 15): each was lowered wrongly by this backend's own copy.


def test_float_to_bool_compares_with_zero() -> None:
    """0.5 is True: ``x != 0``, not ``fptoui`` to i1 (which truncates 0.5 to 0)."""
    text = _module(lambda x: x.astype(jnp.bool_), jnp.full((8, 128), 0.5, jnp.float32))
    assert "arith.cmpf une" in text and "fptoui" not in text


def test_int_to_bool_compares_with_zero() -> None:
    """2 is True: ``x != 0``, not ``trunci`` to i1 (which keeps the low bit, 0)."""
    text = _module(lambda x: x.astype(jnp.bool_), jnp.full((8, 128), 2, jnp.int32))
    assert "arith.cmpi ne" in text and "trunci" not in text


def test_power_zero_is_one() -> None:
    """``x ** 0`` stores ones, whatever x is (it stored x)."""
    text = _module(lambda x: x ** 0, jnp.full((8, 128), 3.0, jnp.float32))
    assert "arith.constant dense<1.000000e+00> : vector<8x128xf32>" in text
    assert "arith.mulf" not in text


def test_integer_negation_subtracts_from_zero() -> None:
    """``-x`` on int32 is ``0 - x`` (``arith.negf`` on integers failed to verify)."""
    text = _module(lambda x: -x, jnp.full((8, 128), 2, jnp.int32))
    assert "arith.subi" in text and "negf" not in text


def test_a_module_that_does_not_verify_is_a_pallas_error() -> None:
    """MLIR's own verification error never reaches the user raw."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import func
    from pallas_mosaic_tpu import ir as mir

    from pallas_core import mlir_lowering
    from pallas_core.errors import PallasError

    with mir.new_context(), ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            f = func.FuncOp("broken", ([], []))
            f.add_entry_block()  # a block without its terminator
        with pytest.raises(PallasError, match=r"'k' does not verify.*Fix: run the kernel with "
                                              r"backend='interpret'"):
            mlir_lowering.verify(module, "mosaic_tpu", "k")
