"""``pl.cdiv`` (and ``pl.align_to``, ``pl.loop``'s trip count) on sizes and on traced integers.

``pl.cdiv`` is JAX's definition: ``(a + b - 1) // b`` on sizes, ``lax.div(a + (b - 1), b)`` on
arrays. The traced form is one ``add`` and one truncating ``div``, which every backend lowers;
the kernel below uses it on program ids, in the body and in an index map, and is lowered for
each installed hardware backend and run by the interpreter against numpy.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jax_pl

import pallas_core as pl
from pallas_core.plugins import manager

GRID, BLOCK = 4, (8, 128)


def _kernel(x_ref, o_ref):
    i = pl.program_id(0)
    o_ref[...] = (x_ref[...] + 1000 * pl.cdiv(i + 3, 2) + 100 * pl.cdiv(7, i + 1)
                  + 10 * pl.align_to(i, 3) + pl.cdiv(i, jnp.int32(GRID)))


def _call(backend: str):
    # The input block of step i is block cdiv(i + 1, 2) - 1: 0, 0, 1, 1.
    return pl.pallas_call(
        _kernel, jax.ShapeDtypeStruct((GRID * BLOCK[0], BLOCK[1]), jnp.int32), grid=(GRID,),
        in_specs=[pl.BlockSpec(BLOCK, lambda i: (pl.cdiv(i + 1, 2) - 1, 0))],
        out_specs=pl.BlockSpec(BLOCK, lambda i: (i, 0)), backend=backend)


def _expected(x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    for i in range(GRID):
        src = -(-(i + 1) // 2) - 1
        blk = x[src * BLOCK[0]:(src + 1) * BLOCK[0]]
        out[i * BLOCK[0]:(i + 1) * BLOCK[0]] = (
            blk + 1000 * -(-(i + 3) // 2) + 100 * -(-7 // (i + 1)) + 10 * -(-i // 3) * 3
            + -(-i // GRID))
    return out


def _input() -> jax.Array:
    return jax.random.randint(jax.random.key(0), (GRID * BLOCK[0], BLOCK[1]), -500, 500,
                              jnp.int32)


def test_cdiv_on_program_ids_runs_in_the_interpreter() -> None:
    x = _input()
    np.testing.assert_array_equal(_call("interpret")(x), _expected(np.asarray(x)))


@pytest.mark.parametrize(("backend", "platform"), [
    ("triton", "cuda"), ("mosaic_tpu", "tpu"), ("mosaic_gpu", "cuda")])
def test_cdiv_on_program_ids_lowers(backend: str, platform: str) -> None:
    if backend not in manager.backends():
        pytest.skip(f"the {backend} backend is not installed")
    text = jax.jit(_call(backend)).trace(_input()).lower(
        lowering_platforms=(platform,)).as_text()
    assert "custom_call" in text


@pytest.mark.parametrize(("a", "b"), list(itertools.product(
    [-9, -8, -7, -1, 0, 1, 7, 8, 9, 100], [-4, -3, -1, 1, 3, 4, 8])))
def test_cdiv_matches_jax_on_ints_and_arrays(a: int, b: int) -> None:
    """Traced values agree with JAX's for every sign; sizes agree with the traced form (as in
    JAX 0.11), and with JAX's on sizes, where every version agrees: a >= 0, b > 0."""
    traced = jax.jit(lambda x, y: (pl.cdiv(x, y), pl.cdiv(x, b), pl.cdiv(a, y)))
    theirs = jax.jit(lambda x, y: (jax_pl.cdiv(x, y), jax_pl.cdiv(x, b), jax_pl.cdiv(a, y)))
    args = (jnp.int32(a), jnp.int32(b))
    ours = [int(v) for v in traced(*args)]
    assert ours == [int(v) for v in theirs(*args)]
    assert pl.cdiv(a, b) == pl.cdiv(np.int32(a), b) == ours[0]
    expected = abs(a + b - 1) // abs(b) * (1 if (a + b - 1 < 0) == (b < 0) else -1)
    assert pl.cdiv(a, b) == expected
    if a >= 0 and b > 0:
        assert pl.cdiv(a, b) == jax_pl.cdiv(a, b) == -(-a // b)
        assert pl.align_to(a, b) == jax_pl.align_to(a, b)


def test_cdiv_of_sizes_is_a_python_int() -> None:
    assert pl.cdiv(1000, 128) == 8 and isinstance(pl.cdiv(1000, 128), int)
    assert pl.cdiv(np.int64(1024), 128) == 8


@pytest.mark.parametrize(("lower", "upper", "step"), [
    (0, 10, 3), (10, 0, -2), (10, 1, -2), (3, 3, 1), (5, 0, 1), (0, 5, -1), (-7, 8, 4)])
@pytest.mark.parametrize("traced", ["none", "bounds", "all"])
def test_loop_trip_count_is_that_of_range(lower: int, upper: int, step: int,
                                          traced: str) -> None:
    def count(lo, up, st):
        @pl.loop(lo, up, step=st, init_carry=jnp.zeros((2,), jnp.int32))
        def total(i, carry):
            return carry + jnp.stack([jnp.int32(1), jnp.asarray(i, jnp.int32)])
        return total

    if traced == "none":
        n, s = count(lower, upper, step)
    elif traced == "bounds":
        n, s = jax.jit(lambda lo, up: count(lo, up, step))(lower, upper)
    else:
        n, s = jax.jit(count)(lower, upper, step)
    r = range(lower, upper, step)
    assert (int(n), int(s)) == (len(r), sum(r))
