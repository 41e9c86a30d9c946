"""What the Triton backend refuses, before lowering, with the fix in the message."""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl

pallas_triton = pytest.importorskip("pallas_triton")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="compiling to PTX and cubin needs the triton package")


def _copy(x_ref: Any, o_ref: Any) -> None:
    o_ref[...] = x_ref[...]


def _lower(fn: Any, *args: Any) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_block_sizes_must_be_powers_of_two() -> None:
    x = jnp.ones((96, 100))
    call = pl.pallas_call(_copy, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
                          in_specs=[pl.BlockSpec((48, 100), lambda i: (i, 0))],
                          out_specs=pl.BlockSpec((48, 100), lambda i: (i, 0)), backend="triton")
    with pytest.raises(pl.BlockSpecError, match=r"block shape \(48, 100\).*power-of-two.*"
                                                 r"Fix: use block_shape \(64, 128\)"):
        call(x)


def test_scratch_is_refused() -> None:
    with pytest.raises(pl.UnsupportedError, match=r"scratch_shapes.*'triton'.*Fix"):
        pl.pallas_call(lambda x_ref, o_ref, s_ref: None, jax.ShapeDtypeStruct((8,), jnp.float32),
                       scratch_shapes=[pl.ANY((8,), jnp.float32)], backend="triton")(jnp.ones(8))


def test_primitive_without_a_rule_names_itself_and_the_line() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jax.lax.cumlogsumexp(x_ref[...])

    x = jnp.ones((128,))
    fn = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), backend="triton")
    with pytest.raises(pl.UnsupportedError,
                       match=r"cumlogsumexp.*'triton' backend.*"
                             r"test_triton_validation\.py:\d+.*Fix"):
        _lower(fn, x)


def test_semaphores_are_refused_by_name() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        pl.semaphore_signal(x_ref.at[0])
        o_ref[...] = x_ref[...]

    with pytest.raises(pl.UnsupportedError, match=r"semaphore_signal.*'triton'.*Fix"):
        pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.int32),
                       backend="triton")(jnp.zeros(8, jnp.int32))


def test_compiler_params_select_the_backend_and_validate() -> None:
    x = jnp.ones((128,))
    fn = pl.pallas_call(_copy, jax.ShapeDtypeStruct(x.shape, x.dtype),
                        compiler_params=pallas_triton.CompilerParams(num_warps=8, num_stages=2))
    text = _lower(fn, x)
    assert "__gpu$xla.gpu.triton" in text and "num_warps = 8" in text
    with pytest.raises(pl.PallasError, match=r"num_warps=3.*power of two.*Fix"):
        pallas_triton.CompilerParams(num_warps=3)


def test_lowering_for_cpu_is_refused_with_the_fix() -> None:
    x = jnp.ones((128,))
    fn = pl.pallas_call(_copy, jax.ShapeDtypeStruct(x.shape, x.dtype), backend="triton")
    with pytest.raises(pl.UnsupportedError,
                       match=r"'triton'.*lowers for \('cuda', 'rocm'\).*'cpu'.*Fix"):
        jax.block_until_ready(fn(x))


@needs_triton
def test_bad_target_is_explained() -> None:
    x = jnp.ones((128,))
    fn = pl.pallas_call(_copy, jax.ShapeDtypeStruct(x.shape, x.dtype), backend="triton")
    with pytest.raises(pl.PallasError,
                       match=r"target 'hopper'.*known targets: sm_80, sm_90.*gfx942.*Fix"):
        pl.stages(fn, x, backend="triton", target="hopper")


@needs_triton
def test_revisited_output_blocks_run_in_order_inside_one_program() -> None:
    """The K axis of a 3-D-grid matmul becomes a loop in each program, not parallel programs
    racing on one output block."""
    from pallas_triton import lowering

    from examples import matmul_3d_grid
    from pallas_core.stages import kernel_calls

    x = jnp.ones((128, 128), jnp.bfloat16)
    fn = jax.jit(lambda a, b: matmul_3d_grid.matmul(a, b, block_m=64, block_n=64, block_k=32))
    text = _lower(fn, x, x)
    assert "grid_x = 4 : i32" in text  # (128/64) * (128/64) programs; K loops inside
    calls = list(kernel_calls(jax.make_jaxpr(fn)(x, x).jaxpr))
    assert lowering.grid_axes(calls[0]) == ((0, 1), (2,))
    (stages,) = pl.stages(fn, x, x, backend="triton", target="sm_90")
    assert "scf.for" in stages["ttir"]


@needs_triton
@pytest.mark.parametrize("atomic", [pl.atomic_max, pl.atomic_min])
def test_float_atomic_max_min_use_integer_atomics_on_the_bits(atomic: Any) -> None:
    """Float compares of the bit patterns would be wrong for negatives (PTX atom.max.s32 on
    float bits); signed max/min for non-negatives and unsigned min/max for negatives are not."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        atomic(o_ref, (pl.ds(0, 128),), x_ref[...])

    whole = pl.BlockSpec(memory_space=pl.ANY)
    fn = pl.pallas_call(kernel, jax.ShapeDtypeStruct((128,), jnp.float32), in_specs=[whole],
                        out_specs=whole, backend="triton")
    (stages,) = pl.stages(fn, jnp.ones(128), backend="triton", target="sm_90")
    ttir = stages["ttir"]
    signed, unsigned = ("max", "umin") if atomic is pl.atomic_max else ("min", "umax")
    assert f"tt.atomic_rmw {signed}" in ttir and f"tt.atomic_rmw {unsigned}" in ttir
    assert "fmax" not in ttir and stages["cubin"]


@needs_triton
def test_atomic_cas_past_the_array_end_leaves_memory_alone() -> None:
    """tt.atomic_cas has no mask: lanes past the array's end must be redirected, not issued."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        start = x_ref[0] * 0  # traced: JAX 0.12 refuses a static slice past the end
        pl.atomic_cas(o_ref.at[pl.ds(start, 128)], jnp.zeros(128, jnp.int32), x_ref[...])

    whole = pl.BlockSpec(memory_space=pl.ANY)
    x = jnp.arange(100, dtype=jnp.int32)
    fn = pl.pallas_call(kernel, jax.ShapeDtypeStruct((100,), jnp.int32),
                        in_specs=[pl.BlockSpec((128,), lambda: (0,))], out_specs=whole,
                        backend="triton")
    (stages,) = pl.stages(fn, x, backend="triton", target="sm_80")
    ttir = stages["ttir"]
    match = re.search(r"tt\.atomic_cas \w+, \w+, (%\w+)", ttir)
    assert match, ttir
    pointers = match.group(1)
    # The pointer operand is the select between in-bounds pointers and the array's start.
    assert any(line.strip().startswith(f"{pointers} = arith.select") for line in
               ttir.splitlines()), ttir
    assert "atom.global" in stages["ptx"] and stages["cubin"]


def test_float16_atomic_max_is_refused() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        pl.atomic_max(o_ref, (pl.ds(0, 128),), x_ref[...])

    whole = pl.BlockSpec(memory_space=pl.ANY)
    fn = pl.pallas_call(kernel, jax.ShapeDtypeStruct((128,), jnp.float16), in_specs=[whole],
                        out_specs=whole, backend="triton")
    with pytest.raises(pl.UnsupportedError, match=r"atomic_max on float16.*Fix"):
        _lower(fn, jnp.ones(128, jnp.float16))


@needs_triton
def test_boolean_arrays_are_bytes_in_memory() -> None:
    """Booleans load as bytes compared with 0 and store as 0/1 bytes (XLA's layout)."""
    def kernel(m_ref: Any, x_ref: Any, o_ref: Any, keep_ref: Any) -> None:
        o_ref[...] = jnp.where(m_ref[...], x_ref[...], -1.0)
        keep_ref[...] = x_ref[...] > 0.0

    x = jax.random.normal(jax.random.key(0), (128,))
    m = x > 0.5
    out_shape = (jax.ShapeDtypeStruct((128,), jnp.float32),
                 jax.ShapeDtypeStruct((128,), jnp.bool_))
    (stages,) = pl.stages(pl.pallas_call(kernel, out_shape), m, x, backend="triton",
                          target="sm_80")
    assert "!tt.ptr<i8>" in stages["ttir"] and stages["cubin"]
    out, keep = pl.pallas_call(kernel, out_shape)(m, x)  # the interpreter, against jnp
    np.testing.assert_allclose(out, jnp.where(m, x, -1.0))
    np.testing.assert_array_equal(keep, x > 0.0)


@needs_triton
def test_float16_to_bfloat16_cast_compiles() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...].astype(jnp.bfloat16)

    fn = pl.pallas_call(kernel, jax.ShapeDtypeStruct((128,), jnp.bfloat16), backend="triton")
    (stages,) = pl.stages(fn, jnp.ones(128, jnp.float16), backend="triton", target="sm_90")
    assert stages["cubin"]


def _atomic_kernel(atomic: str) -> Any:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        if atomic == "cas":  # swap in x wherever o holds 1
            pl.atomic_cas(o_ref.at[pl.ds(0, 128)], jnp.ones(128, x_ref.dtype), x_ref[...])
        else:
            getattr(pl, f"atomic_{atomic}")(o_ref, (pl.ds(0, 128),), x_ref[...])

    return kernel


_NARROW = [(np.bool_, "max"), (np.bool_, "xchg"), (np.bool_, "cas"), (np.int8, "add"),
           (np.int8, "max"), (np.int8, "cas"), (np.int16, "add"), (np.int16, "min"),
           (np.int16, "xchg"), (np.int16, "cas"), (np.uint8, "add"), (np.uint16, "or")]


def _numpy_atomic(atomic: str, o: np.ndarray, x: np.ndarray) -> np.ndarray:
    if atomic == "cas":
        return np.where(o == 1, x, o)
    if o.dtype == np.bool_ and atomic != "xchg":
        return {"max": o | x, "min": o & x, "or": o | x}[atomic]
    return {"add": o + x, "max": np.maximum(o, x), "min": np.minimum(o, x), "or": o | x,
            "xchg": x}[atomic].astype(o.dtype)


@pytest.mark.parametrize(("dtype", "atomic"), _NARROW)
def test_narrow_atomics_are_refused_up_front_and_run_in_the_interpreter(dtype: Any,
                                                                        atomic: str) -> None:
    rng = np.random.default_rng(hash((np.dtype(dtype).name, atomic)) % 2**32)
    o = rng.integers(0, 3, 128).astype(dtype)
    x = rng.integers(0, 3, 128).astype(dtype)
    whole = pl.BlockSpec(memory_space=pl.ANY)
    name = "atomic_cas" if atomic == "cas" else f"atomic_{atomic}"

    def call(backend: str) -> Any:
        return pl.pallas_call(_atomic_kernel(atomic), jax.ShapeDtypeStruct((128,), dtype),
                              in_specs=[whole], out_specs=whole, backend=backend,
                              input_output_aliases={0: 0})

    with pytest.raises(pl.UnsupportedError,
                       match=rf"{name} on {np.dtype(dtype).name} \(kernel 'kernel' "
                             r"\(.*test_triton_validation\.py:\d+\), at "
                             r".*test_triton_validation\.py:\d+\).*'triton' backend.*32- and "
                             r"64-bit.*Fix: widen the Ref to int32"):
        _lower(lambda a, b: call("triton")(a), o, x)
    # The interpreter runs them: the output aliases o, and the kernel applies x to it.
    got = pl.pallas_call(
        lambda o_in, x_ref, o_ref: _atomic_kernel(atomic)(x_ref, o_ref),
        jax.ShapeDtypeStruct((128,), dtype), in_specs=[whole, whole], out_specs=whole,
        backend="interpret", input_output_aliases={0: 0})(o, x)
    np.testing.assert_array_equal(np.asarray(got), _numpy_atomic(atomic, o, x))


@pytest.mark.parametrize("atomic", ["add", "max", "xchg", "cas"])
def test_int32_atomics_still_lower(atomic: str) -> None:
    whole = pl.BlockSpec(memory_space=pl.ANY)
    fn = pl.pallas_call(_atomic_kernel(atomic), jax.ShapeDtypeStruct((128,), jnp.int32),
                        in_specs=[whole], out_specs=whole, backend="triton")
    assert "custom_call" in _lower(fn, jnp.ones(128, jnp.int32))


@pytest.mark.parametrize("backend", ["triton", "mosaic_gpu"])
def test_symbolic_blocks_are_refused_by_name(backend: str) -> None:
    """``jax.export`` in the dynamic-shape mode: a GPU kernel is compiled for static block
    shapes, so a block of symbolic shape is refused before lowering (not an error of JAX's
    shape polymorphism from inside the lowering)."""
    pytest.importorskip(f"pallas_{backend}")
    from jax import export

    def f(x: Any) -> Any:
        return pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2),
                              jax.ShapeDtypeStruct(x.shape, x.dtype), backend=backend)(x)

    (rows,) = export.symbolic_shape("m")
    with pl.pallas_export_experimental(dynamic_shapes=True), pytest.raises(
            pl.UnsupportedError, match=r"symbolic block shape \(m, 128\).*'" + backend):
        export.export(jax.jit(f), platforms=["cuda"])(
            jax.ShapeDtypeStruct((rows, 128), jnp.float32))
