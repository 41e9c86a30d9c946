"""Misuse of the Mosaic GPU backend gets a PallasError that says what was expected and the fix."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl

plgpu = pytest.importorskip("pallas_mosaic_gpu")


def lower(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def copy_kernel(block, dtype=jnp.float32, **params):
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    def fn(x):
        spec = pl.BlockSpec(block, lambda i: (i,) + (0,) * (len(block) - 1))
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                              grid=(x.shape[0] // block[0],), in_specs=[spec], out_specs=spec,
                              compiler_params=plgpu.CompilerParams(**params))(x)
    return fn


def test_tmem_is_refused_on_hopper() -> None:
    """A kernel allocating TMEM is built for sm_100a; asked for sm_90a, it is refused."""
    def kernel(x_ref, o_ref, t_ref):
        o_ref[...] = x_ref[...]

    def fn(x):
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                              scratch_shapes=[plgpu.TMEM((128, 128), jnp.float32)],
                              backend="mosaic_gpu")(x)
    (st,) = pl.stages(fn, jnp.ones((128, 128)), backend="mosaic_gpu", target="sm_90a")
    with pytest.raises(pl.PallasError, match=r"TMEM.*Blackwell.*sm_90a.*target given"):
        st["mosaic_gpu"]
    (st,) = pl.stages(fn, jnp.ones((128, 128)), backend="mosaic_gpu")  # no target, no GPU
    assert "mosaic_gpu.arch_major = 10 : i32" in st["mosaic_gpu"]


@pytest.mark.parametrize("kwargs,match", [
    (dict(dimension_semantics=("parallel", "diagonal")), "'parallel', 'sequential'"),
    (dict(max_concurrent_steps=0), "max_concurrent_steps"),
    (dict(max_concurrent_steps=2, delay_release=2), "delay_release"),
    (dict(lowering_semantics="thread"), "Lane or .Warpgroup"),
])
def test_bad_compiler_params(kwargs, match) -> None:
    with pytest.raises(pl.PallasError, match=match):
        plgpu.CompilerParams(**kwargs)


def test_block_minor_dimension_must_be_16_bytes() -> None:
    with pytest.raises(pl.PallasError, match="multiple of 4"):
        lower(copy_kernel((8, 2)), jnp.ones((16, 2)))


def test_block_dimensions_above_tma_box() -> None:
    """A block is split into several TMA copies along one leading dimension only (and its
    minor dimension cut into rows), so two leading dimensions above 256 are refused."""
    with pytest.raises(pl.PallasError, match=r"dimensions \[0, 1\] are above 256"):
        lower(copy_kernel((512, 512, 16), jnp.int8), jnp.ones((512, 512, 16), jnp.int8))


def test_shared_memory_budget() -> None:
    with pytest.raises(pl.PallasError, match=r"bytes of shared memory.*max_concurrent_steps"):
        lower(copy_kernel((256, 256), max_concurrent_steps=1), jnp.ones((512, 256)))


def test_sequential_axes_must_be_last() -> None:
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    def fn(x):
        spec = pl.BlockSpec((64, 128), lambda i, j: (i, 0))
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2, 2),
                              in_specs=[spec], out_specs=spec,
                              compiler_params=plgpu.CompilerParams(
                                  dimension_semantics=("sequential", "parallel")))(x)
    with pytest.raises(pl.PallasError, match="sequential grid axes must come last"):
        lower(fn, jnp.ones((128, 128)))


def test_dot_needs_b_in_shared_memory() -> None:
    def kernel(a_ref, b_ref, o_ref):
        o_ref[...] = jnp.dot(a_ref[...], b_ref[...] * 2, preferred_element_type=jnp.float32)

    def fn(a, b):
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct((64, 64), jnp.float32),
                              backend="mosaic_gpu")(a, b)
    a = jnp.ones((64, 64), jnp.bfloat16)
    with pytest.raises(pl.PallasError, match=r"right operand.*SMEM"):
        lower(fn, a, a)


def test_copy_in_the_wrong_direction() -> None:
    @functools.partial(plgpu.kernel, out_shape=jax.ShapeDtypeStruct((128,), jnp.float32),
                       scratch_shapes=[plgpu.SMEM((128,), jnp.float32), plgpu.Barrier()])
    def kernel(x_ref, o_ref, smem, bar):
        plgpu.copy_gmem_to_smem(smem, x_ref, bar.at[0])

    with pytest.raises(pl.PallasError, match="source must be in GMEM"):
        jax.jit(kernel).trace(jnp.ones((128,)))


def test_wgmma_needs_an_accumulator() -> None:
    @functools.partial(plgpu.kernel, out_shape=jax.ShapeDtypeStruct((64, 64), jnp.float32),
                       scratch_shapes=[plgpu.SMEM((64, 64), jnp.bfloat16)])
    def kernel(o_ref, smem):
        plgpu.wgmma(o_ref, smem, smem)

    with pytest.raises(pl.PallasError, match=r"plgpu\.ACC"):
        jax.jit(kernel).trace()


def test_barrier_spellings() -> None:
    assert plgpu.Barrier(num_threads=3) == plgpu.Barrier(num_arrivals=3)
    with pytest.raises(pl.PallasError, match="num_barriers"):
        plgpu.Barrier(num_barriers=0)


@pytest.mark.parametrize("shape", [(32, 128), (64, 300)])
def test_acc_shape(shape) -> None:
    with pytest.raises(pl.PallasError, match="multiple of 64"):
        plgpu.ACC(shape)


def test_mesh_checks() -> None:
    with pytest.raises(pl.PallasError, match="at most 3"):
        plgpu.Mesh(grid=(1, 1, 1, 1))
    with pytest.raises(pl.PallasError, match="num_threads and thread_name together"):
        plgpu.Mesh(grid=(2,), num_threads=2)


def test_unsupported_op_names_kernel_and_line() -> None:
    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.cumsum(x_ref[...], axis=1)

    def fn(x):
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                              backend="mosaic_gpu")(x)
    with pytest.raises(pl.PallasError, match=r"cumsum.*test_gpu_errors.py:\d+"):
        lower(fn, jnp.ones((64, 128)))


def test_gmem_scratch_is_refused() -> None:
    def kernel(x_ref, o_ref, g_ref):
        o_ref[...] = x_ref[...]

    def fn(x):
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                              scratch_shapes=[plgpu.GMEM((128,), jnp.float32)],
                              backend="mosaic_gpu")(x)
    with pytest.raises(pl.PallasError, match=r"GMEM scratch.*plgpu\.SMEM"):
        lower(fn, jnp.ones((128, 128)))


def test_single_barrier_needs_no_index_and_interpret_flag() -> None:
    def body(x_ref, o_ref, smem, bar):
        plgpu.copy_gmem_to_smem(x_ref, smem, bar)
        plgpu.barrier_wait(bar)
        o_ref[...] = smem[...] * 2.0

    def make(**kw):
        return plgpu.kernel(body, out_shape=jax.ShapeDtypeStruct((128,), jnp.float32),
                            scratch_shapes=[plgpu.SMEM((128,), jnp.float32), plgpu.Barrier()],
                            **kw)

    x = jax.random.normal(jax.random.key(0), (128,))
    lower(make(), x)
    np.testing.assert_allclose(make(interpret=True)(x), x * 2.0)


def test_lowering_semantics_enum_of_jax_is_accepted() -> None:
    """JAX's enum (its own class, int values) is read by member name, as plgpu's own is; both
    semantics lower alike here (plgpu.LoweringSemantics says why)."""
    import enum

    class LoweringSemantics(enum.Enum):
        Lane = 1
        Warpgroup = 2
        Thread = 3
    for members in (LoweringSemantics, plgpu.LoweringSemantics):
        for member in (members.Lane, members.Warpgroup):
            assert plgpu.CompilerParams(lowering_semantics=member).lowering_semantics == "lane"
    with pytest.raises(pl.PallasError, match=r"Lane or \.Warpgroup"):
        plgpu.CompilerParams(lowering_semantics=LoweringSemantics.Thread)


def _atomic_kernel(body, dtype=jnp.float32):
    def fn(x):
        @functools.partial(plgpu.kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                           backend="mosaic_gpu")
        def kernel(x_ref, o_ref):
            body(x_ref, o_ref)
        return kernel(x)
    return fn


def test_float_atomic_max_is_refused() -> None:
    from pallas_mosaic_gpu import hopper_kernels
    with pytest.raises(pl.UnsupportedError, match=r"atomic_max on float32"):
        lower(functools.partial(hopper_kernels.block_reduce, op="max"), jnp.ones((128, 128)))


def test_using_the_result_of_an_atomic_is_refused() -> None:
    def body(x_ref, o_ref):
        old = pl.atomic_add(o_ref, ..., x_ref[...])
        x_ref[...] = old
    with pytest.raises(pl.UnsupportedError, match=r"previous contents.*plgpu.atomic_add"):
        lower(_atomic_kernel(body), jnp.ones((256,)))


def test_masked_atomic_is_refused() -> None:
    def body(x_ref, o_ref):
        v = x_ref[...]
        pl.atomic_add(o_ref, ..., v, mask=v > 0)
    with pytest.raises(pl.UnsupportedError, match=r"masked atomic"):
        lower(_atomic_kernel(body), jnp.ones((256,)))


def test_emit_pipeline_checks_its_refs_and_specs() -> None:
    spec = pl.BlockSpec((64, 128), lambda i: (i, 0))

    def fn(specs, n_refs):
        @functools.partial(plgpu.kernel, out_shape=jax.ShapeDtypeStruct((128, 128), jnp.float32),
                           backend="interpret")
        def kernel(x_ref, o_ref):
            plgpu.emit_pipeline(lambda idx, *r: None, grid=(2,), in_specs=specs,
                                out_specs=[spec])(*[x_ref, o_ref][:n_refs])
        return kernel(jnp.ones((128, 128)))

    with pytest.raises(pl.PallasError, match=r"1 in_specs and 1 out_specs but was called "
                       r"with 1 Refs"):
        fn([spec], 1)
    with pytest.raises(pl.PallasError, match=r"1-D block_shape .* for a 2-D Ref"):
        fn([pl.BlockSpec((64,), lambda i: (i,))], 2)
    with pytest.raises(pl.PallasError, match=r"block_shape and an index_map"):
        fn([pl.BlockSpec(memory_space=plgpu.GMEM)], 2)
    with pytest.raises(pl.PallasError, match=r"grid must be positive ints"):
        plgpu.emit_pipeline(lambda *a: None, grid=(0,))
