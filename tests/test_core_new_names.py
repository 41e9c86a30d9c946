"""Names of ``jax.experimental.pallas`` added for issue 28: ``pl.empty_ref_like``,
``pl.pallas_export_experimental``, ``pl.semaphore``, ``pl.HOST`` and ``pl.select_ref`` on the
interpreter, each against ``jax.numpy`` or JAX's own objects. (Their TPU lowering is tested in
``plugins/pallas_mosaic_tpu/tests/test_tpu_memory_names.py``.)"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jax_pl

import pallas_core as pl
from pallas_core import backend as plb


def _x(shape: tuple[int, ...] = (8, 16), seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def test_empty_ref_like_makes_a_ref_that_core_map_writes() -> None:
    x = _x()
    sds = jax.ShapeDtypeStruct(x.shape, x.dtype)

    def f(x: Any) -> Any:
        out, theirs = pl.empty_ref_like(sds), jax_pl.empty_ref_like(sds)
        x_ref = jax.new_ref(x)
        assert jax.typeof(out).shape == jax.typeof(theirs).shape == x.shape
        assert jax.typeof(out).dtype == x.dtype

        @pl.core_map(pl.Mesh(("c",), (1,)), backend="interpret")
        def _() -> None:
            out[...] = jnp.sin(x_ref[...]) * 2.0

        return out[...]

    np.testing.assert_allclose(jax.jit(f)(x), jnp.sin(x) * 2.0, rtol=1e-6)
    with pytest.raises(pl.ArgumentError, match="ShapeDtypeStruct"):
        pl.empty_ref_like(x)


def test_pallas_export_experimental_with_static_shapes_changes_nothing() -> None:
    x = _x()
    f = pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] + 1.0),
                       jax.ShapeDtypeStruct(x.shape, x.dtype), backend="interpret")
    with pl.pallas_export_experimental(dynamic_shapes=False):
        np.testing.assert_allclose(f(x), x + 1.0)
    with pl.pallas_export_experimental(dynamic_shapes=True):  # JAX's flag, set inside only
        assert plb.dynamic_shapes_export_enabled()
        np.testing.assert_allclose(f(x), x + 1.0)
    assert not plb.dynamic_shapes_export_enabled()
    with (pytest.raises(pl.ArgumentError, match="expected a bool"),
          pl.pallas_export_experimental(dynamic_shapes="yes")):  # type: ignore[arg-type]
        pass


def test_semaphore_is_a_dtype_class_like_jaxs() -> None:
    assert jnp.issubdtype(pl.semaphore, jax.dtypes.extended)
    assert jnp.issubdtype(jax_pl.semaphore, jax.dtypes.extended)
    assert pl.semaphore.__name__ == jax_pl.semaphore.__name__


def test_host_is_a_whole_array_memory_space() -> None:
    # JAX 0.10's HOST prints 'host'; 0.12's is the MemorySpace.Host member.
    assert pl.MemorySpace.HOST is pl.HOST
    assert str(pl.HOST) == str(jax_pl.HOST).lower().split(".")[-1]
    x = _x()

    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * 5.0

    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                       in_specs=[pl.BlockSpec(memory_space=pl.HOST)], backend="interpret")
    np.testing.assert_allclose(f(x), 5.0 * x)


@pytest.mark.parametrize("which", [0, 1, 2])
def test_select_ref_reads_the_ref_the_index_names(which: int) -> None:
    xs = [_x(seed=s) for s in range(3)]

    def kernel(i_ref: Any, a_ref: Any, b_ref: Any, c_ref: Any, o_ref: Any) -> None:
        o_ref[...] = pl.select_ref(i_ref[0], a_ref, b_ref, c_ref)[...]

    smem = pl.BlockSpec(memory_space=pl.ANY)
    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct(xs[0].shape, jnp.float32),
                       in_specs=[smem, pl.BlockSpec(), pl.BlockSpec(), pl.BlockSpec()],
                       backend="interpret")
    np.testing.assert_array_equal(f(jnp.array([which], jnp.int32), *xs), xs[which])
