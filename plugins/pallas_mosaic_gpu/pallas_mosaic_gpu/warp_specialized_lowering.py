"""Lowering rules for warp specialisation and the register slices it needs (registered into
:data:`pallas_mosaic_gpu.registry.RULES`).

* ``set_max_registers`` is PTX ``setmaxnreg`` (``nvvm.setmaxregister``);
* ``warpgroups_run_concurrently`` is a constant true: a ``lax.cond`` on it (or on any
  constant) lowers only the branch it takes (:func:`static_predicate`);
* ``lax.slice`` of a register array (``acc[0:64, 64:128]``, an epilogue's tile) is the
  library's static slice of a ``FragmentedArray``;
* ``pl.run_scoped(collective_axes=thread_axis)``: one allocation shared by the warpgroups of
  a block (this backend's shared-memory plan gives every ``run_scoped`` one region anyway); as
  in JAX, the warpgroups meet at a block barrier before they enter it, and accumulators, which
  live in each warpgroup's registers, are refused in it. Shared memory allocated without
  ``collective_axes`` in a kernel of several warpgroups is refused, as in JAX (the interpreter
  would give each warpgroup its own buffer where the GPU shares one).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax import lax
from jax.experimental.mosaic import gpu as mgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, gpu, nvvm

from pallas_core.backend import UnsupportedError
from pallas_mosaic_gpu import values
from pallas_mosaic_gpu import warp_specialized as ws
from pallas_mosaic_gpu.params import ACC_SPACE
from pallas_mosaic_gpu.registry import rule
from pallas_mosaic_gpu.values import FA, GPULowering

_CASTS = ("arith.extui", "arith.extsi", "arith.index_cast", "arith.trunci")


def static_predicate(pred: Any) -> int | None:
    """The value of a branch index the lowering knows (a constant, maybe cast), else
    ``None``."""
    if isinstance(pred, (bool, int, np.integer, np.bool_)):
        return int(pred)
    value = pred
    for _ in range(4):
        owner: Any = getattr(value, "owner", None)
        name = getattr(owner, "name", None)
        if name == "arith.constant":
            attr = owner.attributes["value"]
            if isinstance(attr, ir.BoolAttr):
                return int(attr.value)
            return int(ir.IntegerAttr(attr).value) if isinstance(attr, ir.IntegerAttr) else None
        if name not in _CASTS:
            return None
        value = owner.operands[0]
    return None


@rule(ws.set_max_registers_p)
def _set_max_registers(state: GPULowering, eqn: Any, *, n: int, action: str) -> Any:
    nvvm.setmaxregister(n, nvvm.SetMaxRegisterAction.increase if action == "increase"
                        else nvvm.SetMaxRegisterAction.decrease)
    return []


@rule(ws.concurrent_p)
def _concurrent(state: GPULowering, eqn: Any) -> Any:
    return arith.constant(ir.IntegerType.get_signless(1), 1)


@rule(lax.slice_p)
def _slice(state: GPULowering, eqn: Any, x: Any, *, start_indices: Any, limit_indices: Any,
           strides: Any) -> Any:
    if not isinstance(x, FA):
        raise state.fail("lax.slice of a scalar")
    if strides is not None and any(s != 1 for s in strides):
        raise state.fail("a strided lax.slice of an array")
    idx = tuple(slice(int(a), int(b)) for a, b in zip(start_indices, limit_indices))
    try:
        return x[idx]
    except (NotImplementedError, ValueError, IndexError) as e:
        raise state.fail(f"slicing {x.shape} in layout {x.layout} by {idx} ({e}; slices of "
                         "the wgmma layout must cover whole (64, 8) tiles)") from None


def enter_run_scoped(state: GPULowering, eqn: Any) -> None:
    """Checks a ``pl.run_scoped``'s ``collective_axes`` and, for one shared by the
    warpgroups, makes them meet first (a buffer of an earlier scope may share its memory)."""
    axes = tuple(eqn.params.get("collective_axes", ()))
    mesh: Any = getattr(state.call.compiler_params, "mesh", None)
    thread = getattr(mesh, "thread_name", None)
    threads = getattr(mesh, "num_threads", None) or 1
    if not axes:
        shared = [m for m in eqn.params["scoped"] if m.memory_space is not ACC_SPACE]
        if shared and threads > 1:
            raise UnsupportedError(
                f"kernel {state.call.name!r}: pl.run_scoped at {state.location} allocates "
                f"shared memory in a kernel of {threads} warpgroups without "
                "collective_axes; the block has one shared memory, so (as in JAX) such an "
                f"allocation must be shared by its warpgroups. Fix: pass "
                f"collective_axes={thread!r} (and index the buffer by warpgroup where each "
                "needs its own part).")
        return
    if axes != (thread,) or thread is None:
        raise UnsupportedError(
            f"kernel {state.call.name!r}: pl.run_scoped(collective_axes={axes}) at "
            f"{state.location}: the mosaic_gpu backend shares an allocation among the "
            f"warpgroups of a block only (collective_axes=the kernel's thread axis, here "
            f"{thread!r}), not among blocks. Fix: collective_axes={thread!r}, or none.")
    if any(m.memory_space is ACC_SPACE for m in eqn.params["scoped"]):
        raise UnsupportedError(
            f"kernel {state.call.name!r}: pl.run_scoped(collective_axes={axes}) allocates a "
            "plgpu.ACC, which lives in each warpgroup's registers and cannot be shared. Fix: "
            "allocate it in a run_scoped of its own without collective_axes.")
    gpu.barrier()


def arrive_once(barrier: Any, orders_tensor_core: bool = False) -> None:
    """One arrival of the calling warpgroup on ``barrier`` (its threads meet first, so that
    none still reads what the arrival releases; with ``orders_tensor_core`` the library fences
    the tensor core's work before that meeting)."""
    if not orders_tensor_core:
        mgpu.warpgroup_barrier()
    barrier.arrive(orders_tensor_core=orders_tensor_core,
                   predicate=values.one_thread(mgpu.ThreadSubset.WARPGROUP))
