"""The kernel body traced on Refs of its blocks into a closed jaxpr, after the checks of its
signature, aliases and index maps; traced again with its barrier semaphore when it asks for it.
Errors raised while tracing become ``PallasError`` s naming the kernel and the line that raised
(a store of the wrong dtype or shape says both and the fix)."""

from __future__ import annotations

import dataclasses
import functools
import re
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from pallas_core import _jax
from pallas_core import grid_mapping as gmap
from pallas_core import primitives as prims
from pallas_core.arguments import (
    check_aliases,
    check_kernel_signature,
    check_not_empty,
    split_scratch,
    top_level_names,
)
from pallas_core.errors import KernelSignatureError, KernelTraceError, OutOfBoundsError, PallasError
from pallas_core.spec import BARRIER_SEMAPHORE, GridSpec


def _describe_value(x: Any) -> str:
    """``x`` for a message: ``an array float32[8,128]``, else its type (``an int``)."""
    aval = getattr(x, "aval", None)
    if aval is not None and hasattr(aval, "str_short"):
        return f"an array {aval.str_short()}"
    name = type(x).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def source_of(fn: Any) -> str:
    try:
        code = fn.__code__
        return f"{code.co_filename}:{code.co_firstlineno}"
    except AttributeError:
        return "<unknown>"


def _raised_at(error: BaseException, kernel: Any) -> str:
    """``file:line`` of the innermost frame of ``error`` in the kernel's file (else the
    kernel's definition)."""
    frame = _raised_frame(error, kernel)
    return f"{frame.filename}:{frame.lineno}" if frame else source_of(kernel)


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


def kernel_name_of(kernel: Any, name: str | None) -> str:
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
        positional, keywords = split_scratch(scratch)
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
                f"kernel {kernel_name!r} ({source_of(kernel)}) reads or writes a slice of "
                "traced length (pl.ds(start, n) with n known only when the kernel runs), "
                "which JAX cannot trace. Fix: access a static maximum length with a mask "
                "(pl.load(ref.at[pl.ds(start, MAX)], mask=jnp.arange(MAX) < n)), or branch "
                "(lax.switch) over the few lengths that occur.") from e
        if result is not None:
            raise KernelSignatureError(
                f"The kernel function in the pallas_call {kernel_name} at {source_of(kernel)} "
                f"should return None, but it returned {_describe_value(result)}: kernels write "
                "their results into the output Refs (o_ref[...] = value). Fix: drop the return "
                "value.")
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


def trace_checked(kernel: Callable[..., Any], gm: gmap.GridMapping, grid_spec: GridSpec,
                   args: Sequence[Any], out_shape: Any, out_leaves: Sequence[Any], in_tree: Any,
                   out_tree: Any, kernel_name: str, aliases: Sequence[tuple[int, int]],
                   flat_args: Sequence[Any], mode: Any, compiler_params: Any,
                   paths: Sequence[str] | None = None) -> Any:
    """The kernel's signature, aliases and index maps checked, then its body traced.
    ``paths``: the operand and output leaves as JAX names them (``arguments.operand_paths``)."""
    check_not_empty(gm, kernel_name)
    scratch_tree = gmap.scratch_leaves(grid_spec.scratch_shapes)[1]
    scratch = jax.tree_util.tree_unflatten(scratch_tree, gm.scratch_avals)
    names, keywords = top_level_names(args, out_shape, scratch)
    check_kernel_signature(kernel, names, kernel_name, keywords)
    check_aliases(aliases, flat_args, out_leaves, kernel_name, paths)
    # An interpreter told to read outside arrays as uninitialized memory (JAX's
    # out_of_bounds_reads="uninitialized") reads input blocks outside theirs.
    lenient = "uninitialized" in (getattr(mode, "out_of_bounds_reads", None),
                                  getattr(compiler_params, "out_of_bounds_reads", None))
    gmap.check_index_maps_in_bounds(gm, kernel_name, inputs=not lenient)
    return trace_kernel(kernel, gm, in_tree, out_tree, kernel_name, scratch_tree)
