"""``pl.emulate``'s plumbing, independent of any backend's emulator.

A stand-in plugin emulates Triton's custom call by computing what the test kernel means (``x *
y + 1``) from the operands it is handed, so these tests check what ``pl.emulate`` does around
the emulator: which kernels it finds (ours and ``jax.experimental.pallas``'s, inside ``jit``,
``cond``, ``scan``, ``vmap``), what it hands the hook, and its errors. The emulators themselves
are tested in each hardware plugin's tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl
from pallas_core.emulation import EmulatedCall
from pallas_core.hookspecs import hookimpl
from pallas_core.plugins import manager

TRITON_CALL = "__gpu$xla.gpu.triton"


class _StandIn:
    """Emulates the Triton custom call of ``_mul_add`` from its operands, recording calls."""

    def __init__(self) -> None:
        self.calls: list[EmulatedCall] = []

    @hookimpl
    def pallas_emulate(self, call: EmulatedCall) -> list[np.ndarray] | None:
        if call.target != TRITON_CALL:
            return None
        self.calls.append(call)
        x, y = call.operands
        return [(x * y + 1).astype(call.results[0][1])]


@pytest.fixture
def stand_in() -> Iterator[_StandIn]:
    plugin = _StandIn()
    manager.ensure_loaded()
    manager._pm.register(plugin, name="emulate-stand-in")
    try:
        yield plugin
    finally:
        manager._pm.unregister(plugin)


def _kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
    o_ref[...] = x_ref[...] * y_ref[...] + 1.0


def _mul_add(mod: Any = pl, **kwargs: Any) -> Any:
    spec = mod.BlockSpec((8, 128), lambda i: (i, 0))
    return mod.pallas_call(_kernel, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
                           grid=(2,), in_specs=[spec, spec], out_specs=spec, **kwargs)


def _xy(seed: int = 0) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((16, 128)), jnp.float32),
            jnp.asarray(rng.standard_normal((16, 128)), jnp.float32))


def test_kernel_inside_jit_cond_and_scan(stand_in: _StandIn) -> None:
    """Kernels nested in ``jit``, ``cond`` and ``scan`` are all found and emulated."""
    mul_add = _mul_add(backend="interpret")  # emulate lowers it for Triton all the same

    @jax.jit
    def fn(x: jax.Array, y: jax.Array) -> jax.Array:
        z = lax.cond(x[0, 0] > 0, lambda: mul_add(x, y), lambda: -mul_add(y, x))

        def body(c: jax.Array, _: Any) -> tuple[jax.Array, None]:
            return mul_add(c, y) * 0.5, None
        return jnp.tanh(lax.scan(body, z, None, length=2)[0])

    x, y = _xy()
    got = pl.emulate(fn, backend="triton")(x, y)
    z = jnp.where(x[0, 0] > 0, x * y + 1, -(y * x + 1))
    for _ in range(2):
        z = (z * y + 1) * 0.5
    np.testing.assert_allclose(got, jnp.tanh(z), rtol=1e-6, atol=1e-6)
    assert stand_in.calls, "the stand-in emulator was never called"
    call = stand_in.calls[0]
    assert call.options.backend == "triton" and isinstance(call.attributes["ir"], bytes)
    assert call.attributes["grid_x"] * call.attributes["grid_y"] == 2


def test_jax_pallas_kernel_and_vmap(stand_in: _StandIn) -> None:
    """A kernel written against ``jax.experimental.pallas`` is emulated too, under ``vmap``."""
    from jax.experimental import pallas as jpl

    mul_add = _mul_add(jpl)
    x, y = _xy(1)
    got = jax.jit(pl.emulate(jax.vmap(mul_add), backend="triton"))(x[None], y[None])
    np.testing.assert_allclose(got[0], x * y + 1, rtol=1e-6)
    assert stand_in.calls


def test_result_of_the_wrong_count_is_an_error() -> None:
    class Broken:
        @hookimpl
        def pallas_emulate(self, call: EmulatedCall) -> list[np.ndarray] | None:
            return [] if call.target == TRITON_CALL else None

    broken = Broken()
    manager.ensure_loaded()
    manager._pm.register(broken, name="emulate-broken")
    try:
        with pytest.raises(pl.PallasError, match="returned 0 results"):
            pl.emulate(_mul_add(), backend="triton")(*_xy())
    finally:
        manager._pm.unregister(broken)


def test_interpreter_has_no_emulator() -> None:
    with pytest.raises(pl.UnsupportedError, match="runs on CPU already"):
        pl.emulate(_mul_add(), backend="interpret")


def test_unknown_backend() -> None:
    with pytest.raises(pl.BackendNotFoundError):
        pl.emulate(_mul_add(), backend="no_such_backend")


def test_backend_must_be_a_name() -> None:
    with pytest.raises(pl.ArgumentError, match="backend name"):
        pl.emulate(_mul_add(), backend=None)  # type: ignore[arg-type]
