"""Blackwell (sm_100a) work scheduling: cluster launch control and warps of a warpgroup.

* ``dynamic_scheduling_loop(grid_names, *, thread_axis=None, cluster_axes=())``: a
  decorator; its body
  (``body(info: plgpu.NDLoopInfo)``) runs first for the grid point the block was launched for,
  then for each grid point the block claims from blocks not launched yet (cluster launch
  control, ``clusterlaunchcontrol.try_cancel``), until none is left. ``info.index`` is the grid
  point, ``info.local_index`` how many the block ran before. It is written with the primitives
  below, inside a ``pl.run_scoped`` that every warpgroup of the block shares (its
  ``collective_axes`` is the thread axis): a 2-slot answer buffer (16 bytes a slot) and two
  2-slot barriers, one completed when a claim is answered, one when every warpgroup read the
  answer (so that the slot can be reused). A claim is made for a whole cluster and answered
  in every block of it; with ``cluster_axes`` (every cluster axis) the second barrier is a
  ``plgpu.ClusterBarrier``, completed once every warpgroup of the cluster read the answer.
* ``try_cluster_cancel(result_ref, barrier)``: asks for the launch of another block; the
  answer lands in ``result_ref`` (16 bytes of SMEM) and completes ``barrier`` (each warpgroup
  arrives on it once). ``query_cluster_cancel(result_ref, grid_names=...)``: the grid point an
  answer holds and whether a block was claimed at all.
* ``pl.core_map(plgpu.WarpMesh(axis_name="warp"))``: inside a warpgroup, the body runs once per
  warp (4 of them), ``lax.axis_index("warp")`` telling which; a TMA copy, tcgen05_mma or
  tcgen05_commit_arrive in it is issued by one thread of the warp (not of the warpgroup), so
  that one warp can feed the tensor core while another issues copies.

Lowering (lane semantics, JAX's Mosaic GPU library): the loop is an ``scf.while`` carrying
the grid point, the claim's success and the step; the warp region is the warpgroup's code
between two warpgroup barriers, with the warp index ``warp_idx % 4``.

Reference semantics (the interpreter): ``query_cluster_cancel`` is a declared claim
(``PrimitiveSemantics.claim``). Where the interpreter runs a block's warpgroups each at its own
pace (``pallas_interpret.phases``: the loop's memory is shared by the thread axis), blocks run
one after another, so the first block claims every other grid point in order and the other
blocks, cancelled, never run. Elsewhere every block runs on its own and no claim succeeds (the
hardware's answer when every block is resident), each block running its own grid point. The
warps of a ``WarpMesh`` region run each at its own pace in the former case and are refused in
the latter. With ``cluster_axes`` the blocks of a cluster run together (the answers'
``ClusterBarrier`` reaches across them), so the first cluster claims every grid point and
each of its blocks runs them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.mosaic import gpu as mgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm

import pallas_core as pl
from pallas_core import backend as plb
from pallas_core.backend import PallasError, RefViews, UnsupportedError, bind_views
from pallas_mosaic_gpu import cluster, registry, values
from pallas_mosaic_gpu import primitives as gp
from pallas_mosaic_gpu.loops import NDLoopInfo
from pallas_mosaic_gpu.params import SMEM, Barrier, ClusterBarrier

try_cluster_cancel_p = gp._primitive("gpu_try_cluster_cancel")
query_cluster_cancel_p = plb.Primitive("gpu_query_cluster_cancel")
query_cluster_cancel_p.multiple_results = True
fence_p = plb.Primitive("gpu_proxy_fence")
fence_p.multiple_results = True
fence_p.def_effectful_abstract_eval(lambda *, release: ([], {gp.GPU_SYNC}))
warp_region_p = plb.Primitive("gpu_warp_region")
"""Marks where a ``WarpMesh`` body starts (``begin=True``) and ends in the kernel's jaxpr."""
warp_region_p.multiple_results = True
warp_region_p.def_effectful_abstract_eval(lambda *, axis_name, begin: ([], {gp.GPU_SYNC}))

ANSWER_BYTES = 16
SLOTS = 2


@query_cluster_cancel_p.def_effectful_abstract_eval
def _query_abstract(*avals: Any, grid_names: tuple[Any, ...], **_: Any) -> Any:
    outs = [plb.ShapedArray((), jnp.int32)] * len(grid_names) + [plb.ShapedArray((), jnp.bool_)]
    return outs, {plb.ReadEffect(0)}


PRIMITIVES = (try_cluster_cancel_p, query_cluster_cancel_p, fence_p, warp_region_p)
CLUSTER_LAUNCH_CONTROL = (try_cluster_cancel_p, query_cluster_cancel_p)


# --- the user's functions ----------------------------------------------------------------------


def _answer_aval(ref: Any, fn: str) -> Any:
    aval, base = gp._aval(ref, fn)
    if gp._space_name(base) != "SMEM" or \
            int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize != ANSWER_BYTES:
        raise PallasError(f"plgpu.{fn}: the answer buffer must be {ANSWER_BYTES} bytes of SMEM "
                          f"(plgpu.TryClusterCancelResult), found {aval.dtype}"
                          f"{list(aval.shape)} in {gp._space_name(base)}.")
    return aval


def try_cluster_cancel(result_ref: Any, barrier: Any) -> None:
    """Claims the grid point of a block not launched yet (every warpgroup of the block calls
    it); ``barrier`` completes once the answer is in ``result_ref``."""
    _answer_aval(result_ref, "try_cluster_cancel")
    gp._check_barrier(barrier, "try_cluster_cancel")
    bind_views(try_cluster_cancel_p, [result_ref, barrier], [], "try_cluster_cancel")


def query_cluster_cancel(result_ref: Any, grid_names: Sequence[Hashable]
                         ) -> tuple[tuple[Any, ...], Any]:
    """``(grid point, claimed)`` of the answer in ``result_ref`` (after waiting for the barrier
    of its ``try_cluster_cancel``); the grid point means nothing unless ``claimed``."""
    _answer_aval(result_ref, "query_cluster_cancel")
    *idx, ok = bind_views(query_cluster_cancel_p, [result_ref], [], "query_cluster_cancel",
                          grid_names=tuple(grid_names))
    return tuple(idx), ok


def TryClusterCancelResult(num_slots: int = 1) -> Any:
    """SMEM for ``num_slots`` answers of ``try_cluster_cancel`` (16 bytes each)."""
    return SMEM((num_slots, ANSWER_BYTES), jnp.uint8)


def dynamic_scheduling_loop(grid_names: Sequence[Hashable], *,
                            thread_axis: Hashable | None = None,
                            cluster_axes: Sequence[Any] = (),
                            init_carry: Any = None) -> Callable[[Callable[..., Any]], Any]:
    """A loop over grid points claimed at run time (see the module docstring), as a decorator
    of its body; with ``init_carry``, ``body(info, carry=...)`` returns the next carry and the
    decorator returns the last one."""
    grid_names = tuple(grid_names)
    threads = 1 if thread_axis is None else lax.axis_size(thread_axis)
    # The answer to a claim lands in every block of the cluster; with cluster_axes (all of
    # them) a slot is reused once every warpgroup of every block of the cluster read it.
    read = ClusterBarrier(collective_axes=tuple(cluster_axes), num_arrivals=threads,
                          num_barriers=SLOTS) if cluster_axes else \
        Barrier(num_arrivals=threads, num_barriers=SLOTS)

    def decorate(body: Callable[..., Any]) -> Any:
        def scoped(answers: Any, answered: Any, read: Any) -> Any:
            def more(carry: Any) -> Any:
                return carry[1]

            def step(carry: Any) -> Any:
                index, _, local, user = carry
                slot = lax.rem(local, jnp.int32(SLOTS))

                @pl.when(local >= SLOTS)
                def _reuse() -> None:  # every warpgroup read the answer held in this slot
                    gp.barrier_wait(read.at[slot])
                    fence_p.bind(release=False)

                try_cluster_cancel(answers.at[slot], answered.at[slot])
                info = NDLoopInfo(index=index, local_index=local, num_local_steps=None)
                if init_carry is None:
                    body(info)
                else:
                    user = body(info, carry=user)
                gp.barrier_wait(answered.at[slot])
                nxt, claimed = query_cluster_cancel(answers.at[slot], grid_names)
                fence_p.bind(release=True)
                gp.barrier_arrive(read.at[slot])
                return nxt, claimed, local + 1, user

            start = tuple(lax.axis_index(n) for n in grid_names)
            _, _, steps, user = lax.while_loop(
                more, step, (start, jnp.bool_(True), jnp.int32(0), init_carry))

            def drain(k: Any, c: Any) -> Any:  # the reads of the last answers
                gp.barrier_wait(read.at[k])
                return c

            lax.fori_loop(jnp.int32(0), jnp.minimum(steps, SLOTS), drain, None)
            return user

        return pl.run_scoped(
            scoped, TryClusterCancelResult(SLOTS),
            Barrier(num_arrivals=threads, num_barriers=SLOTS), read,
            collective_axes=() if thread_axis is None else thread_axis)

    return decorate


@dataclasses.dataclass(frozen=True)
class WarpMesh:
    """The 4 warps of a warpgroup, for ``pl.core_map`` inside a kernel: the body runs once per
    warp, ``lax.axis_index(axis_name)`` giving the warp (0 to 3)."""

    axis_name: Hashable
    NUM_WARPS = 4

    @property
    def shape(self) -> dict[Hashable, int]:
        return {self.axis_name: self.NUM_WARPS}

    def map_inside_kernel(self, fn: Callable[[], Any]) -> None:
        """Runs the body of ``pl.core_map(self)`` in place (see the module docstring)."""
        if plb.current_kernel_context() is None:
            raise PallasError("pl.core_map over plgpu.WarpMesh runs inside a kernel body (a "
                              "warpgroup's code), not outside one. Fix: call it in the body "
                              "of a plgpu.kernel.")
        axes = [(self.axis_name, self.NUM_WARPS)]

        def flat() -> list[Any]:
            fn()
            return []

        # A dry run first: a warp holds scalars, not the warpgroup's arrays.
        jaxpr, _, _ = plb.trace_to_jaxpr(flat, [], name="warp_mesh_body",
                                         axis_sizes=axes)  # type: ignore[arg-type]
        for eqn in plb.all_eqns(jaxpr):
            arrays = [v.aval for v in eqn.outvars
                      if not isinstance(v.aval, plb.AbstractRef)
                      and tuple(getattr(v.aval, "shape", None) or ())]
            if arrays:
                raise UnsupportedError(
                    f"pl.core_map over plgpu.WarpMesh: {eqn.primitive.name} makes an array "
                    f"{arrays[0].str_short()} inside the body; a warp here holds scalars and "
                    "Refs only (arrays are a warpgroup's). Fix: issue copies and tensor-core "
                    "work from the warps, and compute on arrays outside the pl.core_map.")
        warp_region_p.bind(axis_name=self.axis_name, begin=True)
        with plb.extend_axis_env(axes):  # type: ignore[arg-type]
            out = fn()
        if out is not None:
            raise PallasError("pl.core_map over plgpu.WarpMesh: the body returns nothing "
                              "(write results to Refs).")
        warp_region_p.bind(axis_name=self.axis_name, begin=False)


# --- reference semantics -----------------------------------------------------------------------


def _try_cancel(in_avals: Any, out_avals: Any, *args: Any, tree: Any, roles: Any) -> Any:
    state = RefViews(args, tree, roles)
    answer = state.read(0)
    state.write(0, jnp.zeros_like(answer))  # no block claimed
    state.write(1, state.read(1) + 1)  # this warpgroup's arrival
    return state.new_values(), []


def _query(in_avals: Any, out_avals: Any, *args: Any, tree: Any, roles: Any,
           grid_names: Any) -> Any:
    state = RefViews(args, tree, roles)
    claimed = jnp.any(state.read(0) != 0)
    return state.new_values(), [jnp.int32(0)] * len(grid_names) + [claimed]


def _warp_region(ctx: Any, **params: Any) -> Any:
    raise UnsupportedError(
        "pl.core_map over plgpu.WarpMesh (a body per warp of a warpgroup) cannot run in the "
        "interpreter: its warps wait for one another and would have to run each at its own "
        "pace, which the interpreter does only for warpgroups. Fix: lower it for a GPU "
        "(backend='mosaic_gpu'), or write the warps' work per warpgroup (num_threads=).")


SEMANTICS: tuple[plb.PrimitiveSemantics, ...] = (
    plb.PrimitiveSemantics(try_cluster_cancel_p, discharge=_try_cancel),
    plb.PrimitiveSemantics(query_cluster_cancel_p, discharge=_query, claim=True),
    plb.PrimitiveSemantics(fence_p, evaluate=gp._no_op),
    plb.PrimitiveSemantics(
        warp_region_p, evaluate=_warp_region,
        fork=lambda *, axis_name, begin: (axis_name, WarpMesh.NUM_WARPS, begin)),
)


# --- lowering ----------------------------------------------------------------------------------


def _views(state: Any, eqn: Any, args: Any) -> list[Any]:
    from pallas_mosaic_gpu.blackwell import _role_views
    return _role_views(state, eqn, args)


def _is_first_warpgroup() -> Any:
    return arith.cmpi(arith.CmpIPredicate.eq, values.i32(mgpu.warpgroup_idx(sync=True)),
                      values.i32(0))


@registry.rule(try_cluster_cancel_p, lazy=True)
def _try_cancel_rule(state: Any, eqn: Any, *args: Any, **_: Any) -> Any:
    answer, bar = _views(state, eqn, args)
    first_wg = _is_first_warpgroup()
    leader = values.one_thread(mgpu.ThreadSubset.WARPGROUP)
    # Each warpgroup arrives once; the first one also expects the answer's bytes.
    nbytes = arith.select(first_wg, values.i32(ANSWER_BYTES), values.i32(0))
    bar.barrier.arrive_expect_tx(nbytes, predicate=leader)
    first_block = values.literal(True, plb.ShapedArray((), jnp.bool_))
    for dim in cluster.DIMS:
        first_block = arith.andi(first_block, cluster.is_first_block(dim))
    mgpu.try_cluster_cancel(answer.memref, bar.barrier,
                            predicate=arith.andi(arith.andi(leader, first_wg), first_block))
    return []


@registry.rule(query_cluster_cancel_p, lazy=True)
def _query_rule(state: Any, eqn: Any, *args: Any, grid_names: Any, **_: Any) -> Any:
    (answer,) = _views(state, eqn, args)
    x, y, z, ok = mgpu.query_cluster_cancel(answer.memref)
    mesh = getattr(state.call.compiler_params, "mesh", None)
    if mesh is None:
        raise state.fail("plgpu.query_cluster_cancel outside a plgpu.kernel")
    blocks = [x, y, z]
    names = list(mesh.grid_names)
    found = []
    for name in grid_names:
        if name not in names:
            raise state.fail(f"plgpu.query_cluster_cancel of {name!r}, not a grid axis of the "
                             f"kernel ({names})")
        d = names.index(name)
        c = mesh.cluster[d] if d < len(mesh.cluster) else 1
        found.append(arith.divui(blocks[d], values.i32(c)) if c > 1 else blocks[d])
    return [*found, ok]


_ACQUIRE = "fence.proxy.async::generic.acquire.sync_restrict::shared::cluster.cluster;"
_RELEASE = "fence.proxy.async::generic.release.sync_restrict::shared::cta.cluster;"


@registry.rule(fence_p)
def _fence_rule(state: Any, eqn: Any, *, release: bool) -> Any:
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [], _RELEASE if release else _ACQUIRE, "",
                    has_side_effects=True)
    return []


@registry.rule(warp_region_p)
def _warp_region_rule(state: Any, eqn: Any, *, axis_name: Any, begin: bool) -> Any:
    # The warps' async work (copies, tensor-core ops) is ordered with the warpgroup's by a
    # warpgroup barrier on both sides of the region.
    mgpu.warpgroup_barrier()
    if begin:
        if state.warp_axis is not None:
            raise state.fail("pl.core_map over plgpu.WarpMesh inside another one")
        state.warp_axis = axis_name
        state.axes[axis_name] = arith.remui(values.i32(mgpu.warp_idx(sync=True)),
                                            values.i32(WarpMesh.NUM_WARPS))
    else:
        state.axes.pop(axis_name, None)
        state.warp_axis = None
    return []


def issuing_thread(state: Any) -> Any:
    """The thread that issues a single-thread operation (a TMA copy, a tcgen05 op): one of the
    warpgroup, or of the warp inside a ``WarpMesh`` region."""
    subset = mgpu.ThreadSubset.WARP if getattr(state, "warp_axis", None) is not None else \
        mgpu.ThreadSubset.WARPGROUP
    return values.one_thread(subset)


__all__ = ["NDLoopInfo", "TryClusterCancelResult", "WarpMesh", "dynamic_scheduling_loop",
           "query_cluster_cancel", "try_cluster_cancel"]
