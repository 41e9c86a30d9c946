"""Primitives of the Mosaic GPU backend, each with reference semantics for the interpreter.

* ``copy_gmem_to_smem(src, dst, barrier)``: a TMA copy of a GMEM window into SMEM that
  completes ``barrier``'s phase when its bytes have landed (``barrier_wait(barrier)``).
* ``copy_smem_to_gmem(src, dst)``: a TMA copy of SMEM into a GMEM window, one of the
  "bulk groups" that ``wait_smem_to_gmem(n)`` waits for until at most ``n`` are pending.
* ``commit_smem()``: makes this warpgroup's SMEM writes visible to TMA (before a copy out).
* ``barrier_arrive(barrier)`` / ``barrier_wait(barrier)``: mbarrier arrival and wait.
* ``wgmma(acc, a, b)``: ``acc += a @ b`` on the warpgroup tensor cores (``a`` an SMEM Ref or
  a value, ``b`` an SMEM Ref), asynchronous until ``wgmma_wait(n)``.
* ``griddepcontrol_wait()`` / ``griddepcontrol_launch_dependents()``: programmatic dependent
  launch (PTX ``griddepcontrol.wait`` / ``.launch_dependents``); timing only, so the
  interpreter does nothing.

The interpreter runs copies at once (a copy in completes its barrier's phase immediately), so
a kernel that reads a destination before waiting still sees the copied data there; the
barrier's int32 counts completed phases, and ``barrier_wait`` checks in checked mode that some
phase completed (a wait that could never return is reported instead of hanging).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.mosaic.gpu import CopyPartition

from pallas_core import backend as plb
from pallas_core.backend import PallasError, RefViews, UnsupportedError, bind_views
from pallas_core.backend import ref_and_transforms as _ref_and_transforms


class GPUSyncEffect(plb.Effect):
    """Waits and fences that touch no Ref (they order the kernel's memory traffic)."""


GPU_SYNC = GPUSyncEffect()
plb.register_side_effect(GPUSyncEffect)


def _ref_effects(*avals: Any, roles: tuple[int, ...], **_: Any) -> Any:
    if not roles:
        return [], {GPU_SYNC}
    n_refs = max(roles) + 1
    return [], {e for i in range(n_refs) for e in (plb.ReadEffect(i), plb.WriteEffect(i))}


def _primitive(name: str) -> Any:
    p = plb.Primitive(name)
    p.multiple_results = True
    p.def_effectful_abstract_eval(_ref_effects)
    return p


copy_gmem_to_smem_p = _primitive("gpu_copy_gmem_to_smem")
copy_smem_to_gmem_p = _primitive("gpu_copy_smem_to_gmem")
barrier_arrive_p = _primitive("gpu_barrier_arrive")
barrier_wait_p = _primitive("gpu_barrier_wait")
wgmma_p = _primitive("gpu_wgmma")
wait_smem_to_gmem_p = _primitive("gpu_wait_smem_to_gmem")
commit_smem_p = _primitive("gpu_commit_smem")
wgmma_wait_p = _primitive("gpu_wgmma_wait")
griddepcontrol_wait_p = _primitive("gpu_griddepcontrol_wait")
griddepcontrol_launch_dependents_p = _primitive("gpu_griddepcontrol_launch_dependents")

_SRC, _DST, _BARRIER = 0, 1, 2


def _aval(view: Any, fn: str) -> Any:
    ref, transforms = _ref_and_transforms(view, None, fn)
    return plb.shape_after_transforms(plb.ref_type_of(ref), transforms), ref


def _space_name(ref: Any) -> str:
    space = getattr(plb.ref_type_of(ref), "memory_space", None)
    return getattr(space, "name", str(space))


def _check_copy(src: Any, dst: Any, fn: str, src_space: str, dst_space: str,
                partitioned: int | None = None) -> None:
    """Checks that ``src`` and ``dst`` match and live where ``fn`` copies from and to;
    ``partitioned``: ``dst`` is one block's part of ``src`` along that dimension (a
    multiple of it; the lowering checks the multiple is the cluster's size)."""
    (s, s_ref), (d, d_ref) = _aval(src, fn), _aval(dst, fn)
    fits = s.shape == d.shape
    if partitioned is not None:
        if not 0 <= partitioned < len(s.shape):
            raise PallasError(f"plgpu.{fn}: CopyPartition.PARTITIONED({partitioned}) of a "
                              f"{len(s.shape)}-D window. Fix: name one of its dimensions.")
        fits = len(s.shape) == len(d.shape) and all(
            a == b or (i == partitioned and b and a % b == 0)
            for i, (a, b) in enumerate(zip(s.shape, d.shape)))
    if not fits or s.dtype != d.dtype:
        part = "" if partitioned is None else \
            f" (the source split along dimension {partitioned} among the cluster's blocks)"
        raise PallasError(f"plgpu.{fn}: source {s.dtype}{list(s.shape)} and destination "
                          f"{d.dtype}{list(d.shape)} differ{part}. Fix: slice them to match "
                          "(ref.at[...]).")
    for ref, want, what in ((s_ref, src_space, "source"), (d_ref, dst_space, "destination")):
        found = _space_name(ref)
        ok = found == want or (want == "GMEM" and found in ("any", "None"))
        if not ok:
            raise PallasError(f"plgpu.{fn}: the {what} must be in {want}, found a Ref in "
                              f"{found}. Fix: copy {src_space} -> {dst_space}.")


def _check_barrier(barrier: Any, fn: str) -> None:
    aval, ref = _aval(barrier, fn)
    if _space_name(ref) != "BARRIER" or aval.shape not in ((), (1,)):
        raise PallasError(f"plgpu.{fn}: expected one barrier (a plgpu.Barrier scratch of one "
                          f"barrier, or barrier.at[i] of one holding several), found a "
                          f"Ref {aval.dtype}{list(aval.shape)} in {_space_name(ref)}.")


def copy_gmem_to_smem(src: Any, dst: Any, barrier: Any, *, collective_axes: Any = None,
                      leader_tracked: Any = None, oob_mode: Any = None,
                      partitioned_axis: Any = None) -> None:
    """Starts a TMA copy of ``src`` (GMEM, a window of it with ``.at[...]``) into ``dst``
    (SMEM); ``barrier_wait(barrier)`` returns once it has landed.

    ``collective_axes`` (cluster axes): every block of the cluster along them issues this
    same copy. Without ``leader_tracked`` each of them receives all of it (multicast) and
    its own barrier tracks it. With ``leader_tracked=CopyPartition.PARTITIONED(d)`` the
    window is split along its dimension ``d`` among the blocks (one axis of 2 blocks), each
    receiving its part into ``dst`` (so ``src`` is twice ``dst`` along ``d``), and only the
    first block's barrier tracks the whole transfer; ``CopyPartition.REPLICATED``: each
    receives all of it, tracked by the first block. ``partitioned_axis=d`` is JAX's older
    spelling of ``leader_tracked=CopyPartition.PARTITIONED(d)``. See
    :mod:`pallas_mosaic_gpu.cluster`.

    ``oob_mode`` (a ``plgpu.OOBFillMode``, ``None`` for ``ZEROS``): what elements of the
    window past the end of ``src`` become. Here they are always zeros, which each mode
    allows (``UNDEFINED`` leaves them unspecified, ``PROMISE_IN_BOUNDS`` promises there are
    none)."""
    fn = "copy_gmem_to_smem"
    from jax.experimental.mosaic.gpu import OOBFillMode

    from pallas_mosaic_gpu.im2col import Im2colWindow, copy_im2col
    if isinstance(src, Im2colWindow):
        if collective_axes is not None or leader_tracked is not None or \
                partitioned_axis is not None:
            raise UnsupportedError(f"plgpu.{fn}: an im2col copy shared by a cluster "
                                   "(collective_axes, leader_tracked) is not supported by "
                                   "mosaic_gpu. Fix: copy in each block.")
        copy_im2col(src, dst, barrier)
        return
    if oob_mode is not None and not isinstance(oob_mode, OOBFillMode):
        raise PallasError(f"plgpu.{fn}(oob_mode={oob_mode!r}): expected None or a "
                          "plgpu.OOBFillMode (ZEROS, UNDEFINED or PROMISE_IN_BOUNDS).")
    if partitioned_axis is not None:
        if leader_tracked is not None:
            raise PallasError(f"plgpu.{fn}: partitioned_axis={partitioned_axis!r} and "
                              f"leader_tracked={leader_tracked!r} say the same thing twice. "
                              "Fix: pass only leader_tracked=plgpu.CopyPartition.PARTITIONED("
                              f"{partitioned_axis!r}).")
        leader_tracked = CopyPartition.PARTITIONED(int(partitioned_axis))
    axes = None
    if collective_axes is not None:
        from pallas_mosaic_gpu.cluster import axes_tuple
        axes = axes_tuple(collective_axes)
    if leader_tracked is not None:
        if axes is None:
            raise PallasError(f"plgpu.{fn}(leader_tracked={leader_tracked!r}): a leader-"
                              "tracked copy is shared by the blocks of a cluster. Fix: name "
                              "the cluster axis too, collective_axes='x'.")
        if not isinstance(leader_tracked, CopyPartition):
            raise PallasError(f"plgpu.{fn}(leader_tracked={leader_tracked!r}): expected "
                              "plgpu.CopyPartition.PARTITIONED(axis) or "
                              "plgpu.CopyPartition.REPLICATED.")
        if len(axes) != 1:
            raise PallasError(f"plgpu.{fn}(collective_axes={axes}, leader_tracked=...): a "
                              "leader-tracked copy is shared along one cluster axis.")
    _check_copy(src, dst, fn, "GMEM", "SMEM", partitioned=getattr(leader_tracked, "axis", None))
    _check_barrier(barrier, fn)
    shared = {} if axes is None else {"cluster_blocks": _blocks_along(axes)}
    bind_views(copy_gmem_to_smem_p, [src, dst, barrier], [], fn, collective_axes=axes,
               leader_tracked=leader_tracked, **shared)


def _blocks_along(axes: tuple[Any, ...]) -> int | None:
    """How many blocks of the cluster lie along the cluster axes ``axes`` (they share a
    collective copy; ``pl.report`` counts its HBM bytes once per cluster, ``cost.py``);
    ``None`` where an axis is not bound while tracing (the lowering then names it)."""
    try:
        return math.prod(int(lax.axis_size(a)) for a in axes)
    except (NameError, KeyError, TypeError, ValueError):
        return None


def copy_smem_to_gmem(src: Any, dst: Any, *, commit_group: bool = True) -> None:
    """Starts a TMA copy of ``src`` (SMEM) into ``dst`` (GMEM); call ``commit_smem()`` after
    writing ``src`` and before this, and ``wait_smem_to_gmem`` before reusing ``src``.

    ``commit_group``: the copy closes a bulk group (with any copies issued before it with
    ``commit_group=False``), which ``wait_smem_to_gmem(n)`` counts; with ``False`` the group
    stays open until a later copy or ``plgpu.commit_smem_to_gmem_group()`` closes it.

    ``dst`` may be a ``plgpu.multicast_ref`` view: ``src`` then lands in ``dst`` on every
    device along its axes (``multimem_store``), complete on return."""
    from pallas_mosaic_gpu.multidevice import MulticastRef, multimem_store
    if isinstance(dst, MulticastRef):
        _check_copy(src, dst.ref, "copy_smem_to_gmem", "SMEM", "GMEM")
        multimem_store(src[...], dst.ref, dst.collective_axes)
        return
    _check_copy(src, dst, "copy_smem_to_gmem", "SMEM", "GMEM")
    bind_views(copy_smem_to_gmem_p, [src, dst], [], "copy_smem_to_gmem",
               commit_group=bool(commit_group))


def wait_smem_to_gmem(n: int, wait_read_only: bool = False) -> None:
    """Waits until at most ``n`` SMEM -> GMEM copies are pending (``wait_read_only``: until
    their sources may be overwritten)."""
    if not isinstance(n, int) or n < 0:
        raise PallasError(f"plgpu.wait_smem_to_gmem({n!r}): expected an int >= 0.")
    wait_smem_to_gmem_p.bind(tree=jax.tree_util.tree_structure(()), roles=(), n=n,
                             read_only=bool(wait_read_only))


def commit_smem() -> None:
    """Makes this warpgroup's writes to SMEM visible to the TMA engine."""
    commit_smem_p.bind(tree=jax.tree_util.tree_structure(()), roles=())


def barrier_arrive(barrier: Any) -> None:
    """Arrives on ``barrier`` (one of its ``num_arrivals``)."""
    _check_barrier(barrier, "barrier_arrive")
    bind_views(barrier_arrive_p, [barrier], [], "barrier_arrive")


def barrier_wait(barrier: Any) -> None:
    """Waits until ``barrier`` completes its current phase."""
    _check_barrier(barrier, "barrier_wait")
    bind_views(barrier_wait_p, [barrier], [], "barrier_wait")


def wgmma(acc: Any, a: Any, b: Any) -> None:
    """``acc += a @ b`` with warpgroup matrix-multiply-accumulate (asynchronous: reading
    ``acc`` waits for it; ``wgmma_wait(n)`` leaves at most ``n`` in flight).

    ``acc`` is a ``plgpu.ACC`` Ref (M, N); ``a`` an SMEM Ref or a value (M, K) in a 16-bit
    float dtype; ``b`` an SMEM Ref (K, N) of the same dtype. The SMEM operands' two minor
    dimensions must be multiples of 64 (so that they are tiled for wgmma).
    """
    acc_aval, acc_ref = _aval(acc, "wgmma")
    if _space_name(acc_ref) != "ACC":
        raise PallasError("plgpu.wgmma: the accumulator must be a plgpu.ACC Ref, found a Ref in "
                          f"{_space_name(acc_ref)}. Fix: allocate it with plgpu.ACC((M, N)).")
    a_is_ref = isinstance(plb.typeof(_ref_and_transforms(a, None, "wgmma")[0]
                                      if not isinstance(a, jax.Array) else a),
                          plb.AbstractRef)
    a_aval = _aval(a, "wgmma")[0] if a_is_ref else jnp.asarray(a)
    b_aval = _aval(b, "wgmma")[0]
    (m, k), (k2, n) = a_aval.shape, b_aval.shape
    if k != k2 or (m, n) != acc_aval.shape or a_aval.dtype != b_aval.dtype:
        raise PallasError(f"plgpu.wgmma: acc {list(acc_aval.shape)} += a {a_aval.dtype}"
                          f"{list(a_aval.shape)} @ b {b_aval.dtype}{list(b_aval.shape)} does "
                          "not fit: expected acc (M, N), a (M, K), b (K, N), a and b of one "
                          "dtype.")
    views = [acc, a, b] if a_is_ref else [acc, b]
    extra = [] if a_is_ref else [jnp.asarray(a)]
    bind_views(wgmma_p, views, extra, "wgmma", a_is_ref=a_is_ref)


def wgmma_wait(n: int) -> None:
    """Waits until at most ``n`` wgmma groups are in flight."""
    if not isinstance(n, int) or n < 0:
        raise PallasError(f"plgpu.wgmma_wait({n!r}): expected an int >= 0.")
    wgmma_wait_p.bind(tree=jax.tree_util.tree_structure(()), roles=(), n=n)


# --- reference semantics ---------------------------------------------------------------------


def _simple_indexer(t: Any) -> bool:
    return isinstance(t, plb.NDIndexer) and not t.int_indexer_shape and all(
        (isinstance(i, plb.Slice) and isinstance(i.stride, int) and i.stride == 1)
        or getattr(i, "shape", ()) == () for i in t.indices)


def _fold(outer: Any, inner: Any) -> Any:
    """One indexer for ``inner`` applied to the view ``outer`` makes (starts add up)."""
    rest = iter(inner.indices)
    indices = []
    for i in outer.indices:
        if not isinstance(i, plb.Slice):
            indices.append(i)
            continue
        j = next(rest, None)
        if j is None:
            indices.append(i)
        elif isinstance(j, plb.Slice):
            indices.append(plb.Slice(i.start + j.start, j.size, 1))
        else:
            indices.append(i.start + j)
    return plb.NDIndexer(tuple(indices), outer.shape, (), validate=False)


def _window(transforms: Any) -> tuple[Any, ...]:
    """A copy's GMEM view with its successive indexers folded into one, as a TMA copy
    addresses it (one box of the whole array): ``ref.at[pl.ds(s, k)].at[pl.ds(i, 64)]`` reads
    rows ``s + i`` on, even where the outer window alone would run past the array's end
    (transposed_ragged_dot's groups), which the interpreter would otherwise clamp."""
    if any(isinstance(t, plb.PeerRefTransform) for t in transforms):
        raise UnsupportedError("a TMA copy to or from another device's memory (plgpu.remote_ref) "
                          "is not supported by the interpreter; the mosaic_gpu backend lowers "
                          "it. Fix: lower the kernel for cuda, or exchange the data with "
                          "collectives (jax.lax.all_gather under shard_map).")
    out: list[Any] = []
    for t in transforms:
        if out and _simple_indexer(out[-1]) and _simple_indexer(t):
            out[-1] = _fold(out[-1], t)
        else:
            out.append(t)
    return tuple(out)


def _copy_in(in_avals: Any, out_avals: Any, *args: Any, tree: Any, roles: Any,
             collective_axes: Any = None, leader_tracked: Any = None, **_: Any) -> Any:
    if leader_tracked is not None:
        from pallas_mosaic_gpu.cluster import refused_in_interpreter
        raise refused_in_interpreter(f"plgpu.copy_gmem_to_smem(leader_tracked="
                                     f"{leader_tracked!r})")
    # A multicast copy (collective_axes alone) gives each block what a copy of its own would.
    state = RefViews(args, tree, roles)
    state.write(_DST, state.read(_SRC, _window(state.transforms[_SRC])))
    state.write(_BARRIER, state.read(_BARRIER) + 1)
    return state.new_values(), []


def _copy_in_axes(in_avals: Any, *, collective_axes: Any = None, leader_tracked: Any = None,
                  **_: Any) -> tuple[str, ...]:
    """A leader-tracked copy reaches the first block's barrier (``PrimitiveSemantics.
    cluster``); a multicast copy gives each block what a copy of its own would."""
    return tuple(collective_axes or ()) if leader_tracked is not None else ()


def _copy_in_cross(in_avals: Any, out_avals: Any, *args: Any, stacked: Any, marks: Any,
                   block: Any, tree: Any, roles: Any, collective_axes: Any = None,
                   leader_tracked: Any = None, **_: Any) -> Any:
    """A leader-tracked copy issued by block ``block``: it receives its part of the window
    (all of it where REPLICATED); the ``k``-th such copy of every block on a barrier meets,
    and the first block's barrier gets the arrival once all of them were issued (as the
    first block's barrier waits for every block's bytes on the hardware)."""
    from pallas_mosaic_gpu import cluster

    state = RefViews(args, tree, roles)
    views = cluster.block_views(state, stacked)
    n = len(views)
    bar = roles[_BARRIER]
    tallies = [state.with_values([m[c] if m is not None else None for m in marks])
               for c in range(n)]
    issued = []
    for c, (v, t) in enumerate(zip(views, tallies)):
        here = block == c
        src = v.read(_SRC, _window(v.transforms[_SRC]))
        if isinstance(leader_tracked, CopyPartition.PARTITIONED):
            d = leader_tracked.axis
            size = src.shape[d] // n
            src = lax.slice_in_dim(src, c * size, (c + 1) * size, axis=d)
        v.write(_DST, jnp.where(here, src, v.read(_DST)))
        count = t.read(_BARRIER)
        t.write(_BARRIER, jnp.where(here, count + 1, count))
        issued.append(t.read(_BARRIER))
    mine = jnp.stack(issued)[block]
    met = jnp.all(jnp.stack([i >= mine for i in issued]))
    views[0].write(_BARRIER, views[0].read(_BARRIER) + jnp.where(met, 1, 0))
    new_marks: list[Any] = [None] * len(marks)
    new_marks[bar] = jnp.stack([t.values[bar] for t in tallies])
    return cluster.restack(state, stacked, views), new_marks, []


def _copy_out(in_avals: Any, out_avals: Any, *args: Any, tree: Any, roles: Any,
              commit_group: bool = True) -> Any:
    state = RefViews(args, tree, roles)
    state.write(_DST, state.read(_SRC), _window(state.transforms[_DST]))
    return state.new_values(), []


def _arrive(in_avals: Any, out_avals: Any, *args: Any, tree: Any, roles: Any) -> Any:
    if getattr(getattr(in_avals[0], "memory_space", None), "collective_axes", ()):
        from pallas_mosaic_gpu.cluster import refused_in_interpreter
        raise refused_in_interpreter("plgpu.barrier_arrive on a plgpu.ClusterBarrier")
    state = RefViews(args, tree, roles)
    state.write(0, state.read(0) + 1)
    return state.new_values(), []


def _arrive_axes(in_avals: Any, **_: Any) -> tuple[str, ...]:
    """An arrival on a ClusterBarrier reaches the blocks along its axes."""
    return tuple(getattr(in_avals[0].memory_space, "collective_axes", ()) or ())


def _arrive_cross(in_avals: Any, out_avals: Any, *args: Any, stacked: Any, marks: Any,
                  block: Any, tree: Any, roles: Any) -> Any:
    """An arrival on a ClusterBarrier: one on the barrier of every block along its axes (the
    first block's alone where ``leader_tracked``)."""
    from pallas_mosaic_gpu import cluster

    state = RefViews(args, tree, roles)
    views = cluster.block_views(state, stacked)
    leader = bool(getattr(in_avals[0].memory_space, "leader_tracked", False))
    for v in views[:1] if leader else views:
        v.write(0, v.read(0) + 1)
    return cluster.restack(state, stacked, views), [None] * len(marks), []


def _wait(in_avals: Any, out_avals: Any, *args: Any, tree: Any, roles: Any) -> Any:
    state = RefViews(args, tree, roles)
    plb.check_wait(state.read(0), 1, "a plgpu barrier (no copy or arrival completed it)")
    return state.new_values(), []


def _no_op(ctx: Any, *args: Any, **params: Any) -> Any:
    return []


def _read_operand(state: RefViews, role: int) -> Any:
    """View ``role`` of a wgmma operand, whose last transforms may transpose it
    (``plgpu.transpose_ref``), which JAX's state discharge does not apply."""
    transforms = list(state.transforms[role])
    perms = []
    while transforms and type(transforms[-1]).__name__ == "TransposeTransform":
        perms.append(tuple(transforms.pop().permutation))
    x = state.read(role, tuple(transforms))
    for perm in reversed(perms):
        x = jnp.transpose(x, perm)
    return x


def _wgmma(in_avals: Any, out_avals: Any, *args: Any, tree: Any, roles: Any,
           a_is_ref: bool) -> Any:
    state = RefViews(args, tree, roles)
    acc = state.read(0)
    a = _read_operand(state, 1) if a_is_ref else state.rest[0]
    b = _read_operand(state, 2 if a_is_ref else 1)
    prod = lax.dot(a, b, preferred_element_type=acc.dtype,
                   precision=lax.Precision.HIGHEST)
    state.write(0, acc + prod)
    return state.new_values(), []


SEMANTICS: tuple[plb.PrimitiveSemantics, ...] = (
    plb.PrimitiveSemantics(copy_gmem_to_smem_p, discharge=_copy_in,
                                 cluster=_copy_in_axes, cross=_copy_in_cross),
    plb.PrimitiveSemantics(copy_smem_to_gmem_p, discharge=_copy_out),
    plb.PrimitiveSemantics(barrier_arrive_p, discharge=_arrive, cluster=_arrive_axes,
                                 cross=_arrive_cross),
    plb.PrimitiveSemantics(barrier_wait_p, discharge=_wait, phase_wait=True),
    plb.PrimitiveSemantics(wgmma_p, discharge=_wgmma),
    plb.PrimitiveSemantics(wait_smem_to_gmem_p, evaluate=_no_op),
    plb.PrimitiveSemantics(commit_smem_p, evaluate=_no_op),
    plb.PrimitiveSemantics(wgmma_wait_p, evaluate=_no_op),
    plb.PrimitiveSemantics(griddepcontrol_wait_p, evaluate=_no_op),
    plb.PrimitiveSemantics(griddepcontrol_launch_dependents_p, evaluate=_no_op),
)
