"""JAX's multi-GPU Mosaic GPU kernels (``all_gather_mgpu``, ``reduce_scatter_mgpu``,
``collective_matmul_mgpu``), ported (``porting.ported``: only the Pallas imports rewritten),
under ``jax.shard_map`` on the fake CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_
count=8``).

* Lowering for ``cuda``: the port and JAX's own module are lowered for the same call, and
  ``pallas_mosaic_gpu.inspection`` compares what the runtime acts on (launch, shared memory,
  the custom call's config: collective metadata, replica ids, multicast operands, operand and
  result types, the aliased semaphore operand) and the module's multi-GPU instructions
  (multimem stores and reductions, the multicast semaphore signal, the semaphore wait),
  with the differences pinned exactly (``DIFFERENCES``).
* Meaning: the ports run in this project's interpreter on every device of the mesh, against
  ``lax.all_gather(tiled=True)`` and ``lax.psum_scatter(tiled=True)`` on random inputs.
"""

from __future__ import annotations

import collections
import functools
import importlib
import re
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl
from pallas_core.call import force_interpret_mode
from pallas_core.errors import reraising_reports
from pallas_core.mlir_lowering import walk
from tests.jax_library import porting

plgpu = pytest.importorskip("pallas_mosaic_gpu")  # the mosaic_gpu environment runs this file
from jaxlib.mlir import ir  # noqa: E402
from pallas_mosaic_gpu import inspection  # noqa: E402

P = jax.sharding.PartitionSpec
BF16, F32 = jnp.bfloat16, jnp.float32
NUM_BLOCKS = 4  # the kernels default to the device's SM count, which a CPU device lacks

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake CPU) devices: "
                                "XLA_FLAGS=--xla_force_host_platform_device_count=8")


def _library(name: str, ours: bool) -> types.ModuleType:
    if ours:
        module = porting.ported(f"gpu.{name}")
        assert module.plgpu is plgpu and module.pl is pl, "the port still runs JAX's Pallas"
        return module
    return importlib.import_module(f"jax.experimental.pallas.ops.gpu.{name}")


# (module, function, keyword arguments, global shape, dtype, sharded dimension, devices)
CASES: dict[str, tuple[str, str, dict[str, Any], tuple[int, ...], Any, int, int]] = {
    "all_gather_bf16": ("all_gather_mgpu", "all_gather", {}, (512, 256), BF16, 0, 4),
    "all_gather_f32_dim1": ("all_gather_mgpu", "all_gather", {"gather_dimension": 1},
                            (64, 1024), F32, 1, 8),
    "reduce_scatter_bf16": ("reduce_scatter_mgpu", "reduce_scatter", {}, (512, 256), BF16, 0,
                            4),
    "reduce_scatter_bf16_max_dim1": ("reduce_scatter_mgpu", "reduce_scatter",
                                     {"scatter_dimension": 1, "reduction": "max"},
                                     (64, 2048), BF16, 1, 8),
    "reduce_scatter_f32_dim1": ("reduce_scatter_mgpu", "reduce_scatter",
                                {"scatter_dimension": 1}, (32, 4096), F32, 1, 8),
    "reduce_scatter_i32_xor": ("reduce_scatter_mgpu", "reduce_scatter", {"reduction": "xor"},
                               (1024, 128), jnp.int32, 0, 4),
}


def _sharded(case: str, ours: bool) -> tuple[Any, Any]:
    """The case's kernel under ``shard_map`` (jitted), and its mesh."""
    module, fn, kwargs, _, _, dim, n = CASES[case]
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
    spec = P(*(["x" if d == dim else None for d in range(2)]))
    kernel = functools.partial(getattr(_library(module, ours), fn), axis_name="x",
                               num_blocks=NUM_BLOCKS, **kwargs)
    return jax.jit(jax.shard_map(kernel, mesh=mesh, in_specs=spec, out_specs=spec,
                                 check_vma=False)), (mesh, spec)


def _lower(case: str, ours: bool) -> tuple[dict[str, Any], Any]:
    fn, (mesh, spec) = _sharded(case, ours)
    _, _, _, shape, dtype, _, _ = CASES[case]
    arg = jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, spec))
    text = fn.trace(arg).lower(lowering_platforms=("cuda",)).as_text()
    (found,) = inspection.kernels(text)  # hash checked, module parsed back and verified
    return found


def _instructions(module: Any) -> collections.Counter[str]:
    """The PTX the module holds inline (multimem, semaphore atomics, barriers), counted."""
    found: collections.Counter[str] = collections.Counter()
    for op in walk(module.operation):
        if op.operation.name == "llvm.inline_asm":
            asm = ir.StringAttr(op.operation.attributes["asm_string"]).value
            found[" ".join(asm.split())] += 1
    return found


def _multimem_key(ours_or_theirs: Any) -> str:
    """The backend config's per-parameter multimem flags, as the installed Mosaic GPU library
    names them: ``symmetric_memory_parameters`` (JAX 0.12) or ``multimem_parameters`` (0.10)."""
    config = ours_or_theirs[0]
    return "symmetric_memory_parameters" if "symmetric_memory_parameters" in config \
        else "multimem_parameters"


def _multicast(ours_or_theirs: Any) -> bytes:
    return ours_or_theirs[0][_multimem_key(ours_or_theirs)]  # type: ignore[no-any-return]


# The one difference in the custom call: which of the call's parameters (operands, then
# results) are multicast buffers. The semaphores are one int32 array, an operand aliased to a
# result (zeroed before the call). This backend passes it as Mosaic GPU's in-out operand, so
# the module addresses it (and marks it multicast) as parameter 1, the operand; JAX's
# lowering addresses the same buffer as the result it is aliased to, the last parameter. The
# data are parameter 2 (all_gather's output) or 0 (reduce_scatter's input) in both.
DIFFERENCES = {
    "all_gather": (b"0,1,1,0", b"0,0,1,1"),
    "reduce_scatter": (b"1,1,0,0", b"1,0,0,1"),
}

# Warpgroup barriers (bar.sync): JAX's lowering puts one before and one after every store of
# registers to memory (its automatic barriers); this backend only where the warpgroup's
# threads must see each other's memory: after a multimem store, and before a semaphore
# signal (so the warpgroup's writes precede it), as JAX does too, and at the semaphore wait.
# Between a read and a store of the same thread's elements no barrier is needed: all_gather
# lacks the one before its multimem stores, reduce_scatter those around its store of the
# reduced tile.
BARRIERS = {"all_gather": (3, 4), "reduce_scatter": (2, 4)}


@pytest.mark.parametrize("case", list(CASES))
def test_jax_lowers_its_multidevice_kernel(case: str) -> None:
    """What JAX's own lowering of the kernel asks of the runtime: XLA's collective metadata
    (device ids, peer addresses), the replica ids of the mesh, multicast operands."""
    config, module = _lower(case, ours=False)
    n = CASES[case][6]
    assert config["uses_xla_collective_metadata"] is True
    assert config["xla_replica_ids"] == ",".join(map(str, range(n))).encode()
    assert inspection.launch(module) == {"grid": (NUM_BLOCKS, 1, 1), "cluster": (1, 1, 1),
                                         "block": (128, 1, 1), "smem_bytes": 0,
                                         "arch": (9, 0)}
    assert config["call"]["operand_types"][1] == f"tensor<{NUM_BLOCKS}xi32>"  # semaphores


@pytest.mark.parametrize("case", list(CASES))
def test_port_lowers_like_jax(case: str) -> None:
    ours, theirs = _lower(case, ours=True), _lower(case, ours=False)
    kind = CASES[case][1]
    inspection.assert_same_kernel(ours, theirs, {_multimem_key(theirs): DIFFERENCES[kind]})
    a, b = _instructions(ours[1]), _instructions(theirs[1])
    barrier = "bar.sync $0, 128;"
    assert (a.pop(barrier), b.pop(barrier)) == BARRIERS[kind]
    assert a == b  # multimem st / ld_reduce, the multicast signal, the wait's load and fence
    assert any("multimem.st" in k or "multimem.ld_reduce" in k for k in a)
    assert any("multimem.red.release.sys.global.add.u32" in k for k in a)
    # The module records that it reads the collective metadata and uses multicast memory.
    attrs = ours[1].operation.attributes
    assert "mosaic_gpu.collective_metadata_used" in attrs and "mosaic_gpu.multimem_used" in attrs


def _expected(case: str) -> Any:
    _, fn, kwargs, _, dtype, dim, _ = CASES[case]
    if fn == "all_gather":
        return lambda v: lax.all_gather(v, "x", axis=dim, tiled=True)
    op = kwargs.get("reduction", "add")
    if op == "add":
        return lambda v: lax.psum_scatter(v.astype(F32), "x", scatter_dimension=dim,
                                          tiled=True).astype(dtype)
    combine = {"max": jnp.maximum, "xor": jnp.bitwise_xor}[op]

    def reduce_scatter(v: Any) -> Any:  # this device's share of the reduction over devices
        total = functools.reduce(combine, list(lax.all_gather(v, "x")))
        size = v.shape[dim] // lax.axis_size("x")
        return lax.dynamic_slice_in_dim(total, lax.axis_index("x") * size, size, dim)
    return reduce_scatter


@pytest.mark.parametrize("case", list(CASES))
def test_port_runs_in_the_interpreter(case: str) -> None:
    """The port's meaning: run by the interpreter (checked mode) on every device of the mesh
    (the kernels' multimem stores and reductions and multicast signals are collectives of the
    devices there), against JAX's collectives on random inputs."""
    _, _, _, shape, dtype, _, _ = CASES[case]
    fn, (mesh, spec) = _sharded(case, ours=True)
    key = jax.random.key(list(CASES).index(case))
    if jnp.issubdtype(dtype, jnp.integer):
        x = jax.random.randint(key, shape, -2**20, 2**20, dtype)
    else:
        x = jax.random.normal(key, shape, F32).astype(dtype)
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
    import pallas_interpret  # checked mode: each semaphore_wait must be met by the signals

    with force_interpret_mode(pallas_interpret.InterpretParams(checked=True)), \
            reraising_reports():
        got = fn(x)
    want = jax.jit(jax.shard_map(_expected(case), mesh=mesh, in_specs=spec, out_specs=spec,
                                 check_vma=False))(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    if jnp.issubdtype(dtype, jnp.integer) or CASES[case][1] == "all_gather":
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=2e-2, atol=2e-2)


# --- collective_matmul_mgpu: all-gather of the LHS fused into a warp-specialised matmul --------

CM_DEVICES, CM_SMS = 8, 4  # the kernel asks jax.devices()[0].core_count for its SM count


class _JaxWithSMs(types.ModuleType):
    """``jax`` as collective_matmul sees it: ``jax.devices()`` answers with an SM count."""

    def __getattr__(self, name: str) -> Any:
        return getattr(jax, name)

    def devices(self, *_: Any) -> list[Any]:
        return [types.SimpleNamespace(core_count=CM_SMS)]


def _collective_matmul(ours: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, Any]:
    """The kernel under ``shard_map`` over 8 devices (the LHS sharded along M, the RHS along
    N; each device computes its N columns for all of M), its mesh and specs."""
    lib = _library("collective_matmul_mgpu", ours)
    monkeypatch.setattr(lib, "jax", _JaxWithSMs("jax"))
    hm = lib.hopper_matmul_mgpu
    config = hm.TuningConfig(tile_m=64, tile_n=128, tile_k=64, max_concurrent_steps=2)
    mesh = jax.make_mesh((CM_DEVICES,), ("x",))
    specs = (P("x", None), P(None, "x"))
    fn = jax.shard_map(lambda a, b: lib.all_gather_lhs_matmul(a, b, "x", config=config,
                                                             dtype=jnp.float16),
                       mesh=mesh, in_specs=specs, out_specs=P(None, "x"), check_vma=False)
    return jax.jit(fn), mesh, specs


CM_SHAPES = ((CM_DEVICES * 128, 256), (256, CM_DEVICES * 256))


def _lower_cm(ours: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Any], Any]:
    fn, mesh, specs = _collective_matmul(ours, monkeypatch)
    args = [jax.ShapeDtypeStruct(s, jnp.float16, sharding=jax.sharding.NamedSharding(mesh, p))
            for s, p in zip(CM_SHAPES, specs)]
    (found,) = inspection.kernels(fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text())
    return found


# Shared memory: the kernel runs hopper_matmul's warp-specialised pipeline once per device
# step, the first step peeled out of the loop over the others: two pl.run_scoped regions
# (A and B slots, the epilogue's buffer, barriers: 114720 bytes each). JAX reuses one region
# for both, as the first ends before the second starts; here every pl.run_scoped has a
# region of its own (as pinned for ragged_dot in test_mgpu_library_agreement.py).
CM_DIFFERENCES = {"smem_bytes": (2 * 114720, 114720)}
# Warpgroup barriers: JAX's automatic ones around every store of registers to memory (see
# BARRIERS). Bulk-copy groups: JAX's warp-specialised pipeline closes a group at the end of
# every compute step (commit_smem_to_gmem_group), an empty one when the step stored nothing;
# this backend closes only groups that hold copies, so the sends' wait_smem_to_gmem(1) sees
# one group fewer; in both it returns once the previous step's send is done. mbarrier
# initialisation: each of the two pl.run_scoped regions (see CM_DIFFERENCES) initialises its
# own 4 barriers here, where JAX's one reused region initialises them once. (mbarrier
# arrivals are the same 2: from one thread selected by a predicate here, inside a branch to
# one thread in JAX's lowering; the count drops the predicate.)
CM_INSTRUCTIONS = {"bar.sync $, 128;": (23, 41), "cp.async.bulk.commit_group;": (6, 8),
                   "mbarrier.init.shared::cta.b64 [$], $;": (8, 4)}


# The instructions this backend builds as NVVM ops and JAX's lowering writes as inline PTX
# (from JAX 0.11 on, in its warpgroup-semantics lowering of this kernel; JAX 0.10 builds them
# as NVVM ops too), each as the PTX it stands for: one count per instruction, whatever the
# spelling.
_NVVM_AS_PTX: dict[str, Callable[[Any], str]] = {
    "nvvm.setmaxregister": lambda op: "setmaxnreg.{}.sync.aligned.u32 {};".format(
        "inc" if "increase" in str(op.attributes["action"]) else "dec",
        ir.IntegerAttr(op.attributes["regCount"]).value),
    "nvvm.mbarrier.init": lambda op: "mbarrier.init.shared::cta.b64 [$], $;",
    "nvvm.mbarrier.init.shared": lambda op: "mbarrier.init.shared::cta.b64 [$], $;",
    "nvvm.mbarrier.arrive.expect_tx":
        lambda op: "mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [$], $;",
    "nvvm.wgmma.fence.aligned": lambda op: "wgmma.fence.sync.aligned;",
    "nvvm.wgmma.commit.group.sync.aligned": lambda op: "wgmma.commit_group.sync.aligned;",
    "nvvm.wgmma.wait.group.sync.aligned": lambda op: "wgmma.wait_group.sync.aligned {};".format(
        ir.IntegerAttr(op.attributes["group"]).value),
    "nvvm.cp.async.bulk.commit.group": lambda op: "cp.async.bulk.commit_group;",
}


def _cm_instructions(module: Any) -> collections.Counter[str]:
    """Inline PTX (its predicate guard and operand numbers dropped: ``@$2 mbarrier.arrive
    ... [$1]`` is ``mbarrier.arrive ... [$]``), the NVVM ops above as their PTX, and the
    other bulk-copy ops, counted."""
    found: collections.Counter[str] = collections.Counter()
    for k, n in _instructions(module).items():
        found[re.sub(r"\$\d+", "$", re.sub(r"^@\$\d+ ", "", k))] += n
    for op in walk(module.operation):
        name = op.operation.name
        if name in _NVVM_AS_PTX:
            found[_NVVM_AS_PTX[name](op.operation)] += 1
        elif name.startswith("nvvm.cp.async.bulk"):
            found[name] += 1
    return found


def test_collective_matmul_port_lowers_like_jax(monkeypatch: pytest.MonkeyPatch) -> None:
    """pl.get_global's semaphore (one for the whole launch: a (1,) int32 operand aliased to
    a result), plgpu.remote_ref's TMA stores into the next device's scratch (through XLA's
    collective metadata), pl.semaphore_signal(device_id=) and pl.semaphore_wait, inside
    hopper_matmul's warp-specialised pipeline: the same call, launch and instructions as
    JAX's lowering (each counted in whichever spelling, NVVM op or inline PTX, the installed
    JAX gives it), but for the pinned differences."""
    ours, theirs = _lower_cm(True, monkeypatch), _lower_cm(False, monkeypatch)
    inspection.assert_same_kernel(ours, theirs, CM_DIFFERENCES)
    assert ours[0]["uses_xla_collective_metadata"] is True
    assert ours[0]["call"]["operand_types"][2] == "tensor<1xi32>"  # the global semaphore
    a, b = _cm_instructions(ours[1]), _cm_instructions(theirs[1])
    for k, pinned in CM_INSTRUCTIONS.items():
        assert (a.pop(k), b.pop(k)) == pinned, k
    # TMA loads and stores (6, the remote sends among them), wgmma fences and waits, register
    # hand-over, mbarrier arrivals (with and without a byte count), signals, waits; from JAX
    # 0.11 on, the descriptors prefetched (the remote send's among them: its peer is one
    # value at both sends).
    assert a == b
    assert a["red.release.sys.global.add.u32 [$], $;"] == 2  # signal to the next device
    assert "mosaic_gpu.collective_metadata_used" in ours[1].operation.attributes


def test_collective_matmul_port_is_refused_by_the_interpreter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its blocks share one semaphore (pl.get_global) and wait for every block of the
    sending device; the interpreter runs blocks one after another, so it refuses the kernel
    by name rather than run it wrongly."""
    fn, mesh, specs = _collective_matmul(True, monkeypatch)
    args = [jax.device_put(jnp.ones(s, jnp.float16), jax.sharding.NamedSharding(mesh, p))
            for s, p in zip(CM_SHAPES, specs)]
    with force_interpret_mode(), pytest.raises(pl.UnsupportedError, match=r"pl\.get_global"):
        fn(*args)


# --- refusals ----------------------------------------------------------------------------------


def _one_block(body: Any, backend: str, out: Any = None, **kw: Any) -> Any:
    return plgpu.kernel(body, out_type=out or jax.ShapeDtypeStruct((128,), F32),
                        backend=backend, **kw)


def test_multimem_outside_shard_map_is_refused() -> None:
    def body(x_ref, o_ref):
        plgpu.multimem_store(x_ref[...], o_ref, "x")

    x = jnp.zeros((128,), F32)
    with pytest.raises(pl.UnsupportedError, match=r"outside jax\.shard_map"):
        jax.jit(_one_block(body, "mosaic_gpu")).trace(x).lower(lowering_platforms=("cuda",))
    with pytest.raises(pl.PallasError, match="does not run under shard_map"):
        _one_block(body, "interpret")(x)


def test_multicast_over_part_of_the_mesh_is_refused() -> None:
    mesh = jax.make_mesh((2, 4), ("a", "b"))

    def body(x_ref, o_ref):
        plgpu.multimem_store(x_ref[...], o_ref, "b")

    fn = jax.jit(jax.shard_map(_one_block(body, "mosaic_gpu"), mesh=mesh, in_specs=P("b"),
                               out_specs=P("b"), check_vma=False))
    arg = jax.ShapeDtypeStruct((512,), F32, sharding=jax.sharding.NamedSharding(mesh, P("b")))
    with pytest.raises(pl.UnsupportedError, match=r"collective_axes=\('b',\)"):
        fn.trace(arg).lower(lowering_platforms=("cuda",))


def test_get_global_is_refused_where_unsupported() -> None:
    """pl.get_global is the core's; backends that do not lower it refuse it by name."""
    def body(o_ref):
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
        pl.semaphore_signal(sem)
        o_ref[...] = jnp.zeros_like(o_ref)

    with pytest.raises(pl.UnsupportedError, match=r"pl\.get_global"):
        _one_block(body, "interpret")()
    with pytest.raises(pl.PallasError, match="get_global"):
        pl.get_global(plgpu.SemaphoreType.REGULAR)  # outside a kernel
    with pytest.raises(pl.UnsupportedError, match=r"SemaphoreType\.BARRIER"):
        plgpu.SemaphoreType.BARRIER(())


def test_semaphores_are_per_block_and_multicast_signals_count_devices() -> None:
    """In the interpreter each block has its own semaphores, zero when it starts (as on the
    GPU), a multicast signal adds one per device of the mesh, and in checked mode a wait for
    more than every device sends is reported as a deadlock."""
    import pallas_interpret

    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])

    def run(wait_for: int) -> Any:
        def body(x_ref, o_ref, sem):
            plgpu.semaphore_signal_multicast(sem, collective_axes="x")
            pl.semaphore_wait(sem, wait_for, decrement=False)
            o_ref[pl.ds(lax.axis_index("b") * 128, 128)] = (
                x_ref[pl.ds(lax.axis_index("b") * 128, 128)]
                + pl.semaphore_read(sem).astype(F32))

        k = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((256,), F32), grid=(2,),
                         grid_names=("b",), scratch_types=[plgpu.SemaphoreType.REGULAR])
        fn = jax.jit(jax.shard_map(k, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                   check_vma=False))
        x = jax.device_put(jnp.arange(1024, dtype=F32), jax.sharding.NamedSharding(mesh, P("x")))
        # Checked mode reports from a host callback: reraising_reports raises the report in
        # place of the runtime's error and settles JAX's failed tokens, as pl.kernel's own
        # function does when called outside jit.
        with force_interpret_mode(pallas_interpret.InterpretParams(checked=True)), \
                reraising_reports():
            return np.asarray(fn(x))

    np.testing.assert_array_equal(run(4), np.arange(1024) + 4)  # 4 devices, each block's own
    with pytest.raises(pl.PallasError, match=r"deadlock: pl\.semaphore_wait waits for 5"):
        run(5)


@pytest.mark.parametrize("how", ["read", "copy"])
def test_remote_refs_are_refused_by_the_interpreter(how: str) -> None:
    """Another device's memory through plgpu.remote_ref lowers for cuda; the interpreter
    refuses reads and copies through it by name."""
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])

    def body(x_ref, o_ref, buf, bar):
        peer = plgpu.remote_ref(x_ref, lax.rem(lax.axis_index("x") + 1, 4))
        if how == "read":
            o_ref[...] = peer[...]
        else:
            plgpu.copy_gmem_to_smem(peer, buf, bar)
            plgpu.barrier_wait(bar)
            o_ref[...] = buf[...]

    def run(backend: str) -> Any:
        k = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), F32), backend=backend,
                         scratch_types=[plgpu.SMEM((128,), F32), plgpu.Barrier()])
        return jax.jit(jax.shard_map(k, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                     check_vma=False))

    arg = jax.ShapeDtypeStruct((512,), F32, sharding=jax.sharding.NamedSharding(mesh, P("x")))
    (config, _), = inspection.kernels(run("mosaic_gpu").trace(arg).lower(
        lowering_platforms=("cuda",)).as_text())
    assert config["uses_xla_collective_metadata"] is True
    x = jax.device_put(jnp.zeros((512,), F32), jax.sharding.NamedSharding(mesh, P("x")))
    with pytest.raises(pl.UnsupportedError, match=r"remote_ref"):
        run("interpret")(x)
