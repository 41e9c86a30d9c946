"""The pure-Python and helper names of ``jax.experimental.pallas.tpu`` that ``pltpu`` provides:
chip facts (``TpuInfo``, ``ChipVersion``, ``get_tpu_info_for_chip``), ``einshape``, meshes
(``TensorCoreMesh``, ``CoreType``, ``Tiling``) and the core helpers ``run_on_first_core`` and
``core_barrier``, each checked against JAX's own (its TPU interpret mode for kernels)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as jax_pl
from jax.experimental.pallas import tpu as jax_pltpu

import pallas_core as pl
from pallas_core.errors import PallasError

pltpu = pytest.importorskip("pallas_mosaic_tpu")
from pallas_mosaic_tpu import inspection  # noqa: E402

F32 = jnp.float32


# --- chip facts ----------------------------------------------------------------------------


def _cores(chip: Any) -> list[int]:
    return [1, 2] if chip.supports_megacore else [1]


@pytest.mark.parametrize("chip", list(jax_pltpu.ChipVersion), ids=str)
def test_chip_facts_match_jax(chip: Any) -> None:
    ours = pltpu.ChipVersion(chip.value)
    assert str(ours) == str(chip)
    for prop in ("num_physical_tensor_cores_per_chip", "supports_megacore", "is_lite"):
        assert getattr(ours, prop) == getattr(chip, prop), prop
    for cores in _cores(chip):
        theirs = jax_pltpu.get_tpu_info_for_chip(chip, cores)
        mine = pltpu.get_tpu_info_for_chip(ours, cores)
        for field in dataclasses.fields(theirs):
            a, b = getattr(mine, field.name), getattr(theirs, field.name)
            if field.name == "chip_version":
                assert a.value == b.value
            elif field.name == "sparse_core":
                assert (a is None) == (b is None)
                if b is not None:
                    assert dataclasses.asdict(a) == dataclasses.asdict(b)
            else:
                assert a == b, (chip, cores, field.name, a, b)
        for prop in ("is_lite", "is_split_chip", "is_megacore"):
            assert getattr(mine, prop) == getattr(theirs, prop), prop
        if theirs.generation == 8 and not hasattr(jax_pltpu.ChipVersion, "TPU_8T"):
            continue  # JAX revised 8i's matmul types when it added 8t; older JAX lags
        dtypes = [jnp.float32, jnp.bfloat16, jnp.int8, jnp.uint8, jnp.int4, jnp.float8_e5m2,
                  jnp.float8_e4m3fn, jnp.float8_e4m3b11fnuz]
        for lhs in dtypes:
            for rhs in dtypes:
                assert mine.is_matmul_supported(lhs, rhs) == theirs.is_matmul_supported(
                    lhs, rhs), (lhs, rhs)
        if theirs.generation <= 7:
            for dt in (jnp.float32, jnp.bfloat16, jnp.int8, jnp.int4):
                assert mine.get_sublane_tiling(dt) == theirs.get_sublane_tiling(dt), dt


@pytest.mark.parametrize("chip", list(jax_pltpu.ChipVersion), ids=str)
def test_chip_core_counts_jax_refuses_are_refused(chip: Any) -> None:
    """JAX refuses 2 cores on chips that cannot join theirs; we also refuse 3 on v4/v5p."""
    bad = 1 + max(_cores(chip))
    if not chip.supports_megacore:
        with pytest.raises(ValueError):
            jax_pltpu.get_tpu_info_for_chip(chip, bad)
    with pytest.raises(PallasError, match="TensorCores"):
        pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(chip.value), bad)


def test_current_device_is_not_a_tpu_here() -> None:
    assert pltpu.is_tpu_device() == jax_pltpu.is_tpu_device()
    if not jax_pltpu.is_tpu_device():
        with pytest.raises(PallasError, match="not a TPU"):
            pltpu.get_tpu_info()


def test_enums_have_jax_members() -> None:
    for ours, theirs in ((pltpu.CoreType, jax_pltpu.CoreType),
                         (pltpu.ChipVersion, jax_pltpu.ChipVersion)):
        # In JAX's order; chips newer than the installed JAX may follow.
        mine = [(m.name, m.value) for m in ours]
        assert mine[:len(theirs)] == [(m.name, m.value) for m in theirs]
    assert [m.name for m in pltpu.Tiling] == [m.name for m in jax_pltpu.Tiling]
    assert [m.shape for m in pltpu.Tiling] == [m.shape for m in jax_pltpu.Tiling]
    assert str(pltpu.CoreType.TC) == str(jax_pltpu.CoreType.TC)


# --- einshape ------------------------------------------------------------------------------

EINSHAPES = [
    ("ab->ba", (8, 128), {}),
    ("nhwc->nchw", (2, 4, 8, 16), {}),
    ("(ab)c->abc", (12, 128), {"a": 3}),
    ("abc->(ab)c", (3, 4, 128), {}),
    ("a(bc)->(ba)c", (8, 256), {"b": 2}),
    ("a(bc)->bac", (8, 256), {"c": 128}),
    ("(ab)(cd)->(ca)(db)", (6, 20), {"a": 2, "c": 4}),
    ("abc->abc", (2, 3, 4), {}),
]


@pytest.mark.parametrize("equation,shape,sizes", EINSHAPES)
def test_einshape_matches_jax(equation: str, shape: tuple[int, ...], sizes: dict[str, int]
                              ) -> None:
    x = jax.random.normal(jax.random.key(len(equation)), shape, F32)
    np.testing.assert_array_equal(pltpu.einshape(equation, x, **sizes),
                                  jax_pltpu.einshape(equation, x, **sizes))


@pytest.mark.parametrize("equation,shape,sizes", [
    ("ab->b", (2, 3), {}), ("(ab)->ab", (6,), {}), ("a(bc->abc", (2, 6), {}),
    ("(ab)->ab", (7,), {"a": 2}), ("ab", (2, 3), {}), ("ab->ba", (2, 3, 4), {}),
])
def test_einshape_refuses_what_jax_refuses(equation: str, shape: tuple[int, ...],
                                           sizes: dict[str, int]) -> None:
    x = jnp.ones(shape, F32)
    with pytest.raises((ValueError, NotImplementedError)):
        jax_pltpu.einshape(equation, x, **sizes)
    with pytest.raises(PallasError, match="einshape"):
        pltpu.einshape(equation, x, **sizes)


def test_einshape_in_a_kernel_runs_and_lowers() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = pltpu.einshape("ab->ba", x_ref[...])

    x = jax.random.normal(jax.random.key(1), (128, 256), F32)
    out = jax.ShapeDtypeStruct((256, 128), F32)
    got = pl.pallas_call(kernel, out, backend="interpret")(x)
    np.testing.assert_array_equal(got, x.T)
    text = jax.jit(pl.pallas_call(kernel, out, backend="mosaic_tpu")).trace(x).lower(
        lowering_platforms=("tpu",)).as_text()
    (_, module), = inspection.kernels(text)
    assert "tpu.transpose" in str(module) or "vector.transpose" in str(module)


# --- meshes and core helpers ---------------------------------------------------------------


def test_tensorcore_mesh() -> None:
    mesh = pltpu.TensorCoreMesh(axis_name="x", num_cores=2)
    assert (mesh.axis_name, mesh.num_cores, dict(mesh.shape)) == ("x", 2, {"x": 2})
    assert mesh.core_type is pltpu.CoreType.TC
    assert mesh == pltpu.TensorCoreMesh(axis_name="x", num_cores=2)
    assert mesh.dimension_semantics == [pltpu.PARALLEL]
    assert pltpu.TensorCoreMesh(axis_name="x").num_cores == 1
    for bad in ({"axis_name": "x", "num_cores": 0}, {"axis_name": 1, "num_cores": 1}):
        with pytest.raises(PallasError, match="TensorCoreMesh"):
            pltpu.TensorCoreMesh(**bad)


def _two_core_exchange(m: Any, tpu: Any, *, barrier: bool, backend: str | None) -> Any:
    """Each core copies its row of ``x`` (doubled on core 0, by ``run_on_first_core``) to
    ``o``, passes ``core_barrier``, then copies the other core's row of ``o`` to ``p``."""
    def body(x_hbm: Any, o_hbm: Any, p_hbm: Any) -> None:
        c = lax.axis_index("core")

        def scoped(buf: Any, sem: Any) -> None:
            tpu.sync_copy(x_hbm.at[c], buf)

            @tpu.run_on_first_core("core")
            def _() -> None:
                buf[...] = buf[...] * 2.0

            tpu.sync_copy(buf, o_hbm.at[c])
            if barrier:
                tpu.core_barrier(sem, core_axis_name="core")
            tpu.sync_copy(o_hbm.at[1 - c], buf)
            tpu.sync_copy(buf, p_hbm.at[c])

        m.run_scoped(scoped, tpu.VMEM((8, 128), F32), tpu.SemaphoreType.REGULAR)

    out = (jax.ShapeDtypeStruct((2, 8, 128), F32),) * 2
    if m is pl:
        kw = {"backend": backend} if backend else {}
        return pl.kernel(body, out_type=out, mesh=pltpu.TensorCoreMesh(axis_name="core",
                                                                      num_cores=2), **kw)
    return jax_pl.kernel(body, out_type=out, interpret=jax_pltpu.InterpretParams(),
                         mesh=jax_pltpu.create_tensorcore_mesh("core", num_cores=2))


def test_run_on_first_core_and_core_barrier_match_jax() -> None:
    x = jax.random.normal(jax.random.key(2), (2, 8, 128), F32)
    o, p = _two_core_exchange(pl, pltpu, barrier=True, backend="interpret")(x)
    jo, jp = _two_core_exchange(jax_pl, jax_pltpu, barrier=True, backend=None)(x)
    want = jnp.stack([2 * x[0], x[1]])
    np.testing.assert_array_equal(o, want)
    np.testing.assert_array_equal(p, want[::-1])
    np.testing.assert_array_equal(o, jo)
    np.testing.assert_array_equal(p, jp)
    # Without the barrier core 0 reads core 1's row before core 1 has written it.
    _, p = _two_core_exchange(pl, pltpu, barrier=False, backend="interpret")(x)
    assert not np.array_equal(p, want[::-1])


def test_core_helpers_lower() -> None:
    x = jnp.ones((2, 8, 128), F32)
    f = _two_core_exchange(pl, pltpu, barrier=True, backend="mosaic_tpu")
    text = jax.jit(f).trace(x).lower(lowering_platforms=("tpu",)).as_text()
    (_, module), = inspection.kernels(text)
    assert "tpu.sem_signal" in str(module) and "tpu.sem_wait" in str(module)


def test_run_on_first_core_with_one_core_returns_the_result() -> None:
    seen = []

    def body(o_hbm: Any) -> None:
        seen.append(pltpu.run_on_first_core("core")(lambda: 7))

    pl.kernel(body, out_type=jax.ShapeDtypeStruct((8, 128), F32),
              mesh=pltpu.TensorCoreMesh(axis_name="core", num_cores=1),
              backend="interpret")()
    assert seen == [7]
