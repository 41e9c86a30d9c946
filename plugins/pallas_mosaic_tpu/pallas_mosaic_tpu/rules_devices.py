"""Mosaic TPU's rules for where a kernel runs and what crosses between cores and devices:
grid indices and sizes (``program_id``, ``num_programs``, a dynamic grid's bounds), mesh
coordinates (``lax.axis_index`` of a ``pl.kernel`` or ``shard_map`` axis), symbolic dimensions,
the ``lax.platform_dependent`` branch; DMAs (local and remote, with their device ids),
semaphores and delays."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith
from jaxlib.mosaic.python import tpu

from pallas_core import backend as plb
from pallas_core.backend import PallasError
from pallas_mosaic_tpu import ir as mir
from pallas_mosaic_tpu.registry import Lowering, rule
from pallas_mosaic_tpu.rules_refs import ref_view


@rule(plb.program_id_p)
def _program_id(lowering: Lowering, eqn: Any) -> ir.Value:
    gm = lowering.call.grid_mapping
    return lowering.program_ids[gm.num_batch_axes + eqn.params["axis"]]


@rule(plb.axis_index_p)
def _axis_index(lowering: Lowering, eqn: Any) -> ir.Value:
    gm = lowering.call.grid_mapping
    name = eqn.params["axis_name"]
    name = name[0] if isinstance(name, tuple) and len(name) == 1 else name
    if gm.grid_names and name in gm.grid_names:
        return lowering.program_ids[gm.num_batch_axes + gm.grid_names.index(name)]
    names = [n for n, _ in lowering.mesh_axes]
    if name not in names:
        raise lowering.fail(f"lax.axis_index({name!r}) of an axis that is neither the kernel "
                            f"mesh's nor one of the shard_map mesh axes {tuple(names)}")
    # This device's coordinate along the axis, from its linear id over the mesh.
    k = names.index(name)
    device = tpu.DeviceIdOp().result
    stride = mir.constant(_mesh_stride(lowering.mesh_axes, k), np.int32)
    return arith.RemSIOp(arith.DivSIOp(device, stride).result,
                         mir.constant(lowering.mesh_axes[k][1], np.int32)).result


def _mesh_stride(axes: Sequence[tuple[str, int]], k: int) -> int:
    """How far apart, in linear device ids, neighbours along mesh axis ``k`` are."""
    return math.prod(size for _, size in axes[k + 1:])


@rule(plb.num_programs_p)
def _num_programs(lowering: Lowering, eqn: Any) -> ir.Value:
    """The size of a dynamic grid axis, as the TPU runtime knows it."""
    gm = lowering.call.grid_mapping
    return tpu.GetIterationBoundOp(gm.num_batch_axes + eqn.params["axis"]).result


@rule(plb.dim_as_value_p)
def _dim_as_value(lowering: Lowering, eqn: Any) -> ir.Value:
    """A symbolic dimension's value: its placeholder constant (see ``symbolic.py``), which
    the runtime replaces with the value for each call, as JAX lowers it."""
    dim = eqn.params["dim"]
    if plb.is_symbolic_dim(dim):
        raise lowering.fail(f"the value of the symbolic dimension {dim} outside JAX's "
                            "dynamic-shape export (pl.pallas_export_experimental"
                            "(dynamic_shapes=True))")
    return mir.constant(int(dim), np.int32)


@rule(plb.platform_index_p)
def _platform_index(lowering: Lowering, eqn: Any, *args: Any) -> ir.Value:
    """``lax.platform_dependent`` in a kernel: the branch for ``mosaic``, else the default
    one, as JAX's lowering picks it."""
    branch = plb.platform_branch(eqn, ("mosaic",))
    if branch is None:
        raise lowering.fail(f"lax.platform_dependent with branches for "
                            f"{eqn.params['platforms']} and no default (a Mosaic TPU kernel "
                            "takes the branch named mosaic=..., else default=...)")
    return mir.constant(branch, np.int32, ())


@rule(plb.delay_p)
def _delay(lowering: Lowering, eqn: Any, nanos: ir.Value) -> list[Any]:
    tpu.DelayOp(nanos)
    return []


# --- DMAs and semaphores ----------------------------------------------------------------------


def role_views(lowering: Lowering, eqn: Any, args: Sequence[Any]) -> list[ir.Value]:
    """The memref view of each role (source, destination, semaphores, ...) of a primitive
    bound with ``plb.bind_views`` (a copy's start or wait), from its operands ``args``."""
    roles = eqn.params["roles"]
    n_refs = max(roles) + 1
    tree = eqn.params["tree"]
    transforms = jax.tree_util.tree_unflatten(tree, args[n_refs:n_refs + tree.num_leaves])
    return [ref_view(lowering, args[r], t) for r, t in zip(roles, transforms)]


def _device_id(lowering: Lowering, ids: Sequence[Any], id_type: plb.DeviceIdType
               ) -> ir.Value:
    """The linear (logical) id of the device that ``ids`` name, as the DMA engine wants it."""
    ids = [i if isinstance(i, ir.Value) else mir.constant(i, np.int32) for i in ids]
    if id_type is not plb.DeviceIdType.MESH:
        return ids[0]
    axes = lowering.mesh_axes
    if not axes:
        raise lowering.fail("a device id outside shard_map (run the kernel under shard_map)")
    if len(ids) != len(axes):
        raise PallasError(
            f"kernel {lowering.call.name!r} ({lowering.location}): device_id has {len(ids)} "
            f"coordinates but the shard_map mesh has axes {tuple(n for n, _ in axes)}. Fix: "
            "give one coordinate per mesh axis, or DeviceIdType.LOGICAL with a single index.")
    linear: ir.Value = mir.constant(0, np.int32)
    for k, coord in enumerate(ids):
        stride = mir.constant(_mesh_stride(axes, k), np.int32)
        linear = arith.AddIOp(linear, arith.MulIOp(coord, stride).result).result
    return linear


def copy_device_id(lowering: Lowering, eqn: Any, args: Sequence[Any]) -> ir.Value:
    """The target device of a remote copy bound with ``plb.bind_views`` (its operands after
    the Refs and transforms), as the device id Mosaic takes."""
    roles, tree = eqn.params["roles"], eqn.params["tree"]
    return _device_id(lowering, args[max(roles) + 1 + tree.num_leaves:],
                      eqn.params["device_id_type"])


@rule(plb.copy_start_p)
def _copy_start(lowering: Lowering, eqn: Any, *args: Any) -> list[Any]:
    if eqn.params.get("add"):
        raise lowering.fail("an adding copy (add=True; a SparseCore DMA) on a TensorCore")
    priority = eqn.params.get("priority", 0)
    queue = {"priority": priority} if priority else {}
    if not eqn.params["remote"]:
        src, dst, sem = role_views(lowering, eqn, args)
        tpu.EnqueueDMAOp(src, dst, target_semaphore=sem, **queue)
        return []
    src, dst, recv_sem, send_sem = role_views(lowering, eqn, args)
    tpu.EnqueueDMAOp(src, dst, source_semaphore=send_sem, target_semaphore=recv_sem,
                     device_id=copy_device_id(lowering, eqn, args), **queue)
    return []


@rule(plb.copy_wait_p)
def _copy_wait(lowering: Lowering, eqn: Any, *args: Any) -> list[Any]:
    src, dst, sem = role_views(lowering, eqn, args)
    kind = eqn.params["kind"]
    if plb.mosaic_waits_name_both_ends():  # as the installed JAX lowers waits
        device = None if kind == "local" else copy_device_id(lowering, eqn, args)
        sems = {"source_semaphore": sem} if kind == "send" else {"target_semaphore": sem}
        tpu.WaitDMAOp(src, dst, kind != "send", device_id=device, **sems)
        return []
    if kind == "local":
        tpu.WaitDMA2Op(sem, src, dst)
    elif kind == "recv":  # the data sent to this device has arrived
        tpu.WaitDMA2Op(sem, src, dst, device_id=copy_device_id(lowering, eqn, args))
    else:  # this device's send has left: the DMA seen from the sender's side
        here = mir.constant(0, np.int32)
        tpu.WaitDMA2Op(sem, dst, src, device_id=here, core_id=here)
    return []


def _semaphore(lowering: Lowering, eqn: Any, args: Sequence[Any]) -> ir.Value:
    tree = eqn.params["tree"]
    transforms = jax.tree_util.tree_unflatten(tree, args[1:1 + tree.num_leaves])
    return ref_view(lowering, args[0], transforms)


@rule(plb.semaphore_signal_p)
def _semaphore_signal(lowering: Lowering, eqn: Any, *args: Any) -> list[Any]:
    n = 1 + eqn.params["tree"].num_leaves
    has_core = eqn.params.get("has_core_index", False)
    ids = args[n + 1:len(args) - int(has_core)]
    device = (_device_id(lowering, ids, eqn.params["device_id_type"])
              if eqn.params["has_device_id"] else None)
    core = args[-1] if has_core else None
    tpu.SemaphoreSignalOp(_semaphore(lowering, eqn, args), args[n], device_id=device,
                          core_id=core)
    return []


@rule(plb.semaphore_wait_p)
def _semaphore_wait(lowering: Lowering, eqn: Any, *args: Any) -> list[Any]:
    if not eqn.params["decrement"]:
        raise lowering.fail("pl.semaphore_wait(decrement=False)")
    tpu.SemaphoreWaitOp(_semaphore(lowering, eqn, args), args[1 + eqn.params["tree"].num_leaves])
    return []


@rule(plb.semaphore_read_p)
def _semaphore_read(lowering: Lowering, eqn: Any, *args: Any) -> ir.Value:
    return tpu.SemaphoreReadOp(_semaphore(lowering, eqn, args)).result
