"""Warp specialisation in the Mosaic GPU backend: ``emit_pipeline_warp_specialized``,
``set_max_registers``, ``pl.run_scoped(collective_axes=<thread axis>)`` and wgmma on tile-aligned
slices of tiled SMEM. JAX's hopper_matmul, which uses all of them, is checked against JAX's own
lowering and in the interpreter in tests/jax_library/test_mgpu_library_agreement.py; here a
small kernel of our own, and the refusals."""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl
from pallas_core.call import force_interpret_mode

plgpu = pytest.importorskip("pallas_mosaic_gpu")
from pallas_mosaic_gpu import inspection  # noqa: E402

F16, F32 = jnp.float16, jnp.float32
TILE = 64


def _lower(fn: Any, *args: Any) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _module(fn: Any, *args: Any) -> str:
    ((_, module),) = inspection.kernels(_lower(fn, *args))
    return str(module)


def ws_matmul(a: jax.Array, b: jax.Array, *, steps: int = 2, out_specs: Any = (),
              col: Any = None, manual: bool = False, release: bool = True,
              **pipeline_kw: Any) -> jax.Array:
    """(64, K) @ (K, 128) with two compute warpgroups, each owning 64 columns of B
    (``b_smem.at[:, pl.ds(wg * 64, 64)]``), fed by a memory warpgroup; ``release=False``
    (with ``manual``): the body never hands its slots back."""
    m, k = a.shape
    n = b.shape[1]

    def body(a_gmem: Any, b_gmem: Any, o_gmem: Any, out_smem: Any) -> None:
        wg = lax.axis_index("wg")
        cols = col(wg) if col is not None else pl.ds(wg * TILE, TILE)

        def mma(_: Any, a_smem: Any, b_smem: Any, *rest: Any) -> Any:
            *released, acc = rest
            plgpu.wgmma(acc, a_smem, b_smem.at[:, cols])
            plgpu.wgmma_wait(0)
            for barrier in released if release else ():  # manual_consumed_barriers
                plgpu.barrier_arrive(barrier)
            return acc

        def context(run: Any) -> None:
            def scope(acc: Any) -> None:
                run(acc)
                out_smem[wg] = acc[...].astype(o_gmem.dtype)  # the scratch is shared: a half
                plgpu.commit_smem()                           # of it per warpgroup
                plgpu.copy_smem_to_gmem(out_smem.at[wg], o_gmem.at[:, pl.ds(wg * TILE, TILE)])
                plgpu.wait_smem_to_gmem(0)

            pl.run_scoped(scope, plgpu.ACC((m, TILE)))

        pipeline = plgpu.emit_pipeline_warp_specialized(
            mma, grid=(k // TILE,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=steps, compute_context=context, out_specs=out_specs,
            manual_consumed_barriers=manual,
            in_specs=[plgpu.BlockSpec((m, TILE), lambda i: (0, i)),
                      plgpu.BlockSpec((TILE, n), lambda i: (i, 0))], **pipeline_kw)
        pipeline(a_gmem, b_gmem)

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((m, n), a.dtype), num_threads=3,
                        thread_name="wg", scratch_types=[plgpu.SMEM((2, m, TILE), a.dtype)]
                        )(a, b)  # type: ignore[no-any-return]


def _operands(k: int = 256) -> tuple[jax.Array, jax.Array]:
    ka, kb = jax.random.split(jax.random.key(5))
    return (jax.random.normal(ka, (64, k), F32).astype(F16),
            jax.random.normal(kb, (k, 128), F32).astype(F16))


# The manual form takes about a minute on the host: `tox -e slow` runs it.
@pytest.mark.parametrize("manual", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_warp_specialized_matmul_in_the_interpreter(manual: bool) -> None:
    a, b = _operands()
    with force_interpret_mode():
        got = ws_matmul(a, b, steps=3, manual=manual)
    expected = jnp.dot(a.astype(F32), b.astype(F32))
    np.testing.assert_allclose(got.astype(F32), expected, rtol=2e-2, atol=0.1)


@pytest.mark.slow  # about a minute on CI's machine; test_gpu_scheduling's deadlocks are quick
def test_the_interpreter_runs_the_hand_off_between_warpgroups() -> None:
    """The memory warpgroup fetches every block and waits for the compute warpgroups to hand
    each slot back before refilling it: a body that never hands them back (4 steps through 2
    slots) leaves it waiting for ever, which the interpreter reports."""
    a, b = _operands()
    with pytest.raises(pl.PallasError, match="deadlock"), force_interpret_mode():
        jax.block_until_ready(ws_matmul(a, b, steps=2, manual=True, release=False))


def test_warp_specialized_matmul_lowers_with_its_roles() -> None:
    """The module holds both roles' register budgets (setmaxnreg 40 for the memory
    warpgroup, (512 - 40) // 2 rounded down to 232 for the compute ones), the copies, the
    waits and the wgmma; the pipeline's own allocation is one region shared by the 3
    warpgroups (2 slots of A and B blocks, full and consumed barriers)."""
    a, b = _operands()
    text = _module(ws_matmul, a, b)
    assert "nvvm.setmaxregister decrease 40" in text
    assert "nvvm.setmaxregister increase 232" in text
    assert text.count("nvvm.setmaxregister") == 2
    # A compute warpgroup releases a slot with one (predicated) arrival, not 128: inline PTX
    # whose predicate is its 3rd operand (JAX 0.10's library) or its 2nd (JAX 0.12's).
    assert re.search(r"@\$[12] mbarrier\.arrive\.release", text)
    for op in ("cp.async.bulk.tensor", "wgmma.mma_async", "mbarrier.try_wait"):
        assert op in text, op
    ((_, module),) = inspection.kernels(_lower(ws_matmul, a, b))
    launch = inspection.launch(module)
    assert launch["block"] == (384, 1, 1)
    # The output scratch 2 x (64, 64) f16, A: 2 x (64, 64) f16, B: 2 x (64, 128) f16, then
    # the full and consumed barriers (2 each); the ACC lives in registers.
    assert launch["smem_bytes"] == 2 * 8192 + 2 * 8192 + 2 * 16384 + 4 * 8


def test_collective_run_scoped_is_shared_once() -> None:
    """``pl.run_scoped(collective_axes='wg')`` in a kernel of 2 warpgroups is one region
    (not one per warpgroup), and the warpgroups meet at a block barrier before entering it."""
    def body(o_gmem: Any) -> None:
        def scope(buf: Any) -> None:
            wg = lax.axis_index("wg")
            buf[pl.ds(wg * 128, 128)] = jnp.full((128,), wg.astype(F32))
            plgpu.commit_smem()

            @pl.when(wg == 0)
            def _() -> None:
                plgpu.copy_smem_to_gmem(buf, o_gmem)
                plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scope, plgpu.SMEM((256,), F32), collective_axes="wg")

    fn = functools.partial(plgpu.kernel, body, out_type=jax.ShapeDtypeStruct((256,), F32),
                           num_threads=2, thread_name="wg", backend="mosaic_gpu")
    ((_, module),) = inspection.kernels(_lower(lambda: fn()()))
    assert inspection.launch(module)["smem_bytes"] == 1024
    assert "gpu.barrier" in str(module)


@pytest.mark.parametrize("collective,match", [
    ("g", r"warpgroups of a block only.*collective_axes='wg'"),
    ("nope", r"not mesh axes of this kernel"),
])
def test_collective_run_scoped_needs_the_thread_axis(collective: str, match: str) -> None:
    def body(o_gmem: Any) -> None:
        pl.run_scoped(lambda buf: None, plgpu.SMEM((128,), F32), collective_axes=collective)

    fn = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), F32), grid=(2,),
                      grid_names=("g",), num_threads=2, thread_name="wg", backend="mosaic_gpu")
    with pytest.raises(pl.UnsupportedError, match=match):
        _lower(fn)


def test_collective_run_scoped_refuses_an_accumulator() -> None:
    def body(o_gmem: Any) -> None:
        pl.run_scoped(lambda acc: None, plgpu.ACC((64, 64)), collective_axes="wg")

    fn = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), F32), num_threads=2,
                      thread_name="wg", backend="mosaic_gpu")
    with pytest.raises(pl.UnsupportedError, match=r"plgpu.ACC.*registers"):
        _lower(fn)


@pytest.mark.parametrize("kw,match", [
    (dict(out_specs=[pl.BlockSpec((64, 64), lambda i: (0, i))]), "out_specs"),
    (dict(pipeline_state=0), "pipeline_state"),
    (dict(memory_thread_idx=0), "memory_thread_idx"),
])
def test_warp_specialized_refusals(kw: dict[str, Any], match: str) -> None:
    a, b = _operands()
    with pytest.raises(pl.UnsupportedError, match=match):
        _lower(functools.partial(ws_matmul, **kw), a, b)


def test_wgmma_on_a_slice_off_the_tiles_is_refused() -> None:
    """B's columns are tiled by 64 (f16, 128-byte swizzle): a window starting at 32 has no
    tiled address."""
    a, b = _operands()
    with pytest.raises(pl.UnsupportedError, match=r"starting at 32, not a multiple of its tile"):
        _lower(functools.partial(ws_matmul, col=lambda wg: pl.ds(32, TILE)), a, b)


@pytest.mark.parametrize("n,action", [(20, "increase"), (100, "decrease"), (64, "grow")])
def test_set_max_registers_checks_its_arguments(n: int, action: str) -> None:
    with pytest.raises(pl.PallasError, match="set_max_registers"):
        plgpu.set_max_registers(n, action=action)


def test_manual_consumed_barriers_lower_per_input() -> None:
    """With manual_consumed_barriers each input has its own consumed barriers (2 slots each),
    which the body arrives on; the memory warpgroup waits on each before refilling."""
    a, b = _operands()
    ((_, module),) = inspection.kernels(_lower(functools.partial(ws_matmul, manual=True),
                                               a, b))
    assert inspection.launch(module)["smem_bytes"] == 2 * 8192 + 2 * 8192 + 2 * 16384 + 6 * 8
    assert len(re.findall(r"@\$[12] mbarrier\.arrive\.release", str(module))) == 2


def test_shared_memory_without_collective_axes_is_refused_with_warpgroups() -> None:
    """As in JAX: a block of several warpgroups has one shared memory, so a run_scoped SMEM
    buffer must say it is shared (the interpreter would give each warpgroup its own)."""
    def body(o_gmem: Any) -> None:
        pl.run_scoped(lambda buf: None, plgpu.SMEM((128,), F32))

    fn = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), F32), num_threads=2,
                      thread_name="wg", backend="mosaic_gpu")
    with pytest.raises(pl.UnsupportedError, match="collective_axes='wg'"):
        _lower(fn)
