"""``pl.debug_print`` in Mosaic TPU kernels, lowered as JAX lowers it: scalars through
``tpu.log`` (``{}`` placeholders become ``$s0``, ``$u1``, ``$f2``...), one array after a prefix
through a VMEM buffer and ``tpu.log_buffer``. The module agrees with JAX's, and the emulator
prints what the interpreter prints for the same kernel on random inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jax_pl
from jax.experimental.pallas import tpu as jax_pltpu

import pallas_core as pl
from pallas_core import backend as plb

pltpu = pytest.importorskip("pallas_mosaic_tpu")
from pallas_mosaic_tpu import inspection  # noqa: E402

TYPED = jax.__version_info__ >= (0, 11)


def _lower(f: Callable[..., Any], *args: Any) -> Any:
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    (found,) = inspection.kernels(text)  # decoded and verified
    return found[1]


def _printing(m: Any, vector: bool, **kw: Any) -> Any:
    tpu = pltpu if m is pl else jax_pltpu

    def kernel(x_ref: Any, n_ref: Any, f_ref: Any, o_ref: Any) -> None:
        if vector:
            m.debug_print("row: {}", x_ref[0:8, 0:128])
        else:
            # Floats are logged from JAX 0.11 on; JAX 0.10 logs 32-bit integers only.
            second = f_ref[0] if TYPED else n_ref[0] + 1
            m.debug_print("n = {}, f = {}", n_ref[0], second)
        o_ref[...] = x_ref[...] * 2.0

    smem = m.BlockSpec(memory_space=tpu.SMEM)
    return m.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                         in_specs=[m.BlockSpec((8, 128), lambda: (0, 0)), smem, smem], **kw)


@pytest.mark.parametrize("vector", [False, True], ids=["scalars", "array"])
def test_prints_as_the_interpreter_and_lowers_like_jax(vector: bool, capfd: Any) -> None:
    x = jnp.round(jax.random.normal(jax.random.key(0), (8, 128), jnp.float32) * 4) / 4
    n = jax.random.randint(jax.random.key(1), (1,), 0, 100, jnp.int32)
    f = x[0, :1] + 0.5
    got = _printing(pl, vector, backend="interpret")(x, n, f)
    jax.effects_barrier()
    interpreted = capfd.readouterr().out
    emulated = pl.emulate(_printing(pl, vector), backend="mosaic_tpu")(x, n, f)
    printed = capfd.readouterr().out
    np.testing.assert_allclose(got, x * 2.0)
    np.testing.assert_allclose(emulated, x * 2.0)
    assert printed == interpreted and printed.strip()
    ours = _lower(_printing(pl, vector), x, n, f)
    with plb.assume_device("TPU v5 lite", "tpu"):
        theirs = _lower(_printing(jax_pl, vector), x, n, f)
    inspection.assert_same_kernel(ours, theirs)
    op = "tpu.log_buffer" if vector else "tpu.log"
    assert op in str(ours)
    if not vector:
        assert ("n = $s0, f = $f1" if TYPED else "n = $0, f = $1") in str(ours)


def test_other_prints_are_refused_by_name() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        pl.debug_print("{} then", x_ref[...])
        o_ref[...] = x_ref[...]

    x = jnp.ones((8, 128), jnp.float32)
    call = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32))
    with pytest.raises(pl.UnsupportedError, match="placeholder not at the end"):
        _lower(call, x)
