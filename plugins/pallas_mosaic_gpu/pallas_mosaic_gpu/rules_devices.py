"""Lowering rules of the Mosaic GPU backend for kernels whose devices talk to each other
(registered in :data:`pallas_mosaic_gpu.registry.RULES`): GPU semaphores (``pl.semaphore_signal``
to this or another device, ``pl.semaphore_wait``, ``pl.semaphore_read``,
``plgpu.semaphore_signal_multicast``) and
NVLink multicast memory (``plgpu.multimem_store``, ``plgpu.multimem_load_reduce``).

Remote and multicast addresses come from Mosaic GPU's launch context (``to_remote``,
``to_remote_multicast``), which records in the module that the kernel reads XLA's collective
metadata and which of its operands are multicast; JAX's runtime then passes the metadata and
maps those buffers on every device. A semaphore is an int32 in global memory, signalled by one
thread of the warpgroup after the warpgroup's earlier writes (a warpgroup barrier), as JAX's
lowering does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.experimental.mosaic import gpu as mgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm

from pallas_core import backend as plb
from pallas_mosaic_gpu import multidevice as md
from pallas_mosaic_gpu import values
from pallas_mosaic_gpu.registry import rule
from pallas_mosaic_gpu.values import FA, GPULowering, Ref, _view, i32, signed

_WG = mgpu.ThreadSubset.WARPGROUP


def _sem_view(state: GPULowering, eqn: Any, args: Any, fn: str) -> tuple[Ref, list[Any]]:
    tree = eqn.params["tree"]
    ref, flat = args[0], list(args[1:1 + tree.num_leaves])
    view = _view(state, ref, jax.tree_util.tree_unflatten(tree, flat))
    if view.kind != "gmem" or view.shape != ():
        raise state.fail(f"{fn} of a {view.kind} Ref {list(view.shape)} (GPU semaphores are "
                         "plgpu.SemaphoreType.REGULAR scratch, one at a time)")
    return view, list(args[1 + tree.num_leaves:])


def _int(state: GPULowering, v: Any) -> Any:
    v = state.value(v)
    return i32(int(v)) if isinstance(v, (int, np.integer)) else v


def _check_axes(state: GPULowering, axes: tuple[Any, ...], fn: str) -> None:
    names = {n for n, _ in state.devices}
    if not names:
        raise state.fail(f"{fn} outside jax.shard_map (there are no other devices)")
    if set(axes) != names:
        raise state.fail(f"{fn}(collective_axes={axes}) naming other than every axis of the "
                         f"shard_map mesh {tuple(n for n, _ in state.devices)}")


def device_index(state: GPULowering, name: Any) -> Any:
    """``lax.axis_index(name)`` of a ``shard_map`` axis: this device's coordinate, from the
    device id XLA's collective metadata holds."""
    names = [n for n, _ in state.devices]
    sizes = [s for _, s in state.devices]
    k = names.index(name)
    minor = int(np.prod(sizes[k + 1:], dtype=np.int64))
    return arith.remsi(arith.divsi(state.launch.device_id(), i32(minor)), i32(sizes[k]))


def _logical_device(state: GPULowering, ids: list[Any], mesh_coordinates: bool) -> Any:
    if not mesh_coordinates:
        (only,) = ids
        return _int(state, only)
    if len(ids) != len(state.devices):
        raise state.fail(f"a device_id of {len(ids)} coordinates on a mesh of "
                         f"{len(state.devices)} axes")
    # Row-major over the mesh axes, from the first coordinate (on a 1-axis mesh the id is
    # the coordinate itself: the same value at every use, which the Mosaic GPU library's TMA
    # descriptor cache needs to recognise one peer).
    out = _int(state, ids[0])
    for (_, size), coord in zip(state.devices[1:], ids[1:]):
        out = arith.addi(arith.muli(out, i32(size)), _int(state, coord))
    return out


def peer_index(state: GPULowering, t: Any) -> Any:
    """The logical index of the device a ``plgpu.remote_ref`` view names."""
    if not state.devices:
        raise state.fail("plgpu.remote_ref outside jax.shard_map (there are no other devices)")
    return _logical_device(state, list(t.device_id), t.mesh_coordinates)


@rule(plb.semaphore_signal_p, lazy=True)
def _signal(state: GPULowering, eqn: Any, *args: Any, tree: Any, has_device_id: bool,
            device_id_type: Any, has_core_index: bool = False) -> Any:
    if has_core_index:
        raise state.fail("pl.semaphore_signal(core_index=) (GPU blocks have no core index)")
    view, rest = _sem_view(state, eqn, args, "pl.semaphore_signal")
    inc, ids = _int(state, rest[0]), rest[1:]
    sem = view.memref
    if has_device_id:
        if not state.devices:
            raise state.fail("pl.semaphore_signal(device_id=) outside jax.shard_map")
        peer = _logical_device(state, ids, device_id_type.value == "mesh")
        sem = state.launch.to_remote(sem, peer)
    mgpu.warpgroup_barrier()  # the warpgroup's earlier writes come first
    mgpu.SemaphoreRef(mgpu.utils.memref_ptr(sem)).signal(
        inc, predicate=values.one_thread(_WG))
    return []


@rule(plb.semaphore_wait_p, lazy=True)
def _wait(state: GPULowering, eqn: Any, *args: Any, tree: Any, decrement: bool) -> Any:
    view, rest = _sem_view(state, eqn, args, "pl.semaphore_wait")
    mgpu.SemaphoreRef(mgpu.utils.memref_ptr(view.memref)).wait(
        _int(state, rest[0]), decrement=decrement, scope=_WG)
    return []


@rule(plb.semaphore_read_p, lazy=True)
def _read(state: GPULowering, eqn: Any, *args: Any, tree: Any) -> Any:
    """The semaphore's value, read by every thread with acquire semantics at system scope
    (PTX ``ld.acquire.sys``), as JAX's lowering reads it."""
    view, _ = _sem_view(state, eqn, args, "pl.semaphore_read")
    i32_type = ir.IntegerType.get_signless(32)
    return llvm.inline_asm(i32_type, [mgpu.utils.memref_ptr(view.memref)],
                           "ld.acquire.sys.u32 $0,[$1];", "=r,l", has_side_effects=True)


@rule(md.semaphore_signal_multicast_p, lazy=True)
def _signal_multicast(state: GPULowering, eqn: Any, *args: Any, tree: Any,
                      collective_axes: tuple[Any, ...]) -> Any:
    _check_axes(state, collective_axes, "plgpu.semaphore_signal_multicast")
    view, rest = _sem_view(state, eqn, args, "plgpu.semaphore_signal_multicast")
    multi = state.launch.to_remote_multicast(view.memref).ref
    mgpu.warpgroup_barrier()
    mgpu.SemaphoreRef.signal_multimem(mgpu.utils.memref_ptr(multi), _int(state, rest[0]),
                                      predicate=values.one_thread(_WG))
    return []


def _gmem_view(state: GPULowering, eqn: Any, args: Any, fn: str) -> tuple[Ref, list[Any]]:
    tree = eqn.params["tree"]
    ref, flat = args[0], list(args[1:1 + tree.num_leaves])
    view = _view(state, ref, jax.tree_util.tree_unflatten(tree, flat))
    if view.kind != "gmem":
        raise state.fail(f"{fn} of a {view.kind} Ref (multicast memory is the kernel's GMEM "
                         "operands)")
    return view, list(args[1 + tree.num_leaves:])


@rule(md.multimem_store_p, lazy=True)
def _multimem_store(state: GPULowering, eqn: Any, *args: Any, tree: Any,
                    collective_axes: tuple[Any, ...]) -> Any:
    _check_axes(state, collective_axes, "plgpu.multimem_store")
    view, (value,) = _gmem_view(state, eqn, args, "plgpu.multimem_store")
    multi = state.launch.to_remote_multicast(view.memref)
    value = state.value(value)
    if view.shape == ():
        multi.store(value, [])
    else:
        if not isinstance(value, FA):
            raise state.fail("plgpu.multimem_store of a splat array (give it a layout with "
                             "plgpu.layout_cast)")
        try:
            value.store_untiled(multi, optimized=False)
        except (NotImplementedError, ValueError) as e:
            raise state.fail(f"plgpu.multimem_store of {view.dtype}{list(view.shape)} in "
                             f"{value.layout} ({e})") from None
    mgpu.warpgroup_barrier()  # the stores are complete before what follows
    return []


@dataclasses.dataclass
class PendingReduce:
    """``plgpu.multimem_load_reduce``'s result before ``plgpu.layout_cast`` names its layout
    (the reduction is issued in that layout)."""

    multi: Any
    shape: tuple[int, ...]
    dtype: Any
    reduction: str

    def into(self, state: GPULowering, layout: Any) -> Any:
        if not isinstance(layout, (mgpu.TiledLayout, mgpu.WGStridedFragLayout)):
            raise state.fail(f"plgpu.multimem_load_reduce into {layout} (a strided or tiled "
                             "layout is needed)")
        try:
            return FA.load_reduce_untiled(self.multi, layout=layout, reduction=self.reduction,
                                          is_signed=signed(self.dtype))
        except (NotImplementedError, ValueError) as e:
            raise state.fail(f"plgpu.multimem_load_reduce of {self.dtype}{list(self.shape)} "
                             f"into {layout} ({e})") from None


@rule(md.multimem_load_reduce_p, lazy=True)
def _multimem_load_reduce(state: GPULowering, eqn: Any, *args: Any, tree: Any,
                          collective_axes: tuple[Any, ...], reduction_op: str) -> Any:
    _check_axes(state, collective_axes, "plgpu.multimem_load_reduce")
    view, _ = _gmem_view(state, eqn, args, "plgpu.multimem_load_reduce")
    return PendingReduce(state.launch.to_remote_multicast(view.memref), view.shape,
                         view.dtype, reduction_op)


@rule(plb.get_global_p)
def _get_global(state: GPULowering, eqn: Any, *, what: Any) -> Any:
    mem = state.global_sems.get(id(eqn))
    if mem is None:
        raise state.fail("pl.get_global outside the kernel's body")
    return Ref("gmem", tuple(what.shape), what.dtype, memref=mem)
