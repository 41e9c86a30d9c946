"""Work shared by the blocks of a cluster (pallas_mosaic_gpu.cluster): ClusterBarrier,
collective copies (multicast, CopyPartition), collective TMEM and tcgen05, and claiming work
for a cluster. Each kernel is written once against a ``plgpu`` module and lowered both with
this backend and with JAX's ``jax.experimental.pallas.mosaic_gpu`` for CUDA on this CPU
machine: the launches must agree, and so must the counts of the instructions that make the
work collective. They also run in the interpreter, which runs the blocks of a cluster
together (pallas_interpret.phases), against ``jax.numpy``."""

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
jgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
from jax.experimental import pallas as jpl  # noqa: E402
from pallas_mosaic_gpu import inspection, targets  # noqa: E402

S = jax.ShapeDtypeStruct
F32, F16 = jnp.float32, jnp.float16
ROWS = 64
OURS, THEIRS = (plgpu, pl), (jgpu, jpl)


def _kernels(fn: Any, *args: Any, blackwell: bool = False) -> tuple[Any, Any]:
    """(ours, theirs): the one Mosaic GPU kernel of ``fn(OURS)`` and of ``fn(THEIRS)``."""
    def lower(which: Any) -> Any:
        text = jax.jit(fn(which)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        (found,) = inspection.kernels(text)
        return found

    ours = lower(OURS)
    if blackwell:
        with targets.assume(targets.BLACKWELL):
            return ours, lower(THEIRS)
    return ours, lower(THEIRS)


def _count(module: Any, *marks: str) -> tuple[int, ...]:
    """How often each of ``marks`` (regular expressions) occurs in ``module``'s text."""
    text = str(module)
    return tuple(len(re.findall(m, text)) for m in marks)


# Marks in the form the installed Mosaic GPU library writes them: an nvvm operation (JAX 0.10)
# or inline PTX (JAX 0.12).
CLUSTER_ARRIVE = r"nvvm\.cluster\.arrive|barrier\.cluster\.arrive"
CLUSTER_WAIT = r"nvvm\.cluster\.wait|barrier\.cluster\.wait"
MULTICAST = r"multicast_mask|\.multicast::cluster \["
MAPA = r"mapa\.shared::cluster\.u32 (?:mapped_addr, \$3, 0|\$0, \$1, \$2;)"


def _same_launch(ours: Any, theirs: Any) -> dict[str, Any]:
    a, b = inspection.launch(ours[1]), inspection.launch(theirs[1])
    for k in ("grid", "cluster", "block", "arch"):
        assert a[k] == b[k], (k, a[k], b[k])
    assert ours[0]["call"] == theirs[0]["call"]
    return a


# --- a multicast copy: every block of the cluster receives the whole window -----------------


def multicast(which: Any, groups: int = 2) -> Any:
    """Block (i, c) of each cluster of 2 multicast-copies rows [i*64, (i+1)*64) of x into its
    SMEM, then writes them to output rows [(2i+c)*64, ...): each window appears twice."""
    gpu, pl_ = which

    def body(x_ref: Any, o_ref: Any, buf: Any, bar: Any) -> None:
        i, c = lax.axis_index("i"), lax.axis_index("x")
        gpu.copy_gmem_to_smem(x_ref.at[pl_.ds(i * ROWS, ROWS)], buf, bar.at[0],
                              collective_axes="x")
        gpu.barrier_wait(bar.at[0])
        gpu.copy_smem_to_gmem(buf, o_ref.at[pl_.ds((2 * i + c) * ROWS, ROWS)])
        gpu.wait_smem_to_gmem(0)

    return gpu.kernel(body, out_type=S((2 * groups * ROWS, 64), F32), grid=(groups,),
                      grid_names=("i",), cluster=(2,), cluster_names=("x",),
                      scratch_types=[gpu.SMEM((ROWS, 64), F32), gpu.Barrier(num_barriers=1)])


def test_a_multicast_copy_lowers_like_jax() -> None:
    x = S((2 * ROWS, 64), F32)
    ours, theirs = _kernels(multicast, x)
    launch = _same_launch(ours, theirs)
    assert (launch["grid"], launch["cluster"]) == ((4, 1, 1), (2, 1, 1))
    # One copy multicast to the cluster (a mask of its 2 blocks): each issues half the rows.
    assert _count(ours[1], MULTICAST) == _count(theirs[1], MULTICAST) == (1,)
    assert "cta_group::2" not in str(ours[1])


def test_a_multicast_copy_runs_in_the_interpreter() -> None:
    x = jax.random.normal(jax.random.key(3), (2 * ROWS, 64), F32)
    with force_interpret_mode():
        got = multicast(OURS)(x)
    np.testing.assert_array_equal(got, jnp.repeat(x.reshape(2, 1, ROWS, 64), 2, axis=1)
                                  .reshape(4 * ROWS, 64))


# --- a ClusterBarrier: an arrival reaches every block of the cluster --------------------------


def cluster_meeting(which: Any) -> Any:
    """Each warpgroup of each block arrives on the ClusterBarrier, then waits for the phase
    that needs all of them (2 warpgroups x 2 blocks)."""
    gpu, _ = which

    def body(x_ref: Any, o_ref: Any, bar: Any) -> None:
        gpu.barrier_arrive(bar.at[0])
        gpu.barrier_wait(bar.at[0])

    return gpu.kernel(body, out_type=S((8,), F32), grid=(2,), grid_names=("i",),
                      cluster=(2,), cluster_names=("x",), num_threads=2, thread_name="wg",
                      scratch_types=[gpu.ClusterBarrier(collective_axes=("x",),
                                                         num_arrivals=2, num_barriers=1)])


def test_a_cluster_barrier_lowers_like_jax() -> None:
    ours, theirs = _kernels(cluster_meeting, S((8,), F32))
    _same_launch(ours, theirs)
    marks = (r"mbarrier\.arrive\.shared::cluster\.b64", CLUSTER_ARRIVE, CLUSTER_WAIT)
    # The arrival on both blocks' barriers; the cluster meets after making the barriers.
    assert _count(ours[1], *marks) == _count(theirs[1], *marks) == (1, 1, 1)
    # Made to complete a phase after 4 arrivals: 2 warpgroups in each of the 2 blocks.
    init = r"nvvm\.mbarrier\.init %\w+, %c4_i32|mbarrier\.init\.shared::cta\.b64 .* %\w+, %c4_i32,"
    assert len(re.findall(init, str(ours[1]))) == len(re.findall(init, str(theirs[1]))) == 1


def test_the_interpreter_runs_a_cluster_meeting() -> None:
    """Every warpgroup of both blocks gets past the meeting; with one arrival more needed
    than the blocks make, the interpreter reports the hang."""
    with force_interpret_mode():
        jax.block_until_ready(cluster_meeting(OURS)(jnp.zeros((8,), F32)))

    def body(x_ref: Any, o_ref: Any, bar: Any) -> None:
        plgpu.barrier_arrive(bar.at[0])
        plgpu.barrier_wait(bar.at[0])

    stuck = plgpu.kernel(body, out_type=S((8,), F32), grid=(1,), grid_names=("i",),
                         cluster=(2,), cluster_names=("x",), num_threads=2, thread_name="wg",
                         scratch_types=[plgpu.ClusterBarrier(collective_axes=("x",),
                                                              num_arrivals=3)])
    with pytest.raises(pl.PallasError, match="deadlock"), force_interpret_mode():
        jax.block_until_ready(stuck(jnp.zeros((8,), F32)))


def hand_off(x: jax.Array) -> jax.Array:
    """The second block of the cluster doubles ``x`` into the top half of the output, then
    both arrive on a ClusterBarrier; the first waits for that phase before it reads the top
    half back and writes it plus one into the bottom half."""
    def body(x_ref: Any, o_ref: Any, buf: Any, bar: Any, done: Any) -> None:
        c = lax.axis_index("x")
        top, bottom = o_ref.at[pl.ds(0, ROWS)], o_ref.at[pl.ds(ROWS, ROWS)]

        def through_smem(src: Any, dst: Any, f: Any) -> None:
            plgpu.copy_gmem_to_smem(src, buf, bar.at[0])
            plgpu.barrier_wait(bar.at[0])
            buf[...] = f(buf[...])
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(buf, dst)
            plgpu.wait_smem_to_gmem(0)

        @pl.when(c == 1)
        def _() -> None:
            through_smem(x_ref, top, lambda v: v * 2)

        plgpu.barrier_arrive(done.at[0])
        plgpu.barrier_wait(done.at[0])

        @pl.when(c == 0)
        def _() -> None:
            through_smem(top, bottom, lambda v: v + 1)

    return plgpu.kernel(body, out_type=S((2 * ROWS, 64), F32), grid=(1,), grid_names=("i",),
                        cluster=(2,), cluster_names=("x",),
                        scratch_types=[plgpu.SMEM((ROWS, 64), F32), plgpu.Barrier(),
                                        plgpu.ClusterBarrier(collective_axes=("x",))])(x)


def test_the_interpreter_runs_a_cluster_barrier_hand_off() -> None:
    x = jax.random.normal(jax.random.key(5), (ROWS, 64), F32)
    with force_interpret_mode():
        got = hand_off(x)
    np.testing.assert_array_equal(got, jnp.concatenate([2 * x, 2 * x + 1]))


# --- a partitioned copy: each block receives its half, the first block tracks both ----------


def partitioned(which: Any, dim: int) -> Any:
    gpu, pl_ = which
    shape = (2 * ROWS, 64) if dim == 0 else (ROWS, 128)

    def body(x_ref: Any, o_ref: Any, buf: Any, bar: Any) -> None:
        gpu.copy_gmem_to_smem(x_ref, buf, bar.at[0], collective_axes="x",
                              leader_tracked=gpu.CopyPartition.PARTITIONED(dim))

        @pl_.when(lax.axis_index("x") == 0)
        def _():
            gpu.barrier_wait(bar.at[0])

    return gpu.kernel(body, out_type=S((8,), F32), grid=(1,), grid_names=("i",),
                      cluster=(2,), cluster_names=("x",),
                      scratch_types=[gpu.SMEM((ROWS, 64), F16),
                                     gpu.Barrier(num_barriers=1)]), shape


@pytest.mark.parametrize("dim", [0, 1])
def test_a_partitioned_copy_lowers_like_jax(dim: int) -> None:
    shape = partitioned(OURS, dim)[1]
    ours, theirs = _kernels(lambda w: partitioned(w, dim)[0], S(shape, F16), blackwell=True)
    launch = _same_launch(ours, theirs)
    assert launch["arch"] == (10, 0)  # cta_group::2 is Blackwell's
    marks = (r"global\.tile\.mbarrier::complete_tx::bytes\.cta_group::2", MAPA)
    assert _count(ours[1], *marks) == _count(theirs[1], *marks) == (1, 1)


def copied_back(x: jax.Array, leader_tracked: Any) -> jax.Array:
    """Each block of the cluster receives its part of ``x`` (a leader-tracked copy); the
    first block waits for the whole transfer and tells the second through a ClusterBarrier;
    each then writes what it received into its part of the output (REPLICATED: its copy)."""
    dim = getattr(leader_tracked, "axis", 0)
    part = list(x.shape)
    if dim is not None and isinstance(leader_tracked, plgpu.CopyPartition.PARTITIONED):
        part[dim] //= 2
    replicated = not isinstance(leader_tracked, plgpu.CopyPartition.PARTITIONED)
    out_shape = (2 * x.shape[0], x.shape[1]) if replicated else x.shape

    def body(x_ref: Any, o_ref: Any, buf: Any, bar: Any, done: Any) -> None:
        c = lax.axis_index("x")
        plgpu.copy_gmem_to_smem(x_ref, buf, bar.at[0], collective_axes="x",
                                leader_tracked=leader_tracked)

        @pl.when(c == 0)
        def _() -> None:
            plgpu.barrier_wait(bar.at[0])

        plgpu.barrier_arrive(done.at[0])
        plgpu.barrier_wait(done.at[0])
        if replicated or dim == 0:
            dst = o_ref.at[pl.ds(c * part[0], part[0])]
        else:
            dst = o_ref.at[:, pl.ds(c * part[1], part[1])]
        plgpu.copy_smem_to_gmem(buf, dst)
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(body, out_type=S(out_shape, x.dtype), grid=(1,), grid_names=("i",),
                        cluster=(2,), cluster_names=("x",),
                        scratch_types=[plgpu.SMEM(tuple(part), x.dtype), plgpu.Barrier(),
                                        plgpu.ClusterBarrier(collective_axes=("x",))])(x)


@pytest.mark.parametrize("how", ["dim0", "dim1", "replicated"])
def test_the_interpreter_runs_a_leader_tracked_copy(how: str) -> None:
    shape = (ROWS, 128) if how == "dim1" else (2 * ROWS, 64)
    x = jax.random.normal(jax.random.key(7), shape, F32).astype(F16)
    leader = {"dim0": plgpu.CopyPartition.PARTITIONED(0),
              "dim1": plgpu.CopyPartition.PARTITIONED(1),
              "replicated": plgpu.CopyPartition.REPLICATED}[how]
    with force_interpret_mode():
        got = copied_back(x, leader)
    np.testing.assert_array_equal(got, jnp.concatenate([x, x]) if how == "replicated" else x)


def test_a_leader_tracked_copy_completes_once_every_block_issued_it() -> None:
    """The first block's barrier completes a phase only once both blocks issued their
    copies: a second block that copies only after the first waited hangs the kernel."""
    def body(x_ref: Any, o_ref: Any, buf: Any, bar: Any, done: Any) -> None:
        c = lax.axis_index("x")

        @pl.when(c == 1)
        def _() -> None:
            plgpu.barrier_wait(done.at[0])  # never completes: the first block waits first

        plgpu.copy_gmem_to_smem(x_ref, buf, bar.at[0], collective_axes="x",
                                leader_tracked=plgpu.CopyPartition.PARTITIONED(0))

        @pl.when(c == 0)
        def _() -> None:
            plgpu.barrier_wait(bar.at[0])
            plgpu.barrier_arrive(done.at[0])  # twice: the phase both blocks' arrivals make
            plgpu.barrier_arrive(done.at[0])

    run = plgpu.kernel(body, out_type=S((8,), F32), grid=(1,), grid_names=("i",),
                       cluster=(2,), cluster_names=("x",),
                       scratch_types=[plgpu.SMEM((ROWS, 64), F16), plgpu.Barrier(),
                                       plgpu.ClusterBarrier(collective_axes=("x",))])
    with pytest.raises(pl.PallasError, match="deadlock"), force_interpret_mode():
        jax.block_until_ready(run(jnp.zeros((2 * ROWS, 64), F16)))


def test_partitioned_copy_errors() -> None:
    x = jnp.zeros((2 * ROWS, 64), F16)

    def body(x_ref: Any, o_ref: Any, buf: Any, bar: Any, *, kw: dict[str, Any]) -> None:
        plgpu.copy_gmem_to_smem(x_ref, buf, bar.at[0], **kw)

    def run(kw: dict[str, Any], backend: str = "interpret", **launch: Any) -> Any:
        return plgpu.kernel(functools.partial(body, kw=kw), out_shape=S((8,), F32),
                            scratch_types=[plgpu.SMEM((ROWS, 64), F16), plgpu.Barrier()],
                            backend=backend, **launch)(x)

    part = plgpu.CopyPartition.PARTITIONED(0)
    with pytest.raises(pl.PallasError, match="name the cluster axis too"):
        run(dict(leader_tracked=part))
    with pytest.raises(pl.PallasError, match="split along dimension 1"):
        run(dict(collective_axes="x", leader_tracked=plgpu.CopyPartition.PARTITIONED(1)))
    with pytest.raises(pl.PallasError, match="say the same thing twice"):
        run(dict(collective_axes="x", leader_tracked=part, partitioned_axis=0))
    cluster = dict(backend="mosaic_gpu", grid=(1,), grid_names=("i",), cluster=(2,),
                   cluster_names=("x",))

    def stage(kw: dict[str, Any]) -> str:
        with targets.assume(targets.BLACKWELL):
            (st,) = pl.stages(lambda x: run(kw, **cluster), x, backend="mosaic_gpu")
        return str(st["mosaic_gpu"])

    with pytest.raises(pl.UnsupportedError, match=r"cluster axis 'y'.*cluster axes are \('x',\)"):
        stage(dict(collective_axes="y", leader_tracked=part))
    # JAX's older spelling means the same copy.
    assert "cta_group::2" in stage(dict(collective_axes="x", partitioned_axis=0))


# --- claiming work for a cluster --------------------------------------------------------------


def claiming(which: Any) -> Any:
    gpu, _ = which

    def body(x_ref: Any, o_ref: Any) -> None:
        @gpu.dynamic_scheduling_loop(grid_names=("i",), thread_axis="wg", cluster_axes=("x",))
        def _(info: Any) -> None:
            pass

    return gpu.kernel(body, out_type=S((8,), F32), grid=(4,), grid_names=("i",),
                      cluster=(2,), cluster_names=("x",), num_threads=2, thread_name="wg")


def test_claiming_work_for_a_cluster_lowers_like_jax() -> None:
    ours, theirs = _kernels(claiming, S((8,), F32), blackwell=True)
    _same_launch(ours, theirs)
    marks = (re.escape("clusterlaunchcontrol.try_cancel.async.shared::cta.mbarrier::"
                       "complete_tx::bytes.multicast::cluster::all"),
             r"mbarrier\.arrive\.shared::cluster\.b64", CLUSTER_WAIT)
    assert _count(ours[1], *marks) == _count(theirs[1], *marks) == (1, 1, 1)


def test_the_interpreter_runs_claiming_work_for_a_cluster() -> None:
    """The first cluster claims every grid point and both its blocks run each of them (the
    answers' ClusterBarrier holds each slot until every warpgroup of both blocks read it):
    block c of the cluster writes grid point i into row (i, c)."""
    def body(x_ref: Any, o_ref: Any) -> None:
        c, wg = lax.axis_index("x"), lax.axis_index("wg")

        @plgpu.dynamic_scheduling_loop(grid_names=("i",), thread_axis="wg", cluster_axes=("x",))
        def _(info: Any) -> None:
            (i,) = info.index

            @pl.when(wg == 0)
            def _() -> None:
                def write(buf: Any) -> None:
                    buf[...] = jnp.full((128,), i + 1, F32)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(buf, o_ref.at[i, c])
                    plgpu.wait_smem_to_gmem(0)

                pl.run_scoped(write, plgpu.SMEM((128,), F32))

    run = plgpu.kernel(body, out_type=S((4, 2, 128), F32), grid=(4,), grid_names=("i",),
                       cluster=(2,), cluster_names=("x",), num_threads=2, thread_name="wg")
    with force_interpret_mode():
        got = run(jnp.zeros((8,), F32))
    np.testing.assert_array_equal(got, jnp.broadcast_to(
        jnp.arange(1, 5, dtype=F32)[:, None, None], (4, 2, 128)))


# --- collective TMEM and tcgen05 --------------------------------------------------------------


def test_collective_tmem_and_tcgen05_checks() -> None:
    space = plgpu.TMEM((128, 256), F32, collective=True).memory_space
    assert space.collective and space != plgpu.TMEM and space.name == "TMEM"
    assert plgpu.TMEM((128, 128), F16, packed=True, collective=True).memory_space.packing == 2

    def body(x_ref: Any, o_ref: Any, acc: Any, s: Any, bar: Any) -> None:
        plgpu.tcgen05_mma(acc, s, s, collective_axis="x")

    def run(acc_cols: int, backend: str = "interpret") -> Any:
        return plgpu.kernel(body, out_type=S((8,), F32), backend=backend, grid=(1,),
                            grid_names=("i",), cluster=(2,), cluster_names=("x",),
                            scratch_types=[plgpu.TMEM((128, acc_cols), F32, collective=True),
                                            plgpu.SMEM((128, 128), F16),
                                            plgpu.Barrier(orders_tensor_core=True)])(
                                                jnp.zeros((8,), F32))

    with pytest.raises(pl.PallasError, match=r"acc \(M, 2 N\)"):
        run(128)
    for name in ("ClusterBarrier", "CopyPartition"):
        assert getattr(plgpu, name) is not None
    with pytest.raises(pl.PallasError, match="cluster axis names"):
        plgpu.ClusterBarrier(collective_axes=())
    with pytest.raises(pl.PallasError, match="num_arrivals=0"):
        plgpu.ClusterBarrier(collective_axes=("x",), num_arrivals=0)


def collective_matmul(a: jax.Array, b: jax.Array, commit: bool) -> jax.Array:
    """``a @ b`` by the 2 blocks of a cluster: each receives its half of the rows of ``a`` and
    of the columns of ``b`` (partitioned copies tracked by the first block's barrier), the
    first issues one collective matmul, and each block writes its half of the rows of the
    product; the matmul's barrier (or a collective commit) completes in both blocks."""
    (m, k), (_, n) = a.shape, b.shape
    half_m, half_n = m // 2, n // 2

    def body(a_ref: Any, b_ref: Any, o_ref: Any, a_smem: Any, b_smem: Any, acc: Any,
             out_smem: Any, loaded: Any, done: Any) -> None:
        c = lax.axis_index("x")
        plgpu.copy_gmem_to_smem(a_ref, a_smem, loaded.at[0], collective_axes="x",
                                leader_tracked=plgpu.CopyPartition.PARTITIONED(0))
        plgpu.copy_gmem_to_smem(b_ref, b_smem, loaded.at[0], collective_axes="x",
                                leader_tracked=plgpu.CopyPartition.PARTITIONED(1))

        @pl.when(c == 0)
        def _() -> None:
            plgpu.barrier_wait(loaded.at[0])
            if commit:
                plgpu.tcgen05_mma(acc, a_smem, b_smem, accumulate=False, collective_axis="x")
                plgpu.tcgen05_commit_arrive(done.at[0], collective_axis="x")
            else:
                plgpu.tcgen05_mma(acc, a_smem, b_smem, done.at[0], accumulate=False,
                                  collective_axis="x")

        plgpu.barrier_wait(done.at[0])
        out_smem[...] = plgpu.async_load_tmem(acc)
        plgpu.wait_load_tmem()
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, o_ref.at[pl.ds(c * half_m, half_m)])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body, out_shape=S((m, n), F32), grid=(1,), grid_names=("i",), cluster=(2,),
        cluster_names=("x",),
        scratch_types=[plgpu.SMEM((half_m, k), a.dtype), plgpu.SMEM((k, half_n), b.dtype),
                        plgpu.TMEM((half_m, n), F32, collective=True),
                        plgpu.SMEM((half_m, n), F32), plgpu.Barrier(num_arrivals=2),
                        plgpu.Barrier(orders_tensor_core=True)])(a, b)


@pytest.mark.parametrize("commit", [False, True])
def test_the_interpreter_runs_a_collective_tcgen05_mma(commit: bool) -> None:
    keys = jax.random.split(jax.random.key(11))
    a = jax.random.normal(keys[0], (256, 128), F32).astype(F16)
    b = jax.random.normal(keys[1], (128, 256), F32).astype(F16)
    with force_interpret_mode():
        got = collective_matmul(a, b, commit)
    np.testing.assert_allclose(got, jnp.dot(a.astype(F32), b.astype(F32)), rtol=2e-2,
                               atol=5e-2)
