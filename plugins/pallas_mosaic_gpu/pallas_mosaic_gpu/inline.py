"""``plgpu.inline_mgpu``: code written against JAX's Mosaic GPU library
(``jax.experimental.mosaic.gpu``) inside a kernel.

``inline_mgpu(arg_types=..., return_type=...)`` decorates ``f(ctx, *args)``; calling the
result in a kernel with arrays (``arg_types`` leaf: a ``plgpu.Layout``, the layout ``f``
receives the array in) and Refs (leaf: ``plgpu.RefType()``) runs ``f`` while the kernel is
lowered: ``ctx`` is the library's launch context, an array arrives as a ``FragmentedArray``,
a Ref as its memref (an SMEM Ref that this backend tiles arrives tiled and swizzled, as JAX's
transforms would give it). ``f`` returns ``FragmentedArray``s shaped like ``return_type``
(leaves with ``shape`` and ``dtype``, and optionally a ``layout``).

This backend lowers with that same library, so the code runs as written. The interpreter
cannot run it: ``f`` emits MLIR of the library, which has no meaning outside a GPU kernel's
lowering (JAX's own GPU interpret mode refuses it too).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_core import backend as plb
from pallas_core.backend import PallasError, UnsupportedError, bind_views
from pallas_mosaic_gpu import registry
from pallas_mosaic_gpu.layouts import SomeLayout
from pallas_mosaic_gpu.names import RefType

inline_mgpu_p = plb.Primitive("gpu_inline_mgpu")
inline_mgpu_p.multiple_results = True


@inline_mgpu_p.def_effectful_abstract_eval
def _abstract(*avals: Any, roles: tuple[int, ...], ret: tuple[Any, ...], **_: Any) -> Any:
    n_refs = max(roles) + 1 if roles else 0
    effects = {e for i in range(n_refs) for e in (plb.ReadEffect(i), plb.WriteEffect(i))}
    return [plb.ShapedArray(shape, dtype) for shape, dtype, _ in ret], effects


def inline_mgpu(*, arg_types: Any = (), return_type: Any = None) -> Callable[..., Any]:
    """Decorates ``f(ctx, *args)``, Mosaic GPU library code run while the kernel is lowered
    (see :mod:`pallas_mosaic_gpu.inline`)."""
    flat_types, types_tree = jax.tree_util.tree_flatten(tuple(arg_types))
    for t in flat_types:
        if not isinstance(t, (SomeLayout, RefType)):
            raise PallasError(f"plgpu.inline_mgpu(arg_types=...): each leaf must be a "
                              f"plgpu.Layout (an array) or plgpu.RefType() (a Ref), found {t!r}.")
    flat_ret, ret_tree = jax.tree_util.tree_flatten(return_type)
    ret = []
    for r in flat_ret:
        if not (hasattr(r, "shape") and hasattr(r, "dtype")):
            raise PallasError(f"plgpu.inline_mgpu(return_type=...): each leaf must have a shape "
                              f"and dtype (plgpu.ShapeDtypeStruct), found {r!r}.")
        ret.append((tuple(r.shape), np.dtype(r.dtype), getattr(r, "layout", None)))

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(f)
        def call(*args: Any) -> Any:
            flat_args, tree = jax.tree_util.tree_flatten(tuple(args))
            if str(tree) != str(types_tree):
                raise PallasError(f"plgpu.inline_mgpu: arguments {tree} do not match "
                                  f"arg_types {types_tree}.")
            refs: list[Any] = []
            arrays: list[Any] = []
            kinds: list[Any] = []
            for a, t in zip(flat_args, flat_types):
                if isinstance(t, RefType):
                    if not isinstance(plb.typeof(a), plb.AbstractRef):
                        raise PallasError(f"plgpu.inline_mgpu: arg_types says a Ref, found "
                                          f"{a!r}.")
                    refs.append(a)
                    kinds.append(None)
                else:
                    arrays.append(jnp.asarray(a))
                    kinds.append(t)
            outs = bind_views(inline_mgpu_p, refs, arrays, "inline_mgpu", kinds=tuple(kinds),
                              ret=tuple(ret), mgpu_fn=f)
            return jax.tree_util.tree_unflatten(ret_tree, outs)

        return call

    return decorate


def _interpret(*_: Any, **__: Any) -> Any:
    raise UnsupportedError("plgpu.inline_mgpu cannot run in the interpreter: its function "
                           "emits Mosaic GPU library code, which has a meaning only in a GPU "
                           "kernel's lowering (JAX's GPU interpret mode refuses it too). Fix: "
                           "lower the kernel for cuda (backend='mosaic_gpu'), or write the "
                           "operation with plgpu and jax.numpy.")


@registry.rule(inline_mgpu_p, lazy=True)
def _rule(state: Any, eqn: Any, *args: Any, kinds: Any, ret: Any, mgpu_fn: Any,
          **_: Any) -> Any:
    from pallas_mosaic_gpu.rules_memory import _views
    from pallas_mosaic_gpu.values import FA, relayout

    roles = eqn.params["roles"]
    n_refs = max(roles) + 1 if roles else 0
    tree = eqn.params["tree"]
    views = iter(_views(state, eqn, args) if roles else [])
    arrays = iter(args[n_refs + tree.num_leaves:])
    given = []
    for kind in kinds:
        if kind is None:
            given.append(next(views).memref)
            continue
        x = state.value(next(arrays))
        if not isinstance(x, FA):
            raise state.fail("plgpu.inline_mgpu given an array this backend does not hold "
                             "as a FragmentedArray (a scalar, or one with unit dimensions "
                             "added)")
        given.append(relayout(x, kind.to_mgpu()))
    out = mgpu_fn(state.launch, *given)
    flat = jax.tree_util.tree_leaves(out, is_leaf=lambda v: isinstance(v, FA))
    if len(flat) != len(ret):
        raise state.fail(f"plgpu.inline_mgpu's function returned {len(flat)} arrays where "
                         f"return_type has {len(ret)}")
    results = []
    for x, (shape, _dtype, layout) in zip(flat, ret):
        if not isinstance(x, FA) or tuple(x.shape) != shape:
            raise state.fail(f"plgpu.inline_mgpu's function returned {x!r} where return_type "
                             f"asks for a FragmentedArray of shape {shape}")
        if layout is not None and x.layout != layout.to_mgpu():
            raise state.fail(f"plgpu.inline_mgpu's function returned an array in {x.layout} "
                             f"where return_type asks for {layout}")
        results.append(x)
    return results


def as_torch_kernel(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Makes ``fn`` (a JAX function calling one Mosaic GPU kernel and nothing else) callable
    on PyTorch CUDA tensors, returning tensors. The kernel this backend lowers for cuda is
    the same ``mosaic_gpu_v2`` custom call JAX's is, so JAX's PyTorch bridge
    (``jax.experimental.pallas.mosaic_gpu.as_torch_kernel``) compiles and launches it; it needs
    PyTorch and a GPU when the wrapper is called."""
    from jax.experimental.pallas import mosaic_gpu as jax_mosaic_gpu

    bridge = getattr(jax_mosaic_gpu, "as_torch_kernel", None)
    if bridge is None:
        raise UnsupportedError("plgpu.as_torch_kernel needs JAX's PyTorch bridge, which this "
                               "JAX does not have. Fix: upgrade JAX, or exchange tensors with "
                               "PyTorch through jax.dlpack.")
    return bridge(fn)  # type: ignore[no-any-return]


SEMANTICS: tuple[plb.PrimitiveSemantics, ...] = (
    plb.PrimitiveSemantics(inline_mgpu_p, discharge=_interpret),
)
