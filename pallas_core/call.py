"""``pallas_call``: the entry point, the ``pallas_call`` primitive and its transformation rules.

The entry normalises its arguments (:mod:`pallas_core.arguments`), chooses the backend
(:mod:`pallas_core.dispatch`), traces the kernel (:mod:`pallas_core.kernel_trace`) and binds
the primitive, passing ``jax.Ref`` operands by value and writing them back. The primitive's
lowering rule hands a ``LoweringRequest`` to the chosen plugin; its batching and autodiff rules
are :mod:`pallas_core.batching`'s and :mod:`pallas_core.autodiff`'s. The backend choice and
checks (``resolve_backend``, ``validate``, ``unvalidated``, the interpret-mode switches) are
importable from here too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from pallas_core import _jax, autodiff, batching, bounds
from pallas_core import primitives as prims
from pallas_core.arguments import (
    bounds_checked_when_run,
    freeze_params,
    make_grid_mapping,
    normalize_aliases,
    operand_paths,
    out_shape_leaves,
)
from pallas_core.chips import target_chip
from pallas_core.dispatch import (
    force_interpret_mode,
    forced_interpret_params,
    interpret_in_force,
    is_interpret_params,
    resolve_backend,
    set_interpret_mode,
    unvalidated,
    validate,
    validating,
)
from pallas_core.errors import (
    ArgumentError,
    BlockSpecError,
    LoweringError,
    PallasError,
    UnsupportedError,
    reraising_reports,
)
from pallas_core.kernel_trace import kernel_name_of, source_of, trace_checked, trace_kernel
from pallas_core.plugins import manager
from pallas_core.request import KernelCall, LoweringRequest
from pallas_core.spec import BlockSpec, CostEstimate, GridSpec, is_dynamic_size, no_block_spec

__all__ = ["force_interpret_mode", "forced_interpret_params", "interpret_in_force", "pallas_call",
           "pallas_call_p", "resolve_backend", "set_interpret_mode", "trace_kernel", "unvalidated",
           "validate"]

pallas_call_p = _jax.Primitive("pallas_call")
pallas_call_p.multiple_results = True
_jax.def_eager_impl(pallas_call_p)


_SHARED_MEMORY = re.compile(r"Shared memory size limit exceeded: requested (\d+), "
                            r"available: (\d+)")


@contextlib.contextmanager
def _explained_resource_errors(kernel_name: str, kernel: Any) -> Iterator[None]:
    """A GPU launch refused for want of shared memory (XLA's ``RESOURCE_EXHAUSTED``, found
    only when the compiled kernel is loaded) becomes a ``BlockSpecError`` that names the
    kernel and what to change."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        found = _SHARED_MEMORY.search(str(e))
        if found is None:
            raise
        need, have = (int(g) for g in found.groups())
        raise BlockSpecError(
            f"kernel {kernel_name!r} ({source_of(kernel)}) needs {need} bytes of shared "
            f"memory per thread block as compiled, and this GPU allows {have}. The blocks "
            "that a kernel loads (and, on Triton, the copies its software pipeline keeps of "
            "the blocks loaded in a loop, num_stages of them) live in shared memory. Fix: "
            "smaller blocks, or fewer pipeline stages (Triton: compiler_params="
            "pltriton.CompilerParams(num_stages=1); Mosaic GPU: max_concurrent_steps).") from e


def pallas_call(
    kernel: Callable[..., None],
    out_shape: Any,
    *,
    grid_spec: GridSpec | None = None,
    grid: Any = (),
    in_specs: Any = no_block_spec,
    out_specs: Any = no_block_spec,
    scratch_shapes: Any = (),
    input_output_aliases: Mapping[int, int] | None = None,
    debug: bool = False,
    interpret: Any = False,
    name: str | None = None,
    compiler_params: Any = None,
    cost_estimate: CostEstimate | None = None,
    backend: str | None = None,
    metadata: Mapping[str, str] | None = None,
    _grid_names: tuple[str, ...] | None = None,
    _source: str | None = None,
) -> Callable[..., Any]:
    """Returns a function that runs ``kernel`` over ``grid``, blocked by the BlockSpecs.

    ``kernel(*in_refs, *out_refs, *scratch_refs)`` reads its input blocks and writes its output
    blocks. ``backend=`` picks an installed backend by name (``python -m pallas_core`` lists
    them); otherwise the type of ``compiler_params``, then ``interpret=True``, then the default
    backend of the platform decides (the interpreter on CPU).
    """
    del metadata
    kernel_name = kernel_name_of(kernel, name)
    if cost_estimate is not None and not isinstance(cost_estimate, CostEstimate):
        raise ArgumentError(
            f"pallas_call of kernel {kernel_name!r}: cost_estimate must be a pl.CostEstimate, "
            f"found {type(cost_estimate).__name__}. Fix: pl.CostEstimate(flops=..., "
            "transcendentals=..., bytes_accessed=...).")
    if isinstance(out_shape, list):
        out_shape = tuple(out_shape)
    if grid_spec is None:
        grid_spec = GridSpec(grid, in_specs, out_specs, scratch_shapes)
    elif grid != () or in_specs is not no_block_spec or out_specs is not no_block_spec:
        raise ArgumentError(
            f"pallas_call of kernel {kernel_name!r} got grid_spec= together with grid=/in_specs="
            "/out_specs=. Fix: put everything in the GridSpec, or drop grid_spec=."
        )
    if isinstance(grid_spec.in_specs, BlockSpec):
        raise BlockSpecError(
            f"pallas_call of kernel {kernel_name!r}: `in_specs` must be a tuple or a list of "
            f"BlockSpecs, one per input, but it is a lone {grid_spec.in_specs!r}. Fix: "
            "in_specs=[spec] for a kernel with one input.")
    out_leaves, out_tree = out_shape_leaves(out_shape, kernel_name)
    aliases = normalize_aliases(input_output_aliases, kernel_name)
    resolve_backend(backend, compiler_params, interpret)  # an unknown name fails here
    grid_names = _grid_names if _grid_names is not None else grid_spec.grid_names
    dynamic = [g for g in grid_spec.grid if is_dynamic_size(g)]
    if dynamic and grid_names:
        raise UnsupportedError(
            f"pallas_call of kernel {kernel_name!r}: the named grid {grid_names} has dynamic "
            "sizes; named axes need static sizes (lax.axis_size must be known while the kernel "
            "is traced). Fix: give the named axes int sizes, or drop the names and use "
            "pl.program_id/pl.num_programs.")

    @functools.wraps(kernel)
    def wrapped(*args: Any) -> Any:
        # The sizes of dynamic grid axes come last, and become the primitive's last operands.
        args, sizes = args[:len(args) - len(dynamic)], args[len(args) - len(dynamic):]
        if grid_spec.num_scalar_prefetch > len(args):
            raise ArgumentError(
                f"pallas_call of kernel {kernel_name!r}: num_scalar_prefetch="
                f"{grid_spec.num_scalar_prefetch}, but it was called with {len(args)} "
                "operand(s); the first num_scalar_prefetch operands are the scalar-prefetch "
                "ones. Fix: pass every scalar-prefetch operand, then the inputs, or lower "
                "num_scalar_prefetch.")
        mode = interpret_in_force(backend, interpret)
        chosen = resolve_backend(backend, compiler_params, mode)
        flat_args, in_tree = jax.tree_util.tree_flatten(args)
        for i, a in enumerate(flat_args):
            if not hasattr(a, "shape") or not hasattr(a, "dtype"):
                flat_args[i] = jnp.asarray(a)
        spec_tree = jax.tree_util.tree_structure(args[grid_spec.num_scalar_prefetch:])
        paths = operand_paths(args, out_shape)  # for messages, in JAX's words
        prefetch_tree = jax.tree_util.tree_structure(tuple(args[:grid_spec.num_scalar_prefetch]))
        # Index maps and body are traced for the chosen backend's chip (pallas_core.chips).
        with target_chip(chosen, keep_assumed=True):
            gm = make_grid_mapping(grid_spec, flat_args, spec_tree, out_leaves, out_tree,
                                    kernel, kernel_name, grid_names, _grid_names is not None,
                                    prefetch_tree, paths)
            jaxpr, gm = trace_checked(kernel, gm, grid_spec, args, out_shape, out_leaves,
                                       in_tree, out_tree, kernel_name, aliases, flat_args, mode,
                                       compiler_params, paths)
        if not bounds_checked_when_run(mode, compiler_params):
            bounds.check_constant_indices(jaxpr.jaxpr, kernel_name)
        call = KernelCall(
            name=kernel_name, jaxpr=jaxpr, grid_mapping=gm,
            out_avals=tuple(_jax.ShapedArray(o.shape, o.dtype) for o in out_leaves),
            backend=chosen, compiler_params=freeze_params(compiler_params),
            input_output_aliases=aliases, cost_estimate=cost_estimate, debug=debug,
            # A params object (``interpret=pallas_interpret.InterpretParams(...)``) is kept for
            # the interpreter to read; anything else counts as a flag.
            interpret=(mode if is_interpret_params(mode) else bool(mode)),
            source=_source or source_of(kernel),
        )
        if debug:
            print(f"pallas_call {kernel_name} ({call.source}): grid {gm.grid}")
            print(jaxpr)
        if chosen is not None and validating():
            validate(call, chosen)
        outs = pallas_call_p.bind(*flat_args, *sizes, call=call)
        return jax.tree_util.tree_unflatten(out_tree, outs)

    # Compiled once per argument shapes (and forced interpret mode) when called outside jit;
    # inlined inside jit.
    jitted = jax.jit(wrapped, inline=True)

    @functools.wraps(kernel)
    def run(*args: Any) -> Any:
        if any(_is_jax_ref(a) for a in jax.tree_util.tree_leaves(args)):
            return _call_with_ref_operands(
                kernel, kernel_name, out_shape, grid_spec, aliases, args,
                dict(debug=debug, interpret=interpret, name=name, backend=backend,
                     compiler_params=compiler_params, cost_estimate=cost_estimate,
                     _grid_names=_grid_names))
        # A report of checked mode (raised in a host callback) arrives as itself.
        with reraising_reports(), _explained_resource_errors(kernel_name, kernel):
            # Traced unchecked (pl.report) outside the cache, which later calls rely on.
            fn = (jax.jit(functools.wraps(wrapped)(lambda *a: wrapped(*a)), inline=True)
                  if not validating() else jitted)
            outs = fn(*args, *(jnp.asarray(g, jnp.int32).reshape(()) for g in dynamic))
            if not _jax.being_staged(outs):  # run now: wait for the host callbacks it made
                jax.effects_barrier()
        return outs

    # How many times the kernel was traced, as jax.jit counts (not `lower` or `trace`: wrappers
    # such as jax.vmap copy attributes, and jax.make_jaxpr would call them on unbatched code).
    run._cache_size = jitted._cache_size  # type: ignore[attr-defined]
    return run


def _is_jax_ref(x: Any) -> bool:
    try:
        return isinstance(_jax.typeof(x), _jax.AbstractRef)
    except TypeError:
        return False


def _call_with_ref_operands(kernel: Callable[..., None], kernel_name: str, out_shape: Any,
                            grid_spec: GridSpec, aliases: Any, args: Sequence[Any],
                            options: dict[str, Any]) -> Any:
    """A call whose operands include ``jax.Ref`` s (``jax.new_ref``, ``plgpu.alloc_semaphore``):
    as JAX's state discharge of ``pallas_call`` does, each such operand is passed by value
    and aliased to an extra output, whose Ref the kernel sees in the operand's place (what the
    kernel writes stays in the buffer), and the output is written back into the ``jax.Ref``
    when the call returns."""
    n_args = len(args)
    refs = [i for i, a in enumerate(args) if _is_jax_ref(a)]
    nested = [a for i, a in enumerate(args) if i not in refs and
              any(_is_jax_ref(x) for x in jax.tree_util.tree_leaves(a))]
    what = f"pallas_call of kernel {kernel_name!r}"
    if nested:
        raise UnsupportedError(f"{what}: a jax.Ref inside a pytree operand. Fix: pass each "
                               "jax.Ref as an operand of its own.")
    if any(i < grid_spec.num_scalar_prefetch for i in refs):
        raise UnsupportedError(f"{what}: a jax.Ref as a scalar-prefetch operand. Fix: pass its "
                               "value (ref[...]).")
    taken = sorted(i for i in refs if i in dict(aliases))
    if taken:
        raise ArgumentError(f"{what}: operand(s) {taken} are jax.Refs and also in "
                            "input_output_aliases; a jax.Ref operand is written in place "
                            "already. Fix: drop them from input_output_aliases.")
    single = not isinstance(out_shape, (tuple, list))
    outs = [out_shape] if single else list(out_shape)
    if any(not hasattr(o, "shape") for o in outs):
        raise UnsupportedError(f"{what}: jax.Ref operands with a nested out_shape. Fix: give "
                               "out_shape as one jax.ShapeDtypeStruct or a tuple of them.")
    n_out = len(outs)
    in_specs = grid_spec.in_specs
    if in_specs is no_block_spec:
        in_specs = [no_block_spec] * (n_args - grid_spec.num_scalar_prefetch)
    in_specs = list(in_specs)
    if len(in_specs) != n_args - grid_spec.num_scalar_prefetch:
        raise UnsupportedError(f"{what}: jax.Ref operands need one BlockSpec per operand "
                               f"(in_specs has {len(in_specs)}, for {n_args} operands).")
    out_specs = grid_spec.out_specs
    if out_specs is no_block_spec:
        out_specs = [no_block_spec] * n_out
    elif single:
        out_specs = [out_specs]
    out_specs = list(out_specs)
    extra_specs = [in_specs[i - grid_spec.num_scalar_prefetch] for i in refs]
    extra_shapes = [jax.ShapeDtypeStruct(args[i].shape, args[i].dtype) for i in refs]
    spec = dataclasses.replace(grid_spec, out_specs=tuple(out_specs + extra_specs))

    def body(*kernel_refs: Any) -> None:
        ins, rest = kernel_refs[:n_args], kernel_refs[n_args:]
        written = rest[n_out:n_out + len(refs)]
        ins = tuple(written[refs.index(i)] if i in refs else r for i, r in enumerate(ins))
        kernel(*ins, *rest[:n_out], *rest[n_out + len(refs):])

    body.__name__ = kernel_name
    call = pallas_call(body, tuple(outs + extra_shapes), grid_spec=spec,
                       input_output_aliases={**dict(aliases),
                                             **{i: n_out + j for j, i in enumerate(refs)}},
                       _source=source_of(kernel), **options)
    results = call(*(a[...] if i in refs else a for i, a in enumerate(args)))
    for j, i in enumerate(refs):
        args[i][...] = results[n_out + j]
    return results[0] if single else type(out_shape)(results[:n_out])


# --- the primitive -------------------------------------------------------------------------


@pallas_call_p.def_effectful_abstract_eval
def _abstract_eval(*avals: Any, call: KernelCall) -> tuple[list[Any], set[Any]]:
    # A kernel that prints must run even when nobody reads its outputs.
    effects = {prims.debug_print_effect} if _prints(call) else set()
    return [_jax.with_varying_axes(a, avals) for a in call.out_avals], effects


def _prints(call: KernelCall) -> bool:
    return prims.debug_print_effect in call.jaxpr.jaxpr.effects


def _lowering(ctx: Any, *operands: Any, call: KernelCall) -> Sequence[Any]:
    platforms = _jax.lowering_platforms(ctx)
    backend = call.backend
    if backend is None:
        chosen = {manager.default_for_platform(p) for p in platforms}
        if len(chosen) != 1:
            raise UnsupportedError(
                f"kernel {call.name!r} is being lowered for several platforms {platforms} "
                f"whose default backends differ ({sorted(chosen)}). Fix: pass backend=NAME."
            )
        backend = chosen.pop()
        validate(call, backend)
    info = manager.get(backend).info
    platform = platforms[0]
    unsupported = [p for p in platforms if p not in info.platforms]
    if unsupported:
        raise UnsupportedError(
            f"kernel {call.name!r} uses backend {backend!r}, which lowers for "
            f"{info.platforms}, but the program is being lowered for {unsupported[0]!r}. Fix: "
            f"lower for one of {info.platforms} (e.g. lowering_platforms=({info.platforms[0]!r},)"
            "), or run it in the interpreter (interpret=True, or backend='interpret'), which "
            "runs anywhere."
        )
    request = LoweringRequest(call, backend, platform, ctx, tuple(operands))
    try:
        result = manager.call_hook(backend, "pallas_lower", passthrough=(Exception,),
                                   request=request)
    except PallasError:
        raise
    except NotImplementedError as e:
        # JAX's "MLIR translation rule for primitive 'p' not found": a primitive in the
        # kernel that neither the backend nor any plugin's reference semantics handles.
        raise UnsupportedError(
            f"backend {backend!r} cannot lower kernel {call.name!r} ({call.source}): {e}. "
            "Fix: use only primitives this backend supports, or choose another backend; a "
            "plugin that adds a primitive must give it reference semantics through its "
            "`pallas_primitives` hook."
        ) from e
    except Exception as e:
        raise LoweringError(
            f"backend {backend!r} failed to lower kernel {call.name!r} ({call.source}) with "
            f"{type(e).__name__}: {e}. A backend should refuse what it cannot lower with a "
            "PallasError saying what; this is a defect of the backend plugin. Fix: report it; "
            "meanwhile run the kernel in the interpreter (interpret=True) or another backend."
        ) from e
    if result is None:
        raise LoweringError(
            f"backend {backend!r} did not lower kernel {call.name!r}: its plugin implements no "
            "`pallas_lower` hook, or the hook returned None. Fix: implement pallas_lower "
            "(docs/writing-a-backend.md), or choose another backend."
        )
    if not isinstance(result, (list, tuple)) or len(result) != len(call.out_avals):
        raise manager.plugin_error(
            backend, "pallas_lower", f"returned {type(result).__name__} {result!r:.80} for "
            f"kernel {call.name!r}, where its specification expects a sequence of "
            f"{len(call.out_avals)} MLIR value(s), one per output")
    return list(result)


_jax.register_lowering(pallas_call_p, _lowering)


def _bind(*args: Any, call: KernelCall) -> Sequence[Any]:
    return pallas_call_p.bind(*args, call=call)  # type: ignore[no-any-return]


def _jvp(primals: Any, tangents: Any, *, call: KernelCall) -> Any:
    return autodiff.jvp(_bind, primals, tangents, call)


def _linearize(is_vjp: bool, nonzeros: Sequence[bool], *primals: Any, call: KernelCall) -> Any:
    # jax.vjp/jax.grad linearize too (is_vjp): they fail only if they transpose the result.
    del is_vjp
    return autodiff.linearize(_bind, nonzeros, primals, call)


def _transpose(cotangents: Any, *args: Any, call: KernelCall) -> Any:
    raise autodiff.transpose(call)


_jax.primitive_jvps[pallas_call_p] = _jvp
_jax.register_linearization(pallas_call_p, _linearize)
_jax.primitive_transposes[pallas_call_p] = _transpose


def _batch(axis_data: Any, args: Sequence[Any], dims: Sequence[Any], *,
           call: KernelCall) -> tuple[list[Any], list[int | None]]:
    return batching.batch(_bind, validate, axis_data.size, args, dims, call)


_jax.register_batching_rule(pallas_call_p, _batch)
