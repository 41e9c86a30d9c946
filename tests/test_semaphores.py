"""Semaphores (``pl.semaphore_signal/wait/read``) under the interpreter's reference semantics."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_interpret import InterpretParams

import pallas_core as pl

SEMS = jax.ShapeDtypeStruct((2,), jnp.int32)


def _counts(kernel: Any, grid: tuple[int, ...] = (3,), **params: Any) -> np.ndarray:
    """Runs ``kernel(x_ref, o_ref, sems)``; ``o_ref`` records semaphore values per step."""
    x = jnp.arange(3 * 4, dtype=jnp.float32).reshape(3, 4)
    kw = {"compiler_params": InterpretParams(**params)} if params else {}
    out = pl.pallas_call(
        kernel, jax.ShapeDtypeStruct((3, 2), jnp.int32), grid=grid,
        in_specs=[pl.BlockSpec((None, 4), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((None, 2), lambda i: (i, 0)), scratch_shapes=[SEMS], **kw)(x)
    jax.effects_barrier()
    return np.asarray(out)


def test_signal_wait_read_count_like_a_semaphore() -> None:
    def kernel(x_ref: Any, o_ref: Any, sems: Any) -> None:
        i = pl.program_id(0)

        @pl.when(i == 0)
        def _() -> None:
            sems[...] = jnp.zeros(2, jnp.int32)

        pl.semaphore_signal(sems.at[0], 3)
        pl.semaphore_signal(sems.at[1], i + 1)
        pl.semaphore_wait(sems.at[0], 2)
        o_ref[0] = pl.semaphore_read(sems.at[0])
        o_ref[1] = pl.semaphore_read(sems.at[1])

    # Persisting scratch: sem 0 gains 3 - 2 = 1 per step, sem 1 gains i + 1.
    np.testing.assert_array_equal(_counts(kernel), [[1, 1], [2, 3], [3, 6]])


def test_wait_without_decrement_leaves_the_count() -> None:
    def kernel(x_ref: Any, o_ref: Any, sems: Any) -> None:
        sems[...] = jnp.where(jnp.arange(2) == 0, 5, 0).astype(jnp.int32)
        pl.semaphore_wait(sems.at[0], 4, decrement=False)
        o_ref[...] = sems[...]

    np.testing.assert_array_equal(_counts(kernel), [[5, 0]] * 3)


def test_checked_mode_reports_a_wait_that_can_never_finish() -> None:
    def kernel(x_ref: Any, o_ref: Any, sems: Any) -> None:
        sems[...] = jnp.zeros(2, jnp.int32)
        pl.semaphore_signal(sems.at[1])
        pl.semaphore_wait(sems.at[0])  # nobody signals semaphore 0
        o_ref[...] = sems[...]

    with pytest.raises(Exception, match=r"deadlock: pl.semaphore_wait waits for 1 on a semaphore "
                                        r"at 0.*Fix"):
        _counts(kernel, checked=True)


def test_remote_signal_is_refused_by_the_reference_semantics() -> None:
    def kernel(x_ref: Any, o_ref: Any, sems: Any) -> None:
        pl.semaphore_signal(sems.at[0], 1, device_id=1)
        o_ref[...] = sems[...]

    with pytest.raises(pl.UnsupportedError, match=r"device_id.*Fix"):
        _counts(kernel)


def test_a_semaphore_must_be_one_int32() -> None:
    def kernel(x_ref: Any, o_ref: Any, sems: Any) -> None:
        pl.semaphore_signal(sems)  # the whole array, not one semaphore
        o_ref[...] = sems[...]

    with pytest.raises(pl.PallasError, match=r"one semaphore.*int32\[2\]"):
        _counts(kernel)
