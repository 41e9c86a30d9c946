"""JAX's Triton kernel library (``jax.experimental.pallas.ops.gpu``) on the GPU.

Every kernel the Triton backend lowers (flash attention forward and backward, decode attention
MQA and GQA, paged attention, layer norm and RMS norm forward and backward, softmax), as this
project runs JAX's source (``porting.ported``), on the cases of
tests/jax_library/test_gpu_library_emulated.py. On the GPU its result is compared with

* the reference shipped in the same JAX module;
* JAX's own ``jax.experimental.pallas`` running the unchanged module on the same GPU;
* the Triton emulator (``pl.emulate(..., backend="triton")``) running the same kernels on the
  host for this GPU's architecture: how faithful the emulator is to the hardware (the largest
  difference is printed), and in ``checked=True`` mode once, flash attention, to show that its
  out-of-bounds and race checks are silent on real code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged_attention

import pallas_core as pl
from pallas_core.stages import kernel_calls

pytestmark = pytest.mark.gpu

pytest.importorskip("pallas_triton")
from tests.jax_library import test_gpu_library as library  # noqa: E402
from tests.jax_library import test_gpu_library_emulated as emulated  # noqa: E402

Made = tuple[Callable[..., Any], Callable[..., Any], tuple[Any, ...]]
"""(kernel, reference, inputs)."""

PAGED = {"jax": jax_paged_attention, "ours": library.paged_attention}


def _paged(lowered_by: str) -> Made:
    """Paged attention (6 query heads per KV head, per-sequence lengths), as in
    tests/jax_library/test_gpu_library.py."""
    mod = PAGED[lowered_by]
    q, k_pages, v_pages, tables = library._paged_inputs(q_per_kv=6)
    lengths = jnp.array([3, 17, 32], jnp.int32)
    fn = functools.partial(mod.paged_attention, block_h=16, pages_per_compute_block=2,
                           k_splits=2)

    def ref(q: Any, k: Any, v: Any, t: Any, n: Any) -> Any:
        return mod.paged_attention_reference(q, library._unpage(k, t), library._unpage(v, t), n)

    return fn, ref, (q, k_pages, v_pages, tables, lengths)


def make(name: str, lowered_by: str) -> tuple[Made, float]:
    """The case ``name`` with the module as ``lowered_by`` ("ours" or "jax") runs it, and its
    tolerance (float32 dots run in TensorFloat-32 on the GPU)."""
    if name == "paged_attention":
        return _paged(lowered_by), 2e-2
    build, tol = emulated.CASES[name]
    return build(emulated.MODULES[lowered_by]), tol


NAMES = sorted([*emulated.CASES, "paged_attention"])


def gpu_target(device: Any) -> str:
    """The Triton target of ``device`` (``sm_90`` for an H100)."""
    return "sm_" + str(getattr(device, "compute_capability", "9.0")).replace(".", "")


@functools.cache
def on_gpu(name: str, lowered_by: str) -> list[np.ndarray]:
    """The case's outputs computed on the GPU (once per session)."""
    (fn, _, args), _ = make(name, lowered_by)
    out = jax.block_until_ready(jax.jit(fn)(*args))
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(out)]


def assert_all_close(got: list[np.ndarray], want: Any, tol: float, what: str) -> float:
    """Compares leaf by leaf; returns the largest absolute difference."""
    want = [np.asarray(x, np.float32) for x in jax.tree.leaves(want)]
    assert len(got) == len(want), what
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape, (what, g.shape, w.shape)
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=what)
        worst = max(worst, float(np.max(np.abs(g - w))) if g.size else 0.0)
    return worst


@pytest.mark.parametrize("name", NAMES)
def test_library_kernel_on_gpu(name: str) -> None:
    """This project's Triton lowering of the kernel, run on the GPU, against JAX's reference."""
    (fn, ref, args), tol = make(name, "ours")
    backends = {c.backend for c in kernel_calls(jax.make_jaxpr(fn)(*args).jaxpr)}
    assert backends == {"triton"}, backends
    worst = assert_all_close(on_gpu(name, "ours"), ref(*args), tol, f"{name} vs reference")
    print(f"{name}: max |GPU - reference| {worst:.3g}")


@pytest.mark.parametrize("name", NAMES)
def test_library_kernel_agrees_with_jax_pallas_on_gpu(name: str) -> None:
    """The same kernel as ``jax.experimental.pallas`` runs it on the same GPU."""
    _, tol = make(name, "ours")
    worst = assert_all_close(on_gpu(name, "ours"), on_gpu(name, "jax"), tol,
                             f"{name}: ours vs jax.experimental.pallas")
    print(f"{name}: max |ours - jax.experimental.pallas| on the GPU {worst:.3g}")


@pytest.mark.parametrize("name", NAMES)
def test_emulator_matches_gpu(name: str, gpu: Any) -> None:
    """The Triton emulator, on the host, for this GPU's architecture, against the GPU."""
    (fn, _, args), tol = make(name, "ours")
    emulated_out = pl.emulate(fn, backend="triton", target=gpu_target(gpu))(*args)
    worst = assert_all_close(on_gpu(name, "ours"), emulated_out, tol,
                             f"{name}: GPU vs Triton emulator")
    print(f"{name}: max |GPU - emulator| {worst:.3g}")


def test_checked_emulation_is_silent_on_flash_attention(gpu: Any) -> None:
    """``checked=True`` (out-of-bounds accesses and races between programs are errors) on
    flash attention forward: no report, and the GPU's result."""
    (fn, _, args), tol = make("mha", "ours")
    got = pl.emulate(fn, backend="triton", target=gpu_target(gpu), checked=True)(*args)
    assert_all_close(on_gpu("mha", "ours"), got, tol, "mha: GPU vs checked emulator")
