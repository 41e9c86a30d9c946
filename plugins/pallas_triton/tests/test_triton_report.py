"""``pl.report``'s on-chip footprint for the Triton backend: the shared memory Triton allocates.

The footprint is compared with what Triton's own driver of its pipeline (``triton.compile``,
what its launcher checks against the GPU's limit) reports for the IR that XLA's Triton call
carries, read back from the lowered program: a path that shares nothing with the plugin's
stages but the lowering. A kernel the report says does not fit is refused by ``pl.stages``
with the same numbers; one that fits compiles. No GPU is needed.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jaxlib.mlir import ir
from jaxlib.triton import dialect as tt

import pallas_core as pl

triton = pytest.importorskip("triton", reason="Triton's shared memory needs its compiler")
pallas_triton = pytest.importorskip("pallas_triton")
from pallas_triton import compile as triton_compile  # noqa: E402
from pallas_triton.plugin import pallas_describe  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

F16, F32 = jnp.float16, jnp.float32

DRIVER_LIMIT = {"h100": 232448, "h200": 232448, "a100": 166912, "b200": 232448,
                "mi300x": 65536}
"""Each chip's shared memory per thread block as its driver reports it (CUDA's opt-in
maximum, ``CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN``; HIP's LDS per workgroup):
what Triton's launcher refuses beyond."""

GPU = {"h100": (GPUTarget("cuda", 90, 32), "cuda"), "a100": (GPUTarget("cuda", 80, 32), "cuda"),
       "mi300x": (GPUTarget("hip", "gfx942", 64), "rocm")}


def _matmul(x: Any, y: Any, bm: int = 64, bn: int = 64, bk: int = 32,
            num_stages: int | None = None, num_warps: int = 4) -> Any:
    """A blocked matmul whose K loop loads (bm, bk) and (bk, bn) tiles for a dot: Triton
    pipelines those loads through shared memory, one buffer per stage."""
    m, k = x.shape
    n = y.shape[1]

    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        def step(i: Any, acc: Any) -> Any:
            a = x_ref[:, pl.ds(i * bk, bk)]
            b = y_ref[pl.ds(i * bk, bk), :]
            return acc + jnp.dot(a, b, preferred_element_type=F32)

        acc = jax.lax.fori_loop(0, k // bk, step, jnp.zeros((bm, bn), F32))
        o_ref[...] = acc.astype(o_ref.dtype)

    return pl.pallas_call(
        kernel, jax.ShapeDtypeStruct((m, n), x.dtype), grid=(m // bm, n // bn),
        in_specs=[pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((k, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)), backend="triton",
        compiler_params=pallas_triton.TritonParams(num_warps=num_warps,
                                                                num_stages=num_stages))(x, y)


def _add_transposed(x: Any, y: Any) -> Any:
    """An elementwise kernel reading one operand transposed: the change of layout goes
    through shared memory."""
    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] + y_ref[...].T

    return pl.pallas_call(
        kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // 64, x.shape[1] // 64),
        in_specs=[pl.BlockSpec((64, 64), lambda i, j: (i, j)),
                  pl.BlockSpec((64, 64), lambda i, j: (j, i))],
        out_specs=pl.BlockSpec((64, 64), lambda i, j: (i, j)), backend="triton")(x, y)


def _add(x: Any, y: Any) -> Any:
    spec = pl.BlockSpec((64, 128), lambda i, j: (i, j))
    return pl.pallas_call(
        lambda x_ref, y_ref, o_ref: o_ref.__setitem__(..., x_ref[...] + y_ref[...]),
        jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // 64, x.shape[1] // 128),
        in_specs=[spec, spec], out_specs=spec, backend="triton")(x, y)


def _xla_triton_call(fn: Any, args: tuple[Any, ...], platform: str) -> tuple[str, int, int]:
    """The Triton IR of ``fn``'s one kernel as XLA's Triton call carries it when lowered for
    ``platform`` (printed as text), with the call's ``num_warps`` and ``num_stages``."""
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))
    calls: list[Any] = []

    def visit(op: Any) -> Any:
        if op.name == "stablehlo.custom_call" and \
                ir.StringAttr(op.attributes["call_target_name"]).value == "__gpu$xla.gpu.triton":
            calls.append(ir.DictAttr(op.attributes["mhlo.backend_config"]))
        return ir.WalkResult.ADVANCE

    module = lowered.compiler_ir("stablehlo")
    with module.context:
        module.operation.walk(visit)
    (config,) = calls
    code = ir.StringAttr(config["ir"]).value_bytes
    num_warps = ir.IntegerAttr(config["num_warps"]).value
    num_stages = ir.IntegerAttr(config["num_stages"]).value
    ctx = ir.Context()
    tt.register_dialect(ctx)
    ctx.load_all_available_dialects()
    with ctx:
        text = ir.Module.parse(code).operation.get_asm(enable_debug_info=False)
    return text, num_warps, num_stages


def _tritons_shared(fn: Any, args: tuple[Any, ...], chip: str, tmp: Any) -> int:
    """The ``shared`` metadata of ``triton.compile`` for ``fn``'s kernel on ``chip``."""
    target, platform = GPU[chip]
    text, num_warps, num_stages = _xla_triton_call(fn, args, platform)
    path = os.path.join(tmp, f"{chip}.ttir")
    with open(path, "w") as f:
        f.write(text)
    compiled = triton.compile(path, target=target,
                              options={"num_warps": num_warps, "num_stages": num_stages,
                                       "enable_fp_fusion": True})
    return int(compiled.metadata.shared)


def _x(dtype: Any = F16) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((512, 512), dtype)


_DOT32 = functools.partial(_matmul, bm=32, bn=32, bk=32)


@pytest.mark.parametrize("fn,dtype,chip", [
    (_DOT32, F16, "h100"),
    (functools.partial(_matmul, bk=64, num_stages=4), F16, "a100"),
    (functools.partial(_DOT32, num_stages=2), F16, "mi300x"),
    (_add_transposed, F32, "h100"),
    (_add, F32, "h100"),
], ids=["dot-h100", "dot-4-stages-a100", "dot-mi300x", "transposed-add-h100", "add-h100"])
def test_the_footprint_is_the_shared_memory_triton_allocates(
        fn: Any, dtype: Any, chip: str, tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    args = (_x(dtype), _x(dtype))
    (k,) = pl.report(fn, *args, backend="triton", target=chip).kernels
    assert [name for name, _ in k.onchip_parts] == ["shared memory (Triton's allocation)"]
    assert k.onchip_bytes == _tritons_shared(fn, args, chip, tmp_path)
    assert k.onchip_limit == DRIVER_LIMIT[chip] and k.fits is True
    if fn is not _add:  # a plain elementwise kernel needs no shared memory at all
        assert k.onchip_bytes > 0


def test_each_pipeline_stage_buffers_the_dots_tiles_once_more() -> None:
    def shared(stages: int) -> int:
        f = functools.partial(_DOT32, num_stages=stages)
        (k,) = pl.report(f, _x(), _x(), backend="triton").kernels
        return k.onchip_bytes or 0

    assert shared(3) - shared(2) == (32 * 32 + 32 * 32) * 2  # an (a, b) pair of f16 tiles


def test_a_kernel_that_does_not_fit_is_refused_with_the_same_numbers() -> None:
    """16 stages of (64, 64) float16 tiles need 256 KiB on an H100, which has 227; 12 fit."""
    x = jax.ShapeDtypeStruct((2048, 2048), F16)
    big = functools.partial(_matmul, bk=64, num_stages=16, num_warps=8)
    (k,) = pl.report(big, x, x, backend="triton", target="h100").kernels
    assert k.fits is False and k.onchip_bytes == 16 * (2 * 64 * 64 * 2)
    assert any(f"needs {k.onchip_bytes} bytes on chip, more than the {k.onchip_limit}" in n
               for n in k.notes)
    with pytest.raises(pl.PallasError) as refused:
        pl.stages(big, x, x, backend="triton", target="sm_90")
    message = str(refused.value)
    assert f"kernel {k.name!r} needs {k.onchip_bytes} bytes" in message
    assert f"the {k.onchip_limit} bytes" in message and "num_stages=16" in message
    assert "Fix: use smaller blocks" in message and "fewer pipeline stages" in message

    fits = functools.partial(_matmul, bk=64, num_stages=12, num_warps=8)
    (k,) = pl.report(fits, x, x, backend="triton", target="h100").kernels
    assert k.fits is True and k.onchip_bytes == 12 * (2 * 64 * 64 * 2)
    (stages,) = pl.stages(fits, x, x, backend="triton", target="sm_90")
    assert stages["cubin"]


def test_each_chips_limit_is_its_drivers_and_its_targets() -> None:
    """The chip table's shared memory, the limit ``pl.stages`` refuses beyond for the chip's
    target, and the driver's figure are one number."""
    chips = pallas_describe().chips
    assert set(chips) == set(triton_compile.CHIP_TARGETS) == set(DRIVER_LIMIT)
    for name, chip in chips.items():
        target = triton_compile.parse_target(triton_compile.target_of_chip(name))
        assert chip.onchip_bytes == target.shared_memory == DRIVER_LIMIT[name], name
    with pytest.raises(pl.PallasError, match=r"'v5e'.*h100, h200, a100, b200, mi300x.*Fix"):
        triton_compile.target_of_chip("v5e")
