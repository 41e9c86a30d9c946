"""The Mosaic GPU module of a kernel, as JAX's CUDA runtime receives it, without a GPU.

The ``mosaic_gpu_v2`` custom call carries the module as MLIR bytecode in its backend config
(``module``, with ``kernel_hash``, the SHA-256 of those bytes). These helpers lower a kernel
for ``cuda`` on any machine, pull the module out and parse it back, for ``pl.stages`` and
tests.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import jax
from jax.experimental.mosaic import gpu as mgpu
from jaxlib.mlir import ir, passmanager

from pallas_core import _jax
from pallas_core.errors import PallasError
from pallas_core.request import KernelCall

CUSTOM_CALL_TARGET = "mosaic_gpu_v2"


def _walk(op: Any) -> Iterator[Any]:
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                yield child
                yield from _walk(child.operation)


def custom_calls(stablehlo: Any) -> list[dict[str, Any]]:
    """The ``mosaic_gpu_v2`` custom calls of a lowered program (``jax.jit(f).lower(...)``, its
    ``compiler_ir("stablehlo")``, or its text): each as ``{"module": bytes, "kernel_hash":
    bytes}``."""
    if hasattr(stablehlo, "compiler_ir"):
        stablehlo = stablehlo.compiler_ir("stablehlo")
    if isinstance(stablehlo, str):
        ctx = _jax.make_ir_context()
        with ctx:
            return custom_calls(ir.Module.parse(stablehlo))
    found = []
    for op in _walk(stablehlo.operation):
        if op.operation.name != "stablehlo.custom_call":
            continue
        attrs = op.operation.attributes
        if ir.StringAttr(attrs["call_target_name"]).value != CUSTOM_CALL_TARGET:
            continue
        config = ir.DictAttr(attrs["mhlo.backend_config"])
        found.append({"module": ir.StringAttr(config["module"]).value_bytes,
                      "kernel_hash": ir.StringAttr(config["kernel_hash"]).value_bytes})
    return found


def parse_module(data: bytes) -> ir.Module:
    """Parses a custom call's module into a fresh context (Mosaic GPU dialect registered) and
    verifies it and its hash; raises a PallasError if it does not verify."""
    ctx = _jax.make_ir_context()
    mgpu.dialect.register_dialect(ctx)
    with ctx, ir.Location.unknown():
        # The runtime's form names its dialect `stable_mosaic_gpu`; the serde pass turns it
        # back into `mosaic_gpu` ops, as the runtime does before compiling.
        ctx.allow_unregistered_dialects = True
        module = ir.Module.parse(data)
        passmanager.PassManager.parse(
            "builtin.module(mosaic_gpu-serde{serialize=false})").run(module.operation)
        ctx.allow_unregistered_dialects = False
        if not module.operation.verify():
            raise PallasError("the Mosaic GPU module does not verify")
    return module


def check_call(call: dict[str, Any]) -> ir.Module:
    """:func:`parse_module` of one custom call, checking its ``kernel_hash`` too."""
    if hashlib.sha256(call["module"]).digest() != call["kernel_hash"]:
        raise PallasError("the custom call's kernel_hash is not the SHA-256 of its module")
    return parse_module(call["module"])


def lower_kernel(call: KernelCall) -> Any:
    """``call`` alone, lowered for ``cuda`` (JAX's ``Lowered``)."""
    from pallas_mosaic_gpu.lowering import kernel_fn

    fn = kernel_fn(call)
    ins = [jax.ShapeDtypeStruct(bm.array_shape, bm.dtype)
           for bm in call.grid_mapping.block_mappings[:len(call.grid_mapping.block_mappings)
                                                      - len(call.out_avals)]]
    return jax.jit(fn).trace(*ins).lower(lowering_platforms=("cuda",))


def module_bytes(call: KernelCall) -> bytes:
    """The module of ``call`` as the runtime receives it (MLIR bytecode)."""
    (found,) = custom_calls(lower_kernel(call))
    return found["module"]  # type: ignore[no-any-return]


def module_text(call: KernelCall) -> str:
    """The module of ``call`` as text (parsed back from the bytecode and verified)."""
    module = check_call(custom_calls(lower_kernel(call))[0])
    return str(module)
