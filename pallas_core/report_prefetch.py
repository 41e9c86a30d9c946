"""The scalar-prefetch values (and dynamic grid sizes) ``pl.report`` evaluates a kernel's
index maps on: those that follow from the function's concrete arguments and constants, cut out
of the program and computed once, compiled; else values drawn at random.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_core import _jax, index_eval
from pallas_core.call import pallas_call_p
from pallas_core.request import KernelCall
from pallas_core.spec import BoundedSlice, Element, Squeezed, block_dim_size


def reads_prefetch(bm: Any, grid_rank: int) -> bool:
    """Whether ``bm``'s index map reads scalar-prefetch operands (not only takes them)."""
    return bool(bm.num_prefetch) and index_eval.output_axes(bm.index_map, grid_rank) is None


@dataclasses.dataclass(frozen=True)
class Prefetch:
    """The scalar-prefetch values a kernel's index maps are evaluated on."""

    values: tuple[np.ndarray, ...]
    source: str
    """``"given"`` or ``"sampled"``."""
    bound: int = 0
    """Sampled values lie in ``[0, bound)``."""
    grid: tuple[int, ...] | None = None
    """The sizes of a dynamic grid's axes, where they follow from the values given."""


def sample_prefetch(call: KernelCall, seed: int) -> Prefetch:
    """Values for ``call``'s scalar-prefetch operands drawn at random below the largest
    number of blocks along any dimension of its blocked operands (the range of block
    indices an index map most often reads from them)."""
    gm = call.grid_mapping
    bound = 1
    for bm in gm.block_mappings[gm.num_scalar_prefetch:]:
        if bm.is_whole_array:
            continue
        for dim, n in zip(bm.dims, bm.array_shape, strict=True):
            if isinstance(dim, (Squeezed, Element, BoundedSlice)):
                bound = max(bound, n)
            else:
                bound = max(bound, -(-n // max(block_dim_size(dim), 1)))
    rng = np.random.default_rng(seed)
    values = []
    for bm in gm.block_mappings[:gm.num_scalar_prefetch]:
        dtype = np.dtype(bm.dtype)
        if dtype.kind in "iu":
            values.append(rng.integers(0, bound, bm.array_shape).astype(dtype))
        elif dtype.kind == "b":
            values.append(rng.integers(0, 2, bm.array_shape).astype(dtype))
        else:
            values.append(rng.uniform(0, bound, bm.array_shape).astype(dtype))
    return Prefetch(tuple(values), "sampled", bound)


def given_prefetch(closed: Any, args: Sequence[Any]) -> dict[int, Prefetch]:
    """Per kernel call (by ``id``), its scalar-prefetch values and dynamic grid sizes where
    they follow from ``fn``'s concrete arguments (arrays, not ``ShapeDtypeStruct``s) and
    constants alone. The computation from those to the kernel's operands (a grouped matmul's
    tile tables, a cast or reshape of page indices) is extracted from the program (kernels
    and the work that does not lead there left out) and run once, compiled."""
    flat = jax.tree_util.tree_leaves(args)
    concrete = [isinstance(a, (np.ndarray, jax.Array)) and not isinstance(a, jax.core.Tracer)
                for a in flat]
    if not any(concrete) and not closed.consts:
        return {}
    wanted: list[tuple[int, int, tuple[int, ...]]] = []  # (call, operands, grid)

    def run(*known_args: Any) -> list[Any]:
        it = iter(known_args)
        vals = [next(it) if c else jnp.zeros(a.shape, a.dtype)
                for a, c in zip(flat, concrete, strict=True)]
        outs: list[Any] = []
        _interpret(closed.jaxpr, closed.consts, vals, concrete, wanted, outs)
        return outs

    try:
        with _jax.eval_context():
            traced = jax.make_jaxpr(run)(*(a for a, c in zip(flat, concrete, strict=True) if c))
            if not wanted:
                return {}
            program, used = _jax.dce(_jax.convert_constvars(traced.jaxpr))
            inputs = [*traced.consts, *(a for a, c in zip(flat, concrete, strict=True) if c)]
            values = _run_compiled(program, [a for a, u in zip(inputs, used, strict=True) if u])
    except Exception:  # values that cannot be computed stay unknown (then sampled)
        return {}
    found: dict[int, Prefetch] = {}
    it = iter(values)
    for call_id, n, grid in wanted:
        vals = tuple(np.asarray(next(it)) for _ in range(n))
        sizes = iter(int(np.asarray(next(it))) for _ in range(sum(g < 0 for g in grid)))
        found[call_id] = Prefetch(vals[:n], "given",
                                   grid=tuple(next(sizes) if g < 0 else g for g in grid)
                                   if any(g < 0 for g in grid) else None)
    return found


_COMPILED: dict[tuple[str, tuple[tuple[Any, ...], ...]], Any] = {}
"""Compiled scalar-prefetch computations, by program text and input types (a kernel reported
again reuses its computation)."""


def _run_compiled(program: Any, inputs: Sequence[Any]) -> Any:
    key = (str(program), tuple((np.shape(a), str(np.asarray(a).dtype)) for a in inputs))
    run = _COMPILED.get(key)
    if run is None:
        if len(_COMPILED) >= 64:
            _COMPILED.clear()
        run = _COMPILED[key] = jax.jit(lambda *a: _jax.eval_jaxpr(program, [], *a))
    return run(*inputs)


def _interpret(jaxpr: Any, consts: Sequence[Any], vals: Sequence[Any],
               known: Sequence[bool], wanted: list[tuple[int, int, tuple[int, ...]]],
               outs: list[Any]) -> tuple[list[Any], list[bool]]:
    """Traces ``jaxpr`` with its calls inlined and its kernels left out (zeros in their
    place), tracking which values follow from known inputs alone; for each kernel whose
    scalar-prefetch operands and dynamic grid sizes do, records them in ``wanted`` and
    appends them to ``outs``."""
    env: dict[Any, Any] = {}
    kn: dict[Any, bool] = {}
    for v, c in zip(jaxpr.constvars, consts, strict=False):
        env[v], kn[v] = c, not isinstance(c, jax.core.Tracer)
    for v, x, k in zip(jaxpr.invars, vals, known, strict=True):
        env[v], kn[v] = x, k

    def read(a: Any) -> tuple[Any, bool]:
        if isinstance(a, _jax.Literal):
            return a.val, True
        return env[a], kn[a]

    for eqn in jaxpr.eqns:
        ins, ks = zip(*(read(a) for a in eqn.invars)) if eqn.invars else ((), ())
        subs = _jax.sub_jaxpr_consts(eqn.params)
        if eqn.primitive is pallas_call_p:
            gm = eqn.params["call"].grid_mapping
            n, nd = gm.num_scalar_prefetch, len(gm.dynamic_axes)
            idx = [*range(n), *range(len(ins) - nd, len(ins))]
            if idx and all(ks[i] for i in idx):
                grid = tuple(-1 if a in gm.dynamic_axes else int(g)
                             for a, g in enumerate(gm.grid))
                wanted.append((id(eqn.params["call"]), n, grid))
                outs.extend(ins[i] for i in idx)
            results, kouts = _placeholders(eqn), False
        elif eqn.primitive.name in index_eval.CALLS and len(subs) == 1:
            sub, sub_consts = subs[0]
            results, kk = _interpret(sub, sub_consts, ins, ks, wanted, outs)
            for v, r, k in zip(eqn.outvars, results, kk, strict=True):
                env[v], kn[v] = r, k
            continue
        elif eqn.effects or eqn.primitive in _jax.KEY_PRIMITIVES or any(
                _has_kernel(sub) for sub, _ in subs):
            results, kouts = _placeholders(eqn), False
        else:
            got = eqn.primitive.bind(*ins, **eqn.params)
            results = list(got) if eqn.primitive.multiple_results else [got]
            kouts = all(ks)
        for v, r in zip(eqn.outvars, results, strict=True):
            env[v], kn[v] = r, kouts
    out_vals = [read(a) for a in jaxpr.outvars]
    return [v for v, _ in out_vals], [k for _, k in out_vals]


def _placeholders(eqn: Any) -> list[Any]:
    return [jnp.zeros(v.aval.shape, v.aval.dtype) for v in eqn.outvars]


def _has_kernel(jaxpr: Any) -> bool:
    from pallas_core.stages import kernel_calls

    return next(iter(kernel_calls(jaxpr)), None) is not None
