"""The kernels of benchmarks/gpu_triton.py: correct in the interpreter, compiled for sm_90.

The benchmark itself needs a GPU; these checks make sure that, when one is available, the
kernels it times are right and build.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl

pytest.importorskip("triton", reason="compiling to cubin needs the triton package")
pytest.importorskip("pallas_triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import gpu_triton

SMALL: dict[str, list[tuple[tuple[int, ...], Any]]] = {
    "matmul_bf16_4096": [((256, 256), jnp.bfloat16)] * 2,
    "softmax_8192": [((8, 512), jnp.float32)],
    "flash_attention": [((1, 2, 256, 64), jnp.bfloat16)] * 3,
    "add_relu_2^28": [((1 << 14,), jnp.float32)] * 2,
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_benchmark_kernel_matches_jnp_in_the_interpreter(name: str, monkeypatch: Any) -> None:
    kernel, reference, _, tol = gpu_triton.CASES[name]
    monkeypatch.setattr(gpu_triton, "_triton_params",
                        lambda pl_module, warps, stages: {"backend": "interpret"})
    rng = np.random.default_rng(0)
    args = [jnp.asarray(rng.standard_normal(s), dt) for s, dt in SMALL[name]]
    got = np.asarray(kernel(pl, *args), np.float32)
    np.testing.assert_allclose(got, np.asarray(reference(*args), np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_benchmark_kernel_compiles_for_sm90(name: str) -> None:
    kernel = gpu_triton.CASES[name][0]
    args = [jnp.ones(s, dt) for s, dt in SMALL[name]]
    for stages in pl.stages(functools.partial(kernel, pl), *args, backend="triton",
                            target="sm_90"):
        assert stages["cubin"]
    assert jax.jit(functools.partial(kernel, pl)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text().count("__gpu$xla.gpu.triton") >= 1
