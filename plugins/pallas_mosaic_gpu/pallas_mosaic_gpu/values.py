"""The value model of the Mosaic GPU lowering: what a jaxpr variable holds while a kernel is
lowered, and the state the rules (:mod:`pallas_mosaic_gpu.rules`) share.

* :class:`Ref`: a Ref of the kernel: a memref in GMEM or SMEM (tiled and swizzled for wgmma
  when :func:`is_tileable`), a register accumulator (``plgpu.ACC``), barriers, TMEM; the views
  Ref accesses take of it (:func:`_view`, :func:`_transpose_view`, :func:`_untransposed`,
  :func:`_transposed`);
* register arrays: JAX's Mosaic GPU ``FragmentedArray`` (:data:`FA`), each warpgroup
  holding its part in its lanes; :class:`Expanded` (an array with unit dimensions added, kept
  unbroadcast), :class:`Loaded` (a read of an SMEM Ref not yet in registers: wgmma reads SMEM)
  and :class:`Unavailable` (a value this backend does not produce);
* :class:`GPULowering`: the state of lowering one kernel (axis indices, accumulators,
  ``run_scoped`` allocations, the launch context); :func:`load`, :func:`store` and
  :func:`literal`; :func:`emit_for`, the ``scf.for`` that carries values and accumulators.

Layouts are chosen here, not by the user: SMEM buffers whose two minor dimensions are
multiples of 64 in a 16-bit dtype are tiled (8, 64) with a 128-byte swizzle, as ``wgmma``
reads them (8-bit and 32-bit buffers (8, 128 // itemsize) where the kernel asks, see
:func:`is_tileable`); 2-D arrays whose shape is a multiple of (64, 8) use the wgmma register layout
(row reductions give its row layout), other arrays a strided layout.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental.mosaic import gpu as mgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, scf

from pallas_core import backend as plb
from pallas_core.backend import (
    LoweringState,
    PallasError,
    UnsupportedError,
    is_float,
    is_unsigned,
    mlir_element_type,
)
from pallas_mosaic_gpu import tiled_slices

FA = mgpu.FragmentedArray
WGMMA = mgpu.WGMMA_LAYOUT
SWIZZLE = 128
"""Bytes of the swizzle of tiled SMEM buffers (the widest; what wgmma reads best)."""
WARPGROUP = 128
SMEM_ALIGNMENT = 1024
"""Where every shared-memory buffer starts (a multiple of this many bytes): TMA copies need
128-byte aligned buffers, and a 128-byte swizzle repeats every 1024 bytes, which the swizzled
TMA copies and the wgmma descriptors (base offset 0) assume of a buffer's start."""


# --- values ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Ref:
    """A Ref in the kernel: a memref in GMEM or SMEM (maybe tiled), an accumulator, barriers."""

    kind: str  # "gmem", "smem", "acc", "barrier", "value" (memref holds a value)
    shape: tuple[int, ...]
    dtype: Any
    memref: Any = None
    tiled: bool = False
    """An SMEM buffer whose two minor dimensions are tiled (8, 128 // itemsize), swizzled."""
    barrier: Any = None
    acc_key: int = -1
    transposed: bool = False
    """A tiled SMEM buffer seen with its two minor dimensions swapped (``transpose_ref``):
    only wgmma reads it (as a transposed operand)."""


@dataclasses.dataclass
class Loaded:
    """A read of an SMEM Ref, not yet in registers (``wgmma`` reads SMEM); ``transposed``
    after ``.T``."""

    ref: Ref
    transposed: bool = False


@dataclasses.dataclass
class Expanded:
    """An array with unit dimensions added (``x[:, None]``): kept as the array itself until
    it is broadcast to a full shape."""

    array: Any
    shape: tuple[int, ...]
    dims: tuple[int, ...]
    """Where the array's dimensions sit in ``shape``."""


def bits(dtype: Any) -> int:
    """The width of ``dtype`` in bits (4 for ``float4_e2m1fn``, 2 for ``uint2``)."""
    jnp = jax.numpy
    dt = np.dtype(dtype)
    if jnp.issubdtype(dt, jnp.floating):
        return int(jnp.finfo(dt).bits)
    if jnp.issubdtype(dt, jnp.integer):
        return int(jnp.iinfo(dt).bits)
    return dt.itemsize * 8


def swizzle_elems(dtype: Any) -> int:
    """Elements of ``dtype`` in one swizzled row of a tile: 128 bytes (256 of a 4-bit float)."""
    return SWIZZLE * 8 // bits(dtype)


def is_tileable(shape: Sequence[int], dtype: Any, asked: bool = False) -> bool:
    """Whether an SMEM buffer of this shape is tiled and swizzled for wgmma: 16-bit buffers
    whose two minor dimensions are multiples of 64 always; with ``asked`` (the kernel's
    transforms ask for it, or wgmma reads the buffer) also 8-bit and 32-bit buffers whose
    minor dimensions are multiples of 8 rows and 128 bytes."""
    dt = np.dtype(dtype)
    elems = swizzle_elems(dt)
    if len(shape) < 2 or shape[-1] % elems:
        return False
    if dt.itemsize == 2:
        return shape[-2] % 64 == 0
    return asked and dt.itemsize in (1, 4) and shape[-2] % 8 == 0


def tile_shape(shape: Sequence[int], dtype: Any) -> tuple[int, ...]:
    """The memref shape of a tiled SMEM buffer."""
    elems = swizzle_elems(dtype)
    *lead, r, c = shape
    return (*lead, r // 8, c // elems, 8, elems)


def tile_transform(dtype: Any) -> Any:
    return mgpu.TileTransform((8, swizzle_elems(dtype)))


def layout_for(shape: Sequence[int]) -> Any:
    """The register layout of fresh arrays of ``shape``."""
    if len(shape) == 2 and shape[0] % 64 == 0 and shape[1] % 8 == 0:
        return WGMMA
    return mgpu.WGStridedFragLayout.from_shaped_type(
        ir.VectorType.get(list(shape), ir.F32Type.get()))


def signed(dtype: Any) -> bool | None:
    return None if is_float(dtype) else not is_unsigned(dtype)


def index(v: Any) -> ir.Value:
    """An ``index`` value of an int or an integer scalar."""
    if isinstance(v, (int, np.integer)):
        return arith.constant(ir.IndexType.get(), int(v))
    if isinstance(v.type, ir.IndexType):
        return v
    return arith.index_cast(ir.IndexType.get(), v)


def i32(v: Any) -> ir.Value:
    t = ir.IntegerType.get_signless(32)
    if isinstance(v, (int, np.integer)):
        return arith.constant(t, int(v))
    return v if not isinstance(v.type, ir.IndexType) else arith.index_cast(t, v)


def scalar_constant(value: Any, dtype: Any) -> ir.Value:
    t = mlir_element_type(dtype)
    if is_float(dtype):
        return arith.constant(t, float(value))
    return arith.constant(t, int(value))


def splat(value: ir.Value, shape: Sequence[int], dtype: Any, layout: Any = None) -> Any:
    return FA.splat(value, tuple(shape), layout, is_signed=signed(dtype))


def relayout(arr: Any, layout: Any) -> Any:
    """``arr`` in ``layout`` (splats are re-splatted; others converted by the library)."""
    if arr.layout == layout:
        return arr
    if isinstance(arr.layout, mgpu.WGSplatFragLayout):
        return FA.splat(arr.registers.flat[0], arr.shape, layout, is_signed=arr.is_signed)
    try:
        return arr.to_layout(layout)
    except (NotImplementedError, ValueError) as e:
        raise UnsupportedError(f"an array of shape {arr.shape} in layout {arr.layout} used "
                               f"where {layout} is needed ({e})") from None


# --- the lowering state ----------------------------------------------------------------------


_ONE_THREAD: contextvars.ContextVar[dict[Any, ir.Value] | None] = contextvars.ContextVar(
    "pallas_mosaic_gpu_one_thread", default=None)


@contextlib.contextmanager
def one_thread_predicates() -> Iterator[None]:
    """While a kernel's launch body is lowered: the predicates selecting one thread of each
    warpgroup and of each warp, computed once at the launch's start (where every thread is
    present), as JAX's lowering computes them, and used by every single-thread operation
    (:func:`one_thread`). Each costs an ``elect.sync`` (and the warpgroup's a ``shfl.sync``)."""
    token = _ONE_THREAD.set({subset: mgpu.single_thread_predicate(subset)
                             for subset in (mgpu.ThreadSubset.WARPGROUP,
                                            mgpu.ThreadSubset.WARP)})
    try:
        yield
    finally:
        _ONE_THREAD.reset(token)


def one_thread(subset: Any = mgpu.ThreadSubset.WARPGROUP) -> ir.Value:
    """The predicate that is True in one thread of the calling warpgroup (or warp): the one
    computed at the launch's start inside :func:`one_thread_predicates`, else a fresh one."""
    found = _ONE_THREAD.get()
    return found[subset] if found is not None else mgpu.single_thread_predicate(subset)


@dataclasses.dataclass
class GPULowering(LoweringState):
    """State of lowering one kernel: axis indices, accumulators, the launch context."""

    launch: Any = None
    axes: dict[str, ir.Value] = dataclasses.field(default_factory=dict)
    accs: dict[int, Any] = dataclasses.field(default_factory=dict)
    scoped: dict[int, list[Any]] = dataclasses.field(default_factory=dict)
    """The Refs each ``pl.run_scoped`` (by equation) allocated in shared memory."""
    approx: bool = False
    warp_axis: Any = None
    """The axis of the ``WarpMesh`` region being lowered (single-thread work is then issued by
    one thread of the warp), or ``None``."""
    devices: tuple[tuple[str, int], ...] = ()
    """``(name, size)`` of the ``shard_map`` mesh axes the kernel runs under (else empty)."""
    global_sems: dict[int, Any] = dataclasses.field(default_factory=dict)
    """The semaphores each ``pl.get_global`` returns (by equation), in GMEM."""

    def value(self, v: Any) -> Any:
        """``v`` as something arithmetic applies to (reads of SMEM Refs are done here)."""
        if isinstance(v, Unavailable):
            raise self.fail(v.what)
        if type(v).__name__ == "PendingReduce":  # rules_devices: a layout is still to come
            raise self.fail("plgpu.multimem_load_reduce whose result is not given a layout "
                            "right away by plgpu.layout_cast")
        if isinstance(v, Loaded):
            if v.transposed:
                raise self.fail("transposing an SMEM block other than as a dot operand")
            return load(v.ref)
        return v


def load(ref: Ref) -> Any:
    if ref.kind == "acc":
        raise PallasError("internal: accumulator read without state")
    is_signed = signed(ref.dtype)
    if ref.tiled:
        return FA.load_tiled(ref.memref, swizzle=SWIZZLE, is_signed=is_signed)
    if ref.shape == ():
        from jaxlib.mlir.dialects import memref
        return memref.load(ref.memref, [])
    layout = layout_for(ref.shape)
    if layout == WGMMA:
        return FA.load_untiled(ref.memref, layout=WGMMA, is_signed=is_signed, optimized=False)
    return FA.load_strided(ref.memref, is_signed=is_signed)


def store(ref: Ref, value: Any) -> None:
    if ref.shape == ():
        from jaxlib.mlir.dialects import memref
        memref.store(value, ref.memref, [])
        return
    if not isinstance(value, FA):
        value = splat(value, ref.shape, ref.dtype)
    if ref.tiled:
        # Arrays read from TMEM (one row per thread) are stored in their own layout.
        keep = value.layout in (mgpu.tcgen05.LAYOUT, mgpu.tcgen05.TMEM_NATIVE_LAYOUT)
        (value if keep else relayout(value, WGMMA)).store_tiled(ref.memref, swizzle=SWIZZLE)
        return
    layout = layout_for(ref.shape)
    value = relayout(value, layout) if isinstance(value.layout, mgpu.WGSplatFragLayout) else value
    # Arrays read from TMEM are stored as they are (as JAX's lowering does), the library
    # not looking for a bank-conflict-free pattern.
    if value.layout in (WGMMA, mgpu.tcgen05.LAYOUT, mgpu.tcgen05.TMEM_NATIVE_LAYOUT) or \
            _m64_collective(value.layout, ref.shape):
        value.store_untiled(ref.memref, optimized=False)
    else:
        value.store_untiled(ref.memref)


def _m64_collective(layout: Any, shape: tuple[int, ...]) -> bool:
    """Whether ``layout`` is that of an array read from a TMEM buffer of the M=64 collective
    layout (64 rows of a collective matmul's accumulator)."""
    return len(shape) == 2 and shape[0] == 64 and shape[1] % 16 == 0 and \
        layout == mgpu.tcgen05.fa_m64_collective_layout(shape[1])


def literal(value: Any, aval: Any) -> Any:
    arr = np.asarray(value)
    if arr.ndim == 0:
        return scalar_constant(arr, aval.dtype)
    if arr.size and not (arr == arr.reshape(-1)[0]).all():
        raise UnsupportedError("a non-uniform array constant in a mosaic_gpu kernel")
    return splat(scalar_constant(arr.reshape(-1)[0] if arr.size else 0, aval.dtype),
                 aval.shape, aval.dtype)


# --- loops -----------------------------------------------------------------------------------


def emit_for(state: GPULowering, n: Any, init: list[Any],
             body: Callable[[ir.Value, list[Any]], list[Any]], start: Any = 0) -> list[Any]:
    """An ``scf.for`` over ``[start, start + n)`` carrying ``init`` and every accumulator.

    Carried splats take the layout the body gives them (the body is emitted again if so)."""
    keys = sorted(state.accs)
    for _attempt in range(3):
        carried = [state.accs[k] for k in keys] + list(init)
        leaves, tree = jax.tree_util.tree_flatten(carried)
        lo = index(start)
        hi = arith.addi(lo, index(n))
        op = scf.ForOp(lo, hi, index(1), leaves)
        with ir.InsertionPoint(op.body):
            inner = jax.tree_util.tree_unflatten(tree, list(op.inner_iter_args))
            for k, v in zip(keys, inner[:len(keys)]):
                state.accs[k] = v
            outs = body(i32(op.induction_variable), list(inner[len(keys):]))
            result = [state.accs[k] for k in keys] + [state.value(o) for o in outs]
            out_leaves, out_tree = jax.tree_util.tree_flatten(result)
            same = bool(out_tree == tree)  # type: ignore[operator]
            if same:
                scf.YieldOp(out_leaves)
        if same:
            done = jax.tree_util.tree_unflatten(tree, list(op.results))
            for k, v in zip(keys, done[:len(keys)]):
                state.accs[k] = v
            return list(done[len(keys):])
        op.operation.erase()
        init = relaid_carry(init, result[len(keys):])
    raise changing_layout(state)


def relaid_carry(init: Sequence[Any], produced: Sequence[Any]) -> list[Any]:
    """A loop's carried values in the layouts its body produced (splats take the body's
    layout), for emitting the loop again."""
    out = []
    for old, new in zip(init, produced):
        if isinstance(old, FA) and isinstance(new, FA) and old.layout != new.layout:
            old = relayout(old, new.layout)
        out.append(old)
    return out


def changing_layout(state: GPULowering) -> UnsupportedError:
    return UnsupportedError(
        f"a loop whose carried values change layout in kernel {state.call.name!r} "
        f"(at {state.location})")


# --- views of Refs ---------------------------------------------------------------------------


def _view(state: GPULowering, ref: Ref, transforms: Any) -> Ref:
    """``ref`` after the indexers of a Ref access (slices and integer indices); a peer
    (``plgpu.remote_ref``) is applied last, as the view of the peer's buffer."""
    remote: list[Any] = []
    ref = _view_local(state, ref, transforms, remote)
    if remote:
        ref = dataclasses.replace(ref, memref=state.launch.to_remote(ref.memref, remote[-1]))
    return ref


def _view_local(state: GPULowering, ref: Ref, transforms: Any, remote: list[Any]) -> Ref:
    for t in transforms:
        indices = getattr(t, "indices", None)
        if type(t).__name__ == "TransposeTransform":
            ref = _transpose_view(state, ref, tuple(t.permutation))
            continue
        if isinstance(t, plb.PeerRefTransform):
            if ref.kind != "gmem":
                raise state.fail(f"plgpu.remote_ref of a {ref.kind} Ref (peers' GMEM only)")
            from pallas_mosaic_gpu.rules_devices import peer_index

            peer = peer_index(state, t)
            remote.append(peer)
            continue
        if type(t).__name__ == "ReshapeTransform" and ref.kind in ("gmem", "smem") and \
                not ref.tiled and not ref.transposed:
            try:
                mem = mgpu.memref_reshape(ref.memref, tuple(t.shape))
            except (NotImplementedError, ValueError) as e:
                raise state.fail(f"reshaping a {ref.kind} Ref {list(ref.shape)} to "
                                 f"{list(t.shape)} ({e})") from None
            ref = dataclasses.replace(ref, memref=mem, shape=tuple(t.shape))
            continue
        if indices is None:
            raise state.fail(f"the Ref transform {type(t).__name__}")
        if ref.transposed:
            raise state.fail("indexing a transposed SMEM Ref (index it, then transpose it)")
        if ref.kind not in ("smem", "gmem"):
            if ref.kind == "barrier" and len(indices) == len(ref.shape) >= 1:
                if any(isinstance(i, plb.Slice) for i in indices):
                    raise state.fail("a slice of barriers (index every dimension of the "
                                     "barrier array)")
                flat = index(state.value(indices[0]))  # row-major over the array's shape
                for i, d in zip(indices[1:], ref.shape[1:]):
                    flat = arith.addi(arith.muli(flat, index(d)), index(state.value(i)))
                ref = dataclasses.replace(ref, barrier=ref.barrier[flat], shape=())
                continue
            if all(_full(i, d) for i, d in zip(indices, ref.shape)):
                continue
            raise state.fail(f"indexing a {ref.kind} Ref")
        idx: list[Any] = []
        shape: list[int] = []
        for i in indices:
            if isinstance(i, plb.Slice):
                if not isinstance(i.stride, int) or i.stride != 1:
                    raise state.fail("a strided Ref slice")
                start = i.start
                if isinstance(start, (int, np.integer)):
                    idx.append(slice(int(start), int(start) + i.size))
                else:
                    idx.append(mgpu.ds(index(start), i.size))
                shape.append(int(i.size))
            else:
                v = state.value(i)
                if isinstance(v, FA):
                    raise state.fail("gathering from a Ref with an index array")
                idx.append(index(v) if not isinstance(v, (int, np.integer)) else int(v))
        n_lead = len(ref.shape) - 2
        shape += list(ref.shape[len(indices):])
        if ref.tiled:  # minor slices on whole tiles keep the view tiled (tiled_slices)
            minor = [i for i, _ in list(zip(indices, ref.shape))[n_lead:]]
            mem = tiled_slices.tiled_view(
                ref.memref, idx[:n_lead], [] if all(
                    _full(i, d) for i, d in zip(minor, ref.shape[n_lead:])) else minor,
                ref.shape[n_lead:], (8, swizzle_elems(ref.dtype)),
                state.value, state.fail)
        else:
            mem = mgpu.memref_slice(ref.memref, tuple(idx))
        ref = dataclasses.replace(ref, memref=mem, shape=tuple(shape))
    return ref


def _transpose_view(state: GPULowering, ref: Ref, perm: tuple[int, ...]) -> Ref:
    """``ref`` with its two minor dimensions swapped (the only transpose wgmma reads)."""
    n = len(ref.shape)
    if perm == tuple(range(n)):
        return ref
    if ref.kind != "smem" or not ref.tiled or n < 2 or \
            perm != (*range(n - 2), n - 1, n - 2):
        raise state.fail(f"transposing a {ref.kind} Ref by {perm} (only tiled SMEM buffers, "
                         "their two minor dimensions swapped, as a wgmma operand)")
    return dataclasses.replace(ref, shape=(*ref.shape[:-2], ref.shape[-1], ref.shape[-2]),
                               transposed=not ref.transposed)


def _untransposed(ref: Ref) -> tuple[Ref, bool]:
    """The buffer under a transposed view of it (shape as allocated) and whether it was."""
    if not ref.transposed:
        return ref, False
    shape = (*ref.shape[:-2], ref.shape[-1], ref.shape[-2])
    return dataclasses.replace(ref, shape=shape, transposed=False), True


def _full(i: Any, d: int) -> bool:
    return bool(isinstance(i, plb.Slice) and isinstance(i.start, (int, np.integer))
                and i.start == 0 and i.size == d)


def _transforms(eqn: Any, args: Sequence[Any], n_before: int) -> Any:
    tree = eqn.params["tree"]
    return jax.tree_util.tree_unflatten(tree, list(args[n_before:n_before + tree.num_leaves]))


@dataclasses.dataclass
class Unavailable:
    """A value this backend does not produce (the previous contents an atomic returns)."""

    what: str


def _transposed(ref: Ref) -> Any:
    rank = len(tile_shape(ref.shape, ref.dtype))
    perm = [*range(rank - 4), rank - 3, rank - 4, rank - 1, rank - 2]
    return mgpu.memref_transpose(ref.memref, tuple(perm))
