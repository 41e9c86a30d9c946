"""``pallas_triton.GpuInfo``/``GpuVersion``/``get_gpu_info``/``get_gpu_info_from_version``/
``is_gpu_device``/``CUSTOM_CALL_TARGET_NAME`` (JAX 0.12's ``jax.experimental.pallas.triton``),
and ``get_gpu_info()`` inside a kernel traced for Triton answering for the target GPU where none
is attached (``pl.emulate``/``pl.stages``' ``target=``, else the default, sm_90)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import triton as jax_triton

import pallas_core as pl
from pallas_core.errors import PallasError

pallas_triton = pytest.importorskip("pallas_triton")
_JAX_HAS = hasattr(jax_triton, "GpuInfo")  # JAX 0.12 and newer
_needs_jax = pytest.mark.skipif(not _JAX_HAS, reason="this JAX has no triton.GpuInfo")

if pallas_triton.is_gpu_device():
    pytest.skip("a GPU is attached: it answers for itself", allow_module_level=True)


@_needs_jax
def test_data_classes_match_jaxs() -> None:
    assert [(v.name, v.value) for v in pallas_triton.GpuVersion] == [
        (v.name, v.value) for v in jax_triton.GpuVersion]
    ours = [(f.name, f.kw_only) for f in dataclasses.fields(pallas_triton.GpuInfo)]
    assert ours == [(f.name, f.kw_only) for f in dataclasses.fields(jax_triton.GpuInfo)]
    for v in jax_triton.GpuVersion:
        mine = pallas_triton.get_gpu_info_from_version(pallas_triton.GpuVersion[v.name])
        theirs = jax_triton.get_gpu_info_from_version(v)
        assert (mine.arch_name, mine.compute_capability) == (
            theirs.arch_name, theirs.compute_capability), v
        assert mine.gpu_version is pallas_triton.GpuVersion[v.name]
    assert pallas_triton.CUSTOM_CALL_TARGET_NAME == jax_triton.CUSTOM_CALL_TARGET_NAME


def test_known_models() -> None:
    info = pallas_triton.get_gpu_info_from_version(pallas_triton.GpuVersion.H100)
    assert (info.arch_name, info.compute_capability) == ("9.0", 90)
    assert str(pallas_triton.GpuVersion.A100) == "NVIDIA A100"
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.arch_name = "8.0"  # type: ignore[misc]
    with pytest.raises(PallasError, match="GpuVersion"):
        pallas_triton.get_gpu_info_from_version("H100")  # type: ignore[arg-type]


def test_custom_call_target_is_what_lowering_emits() -> None:
    x = jnp.ones((16,), jnp.float32)

    def copy(x_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = x_ref[...]

    text = jax.jit(lambda x: pl.pallas_call(copy, jax.ShapeDtypeStruct(x.shape, x.dtype),
                                            backend="triton")(x)).trace(x).lower(
        lowering_platforms=("cuda",)).as_text()
    assert re.search(r'custom_call @"?' + re.escape(pallas_triton.CUSTOM_CALL_TARGET_NAME), text)


def test_outside_a_kernel_without_a_gpu() -> None:
    assert pallas_triton.is_gpu_device() is False
    with pytest.raises(PallasError, match="not a GPU"):
        pallas_triton.get_gpu_info()
    if _JAX_HAS:
        assert jax_triton.is_gpu_device() is False
        with pytest.raises(ValueError):
            jax_triton.get_gpu_info()


def _scaled(x: jax.Array, **kw: object) -> jax.Array:
    """``x`` times the target's compute capability, plus 1000 on a GPU without one (AMD)."""
    def kernel(x_ref, o_ref):  # type: ignore[no-untyped-def]
        info = pallas_triton.get_gpu_info()
        extra = 1000.0 if info.arch_name.startswith("gfx") else 0.0
        o_ref[...] = x_ref[...] * float(info.compute_capability) + extra

    return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), **kw)(x)  # type: ignore[arg-type]


def _x() -> jax.Array:
    return jnp.asarray(np.random.default_rng(1).standard_normal((32,)), jnp.float32)


@pytest.mark.parametrize("target,cc,extra", [(None, 90, 0.0), ("sm_80", 80, 0.0),
                                             ("sm_100", 100, 0.0), ("gfx942", 0, 1000.0)])
def test_emulate_answers_for_its_target(target: str | None, cc: int, extra: float) -> None:
    x = _x()
    got = pl.emulate(lambda x: _scaled(x, backend="triton"), backend="triton", target=target)(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x) * cc + extra, rtol=1e-6)


def test_stages_answers_for_its_target() -> None:
    pytest.importorskip("triton")  # pl.stages compiles for the target through it
    x = _x()
    found = pl.stages(_scaled, x, backend="triton", target="sm_80")
    assert "80.0" in found[0]["jaxpr"]
    found = pl.stages(_scaled, x, backend="triton", target="sm_100")
    assert "100.0" in found[0]["jaxpr"]


def test_lowering_answers_for_the_default_target() -> None:
    x = _x()
    # Traced for Triton (its params) and lowered for cuda: the default target, sm_90.
    text = jax.jit(lambda x: _scaled(x, compiler_params=pallas_triton.CompilerParams())).trace(
        x).lower(lowering_platforms=("cuda",)).as_text()
    assert pallas_triton.CUSTOM_CALL_TARGET_NAME in text
    closed = jax.make_jaxpr(lambda x: _scaled(x, backend="triton"))(x)
    assert "90.0" in str(closed)


def test_the_report_chips_are_the_cores_gpu_datasheets() -> None:
    """Triton lists every GPU of ``pallas_core.backend.GPU_CHIPS`` (h100, its default, first),
    the very entries Mosaic GPU lists its Hopper and Blackwell chips from."""
    from pallas_core import backend as plb
    from pallas_core.plugins import manager

    chips = manager.get("triton").info.chips
    assert list(chips) == ["h100", "a100", "h200", "b200", "mi300x"] == list(plb.GPU_CHIPS)
    assert all(chips[name] is plb.GPU_CHIPS[name] for name in chips)
    assert pallas_triton.gpu_info.roofline_chips() == dict(plb.GPU_CHIPS)
    assert chips["h100"].hbm_bandwidth == 3.35e12
    assert chips["h100"].onchip_default_limit == 232448
