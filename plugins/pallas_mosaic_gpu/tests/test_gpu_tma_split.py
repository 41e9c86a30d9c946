"""TMA copies of blocks with a dimension above 256 (``pallas_mosaic_gpu.tma``): they lower for
``cuda`` into a module that parses back and verifies, with the copies, boxes and barrier bytes
the split implies; the same kernels match ``jax.numpy`` in the interpreter on random inputs."""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl

plgpu = pytest.importorskip("pallas_mosaic_gpu")
from pallas_mosaic_gpu import hopper_kernels as K  # noqa: E402, N812
from pallas_mosaic_gpu import inspection, tma  # noqa: E402

S = jax.ShapeDtypeStruct
STORES = "nvvm.cp.async.bulk.tensor.global.shared.cta"


def _module(fn: Any, *args: Any) -> str:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    (found,) = inspection.kernels(text)  # hash checked, parsed back and verified
    return str(found[1])


def _expected_bytes(module: str) -> list[int]:
    """The byte counts announced to barriers: an ``nvvm`` operation (JAX 0.10) or inline PTX
    whose operands follow its constraint string (JAX 0.12)."""
    return [int(n) for n in re.findall(
        r"mbarrier\.arrive\.expect_tx(?:\.[^\n]*?\" %\w+,| %\w+,) %c(\d+)_i32", module)]


def _boxes(module: str) -> list[tuple[int, ...]]:
    """The shapes of the SMEM views the TMA copies move (their boxes)."""
    views = re.findall(r"output_shape \[([\d, ]+)\] : memref<[^>]*workgroup", module)
    return [tuple(int(d) for d in v.split(", ")) for v in views]


def _softmax(block_rows: int, shape: tuple[int, int], dtype: Any) -> tuple[Any, jax.Array]:
    x = (jax.random.normal(jax.random.key(sum(shape)), shape) * 3).astype(dtype)
    return functools.partial(K.softmax, block_rows=block_rows), x


@pytest.mark.parametrize("block_rows, shape, dtype, loads", [
    (64, (256, 384), jnp.float32, 1),    # minor 384 = 2 rows of 192: one 3-D box per copy
    (384, (768, 64), jnp.float32, 2),    # 384 rows = 256 + 128: two copies each way
    (64, (128, 512), jnp.bfloat16, 1),   # tiled (8, 64) buffers: never split
])
def test_wide_softmax_lowers_and_matches(block_rows: int, shape: tuple[int, int], dtype: Any,
                                         loads: int) -> None:
    fn, x = _softmax(block_rows, shape, dtype)
    module = _module(fn, S(x.shape, x.dtype))
    assert inspection.tma_loads(module) == loads and module.count(STORES) == loads
    block_bytes = block_rows * shape[1] * np.dtype(dtype).itemsize
    assert _expected_bytes(module) == [block_bytes]  # announced once for all the copies
    got = fn(x, backend="interpret")
    want = jax.nn.softmax(x.astype(jnp.float32), axis=1).astype(dtype)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2e-2 if dtype == jnp.bfloat16 else 1e-5, atol=1e-6)


def test_minor_split_box() -> None:
    fn, x = _softmax(64, (256, 384), jnp.float32)
    assert (64, 2, 192) in _boxes(_module(fn, S(x.shape, x.dtype)))


def test_float32_512_columns_split_and_share_one_buffer() -> None:
    """(64, 512) float32 blocks are 128 KiB each; the output is staged in the input's buffer
    (``smem_reuse``, tested in test_gpu_smem_reuse.py), and each copy moves (64, 2, 256)."""
    fn, x = _softmax(64, (256, 512), jnp.float32)
    module = _module(fn, S(x.shape, x.dtype))
    assert inspection.tma_loads(module) == 1 and module.count(STORES) == 1
    assert "output_shape [64, 2, 256]" in module and _expected_bytes(module) == [64 * 512 * 4]


def _copy_kernel(start: Any, n: int = 512) -> Any:
    @functools.partial(plgpu.kernel, out_shape=S((n,), jnp.float32),
                       scratch_shapes=[plgpu.SMEM((n,), jnp.float32),
                                       plgpu.Barrier(num_arrivals=1)],
                       grid=(1,), grid_names=("x",), backend="mosaic_gpu")
    def kernel(x_ref: Any, o_ref: Any, smem: Any, barrier: Any) -> None:
        begin = start if isinstance(start, int) else start * lax.axis_index("x")
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(begin, n)], smem, barrier.at[0])
        plgpu.barrier_wait(barrier.at[0])
        smem[...] = smem[...] * 2.0
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, o_ref)
        plgpu.wait_smem_to_gmem(0)

    return kernel


def test_explicit_copy_of_512_elements() -> None:
    module = _module(_copy_kernel(512), S((1024,), jnp.float32))
    assert inspection.tma_loads(module) == 1 and module.count(STORES) == 1
    assert (2, 256) in _boxes(module) and _expected_bytes(module) == [2048]
    assert module.count("cp.async.bulk.commit.group") == 1


def test_explicit_copy_with_a_dynamic_minor_start_is_refused() -> None:
    with pytest.raises(pl.UnsupportedError, match="multiple of 256"):
        _module(_copy_kernel(7), S((1024,), jnp.float32))


def test_split_plan() -> None:
    assert tma.minor_tile(200, 1000, 4) == 200       # fits one box
    assert tma.minor_tile(512, 1024, 4) == 256
    assert tma.minor_tile(384, 384, 4) == 192
    assert tma.minor_tile(512, 1004, 4) == 4         # gcd 4: 128 rows of 4
    assert tma.minor_tile(2048, 1004, 4) is None     # 512 rows of 4 are too many
    assert tma.minor_tile(512, 1002, 4) is None      # rows of 2 are 8 bytes
    assert tma.split_problem((64, 384), 384, 4) is None
    assert "minor dimension of 2048" in str(tma.split_problem((8, 2048), 1004, 4))
    assert "dimensions [0, 1]" in str(tma.split_problem((300, 300, 16), 16, 1))
