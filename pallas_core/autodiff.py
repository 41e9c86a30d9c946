"""Forward-mode differentiation of ``pallas_call``: the kernel is differentiated into a kernel.

``jax.jvp`` (and ``jax.linearize``, ``jax.jacfwd``) through a kernel runs one derivative kernel:
its body is the JVP of the kernel body, in which every differentiated Ref has a tangent Ref that
is read and written wherever the primal Ref is. The tangent of each differentiated input is one
more input, and the tangent of each floating-point output one more output; a tangent operand is
blocked exactly like its primal (the same block mapping), so the grid, the index maps and the
order of grid steps do not change. Floating-point scratch buffers get a tangent scratch buffer.

Inputs whose tangent is a symbolic zero (not differentiated, or integers) get no tangent operand;
integer outputs have zero tangents. Reverse mode (``jax.grad``, ``jax.vjp``) would need the
derivative kernel transposed, which is not done: it raises ``AutodiffError`` naming
``jax.custom_vjp``, the way to give a kernel a backward pass.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from pallas_core import _jax
from pallas_core import grid_mapping as gmap
from pallas_core import primitives as prims
from pallas_core.errors import AutodiffError, PallasError
from pallas_core.request import KernelCall

Bind = Callable[..., Sequence[Any]]
"""``bind(*operands, call=KernelCall) -> outputs``: binds the ``pallas_call`` primitive."""

# Derivative kernels -> (number of primal inputs, number of primal outputs).
_PRIMAL_COUNTS: weakref.WeakKeyDictionary[KernelCall, tuple[int, int]] = (
    weakref.WeakKeyDictionary())


def outputs_independent_of(call: KernelCall, inputs: Sequence[bool]) -> int:
    """How many leading outputs of ``call`` do not depend on the ``inputs`` marked True.

    The primal outputs of a derivative kernel do not depend on its tangent inputs: when only
    tangents are batched (``jax.jacfwd``, a ``vmap`` over tangents), the batching rule keeps
    them unbatched. 0 for other calls.
    """
    n_in, n_out = _PRIMAL_COUNTS.get(call, (0, 0))
    return n_out if n_in and not any(inputs[:n_in]) else 0


def differentiable(dtype: Any) -> bool:
    """Whether values of ``dtype`` have tangents (floating-point and complex types)."""
    try:
        return bool(jnp.issubdtype(dtype, jnp.inexact))
    except TypeError:  # extended dtypes: semaphores, PRNG keys, ...
        return False


def _input_nonzeros(call: KernelCall, primals: Sequence[Any],
                    nonzeros: Sequence[bool]) -> list[bool]:
    """Which inputs are differentiated: floating-point ones whose tangent is not a symbolic
    zero (marked in ``nonzeros``)."""
    nz = [bool(n) and differentiable(_jax.typeof(p).dtype) for p, n in zip(primals, nonzeros)]
    gm = call.grid_mapping
    for i in range(gm.num_scalar_prefetch):
        if nz[i]:
            raise AutodiffError(
                f"jax.jvp of kernel {call.name!r} ({call.source}) differentiates scalar-prefetch "
                f"operand {i} ({_jax.typeof(primals[i]).str_short()}); scalar-prefetch operands "
                "feed the index maps and cannot carry tangents. Fix: pass them as integers, or "
                "wrap them in jax.lax.stop_gradient.")
    return nz


def jvp(bind: Bind, primals: Sequence[Any], tangents: Sequence[Any],
        call: KernelCall) -> tuple[list[Any], list[Any]]:
    """The JVP rule of ``pallas_call``: runs the derivative kernel of ``call``.

    Returns the primal outputs and their tangents (symbolic zeros for integer outputs, and for
    all outputs when no input is differentiated).
    """
    # The sizes of dynamic grid axes are the last operands; integers, so never differentiated.
    n_dyn = call.grid_mapping.num_dynamic_grid_bounds
    n_ops = len(primals) - n_dyn
    sizes = list(primals[n_ops:])
    primals, tangents = list(primals[:n_ops]), list(tangents[:n_ops])
    in_nz = _input_nonzeros(call, primals, [not _jax.is_zero(t) for t in tangents])
    if not any(in_nz):
        return (list(bind(*primals, *sizes, call=call)),
                [_jax.zero_tangent(a) for a in call.out_avals])
    out_nz = tuple(differentiable(a.dtype) for a in call.out_avals)
    # An aliased output starts as its input: its tangent starts as the input's tangent.
    for i, o in call.input_output_aliases:
        if out_nz[o] and not in_nz[i]:
            in_nz[i] = True
            tangents[i] = _jax.instantiate_zero(tangents[i])
    jvp_call = derivative_call(call, tuple(in_nz), out_nz)
    outs = bind(*primals, *(t for t, nz in zip(tangents, in_nz) if nz), *sizes, call=jvp_call)
    n_out = len(call.out_avals)
    out_tangents = iter(outs[n_out:])
    return list(outs[:n_out]), [next(out_tangents) if nz else _jax.zero_tangent(a)
                                for a, nz in zip(call.out_avals, out_nz)]


def linearize(bind: Bind, nonzeros: Sequence[bool], primals: Sequence[Any],
              call: KernelCall) -> tuple[list[Any], list[bool], list[Any], Callable[..., Any]]:
    """The linearization rule of ``pallas_call`` (``jax.linearize``; ``jax.vjp`` starts here).

    The primal outputs come from the kernel itself; the linear part keeps the primal inputs as
    residuals and runs the derivative kernel on them and the tangents (recomputing the primal
    outputs, which it drops).
    """
    any_nz = any(_input_nonzeros(call, primals, nonzeros))
    out_nz = [any_nz and differentiable(a.dtype) for a in call.out_avals]
    outs = list(bind(*primals, call=call))

    def linearized(residuals: Sequence[Any], *tangents: Any) -> list[Any]:
        return jvp(bind, residuals, tangents, call)[1]

    return outs, out_nz, list(primals), linearized


def transpose(call: KernelCall) -> AutodiffError:
    """The error reverse mode raises when it reaches a kernel's derivative."""
    return AutodiffError(
        f"jax.grad/jax.vjp (reverse mode) reached pallas_call kernel {call.name!r} "
        f"({call.source}): kernels are differentiated in forward mode only (jax.jvp, "
        "jax.linearize, jax.jacfwd), and the derivative kernel is not transposed. Fix: wrap "
        "the function that calls pl.pallas_call in jax.custom_vjp and write its backward pass, "
        "typically as another pallas_call.")


# --- the derivative kernel -----------------------------------------------------------------


def derivative_call(call: KernelCall, in_nz: tuple[bool, ...],
                    out_nz: tuple[bool, ...]) -> KernelCall:
    """The launch of the derivative kernel of ``call``.

    Its inputs are the inputs then the tangents of the inputs marked in ``in_nz``; its outputs
    the outputs then the tangents of those marked in ``out_nz``; its scratch buffers the
    scratch buffers then a tangent of each floating-point one.
    """
    gm = call.grid_mapping
    scratch_nz = tuple(differentiable(a.inner_aval.dtype) if hasattr(a, "inner_aval")
                       else False for a in gm.scratch_avals)
    jaxpr, tangent_scratch = _derivative_kernel(call, in_nz, out_nz, scratch_nz)
    ins, outs = gm.inputs, gm.outputs
    t_ins = [_tangent_mapping(bm) for bm, nz in zip(ins, in_nz) if nz]
    t_outs = [_tangent_mapping(bm) for bm, nz in zip(outs, out_nz) if nz]
    new_gm = dataclasses.replace(
        gm, block_mappings=(*ins, *t_ins, *outs, *t_outs), num_inputs=len(ins) + len(t_ins),
        num_outputs=len(outs) + len(t_outs),
        scratch_avals=(*gm.scratch_avals, *tangent_scratch))
    t_in_pos = {int(i): len(ins) + k for k, i in enumerate(np.flatnonzero(in_nz))}
    t_out_pos = {int(o): len(outs) + k for k, o in enumerate(np.flatnonzero(out_nz))}
    aliases = (*call.input_output_aliases,
               *((t_in_pos[i], t_out_pos[o]) for i, o in call.input_output_aliases
                 if o in t_out_pos))
    cost = call.cost_estimate
    if cost is not None:
        cost = dataclasses.replace(
            cost, flops=2 * cost.flops, transcendentals=2 * cost.transcendentals,
            bytes_accessed=2 * cost.bytes_accessed,
            remote_bytes_transferred=2 * cost.remote_bytes_transferred)
    if call.debug:
        print(f"jvp of pallas_call {call.name} ({call.source}):")
        print(jaxpr)
    derivative = call.replace(
        jaxpr=jaxpr, grid_mapping=new_gm, input_output_aliases=tuple(sorted(aliases)),
        out_avals=(*call.out_avals, *(a for a, nz in zip(call.out_avals, out_nz) if nz)),
        cost_estimate=cost)
    _PRIMAL_COUNTS[derivative] = (len(ins), len(outs))
    return derivative


def _tangent_mapping(bm: gmap.BlockMapping) -> gmap.BlockMapping:
    return dataclasses.replace(bm, origin=f"tangent of {bm.origin}")


def _derivative_kernel(call: KernelCall, in_nz: tuple[bool, ...], out_nz: tuple[bool, ...],
                       scratch_nz: tuple[bool, ...]) -> tuple[Any, list[Any]]:
    """The derivative kernel's jaxpr, taking its Refs in the order of the derivative call
    (inputs, input tangents, outputs, output tangents, scratch, scratch tangents), and the
    avals of the tangent scratch buffers."""
    gm = call.grid_mapping
    nonzeros = (*in_nz, *out_nz, *scratch_nz)
    try:
        jvp_jaxpr = _jax.jvp_jaxpr(call.jaxpr, nonzeros, axis_sizes=gm.axis_env)
    except PallasError:
        raise
    except Exception as e:  # JAX raises bare Exceptions for some misuses of Refs
        raise AutodiffError(
            f"jax.jvp could not differentiate the body of kernel {call.name!r} "
            f"({call.source}): {type(e).__name__}: {e}. Fix: use only differentiable "
            "operations on floating-point values in the kernel (copies, semaphores and atomics "
            "have no derivative), or wrap the function that calls pl.pallas_call in "
            "jax.custom_jvp and write its derivative.") from e
    counts = [gm.num_inputs, gm.num_outputs, len(gm.scratch_avals), sum(in_nz), sum(out_nz),
              sum(scratch_nz)]
    p_in, p_out, p_scr, t_in, t_out, t_scr = _split(jvp_jaxpr.in_avals, counts)
    order = [p_in, t_in, p_out, t_out, p_scr, t_scr]

    def kernel(*refs: Any) -> list[Any]:
        r_in, r_t_in, r_out, r_t_out, r_scr, r_t_scr = _split(refs, [len(g) for g in order])
        _jax.eval_jaxpr(jvp_jaxpr.jaxpr, jvp_jaxpr.consts,
                        *r_in, *r_out, *r_scr, *r_t_in, *r_t_out, *r_t_scr)
        return []

    jaxpr, _, consts = _jax.trace_to_jaxpr(kernel, [a for g in order for a in g],
                                           name=call.name, axis_sizes=gm.axis_env)
    return _jax.ClosedJaxpr(jaxpr, consts), list(t_scr)


def _split(seq: Sequence[Any], counts: Sequence[int]) -> list[list[Any]]:
    out, start = [], 0
    for n in counts:
        out.append(list(seq[start:start + n]))
        start += n
    return out


# --- derivatives of the kernel primitives that touch Refs -----------------------------------


def _masked_load_jvp(primals: Sequence[Any], tangents: Sequence[Any], *, tree: Any,
                     has_other: bool) -> tuple[Any, Any]:
    out = prims.masked_load_p.bind(*primals, tree=tree, has_other=has_other)
    ref_t = tangents[0]
    idx_and_mask = primals[1:2 + tree.num_leaves]
    other_t = tangents[-1] if has_other else None
    if _jax.is_zero(ref_t):
        if other_t is None or _jax.is_zero(other_t):
            return out, _jax.zero_tangent(_jax.typeof(out))
        # Lanes read from the Ref have no tangent; masked-off lanes take `other`'s.
        return out, jnp.where(idx_and_mask[-1], jnp.zeros_like(other_t), other_t)
    args = [ref_t, *idx_and_mask]
    if has_other:
        args.append(_jax.instantiate_zero(other_t))
    return out, prims.masked_load_p.bind(*args, tree=tree, has_other=has_other)


def _masked_swap_jvp(primals: Sequence[Any], tangents: Sequence[Any], *,
                     tree: Any) -> tuple[Any, Any]:
    out = prims.masked_swap_p.bind(*primals, tree=tree)
    ref_t, val_t = tangents[:2]
    if _jax.is_zero(ref_t):
        if not _jax.is_zero(val_t):
            raise AutodiffError(
                "pl.store/pl.swap writes a differentiated value into a Ref that has no tangent "
                f"(a {_jax.typeof(primals[0]).str_short()} that is an input not being "
                "differentiated, or of an integer type). Fix: write differentiated values only "
                "into output Refs or floating-point scratch buffers.")
        return out, _jax.zero_tangent(_jax.typeof(out))
    return out, prims.masked_swap_p.bind(ref_t, _jax.instantiate_zero(val_t), *primals[2:],
                                         tree=tree)


def _debug_print_jvp(primals: Sequence[Any], tangents: Sequence[Any], *,
                     fmt: str) -> tuple[list[Any], list[Any]]:
    del tangents
    prims.debug_print_p.bind(*primals, fmt=fmt)
    return [], []


_jax.primitive_jvps[prims.masked_load_p] = _masked_load_jvp
_jax.primitive_jvps[prims.masked_swap_p] = _masked_swap_jvp
_jax.primitive_jvps[prims.debug_print_p] = _debug_print_jvp
