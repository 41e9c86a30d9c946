"""The Triton kernels of a lowered program, as XLA's GPU runtime receives them, without a GPU.

A Triton kernel lowers to a ``stablehlo.custom_call`` of ``__gpu$xla.gpu.triton`` whose
``mhlo.backend_config`` holds the kernel's name, launch grid, ``num_warps``, ``num_stages``,
``debug`` and the TTIR module as MLIR bytecode (``ir``). :func:`triton_calls` decodes each such
call of a program lowered for ``cuda`` into a :class:`TritonCall`: that config, the call's
operand and result types, and the signature of the module's kernel function (its argument types
and their hints, ``tt.divisibility`` and the like). Made to compare this backend with another
producer of the same kernel (``jax.experimental.pallas``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxlib.mlir import ir

from pallas_core.backend import PallasError, walk_operations
from pallas_triton import ir as tir

CUSTOM_CALL_TARGET = "__gpu$xla.gpu.triton"


@dataclasses.dataclass(frozen=True)
class Argument:
    """One argument of the kernel function: its type as text (``!tt.ptr<f16>``) and its
    attributes (``{"tt.divisibility": 16}``)."""

    type: str
    hints: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class TritonCall:
    """One Triton custom call: its config, its operands' and results' types, and its kernel's
    signature."""

    target: str
    name: str
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int
    debug: bool
    operand_types: tuple[str, ...]
    result_types: tuple[str, ...]
    arguments: tuple[Argument, ...]
    ttir: str
    """The module as text (without locations)."""


def _value(attr: ir.Attribute) -> Any:
    if isinstance(attr, ir.StringAttr):
        return attr.value_bytes
    if isinstance(attr, ir.BoolAttr):
        return bool(attr.value)
    if isinstance(attr, ir.IntegerAttr):
        return int(attr.value)
    return str(attr)


def _dict(attr: ir.Attribute) -> dict[str, Any]:
    d = ir.DictAttr(attr)
    return {d[i].name: _value(d[i].attr) for i in range(len(d))}


def triton_calls(lowered: Any) -> list[TritonCall]:
    """The Triton custom calls of ``lowered`` (``jax.jit(f).trace(...).lower(
    lowering_platforms=("cuda",))``, or its ``compiler_ir("stablehlo")`` module), in order."""
    module = lowered.compiler_ir("stablehlo") if hasattr(lowered, "compiler_ir") else lowered
    found = []
    for op in walk_operations(module.operation):
        op = op.operation
        if op.name != "stablehlo.custom_call":
            continue
        target = ir.StringAttr(op.attributes["call_target_name"]).value
        if target != CUSTOM_CALL_TARGET:
            continue
        config = _dict(op.attributes["mhlo.backend_config"])
        arguments, ttir = _signature(config["ir"], config["name"].decode())
        found.append(TritonCall(
            target=target, name=config["name"].decode(),
            grid=(config["grid_x"], config["grid_y"], config["grid_z"]),
            num_warps=config["num_warps"], num_stages=config["num_stages"],
            debug=bool(config.get("debug", False)),
            operand_types=tuple(str(v.type) for v in op.operands),
            result_types=tuple(str(r.type) for r in op.results),
            arguments=arguments, ttir=ttir))
    return found


def _signature(ir_bytes: bytes, name: str) -> tuple[tuple[Argument, ...], str]:
    """The argument types and hints of function ``name`` of the TTIR module ``ir_bytes``."""
    with tir.new_context(), ir.Location.unknown():
        module = ir.Module.parse(ir_bytes)
        for op in module.body.operations:
            op = op.operation
            if op.name == "tt.func" and ir.StringAttr(op.attributes["sym_name"]).value == name:
                break
        else:
            raise PallasError(f"the Triton module of kernel {name!r} has no function of that "
                              "name")
        fn_type = ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)
        attrs = (list(ir.ArrayAttr(op.attributes["arg_attrs"]))
                 if "arg_attrs" in op.attributes else [])
        args = tuple(Argument(str(t), _dict(attrs[i]) if i < len(attrs) else {})
                     for i, t in enumerate(fn_type.inputs))
        text = module.operation.get_asm(enable_debug_info=False)
    return args, text
