"""The seed kernels for AMD GPUs, on a machine without one.

Every kernel lowers for ``rocm`` into XLA's Triton custom call (the one it runs through on
CUDA, with JAX's ROCm default of one pipeline stage), and ``pl.stages`` compiles it through the
``triton`` package to ``ttir``, ``ttgir``, ``llir``, ``amdgcn`` and ``hsaco`` for the CDNA GPUs
(``gfx942``: MI300, ``gfx90a``: MI200; 64-lane wavefronts). The emulator runs the
``rocm``-lowered modules (``pl.emulate(..., target="gfx942")``), compared with ``jax.numpy``.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl
from examples import vector_add

pytest.importorskip("triton", reason="compiling to AMDGCN and hsaco needs the triton package")
pallas_triton = pytest.importorskip("pallas_triton")
from pallas_triton import compile as triton_compile  # noqa: E402
from test_compile import CASES, _rand  # noqa: E402

F32 = jnp.float32
ELF_MAGIC = b"\x7fELF"
EM_CUDA, EM_AMDGPU = 190, 224
"""ELF ``e_machine`` values of NVIDIA cubins and AMD code objects."""

PTX_ONLY = {"triton_only_primitives"}
"""Seed kernels with inline PTX (``add.f32``), which an AMD GPU cannot assemble."""


def _machine(elf: bytes) -> int:
    assert elf[:4] == ELF_MAGIC
    return int.from_bytes(elf[18:20], "little")


def _custom_call_config(text: str) -> str:
    (line,) = [ln for ln in text.splitlines() if "__gpu$xla.gpu.triton" in ln]
    return line


@pytest.mark.parametrize("name", sorted(CASES))
def test_lowers_for_rocm_into_xla_triton_call(name: str) -> None:
    fn, make_args = CASES[name]
    traced = jax.jit(fn).trace(*make_args())
    rocm = _custom_call_config(traced.lower(lowering_platforms=("rocm",)).as_text())
    cuda = _custom_call_config(traced.lower(lowering_platforms=("cuda",)).as_text())
    # The kernels here leave num_stages to the platform: JAX's defaults, 1 on ROCm, 3 on CUDA.
    assert "num_stages = 1 : i32" in rocm and "num_stages = 3 : i32" in cuda
    strip = re.compile(r"num_stages = \d+ : i32")
    if name not in ("triton_only_primitives",):  # approx_tanh differs (no PTX on AMD)
        assert strip.sub("", rocm) == strip.sub("", cuda)


def test_explicit_num_stages_is_kept_on_rocm() -> None:
    x = _rand((1024,))
    fn = pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] + 1.0),
                        jax.ShapeDtypeStruct(x.shape, x.dtype),
                        compiler_params=pallas_triton.CompilerParams(num_stages=2, num_warps=8))
    text = jax.jit(fn).trace(x).lower(lowering_platforms=("rocm",)).as_text()
    config = _custom_call_config(text)
    assert "num_stages = 2 : i32" in config and "num_warps = 8 : i32" in config


@pytest.mark.parametrize("target", ["gfx942", "gfx90a"])
@pytest.mark.parametrize("name", sorted(set(CASES) - PTX_ONLY))
def test_compiles_to_hsaco(name: str, target: str) -> None:
    fn, make_args = CASES[name]
    for stages in pl.stages(fn, *make_args(), backend="triton", target=target):
        assert list(stages.stages) == ["jaxpr", "stablehlo", "ttir", "ttgir", "llir", "amdgcn",
                                       "hsaco"]
        assert "tt.func" in stages["ttir"]
        assert "__gpu$xla.gpu.triton" in stages["stablehlo"]
        assert f'ttg.target = "hip:{target}"' in stages["ttgir"]
        assert '"ttg.threads-per-warp" = 64' in stages["ttgir"]  # CDNA's 64-lane wavefronts
        assert f"-{target}" in stages["amdgcn"] and ".wavefront_size: 64" in stages["amdgcn"]
        assert _machine(stages["hsaco"]) == EM_AMDGPU


def test_vector_add_for_gfx942_end_to_end() -> None:
    """The stablehlo is lowered for rocm; the AMDGCN defines the kernel by its name; the hsaco
    is an AMD GPU code object; and the emulator runs the rocm module to jnp's values."""
    x, y = _rand((1024,)), _rand((1024,), seed=1)

    def add(a: jax.Array, b: jax.Array) -> jax.Array:
        return vector_add.vector_add(a, b, block_size=256)

    (stages,) = pl.stages(add, x, y, backend="triton", target="gfx942")
    name = stages.name
    assert name == "add_kernel"
    assert "num_stages = 1 : i32" in _custom_call_config(stages["stablehlo"])
    assert re.search(rf"^{name}:", stages["amdgcn"], re.M)
    assert f".amdhsa_kernel {name}" in stages["amdgcn"]
    assert re.search(r"\bv_add_f32", stages["amdgcn"])
    hsaco = stages["hsaco"]
    assert hsaco[:4] == ELF_MAGIC and _machine(hsaco) == EM_AMDGPU and name.encode() in hsaco
    got = pl.emulate(add, backend="triton", target="gfx942", checked=True)(x, y)
    np.testing.assert_allclose(got, x + y, rtol=1e-6)


@pytest.mark.parametrize("target", sorted(triton_compile.TARGETS))
def test_every_known_target_compiles(target: str) -> None:
    fn, make_args = CASES["matmul_3d_bf16"]
    (stages,) = pl.stages(fn, *make_args(), backend="triton", target=target)
    amd = triton_compile.TARGETS[target].platform == "rocm"
    binary = stages["hsaco" if amd else "cubin"]
    assert _machine(binary) == (EM_AMDGPU if amd else EM_CUDA)
    assert list(stages.stages)[-2:] == (["amdgcn", "hsaco"] if amd else ["ptx", "cubin"])


@pytest.mark.parametrize("target", ["sm_75", "gfx1234", "mi300"])
def test_unknown_target_lists_the_known_ones(target: str) -> None:
    fn, make_args = CASES["vector_add"]
    with pytest.raises(pl.PallasError, match=rf"{target}.*known targets: sm_80, sm_90, sm_100, "
                                             r"sm_120, gfx90a, gfx942, gfx950.*Fix"):
        pl.stages(fn, *make_args(), backend="triton", target=target)


def test_inline_ptx_cannot_be_assembled_for_amd() -> None:
    fn, make_args = CASES["triton_only_primitives"]
    with pytest.raises(pl.PallasError, match=r"(?s)'hsaco' stage failed for target 'gfx942'.*"
                                             r"inline assembly.*AMDGCN for AMD"):
        pl.stages(fn, *make_args(), backend="triton", target="gfx942")


def _approx_tanh(x: jax.Array) -> jax.Array:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = pallas_triton.approx_tanh(x_ref[...])

    return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


@pytest.mark.parametrize("dtype,tol", [(F32, 2e-6), (jnp.bfloat16, 1e-2)])
def test_approx_tanh_on_amd_is_tanh_without_ptx(dtype: Any, tol: float) -> None:
    x = _rand((16, 128), dtype) * 3
    (stages,) = pl.stages(_approx_tanh, x, backend="triton", target="gfx942")
    assert "tanh.approx" not in stages["ttir"] and _machine(stages["hsaco"]) == EM_AMDGPU
    (nvidia,) = pl.stages(_approx_tanh, x, backend="triton", target="sm_90")
    assert "tanh.approx.f32" in nvidia["ttir"]
    got = pl.emulate(_approx_tanh, backend="triton", target="gfx942", checked=True)(x)
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               np.tanh(np.asarray(x, np.float32)), atol=tol, rtol=tol)


@pytest.mark.parametrize("name,tol", [("softmax", 1e-5), ("atomics", 1e-5),
                                      ("gather_rows", 1e-6), ("masked_load_store", 1e-6),
                                      # float32 dots: TF32 inputs on the GPU, as in JAX
                                      ("flash_attention", 2e-3), ("vmap_multi_head", 2e-3),
                                      ("matmul_3d_bf16", 2e-2)])
def test_rocm_modules_emulated(name: str, tol: float) -> None:
    """``pl.emulate`` with an AMD target lowers for rocm and runs that module: it agrees with
    the interpreter (checked against jax.numpy by tests/test_seed_examples.py) and with the
    module lowered for cuda."""
    fn, make_args = CASES[name]
    args = make_args()
    want = jax.tree.leaves(fn(*args))
    got = {target: jax.tree.leaves(pl.emulate(fn, backend="triton", target=target,
                                              checked=True)(*args))
           for target in ("gfx942", "sm_90")}
    for amd, nvidia, w in zip(got["gfx942"], got["sm_90"], want):
        np.testing.assert_allclose(np.asarray(amd, np.float32), np.asarray(w, np.float32),
                                   atol=tol, rtol=tol)
        np.testing.assert_allclose(np.asarray(amd, np.float32), np.asarray(nvidia, np.float32),
                                   atol=1e-6, rtol=1e-6)
