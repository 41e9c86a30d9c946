"""Warp specialisation: ``plgpu.emit_pipeline_warp_specialized`` and ``plgpu.set_max_registers``.

A warp-specialised pipeline splits the warpgroups of a block (the kernel's thread axis,
``wg_axis``): the last one (the memory warpgroup) only issues TMA copies of the input blocks
into a ring of ``max_concurrent_steps`` SMEM slots; the others (``num_compute_wgs`` compute
warpgroups) run ``body`` on every step. Two sets of mbarriers, one per slot, connect them:

* the memory warpgroup's copies complete a slot's *full* barrier (one arrival per input);
* each compute warpgroup arrives on a slot's *consumed* barrier once it is done with the slot
  (``delay_release`` steps later for ``plgpu.BlockSpec(delay_release=d)``), and the memory
  warpgroup waits for all of them before it refills the slot with the block ``max_concurrent_
  steps`` steps ahead. After its last copy it waits for the last arrivals, so that no barrier
  is left mid-phase. With ``manual_consumed_barriers`` every input has consumed barriers of its
  own, on which the body arrives itself, and each input's slot is refilled on its own.

The memory warpgroup gives registers up (``set_max_registers(memory_registers, action=
"decrease")``) and the compute warpgroups take them (``(512 - memory_registers) //
num_compute_wgs``, rounded down to a multiple of 8, at most 256).

Everything is written with this backend's primitives (copies, barriers, ``lax`` loops and
conditionals), so the lowering needs no rule of its own for the pipeline. The pipeline
branches on :func:`warpgroups_run_concurrently`: true in the lowering (only the
warp-specialised code is emitted) and where the interpreter runs a block's warpgroups each at
its own pace (``pallas_interpret.phases``: the hand-off between warpgroups is run as it is
written); false where the interpreter runs warpgroups one after another (a dynamic grid), so
that no warpgroup waits for another: there every compute warpgroup fetches its own blocks (a
plain pipeline with the same slots and barriers) and the memory warpgroup does nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import pallas_core as pl
from pallas_core import backend as plb
from pallas_core.backend import PallasError, UnsupportedError
from pallas_mosaic_gpu import primitives as gp
from pallas_mosaic_gpu.params import SMEM, Barrier
from pallas_mosaic_gpu.pipeline import _block_dims, _check_layout, _window

# --- primitives ----------------------------------------------------------------------------

set_max_registers_p = plb.Primitive("gpu_set_max_registers")
set_max_registers_p.multiple_results = True
set_max_registers_p.def_effectful_abstract_eval(lambda *, n, action: ([], {gp.GPU_SYNC}))

concurrent_p = plb.Primitive("gpu_warpgroups_run_concurrently")
concurrent_p.def_abstract_eval(lambda: plb.ShapedArray((), jnp.bool_))


def set_max_registers(n: int, *, action: str) -> None:
    """Sets the registers per thread of the calling warpgroup to ``n`` (PTX ``setmaxnreg``):
    ``action="decrease"`` gives registers up, ``"increase"`` takes them (a warpgroup waits
    until others gave enough). ``n`` is a multiple of 8 in [24, 256]. The interpreter does
    nothing here."""
    if action not in ("increase", "decrease"):
        raise PallasError(f"plgpu.set_max_registers(action={action!r}): expected 'increase' "
                          "or 'decrease'.")
    if not isinstance(n, int) or n % 8 or not 24 <= n <= 256:
        raise PallasError(f"plgpu.set_max_registers({n!r}): the register count must be a "
                          "multiple of 8 in [24, 256] (PTX setmaxnreg).")
    set_max_registers_p.bind(n=n, action=action)


def warpgroups_run_concurrently() -> Any:
    """A boolean scalar: true where the warpgroups of a block run at the same time (the
    Mosaic GPU lowering, which folds the branch it decides away, and the interpreter where it
    runs them each at its own pace: ``ReferenceContext.own_pace``), false where the
    interpreter runs them one after another."""
    return concurrent_p.bind()


SEMANTICS = (
    plb.PrimitiveSemantics(set_max_registers_p, evaluate=lambda ctx, **params: []),
    plb.PrimitiveSemantics(concurrent_p,
                                 evaluate=lambda ctx: jnp.bool_(bool(ctx.own_pace))),
)


# --- the pipeline --------------------------------------------------------------------------


def _refuse(what: str, fix: str) -> UnsupportedError:
    return UnsupportedError(f"plgpu.emit_pipeline_warp_specialized: {what} is not supported by "
                            f"the mosaic_gpu backend. Fix: {fix}.")


def compute_registers(memory_registers: int, num_compute_wgs: int) -> int:
    """Registers per thread of each compute warpgroup: the 64K register file of an SM split
    among 128-thread warpgroups, less the memory warpgroup's, shared evenly, rounded down to
    a multiple of 8, at most 256."""
    per = min(256, (512 - memory_registers) // num_compute_wgs)
    return per - per % 8


class WarpSpecializedPipeline:
    """What :func:`emit_pipeline_warp_specialized` returns: call it with the GMEM Refs of
    the inputs (optionally ``allocations=`` from ``pl.run_scoped(**get_allocations(...))``)."""

    def __init__(self, body: Callable[..., Any], grid: tuple[int, ...], in_specs: tuple[Any, ...],
                 slots: int, delay: int, wg_axis: str, num_compute_wgs: int,
                 memory_registers: int, compute_context: Callable[..., Any] | None,
                 manual: bool = False) -> None:
        self.body, self.grid, self.in_specs = body, grid, in_specs
        self.steps = math.prod(grid)
        self.slots, self.delay = slots, delay
        self.wg_axis, self.num_compute_wgs = wg_axis, num_compute_wgs
        self.memory_registers = memory_registers
        self.compute_context = compute_context
        self.manual = manual
        """``manual_consumed_barriers``: a consumed barrier per input, given to the body, which
        arrives on them itself."""

    def _dims(self, refs: Sequence[Any]) -> list[tuple[tuple[int | None, ...], list[int]]]:
        if len(refs) != len(self.in_specs):
            raise PallasError(
                f"plgpu.emit_pipeline_warp_specialized: the pipeline has "
                f"{len(self.in_specs)} in_specs but got {len(refs)} GMEM Refs. Fix: pass one "
                "GMEM Ref per in_spec.")
        dims = [_block_dims(s, f"in_specs[{k}]", len(r.shape))
                for k, (s, r) in enumerate(zip(self.in_specs, refs))]
        for k, (s, (_, shape), r) in enumerate(zip(self.in_specs, dims, refs)):
            _check_layout(s, shape, r.dtype, f"in_specs[{k}]")
        return dims

    def get_allocations(self, *refs: Any) -> dict[str, Any]:
        """The SMEM the pipeline needs, to allocate with ``pl.run_scoped(..., collective_axes=
        wg_axis)`` (and pass back as ``allocations=``): per input ``max_concurrent_steps``
        slots of its block, one full barrier per slot (one arrival per input) and one consumed
        barrier per slot (one arrival per compute warpgroup)."""
        dims = self._dims(refs)
        return dict(
            flat_in_smem_refs=[SMEM((self.slots, *shape), r.dtype,
                                    transforms=getattr(s, "transforms", ()))
                               for s, (_, shape), r in zip(self.in_specs, dims, refs)],
            flat_out_smem_refs=[],
            in_smem_barrier_ref=Barrier(num_arrivals=len(refs), num_barriers=self.slots),
            flat_consumed_barrier_refs=[Barrier(num_arrivals=self.num_compute_wgs,
                                                num_barriers=self.slots)
                                        for _ in (refs if self.manual else refs[:1])])

    def __call__(self, *refs: Any, allocations: Any = None) -> None:
        dims = self._dims(refs)
        if allocations is None:
            pl.run_scoped(lambda allocs: self._run(refs, dims, allocs),
                          self.get_allocations(*refs), collective_axes=self.wg_axis)
        else:
            self._run(refs, dims, allocations)

    # --- the two roles

    def _unravel(self, step: Any) -> tuple[Any, ...]:
        out = []
        for g in reversed(self.grid):
            out.append(lax.rem(step, g))
            step = lax.div(step, g)
        return tuple(reversed(out))

    def _fetch(self, refs: Sequence[Any], dims: Any, bufs: Sequence[Any], full: Any,
               step: Any, slot: Any, only: int | None = None) -> None:
        idx = self._unravel(step)
        for k, (spec, ref, buf) in enumerate(zip(self.in_specs, refs, bufs)):
            if only is not None and k != only:
                continue
            window = _window(spec, dims[k][0], idx, f"in_specs[{k}]")
            gp.copy_gmem_to_smem(ref.at[window], buf.at[slot], full.at[slot])

    def _run(self, refs: Sequence[Any], dims: Any, allocs: Any) -> None:
        try:
            bufs = list(allocs["flat_in_smem_refs"])
            full = allocs["in_smem_barrier_ref"]
            consumed = list(allocs["flat_consumed_barrier_refs"])
            if len(consumed) != (len(refs) if self.manual else 1):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise PallasError(
                "plgpu.emit_pipeline_warp_specialized: allocations= must be what "
                "pl.run_scoped made of pipeline.get_allocations(*gmem_refs).") from None
        concurrent = warpgroups_run_concurrently()
        wg = lax.axis_index(self.wg_axis)

        @pl.when(wg == self.num_compute_wgs)
        def _memory() -> None:
            @pl.when(concurrent)
            def _issue() -> None:
                self._memory_role(refs, dims, bufs, full, consumed)

        @pl.when(wg != self.num_compute_wgs)
        def _compute() -> None:
            set_max_registers(compute_registers(self.memory_registers, self.num_compute_wgs),
                              action="increase")
            self._compute_role(refs, dims, bufs, full, consumed, concurrent)

    def _memory_role(self, refs: Sequence[Any], dims: Any, bufs: Sequence[Any], full: Any,
                     consumed: list[Any]) -> None:
        set_max_registers(self.memory_registers, action="decrease")
        for s in range(self.slots):
            self._fetch(refs, dims, bufs, full, jnp.int32(s), s)

        def refill(step: Any, _: Any) -> None:
            slot = lax.rem(step, self.slots)
            if self.manual:  # each input's slot is refilled once it is released
                for k, bar in enumerate(consumed):
                    gp.barrier_wait(bar.at[slot])
                    self._fetch(refs, dims, bufs, full, step + self.slots, slot, only=k)
            else:
                gp.barrier_wait(consumed[0].at[slot])  # every compute warpgroup is done
                self._fetch(refs, dims, bufs, full, step + self.slots, slot)

        lax.fori_loop(0, self.steps - self.slots, refill, None)

        def quiesce(step: Any, _: Any) -> None:  # the arrivals no refill waited for
            for bar in consumed:
                gp.barrier_wait(bar.at[lax.rem(step, self.slots)])

        lax.fori_loop(self.steps - self.slots, self.steps - self.delay, quiesce, None)

    def _compute_role(self, refs: Sequence[Any], dims: Any, bufs: Sequence[Any], full: Any,
                      consumed: list[Any], concurrent: Any) -> None:
        called: list[bool] = []

        def run_steps(values: list[Any], rebuild: Callable[[Any], Any],
                      sequential: bool) -> list[Any]:
            def step_fn(step: Any, carried: list[Any]) -> list[Any]:
                slot = lax.rem(step, self.slots)
                if sequential:  # warpgroups one after another: this one fetches its own blocks
                    self._fetch(refs, dims, bufs, full, step, slot)
                gp.barrier_wait(full.at[slot])
                released = lax.rem(step - self.delay, self.slots)
                views = [b.at[slot] for b in bufs]
                if self.manual:  # the body releases the slots itself
                    views += [bar.at[released] for bar in consumed]
                if self.compute_context is None:
                    self.body(self._unravel(step), *views)
                    new_values = carried
                else:
                    new = self.body(self._unravel(step), *views, rebuild(carried))
                    new_values = _split(new)[0]
                if not sequential and not self.manual:  # step - delay_release's slot is free

                    @pl.when(step >= self.delay)
                    def _release() -> None:
                        gp.barrier_arrive(consumed[0].at[released])
                return new_values

            return list(lax.fori_loop(0, self.steps, step_fn, list(values)))

        def pipeline(init: Any = None) -> Any:
            if called:
                raise PallasError("plgpu.emit_pipeline_warp_specialized: compute_context "
                                  "called the pipeline twice. Fix: call it once.")
            called.append(True)
            values, rebuild = _split(init)
            final = lax.cond(concurrent, lambda v: run_steps(v, rebuild, False),
                             lambda v: run_steps(v, rebuild, True), values)
            return rebuild(final)

        if self.compute_context is None:
            pipeline()
        else:
            self.compute_context(pipeline)
            if not called:
                raise PallasError("plgpu.emit_pipeline_warp_specialized: compute_context "
                                  "never called the pipeline. Fix: call it (once) with the "
                                  "initial carry.")


def emit_pipeline_warp_specialized(
        body: Callable[..., Any], *, grid: Sequence[int], memory_registers: int,
        in_specs: Sequence[Any] = (), out_specs: Sequence[Any] = (),
        max_concurrent_steps: int = 2, wg_axis: str, num_compute_wgs: int,
        pipeline_state: Any = None, manual_consumed_barriers: bool = False,
        compute_context: Callable[..., Any] | None = None,
        memory_thread_idx: int | None = None) -> WarpSpecializedPipeline:
    """A pipeline over ``grid`` whose input blocks one warpgroup copies while the others
    compute, as JAX's ``plgpu.emit_pipeline_warp_specialized`` (see the module docstring).

    ``body(indices, *in_smem)`` runs on every step in each compute warpgroup; with
    ``compute_context`` (a function of the pipeline, run by the compute warpgroups only, that
    calls it once with the initial carry) the body takes the carry last and returns the next
    one. With ``manual_consumed_barriers`` each input has its own consumed barriers, passed
    to the body after the input Refs (the slot to release, ``delay_release`` steps back), and
    every compute warpgroup must arrive on each of them at every step; the memory warpgroup
    refills an input's slot once its barrier completes. Inputs only: ``out_specs``,
    ``pipeline_state`` and a memory warpgroup other than the last are refused.
    """
    in_specs = tuple(in_specs) if isinstance(in_specs, (list, tuple)) else (in_specs,)
    if out_specs not in ((), []):
        raise _refuse("out_specs (blocks stored from SMEM by the compute warpgroups)",
                      "store outputs in the body or in compute_context (plgpu.copy_smem_to_"
                      "gmem)")
    if pipeline_state is not None:
        raise _refuse("pipeline_state (a pipeline of pipelines)", "run separate pipelines")
    if memory_thread_idx not in (None, num_compute_wgs):
        raise _refuse(f"memory_thread_idx={memory_thread_idx} (the memory warpgroup must be "
                      "the last)", "drop memory_thread_idx")
    grid = tuple(grid)
    if not grid or not all(isinstance(g, int) and g > 0 for g in grid):
        raise PallasError(f"plgpu.emit_pipeline_warp_specialized: grid must be positive ints, "
                          f"found {grid}. Fix: a static grid such as (k_steps,).")
    if not in_specs:
        raise PallasError("plgpu.emit_pipeline_warp_specialized: no in_specs; the memory "
                          "warpgroup would have nothing to copy. Fix: give in_specs.")
    if not isinstance(num_compute_wgs, int) or num_compute_wgs < 1:
        raise PallasError(f"plgpu.emit_pipeline_warp_specialized(num_compute_wgs="
                          f"{num_compute_wgs!r}): expected an int >= 1.")
    if not isinstance(memory_registers, int) or memory_registers % 8 or \
            not 24 <= memory_registers <= 256:
        raise PallasError(f"plgpu.emit_pipeline_warp_specialized(memory_registers="
                          f"{memory_registers!r}): a multiple of 8 in [24, 256] (40 suits "
                          "H100).")
    delays = {int(getattr(s, "delay_release", 0)) for s in in_specs}
    if len(delays) > 1:
        raise _refuse(f"inputs with different delay_release {sorted(delays)}",
                      "give every input the same delay_release")
    delay = delays.pop()
    steps = math.prod(grid)
    slots = min(max_concurrent_steps, steps)
    if not isinstance(max_concurrent_steps, int) or max_concurrent_steps <= delay:
        raise PallasError(f"plgpu.emit_pipeline_warp_specialized: max_concurrent_steps="
                          f"{max_concurrent_steps!r} must be an int above delay_release="
                          f"{delay}.")
    if slots <= delay:
        raise PallasError(f"plgpu.emit_pipeline_warp_specialized: {steps} steps give "
                          f"{slots} slots, not more than delay_release={delay}. Fix: a "
                          "longer grid or a smaller delay_release.")
    for k, spec in enumerate(in_specs):
        if spec.index_map is not None and _ignores_grid(spec.index_map, len(grid)):
            raise _refuse(f"in_specs[{k}], whose block does not change along the grid",
                          "pass such an operand whole and copy it once before the pipeline")
    return WarpSpecializedPipeline(body, grid, in_specs, slots, delay, wg_axis,
                                   num_compute_wgs, memory_registers, compute_context,
                                   bool(manual_consumed_barriers))


def _split(tree: Any) -> tuple[list[Any], Callable[[Any], Any]]:
    """The carry's array leaves, and the function rebuilding the carry from new ones (Refs
    in the carry, such as a ``plgpu.ACC``, are not carried through loops: they stay)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    is_ref = [isinstance(plb.typeof(x), plb.AbstractRef) for x in leaves]

    def rebuild(values: Any) -> Any:
        it = iter(values)
        return jax.tree_util.tree_unflatten(
            treedef, [x if r else next(it) for x, r in zip(leaves, is_ref)])

    return [x for x, r in zip(leaves, is_ref) if not r], rebuild


def _ignores_grid(index_map: Callable[..., Any], n: int) -> bool:
    jaxpr = jax.make_jaxpr(index_map)(*[jnp.int32(0)] * n).jaxpr
    used = [v for e in jaxpr.eqns for v in e.invars] + list(jaxpr.outvars)
    return not any(u is v for u in used for v in jaxpr.invars)
