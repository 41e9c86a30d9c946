"""An output block staged in an input block's shared-memory buffer (``smem_reuse``): only when
the kernel would not fit otherwise and only when the kernel provably reads the input before it
first touches the output. Modules are lowered for ``cuda``, parsed back and verified; the
kernels that lower match ``jax.numpy`` in the interpreter on random inputs."""

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
from pallas_mosaic_gpu import inspection, validation  # noqa: E402

S = jax.ShapeDtypeStruct
BLOCK = (64, 512)  # 128 KiB of float32: an input and an output buffer exceed 227 KiB


def _module(fn: Any, *args: Any) -> list[str]:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    (found,) = inspection.kernels(text)  # hash checked, parsed back and verified
    return str(found[1]).splitlines()


def _smem_size(module: list[str]) -> int:
    (size,) = re.findall(r"dynamic_shared_memory_size %c(\d+)", "\n".join(module))
    return int(size)


def _rand(shape: tuple[int, ...], seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32) * 3


def _blocked(kernel: Any, n_in: int = 1, shape: tuple[int, int] = (256, 512)) -> Any:
    spec = pl.BlockSpec(BLOCK, lambda i: (i, 0))

    def fn(*xs: jax.Array, backend: str = "mosaic_gpu") -> jax.Array:
        return pl.pallas_call(kernel, S(shape, jnp.float32), grid=(shape[0] // BLOCK[0],),
                              in_specs=[spec] * n_in, out_specs=spec, backend=backend)(*xs)
    return fn


def test_wide_float32_softmax_shares_one_buffer_and_matches() -> None:
    fn = functools.partial(K.softmax, block_rows=64)
    x = _rand((256, 512))
    module = _module(fn, S(x.shape, x.dtype))
    size = _smem_size(module)
    assert size <= validation.SMEM_BYTES and size == 64 * 512 * 4 + 8  # one buffer, 1 barrier
    got = fn(x, backend="interpret")
    np.testing.assert_allclose(got, jax.nn.softmax(x, axis=1), rtol=1e-5, atol=1e-6)


def _barrier_before_first_store(module: list[str]) -> bool:
    loads = [i for i, line in enumerate(module) if "llvm.load" in line and "ptr<3>" in line]
    stores = [i for i, line in enumerate(module) if "llvm.store" in line and "ptr<3>" in line]
    syncs = [i for i, line in enumerate(module) if "bar.sync" in line]
    assert loads and stores and min(loads) < min(stores)
    return any(min(loads) < i < min(stores) for i in syncs)


def test_a_barrier_separates_the_input_reads_from_the_first_output_write() -> None:
    """Without it a warp could overwrite input elements another warp has yet to read."""
    softmax = functools.partial(K.softmax, block_rows=64)
    assert _barrier_before_first_store(_module(softmax, S((256, 512), jnp.float32)))
    assert not _barrier_before_first_store(_module(softmax, S((256, 384), jnp.float32)))


def test_kernels_that_fit_keep_their_own_buffers() -> None:
    """(64, 384) float32: 2 x 96 KiB fit, laid out as JAX lays them out (no reuse)."""
    module = _module(functools.partial(K.softmax, block_rows=64), S((256, 384), jnp.float32))
    assert _smem_size(module) == 2 * 64 * 384 * 4 + 8


def _scale(x_ref: Any, o_ref: Any) -> None:
    x = x_ref[...]
    o_ref[...] = x * 2.0 + jnp.max(x, axis=1, keepdims=True)


def test_read_then_write_kernel_lowers_and_matches() -> None:
    fn, x = _blocked(_scale), _rand((256, 512), 1)
    assert _smem_size(_module(fn, S(x.shape, x.dtype))) == 64 * 512 * 4 + 8
    np.testing.assert_allclose(fn(x, backend="interpret"),
                               x * 2 + jnp.max(x, axis=1, keepdims=True), rtol=1e-6)


def _write_then_read(x_ref: Any, o_ref: Any) -> None:
    o_ref[...] = x_ref[...] + 1.0
    o_ref[...] = o_ref[...] * x_ref[...]  # reads the input after the output was written


def _late_lazy_read(x_ref: Any, o_ref: Any) -> None:
    x = x_ref[...]  # an SMEM read the lowering defers until the value is used...
    o_ref[...] = jnp.ones(BLOCK, jnp.float32)
    o_ref[...] += x  # ...which is after the output's first write


def _read_in_cond(x_ref: Any, o_ref: Any) -> None:
    o_ref[...] = lax.cond(pl.program_id(0) == 0, lambda: x_ref[...] * 2.0, lambda: x_ref[...])


def _copy_through(x_ref: Any, o_ref: Any) -> None:
    o_ref[...] = x_ref[...]  # the read and the write are one equation


@pytest.mark.parametrize("kernel", [_write_then_read, _late_lazy_read, _read_in_cond,
                                    _copy_through])
def test_no_reuse_where_it_is_not_provably_safe(kernel: Any) -> None:
    """These kernels keep separate buffers, so (64, 512) float32 is refused as before (two
    128 KiB buffers and the input's barrier); the interpreter runs them (the refusal is about
    shared memory, not the kernel)."""
    fn, x = _blocked(kernel), _rand((256, 512), 2)
    with pytest.raises(pl.BlockSpecError, match="needs 262152 bytes of shared memory"):
        _module(fn, S(x.shape, x.dtype))
    assert fn(x, backend="interpret").shape == x.shape


def test_only_as_much_as_needed_and_still_refused_when_not_enough() -> None:
    """Two inputs and one output: sharing saves one buffer, 256 KiB and two barriers
    remain."""
    fn = _blocked(lambda x_ref, y_ref, o_ref: o_ref.__setitem__(..., x_ref[...] + y_ref[...]),
                  n_in=2)
    with pytest.raises(pl.BlockSpecError, match="needs 262160 bytes"):
        _module(fn, S((256, 512), jnp.float32), S((256, 512), jnp.float32))


def test_sequential_grids_keep_their_buffers() -> None:
    """An output revisited along a sequential axis keeps its own buffer (a later TMA load into
    the input's buffer would overwrite it)."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        x = x_ref[...]

        @pl.when(pl.program_id(1) == 0)
        def _() -> None:
            o_ref[...] = x

        @pl.when(pl.program_id(1) > 0)
        def _() -> None:
            o_ref[...] += x

    def fn(x: jax.Array, backend: str = "mosaic_gpu") -> jax.Array:
        return pl.pallas_call(kernel, S((256, 512), jnp.float32), grid=(4, 2),
                              in_specs=[pl.BlockSpec(BLOCK, lambda i, j: (i, j))],
                              out_specs=pl.BlockSpec(BLOCK, lambda i, j: (i, 0)),
                              backend=backend)(x)

    x = _rand((256, 1024), 3)
    with pytest.raises(pl.BlockSpecError, match="needs 262152 bytes"):
        _module(fn, S(x.shape, x.dtype))
    np.testing.assert_allclose(fn(x, backend="interpret"), x[:, :512] + x[:, 512:], rtol=1e-6)


def test_the_seed_softmax_example_lowers_with_64_by_512_float32_blocks() -> None:
    """``examples/softmax.py`` as written (its default 64-row blocks, 512 float32 columns)."""
    from examples import softmax as seed

    x = _rand((256, 512), 4)
    (st,) = pl.stages(seed.softmax, x, backend="mosaic_gpu", target="sm_90a")
    module = st["mosaic_gpu"].splitlines()
    assert _smem_size(module) <= validation.SMEM_BYTES
    np.testing.assert_allclose(seed.softmax(x), jax.nn.softmax(x, axis=-1), rtol=1e-5,
                               atol=1e-6)
