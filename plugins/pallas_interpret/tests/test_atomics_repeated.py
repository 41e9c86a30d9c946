"""Atomics whose lanes name the same element (integer array indices that repeat) apply one
after another, as atomic operations do: checked against a sequential numpy model, for every
read-modify-write op and compare-and-swap, masked and unmasked, in the interpreter's exact
path and its default, and in the Triton emulator.

The model runs the lanes in row-major order; each lane's returned "old" value is the element
as the lanes before it left it. (Hardware may order the lanes of one instruction otherwise:
the final contents agree for every op here but ``xchg`` and ``cas``, whose model fixes an
order the interpreter follows.)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_interpret import InterpretParams

import pallas_core as pl

OPS = {
    "add": (pl.atomic_add, np.add),
    "max": (pl.atomic_max, np.maximum),
    "min": (pl.atomic_min, np.minimum),
    "and": (pl.atomic_and, np.bitwise_and),
    "or": (pl.atomic_or, np.bitwise_or),
    "xor": (pl.atomic_xor, np.bitwise_xor),
    "xchg": (pl.atomic_xchg, lambda old, v: v),
}
BITWISE = ("and", "or", "xor")
PARAMS = {"exact": InterpretParams(fast=False), "default": None}


def _model(x: np.ndarray, positions: np.ndarray, values: np.ndarray, mask: np.ndarray,
           combine: Any) -> tuple[np.ndarray, np.ndarray]:
    """The lanes one at a time: (new x, each lane's old value)."""
    x = x.copy()
    flat = x.reshape(-1)
    olds = np.zeros(positions.shape, x.dtype)
    for lane in np.ndindex(positions.shape):
        p = positions[lane]
        olds[lane] = flat[p]
        if mask[lane]:
            flat[p] = combine(flat[p], values[lane])
    return x, olds


def _inputs(op: str, seed: int, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    if op in BITWISE:
        return (rng.integers(0, 1 << 16, shape).astype(np.int32),
                rng.integers(0, 1 << 16, (16, *shape[1:])).astype(np.int32))
    # Small integers in float32: sums are exact in any order.
    return (rng.integers(-8, 8, shape).astype(np.float32),
            rng.integers(-8, 8, (16, *shape[1:])).astype(np.float32))


CASES = [(op, masked, "exact") for op in OPS for masked in (False, True)] + [
    ("add", True, "default"), ("xchg", False, "default")]


@pytest.mark.parametrize(("op", "masked", "params"), CASES)
def test_repeated_indices_apply_in_sequence(op: str, masked: bool, params: str) -> None:
    """16 lanes onto 8 elements: indices drawn with repeats (the issue's
    ``[0, 1, 1, 3, 3, 3, 5, 7]`` pattern and random ones)."""
    atomic, combine = OPS[op]
    x, values = _inputs(op, seed=len(op) + masked, shape=(8,))
    rng = np.random.default_rng(7)
    idx = np.concatenate([[0, 1, 1, 3, 3, 3, 5, 7], rng.integers(0, 8, 8)]).astype(np.int32)
    mask = rng.random(16) < 0.7 if masked else np.ones(16, bool)

    def kernel(x_ref: Any, i_ref: Any, v_ref: Any, m_ref: Any, o_ref: Any, old_ref: Any) -> None:
        o_ref[...] = x_ref[...]
        old_ref[...] = atomic(o_ref, (i_ref[...],), v_ref[...],
                              mask=m_ref[...] != 0 if masked else None)

    out_shape = (jax.ShapeDtypeStruct((8,), x.dtype), jax.ShapeDtypeStruct((16,), x.dtype))
    fn = pl.pallas_call(kernel, out_shape=out_shape, backend="interpret",
                        interpret=PARAMS[params] or False)
    got, olds = fn(x, idx, values, mask.astype(np.int32))
    want, want_olds = _model(x, idx, values, mask, combine)
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(olds), want_olds)


def test_the_issues_example_sums_every_update() -> None:
    idx = jnp.array([0, 1, 1, 3, 3, 3, 5, 7], jnp.int32)

    def kernel(i_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jnp.zeros_like(o_ref)
        pl.atomic_add(o_ref, (i_ref[...],), jnp.ones((8,), jnp.float32))

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
                         backend="interpret")(idx)
    np.testing.assert_array_equal(np.asarray(out), [1, 2, 0, 3, 0, 1, 0, 1])


@pytest.mark.parametrize("op", ["add", "max", "xor"])
def test_repeated_rows_of_a_2d_ref(op: str) -> None:
    """Integer array indices on the first axis and a slice on the second: whole rows repeat;
    lanes go row by row."""
    atomic, combine = OPS[op]
    x, _ = _inputs(op, seed=3, shape=(4, 128))
    rng = np.random.default_rng(11)
    idx = rng.integers(0, 4, 6).astype(np.int32)
    values = _inputs(op, seed=5, shape=(6, 128))[0]

    def kernel(x_ref: Any, i_ref: Any, v_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...]
        atomic(o_ref, (i_ref[...], slice(None)), v_ref[...])

    got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                         backend="interpret")(x, idx, values)
    positions = idx[:, None] * 128 + np.arange(128)[None, :]
    want, _ = _model(x, positions, values, np.ones(positions.shape, bool), combine)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_compare_and_swap_at_repeated_indices() -> None:
    """Lane by lane: a lane swaps only if the element still holds its ``cmp``, so of the
    lanes that expect the initial value at one element, the first wins."""
    x = np.array([5, 6, 7, 8], np.int32)
    idx = np.array([0, 0, 1, 2, 2, 2, 3, 3], np.int32)
    cmp = np.array([5, 5, 6, 7, 100, 7, 8, 30], np.int32)
    val = np.array([10, 20, 30, 40, 50, 60, 30, 31], np.int32)

    def kernel(x_ref: Any, i_ref: Any, c_ref: Any, v_ref: Any, o_ref: Any,
               old_ref: Any) -> None:
        o_ref[...] = x_ref[...]
        old_ref[...] = pl.atomic_cas(o_ref.at[i_ref[...]], c_ref[...], v_ref[...])

    out_shape = (jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((8,), jnp.int32))
    got, olds = pl.pallas_call(kernel, out_shape=out_shape, backend="interpret")(x, idx, cmp,
                                                                                  val)
    want = x.copy()
    want_olds = np.zeros(8, np.int32)
    for lane in range(8):
        want_olds[lane] = want[idx[lane]]
        if want[idx[lane]] == cmp[lane]:
            want[idx[lane]] = val[lane]
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(olds), want_olds)
    assert list(want) == [10, 30, 40, 31]  # the model itself: first matching lane wins


@pytest.mark.parametrize("op", ["add", "max"])
def test_the_triton_emulator_agrees(op: str) -> None:
    """The same kernel lowered for Triton and run by its emulator gives the model's final
    contents (its lanes' order within one instruction is the hardware's, so the old values
    are not compared)."""
    pytest.importorskip("pallas_triton")
    atomic, combine = OPS[op]
    x, values = _inputs(op, seed=1, shape=(8,))
    idx = np.array([0, 1, 1, 3, 3, 3, 5, 7] * 2, np.int32)

    def kernel(x_ref: Any, i_ref: Any, v_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...]
        atomic(o_ref, (i_ref[...],), v_ref[...])

    fn = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,), x.dtype),
                        backend="triton")
    got = pl.emulate(fn, backend="triton")(x, idx, values)
    want, _ = _model(x, idx, values, np.ones(16, bool), combine)
    np.testing.assert_array_equal(np.asarray(got), want)
