"""Runs a ``pallas_call`` as straight-line XLA: the grid is unrolled in Python.

Every grid step becomes its own copy of the kernel. Index maps are evaluated ahead of time,
so blocks are cut with static slices, and ``program_id`` is a constant in each copy: scalar
arithmetic on it is folded while tracing, so ``pl.when(pl.program_id(0) == 0)`` picks its
branch statically. Refs are discharged with JAX's state discharge; the pure kernel is then
evaluated by the core's reference evaluator (``pallas_core.reference``), which applies the
``evaluate`` rules that plugins register (``program_id``, ``debug_print``, ...) at any depth.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_core import backend as plb


def run(call: plb.KernelCall, args: Sequence[Any], rules: plb.SemanticsRules) -> list[Any]:
    """The outputs of ``call`` on ``args``, one unrolled grid step after another."""
    gm = call.grid_mapping
    kernel = plb.discharge_state(call.jaxpr, axis_sizes=gm.axis_env)
    aliased = {o: i for i, o in call.input_output_aliases}
    ins = [_pad(x, bm) for x, bm in zip(args, gm.inputs)]
    outs = [_pad(args[aliased[k]] if k in aliased else jnp.zeros(bm.array_shape, bm.dtype), bm)
            for k, bm in enumerate(gm.outputs)]
    scratch = [jnp.zeros(a.inner_aval.shape, a.inner_aval.dtype) for a in gm.scratch_avals]
    n_in, n_out = gm.num_inputs, gm.num_outputs
    for point in itertools.product(*map(range, gm.grid)):
        ids = tuple(np.int32(p) for p in point)
        ctx = plb.ReferenceContext(ids, gm.grid, gm.num_batch_axes, gm.grid_names)
        starts = [_block_start(bm, ids) for bm in gm.block_mappings]
        blocks = [_read(buf, bm, s) for buf, bm, s in zip([*ins, *outs], gm.block_mappings,
                                                          starts)]
        results = plb.evaluate(kernel, [*blocks, *scratch], ctx, rules)
        outs = [lax.dynamic_update_slice(o, r.reshape(bm.full_block_shape), s)
                for o, bm, s, r in zip(outs, gm.outputs, starts[n_in:],
                                       results[n_in:n_in + n_out])]
        scratch = results[n_in + n_out:]
    return [o[tuple(slice(0, d) for d in bm.array_shape)] for o, bm in zip(outs, gm.outputs)]


def _pad(x: Any, bm: plb.BlockMapping) -> Any:
    """Pads ``x`` to whole blocks, so that edge blocks are read and written like the others."""
    shape = [-(-d // b) * b for d, b in zip(bm.array_shape, bm.full_block_shape)]
    if list(x.shape) == shape:
        return x
    return lax.pad(x, jnp.zeros((), x.dtype), [(0, s - d, 0) for d, s in zip(x.shape, shape)])


def _block_start(bm: plb.BlockMapping, ids: Sequence[Any]) -> tuple[int, ...]:
    with jax.ensure_compile_time_eval():
        indices = bm.block_indices(*ids)
    return tuple(int(i) * b for i, b in zip(indices, bm.full_block_shape))


def _read(buf: Any, bm: plb.BlockMapping, start: Sequence[int]) -> Any:
    limit = [s + b for s, b in zip(start, bm.full_block_shape)]
    return lax.slice(buf, start, limit).reshape(bm.ref_shape)
