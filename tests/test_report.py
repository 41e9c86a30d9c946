"""``pl.report``'s counting, backend-neutral: bytes the pipeline moves (re-fetches skipped),
the work of the body times the grid (loops multiplied, the costlier branch of a ``pl.when``,
said in the notes), against closed forms; and ``plb.kernel_cost`` agreeing with it."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import pallas_core as pl
from pallas_core import backend as plb
from pallas_core.stages import kernel_calls

X = jax.ShapeDtypeStruct((64, 256), jnp.float32)


def _rows(kernel: Any, *, grid: int = 8) -> Any:
    spec = pl.BlockSpec((64 // grid, 256), lambda i: (i, 0))
    return lambda x: pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    grid=(grid,), in_specs=[spec], out_specs=spec,
                                    backend="interpret")(x)


def test_elementwise_work_and_traffic_on_the_interpreter() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        x = x_ref[...]
        o_ref[...] = jnp.exp(x) * 2.0 + x

    (k,) = pl.report(_rows(kernel), X).kernels
    assert k.backend == "interpret" and k.grid == (8,)
    assert k.transcendentals == 64 * 256
    assert k.vector_flops == 2 * 64 * 256 and k.matmul_flops == 0
    assert k.hbm_bytes == 2 * 64 * 256 * 4
    assert k.onchip_bytes is None and k.fits is None  # the interpreter keeps no account
    assert not k.roofline  # it lists no chips


def test_static_loops_are_multiplied_and_when_is_decided_per_step() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        def body(_: Any, acc: Any) -> Any:
            return acc * 1.5

        y = lax.fori_loop(0, 5, body, x_ref[...])
        o_ref[...] = y

        @pl.when(pl.program_id(0) == 0)
        def _() -> None:
            o_ref[...] = y + jnp.tanh(y)

    (k,) = pl.report(_rows(kernel), X).kernels
    per_block = 8 * 256
    # Five multiplies of the block per step; the branch (an add and a tanh) runs at step 0
    # only. The loop counter's increments are integer operations, not flops.
    assert k.vector_flops == 8 * 5 * per_block + per_block
    assert k.integer_ops >= 8 * 5
    assert k.transcendentals == per_block
    assert k.skipped_flops == 7 * per_block
    assert k.skipped_fraction == pytest.approx(7 * per_block / (k.flops + 7 * per_block))
    assert any("decided per grid step" in n for n in k.notes)


def test_a_branch_on_data_counts_the_costlier_branch_at_every_step() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        y = x_ref[...]
        o_ref[...] = y

        @pl.when(y[0, 0] > 0)
        def _() -> None:
            o_ref[...] = jnp.tanh(y)

    (k,) = pl.report(_rows(kernel), X).kernels
    assert k.transcendentals == 64 * 256 and k.skipped_flops == 0
    assert any("costlier branch" in n for n in k.notes)


def test_a_fori_loop_bounded_by_the_grid_index_counts_each_steps_trips() -> None:
    """A causal loop: step i runs i + 1 trips (2 multiplies of the block each)."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        i = pl.program_id(0)
        o_ref[...] = lax.fori_loop(0, i + 1, lambda _, acc: acc * acc * 0.5, x_ref[...])

    (k,) = pl.report(_rows(kernel), X).kernels
    per_block = 8 * 256
    trips = sum(i + 1 for i in range(8))
    # Per trip two multiplies of the block (the counter's increment and the bound's add are
    # integer operations).
    assert k.vector_flops == trips * 2 * per_block
    assert k.integer_ops == trips + 8
    # Against every step running the most trips (8).
    assert k.skipped_flops == (8 * 8 - trips) * 2 * per_block


def test_kernel_cost_is_the_reports_count() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jnp.sin(x_ref[...]) + 1.0

    (call,) = kernel_calls(jax.make_jaxpr(_rows(kernel))(X).jaxpr)
    cost = plb.kernel_cost(call)
    (k,) = pl.report(_rows(kernel), X).kernels
    assert (cost.flops, cost.transcendentals, cost.bytes_accessed) == (
        k.flops, k.transcendentals, k.hbm_bytes)


def test_an_unknown_chip_is_refused() -> None:
    with pytest.raises(pl.ArgumentError, match="not a chip"):
        pl.report(_rows(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...])), X,
                  target="no-such-chip")


def test_one_kernel_compared_on_a_tpu_and_a_gpu() -> None:
    """The seed's matmul (512 blocks) on v5e and H100: the same intensity (the kernel's own
    bytes and flops), each chip's ridge from its sheet; compute-bound on v5e, memory-bound on
    the H100, whose ridge is higher."""
    pytest.importorskip("pallas_mosaic_tpu")
    pytest.importorskip("pallas_triton")
    n, b = 4096, 512

    def matmul(x: Any, y: Any) -> Any:
        def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
            o_ref[...] += jnp.dot(x_ref[...], y_ref[...],
                                  preferred_element_type=jnp.float32).astype(o_ref.dtype)

        return pl.pallas_call(
            kernel, jax.ShapeDtypeStruct((n, n), jnp.bfloat16), grid=(n // b, n // b, n // b),
            in_specs=[pl.BlockSpec((b, b), lambda i, j, k: (i, k)),
                      pl.BlockSpec((b, b), lambda i, j, k: (k, j))],
            out_specs=pl.BlockSpec((b, b), lambda i, j, k: (i, j)), backend="interpret")(x, y)

    a = jax.ShapeDtypeStruct((n, n), jnp.bfloat16)
    (k,) = pl.report(matmul, a, a, target=["v5e", "h100"]).kernels
    v5e, h100 = k.roofline["v5e"], k.roofline["h100"]
    assert v5e.intensity == h100.intensity
    assert round(v5e.ridge) == 240 and round(h100.ridge) == round(989.4e12 / 3.35e12)
    assert (v5e.bound, h100.bound) == ("compute", "memory")
    assert h100.seconds == pytest.approx(k.hbm_bytes / 3.35e12)
