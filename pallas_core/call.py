"""``pallas_call``: the entry point, the ``pallas_call`` primitive and its transformation rules."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import re
import traceback
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_core import _jax, autodiff, batching, bounds
from pallas_core import grid_mapping as gmap
from pallas_core import primitives as prims
from pallas_core.chips import target_chip
from pallas_core.errors import (
    ArgumentError,
    BlockSpecError,
    KernelSignatureError,
    KernelTraceError,
    LoweringError,
    OutOfBoundsError,
    PallasError,
    UnsupportedError,
    reraising_reports,
)
from pallas_core.plugins import Capability, manager
from pallas_core.request import KernelCall, LoweringRequest
from pallas_core.spec import (
    BARRIER_SEMAPHORE,
    BlockSpec,
    BoundedSlice,
    CostEstimate,
    Element,
    GridSpec,
    is_dynamic_size,
    no_block_spec,
)

pallas_call_p = _jax.Primitive("pallas_call")
pallas_call_p.multiple_results = True
_jax.def_eager_impl(pallas_call_p)

_COMPILER_PARAMS_KEYS = {"mosaic": "mosaic_tpu", "mosaic_tpu": "mosaic_tpu",
                         "triton": "triton", "mosaic_gpu": "mosaic_gpu"}


def resolve_backend(backend: str | None, compiler_params: Any, interpret: Any) -> str | None:
    """The backend chosen at call time: ``backend=`` > ``interpret=`` > params type.

    ``interpret=`` outranks the type of ``compiler_params`` as in JAX: kernels written for a
    backend pass its params together with ``interpret=True`` to run on CPU. A forced
    interpret mode (:func:`force_interpret_mode`, ``pltpu.force_tpu_interpret_mode()``) counts
    as ``interpret=`` its params, in place of the call's own (as in JAX).
    """
    if backend is not None:
        if not isinstance(backend, str):
            raise ArgumentError(f"backend= must be a backend name (str), found {backend!r}.")
        return manager.get(backend).info.name
    interpret = interpret_in_force(backend, interpret)
    if interpret is not None and interpret is not False:
        name = getattr(type(interpret), "BACKEND", None) if _is_params(interpret) else None
        return manager.get(name if isinstance(name, str) else "interpret").info.name
    if compiler_params is not None:
        if isinstance(compiler_params, Mapping):
            keys = [_COMPILER_PARAMS_KEYS.get(str(k), str(k)) for k in compiler_params]
            if len(keys) == 1:
                return manager.get(keys[0]).info.name
        else:
            name = manager.backend_for_params(compiler_params)
            if name is None:
                raise ArgumentError(
                    f"compiler_params of type {type(compiler_params).__name__} belong to no "
                    f"installed backend (installed: {', '.join(sorted(manager.backends()))}). "
                    "Fix: pass the CompilerParams class of the backend you mean (e.g. "
                    "pallas_interpret.CompilerParams), or install the backend they belong to.")
            return manager.get(name).info.name
    return None


def _is_params(interpret: Any) -> bool:
    """``interpret=`` is a params object (``pltpu.InterpretParams(...)``), not a flag."""
    return not isinstance(interpret, (bool, int, np.integer))


# Part of jax.jit's cache key: a function traced outside forced interpret mode is traced again
# inside it, instead of reusing a trace that lowers for the hardware.
_FORCED_INTERPRET = _jax.jit_keyed_setting("pallas_core_forced_interpret")


def forced_interpret_params() -> Any:
    """The ``interpret=`` value forced on every ``pallas_call`` now (``None``: none is)."""
    return _FORCED_INTERPRET.value


@contextlib.contextmanager
def force_interpret_mode(params: Any = True) -> Iterator[None]:
    """Within the block, every ``pallas_call`` and ``pl.kernel`` traced runs as if called with
    ``interpret=params`` (``True``, or an interpreter params object), in place of its own
    ``interpret=`` as in JAX: kernels run on CPU without editing their source. ``None`` turns
    it off."""
    prev = _FORCED_INTERPRET.swap_local(params)
    try:
        yield
    finally:
        _FORCED_INTERPRET.set_local(prev)


def interpret_in_force(backend: str | None, interpret: Any) -> Any:
    """The ``interpret=`` a call runs with: a forced interpret mode wins over the call's own, as
    in JAX, unless the call names its backend."""
    forced = forced_interpret_params()
    return forced if backend is None and forced is not None else interpret


def set_interpret_mode(params: Any = True) -> None:
    """Forces ``interpret=params`` on every later ``pallas_call`` in this process, until called
    again (``None`` turns it off); :func:`force_interpret_mode` is the scoped form."""
    _FORCED_INTERPRET.set_global(params)


def _freeze_params(params: Any) -> Any:
    """Params as the backend will read them: mappings become read-only, objects stay."""
    if isinstance(params, Mapping):
        return types.MappingProxyType({k: _freeze_params(v) for k, v in params.items()})
    return params


def _out_shape_leaves(out_shape: Any, kernel_name: str) -> tuple[list[Any], Any]:
    leaves, tree = jax.tree_util.tree_flatten(out_shape)
    if out_shape is None:
        raise KernelSignatureError(
            f"pallas_call of kernel {kernel_name!r} has out_shape=None, which describes no "
            "outputs; expected a jax.ShapeDtypeStruct (or a tuple of them). Fix: "
            "out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), one per output, or "
            "out_shape=() for a kernel without outputs."
        )
    if isinstance(out_shape, (tuple, list)) and out_shape and all(
            isinstance(d, (int, np.integer)) for d in out_shape):
        raise KernelSignatureError(
            f"pallas_call of kernel {kernel_name!r} has out_shape={out_shape!r}, a shape "
            "without a dtype; expected a jax.ShapeDtypeStruct. Fix: "
            f"out_shape=jax.ShapeDtypeStruct({tuple(int(d) for d in out_shape)}, dtype)."
        )
    out = []
    for i, leaf in enumerate(leaves):
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape is None or dtype is None or not isinstance(shape, (tuple, list)):
            what = "a dtype without a shape" if _is_dtype(leaf) else f"a {type(leaf).__name__}"
            raise KernelSignatureError(
                f"pallas_call of kernel {kernel_name!r}: out_shape leaf {i} is {leaf!r}, "
                f"{what}; expected a jax.ShapeDtypeStruct (or an array) with shape and dtype. "
                "Fix: out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype)."
            )
        dynamic = [d for d, n in enumerate(shape) if isinstance(n, _jax.Tracer)]
        if dynamic:
            raise KernelSignatureError(
                f"pallas_call of kernel {kernel_name!r}: out_shape leaf {i} has dimension "
                f"{dynamic[0]} known only when the program runs (a traced value, e.g. an "
                "argument of jax.jit); output shapes must be static. Fix: pass the size as a "
                "static argument (jax.jit(..., static_argnums=...)) or take it from an "
                "operand's .shape.")
        wide = _numpy_dtype(dtype)
        if (wide is not None and wide.itemsize == 8 and wide.kind in "fiu"
                and not jax.config.read("jax_enable_x64")):
            raise KernelSignatureError(
                f"pallas_call of kernel {kernel_name!r}: out_shape leaf {i} has dtype {wide}, "
                "but 64-bit types are off (jax_enable_x64 is False), so the kernel's values "
                f"would be 32-bit. Fix: jax.config.update('jax_enable_x64', True), or use a "
                "32-bit dtype.")
        out.append(jax.ShapeDtypeStruct(tuple(shape), dtype))
    return out, tree


def _bounds_checked_when_run(*params: Any) -> bool:
    """Whether the interpreter was asked to check accesses outside a Ref when the kernel runs
    (checked mode, or JAX's TPU interpret options): then it decides what such an access means
    (an error, or uninitialized padding as in JAX), not the trace-time check."""
    return any(getattr(p, "checked", False) is True or hasattr(p, "out_of_bounds_reads")
               for p in params)


def _check_not_empty(gm: gmap.GridMapping, kernel_name: str) -> None:
    """An array with a zero-size dimension that a block of nonzero size walks has no block to
    give the kernel."""
    for bm in gm.block_mappings:
        for d, (n, b) in enumerate(zip(bm.array_shape, bm.block_shape, strict=False)):
            if n == 0 and b != 0:  # a squeezed dimension (None) has blocks of size 1
                raise ArgumentError(
                    f"pallas_call of kernel {kernel_name!r}: {bm.origin} has shape "
                    f"{bm.array_shape}, empty along dimension {d}, but its blocks have size "
                    f"{1 if b is None else b} there: every block would lie outside the array. "
                    "Fix: skip the call when the array is empty (if x.size == 0: ...), or give "
                    "it whole-array blocks (no BlockSpec).")


def _numpy_dtype(dtype: Any) -> np.dtype | None:
    """``dtype`` as a numpy dtype (``None`` for JAX's extended dtypes, such as PRNG keys)."""
    try:
        return np.dtype(dtype)
    except TypeError:
        return None


def _is_dtype(x: Any) -> bool:
    """``x`` is a dtype (``np.float32``, ``jnp.float32``, ``np.dtype(...)``), not an array."""
    if isinstance(x, np.dtype) or (isinstance(x, type) and issubclass(x, np.generic)):
        return True
    return isinstance(getattr(x, "dtype", None), np.dtype) and not hasattr(x, "shape")


def _top_level_names(args: Sequence[Any], out_shape: Any, scratch: Any
                     ) -> tuple[list[str], dict[str, str]]:
    """The kernel's arguments, named: one per top-level input (pytrees count once), output and
    scratch entry (as in :func:`_split_scratch`), the last ones by keyword for a dict."""
    names = [f"input {i}" for i in range(len(args))]
    n_out = len(out_shape) if isinstance(out_shape, tuple) else 1
    names += [f"output {i}" for i in range(n_out)]
    positional, keywords = _split_scratch(scratch)
    names += [f"scratch {i}" for i in range(len(positional))]
    return names, {k: f"scratch {k!r}" for k in keywords}


def _split_scratch(scratch: Any) -> tuple[Sequence[Any], dict[str, Any]]:
    """The kernel's scratch arguments, as JAX passes them: the entries of a tuple or list (each
    a Ref, a pytree of Refs, or None) positionally, those of a dict by keyword."""
    if scratch is None:
        return (), {}
    if isinstance(scratch, dict):
        return (), scratch
    if isinstance(scratch, (tuple, list)):
        return tuple(scratch), {}
    return (scratch,), {}


def _check_kernel_signature(kernel: Callable[..., Any], names: Sequence[str],
                            kernel_name: str, keywords: Mapping[str, str] | None = None
                            ) -> None:
    try:
        sig = inspect.signature(kernel)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*names, **(keywords or {}))
    except TypeError:
        if keywords:
            names = [*names, *(f"{k}= ({v})" for k, v in keywords.items())]
        n_params = len([p for p in sig.parameters.values()
                        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])
        raise KernelSignatureError(
            f"kernel {kernel_name!r} takes {n_params} positional parameters {tuple(sig.parameters)}"
            f" but pallas_call passes {len(names)} Refs: {', '.join(names)}. Fix: the kernel "
            "takes one Ref per input, then one per output, then one per scratch buffer."
        ) from None


def _describe_value(x: Any) -> str:
    """``x`` for a message: ``an array float32[8,128]``, else its type."""
    aval = getattr(x, "aval", None)
    if aval is not None and hasattr(aval, "str_short"):
        return f"an array {aval.str_short()}"
    return f"a {type(x).__name__}"


def _source_of(fn: Any) -> str:
    try:
        code = fn.__code__
        return f"{code.co_filename}:{code.co_firstlineno}"
    except AttributeError:
        return "<unknown>"


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
            f"kernel {kernel_name!r} ({_source_of(kernel)}) needs {need} bytes of shared "
            f"memory per thread block as compiled, and this GPU allows {have}. The blocks "
            "that a kernel loads (and, on Triton, the copies its software pipeline keeps of "
            "the blocks loaded in a loop, num_stages of them) live in shared memory. Fix: "
            "smaller blocks, or fewer pipeline stages (Triton: compiler_params="
            "pltriton.CompilerParams(num_stages=1); Mosaic GPU: max_concurrent_steps).") from e


def _raised_at(error: BaseException, kernel: Any) -> str:
    """``file:line`` of the innermost frame of ``error`` in the kernel's file (else the
    kernel's definition)."""
    frame = _raised_frame(error, kernel)
    return f"{frame.filename}:{frame.lineno}" if frame else _source_of(kernel)


def _raised_frame(error: BaseException, kernel: Any) -> traceback.FrameSummary | None:
    where = getattr(getattr(kernel, "__code__", None), "co_filename", None)
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == where]
    return frames[-1] if frames else None


def _store_error(error: BaseException, found: _jax.StoreMismatch, kernel: Any,
                 kernel_name: str) -> KernelTraceError:
    """JAX's refusal of ``ref[...] = value`` (a dtype or shape that is not the Ref's), said
    with the store's line and the fix."""
    frame = _raised_frame(error, kernel)
    line = (frame.line or "").strip() if frame else ""
    named = re.match(r"([A-Za-z_]\w*)\s*(?:\[|\.at\b)", line)
    ref = named.group(1) if named else "ref"
    store = f"`{line}` stores" if line else "a store writes"
    head = f"kernel {kernel_name!r} ({_raised_at(error, kernel)}) failed while being traced: "
    if found.kind == "dtype":
        return KernelTraceError(
            f"{head}{store} a {found.found or '?'} value into a Ref of {found.expected or '?'}"
            "; a store does not convert dtypes. Fix: convert the value "
            f"({ref}[...] = value.astype({ref}.dtype)), or give the Ref the value's dtype "
            "(in out_shape or the scratch shape).")
    return KernelTraceError(
        f"{head}{store} a value of shape {found.found or '?'} into a Ref (or view) of shape "
        f"{found.expected or '?'}; a store neither broadcasts nor reshapes. Fix: store into "
        f"a view of the value's shape ({ref}[pl.ds(start, n)] = value, {ref}.at[...]), give "
        f"the value the shape {found.expected or 'of the Ref'} (jnp.broadcast_to, reshape), "
        "or change the block shape in the BlockSpec.")


def _kernel_name(kernel: Any, name: str | None) -> str:
    if name is not None:
        return name
    while isinstance(kernel, functools.partial):  # JAX names a partial after its function
        kernel = kernel.func
    return getattr(kernel, "__name__", None) or type(kernel).__name__


def trace_kernel(kernel: Callable[..., Any], gm: gmap.GridMapping, in_tree: Any, out_tree: Any,
                 kernel_name: str, scratch_tree: Any = None) -> tuple[Any, gmap.GridMapping]:
    """Traces the kernel body on Refs of its blocks into a closed jaxpr.

    The kernel receives the input and output Refs nested like the operands and ``out_shape``
    (``None`` for a ``None`` entry), then the scratch Refs nested like ``scratch_tree`` (the
    structure of ``scratch_shapes``; ``None``: one argument per scratch buffer). Returns the
    jaxpr and the grid mapping, which gains a last scratch operand when the kernel uses its
    barrier semaphore.
    """
    block_avals = [_jax.make_ref_aval(bm.ref_shape, bm.dtype, bm.memory_space)
                   for bm in gm.block_mappings]
    avals = [*block_avals, *gm.scratch_avals]
    n_in, n_out = gm.num_inputs, gm.num_outputs

    def flat_kernel(*refs: Any) -> list[Any]:
        ins = jax.tree_util.tree_unflatten(in_tree, refs[:n_in])
        outs = jax.tree_util.tree_unflatten(out_tree, refs[n_in:n_in + n_out])
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        scratch: Any = refs[n_in + n_out:]
        if scratch_tree is not None:
            scratch = jax.tree_util.tree_unflatten(scratch_tree, scratch)
        positional, keywords = _split_scratch(scratch)
        try:
            result = kernel(*ins, *outs, *positional, **keywords)
        except PallasError:
            raise
        except NameError as e:
            if "unbound axis name" not in str(e):
                raise
            names = [n for n in (gm.grid_names or ()) if n is not None]
            raise KernelTraceError(
                f"kernel {kernel_name!r} ({_raised_at(e, kernel)}) asks for an axis no one "
                f"named ({e}). The kernel's named grid axes: {names or 'none'}; mesh axes "
                "exist only under jax.shard_map (or pl.kernel's mesh). Fix: name the grid axes "
                "(grid=(('i', 4), ('j', 2))) and use one of those names, or call the kernel "
                "under shard_map over that axis.") from e
        except (ValueError, TypeError, IndexError) as e:
            if _jax.out_of_bound_slice(e):
                raise OutOfBoundsError(
                    f"kernel {kernel_name!r} ({_raised_at(e, kernel)}) indexes a Ref with a "
                    f"static slice past its end ({e}): out of bounds (the hardware would touch "
                    "memory outside the block, the interpreter would clamp it). Fix: keep 0 <= "
                    "start and start + size <= the Ref's size (pl.ds(start, size); a masked "
                    "access needs only its start inside); to reach other rows, move the block "
                    "with its index map.") from e
            mismatch = _jax.store_mismatch(e)
            if mismatch is not None:
                raise _store_error(e, mismatch, kernel, kernel_name) from e
            raise KernelTraceError(
                f"kernel {kernel_name!r} ({_raised_at(e, kernel)}) failed while being traced: "
                f"{type(e).__name__}: {e}"
            ) from e
        except AssertionError as e:
            if "DShapedArray" not in str(e):
                raise
            # JAX's own check, on a value whose shape is only known when the kernel runs.
            raise KernelTraceError(
                f"kernel {kernel_name!r} ({_source_of(kernel)}) reads or writes a slice of "
                "traced length (pl.ds(start, n) with n known only when the kernel runs), "
                "which JAX cannot trace. Fix: access a static maximum length with a mask "
                "(pl.load(ref.at[pl.ds(start, MAX)], mask=jnp.arange(MAX) < n)), or branch "
                "(lax.switch) over the few lengths that occur.") from e
        if result is not None:
            raise KernelSignatureError(
                f"The kernel function {kernel_name!r} at {_source_of(kernel)} should return "
                f"None, but returned {_describe_value(result)}: kernels write their results into "
                "the output Refs (o_ref[...] = value). Fix: drop the return value.")
        return []

    def with_barrier(*refs: Any) -> list[Any]:
        with prims.barrier_semaphore_context(refs[-1]):
            return flat_kernel(*refs[:-1])

    grid = gm.user_grid
    if gm.symbolic_sizes and _jax.dynamic_shapes_export_enabled():
        # pl.num_programs of a symbolic axis is its dimension, as in JAX's export mode.
        grid = tuple(s if s is not None else g for g, s in zip(grid, gm.symbolic_sizes))
    ctx = prims.KernelTraceContext(grid, gm.grid_names)
    with prims.kernel_trace_context(ctx):
        try:
            jaxpr, _, consts = _jax.trace_to_jaxpr(flat_kernel, avals, name=kernel_name,
                                                   axis_sizes=gm.axis_env)
        except prims.BarrierSemaphoreNeeded:
            # The kernel asked for its barrier semaphore: trace again with it as a hidden
            # last scratch operand (backends recognise it by its memory space).
            barrier = gmap.scratch_avals([BARRIER_SEMAPHORE((), np.int32)])
            gm = dataclasses.replace(gm, scratch_avals=(*gm.scratch_avals, *barrier))
            jaxpr, _, consts = _jax.trace_to_jaxpr(with_barrier, [*avals, *barrier],
                                                   name=kernel_name, axis_sizes=gm.axis_env)
    shapes = gmap.captured_arrays(consts)
    if shapes:
        raise KernelSignatureError(
            f"The kernel function {kernel_name!r} captures constants from its enclosing scope "
            f"(arrays {shapes}). "
            "Kernels may only read their Refs. Fix: pass these arrays to the pallas_call as "
            "inputs (with a BlockSpec), or make them Python scalars."
        )
    return _close(jaxpr, consts), gm


def _close(jaxpr: Any, consts: Sequence[Any]) -> Any:
    return _jax.ClosedJaxpr(jaxpr, list(consts))


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
    kernel_name = _kernel_name(kernel, name)
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
    out_leaves, out_tree = _out_shape_leaves(out_shape, kernel_name)
    aliases = _normalize_aliases(input_output_aliases, kernel_name)
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
        prefetch_tree = jax.tree_util.tree_structure(tuple(args[:grid_spec.num_scalar_prefetch]))
        # Index maps and body are traced for the chosen backend's chip (pallas_core.chips).
        with target_chip(chosen, keep_assumed=True):
            gm = _make_grid_mapping(grid_spec, flat_args, spec_tree, out_leaves, out_tree,
                                    kernel, kernel_name, grid_names, _grid_names is not None,
                                    prefetch_tree)
            jaxpr, gm = _trace_checked(kernel, gm, grid_spec, args, out_shape, out_leaves,
                                       in_tree, out_tree, kernel_name, aliases, flat_args, mode,
                                       compiler_params)
        if not _bounds_checked_when_run(mode, compiler_params):
            bounds.check_constant_indices(jaxpr.jaxpr, kernel_name)
        call = KernelCall(
            name=kernel_name, jaxpr=jaxpr, grid_mapping=gm,
            out_avals=tuple(_jax.ShapedArray(o.shape, o.dtype) for o in out_leaves),
            backend=chosen, compiler_params=_freeze_params(compiler_params),
            input_output_aliases=aliases, cost_estimate=cost_estimate, debug=debug,
            # A params object (``interpret=pallas_interpret.InterpretParams(...)``) is kept for
            # the interpreter to read; anything else counts as a flag.
            interpret=(mode if _is_params(mode) else bool(mode)),
            source=_source or _source_of(kernel),
        )
        if debug:
            print(f"pallas_call {kernel_name} ({call.source}): grid {gm.grid}")
            print(jaxpr)
        if chosen is not None and not _UNCHECKED.get():
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
                  if _UNCHECKED.get() else jitted)
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
                       _source=_source_of(kernel), **options)
    results = call(*(a[...] if i in refs else a for i, a in enumerate(args)))
    for j, i in enumerate(refs):
        args[i][...] = results[n_out + j]
    return results[0] if single else type(out_shape)(results[:n_out])


def _trace_checked(kernel: Callable[..., Any], gm: gmap.GridMapping, grid_spec: GridSpec,
                   args: Sequence[Any], out_shape: Any, out_leaves: Sequence[Any], in_tree: Any,
                   out_tree: Any, kernel_name: str, aliases: Sequence[tuple[int, int]],
                   flat_args: Sequence[Any], mode: Any, compiler_params: Any) -> Any:
    """The kernel's signature, aliases and index maps checked, then its body traced."""
    _check_not_empty(gm, kernel_name)
    scratch_tree = gmap.scratch_leaves(grid_spec.scratch_shapes)[1]
    scratch = jax.tree_util.tree_unflatten(scratch_tree, gm.scratch_avals)
    names, keywords = _top_level_names(args, out_shape, scratch)
    _check_kernel_signature(kernel, names, kernel_name, keywords)
    _check_aliases(aliases, flat_args, out_leaves, kernel_name)
    # An interpreter told to read outside arrays as uninitialized memory (JAX's
    # out_of_bounds_reads="uninitialized") reads input blocks outside theirs.
    lenient = "uninitialized" in (getattr(mode, "out_of_bounds_reads", None),
                                  getattr(compiler_params, "out_of_bounds_reads", None))
    gmap.check_index_maps_in_bounds(gm, kernel_name, inputs=not lenient)
    return trace_kernel(kernel, gm, in_tree, out_tree, kernel_name, scratch_tree)


def _normalize_aliases(aliases: Mapping[Any, Any] | None,
                       kernel_name: str) -> tuple[tuple[int, int], ...]:
    pairs = []
    for i, o in (aliases or {}).items():
        if not isinstance(i, (int, np.integer)) or not isinstance(o, (int, np.integer)):
            raise ArgumentError(
                f"pallas_call of kernel {kernel_name!r}: input_output_aliases={aliases!r} must "
                "map input positions (ints) to output positions (ints). Fix: e.g. {0: 0}.")
        pairs.append((int(i), int(o)))
    outs = [o for _, o in pairs]
    if len(set(outs)) != len(outs):
        raise ArgumentError(
            f"pallas_call of kernel {kernel_name!r}: input_output_aliases={aliases!r} aliases "
            "several inputs to one output. Fix: alias each output to at most one input.")
    return tuple(sorted(pairs))


def _ref_param_names(kernel: Callable[..., Any], count: int) -> list[str] | None:
    """The kernel's parameter names, if it takes exactly ``count`` positional Refs."""
    try:
        params = list(inspect.signature(kernel).parameters.values())
    except (TypeError, ValueError):
        return None
    if len(params) != count or any(
            p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
        return None
    return [p.name for p in params]


def _make_grid_mapping(spec: GridSpec, args: Sequence[Any], spec_tree: Any,
                       outs: Sequence[Any], out_tree: Any, kernel: Callable[..., Any],
                       kernel_name: str, grid_names: tuple[str, ...] | None,
                       is_mesh: bool = False, prefetch_tree: Any = None) -> gmap.GridMapping:
    """The grid mapping of a call; ``prefetch_tree`` is the structure of the scalar-prefetch
    arguments (a tuple of ``num_scalar_prefetch`` pytrees; default: one array each)."""
    grid = tuple(gmap.DYNAMIC if is_dynamic_size(g) else int(g) for g in spec.grid)
    scratch = gmap.scratch_avals(spec.scratch_shapes)
    in_specs = gmap.flatten_specs(spec.in_specs, spec_tree, "in_specs", kernel_name)
    out_specs = gmap.flatten_specs(spec.out_specs, out_tree, "out_specs", kernel_name)
    # Operands are named in messages by position and, when it fits, by kernel parameter.
    n_pf = spec.num_scalar_prefetch if prefetch_tree is None else prefetch_tree.num_leaves
    origins = [f"scalar prefetch {i}" if i < n_pf else f"input {i}"
               for i in range(len(args))] + [
        f"output {i}" for i in range(len(outs))]
    params = _ref_param_names(kernel, len(origins) + len(scratch))
    if params is not None:
        origins = [f"{o} ({p})" for o, p in zip(origins, params)]
    n_top = len(prefetch_tree.children()) if prefetch_tree is not None else len(args)
    if spec.num_scalar_prefetch > min(n_top, len(args)):
        raise ArgumentError(
            f"pallas_call of kernel {kernel_name!r}: num_scalar_prefetch="
            f"{spec.num_scalar_prefetch} but only {min(n_top, len(args))} operands were "
            "passed. Fix: pass the scalar-prefetch arrays first.")
    pf_avals = [_jax.make_ref_aval(x.shape, x.dtype) for x in args[:n_pf]]
    mappings = [gmap.make_block_mapping(None, x, grid, origin, kernel_name, pf_avals)
                for x, origin in zip(args[:n_pf], origins)]
    mappings += [gmap.make_block_mapping(s, x, grid, origin, kernel_name, pf_avals, grid_names,
                                         prefetch_tree)
                 for s, x, origin in zip([*in_specs, *out_specs], [*args[n_pf:], *outs],
                                         origins[n_pf:])]
    symbolic = tuple(g for g in spec.grid if _jax.is_symbolic_dim(g))
    return gmap.GridMapping(grid, tuple(mappings), len(args), len(outs), scratch, 0,
                            grid_names, n_pf, is_mesh,
                            symbolic_sizes=tuple(g if _jax.is_symbolic_dim(g) else None
                                                 for g in spec.grid) if symbolic else ())


def _check_aliases(aliases: Sequence[tuple[int, int]], args: Sequence[Any],
                   outs: Sequence[Any], kernel_name: str) -> None:
    for i, o in aliases:
        if not (0 <= i < len(args) and 0 <= o < len(outs)):
            raise ArgumentError(
                f"pallas_call of kernel {kernel_name!r}: input_output_aliases has {{{i}: {o}}} "
                f"but there are {len(args)} inputs and {len(outs)} outputs. Fix: map an "
                f"input index in range({len(args)}) to an output index in range({len(outs)})."
            )
        a, b = args[i], outs[o]
        if tuple(a.shape) != tuple(b.shape) or jnp.dtype(a.dtype) != jnp.dtype(b.dtype):
            raise ArgumentError(
                f"pallas_call of kernel {kernel_name!r}: input {i} ({a.dtype}{list(a.shape)}) is "
                f"aliased to output {o} ({b.dtype}{list(b.shape)}); aliased buffers must have "
                f"the same shape and dtype. Fix: make out_shape[{o}] "
                f"jax.ShapeDtypeStruct({tuple(a.shape)}, {jnp.dtype(a.dtype).name}), or drop "
                "the alias."
            )


def _check_grid_and_block_forms(call: KernelCall, backend: str,
                                capabilities: frozenset[Capability]) -> None:
    """Raises ``UnsupportedError`` for a dynamic grid, a symbolic block shape or an
    element-indexed block dimension that ``backend`` does not declare it lowers (capabilities
    ``DYNAMIC_GRID``, ``SYMBOLIC_BLOCKS``, ``ELEMENT_BLOCKS``, ``BOUNDED_SLICE_BLOCKS``)."""
    gm = call.grid_mapping
    found: list[tuple[Capability, str, str]] = []
    if gm.dynamic_axes:
        found.append((Capability.DYNAMIC_GRID, f"its grid {gm.user_grid} has dynamic sizes",
                      "give the grid Python int sizes (e.g. a static upper bound, skipping "
                      "the extra steps with pl.when)"))
    symbolic = [bm for bm in gm.block_mappings
                if not _jax.is_static_shape([b for b in bm.block_shape if b is not None])]
    if symbolic:
        found.append((Capability.SYMBOLIC_BLOCKS,
                      f"{symbolic[0].origin} has the symbolic block shape "
                      f"{symbolic[0].block_shape} (jax.export with shape polymorphism)",
                      "give every block static sizes (the backend compiles a kernel for "
                      "static block shapes), or export for TPU (backend='mosaic_tpu')"))
    for bm in gm.block_mappings:
        for d in bm.dims:
            if isinstance(d, Element):
                found.append((Capability.ELEMENT_BLOCKS, f"{bm.origin} has block dimension {d}",
                              "use block-indexed dimensions (ints), padding the array "
                              "yourself"))
            elif isinstance(d, BoundedSlice):
                found.append((Capability.BOUNDED_SLICE_BLOCKS,
                              f"{bm.origin} has block dimension {d}",
                              "use a full block and mask the unused part in the kernel"))
    for capability, what, fix in found:
        if capability not in capabilities:
            raise UnsupportedError(
                f"kernel {call.name!r}: {what}, which backend {backend!r} does not support. "
                f"Fix: {fix}, or run it with backend='interpret'.")


_UNCHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar("pallas_unchecked",
                                                                  default=False)


@contextlib.contextmanager
def unvalidated() -> Iterator[None]:
    """Inside, kernels are traced without their backend's checks (``pl.report`` checks each
    itself, and reports a refusal instead of raising it)."""
    token = _UNCHECKED.set(True)
    try:
        yield
    finally:
        _UNCHECKED.reset(token)


def _check_params_owner(call: KernelCall, backend: str, info: Any) -> None:
    """Refuses compiler params of a backend for another platform (Triton's on Mosaic TPU, and
    the reverse): the chosen backend would drop them without a word; JAX refuses them too. A
    backend for the same platform may read another's (SparseCore reads Mosaic TPU's)."""
    params = call.compiler_params
    if params is None or isinstance(params, Mapping):
        return  # {"triton": {...}, "mosaic_tpu": {...}}: each backend reads its own entry
    owner = manager.backend_for_params(params)
    if owner is None or owner == backend or owner not in manager.backends():
        return
    if set(manager.get(owner).info.platforms) & set(info.platforms):
        return
    raise UnsupportedError(
        f"kernel {call.name!r} ({call.source}) has compiler_params of the {owner!r} backend "
        f"({type(params).__module__}.{type(params).__name__}), but is compiled by {backend!r}, "
        f"which would ignore them (JAX refuses such params too). Fix: pass {backend!r}'s own "
        f"CompilerParams, or backend={owner!r}; to give both, pass a mapping "
        f"{{{owner!r}: ..., {backend!r}: ...}}.")


def validate(call: KernelCall, backend: str) -> None:
    """Checks ``call`` for ``backend``: memory spaces here, the hardware rules in the plugin."""
    info = manager.get(backend).info
    _check_grid_and_block_forms(call, backend, info.capabilities)
    if Capability.FOREIGN_MEMORY_SPACES not in info.capabilities:
        _check_params_owner(call, backend, info)
        spaces = [(bm.origin, bm.memory_space) for bm in call.grid_mapping.block_mappings]
        spaces += [(f"scratch {i}", a.memory_space)
                   for i, a in enumerate(call.grid_mapping.scratch_avals)]
        declared = manager.memory_spaces(backend)
        for origin, space in spaces:
            owner = getattr(space, "backend", None)
            # A backend may adopt another's memory spaces (SparseCore uses pltpu.VMEM, ...).
            if owner is not None and owner != backend and not any(space is d for d in declared):
                raise UnsupportedError(
                    f"kernel {call.name!r}: {origin} is in memory space {space}, which belongs "
                    f"to the {owner!r} backend, but the kernel is lowered by {backend!r}. Fix: "
                    f"pass backend={owner!r}, or use a memory space of {backend!r} (or pl.ANY)."
                )
    if Capability.PIPELINE_MODE not in info.capabilities:
        for bm in call.grid_mapping.block_mappings:
            if bm.pipeline_mode is not None:
                raise UnsupportedError(
                    f"kernel {call.name!r}: {bm.origin} has pipeline_mode={bm.pipeline_mode}, "
                    f"but the {backend!r} backend has no pipelines whose buffers pl.Buffered "
                    "could set. Fix: drop pipeline_mode= for this backend (it never changes "
                    "results).")
    manager.call_hook(backend, "pallas_validate", call=call)
    manager.broadcast("pallas_validate_call", call=call, backend=backend)


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
