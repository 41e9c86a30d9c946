"""The cost estimate a Mosaic TPU kernel's ``tpu_custom_call`` carries for XLA's scheduler.

Where the user gives none, the backend passes the one ``pl.report`` counts
(``plb.kernel_cost``), checked here against counts written out by hand; a user's estimate
wins, emitted as JAX emits it; where the count would be wrong (a dynamic grid, a kernel that
talks to other devices, a count that fails) there is none, as in JAX. Also the comparison helper
the agreement tests use, which sets our own estimate aside where JAX's config has none.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as jax_pl

import pallas_core as pl
from pallas_core import backend as plb
from pallas_core.stages import kernel_calls

pltpu = pytest.importorskip("pallas_mosaic_tpu")
import test_tpu_lowering as seeds  # noqa: E402
from pallas_mosaic_tpu import inspection  # noqa: E402

from tests.jax_library import porting  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32
M, N, K = 256, 512, 384
BM, BN, BK = 128, 128, 128


def _config(fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """The ``custom_call_config`` of the one ``tpu_custom_call`` that ``fn(*args)`` lowers to
    (body aside)."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    (config, _), = inspection.kernels(text)
    return config["custom_call_config"]  # type: ignore[no-any-return]


def _cost(fn: Callable[..., Any], *args: Any) -> pl.CostEstimate:
    """``plb.kernel_cost`` of the one kernel ``fn(*args)`` makes."""
    (call,) = kernel_calls(jax.make_jaxpr(fn)(*args).jaxpr)
    return plb.kernel_cost(call, backend="mosaic_tpu")


def _fields(cost: Any) -> dict[str, int]:
    return {"flops": cost.flops, "transcendentals": cost.transcendentals,
            "bytes_accessed": cost.bytes_accessed,
            "remote_bytes_transferred": cost.remote_bytes_transferred}


def matmul(m: Any, cost: Any = None) -> Callable[..., Any]:
    """bf16 (M, K) @ (K, N) into float32, (BM, BN) output blocks accumulated over K / BK."""
    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        @m.when(m.program_id(2) == 0)
        def _() -> None:
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=F32)

    def f(x: Any, y: Any) -> Any:
        return m.pallas_call(
            kernel, jax.ShapeDtypeStruct((M, N), F32), grid=(M // BM, N // BN, K // BK),
            in_specs=[m.BlockSpec((BM, BK), lambda i, j, k: (i, k)),
                      m.BlockSpec((BK, BN), lambda i, j, k: (k, j))],
            out_specs=m.BlockSpec((BM, BN), lambda i, j, k: (i, j)), cost_estimate=cost)(x, y)
    return f


def _matmul_operands() -> list[jax.Array]:
    return [jnp.ones((M, K), BF16), jnp.ones((K, N), BF16)]


def exp_times(x: Any, y: Any) -> Any:
    """``exp(x) * y`` by (128, 256) row blocks over 500 rows: the last block is clipped."""
    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jnp.exp(x_ref[...]) * y_ref[...]

    spec = pl.BlockSpec((128, 256), lambda i: (i, 0))
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, F32), grid=(4,),
                          in_specs=[spec, spec], out_specs=spec)(x, y)


def test_a_blocked_matmul_carries_the_counted_estimate() -> None:
    args = _matmul_operands()
    emitted = _config(matmul(pl), *args)["cost_estimate"]
    steps = (M // BM) * (N // BN) * (K // BK)
    # Two flops per multiply-add, and the accumulation: one add per output element per K step.
    flops = 2 * M * N * K + M * N * (K // BK)
    # The K index moves at every step, so both inputs' blocks are fetched at every step; an
    # output block is written back once, when (i, j) moves on.
    x_bytes = steps * BM * BK * 2
    y_bytes = steps * BK * BN * 2
    out_bytes = M * N * 4
    want = {"flops": flops, "transcendentals": 0,
            "bytes_accessed": x_bytes + y_bytes + out_bytes, "remote_bytes_transferred": 0}
    assert emitted == want
    assert emitted == _fields(_cost(matmul(pl), *args))


def test_an_elementwise_kernel_carries_the_counted_estimate() -> None:
    x = jnp.ones((500, 256), F32)
    emitted = _config(exp_times, x, x)["cost_estimate"]
    # The body works on whole blocks at each of the 4 steps; HBM traffic stops at row 500.
    blocks = 4 * 128 * 256
    want = {"flops": blocks, "transcendentals": blocks, "bytes_accessed": 3 * 500 * 256 * 4,
            "remote_bytes_transferred": 0}
    assert emitted == want
    assert emitted == _fields(_cost(exp_times, x, x))


def test_a_users_estimate_wins_and_is_emitted_as_jax_emits_it() -> None:
    args = _matmul_operands()
    given = {"flops": 7, "transcendentals": 3, "bytes_accessed": 11,
             "remote_bytes_transferred": 2}
    ours = _config(matmul(pl, pl.CostEstimate(**given)), *args)
    with plb.assume_device("TPU v5 lite", "tpu"):
        theirs = _config(matmul(jax_pl, jax_pl.CostEstimate(**given)), *args)
    assert ours["cost_estimate"] == given
    assert list(ours["cost_estimate"]) == list(theirs["cost_estimate"])  # JAX's key order
    assert ours == theirs
    inspection.assert_same_config({"custom_call_config": ours}, {"custom_call_config": theirs})


def test_a_library_kernel_without_an_estimate_now_carries_one() -> None:
    x, y = jnp.ones((256, 384), F32), jnp.ones((384, 256), F32)

    def run(lib: Any) -> Callable[..., Any]:
        return functools.partial(lib.matmul, block_shape=(128, 128), block_k=128)

    import jax.experimental.pallas.ops.tpu.matmul as jax_matmul

    with plb.assume_device("TPU v5 lite", "tpu"):
        assert "cost_estimate" not in _config(run(jax_matmul), x, y)  # JAX gives none
    ours = porting.ported("tpu.matmul")
    emitted = _config(run(ours), x, y)["cost_estimate"]
    assert emitted == _fields(_cost(run(ours), x, y))
    assert emitted["flops"] >= 2 * 256 * 256 * 384
    assert emitted["bytes_accessed"] >= 4 * (256 * 384 + 384 * 256 + 256 * 256)


def test_a_dynamic_grid_carries_none() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * 2.0

    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))

    def f(n: Any, x: Any) -> Any:
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(n,),
                              in_specs=[spec], out_specs=spec)(x)

    x = jnp.ones((32, 128), F32)
    assert "cost_estimate" not in _config(f, jnp.int32(3), x)
    # With the grid's size fixed the same kernel carries one: what is missing is the grid.
    assert "cost_estimate" in _config(functools.partial(f, 4), x)


def test_the_copies_a_kernel_makes_itself_are_counted() -> None:
    def kernel(x_hbm: Any, o_ref: Any) -> None:
        pltpu.sync_copy(x_hbm, o_ref)

    def f(x: Any) -> Any:
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                              in_specs=[pl.BlockSpec(memory_space=pl.ANY)])(x)

    x = jnp.ones((16, 128), F32)
    emitted = _config(f, x)["cost_estimate"]
    # x copied from HBM by the kernel, the output block written back by the pipeline.
    assert emitted["bytes_accessed"] == 2 * 16 * 128 * 4
    assert emitted == _fields(_cost(f, x))


def test_a_kernel_that_talks_to_other_devices_carries_none() -> None:
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    x = jnp.ones((64, 128), F32)
    config = _config(seeds.ring_permute(pl, ("x",), (8,)), x)
    assert config["has_communication"] is True
    assert "cost_estimate" not in config  # remote bytes are not counted


def test_a_count_that_fails_gives_none_and_the_kernel_still_lowers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def cannot_count(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("no count")

    monkeypatch.setattr(plb, "kernel_cost", cannot_count)
    x = jnp.ones((500, 256), F32)
    config = _config(lambda a, b: exp_times(a, b), x, x)
    assert "cost_estimate" not in config and config["needs_layout_passes"] is True


# --- the comparison with JAX's configuration ------------------------------------------------

_ESTIMATE = {"flops": 1, "transcendentals": 2, "bytes_accessed": 3,
             "remote_bytes_transferred": 0}


def _full(**fields: Any) -> dict[str, Any]:
    return {"custom_call_config": {"serialization_format": 1, **fields}}


def test_our_estimate_is_set_aside_only_where_jax_has_none() -> None:
    inspection.assert_same_config(_full(cost_estimate=_ESTIMATE), _full())
    inspection.assert_same_config(_full(cost_estimate=_ESTIMATE), _full(cost_estimate=_ESTIMATE))
    with pytest.raises(AssertionError, match="cost_estimate"):
        inspection.assert_same_config(_full(cost_estimate={**_ESTIMATE, "flops": 5}),
                                      _full(cost_estimate=_ESTIMATE))
    with pytest.raises(AssertionError, match="custom_call_config"):  # JAX's, missing in ours
        inspection.assert_same_config(_full(), _full(cost_estimate=_ESTIMATE))


def test_everything_else_is_still_compared() -> None:
    with pytest.raises(AssertionError, match="needs_layout_passes"):
        inspection.assert_same_config(_full(cost_estimate=_ESTIMATE, needs_layout_passes=True),
                                      _full())
    with pytest.raises(AssertionError, match="scoped_memory_configs"):
        inspection.assert_same_config(
            _full(), {**_full(), "scoped_memory_configs": [{"size": 1}]})
