"""Kernels exported with symbolic shapes (``jax.export`` with shape polymorphism) for TPU.

Each kernel is written once against a module pair (``pl``, or JAX's
``jax.experimental.pallas``) and exported for TPU on CPU:

- outside the dynamic-shape export mode, a symbolic grid size is a dynamic grid axis (its
  size an operand of the call, ``tpu.iteration_bound`` in the kernel);
- inside ``pallas_export_experimental(dynamic_shapes=True)``, every symbolic dimension the
  kernel sees (block shapes, ``dim_as_value``, the grid) is a placeholder constant, and the
  module says how the runtime computes each one.

Our module must hold what JAX's holds (types, grid bounds, the placeholder attributes and
the programs they carry), and both exported programs, run by ``pl.emulate`` (which
specialises the module for each call's shapes, as the TPU runtime does), must give
``jax.numpy``'s result on random inputs of several sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental import pallas as jax_pl

import pallas_core as pl
from pallas_core import backend as plb

pltpu = pytest.importorskip("pallas_mosaic_tpu")
from pallas_mosaic_tpu import inspection, symbolic  # noqa: E402

Kernel = Callable[..., Any]


def _call(m: Any, kernel: Kernel, out: Any, **kw: Any) -> Any:
    where = {} if m is jax_pl else {"backend": "mosaic_tpu"}
    return m.pallas_call(kernel, out, **kw, **where)


def _rows(m: Any, x: Any) -> Any:
    """``2x + rows`` by (8, 128) blocks over a grid of ``rows // 8`` (a symbolic size)."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * 2 + jnp.asarray(m.num_programs(0), x_ref.dtype)

    spec = m.BlockSpec((8, 128), lambda i: (i, 0))
    return _call(m, kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // 8,),
                 in_specs=[spec], out_specs=spec)(x)


def _whole(m: Any, x: Any, y: Any) -> Any:
    """Whole blocks of symbolic shape, and the dimensions' values in the kernel
    (``dim_as_value`` of ``m`` and of ``m // 8``)."""
    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        rows = x_ref.shape[0]
        o_ref[...] = (x_ref[...] * jnp.asarray(rows, x_ref.dtype)
                      + jnp.max(y_ref[...], axis=0, keepdims=True)
                      + jnp.asarray(rows // 8, x_ref.dtype))

    return _call(m, kernel, jax.ShapeDtypeStruct(x.shape, x.dtype))(x, y)


def _both(m: Any, x: Any, y: Any) -> Any:
    """A symbolic grid and symbolic whole blocks in one kernel: each step adds the whole
    ``y`` (of symbolic rows) to its block of ``x``."""
    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] + jnp.sum(y_ref[...], axis=0, keepdims=True)

    spec = m.BlockSpec((8, 128), lambda i: (i, 0))
    return _call(m, kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // 8,),
                 in_specs=[spec, m.BlockSpec(y.shape, lambda i: (0, 0))], out_specs=spec)(x, y)


M, N = export.symbolic_shape("m, n")


def _specs(dtype: Any, n_args: int) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct((M, 128), dtype),
            jax.ShapeDtypeStruct((N, 128), dtype)][:n_args]


def _export(m: Any, f: Callable[..., Any], dtype: Any, n_args: int, dynamic: bool) -> Any:
    def fn(*xs: Any) -> Any:
        return f(m, *xs)
    with m.pallas_export_experimental(dynamic_shapes=dynamic):
        return export.export(jax.jit(fn), platforms=["tpu"])(*_specs(dtype, n_args))


def _module(exported: Any) -> Any:
    (found,) = inspection.kernels(str(exported.mlir_module()))  # decoded and verified
    return found[1]


def _random(shape: tuple[int, ...], dtype: Any, seed: int) -> jax.Array:
    rng = np.random.default_rng(seed)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(rng.integers(-50, 50, shape), dtype)
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _want(f: Callable[..., Any], *xs: Any) -> np.ndarray:
    x = np.asarray(xs[0], np.float64)
    if f is _rows:
        return x * 2 + x.shape[0] // 8
    y = np.asarray(xs[1], np.float64)
    if f is _whole:
        return x * x.shape[0] + y.max(axis=0, keepdims=True) + x.shape[0] // 8
    return x + y.sum(axis=0, keepdims=True)


CASES = [(_rows, 1), (_whole, 2), (_both, 2)]
IDS = ["grid", "whole-blocks", "grid-and-blocks"]


def _kernel_summary(module: Any) -> dict[str, Any]:
    """What must agree: the kernel's type and grid attributes, the op kinds of every
    function, and per placeholder where its variables are and the op kinds of its
    program."""
    fn = symbolic.kernel_function(module)
    attrs = fn.attributes
    ops = sorted(op.operation.name for op in plb_walk(module))
    placeholders = {p: (where, sorted(_program_ops(program)))
                    for p, (where, program) in symbolic.placeholders_of(module).items()}
    return {"type": str(attrs["function_type"]),
            "bounds": str(attrs["iteration_bounds"]) if "iteration_bounds" in attrs else None,
            "windows": [str(ir_dict["window_bounds"]) for ir_dict in _windows(attrs)],
            "ops": ops, "placeholders": placeholders}


def _windows(attrs: Any) -> list[Any]:
    from jaxlib.mlir import ir
    if "window_params" not in attrs:
        return []
    return [ir.DictAttr(p) for p in ir.ArrayAttr(attrs["window_params"]) if "window_bounds"
            in ir.DictAttr(p)]


def _program_ops(program: str) -> list[str]:
    from jaxlib.mlir import ir
    with plb.make_ir_context():
        parsed = ir.Module.parse(program)
        return [op.operation.name for op in plb_walk(parsed)]


def plb_walk(module: Any) -> Any:
    from pallas_core.mlir_lowering import walk
    return walk(module.operation)


@pytest.mark.parametrize("f, n_args", CASES, ids=IDS)
def test_dynamic_shape_export_writes_the_placeholders_jax_writes(f: Callable[..., Any],
                                                                 n_args: int) -> None:
    ours = _kernel_summary(_module(_export(pl, f, jnp.float32, n_args, dynamic=True)))
    theirs = _kernel_summary(_module(_export(jax_pl, f, jnp.float32, n_args, dynamic=True)))
    assert ours["placeholders"], "no placeholder was written"
    assert ours["type"] == theirs["type"]
    assert ours["bounds"] == theirs["bounds"]
    assert ours["windows"] == theirs["windows"]
    assert ours["placeholders"] == theirs["placeholders"]
    # The same kinds of operations (JAX emits a few more index constants).
    assert set(ours["ops"]) == set(theirs["ops"])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32],
                         ids=["f32", "bf16", "i32"])
@pytest.mark.parametrize("f, n_args", CASES, ids=IDS)
def test_exported_kernels_emulate_to_numpy_at_every_size(f: Callable[..., Any], n_args: int,
                                                         dtype: Any) -> None:
    """Ours and JAX's exported programs, specialised for each call's shapes, give the
    reference's result."""
    if f is _rows and dtype == jnp.int32:
        dtype = jnp.float32  # the grid case casts num_programs to the block's dtype either way
    exported = [_export(m, f, dtype, n_args, dynamic=True) for m in (pl, jax_pl)]
    tol = 1e-1 if dtype == jnp.bfloat16 else 1e-4
    for seed, (rows, other) in enumerate([(16, 8), (40, 24)]):
        xs = [_random((rows, 128), dtype, seed), _random((other, 128), dtype, seed + 7)]
        xs = xs[:n_args]
        want = _want(f, *[np.asarray(x.astype(jnp.float32)) for x in xs])
        for e in exported:
            got = pl.emulate(e.call, backend="mosaic_tpu")(*xs)
            assert got.shape == xs[0].shape
            np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want,
                                       rtol=tol, atol=tol * max(1.0, np.abs(want).max()))


def test_a_symbolic_grid_outside_the_export_mode_is_a_dynamic_grid() -> None:
    """Without the mode, as in JAX: the grid size is an operand, the bound is dynamic."""
    ours = _kernel_summary(_module(_export(pl, _rows, jnp.float32, 1, dynamic=False)))
    theirs = _kernel_summary(_module(_export(jax_pl, _rows, jnp.float32, 1, dynamic=False)))
    assert not ours["placeholders"] and not theirs["placeholders"]
    assert ours["bounds"] == theirs["bounds"] == "array<i64: -9223372036854775808>"
    assert "tpu.iteration_bound" in ours["ops"]
    assert ours["type"] == theirs["type"] and set(ours["ops"]) == set(theirs["ops"])
    exported = _export(pl, _rows, jnp.float32, 1, dynamic=False)
    x = _random((24, 128), jnp.float32, 3)
    np.testing.assert_allclose(pl.emulate(exported.call, backend="mosaic_tpu")(x),
                               _want(_rows, np.asarray(x)), rtol=1e-6)


def test_a_symbolic_block_outside_the_export_mode_is_refused_with_the_fix() -> None:
    with pytest.raises(pl.BlockSpecError, match="pallas_export_experimental"):
        _export(pl, _whole, jnp.float32, 2, dynamic=False)


def test_a_variable_no_operand_has_whole_is_refused_by_name() -> None:
    """The runtime finds each variable as a whole dimension of an operand: with rows of
    ``8*m`` there is none for ``m`` (JAX fails on this too)."""
    (rows,) = export.symbolic_shape("8*m")

    def fn(x: Any) -> Any:
        def kernel(x_ref: Any, o_ref: Any) -> None:
            o_ref[...] = x_ref[...] + jnp.asarray(x_ref.shape[0] // 8, x_ref.dtype)
        return _call(pl, kernel, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    with pl.pallas_export_experimental(dynamic_shapes=True), \
            pytest.raises(pl.PallasError, match=r"dimension variable\(s\) \['m'\]"):
        export.export(jax.jit(fn), platforms=["tpu"])(
            jax.ShapeDtypeStruct((rows, 128), jnp.float32))
