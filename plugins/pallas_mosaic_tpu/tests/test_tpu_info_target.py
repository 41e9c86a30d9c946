"""``pltpu.get_tpu_info()`` inside a kernel (body or index map) traced for a TPU answers for the
chip being targeted where no TPU is attached: ``pl.emulate``'s and ``pl.stages``' ``target=``,
else Mosaic TPU's default chip (v5e) when the kernel is traced for Mosaic TPU. Outside any
kernel, on a machine without a TPU, it raises as before (JAX raises too)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl
from pallas_core.errors import PallasError

pltpu = pytest.importorskip("pallas_mosaic_tpu")
from jax.experimental.pallas import tpu as jax_pltpu  # noqa: E402

if pltpu.is_tpu_device():
    pytest.skip("a TPU is attached: it answers for itself", allow_module_level=True)

_MiB = 1 << 20
CHIPS = {"v5e": "TPU_V5E", "v6e": "TPU_V6E", "v7x": "TPU_7X", "v4": "TPU_V4"}


def _facts(chip: str) -> tuple[float, int]:
    """VMEM MiB and MXU column size of ``chip``, from JAX's own table."""
    info = jax_pltpu.get_tpu_info_for_chip(getattr(jax_pltpu.ChipVersion, CHIPS[chip]), 1)
    return info.vmem_capacity_bytes / _MiB, info.mxu_column_size


def _scaled(x: jax.Array, **kw: object) -> jax.Array:
    """``x`` times the chip's VMEM capacity in MiB, plus its MXU column size; the index map
    asks the chip too (its block index is 0 on every chip)."""
    def index_map(i):  # type: ignore[no-untyped-def]
        return (i * 0 + (pltpu.get_tpu_info().num_lanes - 128), 0)

    def kernel(x_ref, o_ref):  # type: ignore[no-untyped-def]
        info = pltpu.get_tpu_info()
        o_ref[...] = (x_ref[...] * (info.vmem_capacity_bytes / _MiB)
                      + float(info.mxu_column_size))

    spec = pl.BlockSpec((8, 128), index_map)
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(1,),
                          in_specs=[spec], out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
                          **kw)(x)  # type: ignore[arg-type]


def _x() -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).standard_normal((8, 128)), jnp.float32)


def _want(x: jax.Array, chip: str) -> np.ndarray:
    vmem, cols = _facts(chip)
    return np.asarray(x) * vmem + cols


def test_outside_a_kernel_without_a_tpu_it_raises() -> None:
    with pytest.raises(PallasError, match="not a TPU"):
        pltpu.get_tpu_info()
    with pytest.raises(ValueError):
        jax_pltpu.get_tpu_info()


@pytest.mark.parametrize("chip", ["v5e", "v6e", "v7x"])
def test_emulate_answers_for_its_target(chip: str) -> None:
    x = _x()
    got = pl.emulate(lambda x: _scaled(x, backend="mosaic_tpu"), backend="mosaic_tpu",
                     target=chip)(x)
    np.testing.assert_allclose(np.asarray(got), _want(x, chip), rtol=1e-6)


def test_stages_answers_for_its_target() -> None:
    x = _x()
    for chip in ("v5e", "v7x"):
        vmem, cols = _facts(chip)
        found = pl.stages(lambda x: _scaled(x), x, backend="mosaic_tpu", target=chip)
        assert f"{vmem:.1f}" in found[0]["jaxpr"] and f"{float(cols):.1f}" in found[0]["jaxpr"]
        assert "tpu_custom_call" in found[0]["stablehlo"]
    # The same function staged for two chips was traced for each (the chip is in jit's key).
    v5e = pl.stages(jax.jit(_scaled), x, backend="mosaic_tpu", target="v5e")[0]["jaxpr"]
    v7x = pl.stages(jax.jit(_scaled), x, backend="mosaic_tpu", target="v7x")[0]["jaxpr"]
    assert v5e != v7x


@pytest.mark.parametrize("kw", [{"backend": "mosaic_tpu"},
                                {"compiler_params": "tpu"}], ids=["backend", "params"])
def test_lowering_for_mosaic_tpu_answers_for_its_default_chip(kw: dict[str, object]) -> None:
    if kw.get("compiler_params") == "tpu":
        kw = {"compiler_params": pltpu.CompilerParams()}
    x = _x()
    text = jax.jit(lambda x: _scaled(x, **kw)).trace(x).lower(
        lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
    # The default chip, v5e, is what the emulator runs the kernel as, too.
    got = pl.emulate(lambda x: _scaled(x, **kw), backend="mosaic_tpu")(x)
    np.testing.assert_allclose(np.asarray(got), _want(x, "v5e"), rtol=1e-6)


def test_a_kernel_the_interpreter_runs_still_has_no_tpu() -> None:
    with pytest.raises(PallasError, match="not a TPU"):
        _scaled(_x(), interpret=True)
