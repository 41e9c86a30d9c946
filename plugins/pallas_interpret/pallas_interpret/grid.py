"""Runs a ``pallas_call`` as plain JAX: a loop over the grid in lexicographic order.

Each step fetches every operand's block through its index map, evaluates the discharged
kernel on the blocks, and writes the output blocks back. Edge blocks are padded on read and
cut off on write; outputs that are revisited accumulate because each step reads the current
contents of its output block; scratch buffers persist across steps. Where it is proven safe,
:mod:`pallas_interpret.fast` runs the same computation batched instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_core import reference
from pallas_core.errors import UnsupportedError
from pallas_core.request import KernelCall
from pallas_core.semantics import ReferenceContext, fresh_buffer
from pallas_interpret import blocks, checks, fast, lockstep
from pallas_interpret.params import InterpretParams


def run(call: KernelCall, args: Sequence[Any], rules: reference.Rules,
        params: InterpretParams | None = None) -> list[Any]:
    """The outputs of ``call`` on ``args`` (the primitive's operands: inputs, then the sizes
    of dynamic grid axes): batched where that is proven safe and allowed by ``params``, else
    step by step."""
    params = params or InterpretParams()
    if call.grid_mapping.dynamic_axes:
        if lockstep.barrier_axes(call) is not None:
            raise UnsupportedError(
                f"kernel {call.name!r} has barriers and a dynamic grid "
                f"{call.grid_mapping.user_grid}; the interpreter runs barriers on static grids "
                "only. Fix: give the grid int sizes.")
        return run_exact(call, args, rules, params)
    axes = lockstep.lockstep_axes(call)
    if axes is not None:
        return lockstep.run(call, args, rules, params, axes)
    if params.fast and not params.checked and params.shuffle_seed is None:
        plan = fast.plan(call)
        if plan is not None:
            return fast.run(call, args, plan, rules)
    return run_exact(call, args, rules, params)


def _shuffled_order(grid: tuple[int, ...], axes: Sequence[int], seed: int) -> list[Any]:
    """Per grid axis, a permutation of its indices (``None``: in order, for axes not in
    ``axes``)."""
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.permutation(n), jnp.int32) if a in axes else None
            for a, n in enumerate(grid)]


def _split_grid_sizes(call: KernelCall, args: Sequence[Any]) -> tuple[list[Any], tuple[Any, ...]]:
    """The call's inputs, and its full grid with each dynamic size taken from the operands."""
    gm = call.grid_mapping
    n = len(args) - gm.num_dynamic_grid_bounds
    return list(args[:n]), gm.resolved_grid([jnp.asarray(s, jnp.int32) for s in args[n:]])


def run_exact(call: KernelCall, args: Sequence[Any], rules: reference.Rules,
              params: InterpretParams | None = None) -> list[Any]:
    """The outputs of ``call`` on ``args`` (as for :func:`run`), one grid step after another."""
    params = params or InterpretParams()
    checked = params.checked
    gm = call.grid_mapping
    args, grid = _split_grid_sizes(call, args)
    parallel = params.resolved_parallel_axes(gm.user_grid, call.compiler_params)
    parallel = tuple(a + gm.num_batch_axes for a in parallel) + tuple(range(gm.num_batch_axes))
    if checked:
        checks.check_races(call, parallel)
    kernel = checks.discharge(call, checked)
    ins, outs = blocks.initial_operands(call, args, checked)
    scratch = [fresh_buffer(a.inner_aval.shape, a.inner_aval.dtype, a.memory_space, checked)
               for a in gm.scratch_avals]
    n_in, n_out = gm.num_inputs, gm.num_outputs
    prefetch = list(args[:gm.num_scalar_prefetch])
    if params.shuffle_seed is not None and any(a in parallel for a in gm.dynamic_axes):
        raise UnsupportedError(
            f"kernel {call.name!r}: InterpretParams(shuffle_seed=...) shuffles parallel grid "
            f"axes, but axes {gm.dynamic_axes} of the grid {gm.grid} have dynamic sizes. Fix: "
            "give those axes int sizes, or drop shuffle_seed.")
    order = (None if params.shuffle_seed is None
             else _shuffled_order(gm.grid, parallel, params.shuffle_seed))

    # Inputs the kernel writes: the write stays visible to later steps that read the block.
    written = [k for k in range(n_in)
               if kernel.jaxpr.outvars[k] is not kernel.jaxpr.invars[k]]

    def step(k: Any, carry: tuple[list[Any], list[Any], list[Any]]
             ) -> tuple[list[Any], list[Any], list[Any]]:
        outs, scratch, written_ins = carry
        bufs = list(ins)
        for j, buf in zip(written, written_ins):
            bufs[j] = buf
        ids = blocks.unravel(k, grid)
        if order is not None:
            ids = tuple(i if perm is None else perm[i] for perm, i in zip(order, ids))
        ctx = ReferenceContext(ids, grid, gm.num_batch_axes, gm.grid_names, checked)
        in_starts = [blocks.starts(bm, ids, prefetch, ctx, rules) for bm in gm.inputs]
        out_starts = [blocks.starts(bm, ids, prefetch, ctx, rules) for bm in gm.outputs]
        views = [blocks.read_block(x, bm, s, checked)
                 for x, bm, s in zip(bufs, gm.inputs, in_starts)]
        views += [blocks.read_block(o, bm, s, checked)
                  for o, bm, s in zip(outs, gm.outputs, out_starts)]
        results = reference.evaluate(kernel, [*views, *scratch], ctx, rules)
        new_outs = [blocks.write_block(o, bm, s, b) for o, bm, s, b in
                    zip(outs, gm.outputs, out_starts, results[n_in:n_in + n_out])]
        new_ins = [blocks.write_block(bufs[j], gm.inputs[j], in_starts[j], results[j])
                   for j in written]
        return new_outs, list(results[n_in + n_out:]), new_ins

    num_steps = math.prod(grid)
    carry = (outs, scratch, [ins[j] for j in written])
    if gm.dynamic_axes:  # the number of steps is a traced value
        carry = lax.fori_loop(jnp.int32(0), num_steps, step, carry)
    elif num_steps == 1:
        carry = step(jnp.int32(0), carry)
    elif num_steps > 1:
        carry = lax.fori_loop(0, num_steps, step, carry)
    outs = carry[0]
    return [blocks.unpad(o, bm) for o, bm in zip(outs, gm.outputs)]


def run_jitted(call: KernelCall, rules: reference.Rules,
               params: InterpretParams | None = None) -> Any:
    """A jitted function of the call's operands (for inspection stages)."""
    return jax.jit(lambda *args: run(call, args, rules, params))
