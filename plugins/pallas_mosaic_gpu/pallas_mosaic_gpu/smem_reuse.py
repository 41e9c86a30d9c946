"""Output blocks that share an input block's shared-memory buffer.

A ``pallas_call`` pipeline gives every windowed input and output a buffer of its own in shared
memory (see :mod:`pallas_mosaic_gpu.call_lowering`). When that exceeds a Hopper thread block's
227 KiB, an output may instead be staged in the buffer of an input block of the same shape and
dtype, provided the kernel is provably done reading that input before it first touches the
output. The softmax of (64, 512) float32 blocks (128 KiB in, 128 KiB out) lowers this way.

The reuse is applied only where it is sound and only where it is needed:

* the kernel runs one grid step per thread block (every grid axis is parallel), so no later
  TMA copy refills the input buffer while the output's TMA store still reads it;
* the input and output have equal block shapes and dtypes (so equal buffers), and the input is
  not aliased to an output;
* in the kernel's jaxpr, the input Ref is only read with ``x_ref[...]``-style loads at its top
  level, and every equation that consumes such a read (directly, or through rules that pass a
  not-yet-loaded SMEM read along) comes before the first equation that uses the output Ref;
  reads inside ``cond``/loops/calls and asynchronous readers (``plgpu.wgmma``, TMA copies out of
  the input) rule the reuse out;
* without it the kernel would need more shared memory than a thread block has (kernels that
  fit keep their own buffers, exactly as JAX's lowering lays them out).

A warpgroup barrier is emitted before the output's first use, so no thread overwrites what
another thread of the block has yet to read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax import lax
from jax.experimental.mosaic import gpu as mgpu

from pallas_core import backend as plb
from pallas_core.backend import KernelCall
from pallas_mosaic_gpu import call_lowering, rules, values
from pallas_mosaic_gpu.params import GPUCompilerParams

_SYNCHRONOUS = frozenset({plb.get_p, plb.swap_p, lax.transpose_p, lax.dot_general_p})
"""Rules taking unloaded SMEM reads whose reads are done when they return (``jnp.dot`` waits
for its wgmma; a store loads its value first)."""


def last_read_before_first_use(jaxpr: Any, in_var: Any, out_var: Any) -> int | None:
    """The index of the first top-level equation of ``jaxpr`` that uses ``out_var`` when every
    read of ``in_var`` provably completes before it; ``None`` when that cannot be shown.

    ``in_var`` may only be read by ``get`` equations at the top level. The value a ``get``
    returns may reach the lowering as an SMEM read that is not done yet (a lazy read), so it is
    followed through equations whose rules pass such values along; every equation consuming
    one counts as a read. Of the rules that take such values unloaded, only those that finish
    their reads before returning (:data:`_SYNCHRONOUS`) may consume one: equations holding
    jaxprs (``cond``, loops, calls) and asynchronous readers (TMA copies, ``plgpu.wgmma``) rule
    the reuse out."""
    first_use = next((i for i, eqn in enumerate(jaxpr.eqns)
                      if any(v is out_var for v in eqn.invars)), len(jaxpr.eqns))
    tainted: set[Any] = {in_var}
    last_read = -1
    for i, eqn in enumerate(jaxpr.eqns):
        used = [v for v in eqn.invars if not isinstance(v, plb.Literal) and v in tainted]
        if not used:
            continue
        if any(v is in_var for v in used) and eqn.primitive is not plb.get_p:
            return None  # written, transformed, or handed to something else
        lazy = eqn.primitive in rules.LAZY_OK
        if lazy and eqn.primitive not in _SYNCHRONOUS:
            return None
        last_read = i
        if lazy:
            tainted.update(eqn.outvars)
    return first_use if last_read < first_use else None


def candidates(call: KernelCall) -> dict[int, tuple[int, int]]:
    """Output index -> (input index, first equation using the output) for every output whose
    block may be staged in an input block's buffer (see the module docstring); each input
    serves at most one output."""
    params = call.compiler_params if isinstance(call.compiler_params, GPUCompilerParams) else \
        GPUCompilerParams()
    if params.mesh is not None:
        return {}
    pl_ = call_lowering.plan(call)
    if math.prod(call.grid_mapping.grid[a] for a in pl_.sequential_axes) > 1:
        return {}
    ins, outs = call_lowering._operands(call)
    jaxpr = call.jaxpr.jaxpr
    aliased_in = set(dict(call.input_output_aliases))
    aliased_out = set(dict(call.input_output_aliases).values())
    taken: set[int] = set()
    found: dict[int, tuple[int, int]] = {}
    for j, ob in enumerate(outs):
        if not call_lowering._windowed(ob) or j in aliased_out:
            continue
        for k, ib in enumerate(ins):
            if (k in taken or k in aliased_in or not call_lowering._windowed(ib)
                    or tuple(ib.ref_shape) != tuple(ob.ref_shape)
                    or np.dtype(ib.dtype) != np.dtype(ob.dtype)):
                continue
            at = last_read_before_first_use(jaxpr, jaxpr.invars[k],
                                            jaxpr.invars[len(ins) + j])
            if at is not None:
                found[j] = (k, at)
                taken.add(k)
                break
    return found


def reused(call: KernelCall) -> dict[int, tuple[int, int]]:
    """The outputs of ``call`` staged in an input's buffer (as :func:`candidates`), chosen in
    order only while the kernel would otherwise need more shared memory than a thread block
    may use (``validation.smem_parts`` against ``validation.smem_limit``); empty for every
    kernel that fits."""
    from pallas_mosaic_gpu import validation

    limit = validation.smem_limit()

    def needed(reuse: dict[int, tuple[int, int]]) -> int:
        return sum(b for _, b in validation.smem_parts(call, reuse))

    chosen: dict[int, tuple[int, int]] = {}
    if needed(chosen) <= limit:
        return chosen
    for j, pair in candidates(call).items():
        chosen[j] = pair
        if needed(chosen) <= limit:
            break
    return chosen


def lower_body(state: Any, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
               barrier_before: set[int]) -> list[Any]:
    """Emits the kernel body ``jaxpr`` like :func:`pallas_mosaic_gpu.rules.lower_jaxpr`, with a
    warpgroup barrier before each top-level equation whose index is in ``barrier_before``."""
    if not barrier_before:
        return rules.lower_jaxpr(state, jaxpr, consts, args)
    marked = {id(jaxpr.eqns[i]) for i in barrier_before if i < len(jaxpr.eqns)}

    def fenced(fn: Any) -> Any:
        def rule(st: Any, eqn: Any, *vals: Any) -> Any:
            if id(eqn) in marked:
                mgpu.warpgroup_barrier()
            return fn(st, eqn, *vals)
        return rule

    table = plb.Rules({p: fenced(fn) for p, fn in rules.RULES.items()})
    return plb.lower_jaxpr(state, table, jaxpr, consts, args, values.literal)
