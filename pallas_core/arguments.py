"""``pallas_call``'s arguments normalised and checked before the kernel is traced: ``out_shape``
as flat output shapes, ``input_output_aliases``, the kernel's signature against the Refs it is
passed, the grid mapping of the operands (named for messages by position and parameter), and
arrays that no block fits."""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_core import _jax
from pallas_core import grid_mapping as gmap
from pallas_core.errors import ArgumentError, KernelSignatureError
from pallas_core.spec import GridSpec, is_dynamic_size


def freeze_params(params: Any) -> Any:
    """Params as the backend will read them: mappings become read-only, objects stay."""
    if isinstance(params, Mapping):
        return types.MappingProxyType({k: freeze_params(v) for k, v in params.items()})
    return params


def out_shape_leaves(out_shape: Any, kernel_name: str) -> tuple[list[Any], Any]:
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


def bounds_checked_when_run(*params: Any) -> bool:
    """Whether the interpreter was asked to check accesses outside a Ref when the kernel runs
    (checked mode, or JAX's TPU interpret options): then it decides what such an access means
    (an error, or uninitialized padding as in JAX), not the trace-time check."""
    return any(getattr(p, "checked", False) is True or hasattr(p, "out_of_bounds_reads")
               for p in params)


def check_not_empty(gm: gmap.GridMapping, kernel_name: str) -> None:
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


def top_level_names(args: Sequence[Any], out_shape: Any, scratch: Any
                     ) -> tuple[list[str], dict[str, str]]:
    """The kernel's arguments, named: one per top-level input (pytrees count once), output and
    scratch entry (as in :func:`split_scratch`), the last ones by keyword for a dict."""
    names = [f"input {i}" for i in range(len(args))]
    n_out = len(out_shape) if isinstance(out_shape, tuple) else 1
    names += [f"output {i}" for i in range(n_out)]
    positional, keywords = split_scratch(scratch)
    names += [f"scratch {i}" for i in range(len(positional))]
    return names, {k: f"scratch {k!r}" for k in keywords}


def split_scratch(scratch: Any) -> tuple[Sequence[Any], dict[str, Any]]:
    """The kernel's scratch arguments, as JAX passes them: the entries of a tuple or list (each
    a Ref, a pytree of Refs, or None) positionally, those of a dict by keyword."""
    if scratch is None:
        return (), {}
    if isinstance(scratch, dict):
        return (), scratch
    if isinstance(scratch, (tuple, list)):
        return tuple(scratch), {}
    return (scratch,), {}


def check_kernel_signature(kernel: Callable[..., Any], names: Sequence[str],
                            kernel_name: str, keywords: Mapping[str, str] | None = None
                            ) -> None:
    try:
        sig = inspect.signature(kernel)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*names, **(keywords or {}))
    except TypeError as e:
        problem = _call_problem(sig, len(names), keywords or {}, str(e))
        if keywords:
            names = [*names, *(f"{k}= ({v})" for k, v in keywords.items())]
        raise KernelSignatureError(
            f"kernel {kernel_name!r} {problem}: its parameters are {tuple(sig.parameters)}, and "
            f"pallas_call passes {len(names)} Refs: {', '.join(names)}. Fix: the kernel "
            "takes one Ref per input, then one per output, then one per scratch buffer."
        ) from None


def _call_problem(sig: inspect.Signature, n_given: int, keywords: Mapping[str, Any],
                  bind_error: str) -> str:
    """Why ``sig`` cannot take ``n_given`` positional arguments (and ``keywords``), in Python's
    words for the failed call (``takes 1 positional argument but 2 were given``, ``missing 1
    required positional argument: 'o_ref'``)."""
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    star = any(p.kind is p.VAR_POSITIONAL for p in params)
    required = [p for p in positional if p.default is p.empty]
    if n_given > len(positional) and not star:
        most = len(positional)
        takes = (f"from {len(required)} to {most}" if len(required) < most else str(most))
        return (f"takes {takes} positional argument{'s' if most != 1 or takes != '1' else ''}"
                f" but {n_given} {'was' if n_given == 1 else 'were'} given")
    missing = [p.name for p in required[n_given:] if p.name not in keywords]
    if missing:
        quoted = [repr(m) for m in missing]
        listed = (quoted[0] if len(quoted) == 1
                  else ", ".join(quoted[:-1]) + f" and {quoted[-1]}")
        return (f"gets too few Refs (missing {len(missing)} required positional "
                f"argument{'s' if len(missing) != 1 else ''}: {listed})")
    return f"cannot be called with these Refs ({bind_error})"


def normalize_aliases(aliases: Mapping[Any, Any] | None,
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


def make_grid_mapping(spec: GridSpec, args: Sequence[Any], spec_tree: Any,
                       outs: Sequence[Any], out_tree: Any, kernel: Callable[..., Any],
                       kernel_name: str, grid_names: tuple[str, ...] | None,
                       is_mesh: bool = False, prefetch_tree: Any = None,
                       paths: Sequence[str] | None = None) -> gmap.GridMapping:
    """The grid mapping of a call; ``prefetch_tree`` is the structure of the scalar-prefetch
    arguments (a tuple of ``num_scalar_prefetch`` pytrees; default: one array each).
    ``paths``: each operand leaf, then each output leaf, as JAX's messages name them
    (``args[0]['a']``, ``outputs[1]``; see :func:`operand_paths`)."""
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
    jax_paths = list(paths) if paths is not None else [None] * len(origins)
    mappings += [gmap.make_block_mapping(s, x, grid, origin, kernel_name, pf_avals, grid_names,
                                         prefetch_tree, path)
                 for s, x, origin, path in zip([*in_specs, *out_specs], [*args[n_pf:], *outs],
                                               origins[n_pf:], jax_paths[n_pf:])]
    symbolic = tuple(g for g in spec.grid if _jax.is_symbolic_dim(g))
    return gmap.GridMapping(grid, tuple(mappings), len(args), len(outs), scratch, 0,
                            grid_names, n_pf, is_mesh,
                            symbolic_sizes=tuple(g if _jax.is_symbolic_dim(g) else None
                                                 for g in spec.grid) if symbolic else ())


def operand_paths(args: Any, out_shape: Any) -> list[str]:
    """Each operand leaf of ``args`` (the tuple of a call's operands), then each leaf of
    ``out_shape``, as JAX's messages name them: ``args[0]``, ``args[1]['a']``, ``outputs[0]``
    (``outputs`` for a lone output)."""
    keystr = jax.tree_util.keystr
    ins = jax.tree_util.tree_flatten_with_path(args)[0]
    outs = jax.tree_util.tree_flatten_with_path(out_shape)[0]
    return [f"args{keystr(p)}" for p, _ in ins] + [f"outputs{keystr(p)}" for p, _ in outs]


def check_aliases(aliases: Sequence[tuple[int, int]], args: Sequence[Any],
                   outs: Sequence[Any], kernel_name: str,
                   paths: Sequence[str] | None = None) -> None:
    """Raises unless each alias maps an input leaf to an output leaf of its shape and dtype.
    ``paths``: as :func:`make_grid_mapping` takes them."""
    for i, o in aliases:
        if not (0 <= i < len(args) and 0 <= o < len(outs)):
            which, index, n = (("input", i, len(args)) if not 0 <= i < len(args)
                               else ("output", o, len(outs)))
            raise ArgumentError(
                f"pallas_call of kernel {kernel_name!r}: input_output_aliases contains the "
                f"mapping '{i}:{o}' with {which} index {index} outside the range [0, {n}): "
                f"there are {len(args)} inputs and {len(outs)} outputs. Fix: map an "
                f"input index in range({len(args)}) to an output index in range({len(outs)})."
            )
        a, b = args[i], outs[o]
        if tuple(a.shape) != tuple(b.shape) or jnp.dtype(a.dtype) != jnp.dtype(b.dtype):
            if paths is not None:
                in_path = "input" + paths[i].removeprefix("args")
                out_path = "output" + paths[len(args) + o].removeprefix("outputs")
            else:
                in_path, out_path = f"input[{i}]", f"output[{o}]"
            raise ArgumentError(
                f"pallas_call of kernel {kernel_name!r}: input_output_aliases contains the "
                f"mapping '{i}:{o}' referring to {in_path} with abstract value "
                f"{gmap.type_text(a)} and to {out_path} with a different abstract value "
                f"{gmap.type_text(b)}; aliased buffers must have the same shape and dtype. Fix: "
                f"make out_shape[{o}] jax.ShapeDtypeStruct({tuple(a.shape)}, "
                f"{jnp.dtype(a.dtype).name}), or drop the alias."
            )
