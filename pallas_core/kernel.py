"""``pl.kernel`` and ``pl.core_map``: run a body once per point of a mesh of cores."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from pallas_core import _jax
from pallas_core import primitives as prims
from pallas_core.call import interpret_in_force, pallas_call
from pallas_core.errors import KernelSignatureError, PallasError, UnsupportedError
from pallas_core.plugins import manager
from pallas_core.spec import ANY, BlockSpec, CostEstimate, Mesh


def _check_mesh(mesh: Any, fn: str) -> Mesh:
    as_mesh = getattr(mesh, "pallas_mesh", None)
    if not isinstance(mesh, Mesh) and callable(as_mesh):
        mesh = as_mesh()  # a backend's own mesh class (plgpu.Mesh), as a core Mesh
    if not isinstance(mesh, Mesh):
        raise PallasError(
            f"pl.{fn} needs mesh= to be a pallas_core.Mesh (e.g. pl.Mesh(('x',), (2,)) or a "
            f"backend's constructor such as pltpu.create_tensorcore_mesh('x')); found {mesh!r}."
        )
    return mesh


def kernel(
    body: Callable[..., None] | None = None,
    out_type: Any = None,
    *,
    mesh: Mesh,
    scratch_types: Any = (),
    compiler_params: Any = None,
    interpret: Any = False,
    cost_estimate: CostEstimate | None = None,
    debug: bool = False,
    name: str | None = None,
    metadata: Any = None,
    backend: str | None = None,
    out_shape: Any = None,
    scratch_shapes: Any = None,
) -> Any:
    """Runs ``body(*in_refs, *out_refs, *scratch_refs)`` once on every core of ``mesh``.

    Refs are whole arrays (memory space ``ANY``); ``jax.lax.axis_index(axis_name)`` gives the
    core's position. Usable directly or as a decorator factory
    (``@pl.kernel(out_type=..., mesh=...)``). ``out_shape``/``scratch_shapes`` are accepted
    as older spellings of ``out_type``/``scratch_types``.
    """
    del metadata
    mesh = _check_mesh(mesh, "kernel")
    out = out_type if out_type is not None else out_shape
    if out is None or not jax.tree_util.tree_leaves(out):
        raise KernelSignatureError(
            "pl.kernel needs out_type= (a jax.ShapeDtypeStruct or a tuple of them) describing "
            "the outputs the body writes."
        )
    scratch = scratch_shapes if scratch_shapes is not None else scratch_types

    def decorate(fn: Callable[..., None]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            return _mesh_call(fn, out, mesh, args, scratch_shapes=scratch,
                              compiler_params=compiler_params, interpret=interpret,
                              cost_estimate=cost_estimate, debug=debug, name=name,
                              backend=backend)

        return call

    return decorate if body is None else decorate(body)


def core_map(
    mesh: Mesh,
    *,
    compiler_params: Any = None,
    interpret: Any = False,
    debug: bool = False,
    cost_estimate: CostEstimate | None = None,
    name: str | None = None,
    metadata: Any = None,
    scratch_shapes: Any = (),
    backend: str | None = None,
) -> Callable[[Callable[..., None]], None]:
    """Decorator: runs a body that takes no arguments on every core of ``mesh``.

    The body reads and writes Refs it closes over (from ``pl.run_state`` or ``jax.new_ref``);
    their final contents are written back when the decorator returns.
    """
    del metadata
    inside = getattr(mesh, "map_inside_kernel", None)
    if inside is not None and not isinstance(mesh, Mesh):
        # A backend's mesh over parts of the core running the kernel (Mosaic GPU's warps of a
        # warpgroup): the body runs in place, inside the kernel being traced.
        if jax.tree_util.tree_leaves(scratch_shapes) or compiler_params is not None:
            raise UnsupportedError(
                f"pl.core_map over {mesh!r} takes no scratch_shapes or compiler_params (it "
                "runs inside the kernel). Fix: drop them; allocate with pl.run_scoped.")
        return inside  # type: ignore[no-any-return]
    mesh = _check_mesh(mesh, "core_map")
    if jax.tree_util.tree_leaves(scratch_shapes):
        raise UnsupportedError(
            "pl.core_map(scratch_shapes=...) is not supported yet. Fix: allocate scratch "
            "inside the body with pl.run_scoped."
        )

    def decorate(fn: Callable[..., None]) -> None:
        axis_sizes = tuple(zip(mesh.axis_names, mesh.axis_sizes))

        def flat() -> list[Any]:
            fn()
            return []

        with prims.kernel_trace_context(prims.KernelTraceContext(mesh.axis_sizes,
                                                                 mesh.axis_names)):
            try:
                jaxpr, _, consts = _jax.trace_to_jaxpr(flat, [], name=name or fn.__name__,
                                                       axis_sizes=axis_sizes)
            except prims.BarrierSemaphoreNeeded:
                raise UnsupportedError(
                    f"pl.core_map body {fn.__name__!r} uses the barrier semaphore, which only "
                    "pl.kernel and pl.pallas_call provide. Fix: write the body as a pl.kernel."
                ) from None
        is_ref = [isinstance(_jax.typeof(c), _jax.AbstractRef) for c in consts]
        refs = [c for c, r in zip(consts, is_ref) if r]
        if not refs:
            raise PallasError(
                f"pl.core_map body {fn.__name__!r} closes over no Refs, so it can have no "
                "effect. Fix: write results into Refs created with pl.run_state or jax.new_ref."
            )
        values = [r[...] for r in refs]

        def body(*kernel_refs: Any) -> None:
            outs = iter(kernel_refs[len(refs): 2 * len(refs)])
            env = [next(outs) if r else c for c, r in zip(consts, is_ref)]
            _jax.eval_jaxpr(jaxpr, env)

        body.__name__ = name or fn.__name__
        results = _mesh_call(
            body, tuple(jax.ShapeDtypeStruct(v.shape, v.dtype) for v in values), mesh, values,
            input_output_aliases={i: i for i in range(len(refs))},
            compiler_params=compiler_params, interpret=interpret, debug=debug,
            cost_estimate=cost_estimate, name=name, backend=backend)
        for r, v in zip(refs, results):
            r[...] = v

    return decorate


def _mesh_call(fn: Callable[..., None], out: Any, mesh: Mesh, args: Any, *,
               name: str | None, backend: str | None, **kwargs: Any) -> Any:
    """``fn`` as a ``pallas_call`` over the mesh, every operand whole (memory space ANY)."""
    def whole(tree: Any) -> Any:
        return jax.tree_util.tree_map(lambda _: BlockSpec(memory_space=ANY), tree)

    user_params = kwargs.get("compiler_params")
    if manager.backend_for_params(user_params) != "interpret":
        # The interpreter runs any mesh: its params go through as they are.
        kwargs["compiler_params"] = mesh.compiler_params_for(user_params)
    kwargs["interpret"] = interpret_in_force(backend, kwargs.get("interpret", False))

    return pallas_call(
        fn, out, grid=mesh.axis_sizes, in_specs=whole(tuple(args)), out_specs=whole(out),
        name=name or fn.__name__,
        # The mesh names its backend unless the call chose one (compiler params select too).
        backend=backend or (None if kwargs.get("compiler_params") is not None
                            or kwargs.get("interpret") else mesh.backend),
        _grid_names=mesh.axis_names, **kwargs,
    )(*args)
