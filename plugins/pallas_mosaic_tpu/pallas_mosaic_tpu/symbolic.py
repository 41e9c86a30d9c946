"""Kernels exported with symbolic shapes, written as JAX writes them for the TPU runtime.

Inside ``pl.pallas_export_experimental(dynamic_shapes=True)``, ``jax.export`` with shape
polymorphism may give a kernel blocks (and a grid) of symbolic size. Mosaic's vector dialect
has static shapes only, so each distinct symbolic dimension the kernel uses is written as a
placeholder constant: the largest int32, then counting down, at most 128 of them. The module
says how to compute each placeholder when the kernel is called, in two attributes:

- ``tpu.dynamic_dimension_mapping_indices_<p>``: where each dimension variable of the kernel
  is found, as ``{operand_index, dimension_index}`` of the custom call's operands;
- ``tpu.dynamic_dimension_mapping_module_<p>``: a StableHLO module computing the dimension
  from those variables' values (in that order).

The runtime specialises the module for each call's shapes; so does the emulator
(:func:`specialize`). Without that mode a symbolic grid size is a dynamic grid axis, and a
symbolic block is refused by the core.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jaxlib.mlir import ir

from pallas_core import backend as plb
from pallas_core.backend import PallasError, UnsupportedError

UPPER = 2**31 - 1
"""The first placeholder: the largest int32."""
COUNT = 128
"""How many placeholders a kernel may have."""
_INDICES = "tpu.dynamic_dimension_mapping_indices_"
_MODULE = "tpu.dynamic_dimension_mapping_module_"


class Placeholders:
    """The placeholder of each symbolic dimension of one call, handed out in turn."""

    def __init__(self, call: plb.KernelCall) -> None:
        self.call = call
        self.table: dict[Any, int] = {}
        for d in call.symbolic_dims:
            self(d)

    def __call__(self, dim: Any) -> int:
        if dim not in self.table:
            if len(self.table) == COUNT:
                raise PallasError(
                    f"kernel {self.call.name!r} ({self.call.source}) has more than {COUNT} "
                    "distinct symbolic dimensions, the most a Mosaic TPU module can carry. "
                    "Fix: export with fewer dimension variables, or static block shapes.")
            self.table[dim] = UPPER - len(self.table)
        return self.table[dim]


def lower(call: plb.KernelCall, lower_kernel: Callable[[plb.KernelCall], tuple[ir.Module, str]]
          ) -> tuple[ir.Module, str]:
    """``lower_kernel(call)``, with the call's symbolic dimensions written as placeholders and
    the module told how to compute them, when kernels are exported with dynamic shapes."""
    if not plb.dynamic_shapes_export_enabled() or not call.symbolic_dims:
        return lower_kernel(call)
    placeholders = Placeholders(call)
    kernel_dims = dict(placeholders.table)  # the module's own; the rest stay outside it
    module, name = lower_kernel(call.with_dims(placeholders))
    _describe(module, call, kernel_dims)
    return module, name


def _operand_avals(call: plb.KernelCall) -> list[Any]:
    """The custom call's operands: the dynamic grid sizes first, then the inputs."""
    gm = call.grid_mapping
    sizes = [plb.ShapedArray((), np.dtype(np.int32))] * gm.num_dynamic_grid_bounds
    return sizes + [plb.ShapedArray(bm.array_shape, bm.dtype) for bm in gm.inputs]


def _describe(module: ir.Module, call: plb.KernelCall, dims: dict[Any, int]) -> None:
    gm = call.grid_mapping
    kernel_avals = [v.aval for v in call.jaxpr.jaxpr.invars]
    grid = [s for s in gm.symbolic_sizes if s is not None]
    names = plb.dimension_variables([*kernel_avals, plb.ShapedArray(tuple(grid), np.int32)])
    where: dict[str, tuple[int, int]] = {}
    for k, aval in enumerate(_operand_avals(call)):
        for d, size in enumerate(getattr(aval, "shape", ())):
            where.setdefault(str(size), (k, d))
    missing = [n for n in names if n not in where]
    if missing:
        raise PallasError(
            f"kernel {call.name!r} ({call.source}) uses the dimension variable(s) {missing}, "
            "which no input of the call has as a whole dimension, so the TPU runtime could not "
            "find their values. Fix: give an input a dimension that is exactly that variable "
            "(e.g. export with shapes ('m', 128) rather than ('8*m', 128)).")
    i64 = ir.IntegerType.get_signless(64)
    with module.context:
        for dim, placeholder in dims.items():
            program = plb.dimension_program(dim, names, [UPPER] * len(names))
            module.operation.attributes[_MODULE + str(placeholder)] = ir.StringAttr.get(program)
            module.operation.attributes[_INDICES + str(placeholder)] = ir.ArrayAttr.get([
                ir.DictAttr.get({"operand_index": ir.IntegerAttr.get(i64, where[n][0]),
                                 "dimension_index": ir.IntegerAttr.get(i64, where[n][1])})
                for n in names])


# --- the runtime's side: a module specialised for one call's operands --------------------


def placeholders_of(module: ir.Module) -> dict[int, tuple[list[tuple[int, int]], str]]:
    """Each placeholder of ``module`` with where its variables are and its StableHLO
    program; empty for a module of static shapes."""
    attrs = module.operation.attributes
    found: dict[int, tuple[list[tuple[int, int]], str]] = {}
    for k in range(len(attrs)):
        named = attrs[k]
        if not named.name.startswith(_INDICES):
            continue
        p = int(named.name[len(_INDICES):])
        where = [(ir.IntegerAttr(ir.DictAttr(a)["operand_index"]).value,
                  ir.IntegerAttr(ir.DictAttr(a)["dimension_index"]).value)
                 for a in ir.ArrayAttr(named.attr)]
        found[p] = (where, ir.StringAttr(attrs[_MODULE + str(p)]).value)
    return found


def values(module: ir.Module, operands: Sequence[np.ndarray]) -> dict[int, int]:
    """The value of each placeholder of ``module`` for a call with ``operands``."""
    out = {}
    for p, (where, program) in placeholders_of(module).items():
        dims = [int(np.asarray(operands[k]).shape[d]) if d >= 0 else int(np.asarray(operands[k]))
                for k, d in where]
        out[p] = plb.run_dimension_program(program, dims)
    return out


def specialize(module: ir.Module, operands: Sequence[np.ndarray]) -> ir.Module:
    """``module`` with its placeholders replaced by their values for ``operands`` (as the TPU
    runtime specialises it): in types, integer attributes and integer constants. A grid
    axis whose size was a placeholder becomes dynamic: its size is one of the call's leading
    operands, as for any dynamic grid. A module of static shapes is returned as it is."""
    table = values(module, operands)
    if not table:
        return module
    kernel = kernel_function(module)
    bounds = ([int(b) for b in ir.DenseI64ArrayAttr(kernel.attributes["iteration_bounds"])]
              if "iteration_bounds" in kernel.attributes else [])
    text = _substituted(module.operation.get_asm(enable_debug_info=True), table)
    with module.context:
        out = ir.Module.parse(text)
        attrs = out.operation.attributes
        for name in [attrs[k].name for k in range(len(attrs))]:
            if name.startswith((_INDICES, _MODULE)):
                del out.operation.attributes[name]
        if bounds:
            dynamic = ir.ShapedType.get_dynamic_size()
            kernel_function(out).attributes["iteration_bounds"] = ir.DenseI64ArrayAttr.get(
                [dynamic if b in table else b for b in bounds])
    return out


def kernel_function(module: ir.Module) -> ir.Operation:
    """The Mosaic kernel's ``func.func`` (the one carrying the grid attributes)."""
    for op in module.body.operations:
        if "dimension_semantics" in op.attributes or "window_params" in op.attributes:
            return op.operation
    raise UnsupportedError("the Mosaic TPU emulator found no kernel function in the module")


def _substituted(text: str, table: dict[int, int]) -> str:
    pattern = re.compile(r"(?<![\d.])(" + "|".join(str(p) for p in table) + r")(?![\d.])")
    return pattern.sub(lambda m: str(table[int(m.group(1))]), text)
