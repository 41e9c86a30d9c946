"""Reading Mosaic kernels back out of lowered programs, to compare them with other producers.

``kernels(stablehlo_text)`` finds every ``tpu_custom_call`` and decodes its module;
``summary(module)`` gives the attributes a TPU runtime acts on (grid, dimension semantics,
windows, scalar prefetch, scratch); ``block_indices(module, window, ids, prefetch)`` evaluates a
window's index map at one grid point. Together they let a test check this backend against what
``jax.experimental.pallas`` emits for the same kernel, whatever the text of the index maps;
``assert_same_kernel(ours, theirs)`` does all of it for two modules, and
``assert_same_config(ours, theirs)`` compares their configurations.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
from jaxlib.mlir import ir

from pallas_mosaic_tpu import ir as mir

_CALL = re.compile(r'custom_call @tpu_custom_call\(.*?backend_config = "((?:[^"\\]|\\.)*)"')


def _configs(stablehlo_text: str) -> list[dict[str, Any]]:
    """The backend config of every ``tpu_custom_call`` in the text."""
    found = []
    for match in _CALL.finditer(stablehlo_text):
        raw = re.sub(r"\\([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), match.group(1))
        found.append(json.loads(raw))
    return found


def kernels(stablehlo_text: str) -> list[tuple[dict[str, Any], ir.Module]]:
    """``(backend config without body, module)`` of every ``tpu_custom_call`` in the text.

    The config also goes without ``debug_locations``: the source locations that newer JAX
    moves out of the body into the config (metadata for error messages, not the kernel)."""
    found = []
    for config in _configs(stablehlo_text):
        config["custom_call_config"].pop("debug_locations", None)
        body = config["custom_call_config"].pop("body")
        found.append((config, mir.deserialize(body.encode("ascii"))))
    return found


def assert_same_config(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Raises ``AssertionError`` unless two configurations (as :func:`kernels` gives them,
    ours and JAX's for the same kernel) are equal, but for the cost estimate this backend
    computes where the user gave none (``plugin.estimated_cost``) and JAX writes none: where
    ``theirs`` has no ``cost_estimate``, ``ours`` is compared without its own. Where JAX
    has one (the user's), the two must match as everything else does."""
    if "cost_estimate" not in theirs.get("custom_call_config", {}):
        mine = {k: v for k, v in ours.get("custom_call_config", {}).items()
                if k != "cost_estimate"}
        ours = {**ours, "custom_call_config": mine} if "custom_call_config" in ours else ours
    if ours != theirs:
        keys = sorted(set(ours) | set(theirs))
        diff = {k: (ours.get(k), theirs.get(k)) for k in keys if ours.get(k) != theirs.get(k)}
        raise AssertionError(f"the configurations differ (ours, theirs): {diff}")


def format_versions(stablehlo_text: str) -> list[int]:
    """The Mosaic format version each ``tpu_custom_call`` body declares."""
    return [mir.serialized_version(c["custom_call_config"]["body"].encode("ascii"))
            for c in _configs(stablehlo_text)]


def _kernel_func(module: ir.Module) -> Any:
    for op in module.body.operations:
        if "window_params" in op.attributes or "dimension_semantics" in op.attributes:
            return op
    raise ValueError("no Mosaic kernel function in the module")


def _transform_name(attr: ir.Attribute) -> str:
    """A window's index map: a function's name, or (SparseCore) an affine map's text."""
    try:
        return str(ir.FlatSymbolRefAttr(attr).value)
    except ValueError:
        return str(attr)


def summary(module: ir.Module) -> dict[str, Any]:
    """What the runtime acts on: grid, semantics, prefetch and scratch counts, windows, and
    the types (memory spaces included) of the kernel's operands."""
    fn = _kernel_func(module)
    attrs = fn.attributes

    def get(name: str) -> Any:
        return attrs[name] if name in attrs else None  # noqa: SIM401 - no .get on attributes

    bounds = get("iteration_bounds")
    windows = []
    if get("window_params") is not None:
        for w in ir.ArrayAttr(attrs["window_params"]):
            d = ir.DictAttr(w)
            windows.append({
                "window_bounds": (tuple(ir.DenseI64ArrayAttr(d["window_bounds"]))
                                  if "window_bounds" in d else None),
                "transform": _transform_name(d["transform_indices"])
                if "transform_indices" in d else None,
            })
    return {
        "iteration_bounds": tuple(ir.DenseI64ArrayAttr(bounds)) if bounds is not None else (),
        "dimension_semantics": tuple(re.sub(r".*<(.*)>", r"\1", str(s))
                                     for s in ir.ArrayAttr(attrs["dimension_semantics"])),
        "scalar_prefetch": ir.IntegerAttr(attrs["scalar_prefetch"]).value,
        "scratch_operands": ir.IntegerAttr(attrs["scratch_operands"]).value,
        "windows": windows,
        # The kernel's parameters: shapes, element types and memory spaces of every operand.
        "operand_types": tuple(str(t) for t in
                               ir.FunctionType(ir.TypeAttr(attrs["function_type"]).value).inputs),
    }


_CMP = {0: np.equal, 1: np.not_equal, 2: np.less, 3: np.less_equal, 4: np.greater,
        5: np.greater_equal, 6: np.less, 7: np.less_equal, 8: np.greater,
        9: np.greater_equal}


def block_indices(module: ir.Module, transform: str, ids: Sequence[int],
                  prefetch: Sequence[np.ndarray] = ()) -> tuple[int, ...]:
    """Evaluates the index-map function ``transform`` at grid point ``ids``."""
    fn = next(op for op in module.body.operations
              if "sym_name" in op.attributes
              and ir.StringAttr(op.attributes["sym_name"]).value == transform)
    block = fn.regions[0].blocks[0]
    env: dict[Any, Any] = {}
    for arg, value in zip(block.arguments, [*ids, *prefetch]):
        env[arg] = value
    for op in block.operations:
        name = op.operation.name
        ins = [env[v] for v in op.operands]
        if name == "func.return":
            return tuple(int(v) for v in ins)
        env[op.results[0]] = _eval(name, op, ins)
    raise ValueError(f"{transform} has no return")


def _eval(name: str, op: Any, ins: list[Any]) -> Any:
    if name == "arith.constant":
        return ir.IntegerAttr(op.attributes["value"]).value
    if name in ("arith.index_cast", "arith.extui", "arith.extsi", "arith.trunci"):
        return ins[0]
    if name == "memref.load":  # out-of-range indices wrap (prefetch values may be arbitrary)
        table = np.asarray(ins[0])
        return int(table[tuple(int(i) % n for i, n in zip(ins[1:], table.shape))])
    if name == "arith.select":
        return ins[1] if ins[0] else ins[2]
    if name == "arith.cmpi":
        return bool(_CMP[ir.IntegerAttr(op.attributes["predicate"]).value](ins[0], ins[1]))
    a, b = ins
    ops = {"arith.addi": lambda: a + b, "arith.subi": lambda: a - b, "arith.muli": lambda: a * b,
           "arith.divsi": lambda: int(a / b), "arith.remsi": lambda: int(np.fmod(a, b)),
           "arith.floordivsi": lambda: a // b, "arith.maxsi": lambda: max(a, b),
           "arith.minsi": lambda: min(a, b), "arith.andi": lambda: a & b,
           "arith.ori": lambda: a | b, "arith.xori": lambda: a ^ b}
    if name not in ops:
        raise NotImplementedError(f"evaluating {name} in an index map")
    return ops[name]()


def prefetch_values(module: ir.Module, seed: int = 0) -> list[np.ndarray]:
    """Pseudo-random small non-negative integers for each scalar-prefetch operand of the kernel
    in ``module`` (index maps evaluated on them wrap out-of-range loads)."""
    fn = _kernel_func(module)
    info = summary(module)
    inputs = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value).inputs
    first = len(info["iteration_bounds"])
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 8, tuple(ir.MemRefType(t).shape)).astype(np.int64)
            for t in inputs[first:first + info["scalar_prefetch"]]]


def assert_same_kernel(ours: ir.Module, theirs: ir.Module,
                       prefetch: Sequence[np.ndarray] | None = None) -> None:
    """Raises ``AssertionError`` unless the two kernels agree on what a TPU runtime acts on:
    their :func:`summary`, and every window's block indices at every grid point (on
    ``prefetch``, or on :func:`prefetch_values` of ``ours``)."""
    a, b = summary(ours), summary(theirs)
    if a != b:
        diff = {k: (a[k], b[k]) for k in a if a[k] != b.get(k)}
        raise AssertionError(f"the kernels differ (ours, theirs): {diff}")
    values = prefetch_values(ours) if prefetch is None else list(prefetch)
    for k, window in enumerate(a["windows"]):
        if window["transform"] is None:
            continue
        for point in itertools.product(*map(range, a["iteration_bounds"])):
            mine = block_indices(ours, window["transform"], point, values)
            other = block_indices(theirs, b["windows"][k]["transform"], point, values)
            if mine != other:
                raise AssertionError(f"window {k} at grid point {point}: block {mine} here, "
                                     f"{other} in the other kernel")
