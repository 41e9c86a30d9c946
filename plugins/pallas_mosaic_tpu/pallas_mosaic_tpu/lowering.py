"""Lowering of a traced kernel (a :class:`pallas_core.KernelCall`) to a Mosaic TPU module.

The module holds the kernel ``func.func`` and one ``transform_<i>`` function per windowed
operand (its index map). The kernel takes the grid indices (``i32``), the scalar-prefetch
operands (SMEM), one memref per input and output block (VMEM; whole arrays for ``ANY``), then
the scratch buffers. Attributes on the kernel carry what the TPU runtime pipelines: the
``iteration_bounds`` (grid), ``dimension_semantics``, ``window_params`` (block shapes and index
maps), ``scalar_prefetch`` and ``scratch_operands``.

The body is lowered with the rule table of :mod:`pallas_mosaic_tpu.registry`, which the rule
modules fill: ``rules_arrays`` (vector shapes), ``rules_compute`` (MXU products, reductions to
an index, gathers, top-k, convolutions), ``rules_refs`` (views, loads and stores, scoped
buffers), ``rules_devices`` (grid and mesh indices, DMAs, semaphores), ``rules_debug``
(printing and checks), and the modules of ``pltpu``'s own primitives. Anything else raises an
``UnsupportedError`` naming the primitive and the kernel's source line. The names other
backends extend the lowering with (SparseCore) are importable from here.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import func
from jaxlib.mosaic.python import tpu

from pallas_core import HOST
from pallas_core import backend as plb
from pallas_core.backend import (
    BARRIER_SEMAPHORE,
    BlockMapping,
    KernelCall,
    PallasError,
    UnsupportedError,
)
from pallas_mosaic_tpu import ir as mir
from pallas_mosaic_tpu import rules_arrays, rules_compute, rules_debug  # noqa: F401 - register rules
from pallas_mosaic_tpu.params import (
    CMEM,
    HBM,
    SEMAPHORE,
    SMEM,
    VMEM_SHARED,
    AccMemorySpace,
    TPUCompilerParams,
)
from pallas_mosaic_tpu.registry import RULES, AccRef, Lowering, lower_jaxpr, rule
from pallas_mosaic_tpu.rules_devices import copy_device_id, role_views
from pallas_mosaic_tpu.rules_refs import (
    accessed_view,
    eqn_transforms,
    ref_view,
    scratch_memref_type,
    view_indices,
)

__all__ = [
    "RULES", "AccRef", "Lowering", "accessed_view", "copy_device_id", "eqn_transforms",
    "lower_jaxpr", "lower_kernel", "lowering_rules", "module_text", "ref_view", "role_views",
    "rule", "scratch_memref_type", "view_indices",
]


def _space(bm: BlockMapping, prefetch: bool) -> str:
    if prefetch or bm.memory_space is SMEM:
        return "smem"
    if bm.memory_space is HBM:
        return "hbm"
    if bm.memory_space is HOST:
        return "host"
    if bm.memory_space is CMEM or bm.memory_space is VMEM_SHARED:
        return str(bm.memory_space.value)
    return "any" if bm.is_whole_array else "vmem"


def lower_kernel(call: KernelCall, mesh_axes: tuple[tuple[str, int], ...] = ()
                 ) -> tuple[ir.Module, str]:
    """The Mosaic module of ``call`` (in a fresh context) and its kernel function's name.

    ``mesh_axes`` are the ``shard_map`` mesh axes the call runs under (for device ids).
    """
    gm = call.grid_mapping
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in call.name) or "kernel"
    n_pf = gm.num_scalar_prefetch
    ctx = mir.new_context()
    with ctx, ir.Location.unknown():
        module = ir.Module.create()
        i32 = ir.IntegerType.get_signless(32)
        grid_types = [i32] * len(gm.grid)
        operand_types = []
        for k, bm in enumerate(gm.block_mappings):
            space = _space(bm, k < n_pf)
            # Squeezed block dimensions (``None``) stay in the operand as size 1, as JAX has
            # them; the kernel body sees the operand squeezed (below).
            # Scalar prefetch and ANY/HBM operands come whole; VMEM and SMEM ones by block.
            whole = k < n_pf or space in ("any", "hbm")
            shape = bm.array_shape if whole else bm.full_block_shape
            operand_types.append(mir.memref(shape, bm.dtype, space))
        # The barrier semaphore and accumulators are not operands of the kernel function.
        scratch = [a for a in gm.scratch_avals if a.memory_space is not BARRIER_SEMAPHORE
                   and not isinstance(a.memory_space, AccMemorySpace)]
        scratch_types = [scratch_memref_type(a.inner_aval.shape, a.inner_aval.dtype, a.memory_space)
                         for a in scratch]
        windows = []
        with ir.InsertionPoint(module.body):
            kernel = func.FuncOp(name, (grid_types + operand_types + scratch_types, []))
            for j, bm in enumerate(gm.block_mappings[n_pf:]):
                if _space(bm, False) not in ("vmem", "smem"):
                    windows.append(ir.DictAttr.get({}))
                    continue
                _transform(call, bm, f"transform_{j}", grid_types + operand_types[:n_pf])
                windows.append(ir.DictAttr.get({
                    "transform_indices": ir.FlatSymbolRefAttr.get(f"transform_{j}"),
                    "window_bounds": ir.DenseI64ArrayAttr.get(list(bm.full_block_shape)),
                    **_pipeline_mode(call, bm),
                }))
        _set_attributes(kernel, call, windows, len(scratch))
        entry = kernel.add_entry_block()
        with ir.InsertionPoint(entry):
            args = list(entry.arguments)
            for k, bm in enumerate(gm.block_mappings):
                args[len(gm.grid) + k] = _squeezed(args[len(gm.grid) + k], bm)
            lowering = Lowering(call, "mosaic_tpu", args[:len(gm.grid)], mesh_axes=mesh_axes)
            n_args = len(gm.grid) + len(gm.block_mappings)
            given = iter(args[n_args:])
            scratch_args = []
            for a in gm.scratch_avals:
                if a.memory_space is BARRIER_SEMAPHORE:  # the kernel's barrier semaphore
                    scratch_args.append(tpu.GetBarrierSemaphoreOp(
                        scratch_memref_type((), np.int32, SEMAPHORE)).result)
                elif isinstance(a.memory_space, AccMemorySpace):
                    scratch_args.append(lowering.alloc_accumulator(
                        a.inner_aval.shape, a.inner_aval.dtype, a.memory_space))
                else:
                    scratch_args.append(next(given))
            lower_jaxpr(lowering, call.jaxpr.jaxpr, call.jaxpr.consts,
                        [*args[len(gm.grid):n_args], *scratch_args])
            func.ReturnOp([])
        plb.verify_module(module, "mosaic_tpu", call.name)
    return module, name


def _squeezed(arg: ir.Value, bm: BlockMapping) -> ir.Value:
    """The block ``arg`` without its squeezed (``None``) dimensions: the Ref the body sees."""
    ty = ir.MemRefType(arg.type)
    if list(ty.shape) == list(bm.ref_shape):
        return arg
    return tpu.MemRefSqueezeOp(ir.MemRefType.get(list(bm.ref_shape), ty.element_type,
                                                 memory_space=ty.memory_space), arg).result


def _pipeline_mode(call: KernelCall, bm: BlockMapping) -> dict[str, ir.Attribute]:
    """The window attributes of a ``pl.Buffered`` pipeline mode (as JAX's lowering emits)."""
    mode = bm.pipeline_mode
    if mode is None:
        return {}
    if mode.use_lookahead or mode.buffer_count > 2:
        raise UnsupportedError(
            f"kernel {call.name!r}: {bm.origin} has pipeline_mode={mode}; the TPU pipeline "
            "takes 1 or 2 buffers and no lookahead. Fix: pl.Buffered(1) or pl.Buffered(2).")
    kind = "synchronous" if mode.buffer_count == 1 else "double_buffered"
    attrs = {"pipeline_mode": ir.Attribute.parse(f"#tpu.pipeline_mode<{kind}>")}
    if mode.revisit is not None:
        if mode.revisit.value == "any" and mode.buffer_count > 1:
            raise UnsupportedError(
                f"kernel {call.name!r}: {bm.origin} has pipeline_mode={mode}; revisiting any "
                "block needs a single buffer on TPU. Fix: pl.Buffered(1, revisit=...).")
        attrs["revisit_mode"] = ir.Attribute.parse(f"#tpu.revisit_mode<{mode.revisit.value}>")
    return attrs


def _transform(call: KernelCall, bm: BlockMapping, name: str, arg_types: list[ir.Type]) -> None:
    i32 = ir.IntegerType.get_signless(32)
    fn = func.FuncOp(name, (arg_types, [i32] * len(bm.array_shape)))
    entry = fn.add_entry_block()
    with ir.InsertionPoint(entry):
        lowering = Lowering(call, "mosaic_tpu")
        outs = lower_jaxpr(lowering, bm.index_map.jaxpr, bm.index_map.consts,
                           list(entry.arguments))
        func.ReturnOp([o if not isinstance(o, int) else mir.constant(o, np.int32) for o in outs])


def _set_attributes(kernel: Any, call: KernelCall, windows: list[ir.Attribute],
                    num_scratch: int) -> None:
    gm = call.grid_mapping
    params = call.compiler_params
    semantics = list(getattr(params, "dimension_semantics", None) or ())
    if isinstance(params, TPUCompilerParams) and semantics and len(semantics) != len(
            gm.user_grid):
        raise PallasError(
            f"kernel {call.name!r}: dimension_semantics has {len(semantics)} entries but the "
            f"grid {gm.user_grid} has {len(gm.user_grid)} axes. Fix: give one per grid axis.")
    # The cores of a mesh (pl.kernel) run in parallel; grid steps default to arbitrary.
    default = "parallel" if gm.is_mesh else "arbitrary"
    # Ours are enum members; JAX's own pltpu.CompilerParams may hold its enum or strings.
    names = ["parallel"] * gm.num_batch_axes + [
        str(getattr(s, "value", s)).lower() for s in semantics] + [
        default] * (len(gm.user_grid) - len(semantics))
    attrs = kernel.attributes
    attrs["dimension_semantics"] = ir.ArrayAttr.get(
        [ir.Attribute.parse(f"#tpu.dimension_semantics<{n}>") for n in names])
    if gm.grid:
        # A dynamic axis's size is a leading operand of the custom call (see plugin.py).
        dynamic = set(gm.dynamic_axes)
        attrs["iteration_bounds"] = ir.DenseI64ArrayAttr.get(
            [ir.ShapedType.get_dynamic_size() if a in dynamic else b
             for a, b in enumerate(gm.grid)])
        attrs["window_params"] = ir.ArrayAttr.get(windows)
    i64 = ir.IntegerType.get_signless(64)
    attrs["scalar_prefetch"] = ir.IntegerAttr.get(i64, gm.num_scalar_prefetch)
    attrs["scratch_operands"] = ir.IntegerAttr.get(i64, num_scratch)
    attrs["tpu.core_type"] = ir.Attribute.parse("#tpu.core_type<tc>")


def module_text(module: ir.Module) -> str:
    with module.context:
        return module.operation.get_asm(enable_debug_info=False)  # type: ignore[no-any-return]


def lowering_rules() -> Mapping[Any, plb.Rule]:
    """Mosaic TPU's full rule table, read-only: the shared rules, those of the ``rules_*``
    modules and those of the TensorCore primitives (:mod:`pallas_mosaic_tpu.primitives`); every
    entry has the one rule signature (``pallas_core.backend.Rule``)."""
    from pallas_mosaic_tpu import primitives  # noqa: F401 - defines the primitives' rules

    return types.MappingProxyType(RULES)
