"""The backend of a ``pallas_call`` lowered for ``cuda`` with no ``backend=``, ``interpret=`` or
compiler parameters follows JAX's ``jax_pallas_use_mosaic_gpu`` setting, as JAX does: Mosaic GPU
where it is on (its default in the JAX versions that have it), Triton where it is off or where
JAX has no such setting (JAX 0.12). A backend that is not loaded gives way to the other."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl
from pallas_core import plugins

pytest.importorskip("pallas_triton")
pytest.importorskip("pallas_mosaic_gpu")

MOSAIC_GPU_TARGET = "mosaic_gpu_v2"
TRITON_TARGET = "__gpu$xla.gpu.triton"
_HAS_SETTING = hasattr(jax.config, "jax_pallas_use_mosaic_gpu")


def _add(x: jax.Array, y: jax.Array) -> jax.Array:
    def kernel(x_ref, y_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = x_ref[...] + y_ref[...]
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype))(x, y)


def _cuda_text(fn, *args) -> str:  # type: ignore[no-untyped-def]
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _targets(text: str) -> set[str]:
    """The call targets of the program's custom calls (``@name`` or ``@"name"``)."""
    return set(re.findall(r'stablehlo\.custom_call @"?([^"(]+)"?\(', text))


@pytest.fixture
def setting() -> Iterator[None]:
    """Restores JAX's setting after a test that changes it."""
    if not _HAS_SETTING:
        yield
        return
    before = jax.config.jax_pallas_use_mosaic_gpu
    try:
        yield
    finally:
        jax.config.update("jax_pallas_use_mosaic_gpu", before)


def _args() -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((128, 128)), jnp.float32)
    return x, jnp.asarray(rng.standard_normal((128, 128)), jnp.float32)


def test_the_default_on_cuda_is_jaxs_default(setting: None) -> None:
    if _HAS_SETTING:
        jax.config.update("jax_pallas_use_mosaic_gpu", True)
        want = {MOSAIC_GPU_TARGET}
    else:
        want = {TRITON_TARGET}  # JAX 0.12 dropped the setting and always lowers to Triton
    assert _targets(_cuda_text(_add, *_args())) == want
    assert plugins.manager.default_for_platform("cuda") == (
        "mosaic_gpu" if _HAS_SETTING else "triton")


@pytest.mark.skipif(not _HAS_SETTING, reason="this JAX has no jax_pallas_use_mosaic_gpu")
def test_the_setting_off_chooses_triton_and_on_again_mosaic_gpu(setting: None) -> None:
    x, y = _args()
    jax.config.update("jax_pallas_use_mosaic_gpu", False)
    assert _targets(_cuda_text(_add, x, y)) == {TRITON_TARGET}
    # The setting is in jax.jit's cache key: the same function lowers anew once it changes.
    jax.config.update("jax_pallas_use_mosaic_gpu", True)
    assert _targets(_cuda_text(_add, x, y)) == {MOSAIC_GPU_TARGET}


def test_rocm_stays_with_triton(setting: None) -> None:
    if _HAS_SETTING:
        jax.config.update("jax_pallas_use_mosaic_gpu", True)
    assert plugins.manager.default_for_platform("rocm") == "triton"


def test_an_explicit_choice_beats_the_setting(setting: None) -> None:
    import pallas_triton

    x, y = _args()

    def by_params(x: jax.Array, y: jax.Array) -> jax.Array:
        def kernel(x_ref, y_ref, o_ref):  # type: ignore[no-untyped-def]
            o_ref[...] = x_ref[...] + y_ref[...]
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                              compiler_params=pallas_triton.CompilerParams())(x, y)

    if _HAS_SETTING:
        jax.config.update("jax_pallas_use_mosaic_gpu", True)
    assert _targets(_cuda_text(by_params, x, y)) == {TRITON_TARGET}


def _run(code: str, **env: str) -> str:
    full = {k: v for k, v in os.environ.items()
            if k not in (plugins.DISABLED_BACKENDS_ENV, plugins.ALLOWED_BACKENDS_ENV,
                         plugins.DISABLE_AUTOLOAD_ENV)}
    full.update(JAX_PLATFORMS="cpu", **env)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=full, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


_CHOICE = """
import jax
from pallas_core import plugins
print(plugins.manager.default_for_platform("cuda"))
"""


def test_a_backend_not_loaded_gives_way_to_the_other() -> None:
    # The setting at its default (on where JAX has it), Mosaic GPU not loaded: Triton.
    assert _run(_CHOICE, PALLAS_DISABLED_BACKENDS="mosaic_gpu").strip() == "triton"
    # The setting off, Triton not loaded: Mosaic GPU.
    assert _run(_CHOICE, PALLAS_DISABLED_BACKENDS="triton",
                JAX_PALLAS_USE_MOSAIC_GPU="0").strip() == "mosaic_gpu"
    # Neither: the error names the platform and what is loaded, as before.
    out = _run("""
import pallas_core as pl
from pallas_core import plugins
try:
    plugins.manager.default_for_platform("cuda")
except pl.BackendNotFoundError as e:
    print(e)
""", PALLAS_DISABLED_BACKENDS="mosaic_gpu,triton")
    assert "no installed backend is the default for platform 'cuda'" in out
