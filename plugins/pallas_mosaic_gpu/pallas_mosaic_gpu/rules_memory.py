"""Lowering rules of the Mosaic GPU backend for memory and the tensor cores (registered in
:data:`pallas_mosaic_gpu.registry.RULES`, with its rule signature): Ref reads and writes
(``get``, ``swap``, atomics), ``jnp.dot`` as wgmma on SMEM operands, and this backend's
primitives: TMA copies, barriers, ``commit_smem``, ``wait_smem_to_gmem``, ``plgpu.wgmma``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.experimental.mosaic import gpu as mgpu
from jaxlib.mlir.dialects import arith, nvvm

from pallas_core import backend as plb
from pallas_core.backend import is_float, mlir_element_type
from pallas_mosaic_gpu import cluster, tma, values, warp_specialized_lowering
from pallas_mosaic_gpu import primitives as gp
from pallas_mosaic_gpu.registry import rule
from pallas_mosaic_gpu.values import (
    FA,
    SWIZZLE,
    WGMMA,
    GPULowering,
    Loaded,
    Ref,
    Unavailable,
    _transforms,
    _transposed,
    _untransposed,
    _view,
    index,
    layout_for,
    load,
    relayout,
    signed,
    splat,
    store,
    tile_transform,
)

# --- Ref reads and writes --------------------------------------------------------------------


@rule(plb.get_p, lazy=True)
def _get(state: GPULowering, eqn: Any, ref: Ref, *flat: Any, **_: Any) -> Any:
    view = _view(state, ref, _transforms(eqn, [ref, *flat], 1))
    if view.kind == "value":  # a value pl.run_state closes over (layout_rules._run_state)
        return view.memref
    if view.kind == "acc":
        nvvm.wgmma_wait_group_sync_aligned(0)
        return state.accs[view.acc_key].value
    if view.kind == "smem" and len(view.shape) >= 1:
        return Loaded(*_untransposed(view))
    if view.kind == "gmem" and len(view.shape) >= 1 and id(eqn) in _cast_reads(state):
        return Loaded(view)  # read by the plgpu.layout_cast right after, in its layout
    return load(view)


def _cast_reads(state: GPULowering) -> set[int]:
    """The Ref reads of the kernel (by equation) that the very next equation gives to
    ``plgpu.layout_cast``: JAX's kernels read GMEM straight into the layout the cast names
    (``layout_cast(x_ref[idx], Layout.WG_STRIDED(shape, vec_size=8))``), which is what the
    lowering does for them; nothing runs in between, so the read is not moved past a write."""
    from pallas_mosaic_gpu import layouts

    found = getattr(state, "_cast_reads", None)
    if found is None:
        eqns = list(plb.all_eqns(state.call.jaxpr.jaxpr))
        found = {id(a) for a, b in itertools.pairwise(eqns)
                 if a.primitive is plb.get_p and b.primitive is layouts.layout_cast_p
                 and b.invars[0] is a.outvars[0]}
        state._cast_reads = found  # type: ignore[attr-defined]
    return found


def _unread_results(state: GPULowering) -> set[int]:
    """``id`` of every variable an equation of the kernel's jaxpr (nested ones included)
    defines and nothing reads: no equation takes it, no jaxpr returns it."""
    found = getattr(state, "_unread", None)
    if found is None:
        defined: set[int] = set()
        read: set[int] = set()

        def visit(jaxpr: Any) -> None:
            read.update(id(v) for v in jaxpr.outvars)
            for e in jaxpr.eqns:
                read.update(id(v) for v in e.invars)
                defined.update(id(v) for v in e.outvars)
                for sub in plb.sub_jaxprs(e.params):
                    visit(sub)

        visit(state.call.jaxpr.jaxpr)
        found = defined - read
        state._unread = found  # type: ignore[attr-defined]
    return found


@rule(plb.swap_p, lazy=True)
def _swap(state: GPULowering, eqn: Any, ref: Ref, value: Any, *flat: Any, **_: Any
          ) -> Any:
    value = state.value(value)
    view = _view(state, ref, _transforms(eqn, [ref, value, *flat], 2))
    if view.kind == "value":
        raise state.fail("writing to a Ref pl.run_state made of a value (only plgpu.ACC.init "
                         "accumulators are written there)")
    if view.kind == "acc":
        nvvm.wgmma_wait_group_sync_aligned(0)
        held = state.accs[view.acc_key].value
        state.accs[view.acc_key] = mgpu.WGMMAAccumulator.from_registers(relayout(value, WGMMA))
        return held
    if view.transposed:
        raise state.fail("storing to a transposed SMEM Ref")
    old = None
    # The previous contents are read only where something reads them (``ref[...] = v``
    # traces a swap whose result nothing uses; JAX's lowering drops that read as dead code).
    if (eqn.outvars and type(eqn.outvars[0]).__name__ != "DropVar"
            and id(eqn.outvars[0]) not in _unread_results(state)):
        try:
            old = load(view)
        except (NotImplementedError, ValueError) as e:  # e.g. 64 floats in no strided layout
            old = Unavailable(f"the previous contents of a {np.dtype(view.dtype).name}"
                              f"{list(view.shape)} Ref returned by a swap ({e})")
    store(view, value)
    return old


_ATOMIC_OPS = {"add", "max", "min", "and", "or", "xor"}


@rule(plb.atomic_rmw_p, lazy=True)
def _atomic(state: GPULowering, eqn: Any, ref: Ref, value: Any, *rest: Any, op: Any,
            has_mask: bool, tree: Any) -> Any:
    if has_mask:
        raise state.fail("a masked atomic (mask=)")
    if op.value not in _ATOMIC_OPS:
        raise state.fail(f"pl.atomic_{op.value}")
    view = _view(state, ref, _transforms(eqn, [ref, value, *rest], 2))
    if view.kind not in ("gmem", "smem") or view.tiled:
        raise state.fail(f"an atomic on a {view.kind} Ref" +
                         (" (a tiled SMEM buffer)" if view.tiled else ""))
    if view.shape == ():
        raise state.fail("an atomic on a single element (give it a 1-D Ref of 128 or more "
                         "elements, one per thread)")
    value = state.value(value)
    if not isinstance(value, FA):
        value = splat(value, view.shape, view.dtype)
    value = relayout(value, layout_for(view.shape))
    try:
        if value.layout == WGMMA:
            value.store_untiled(view.memref, optimized=False, atomic=op.value)
        else:
            value.store_untiled(view.memref, atomic=op.value)
    except (NotImplementedError, ValueError) as e:
        raise state.fail(f"atomic_{op.value} on {view.dtype} in {view.kind.upper()} ({e})"
                         ) from e
    return Unavailable(f"the previous contents returned by pl.atomic_{op.value} (Mosaic GPU "
                       "atomics return nothing; use plgpu.atomic_" + op.value + ")")


# --- matmul ----------------------------------------------------------------------------------


@rule(lax.transpose_p, lazy=True)
def _transpose(state: GPULowering, eqn: Any, x: Any, *, permutation: Any, **_: Any) -> Any:
    if isinstance(x, Loaded) and tuple(permutation) == (1, 0):
        return Loaded(x.ref, not x.transposed)
    raise state.fail("a transpose (other than of an SMEM block used as a dot operand)")


def _operand_ref(state: GPULowering, v: Any, what: str) -> Ref:
    if not isinstance(v, Loaded) or not v.ref.tiled:
        raise state.fail(
            f"a dot whose {what} operand is not a whole SMEM block of a 16-bit dtype with both "
            "dimensions multiples of 64 (wgmma reads its B operand from such tiled SMEM)")
    return v.ref


def wgmma_into(state: GPULowering, acc: Any, a: Any, b: Any, a_t: bool = False,
               b_t: bool = False) -> Any:
    """``acc + a @ b`` (``a``/``b`` transposed when asked) issued as wgmma."""
    if isinstance(a, (Loaded, Ref)):
        a_ref = a.ref if isinstance(a, Loaded) else a
        a_op = _transposed(a_ref) if a_t else a_ref.memref
    else:
        if a_t:
            raise state.fail("a dot with a transposed register operand")
        a_op = relayout(a, WGMMA)
    b_ref = b.ref if isinstance(b, Loaded) else b
    b_op = _transposed(b_ref) if b_t else b_ref.memref
    try:
        out = mgpu.wgmma(acc, a_op, b_op, swizzle=SWIZZLE)
    except (NotImplementedError, ValueError) as e:
        raise state.fail(f"this wgmma ({e})") from None
    # Close a wgmma group holding these matmuls, as JAX's lowering does after each wgmma:
    # wgmma.wait_group counts committed groups only, so without it a later wait would not
    # wait for them.
    nvvm.wgmma_commit_group_sync_aligned()
    return out


@rule(lax.dot_general_p, lazy=True)
def _dot(state: GPULowering, eqn: Any, a: Any, b: Any, *, dimension_numbers: Any,
         preferred_element_type: Any = None, **_: Any) -> Any:
    (ca, cb), (ba, bb) = dimension_numbers
    if ba or bb or len(eqn.invars[0].aval.shape) != 2 or len(eqn.invars[1].aval.shape) != 2:
        raise state.fail("a batched or non-2-D dot")
    a_t, b_t = tuple(ca) == (0,), tuple(cb) == (1,)
    if isinstance(a, Loaded) and a.transposed:
        a, a_t = Loaded(a.ref), not a_t
    if isinstance(b, Loaded) and b.transposed:
        b, b_t = Loaded(b.ref), not b_t
    if not isinstance(b, Loaded):
        raise state.fail(
            "a dot whose right operand is not read straight from an SMEM block (wgmma reads "
            "B from shared memory: write jnp.dot(x, b_ref[...]))")
    _operand_ref(state, b, "right")
    if isinstance(a, Loaded):
        _operand_ref(state, a, "left")
    out_dtype = eqn.outvars[0].aval.dtype
    m, n = eqn.outvars[0].aval.shape
    acc_dtype = np.float32 if is_float(out_dtype) else np.int32
    acc = mgpu.WGMMAAccumulator.zero(m, n, mlir_element_type(acc_dtype),
                                     is_signed=signed(acc_dtype))
    acc = wgmma_into(state, acc, a, b, a_t, b_t)
    nvvm.wgmma_wait_group_sync_aligned(0)
    out = acc.value
    if np.dtype(out_dtype) != np.dtype(acc_dtype):
        out = out.astype(mlir_element_type(out_dtype), is_signed=signed(out_dtype))
    return out


# --- this backend's primitives -----------------------------------------------------------------


def _views(state: GPULowering, eqn: Any, args: Sequence[Any]) -> list[Ref]:
    roles = eqn.params["roles"]
    n_refs = max(roles) + 1 if roles else 0
    tree = eqn.params["tree"]
    transforms = jax.tree_util.tree_unflatten(tree, list(args[n_refs:n_refs + tree.num_leaves]))
    views = [_view(state, args[r], t) for r, t in zip(roles, transforms)]
    if eqn.primitive is not gp.wgmma_p and any(v.transposed for v in views):
        raise state.fail(f"a transposed SMEM Ref given to {eqn.primitive.name} (only wgmma "
                         "reads transposed buffers)")
    # A Barrier of one barrier (shape (), (1,), ...) may be passed without indexing it.
    return [dataclasses.replace(v, barrier=v.barrier[0], shape=())
            if v.kind == "barrier" and not t and math.prod(v.shape) == 1 else v
            for v, t in zip(views, transforms)]


def _gmem_window(state: GPULowering, eqn: Any, args: Sequence[Any], role: int
                 ) -> tuple[Any, tuple[Any, ...]]:
    """The kernel's GMEM memref and the window of it a copy's view ``role`` names (TMA
    descriptors are made for whole kernel operands; the window is the copy's box)."""
    roles, tree = eqn.params["roles"], eqn.params["tree"]
    n_refs = max(roles) + 1
    transforms = jax.tree_util.tree_unflatten(tree, list(args[n_refs:n_refs + tree.num_leaves]))
    ref = args[roles[role]]
    if ref.kind != "gmem":
        raise state.fail(f"a TMA copy whose GMEM side is a {ref.kind} Ref")
    # Per dimension of the operand: (start, size), or (index, None) once an int indexes it;
    # successive indexers (``ref.at[g].at[rows]``) apply to the dimensions still there.
    dims: list[tuple[Any, int | None]] = [(0, d) for d in ref.shape]
    for t in transforms[role]:
        if isinstance(t, plb.PeerRefTransform):
            continue  # the copy's peer (_gmem_peer)
        indices = getattr(t, "indices", None)
        if indices is None:
            raise state.fail("this view of a GMEM Ref in a copy (slices and ints only)")
        open_dims = [k for k, (_, size) in enumerate(dims) if size is not None]
        for k, i in zip(open_dims, indices):
            base = dims[k][0]
            if isinstance(i, plb.Slice):
                if not isinstance(i.stride, int) or i.stride != 1:
                    raise state.fail("a strided slice of a GMEM Ref in a copy")
                start = i.start if isinstance(i.start, (int, np.integer)) else \
                    state.value(i.start)
                dims[k] = (_add_index(base, start), int(i.size))
            else:
                dims[k] = (_add_index(base, state.value(i)), None)
    window = tuple(mgpu.ds(index(start), size) if size is not None else index(start)
                   for start, size in dims) if transforms[role] else ()
    return ref.memref, window


def _gmem_peer(state: GPULowering, eqn: Any, args: Sequence[Any], role: int) -> Any:
    """The device (logical index) whose GMEM a copy's view ``role`` names
    (``plgpu.remote_ref``), or ``None`` for this device's."""
    from pallas_mosaic_gpu.rules_devices import peer_index

    roles, tree = eqn.params["roles"], eqn.params["tree"]
    n_refs = max(roles) + 1
    transforms = jax.tree_util.tree_unflatten(tree, list(args[n_refs:n_refs + tree.num_leaves]))
    peers = [t for t in transforms[role] if isinstance(t, plb.PeerRefTransform)]
    if not peers:
        return None
    if len(peers) > 1:
        raise state.fail("a view naming two devices (remote_ref of a remote_ref)")
    return peer_index(state, peers[0])


def _add_index(a: Any, b: Any) -> Any:
    """``a + b`` of two ints or index-like scalars (an int when both are ints)."""
    if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
        return int(a) + int(b)
    if isinstance(a, (int, np.integer)) and a == 0:
        return b
    return arith.addi(index(a), index(b))


@rule(gp.copy_gmem_to_smem_p, lazy=True)
def _copy_in(state: GPULowering, eqn: Any, *args: Any, collective_axes: Any = None,
             leader_tracked: Any = None, **_: Any) -> Any:
    _src_view, dst, bar = _views(state, eqn, args)
    src, window = _gmem_window(state, eqn, args, 0)
    shared = {}
    if collective_axes is not None:  # a copy the blocks of a cluster share (cluster.py)
        dims = cluster.cluster_dims(state.call.compiler_params.mesh, collective_axes,
                                    "plgpu.copy_gmem_to_smem(collective_axes=...)", state.fail)
        if leader_tracked is not None and \
                cluster.cluster_size(state.call.compiler_params.mesh, dims) != 2:
            raise state.fail("a leader-tracked plgpu.copy_gmem_to_smem along cluster axes of "
                             "other than 2 blocks")
        shared = dict(collective=dims, leader_tracked=leader_tracked)
    tma.copy(state.launch, gmem=src, smem=dst.memref, window=window, to_smem=True,
             peer=_gmem_peer(state, eqn, args, 0),
             barrier=bar.barrier, aligned=False, kernel=state.call.name,
             tiling=tile_transform(dst.dtype) if dst.tiled else None,
             swizzle=SWIZZLE if dst.tiled else None, predicate=_issuer(state), **shared)
    return []


@rule(gp.copy_smem_to_gmem_p, lazy=True)
def _copy_out(state: GPULowering, eqn: Any, *args: Any, commit_group: bool = True,
              **_: Any) -> Any:
    src, _dst_view = _views(state, eqn, args)
    dst, window = _gmem_window(state, eqn, args, 1)
    tma.copy(state.launch, gmem=dst, smem=src.memref, window=window, to_smem=False,
             aligned=False, kernel=state.call.name, commit=commit_group,
             peer=_gmem_peer(state, eqn, args, 1),
             tiling=tile_transform(src.dtype) if src.tiled else None,
             swizzle=SWIZZLE if src.tiled else None, predicate=_issuer(state))
    return []


def _issuer(state: GPULowering) -> Any:
    """The thread issuing a copy: one of the warp inside a ``WarpMesh`` region, else one of
    the warpgroup (the predicates computed once per launch, as in JAX's lowering)."""
    from pallas_mosaic_gpu import dynamic_scheduling
    return dynamic_scheduling.issuing_thread(state)


@rule(gp.barrier_wait_p, lazy=True)
def _barrier_wait(state: GPULowering, eqn: Any, *args: Any, **_: Any) -> Any:
    (bar,) = _views(state, eqn, args)
    bar.barrier.wait(orders_tensor_core=_orders_tensor_core(eqn))
    return []


def _orders_tensor_core(eqn: Any) -> bool:
    """Whether the barrier of a wait or arrival is a ``Barrier(orders_tensor_core=True)``."""
    space = getattr(eqn.invars[0].aval, "memory_space", None)
    return bool(getattr(space, "orders_tensor_core", False))


@rule(gp.barrier_arrive_p, lazy=True)
def _barrier_arrive(state: GPULowering, eqn: Any, *args: Any, **_: Any) -> Any:
    (bar,) = _views(state, eqn, args)
    if isinstance(bar.barrier, mgpu.CollectiveBarrierRef):  # a plgpu.ClusterBarrier
        if state.warp_axis is not None:
            raise state.fail("plgpu.barrier_arrive on a plgpu.ClusterBarrier inside a "
                             "pl.core_map(plgpu.WarpMesh) region (a warpgroup arrives on it)")
        if not _orders_tensor_core(eqn):
            mgpu.warpgroup_barrier()  # as arrive_once: no thread still reads what it releases
        bar.barrier.arrive(orders_tensor_core=_orders_tensor_core(eqn))
        return []
    if state.warp_axis is not None:  # one arrival per warp inside a WarpMesh region
        bar.barrier.arrive(orders_tensor_core=_orders_tensor_core(eqn),
                           predicate=values.one_thread(mgpu.ThreadSubset.WARP),
                           scope=mgpu.ThreadSubset.WARP)
        return []
    warp_specialized_lowering.arrive_once(bar.barrier, _orders_tensor_core(eqn))
    return []


@rule(gp.commit_smem_p)
def _commit(state: GPULowering, eqn: Any, **_: Any) -> Any:
    mgpu.commit_shared()
    return []


@rule(gp.wait_smem_to_gmem_p)
def _wait_out(state: GPULowering, eqn: Any, *, n: int, read_only: bool, **_: Any) -> Any:
    state.launch.await_async_copy(n, await_read_only=read_only)
    return []


@rule(gp.wgmma_wait_p)
def _wgmma_wait(state: GPULowering, eqn: Any, *, n: int, **_: Any) -> Any:
    nvvm.wgmma_wait_group_sync_aligned(n)
    return []


@rule(gp.wgmma_p, lazy=True)
def _wgmma(state: GPULowering, eqn: Any, *args: Any, a_is_ref: bool, **_: Any) -> Any:
    views = _views(state, eqn, args)
    acc = views[0]
    a_t = False
    if a_is_ref:
        (a, a_t), (b, b_t) = _untransposed(views[1]), _untransposed(views[2])
        if not a.tiled:
            raise state.fail("plgpu.wgmma with an A operand in untiled SMEM")
    else:
        a, (b, b_t) = state.value(args[-1]), _untransposed(views[1])
    if not b.tiled:
        raise state.fail("plgpu.wgmma with a B operand that is not a tiled SMEM buffer "
                         "(16-bit dtype, both dimensions multiples of 64)")
    state.accs[acc.acc_key] = wgmma_into(state, state.accs[acc.acc_key], a, b, a_t, b_t)
    return []
