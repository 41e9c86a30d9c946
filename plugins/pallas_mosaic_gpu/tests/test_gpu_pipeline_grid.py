"""``plgpu.emit_pipeline`` over a grid known only at run time (JAX's transposed_ragged_dot
pipelines over the K blocks of a group, read from GMEM): max_concurrent_steps slots, the first
fetches guarded by the step count, a loop with a dynamic bound."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl
from pallas_core.call import force_interpret_mode

plgpu = pytest.importorskip("pallas_mosaic_gpu")
from pallas_mosaic_gpu import inspection  # noqa: E402

BLOCK = 128


def add_one_prefix(n: jax.Array, x: jax.Array) -> jax.Array:
    """``x + 1`` on the first ``n[0]`` blocks of ``x`` (the rest of the output unwritten)."""
    def body(n_gmem: Any, x_gmem: Any, o_gmem: Any) -> None:
        def step(_: Any, x_smem: Any, o_smem: Any) -> None:
            o_smem[...] = x_smem[...] + 1.0

        spec = pl.BlockSpec((BLOCK,), lambda i: (i,))
        plgpu.emit_pipeline(step, grid=(n_gmem[0],), in_specs=[spec], out_specs=[spec],
                            max_concurrent_steps=3)(x_gmem, o_gmem)

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype))(n, x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("blocks", [0, 2, 5])
def test_dynamic_grid_in_the_interpreter(blocks: int) -> None:
    x = jax.random.normal(jax.random.key(blocks), (8 * BLOCK,), jnp.float32)
    n = jnp.array([blocks], jnp.int32)
    with force_interpret_mode():
        got = add_one_prefix(n, x)
    np.testing.assert_allclose(got[:blocks * BLOCK], x[:blocks * BLOCK] + 1.0, rtol=1e-6)


def test_dynamic_grid_lowers_with_max_concurrent_steps_slots() -> None:
    x = jax.ShapeDtypeStruct((8 * BLOCK,), jnp.float32)
    n = jax.ShapeDtypeStruct((1,), jnp.int32)
    text = jax.jit(add_one_prefix).trace(n, x).lower(lowering_platforms=("cuda",)).as_text()
    ((_, module),) = inspection.kernels(text)
    # 3 slots of the input block (512 bytes each, 1024-aligned: 3 x 512 packed in 1536, the
    # output buffer at 2048), then 3 barriers.
    assert inspection.launch(module)["smem_bytes"] == 2048 + 512 + 3 * 8
    assert "scf.while" in str(module) or "scf.for" in str(module)


def test_static_grid_still_shrinks_the_slots() -> None:
    def body(x_gmem: Any, o_gmem: Any) -> None:
        spec = pl.BlockSpec((BLOCK,), lambda i: (i,))
        plgpu.emit_pipeline(lambda _, x, o: o.__setitem__(..., x[...]), grid=(np.int64(2),),
                            in_specs=[spec], out_specs=[spec], max_concurrent_steps=4)(
            x_gmem, o_gmem)

    x = jax.ShapeDtypeStruct((2 * BLOCK,), jnp.float32)
    fn = plgpu.kernel(body, out_type=x)
    text = jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    ((_, module),) = inspection.kernels(text)
    assert inspection.launch(module)["smem_bytes"] == 1024 + 512 + 2 * 8
