"""Runs a ``pallas_call`` as plain JAX: a loop over the grid in lexicographic order.

Each step fetches every operand's block through its index map, evaluates the discharged
kernel on the blocks, and writes the output blocks back. Edge blocks are padded on read and
cut off on write; outputs that are revisited accumulate because each step reads the current
contents of its output block; scratch buffers persist across steps. Where it is proven safe,
:mod:`pallas_interpret.fast` runs the same computation batched instead; kernels whose points
wait for each other run in the runners of :mod:`~pallas_interpret.handshake`,
:mod:`~pallas_interpret.phases` and :mod:`~pallas_interpret.lockstep`. :data:`RUNNERS` says which
runner runs which kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import io_callback

from pallas_core import backend as plb
from pallas_core.backend import KernelCall, ReferenceContext, UnsupportedError, fresh_buffer
from pallas_interpret import (
    blocks,
    checks,
    fast,
    handshake,
    lockstep,
    phases,
    skip_float,
    step_order,
)
from pallas_interpret.params import InterpretParams


def run(call: KernelCall, args: Sequence[Any], rules: plb.SemanticsRules,
        params: InterpretParams | None = None) -> list[Any]:
    """The outputs of ``call`` on ``args`` (the primitive's operands: inputs, then the sizes
    of dynamic grid axes), run by the first runner of :data:`RUNNERS` that applies."""
    params = params or InterpretParams()
    if plb.find_eqn(call.jaxpr.jaxpr, {plb.get_global_p}) is not None:
        raise UnsupportedError(
            f"kernel {call.name!r} uses pl.get_global (a Ref every block of the kernel "
            "shares), which the interpreter does not support: it runs a kernel's blocks one "
            "after another, so blocks waiting for each other's signals on a shared semaphore "
            "would wait for signals not yet sent. Fix: lower the kernel for its hardware, or "
            "give each block its own semaphores (scratch_shapes).")
    # parallel_axes naming an axis the grid lacks is an error, whichever runner runs.
    params.resolved_parallel_axes(call.grid_mapping.user_grid, call.compiler_params, call.name)
    if params.skip_floating_point_ops:
        call = call.replace(jaxpr=skip_float.transform(call.jaxpr, call.grid_mapping.axis_env))
    runner, fit = choose(call, params)
    return runner.run(call, args, rules, params, fit)


# --- which runner runs a kernel -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Runner:
    """One way to run a kernel: a row of :data:`RUNNERS`."""

    name: str
    applies: Callable[[KernelCall, InterpretParams], Any]
    """``applies(call, params)``: what :attr:`run` needs for ``call`` (its axes, its plan;
    ``True`` when nothing), or ``None`` when this runner does not apply. It raises
    ``UnsupportedError`` for a kernel only this runner could run, when it cannot."""
    run: Callable[[KernelCall, Sequence[Any], plb.SemanticsRules, InterpretParams, Any],
                  list[Any]]
    """``run(call, args, rules, params, fit)``, ``fit`` being what :attr:`applies` gave."""
    reason: str
    """Why this runner, for the kernels it applies to."""


def _signals_cores(call: KernelCall, params: InterpretParams) -> bool | None:
    return True if handshake.signals_cores(call) else None


def _shares_memory(call: KernelCall, params: InterpretParams) -> tuple[int, ...] | None:
    shared = phases.group_axes(call)
    if shared is None and not call.grid_mapping.dynamic_axes:
        phases.check_no_fork(call)  # warp regions (sub-points) run in this runner only
    return shared


def _meets_at_barriers(call: KernelCall, params: InterpretParams) -> tuple[int, ...] | None:
    if call.grid_mapping.dynamic_axes:
        if lockstep.barrier_axes(call) is not None:
            raise UnsupportedError(
                f"kernel {call.name!r} has barriers and a dynamic grid "
                f"{call.grid_mapping.user_grid}; the interpreter runs barriers on static grids "
                "only. Fix: give the grid int sizes.")
        return None
    axes = lockstep.lockstep_axes(call)
    if axes is not None and (params.num_cores > 1 or params.grid_point_recorder is not None):
        raise UnsupportedError(
            f"kernel {call.name!r} has barriers, so the interpreter runs its points in "
            "lockstep, and then simulates neither several cores nor a grid_point_recorder. "
            "Fix: use num_cores_or_threads=1 and no grid_point_recorder for this kernel.")
    return axes


def _batches(call: KernelCall, params: InterpretParams) -> fast.Plan | None:
    if not params.fast or (params.checked or params.tpu_memory or params.num_cores > 1
                           or params.shuffle_seed is not None or params.grid_point_recorder):
        return None  # each asks for steps one after another, in their order and on their cores
    return fast.plan(call)


def _always(call: KernelCall, params: InterpretParams) -> bool:
    return True


RUNNERS: tuple[Runner, ...] = (
    Runner("handshake", _signals_cores,
           lambda call, args, rules, params, _: handshake.run(call, args, rules, params),
           "a core may wait for a semaphore signal that another core sends later in its own "
           "program, which no one-core-after-another order meets: each core runs at its own "
           "pace"),
    Runner("phases", _shares_memory,
           lambda call, args, rules, params, shared: phases.run(call, args, rules, params,
                                                                shared),
           "points that share memory (GPU warpgroups, warps, a cluster's blocks) wait on each "
           "other's barrier arrivals, so each runs at its own pace, group after group"),
    Runner("lockstep", _meets_at_barriers,
           lambda call, args, rules, params, axes: lockstep.run(call, args, rules, params,
                                                                axes),
           "points that meet at barriers (SparseCore subcores) run phase by phase, every point "
           "reaching a barrier before any passes it"),
    Runner("fast", _batches,
           lambda call, args, rules, params, plan: fast.run(call, args, plan, rules),
           "no output block is revisited along the parallel axes and the kernel has no "
           "effects, so those axes run as one vmapped evaluation, the same result as steps"),
    Runner("exact", _always,
           lambda call, args, rules, params, _: run_exact(call, args, rules, params),
           "every other kernel (dynamic grids, scratch, effects, checked or TPU-memory mode, "
           "shuffled or several-core orders): one grid step after another, the reference"),
)
"""How the interpreter runs a kernel: one row per runner, in order of preference; the first
whose predicate applies runs it (:func:`choose`)."""


def choose(call: KernelCall, params: InterpretParams) -> tuple[Runner, Any]:
    """The first row of :data:`RUNNERS` that applies to ``call`` under ``params``, and what it
    needs to run it."""
    for runner in RUNNERS:
        fit = runner.applies(call, params)
        if fit is not None:
            return runner, fit
    raise AssertionError("the last runner applies to every kernel")


def _split_grid_sizes(call: KernelCall, args: Sequence[Any]) -> tuple[list[Any], tuple[Any, ...]]:
    """The call's inputs, and its full grid with each dynamic size taken from the operands."""
    gm = call.grid_mapping
    n = len(args) - gm.num_dynamic_grid_bounds
    return list(args[:n]), gm.resolved_grid([jnp.asarray(s, jnp.int32) for s in args[n:]])


def run_exact(call: KernelCall, args: Sequence[Any], rules: plb.SemanticsRules,
              params: InterpretParams | None = None) -> list[Any]:
    """The outputs of ``call`` on ``args`` (as for :func:`run`), one grid step after another,
    in the order and on the simulated cores of :mod:`pallas_interpret.step_order`."""
    params = params or InterpretParams()
    checked = params.checked
    gm = call.grid_mapping
    args, grid = _split_grid_sizes(call, args)
    parallel = params.resolved_parallel_axes(gm.user_grid, call.compiler_params,
                                               call.name)
    parallel = tuple(a + gm.num_batch_axes for a in parallel) + tuple(range(gm.num_batch_axes))
    sched = step_order.make(grid, parallel, params.shuffle_seed, params.num_cores, call.name)
    if not gm.dynamic_axes:
        if checked and params.detect_races:
            # With the TPU memory model, only steps on different simulated cores race.
            checks.check_races(call, parallel,
                               sched.cores_by_point() if params.tpu_memory else None,
                               warn=params.on_race == "warn")
        if params.tpu_memory:
            checks.check_revisits(call, sched.points(), sched.cores())
    kernel = checks.discharge(call, params)
    poison = params.poison
    ins, outs = blocks.initial_operands(call, args, poison)
    scratch0 = [fresh_buffer(a.inner_aval.shape, a.inner_aval.dtype, a.memory_space, poison)
                for a in gm.scratch_avals]
    n_in, n_out = gm.num_inputs, gm.num_outputs
    prefetch = list(args[:gm.num_scalar_prefetch])
    inputs = _InputBlocks(call, params)

    def step(k: Any, carry: tuple[Any, ...]) -> tuple[Any, ...]:
        outs, scratch, in_state, token = carry
        ids = sched.point(k)
        first = sched.first_of_core(k)
        if sched.num_cores > 1 and scratch:
            scratch = lax.cond(first, lambda: list(scratch0), lambda: list(scratch))
        scratch = [s0 if getattr(a.memory_space, "per_point", False) else s  # fresh each point
                   for s, s0, a in zip(scratch, scratch0, gm.scratch_avals)]
        if params.grid_point_recorder is not None:
            point = ids[gm.num_batch_axes:]
            token = io_callback(params.grid_point_recorder, jax.ShapeDtypeStruct((), jnp.int32),
                                token, jnp.stack(point).astype(jnp.int32) if point
                                else jnp.zeros(0, jnp.int32), sched.core(k).astype(jnp.int32))
        ctx = ReferenceContext(ids, grid, gm.num_batch_axes, gm.grid_names, checked)
        in_starts = [blocks.starts(bm, ids, prefetch, ctx, rules) for bm in gm.inputs]
        out_starts = [blocks.starts(bm, ids, prefetch, ctx, rules) for bm in gm.outputs]
        views = inputs.read(ins, outs, in_starts, in_state, first)
        views += [blocks.read_block(o, bm, s, poison)
                  for o, bm, s in zip(outs, gm.outputs, out_starts)]
        if checked:  # the blocks' indices are checked before the kernel's accesses
            checked_at = checks.check_block_indices(call, params, ids, in_starts + out_starts)
            if checked_at is not None:
                views = lax.optimization_barrier((views, checked_at))[0]
        results = plb.evaluate(kernel, [*views, *scratch], ctx, rules)
        new_outs = [blocks.write_block(o, bm, s, b) for o, bm, s, b in
                    zip(outs, gm.outputs, out_starts, results[n_in:n_in + n_out])]
        in_state = inputs.after(in_state, in_starts, results[:n_in])
        return new_outs, list(results[n_in + n_out:]), in_state, token

    carry = (outs, scratch0, inputs.initial(ins), jnp.int32(0))
    num_steps = sched.num_steps
    if not checked and not gm.dynamic_axes:  # once per call (checked mode: at every step)

        def windows_at(k: Any) -> tuple[Any, list[Any]]:
            ids = sched.point(k)
            ctx = ReferenceContext(ids, grid, gm.num_batch_axes, gm.grid_names, False)
            return ids, [blocks.starts(bm, ids, prefetch, ctx, rules)
                         for bm in (*gm.inputs, *gm.outputs)]

        token = checks.check_all_block_indices(call, params, num_steps, windows_at)
        if token is not None:
            carry = lax.optimization_barrier((carry, token))[0]
    if gm.dynamic_axes:  # the number of steps is a traced value
        carry = lax.fori_loop(jnp.int32(0), num_steps, step, carry)
    elif num_steps == 1:
        carry = step(jnp.int32(0), carry)
    elif num_steps > 1:
        carry = lax.fori_loop(0, num_steps, step, carry)
    outs = carry[0]
    return [blocks.unpad(o, bm) for o, bm in zip(outs, gm.outputs)]


class _InputBlocks:
    """How the steps see input blocks.

    By default a kernel's write to an input block stays visible to every later step that reads
    the block (it is written back to the input). With ``tpu_memory``, as on a TPU, each input
    has one block buffer, filled (from the output it is aliased to, if any) when its block
    index changes or a core starts; a kernel's writes to it last until then. With
    ``out_of_bounds_reads="uninitialized"`` the parts of a block outside its array read as
    uninitialized memory.
    """

    def __init__(self, call: KernelCall, params: InterpretParams) -> None:
        self.gm = call.grid_mapping
        self.tpu = params.tpu_memory
        self.poison = params.poison
        self.fill_outside = params.out_of_bounds_reads == "uninitialized"
        self.alias = dict(call.input_output_aliases)
        written = plb.written_invars(call.jaxpr.jaxpr)
        self.written = [j for j, v in enumerate(call.jaxpr.jaxpr.invars[:self.gm.num_inputs])
                        if v in written]

    def initial(self, ins: list[Any]) -> list[Any]:
        """The carried state: per input its block buffer and where that came from (TPU);
        else the inputs the kernel writes."""
        if self.tpu:
            return [(jnp.zeros(bm.ref_shape, bm.dtype), [jnp.int32(0)] * len(bm.array_shape))
                    for bm in self.gm.inputs]
        return [ins[j] for j in self.written]

    def _read(self, src: Any, bm: Any, where: Any) -> Any:
        if self.fill_outside:
            return blocks.read_block_filled(src, bm, where, self.poison)
        return blocks.read_block(src, bm, where, self.poison)

    def read(self, ins: list[Any], outs: list[Any], starts: list[Any], state: list[Any],
             first: Any) -> list[Any]:
        """The input blocks a step sees."""
        if not self.tpu:
            bufs = list(ins)
            for j, buf in zip(self.written, state):
                bufs[j] = buf
            return [self._read(b, bm, s) for b, bm, s in zip(bufs, self.gm.inputs, starts)]
        views = []
        for j, bm in enumerate(self.gm.inputs):
            block = self._read(outs[self.alias[j]] if j in self.alias else ins[j], bm, starts[j])
            cached, cached_starts = state[j]
            refill = first
            for a, b in zip(starts[j].starts, cached_starts):
                refill = refill | (jnp.asarray(a, jnp.int32) != b)
            views.append(lax.select(jnp.broadcast_to(refill, block.shape), block, cached))
        return views

    def after(self, state: list[Any], starts: list[Any], results: Sequence[Any]) -> list[Any]:
        """The state after a step whose kernel left ``results`` in the input blocks."""
        if self.tpu:
            return [(r, [jnp.asarray(s, jnp.int32) for s in st.starts])
                    for r, st in zip(results, starts)]
        return [blocks.write_block(x, self.gm.inputs[j], starts[j], results[j])
                for j, x in zip(self.written, state)]


def run_jitted(call: KernelCall, rules: plb.SemanticsRules,
               params: InterpretParams | None = None) -> Any:
    """A jitted function of the call's operands (for inspection stages)."""
    return jax.jit(lambda *args: run(call, args, rules, params))
