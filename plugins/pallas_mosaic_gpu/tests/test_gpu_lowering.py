"""The Mosaic GPU backend without a GPU: every kernel lowers for ``cuda`` into the
``mosaic_gpu_v2`` custom call, its module parses back and verifies, it holds the hardware
operations the kernel asks for (TMA copies, mbarriers, wgmma), and the same kernel runs in the
interpreter and matches ``jax.numpy`` on random inputs."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl

plgpu = pytest.importorskip("pallas_mosaic_gpu")
from pallas_mosaic_gpu import hopper_kernels as K  # noqa: E402, N812
from pallas_mosaic_gpu import inspection  # noqa: E402


def rand(seed: int, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def attention_ref(q, k, v):
    q, k, v = (t.astype(jnp.float32) for t in (q, k, v))
    s = jnp.einsum("bqd,bkd->bqk", q, k) / math.sqrt(q.shape[-1])
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), v)


def matmul_ref(a, b):
    return jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))


TMA_LOAD_OP = "cp.async.bulk.tensor.shared.cluster.global"  # a TMA load, in either form
CASES = {
    # name: (kernel, args, reference, tolerance, operations the module must hold)
    "add_one": (K.add_one, lambda: (rand(0, (256,)),), lambda x: x + 1, 0, ()),
    "add_one_tma": (K.add_one_tma, lambda: (rand(1, (256,)),), lambda x: x + 1, 0,
                    (TMA_LOAD_OP, "mbarrier.try_wait",
                     "cp.async.bulk.tensor.global.shared.cta", "fence.proxy")),
    "blocked_add": (K.blocked_add, lambda: (rand(2, (256, 384)), rand(3, (256, 384))),
                    lambda x, y: x + y, 0,
                    (TMA_LOAD_OP, "mbarrier.try_wait")),
    "softmax": (K.softmax, lambda: (rand(4, (256, 128)),),
                lambda x: jax.nn.softmax(x, axis=1), 1e-6, ("shfl.sync",)),
    "matmul": (K.matmul, lambda: (rand(5, (256, 512), jnp.bfloat16),
                                  rand(6, (512, 384), jnp.bfloat16)),
               matmul_ref, 0.5, ("wgmma.mma_async", "wgmma.wait.group",
                                 TMA_LOAD_OP)),
    "pipelined_add": (K.pipelined_add, lambda: (rand(12, (256, 384)), rand(13, (256, 384))),
                      lambda x, y: x + y, 0,
                      (TMA_LOAD_OP, "mbarrier.try_wait",
                       "cp.async.bulk.tensor.global.shared.cta")),
    "matmul_pipeline": (K.matmul_pipeline, lambda: (rand(14, (256, 512), jnp.bfloat16),
                                                    rand(15, (512, 384), jnp.bfloat16)),
                        matmul_ref, 0.5, ("wgmma.mma_async", "mbarrier.try_wait",
                                          TMA_LOAD_OP)),
    "block_reduce": (K.block_reduce, lambda: (rand(16, (512, 128)),),
                     lambda x: x.reshape(8, 64, 128).sum(0), 1e-5,
                     ("relaxed.gpu.add.f32", TMA_LOAD_OP)),
    "attention": (K.attention, lambda: tuple(rand(7 + i, (2, 256, 128), jnp.bfloat16)
                                             for i in range(3)),
                  attention_ref, 2e-2, ("wgmma.mma_async", "mbarrier.try_wait")),
}


@functools.cache
def lowered(name: str):
    fn, args, *_ = CASES[name]
    return jax.jit(fn).trace(*args()).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("name", sorted(CASES))
def test_lowers_for_cuda_and_verifies(name: str) -> None:
    calls = inspection.custom_calls(lowered(name))
    assert len(calls) == 1
    module = inspection.check_call(calls[0])
    text = str(module)
    assert "stable_mosaic_gpu" not in text and "gpu.launch" in text
    assert re.search(r"mosaic_gpu.arch_major = 9", text)
    for op in CASES[name][4]:
        found = (inspection.tma_loads(text) > 0 if op == TMA_LOAD_OP else op in text)
        assert found, f"{name}: {op} missing from the module"
    # TMA and wgmma need every buffer at a multiple of 1024 bytes (128-byte swizzle); the
    # barriers (i64) come after the buffers.
    views = inspection.smem_buffers(module)
    buffers = [(off, ty) for off, ty in views if "xi64," not in ty]
    assert all(off % 1024 == 0 for off, _ in buffers), f"{name}: misaligned SMEM: {views}"
    assert all(off >= max((o for o, _ in buffers), default=0)
               for off, ty in views if "xi64," in ty), views


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreter_matches_jax_numpy(name: str) -> None:
    fn, args, ref, tol, _ = CASES[name]
    a = args()
    out = fn(*a, backend="interpret")
    expected = ref(*a)
    assert out.shape == expected.shape and out.dtype == a[0].dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                               atol=tol, rtol=tol)


def test_custom_call_operands_and_results() -> None:
    text = lowered("matmul").as_text()
    call = next(line for line in text.splitlines() if "mosaic_gpu_v2" in line)
    assert "(tensor<256x512xbf16>, tensor<512x384xbf16>) -> tensor<256x384xbf16>" in call


def _launch_grid(name: str) -> tuple[int, ...]:
    return _launch_grid_text(str(inspection.check_call(inspection.custom_calls(lowered(name))[0])))


def _launch_grid_text(text: str) -> tuple[int, ...]:
    launch = re.search(r"gpu\.launch.*?blocks\(.*?\) in \((.*?)\) threads\(.*?\) in \((.*?)\)",
                       text)
    assert launch, "no gpu.launch"
    consts = dict(re.findall(r"(%\w+) = arith.constant (\d+) : index", text))
    grid = tuple(int(consts[v.split("=")[1].strip()]) for v in launch.group(1).split(","))
    block = tuple(int(consts[v.split("=")[1].strip()]) for v in launch.group(2).split(","))
    return grid + block


@pytest.mark.parametrize("name,grid", [
    ("add_one", (2, 1, 1)), ("blocked_add", (12, 1, 1)), ("softmax", (4, 1, 1)),
    ("matmul", (6, 1, 1)), ("attention", (8, 1, 1))])
def test_launch_grid(name: str, grid: tuple[int, ...]) -> None:
    """Parallel grid axes become thread blocks (the matmul's K axis is a loop inside one);
    each block is one warpgroup of 128 threads."""
    assert _launch_grid(name) == (*grid, 128, 1, 1)


def test_pipelined_matmul_variants_match() -> None:
    a, b = rand(10, (128, 512), jnp.bfloat16), rand(11, (512, 128), jnp.bfloat16)
    for steps, delay in ((1, 0), (3, 0), (3, 1)):
        out = K.matmul(a, b, max_concurrent_steps=steps, delay_release=delay,
                       backend="interpret")
        np.testing.assert_allclose(np.asarray(out, np.float32), matmul_ref(a, b), atol=0.5,
                                   rtol=2e-2)
        low = jax.jit(functools.partial(K.matmul, max_concurrent_steps=steps,
                                        delay_release=delay)).trace(a, b).lower(
            lowering_platforms=("cuda",))
        inspection.check_call(inspection.custom_calls(low)[0])


def test_generic_dot_accumulating_in_smem_scratch() -> None:
    """The portable 3-D-grid matmul (``acc_ref[...] += jnp.dot(a_ref[...], b_ref[...])`` into a
    float32 SMEM scratch) lowers through wgmma too."""
    def kernel(a_ref, b_ref, o_ref, acc_ref):
        @pl.when(pl.program_id(2) == 0)
        def _():
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        acc_ref[...] += jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)

        @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
        def _():
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    def mm(a, b, backend="mosaic_gpu"):
        return pl.pallas_call(
            kernel, jax.ShapeDtypeStruct((a.shape[0], b.shape[1]), a.dtype), grid=(2, 2, 4),
            in_specs=[pl.BlockSpec((64, 64), lambda i, j, k: (i, k)),
                      pl.BlockSpec((64, 64), lambda i, j, k: (k, j))],
            out_specs=pl.BlockSpec((64, 64), lambda i, j, k: (i, j)),
            scratch_shapes=[plgpu.SMEM((64, 64), jnp.float32)], backend=backend)(a, b)

    a, b = rand(12, (128, 256), jnp.bfloat16), rand(13, (256, 128), jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(mm(a, b, "interpret"), np.float32), matmul_ref(a, b),
                               atol=0.5, rtol=2e-2)
    low = jax.jit(mm).trace(a, b).lower(lowering_platforms=("cuda",))
    text = str(inspection.check_call(inspection.custom_calls(low)[0]))
    assert "wgmma.mma_async" in text
    assert _grid_of(low) == 4  # the K axis is revisiting: a loop, not thread blocks


def _grid_of(low) -> int:
    text = str(inspection.check_call(inspection.custom_calls(low)[0]))
    launch = re.search(r"gpu\.launch.*?blocks\(.*?\) in \(%\w+ = (%\w+)", text)
    consts = dict(re.findall(r"(%\w+) = arith.constant (\d+) : index", text))
    return int(consts[launch.group(1)])


def test_kernel_with_warpgroups_and_clusters() -> None:
    """``plgpu.kernel`` with clusters of 2 blocks and two warpgroups per block: the axes read by
    ``lax.axis_index`` are the cluster's grid position, the block's place in its cluster and
    the warpgroup; the CUDA grid is grid * cluster."""
    out_shape = jax.ShapeDtypeStruct((3, 2, 2, 128), jnp.float32)

    def body(o_ref):
        g, c, w = lax.axis_index("g"), lax.axis_index("c"), lax.axis_index("wg")
        value = (g * 100 + c * 10 + w).astype(jnp.float32)
        o_ref[g, c, w, :] = lax.broadcasted_iota(jnp.float32, (128,), 0) + value

    def run(backend):
        return plgpu.kernel(body, out_shape=out_shape, grid=(3,), grid_names=("g",),
                            cluster=(2,), cluster_names=("c",), num_threads=2,
                            thread_name="wg", backend=backend)()

    g, c, w, i = np.meshgrid(*[np.arange(n) for n in out_shape.shape], indexing="ij")
    np.testing.assert_array_equal(run("interpret"), g * 100 + c * 10 + w + i)
    low = jax.jit(lambda: run("mosaic_gpu")).trace().lower(lowering_platforms=("cuda",))
    text = str(inspection.check_call(inspection.custom_calls(low)[0]))
    assert "clusters(" in text and "gpu.cluster_block_id" in text
    assert _launch_grid_text(text) == (6, 1, 1, 256, 1, 1)


def test_kernel_takes_jax_newer_argument_names() -> None:
    """``out_type=`` and ``scratch_types=`` (JAX 0.10's names, which its attention_mgpu uses)
    mean ``out_shape=`` and ``scratch_shapes=``; giving both spellings is an error."""
    x = rand(21, (256,))

    def body(x_ref, o_ref, smem):
        smem[...] = x_ref[...] * 2.0
        o_ref[...] = smem[...] + 1.0

    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    for backend in ("interpret", "mosaic_gpu"):
        fn = plgpu.kernel(body, out_type=out, scratch_types=[plgpu.SMEM(x.shape, x.dtype)],
                          backend=backend)
        if backend == "interpret":
            np.testing.assert_allclose(fn(x), x * 2.0 + 1.0, rtol=1e-6)
        else:
            assert inspection.custom_calls(
                jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",)))
    with pytest.raises(pl.PallasError, match="out_shape and out_type"):
        plgpu.kernel(body, out, out_type=out)
    with pytest.raises(pl.PallasError, match="scratch_shapes and scratch_types"):
        plgpu.kernel(body, out_type=out, scratch_shapes=[plgpu.SMEM(x.shape, x.dtype)],
                     scratch_types=[plgpu.SMEM(x.shape, x.dtype)])


def test_stages() -> None:
    x = rand(20, (256, 128))
    (st,) = pl.stages(K.softmax, x, backend="mosaic_gpu", target="sm_90a")
    assert set(st.stages) >= {"jaxpr", "stablehlo", "mosaic_gpu", "mosaic_gpu_bytecode"}
    assert "gpu.launch" in st["mosaic_gpu"]
    assert isinstance(st["mosaic_gpu_bytecode"], bytes)
    assert "mosaic_gpu_v2" in st["stablehlo"]
    with pytest.raises(pl.PallasError, match="sm_90a"):
        pl.stages(K.softmax, x, backend="mosaic_gpu", target="sm_75")


_INT_FOLDS = {"add": jnp.sum, "max": jnp.max, "min": jnp.min,
              "and": lambda r, axis: lax.reduce(r, np.int32(-1), lax.bitwise_and, (axis,)),
              "or": lambda r, axis: lax.reduce(r, np.int32(0), lax.bitwise_or, (axis,)),
              "xor": lambda r, axis: lax.reduce(r, np.int32(0), lax.bitwise_xor, (axis,))}


@pytest.mark.parametrize("op", sorted(_INT_FOLDS))
def test_integer_atomics(op: str) -> None:
    """Every ``plgpu.atomic_*`` on int32: the interpreter folds the blocks like jax.numpy,
    and the lowering holds the PTX reduction of that op on global memory."""
    x = jax.random.randint(jax.random.key(20), (512, 128), -(2**20), 2**20, jnp.int32)
    out = K.block_reduce(x, op=op, backend="interpret")
    expected = _INT_FOLDS[op](x.reshape(8, 64, 128), axis=0)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
    low = jax.jit(functools.partial(K.block_reduce, op=op)).trace(x).lower(
        lowering_platforms=("cuda",))
    text = str(inspection.check_call(inspection.custom_calls(low)[0]))
    suffix = "s32" if op in ("add", "max", "min") else "b32"
    # JAX 0.10 spells it red.relaxed.gpu.<op>, 0.11 red.global.relaxed.gpu.<op>.
    assert re.search(rf"red(\.global)?\.relaxed\.gpu\.{op}\.{suffix}", text)


def test_aliased_operand_is_written_in_place() -> None:
    """input_output_aliases: the aliased input is the custom call's in-out operand (its
    result aliases the operand) and the kernel adds into its contents."""
    x = rand(21, (512, 128))
    low = jax.jit(K.block_reduce).trace(x).lower(lowering_platforms=("cuda",))
    text = low.as_text()
    call = next(line for line in text.splitlines() if "mosaic_gpu_v2" in line)
    assert "output_operand_aliases" in call
    assert "(tensor<512x128xf32>, tensor<64x128xf32>) -> tensor<64x128xf32>" in call


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_emit_pipeline_depths(steps: int) -> None:
    """emit_pipeline with 1 (no overlap), 2 and 4 buffers per input matches jax.numpy in the
    interpreter and lowers, with one TMA barrier wait per input and step in its loop."""
    a, b = rand(22, (128, 512), jnp.bfloat16), rand(23, (512, 128), jnp.bfloat16)
    f = functools.partial(K.matmul_pipeline, max_concurrent_steps=steps)
    out = f(a, b, backend="interpret")
    np.testing.assert_allclose(np.asarray(out, np.float32), matmul_ref(a, b), atol=0.5,
                               rtol=2e-2)
    low = jax.jit(f).trace(a, b).lower(lowering_platforms=("cuda",))
    text = str(inspection.check_call(inspection.custom_calls(low)[0]))
    assert "scf.for" in text and "wgmma.mma_async" in text


def test_emit_pipeline_revisited_output_block_accumulates() -> None:
    """An output block named by consecutive steps stays in SMEM across them (a sum over
    column blocks written with emit_pipeline): it matches jax.numpy in the interpreter, and
    the lowered loop stores the block only when its index changes (under an scf.if)."""
    x = rand(24, (128, 512))

    def colblock_sum(x, backend):
        @functools.partial(plgpu.kernel,
                           out_shape=jax.ShapeDtypeStruct((128, 128), jnp.float32),
                           backend=backend)
        def kernel(x_gmem, o_gmem):
            def body(idx, x_smem, o_smem):
                @pl.when(idx[1] == 0)
                def _():
                    o_smem[...] = jnp.zeros_like(o_smem)
                o_smem[...] += x_smem[...]

            plgpu.emit_pipeline(body, grid=(1, 4),
                                in_specs=[pl.BlockSpec((128, 128), lambda i, j: (i, j))],
                                out_specs=[pl.BlockSpec((128, 128), lambda i, j: (i, 0))],
                                max_concurrent_steps=2)(x_gmem, o_gmem)
        return kernel(x)

    out = colblock_sum(x, "interpret")
    np.testing.assert_allclose(out, x.reshape(128, 4, 128).sum(1), rtol=1e-5, atol=1e-5)
    low = jax.jit(functools.partial(colblock_sum, backend="mosaic_gpu")).trace(x).lower(
        lowering_platforms=("cuda",))
    text = str(inspection.check_call(inspection.custom_calls(low)[0]))
    store = "cp.async.bulk.tensor.global.shared.cta"
    assert store in text
    body = text[text.index("scf.for"):]
    assert body.index("scf.if") < body.index(store)
