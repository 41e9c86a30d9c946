"""The Mosaic GPU module of a kernel, as JAX's CUDA runtime receives it, without a GPU.

The ``mosaic_gpu_v2`` custom call carries the module as MLIR bytecode in its backend config
(``module``, with ``kernel_hash``, the SHA-256 of those bytes). These helpers lower a kernel
for ``cuda`` on any machine, pull the module out and parse it back, for ``pl.stages`` and
tests.

To compare this backend with another producer of the same kernel (``jax.experimental.pallas``):
``kernels(stablehlo_text)`` decodes every ``mosaic_gpu_v2`` call into its config (the backend
config's flags and the call's operand and result types, layouts and aliases) and its verified
module; ``launch(module)`` reads the ``gpu.launch`` of the module (grid, cluster, block, dynamic
shared memory); ``assert_same_kernel(ours, theirs)`` compares all of it.
"""

from __future__ import annotations

import collections
import hashlib
import re
from typing import Any

import jax
from jax.experimental.mosaic import gpu as mgpu
from jaxlib.mlir import ir, passmanager

from pallas_core import backend as plb
from pallas_core.backend import KernelCall, PallasError, walk_operations

CUSTOM_CALL_TARGET = "mosaic_gpu_v2"
TMA_LOAD = re.compile(
    r"cp\.async\.bulk\.tensor\.(?:shared\.cluster\.global|\d+d\.shared::c\w+\.global)")
"""A TMA load (global to shared memory) in a module's text, as the installed Mosaic GPU library
writes it: an ``nvvm`` operation (JAX 0.10), or inline PTX (JAX 0.12)."""


def tma_loads(text: str) -> int:
    """How many TMA loads (:data:`TMA_LOAD`) a module's text holds."""
    return len(TMA_LOAD.findall(text))


def _backend_config(config: ir.DictAttr) -> dict[str, Any]:
    """The backend config's entries as Python values (strings as bytes, flags as bools)."""
    found: dict[str, Any] = {}
    for i in range(len(config)):
        named = config[i]
        attr = named.attr
        if isinstance(attr, ir.StringAttr):
            found[named.name] = ir.StringAttr(attr).value_bytes
        elif isinstance(attr, ir.BoolAttr):
            found[named.name] = ir.BoolAttr(attr).value
        else:
            found[named.name] = str(attr)
    return found


def custom_calls(stablehlo: Any) -> list[dict[str, Any]]:
    """The ``mosaic_gpu_v2`` custom calls of a lowered program (``jax.jit(f).lower(...)``, its
    ``compiler_ir("stablehlo")``, or its text): each as its backend config (``module`` and
    ``kernel_hash`` as bytes, ``use_custom_barrier``, ``uses_xla_collective_metadata``, ...)
    plus ``"call"``: the custom call's own attributes (``api_version``, ``has_side_effect``,
    ``operand_layouts``, ``result_layouts``, ``output_operand_aliases``) and its
    ``operand_types`` and ``result_types``, as text."""
    if hasattr(stablehlo, "compiler_ir"):
        stablehlo = stablehlo.compiler_ir("stablehlo")
    if isinstance(stablehlo, str):
        ctx = plb.make_ir_context()
        with ctx:
            return custom_calls(ir.Module.parse(stablehlo))
    found = []
    for op in walk_operations(stablehlo.operation):
        if op.operation.name != "stablehlo.custom_call":
            continue
        attrs = op.operation.attributes
        if ir.StringAttr(attrs["call_target_name"]).value != CUSTOM_CALL_TARGET:
            continue
        entry = _backend_config(ir.DictAttr(attrs["mhlo.backend_config"]))
        names = ("api_version", "has_side_effect", "operand_layouts", "result_layouts",
                 "output_operand_aliases")
        call: dict[str, Any] = {n: str(attrs[n]) if n in attrs else None for n in names}
        call["operand_types"] = tuple(str(v.type) for v in op.operation.operands)
        call["result_types"] = tuple(str(r.type) for r in op.operation.results)
        entry["call"] = call
        found.append(entry)
    return found


def parse_module(data: bytes) -> ir.Module:
    """Parses a custom call's module into a fresh context (Mosaic GPU dialect registered) and
    verifies it and its hash; raises a PallasError if it does not verify."""
    ctx = plb.make_ir_context()
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
    from pallas_mosaic_gpu.call_lowering import kernel_fn

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


def kernels(stablehlo_text: Any) -> list[tuple[dict[str, Any], ir.Module]]:
    """``(config, module)`` of every ``mosaic_gpu_v2`` call of a lowered program: ``config`` is
    :func:`custom_calls`'s entry without the module bytes and their hash (both checked here),
    ``module`` the kernel's module, parsed back and verified as the runtime does."""
    found = []
    for entry in custom_calls(stablehlo_text):
        module = check_call(entry)
        config = {k: v for k, v in entry.items() if k not in ("module", "kernel_hash")}
        found.append((config, module))
    return found


def blackwell_kernel(fn: Any, *args: Any) -> tuple[dict[str, Any], ir.Module]:
    """The one kernel of ``fn(*args)`` (JAX's or this project's) lowered for ``cuda`` on an
    assumed Blackwell device (else JAX's lowering marks the module sm_90a), as
    :func:`kernels` gives it."""
    from pallas_mosaic_gpu import targets

    with targets.assume(targets.BLACKWELL):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    (kernel,) = kernels(text)
    return kernel


def tcgen05_counts(module: Any) -> collections.Counter[str]:
    """How often each ``tcgen05`` instruction (with its qualifiers) appears in ``module``."""
    return collections.Counter(re.findall(r"tcgen05\.[\w.:]+", str(module)))


def _constant(value: Any, what: str) -> int:
    owner = value.owner
    if getattr(owner, "name", None) != "arith.constant":
        raise PallasError(f"the kernel's {what} is not a constant (it is computed by "
                          f"{getattr(owner, 'name', owner)}); launch() reads static launches only")
    return int(ir.IntegerAttr(owner.attributes["value"]).value)


def launch(module: ir.Module) -> dict[str, Any]:
    """What the runtime launches the kernel of ``module`` with, read from its one
    ``gpu.launch``: ``grid`` (blocks), ``cluster`` (blocks per cluster; ``(1, 1, 1)`` when the
    launch names none), ``block`` (threads per block), ``smem_bytes`` (dynamic shared memory),
    and ``arch`` (the ``mosaic_gpu.arch_major/minor`` the module is built for)."""
    launches = [op for op in walk_operations(module.operation) if op.operation.name == "gpu.launch"]
    if len(launches) != 1:
        raise PallasError(f"expected one gpu.launch in the Mosaic GPU module, found "
                          f"{len(launches)}")
    op = launches[0]

    def dims(prefix: str) -> tuple[int, ...]:
        return tuple(_constant(getattr(op, f"{prefix}{x}"), f"{prefix}{x}") for x in "XYZ")

    cluster = (1, 1, 1) if op.clusterSizeX is None else dims("clusterSize")
    smem = op.dynamicSharedMemorySize
    attrs = module.operation.attributes
    arch = tuple(ir.IntegerAttr(attrs[f"mosaic_gpu.arch_{k}"]).value
                 for k in ("major", "minor") if f"mosaic_gpu.arch_{k}" in attrs)
    return {"grid": dims("gridSize"), "cluster": cluster, "block": dims("blockSize"),
            "smem_bytes": 0 if smem is None else _constant(smem, "dynamic shared memory size"),
            "arch": arch}


def smem_buffers(module: ir.Module) -> list[tuple[int, str]]:
    """``(byte offset, memref type)`` of every view the kernel of ``module`` takes of its
    dynamic shared memory at a constant offset (its buffers and barriers), by offset."""
    found = set()
    for op in walk_operations(module.operation):
        if op.operation.name != "memref.view":
            continue
        source, offset = op.operation.operands[0], op.operation.operands[1]
        if "workgroup" not in str(source.type) or \
                getattr(offset.owner, "name", None) != "arith.constant":
            continue
        found.add((_constant(offset, "view offset"), str(op.operation.results[0].type)))
    return sorted(found)


def assert_same_kernel(ours: tuple[dict[str, Any], ir.Module],
                       theirs: tuple[dict[str, Any], ir.Module],
                       differences: dict[str, tuple[Any, Any]] | None = None) -> None:
    """Raises ``AssertionError`` unless two entries of :func:`kernels` agree on what a GPU
    runtime acts on: the custom call's config (flags, operand and result types, layouts,
    aliases) and the :func:`launch` of the module. ``differences`` names the fields known to
    differ, each as ``(ours, theirs)``: they must differ exactly so."""
    (config_a, module_a), (config_b, module_b) = ours, theirs
    a = {**config_a, **launch(module_a)}
    b = {**config_b, **launch(module_b)}
    expected = dict(differences or {})
    diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) or k in expected}
    if diff != expected:
        raise AssertionError(f"the kernels differ (ours, theirs): {diff}; expected "
                             f"differences: {expected}")
