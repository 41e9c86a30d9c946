"""``pl.report`` counts Mosaic GPU's own primitives through the backend's ``pallas_op_cost``
hook (``pallas_mosaic_gpu.cost``): ``wgmma``'s matrix flops, the HBM bytes of TMA copies.

* A hand-written ``plgpu.wgmma`` kernel (A from SMEM or registers, B transposed or not, K in
  steps) counts ``2 * M * N * K`` exactly, and its TMA copies the bytes of A, B and C.
* A copy the blocks of a cluster share reads its window from HBM once per cluster.
* JAX's attention_mgpu (ported): flops within 10% of XLA's count of a plain-jnp attention,
  the block pairs it runs counted exactly (causal: fewer), HBM bytes the closed form.
* JAX's hopper_matmul_mgpu (ported): each wgmma and TMA copy of its body costs what it
  should, and over its persistent, warp-specialised loop (trips decided per SM, roles per
  warpgroup, ``warpgroups_run_concurrently`` true as on the GPU: the backend's
  ``pallas_op_value``) the totals are XLA's flops and the closed-form bytes.
* JAX's blackwell_matmul (ported): each ``tcgen05_mma``, one block's or (collective) the
  pair's, and each block's part of a partitioned copy.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl
from pallas_core import backend as plb
from pallas_core.stages import kernel_calls
from tests.jax_library import porting
from tests.xla_cost import xla_flops

plgpu = pytest.importorskip("pallas_mosaic_gpu")
from pallas_mosaic_gpu import cost  # noqa: E402

S = jax.ShapeDtypeStruct
F16, F32 = jnp.float16, jnp.float32
TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
NUM_SMS = 4


def _report(fn: Any, *args: Any) -> Any:
    (kernel,) = pl.report(fn, *args, backend="mosaic_gpu", target="h100").kernels
    return kernel


def _nbytes(*shapes: Any) -> int:
    return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in shapes)


# --- a hand-written wgmma kernel ---------------------------------------------------------------


def wgmma_matmul(a: Any, b: Any, *, steps: int = 1, transpose_b: bool = False,
                 a_in_registers: bool = False) -> Any:
    """``a @ b`` (``b`` given as (N, K) when ``transpose_b``) in one block: A and B copied into
    SMEM by TMA, ``steps`` wgmma over slices of K into a ``plgpu.ACC``, the result staged in
    SMEM and copied out by TMA."""
    m, k = a.shape
    n = b.shape[0] if transpose_b else b.shape[1]
    kt = k // steps

    @functools.partial(plgpu.kernel, out_type=S((m, n), F32),
                       scratch_types=[plgpu.SMEM(a.shape, F16, transforms=TILED),
                                      plgpu.SMEM(b.shape, F16, transforms=TILED),
                                      plgpu.SMEM((m, n), F32),
                                      plgpu.Barrier(num_barriers=2)])
    def kernel(a_ref: Any, b_ref: Any, o_ref: Any, a_smem: Any, b_smem: Any, o_smem: Any,
               bars: Any) -> None:
        plgpu.copy_gmem_to_smem(a_ref, a_smem, bars.at[0])
        plgpu.copy_gmem_to_smem(b_ref, b_smem, bars.at[1])
        plgpu.barrier_wait(bars.at[0])
        plgpu.barrier_wait(bars.at[1])

        def scope(acc: Any) -> None:
            @pl.loop(0, steps)
            def _step(s: Any) -> None:
                ks = pl.ds(pl.multiple_of(s * kt, kt), kt)
                lhs = a_smem.at[:, ks]
                rhs = b_smem.at[:, ks].transpose((1, 0)) if transpose_b else b_smem.at[ks, :]
                plgpu.wgmma(acc, lhs[...] if a_in_registers else lhs, rhs)
                plgpu.wgmma_wait(0)

            o_smem[...] = acc[...]

        pl.run_scoped(scope, plgpu.ACC((m, n), F32))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref)
        plgpu.wait_smem_to_gmem(0)

    return kernel(a, b)


@pytest.mark.parametrize("steps, transpose_b, a_in_registers", [
    (1, False, False), (2, True, False), (2, False, True)],
    ids=["smem", "transposed_b_in_steps", "a_in_registers"])
def test_a_wgmma_kernel_counts_2mnk(steps: int, transpose_b: bool,
                                    a_in_registers: bool) -> None:
    m, n, k = 64, 128, 128
    a = S((m, k), F16)
    b = S((n, k) if transpose_b else (k, n), F16)
    fn = functools.partial(wgmma_matmul, steps=steps, transpose_b=transpose_b,
                           a_in_registers=a_in_registers)
    got = _report(fn, a, b)
    assert got.matmul_flops == 2 * m * n * k
    assert got.transcendentals == 0 and got.vector_flops < 16  # scalar index arithmetic
    assert got.hbm_bytes == _nbytes(a, b, S((m, n), F32))  # A and B in, C out, each once
    assert got.roofline["h100"].compute_seconds == pytest.approx(  # at the float16 peak
        2 * m * n * k / plb.GPU_CHIPS["h100"].matmul_peak("float16"))
    assert got.matmul_flops == xla_flops(
        lambda x, y: jnp.dot(x, y.T if transpose_b else y, preferred_element_type=F32), a, b)
    pl.stages(fn, a, b, backend="mosaic_gpu")  # the kernel counted is one that lowers


def test_each_primitive_alone() -> None:
    """The hook on the equations of the kernel above: wgmma's flops and dtype, each copy's
    bytes, nothing for barriers and waits, and None for what the core counts."""
    jaxpr = jax.make_jaxpr(functools.partial(wgmma_matmul, transpose_b=True))(
        S((64, 128), F16), S((128, 128), F16))
    (call,) = kernel_calls(jaxpr.jaxpr)
    costs: dict[str, Any] = {}

    def walk(j: Any) -> None:
        for eqn in j.eqns:
            costs.setdefault(eqn.primitive.name, []).append(cost.op_cost(eqn))
            for sub in _subjaxprs(eqn):
                walk(sub)

    walk(call.jaxpr.jaxpr)
    assert costs["gpu_wgmma"] == [plb.OpCost(matmul_flops=2 * 64 * 128 * 128,
                                             matmul_dtype="float16")]
    assert costs["gpu_copy_gmem_to_smem"] == [plb.OpCost(hbm_bytes=64 * 128 * 2),
                                              plb.OpCost(hbm_bytes=128 * 128 * 2)]
    assert costs["gpu_copy_smem_to_gmem"] == [plb.OpCost(hbm_bytes=64 * 128 * 4)]
    for free in ("gpu_barrier_wait", "gpu_wgmma_wait", "gpu_commit_smem",
                 "gpu_wait_smem_to_gmem"):
        assert set(costs[free]) == {plb.OpCost()}, free
    assert set(costs["run_scoped"]) == {None}


def _subjaxprs(eqn: Any) -> list[Any]:
    out = []
    for v in eqn.params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            if hasattr(x, "eqns"):
                out.append(x)
            elif hasattr(getattr(x, "jaxpr", None), "eqns"):
                out.append(x.jaxpr)
    return out


# --- copies a cluster shares -------------------------------------------------------------------

ROWS = 128


def cluster_copy(x: Any, how: str) -> Any:
    """Two clusters of 2 blocks; each cluster copies its (ROWS, 64) window of ``x`` with one
    copy its blocks share (``multicast``: each receives all of it; ``partitioned``: each
    receives its half of the rows) and writes what it received back out."""
    part = ROWS // 2 if how == "partitioned" else ROWS
    shared: dict[str, Any] = dict(collective_axes="x")
    if how == "partitioned":
        shared["leader_tracked"] = plgpu.CopyPartition.PARTITIONED(0)

    def body(x_ref: Any, o_ref: Any, buf: Any, bar: Any) -> None:
        i, c = lax.axis_index("i"), lax.axis_index("x")
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(i * ROWS, ROWS)], buf, bar.at[0], **shared)

        @pl.when(c == 0)
        def _wait() -> None:
            plgpu.barrier_wait(bar.at[0])

        plgpu.copy_smem_to_gmem(buf, o_ref.at[pl.ds((2 * i + c) * part, part)])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(body, out_type=S((4 * part, 64), F32), grid=(2,), grid_names=("i",),
                        cluster=(2,), cluster_names=("x",),
                        scratch_types=[plgpu.SMEM((part, 64), F32),
                                       plgpu.Barrier(num_barriers=1)])(x)


@pytest.mark.parametrize("how", ["multicast", "partitioned"])
def test_a_copy_a_cluster_shares_reads_its_window_once(how: str) -> None:
    """Each cluster's (ROWS, 64) float32 window is read from HBM once, however its blocks
    share it (a multicast copy: each block fetches half and multicasts it; a partitioned
    one: each fetches its own half); the blocks' stores out count in full."""
    x = S((2 * ROWS, 64), F32)
    got = _report(functools.partial(cluster_copy, how=how), x)
    window = ROWS * 64 * 4
    stores = 4 * (window if how == "multicast" else window // 2)
    assert got.grid == (2, 2)
    assert got.hbm_bytes == 2 * window + stores


# --- JAX's attention_mgpu ----------------------------------------------------------------------

BATCH, SEQ, HEADS, HEAD_DIM, BLOCK = 1, 512, 2, 64, 64


@pytest.fixture()
def attention_mgpu(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The port of JAX's attention_mgpu, told a CUDA runtime version (it refuses causal
    masking on some), as tests/jax_library/test_mgpu_library_agreement.py tells it."""
    module = porting.ported("gpu.attention_mgpu")
    monkeypatch.setattr(module, "cuda_versions", types.SimpleNamespace(
        cuda_runtime_get_version=lambda: 12091))
    return module


def attention_reference(q: Any, k: Any, v: Any) -> Any:
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=F32)
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v, preferred_element_type=F32).astype(q.dtype)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_mgpu(attention_mgpu: types.ModuleType, causal: bool) -> None:
    """Two wgmma per (q block, kv block) pair, ``Q K^T`` (B transposed) and ``P V``, each
    2 * 64 * 64 * 64 flops; every pair non-causal, the 36 of each head's 64 with kv <= q
    causal (decided per block from its q index). K and V are fetched once per block of 2 x 64
    query rows (causal: up to its diagonal), Q read and O written once."""
    config = attention_mgpu.TuningConfig(block_q=BLOCK, block_kv=BLOCK, max_concurrent_steps=2,
                                         causal=causal)
    args = (S((BATCH, SEQ, HEADS, HEAD_DIM), F16),) * 3
    got = _report(lambda q, k, v: attention_mgpu.attention(q, k, v, config), *args)
    blocks = SEQ // BLOCK
    pairs = blocks * (blocks + 1) // 2 if causal else blocks * blocks
    assert got.matmul_flops == BATCH * HEADS * pairs * 2 * (2 * BLOCK ** 3)
    assert got.transcendentals > 0
    xla = xla_flops(attention_reference, *args)
    if causal:
        assert got.flops < 0.6 * xla
    else:
        assert got.flops == pytest.approx(xla, rel=0.1)
    tensor = _nbytes(args[0])
    rows = 2 * BLOCK  # query rows of a thread block (two compute warpgroups)
    per_head_kv = sum(((i + 1) * rows if causal else SEQ) for i in range(SEQ // rows))
    kv = 2 * BATCH * HEADS * per_head_kv * HEAD_DIM * 2
    assert got.hbm_bytes == 2 * tensor + kv


# --- JAX's hopper_matmul_mgpu ------------------------------------------------------------------

M = N = K = 512
TILE_M, TILE_N, TILE_K = 128, 128, 64


@pytest.fixture()
def hopper_matmul(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The port of JAX's hopper_matmul_mgpu on 4 SMs (it asks the device for its SM count),
    and the matmul it runs at 512^3 float16."""
    module = porting.ported("gpu.hopper_matmul_mgpu")
    monkeypatch.setattr(module, "get_num_sms", lambda: NUM_SMS)
    config = module.TuningConfig(tile_m=TILE_M, tile_n=TILE_N, tile_k=TILE_K,
                                 max_concurrent_steps=2)
    return lambda a, b: module.matmul(a, b, None, config)


ARGS = (S((M, K), F16), S((K, N), F16))
# Two compute warpgroups side by side along N: a block's tile is (128, 256), each K step
# fetches A (128, 64) and B (64, 256) once, and C leaves in (64, 64) epilogue tiles.
CTA_M, CTA_N = TILE_M, 2 * TILE_N
CLOSED_FORM_BYTES = 2 * (M * K * (N // CTA_N) + K * N * (M // CTA_M) + M * N)


def _costs_by_primitive(jaxpr: Any) -> dict[str, set[Any]]:
    """Each Mosaic GPU primitive of ``jaxpr`` (nested jaxprs too) -> the costs the hook gives
    its equations."""
    found: dict[str, set[Any]] = {}

    def walk(j: Any) -> None:
        for eqn in j.eqns:
            if eqn.primitive.name.startswith("gpu_"):
                found.setdefault(eqn.primitive.name, set()).add(cost.op_cost(eqn))
            for sub in _subjaxprs(eqn):
                walk(sub)

    walk(jaxpr)
    return found


def test_hopper_matmul_primitives(hopper_matmul: Any) -> None:
    """Each instruction of the kernel's body, as the hook counts it."""
    (call,) = kernel_calls(jax.make_jaxpr(hopper_matmul)(*ARGS).jaxpr)
    found = _costs_by_primitive(call.jaxpr.jaxpr)
    assert found["gpu_wgmma"] == {plb.OpCost(matmul_flops=2 * TILE_M * TILE_N * TILE_K,
                                             matmul_dtype="float16")}
    assert found["gpu_copy_gmem_to_smem"] == {plb.OpCost(hbm_bytes=CTA_M * TILE_K * 2),
                                              plb.OpCost(hbm_bytes=TILE_K * CTA_N * 2)}
    assert found["gpu_copy_smem_to_gmem"] == {plb.OpCost(hbm_bytes=64 * 64 * 2)}
    assert found["gpu_warpgroups_run_concurrently"] == {None}


def test_hopper_matmul_bounds(hopper_matmul: Any) -> None:
    """What holds today: the counts are upper bounds of the closed forms (see below)."""
    got = _report(hopper_matmul, *ARGS)
    xla = xla_flops(jnp.dot, *ARGS)
    assert got.matmul_flops >= 0.9 * xla
    assert got.hbm_bytes >= CLOSED_FORM_BYTES


def test_hopper_matmul_totals(hopper_matmul: Any) -> None:
    """The persistent tile loop's trips are decided per SM, the warpgroups' roles per
    warpgroup inside it, and the pipeline's warp-specialised branch as on the GPU (its
    warpgroups run concurrently): the flops are XLA's, the bytes the closed form."""
    got = _report(hopper_matmul, *ARGS)
    assert got.flops == pytest.approx(xla_flops(jnp.dot, *ARGS), rel=0.1)
    assert got.matmul_flops == pytest.approx(xla_flops(jnp.dot, *ARGS), rel=0.1)
    assert got.hbm_bytes == CLOSED_FORM_BYTES


# --- Blackwell: tcgen05_mma --------------------------------------------------------------------


@pytest.mark.parametrize("collective", [False, True])
def test_blackwell_matmul_mma(collective: bool) -> None:
    """JAX's blackwell_matmul (ported): each tcgen05_mma is a (128, 128, 64) matmul of one
    block, or, collective, one (256, 256, 64) instruction over the pair of blocks (each
    holding 128 rows of A and of the accumulator, 128 columns of B), issued by the first."""
    module = porting.ported("gpu.blackwell_matmul_mgpu")
    config = module.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=2,
                                 collective=collective)
    jaxpr = jax.make_jaxpr(lambda a, b: module.matmul_kernel(a, b, config))(*ARGS)
    (call,) = kernel_calls(jaxpr.jaxpr)
    found = _costs_by_primitive(call.jaxpr.jaxpr)
    rows = 2 * 128 if collective else 128
    assert found["gpu_tcgen05_mma"] == {plb.OpCost(matmul_flops=2 * rows * rows * 64,
                                                   matmul_dtype="float16")}
    assert found["gpu_tcgen05_commit_arrive"] == {plb.OpCost()}
    # Each block's copies: A (128, 64) and B (64, 128); collective, the same: its part of
    # the pair's (256, 64) window of A and (64, 256) window of B (PARTITIONED).
    assert found["gpu_copy_gmem_to_smem"] == {plb.OpCost(hbm_bytes=128 * 64 * 2)}
