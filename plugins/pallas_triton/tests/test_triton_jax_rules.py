"""The Triton rules added to match JAX's Triton lowering rule for rule: each kernel runs on the
interpreter and through the Triton emulator (``pl.emulate(f, backend="triton")``, which executes
the emitted TTIR), both against ``jax.numpy`` on random inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl
from pallas_core import backend as plb

plt = pytest.importorskip("pallas_triton")

F32 = jnp.float32
S = jax.ShapeDtypeStruct


def _rand(shape: tuple[int, ...], dtype: Any = F32, seed: int = 0) -> jax.Array:
    rng = np.random.default_rng(seed)
    if np.issubdtype(np.dtype(dtype), np.integer):
        return jnp.asarray(rng.integers(-20, 20, shape), dtype)
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _both(kernel: Callable[..., None], out: Any, *args: jax.Array, grid: Any = (),
          in_specs: Any = None, out_specs: Any = None, **kw: Any) -> list[Any]:
    """``kernel`` run on the interpreter and emulated as the Triton backend lowers it."""
    specs = {} if in_specs is None else {"in_specs": in_specs, "out_specs": out_specs}

    def call(**backend: Any) -> Any:
        return pl.pallas_call(kernel, out_shape=out, grid=grid, **specs, **kw, **backend)

    return [call(interpret=True)(*args),
            pl.emulate(call(compiler_params=plt.CompilerParams()), backend="triton",
                       checked=True)(*args)]


def _values(body: Callable[..., Any], out: Any, *args: jax.Array) -> list[Any]:
    """A kernel reading every operand whole and writing ``body`` of them whole."""
    def kernel(*refs: Any) -> None:
        refs[-1][...] = body(*(r[...] for r in refs[:-1]))
    return _both(kernel, out, *args)


def _close(gots: list[Any], want: Any, tol: float = 1e-5) -> None:
    for got in gots:
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)


# --- argmax, argmin ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, jnp.int32, jnp.uint8, jnp.bfloat16])
@pytest.mark.parametrize("fn", [jnp.argmax, jnp.argmin])
@pytest.mark.parametrize("axis", [0, 1])
def test_argmax_argmin(fn: Any, axis: int, dtype: Any) -> None:
    x = _rand((16, 32), dtype)
    if dtype == jnp.uint8:
        x = jnp.asarray(np.random.default_rng(1).integers(0, 255, (16, 32)), dtype)
    x = x.at[3, 5].set(x[3, 9]).at[7].set(x[7, 0])  # ties: the first index wins
    if jnp.issubdtype(dtype, jnp.floating):
        x = x.at[2, 4].set(jnp.nan).at[2, 30].set(jnp.nan).at[9, 1].set(jnp.nan)
    out = S((32,) if axis == 0 else (16,), jnp.int32)
    _close(_values(lambda v: fn(v, axis=axis).astype(jnp.int32), out, x), fn(x, axis=axis))


# --- cumulative reductions --------------------------------------------------------------------


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("op", [lax.cumsum, lax.cumprod, lax.cummax, lax.cummin])
@pytest.mark.parametrize("dtype,axis", [(F32, 1), (F32, 0), (jnp.int32, 1)])
def test_cumulative(op: Any, reverse: bool, dtype: Any, axis: int) -> None:
    x = _rand((8, 16), dtype)
    if op is lax.cumprod:
        x = (x / 4 + 1) if dtype == F32 else jnp.sign(x) + (x % 2)
    want = op(x, axis=axis, reverse=reverse)
    _close(_values(lambda v: op(v, axis=axis, reverse=reverse), S(x.shape, dtype), x), want,
           tol=1e-4)


@pytest.mark.parametrize("op", [lax.cummax, lax.cummin])
def test_cumulative_unsigned(op: Any) -> None:
    x = jnp.asarray(np.random.default_rng(2).integers(0, 255, (4, 16)), jnp.uint8)
    _close(_values(lambda v: op(v, axis=1), S(x.shape, jnp.uint8), x), op(x, axis=1))


# --- joining and splitting --------------------------------------------------------------------


@pytest.mark.parametrize("pieces,axis", [(2, 0), (2, 1), (4, 1), (2, 2)])
def test_concatenate(pieces: int, axis: int) -> None:
    x = _rand((4, 8, 2))
    want = jnp.concatenate([x * (i + 1) for i in range(pieces)], axis=axis)
    gots = _values(lambda v: jnp.concatenate([v * (i + 1) for i in range(pieces)], axis=axis),
                   S(want.shape, F32), x)
    _close(gots, want)


@pytest.mark.parametrize("pieces,axis", [(2, 0), (2, 1), (2, 2), (4, 1)])
def test_stack(pieces: int, axis: int) -> None:
    x = _rand((8, 16))
    want = jnp.stack([x + i for i in range(pieces)], axis=axis)
    _close(_values(lambda v: jnp.stack([v + i for i in range(pieces)], axis=axis),
                   S(want.shape, F32), x), want)


@pytest.mark.parametrize("parts,axis", [(2, 0), (4, 1), (8, 1)])
def test_split(parts: int, axis: int) -> None:
    x = _rand((8, 16))

    def body(v: Any) -> Any:
        return sum((i + 1) * p for i, p in enumerate(jnp.split(v, parts, axis=axis)))

    _close(_values(body, S(body(x).shape, F32), x), body(x))


@pytest.mark.parametrize("axis", [0, 1])
def test_unstack(axis: int) -> None:
    x = _rand((4, 4, 8))

    def body(v: Any) -> Any:
        return sum((i + 1) * p for i, p in enumerate(lax.unstack(v, axis=axis)))

    _close(_values(body, S(body(x).shape, F32), x), body(x))


def test_uneven_concatenate_is_refused() -> None:
    x = _rand((8, 16))
    with pytest.raises(pl.UnsupportedError, match="concatenating arrays of different shapes"):
        pl.emulate(pl.pallas_call(
            lambda r, o: o.__setitem__(..., jnp.concatenate([r[...], r[:, pl.ds(0, 8)]], 1)),
            out_shape=S((8, 24), F32), compiler_params=plt.CompilerParams()),
            backend="triton")(x)


@pytest.mark.parametrize("src,shape", [((1, 16), (8, 16)), ((8, 1), (8, 16)), ((16,), (8, 16)),
                                       ((), (4, 8))])
def test_broadcast_to(src: tuple[int, ...], shape: tuple[int, ...]) -> None:
    """JAX's equal-rank ``broadcast_to`` primitive (what indexing with several arrays binds)."""
    x = _rand(src)
    want = jnp.broadcast_to(x, shape)
    _close(_values(lambda v: plb.broadcast_to_p.bind(v, shape=shape), S(shape, F32), x), want)


# --- elementwise math, checkpoint -------------------------------------------------------------


@pytest.mark.parametrize("fn,domain", [
    (jnp.arcsin, jnp.tanh), (jnp.arccos, jnp.tanh), (jnp.arctanh, jnp.tanh),
    (jnp.sinh, None), (jnp.cosh, None), (jnp.arcsinh, None),
    (jnp.arccosh, lambda v: 1 + v * v)])
def test_hyperbolic_and_inverse_trig(fn: Any, domain: Any) -> None:
    x = _rand((8, 32)) * 2
    x = domain(x) if domain else x
    _close(_values(fn, S(x.shape, F32), x), fn(x), tol=1e-5)


@pytest.mark.parametrize("dtype", [F32, jnp.float16])
def test_nextafter(dtype: Any) -> None:
    x = _rand((8, 32), dtype)
    y = _rand((8, 32), dtype, seed=1)
    x = x.at[0, :4].set(0).at[1, 0].set(jnp.nan).at[2].set(y[2]).at[3, 0].set(-0.0)
    y = y.at[0, 1].set(-1).at[3, 0].set(2)
    want = lax.nextafter(x, y)
    for got in _values(lax.nextafter, S(x.shape, dtype), x, y):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16 if dtype != F32
                                                           else np.uint32),
                                      np.asarray(want).view(np.uint16 if dtype != F32
                                                            else np.uint32))


def test_checkpoint_inlines() -> None:
    x = _rand((8, 16))

    def body(v: Any) -> Any:
        return jax.checkpoint(lambda u: jnp.sin(u) * u)(v) + 1
    _close(_values(body, S(x.shape, F32), x), body(x))


# --- memory: +=, several index arrays; named grid axes ------------------------------------------


def test_addupdate_from_every_program() -> None:
    """Each program adds its row block into one shared output block (aliased to an input that
    holds its starting values): atomic, so no program's sums are lost."""
    x, init = _rand((64, 32)), _rand((8, 32), seed=1)

    def kernel(x_ref: Any, init_ref: Any, o_ref: Any) -> None:
        o_ref[...] += x_ref[...]

    gots = _both(kernel, S((8, 32), F32), x, init, grid=(8,), in_specs=[
        pl.BlockSpec((8, 32), lambda i: (i, 0)), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((8, 32), lambda i: (0, 0)), input_output_aliases={1: 0})
    _close(gots, init + x.reshape(8, 8, 32).sum(0), tol=1e-4)


GATHERS: dict[str, Callable[[Any, Any, Any], tuple[Any, ...]]] = {
    # Index arrays side by side: their (8, 4) shape where they stand.
    "rows_cols": lambda a, r, c: (2, r[:, None], c[None]),
    "slice_rows_cols": lambda a, r, c: (pl.ds(1, 4), r[:, None], c[None]),
    # Parted by a slice: their shape in front.
    "parted_by_slice": lambda a, r, c: (a[:, None], pl.ds(1, 8), c[None]),
    "array_and_scalar": lambda a, r, c: (a, 7, pl.ds(2, 8)),
}


def _numpy_index(i: Any) -> Any:
    return slice(i.start, i.start + i.size) if isinstance(i, pl.Slice) else np.asarray(i)


@pytest.mark.parametrize("form", list(GATHERS))
def test_gather_with_several_index_arrays(form: str) -> None:
    """NumPy's advanced indexing on a Ref, loaded with a mask (the norm backward kernels'
    ``x_ref.at[rows[:, None], cols[None]]``); rows past the array are masked."""
    x = _rand((6, 10, 12))
    a = jnp.asarray([5, 0, 3, 3, 1, 4, 2, 4], jnp.int32)
    r = jnp.asarray([9, 0, 3, 3, 1, 12, 2, 4], jnp.int32)  # 12: past the array
    c = jnp.asarray([11, 2, 0, 9], jnp.int32)
    index = GATHERS[form]
    valid = np.asarray(r) < 10
    idx = index(np.asarray(a), np.where(valid, np.asarray(r), 0), np.asarray(c))
    want = np.asarray(x)[tuple(_numpy_index(i) for i in idx)]
    masked = form.endswith("rows_cols")
    if masked:
        want = np.where(valid[:, None], want, -1.0)

    def kernel(x_ref: Any, a_ref: Any, r_ref: Any, c_ref: Any, o_ref: Any) -> None:
        rows = r_ref[...]
        mask = (rows < 10)[:, None] & (c_ref[...] < 12)[None] if masked else None
        v = plt.load(x_ref.at[index(a_ref[...], rows, c_ref[...])], mask=mask,
                     other=-1.0 if masked else None)
        o_ref[...] = v * 2

    _close(_both(kernel, S(want.shape, F32), x, a, r, c), jnp.asarray(want * 2))


def test_scatter_with_two_index_arrays() -> None:
    x = _rand((8, 4))
    rows = jnp.asarray([7, 1, 4, 2, 0, 6, 5, 3], jnp.int32)
    cols = jnp.asarray([3, 0, 2, 1], jnp.int32)

    def kernel(x_ref: Any, r_ref: Any, c_ref: Any, o_ref: Any) -> None:
        plt.store(o_ref.at[r_ref[...][:, None], c_ref[...][None]], x_ref[...] + 1)

    want = np.zeros((8, 4), np.float32)
    want[np.asarray(rows)[:, None], np.asarray(cols)[None]] = np.asarray(x) + 1
    _close(_both(kernel, S((8, 4), F32), x, rows, cols), jnp.asarray(want))


def test_axis_index_of_a_named_grid_axis() -> None:
    x = _rand((4, 3, 8))

    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * lax.axis_index("j") + lax.axis_index("i")

    spec = pl.BlockSpec((None, None, 8), lambda i, j: (i, j, 0))
    gots = _both(kernel, S(x.shape, F32), x, grid=(4, 3), in_specs=[spec], out_specs=spec,
                 _grid_names=("i", "j"))
    want = x * jnp.arange(3)[None, :, None] + jnp.arange(4)[:, None, None]
    _close(gots, want)
