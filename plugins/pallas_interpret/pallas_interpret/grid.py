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
from pallas_core.request import KernelCall
from pallas_core.semantics import ReferenceContext, fresh_buffer
from pallas_interpret import blocks, checks, fast, lockstep
from pallas_interpret.params import InterpretParams


def run(call: KernelCall, args: Sequence[Any], rules: reference.Rules,
        params: InterpretParams | None = None) -> list[Any]:
    """The outputs of ``call`` on ``args``: batched where that is proven safe and allowed by
    ``params``, else step by step."""
    params = params or InterpretParams()
    axes = lockstep.lockstep_axes(call)
    if axes is not None:
        return lockstep.run(call, args, rules, params, axes)
    if params.fast and not params.checked and params.shuffle_seed is None:
        plan = fast.plan(call)
        if plan is not None:
            return fast.run(call, args, plan, rules)
    return run_exact(call, args, rules, params)


def _shuffled_order(grid: tuple[int, ...], axes: Sequence[int], seed: int) -> list[Any]:
    """Per grid axis, a permutation of its indices (identity for axes not in ``axes``)."""
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.permutation(n) if a in axes else np.arange(n), jnp.int32)
            for a, n in enumerate(grid)]


def run_exact(call: KernelCall, args: Sequence[Any], rules: reference.Rules,
              params: InterpretParams | None = None) -> list[Any]:
    """The outputs of ``call`` on ``args``, one grid step after another."""
    params = params or InterpretParams()
    checked = params.checked
    gm = call.grid_mapping
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
        ids = blocks.unravel(k, gm.grid)
        if order is not None:
            ids = tuple(perm[i] for perm, i in zip(order, ids))
        ctx = ReferenceContext(ids, gm.grid, gm.num_batch_axes, gm.grid_names, checked)
        in_starts = [blocks.starts(bm, ids, prefetch) for bm in gm.inputs]
        out_starts = [blocks.starts(bm, ids, prefetch) for bm in gm.outputs]
        views = [blocks.read_block(x, bm, s) for x, bm, s in zip(bufs, gm.inputs, in_starts)]
        views += [blocks.read_block(o, bm, s) for o, bm, s in zip(outs, gm.outputs, out_starts)]
        results = reference.evaluate(kernel, [*views, *scratch], ctx, rules)
        new_outs = [blocks.write_block(o, bm, s, b) for o, bm, s, b in
                    zip(outs, gm.outputs, out_starts, results[n_in:n_in + n_out])]
        new_ins = [blocks.write_block(bufs[j], gm.inputs[j], in_starts[j], results[j])
                   for j in written]
        return new_outs, list(results[n_in + n_out:]), new_ins

    num_steps = math.prod(gm.grid)
    carry = (outs, scratch, [ins[j] for j in written])
    if num_steps == 1:
        carry = step(jnp.int32(0), carry)
    elif num_steps > 1:
        carry = lax.fori_loop(0, num_steps, step, carry)
    outs = carry[0]
    return [blocks.unpad(o, bm) for o, bm in zip(outs, gm.outputs)]


def run_jitted(call: KernelCall, rules: reference.Rules,
               params: InterpretParams | None = None) -> Any:
    """A jitted function of the call's inputs (for inspection stages)."""
    return jax.jit(lambda *args: run(call, args, rules, params))
