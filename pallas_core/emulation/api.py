"""``pl.emulate``: run a function on CPU with every kernel as a hardware backend compiles it.

Each kernel of the function (``pl.pallas_call``/``pl.kernel``, or ``jax.experimental.pallas``'s
``pallas_call``) is lowered for the backend's hardware platform, exactly as it would be for the
device; the custom calls of the lowered program are handed to the backend plugin's
``pallas_emulate`` hook, which executes the module they carry with numpy. Everything else in the
function runs as plain JAX on CPU. The kernel runs inside a ``jax.pure_callback``, so the emulated
function can be jitted and vmapped (kernel by kernel, in sequence); to differentiate, emulate the
derivative (``pl.emulate(jax.grad(f), ...)``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jaxlib.mlir import ir

from pallas_core import _jax
from pallas_core.call import pallas_call_p, validate
from pallas_core.emulation import shape_programs
from pallas_core.emulation.call import EmulatedCall, EmulateOptions, Joint
from pallas_core.emulation.machine import Compiler, Rule
from pallas_core.emulation.types import attribute_array, dtype_of, shape_of
from pallas_core.errors import (
    ArgumentError,
    PallasError,
    UnsupportedError,
    report_from_callback,
    reraising_reports,
)
from pallas_core.plugins import manager
from pallas_core.utils import check_tool_arguments


def emulate(fn: Callable[..., Any], *, backend: str, target: str | None = None,
            checked: bool = False, seed: int | None = None) -> Callable[..., Any]:
    """``fn`` run on CPU with each of its kernels compiled by ``backend`` and emulated.

    :param backend: a hardware backend with an emulator (``"mosaic_tpu"``, ``"sparsecore"``,
        ``"triton"``); kernels are lowered by it whatever backend they name.
    :param target: the backend's hardware target (``"v5e"``, ``"sm_90"``, ``"gfx942"``).
    :param checked: report out-of-bounds accesses and races between programs as errors.
    :param seed: run the grid axes a kernel declares parallel in an order shuffled by ``seed``
        (a correct kernel's result does not depend on it).
    """
    if not isinstance(backend, str):
        raise ArgumentError(f"pl.emulate(backend=...) must be a backend name, found {backend!r}")
    check_tool_arguments("pl.emulate", fn, target, checked=(checked, "bool"),
                         seed=(seed, "int or None"))
    found = manager.get(backend)
    if not hasattr(found.plugin, "pallas_emulate"):
        runs_here = "cpu" in found.info.platforms
        raise UnsupportedError(
            f"pl.emulate(backend={backend!r}): {backend!r} has no emulator (its plugin "
            "implements no pallas_emulate hook)"
            + (", and runs on CPU already. Fix: call the function directly." if runs_here
               else ". Fix: emulate with a backend that has one (mosaic_tpu, sparsecore, "
               "triton)."))
    platform = _platform(found.info.platforms, target, backend)
    kinds = dict(found.info.device_kinds)
    device_kind = kinds.get(target or "", next(iter(kinds.values()), None))
    options = EmulateOptions(backend=backend, target=target, checked=checked, seed=seed)

    @functools.wraps(fn)
    def emulated(*args: Any, **kwargs: Any) -> Any:
        # JAX's own code may ask which chip it compiles for, while the function is traced
        # or its kernels lowered: it is told the target's (BackendInfo.device_kinds).
        with _told(device_kind, platform):
            return run(args, kwargs)

    def run(args: Any, kwargs: Any) -> Any:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)
        flat = jax.tree_util.tree_leaves((args, kwargs))
        replace = functools.partial(_replace, platform=platform, options=options,
                                    device_kind=device_kind)
        # An emulator's error inside a callback reaches here wrapped by the runtime.
        with reraising_reports():
            outs = _jax.evaluate_replacing(closed.jaxpr, closed.consts, flat, replace,
                                           _has_kernel)
            outs = jax.block_until_ready(outs)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

    return emulated


def _attached(platform: str) -> bool:
    try:
        return bool(jax.devices(platform))
    except RuntimeError:
        return False


def _assumed(device_kind: str | None, platform: str) -> Any:
    """JAX told it compiles for ``device_kind`` when no ``platform`` device is attached (a
    mesh of that one device: for lowering a kernel on its own)."""
    return _unless_attached(_jax.assume_device, device_kind, platform)


def _told(device_kind: str | None, platform: str) -> Any:
    """JAX's questions about the chip answered with ``device_kind`` when no ``platform``
    device is attached (no mesh: the function's own meshes stay as they are)."""
    return _unless_attached(_jax.chip_answers, device_kind, platform)


def _unless_attached(context: Callable[[str, str], Any], device_kind: str | None,
                     platform: str) -> Any:
    if device_kind is None or _attached(platform):
        return contextlib.nullcontext()
    return context(device_kind, platform)


def _platform(platforms: Sequence[str], target: str | None, backend: str) -> str:
    hardware = [p for p in platforms if p != "cpu"]
    if not hardware:
        raise UnsupportedError(
            f"pl.emulate(backend={backend!r}): {backend!r} runs on CPU already and has no "
            "emulator. Fix: name a hardware backend (mosaic_tpu, sparsecore, triton), or call "
            "the function directly.")
    if target is not None and target.startswith("gfx") and "rocm" in hardware:
        return "rocm"
    return hardware[0]


@functools.cache
def _kernel_primitives() -> dict[Any, str]:
    """The kernel primitives pl.emulate replaces, with their kind (looked up once)."""
    jax_prims = _jax.jax_pallas_primitives()
    kinds = {pallas_call_p: "pallas_call", jax_prims["pallas_call"]: "jax_pallas_call"}
    if "core_map" in jax_prims:
        kinds[jax_prims["core_map"]] = "jax_core_map"
    if "mpmd_map" in jax_prims:
        kinds[jax_prims["mpmd_map"]] = "jax_pallas_call"
    kinds[_jax.call_exported_primitive()] = "exported"
    return kinds


_KERNEL_TARGETS = ("@tpu_custom_call", "@__gpu$xla.gpu.triton", "@mosaic_gpu")
"""Custom-call targets of kernels, as they appear in an exported program's text."""


@functools.lru_cache(maxsize=64)
def _exports_kernel(exported: Any) -> bool:
    """Whether a ``jax.export.Exported`` program calls a kernel (a hardware custom call)."""
    text = str(exported.mlir_module())
    return any(t in text for t in _KERNEL_TARGETS)


def _kind(eqn: Any) -> str | None:
    """What kernel ``eqn`` runs (``"pallas_call"``, ``"exported"``, ...), or ``None``: an
    exported function counts when its program calls a kernel."""
    kind = _kernel_primitives().get(eqn.primitive)
    if kind == "exported" and not _exports_kernel(eqn.params["exported"]):
        return None
    return kind


def _has_kernel(jaxpr: Any) -> bool:
    from pallas_core.reference import all_eqns

    return any(_kind(eqn) is not None for eqn in all_eqns(jaxpr))


class _Meshes(threading.local):
    def __init__(self) -> None:
        self.stack: list[Any] = []


_meshes = _Meshes()
"""The meshes of the ``shard_map`` bodies being rewritten (innermost last), per thread."""


def _replace(eqn: Any, invals: list[Any], *, platform: str, options: EmulateOptions,
             device_kind: str | None = None) -> list[Any] | None:
    kind = _kind(eqn)
    if kind is None:
        mesh = _jax.shard_map_mesh(eqn)
        if mesh is None or not any(_has_kernel(j) for j in _jax.sub_jaxprs(eqn.params)):
            return None
        # The kernels of this body are lowered as the devices of ``mesh`` run them.
        replace = functools.partial(_replace, platform=platform, options=options,
                                    device_kind=device_kind)
        _meshes.stack.append(mesh)
        try:
            return _jax.bind_rewriting(eqn, invals, replace, _has_kernel)
        finally:
            _meshes.stack.pop()
    if kind == "jax_core_map":
        raise UnsupportedError(
            "pl.emulate does not run jax.experimental.pallas's core_map/pl.kernel (a stateful "
            "kernel over a mesh). Fix: write it with pallas_core's pl.kernel, or with "
            "pallas_call.")
    if kind == "pallas_call":
        call = eqn.params["call"]
        if call.backend != options.backend:
            # Checked for the emulated backend as pl.stages and a call naming it are (memory
            # spaces, capabilities, the plugin's rules): a kernel it cannot lower is refused
            # with the cause, not with whatever the lowering trips over first.
            validate(call, options.backend)
        params = dict(eqn.params, call=call.replace(backend=options.backend, interpret=False))
    elif kind == "exported":  # its kernels were lowered when it was exported
        params = dict(eqn.params)
        exported = params["exported"]
        if platform not in exported.platforms:
            raise UnsupportedError(
                f"pl.emulate(backend={options.backend!r}): the exported function "
                f"{exported.fun_name!r} was exported for {list(exported.platforms)}, not "
                f"{platform!r}. Fix: export it with platforms=[{platform!r}] (or emulate "
                "with a backend of one of its platforms).")
    else:
        params = dict(eqn.params, interpret=False)
        if params.get("compiler_params") is None and options.backend == "triton":
            # JAX's GPU lowering picks Triton by the type of the compiler params.
            from jax.experimental.pallas import triton as jax_triton

            params["compiler_params"] = jax_triton.CompilerParams()
    in_avals = [v.aval for v in eqn.invars]
    out_avals = [v.aval for v in eqn.outvars]
    mesh = _meshes.stack[-1] if _meshes.stack else None
    # JAX's lowering may ask which chip it targets: it lowers under a mesh of that chip,
    # except under a shard_map, whose mesh is the device mesh. Ours takes the target from
    # the options.
    told = device_kind if mesh is None and kind != "pallas_call" else None
    kernel = _kernel(eqn.primitive, params, in_avals, out_avals, platform, options, told,
                     mesh)
    if not any(isinstance(x, _jax.Tracer) for x in invals):
        return [jax.numpy.asarray(o) for o in kernel(*invals)]
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals]
    # Under shard_map each device's call says where in the mesh it runs.
    coords = [jax.lax.axis_index(a) for a in mesh.axis_names] if mesh is not None else []
    outs = jax.pure_callback(kernel, shapes, *invals, *coords, vmap_method="sequential")
    return list(outs)


_KERNELS: collections.OrderedDict[Any, _Kernel] = collections.OrderedDict()
_CACHE_SIZE = 64


def _kernel(primitive: Any, params: dict[str, Any], in_avals: Sequence[Any],
            out_avals: Sequence[Any], platform: str, options: EmulateOptions,
            device_kind: str | None, mesh: Any = None) -> _Kernel:
    """The kernel lowered and compiled once per primitive, parameters, avals, options and
    mesh (a function emulated again traces to the same kernel: JAX caches the traced kernel)."""
    args = (primitive, params, in_avals, out_avals, platform, options, device_kind, mesh)
    try:
        key = (primitive, tuple(sorted(params.items())), tuple(in_avals), tuple(out_avals),
               platform, options, device_kind, mesh)
        hash(key)
    except TypeError:
        return _Kernel(*args)
    found = _KERNELS.get(key)
    if found is None:
        found = _KERNELS[key] = _Kernel(*args)
        if len(_KERNELS) > _CACHE_SIZE:
            _KERNELS.popitem(last=False)
    else:
        _KERNELS.move_to_end(key)
    return found


class _Kernel:
    """One kernel lowered for the hardware: called with numpy operands, it emulates."""

    def __init__(self, primitive: Any, params: dict[str, Any], in_avals: Sequence[Any],
                 out_avals: Sequence[Any], platform: str, options: EmulateOptions,
                 device_kind: str | None = None, mesh: Any = None) -> None:
        self.options = options
        self.out_avals = out_avals
        call = params.get("call")
        self.name = call.name if call is not None else _jax_kernel_name(params)
        self.mesh_shape = tuple(int(n) for n in mesh.axis_sizes) if mesh is not None else ()
        self.devices = int(np.prod(self.mesh_shape, dtype=np.int64))
        self.here = threading.local()
        """The device (logical id) this thread emulates."""

        def bind(*args: Any) -> Any:
            return primitive.bind(*args, **params)

        avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in in_avals]
        if mesh is not None:
            # Lowered in a shard_map over the mesh, as each device runs it (device ids and
            # the kernel's axis_index resolve against the mesh); each device's operands are
            # the kernel's own, so the shard_map splits nothing.
            every = jax.sharding.PartitionSpec()
            bind = jax.shard_map(bind, mesh=mesh, in_specs=every, out_specs=every,
                                 check_vma=False)
        # Lowered on its own, whatever is being traced around it.
        with _jax.top_level(), _assumed(device_kind, platform):
            lowered = jax.jit(bind).trace(*avals).lower(lowering_platforms=(platform,))
        self.module = lowered.compiler_ir("stablehlo")
        with self.module.context:
            compiler = Compiler(_glue_rules(self), backend=f"{options.backend} program",
                                module=self.module)
            self.main = compiler.function("main")

    def __call__(self, *operands: Any) -> tuple[np.ndarray, ...]:
        if self.mesh_shape:  # under shard_map: the device's coordinates in the mesh follow
            coords = [int(np.asarray(c)) for c in operands[-len(self.mesh_shape):]]
            operands = operands[:-len(self.mesh_shape)]
            self.here.device = int(np.ravel_multi_index(coords, self.mesh_shape))
        try:
            with np.errstate(all="ignore"):
                outs = self.main(*[np.asarray(x) for x in operands])
        except PallasError as e:
            report_from_callback(e)
            raise
        return tuple(_check_result(o, a, self.name) for o, a in zip(outs, self.out_avals,
                                                                    strict=True))


def _jax_kernel_name(params: dict[str, Any]) -> str:
    """The name of a ``jax.experimental.pallas`` kernel: ``name=``, else its function's (or
    an exported function's)."""
    if "exported" in params:
        return str(params["exported"].fun_name)
    debug = getattr(params.get("jaxpr"), "debug_info", None)
    return str(params.get("name") or getattr(debug, "func_name", None) or "kernel")


def _check_result(value: Any, aval: Any, name: str) -> np.ndarray:
    value = np.asarray(value)
    if value.shape != tuple(aval.shape):
        raise PallasError(f"emulating kernel {name!r}: a result has shape {value.shape}, "
                          f"expected {tuple(aval.shape)}")
    return value.astype(aval.dtype, copy=False)


# -- the program around the kernel: its custom calls and the glue JAX emits --------------

def _glue_rules(kernel: _Kernel) -> dict[str, Rule]:
    def custom_call(c: Compiler, op: ir.Operation) -> Callable[..., Any]:
        return _custom_call(op, kernel)

    def constant(c: Compiler, op: ir.Operation) -> Callable[..., Any]:
        value = attribute_array(op.attributes["value"], op.results[0].type)
        return lambda: value

    def reshape(c: Compiler, op: ir.Operation) -> Callable[..., Any]:
        shape = shape_of(op.results[0].type)
        return lambda x: np.reshape(x, shape)

    def convert(c: Compiler, op: ir.Operation) -> Callable[..., Any]:
        dtype = dtype_of(op.results[0].type)
        return lambda x: np.asarray(x).astype(dtype)

    def broadcast_in_dim(c: Compiler, op: ir.Operation) -> Callable[..., Any]:
        shape = shape_of(op.results[0].type)
        dims = list(ir.DenseI64ArrayAttr(op.attributes["broadcast_dimensions"]))

        def run(x: Any) -> Any:
            x = np.asarray(x)
            expanded = [1] * len(shape)
            for src, dst in enumerate(dims):
                expanded[dst] = x.shape[src]
            return np.broadcast_to(x.reshape(expanded), shape).copy()
        return run

    def tuple_(c: Compiler, op: ir.Operation) -> Callable[..., Any]:
        return lambda *xs: tuple(xs)

    def get_tuple_element(c: Compiler, op: ir.Operation) -> Callable[..., Any]:
        index = ir.IntegerAttr(op.attributes["index"]).value
        return lambda t: t[index]

    def get_dimension_size(c: Compiler, op: ir.Operation) -> Callable[..., Any]:
        dim = ir.IntegerAttr(op.attributes["dimension"]).value
        return lambda x: np.int32(np.shape(x)[dim])

    def concatenate(c: Compiler, op: ir.Operation) -> Callable[..., Any]:
        axis = ir.IntegerAttr(op.attributes["dimension"]).value
        return lambda *xs: np.concatenate([np.asarray(x) for x in xs], axis=axis)

    def manual_computation(c: Compiler, op: ir.Operation) -> Callable[..., Any]:
        body = c.region(op.regions[0])  # one device's part of a shard_map
        n = len(op.results)
        return lambda *xs: (lambda out: out[0] if n == 1 else tuple(out))(body(*xs))

    # An exported function computes its symbolic dimensions with integer scalar operations.
    return {**shape_programs.RULES,
            "stablehlo.get_dimension_size": get_dimension_size,
            "stablehlo.concatenate": concatenate,
            "stablehlo.custom_call": custom_call, "stablehlo.constant": constant,
            "sdy.manual_computation": manual_computation,
            # Where a value is laid out over the mesh, not what it is.
            "sdy.sharding_constraint": lambda c, op: lambda x: x,
            "sdy.reshard": lambda c, op: lambda x: x,
            "stablehlo.reshape": reshape, "stablehlo.convert": convert,
            "stablehlo.broadcast_in_dim": broadcast_in_dim, "stablehlo.tuple": tuple_,
            "stablehlo.get_tuple_element": get_tuple_element,
            "stablehlo.optimization_barrier": lambda c, op: lambda *xs: (
                xs[0] if len(xs) == 1 else tuple(xs))}


_ALIAS = re.compile(r"output_tuple_indices = \[([0-9, ]*)\], operand_index = ([0-9]+)")


def _shape_assertion(op: ir.Operation) -> Callable[..., Any]:
    """An exported function's check of its arguments' shapes: raises its message if false."""
    message = ir.StringAttr(op.attributes["error_message"]).value

    def run(ok: Any, *values: Any) -> None:
        if not bool(np.asarray(ok)):
            raise ArgumentError(message.format(*[int(np.asarray(v)) for v in values]))
    return run


def _custom_call(op: ir.Operation, kernel: _Kernel) -> Callable[..., Any]:
    attrs = op.attributes
    target = ir.StringAttr(attrs["call_target_name"]).value
    if target == "shape_assertion":
        return _shape_assertion(op)
    # Result shapes given as operands (symbolic shapes of an exported function).
    shape_operands = ([int(i) for i in np.asarray(
        attribute_array(attrs["indices_of_shape_operands"],
                        attrs["indices_of_shape_operands"].type))]
        if "indices_of_shape_operands" in attrs else [])
    config: str | bytes = ""
    if "backend_config" in attrs:
        raw = attrs["backend_config"]
        config = _python_value(raw) if isinstance(raw, ir.StringAttr) else ""
    extra = _python_value(attrs["mhlo.backend_config"]) if "mhlo.backend_config" in attrs \
        else {}
    aliases = []
    if "output_operand_aliases" in attrs:
        for alias in ir.ArrayAttr(attrs["output_operand_aliases"]):
            m = _ALIAS.search(str(alias))
            if m is None:
                raise UnsupportedError(f"pl.emulate cannot read the alias {alias}")
            indices = [int(i) for i in m.group(1).split(",") if i.strip()]
            aliases.append((indices[0] if indices else 0, int(m.group(2))))
    results = [(() if shape_operands else shape_of(r.type), dtype_of(r.type))
               for r in op.results]
    options = kernel.options
    if target in _SHARDING_MARKS:  # GSPMD's marks around a shard_map body: no data change
        return lambda *xs: xs[0] if len(xs) == 1 else tuple(xs)
    meeting = _Meeting(kernel.devices, kernel.name) if kernel.mesh_shape else None

    def run(*operands: Any) -> Any:
        shapes = [tuple(int(d) for d in np.asarray(operands[k])) for k in shape_operands]
        operands = tuple(x for k, x in enumerate(operands) if k not in shape_operands)
        given = [(shape, dt) for shape, (_, dt) in zip(shapes, results, strict=True)] \
            if shape_operands else results
        call = EmulatedCall(target=target, backend_config=config, attributes=extra,
                            operands=tuple(np.asarray(x) for x in operands),
                            results=tuple(given), aliases=tuple(aliases), options=options,
                            name=kernel.name, device=getattr(kernel.here, "device", 0),
                            devices=max(kernel.devices, 1),
                            meeting=meeting.join if meeting is not None else None)
        answered = manager.broadcast("pallas_emulate", first=True, call=call)
        outs = answered[0][1] if answered else None
        if outs is None:
            raise UnsupportedError(
                f"pl.emulate(backend={options.backend!r}): no installed plugin emulates the "
                f"custom call {target!r} of kernel {kernel.name!r}. Fix: install the plugin "
                "whose hardware it targets (it must implement the pallas_emulate hook).")
        outs = list(outs)
        if len(outs) != len(results):
            raise PallasError(f"the emulator of {target!r} returned {len(outs)} results for "
                              f"kernel {kernel.name!r}, expected {len(results)}")
        fixed = [np.asarray(o).astype(dt, copy=False).reshape(sh)
                 for o, (sh, dt) in zip(outs, given, strict=True)]
        return fixed[0] if len(fixed) == 1 else tuple(fixed)
    return run


_SHARDING_MARKS = frozenset({"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"})

_MEETING_TIMEOUT_S = 600.0
"""How long the devices that reached a joint kernel wait for the others."""


class _Meeting:
    """Where the devices of a ``shard_map`` meet to run one custom call together: each
    device's thread brings its call; the last to arrive runs them all and every device
    leaves with its own results (round after round, as the kernel is called again)."""

    def __init__(self, devices: int, name: str) -> None:
        self.devices, self.name = devices, name
        self.cv = threading.Condition()
        self.round = 0
        self.calls: dict[int, EmulatedCall] = {}
        self.ended: dict[int, tuple[Sequence[Sequence[np.ndarray]] | None,
                                    BaseException | None, int]] = {}

    def join(self, call: EmulatedCall, joint: Joint) -> Sequence[np.ndarray]:
        with self.cv:
            turn = self.round
            self.calls[call.device] = call
            if len(self.calls) == self.devices:
                calls = [self.calls[d] for d in range(self.devices)]
                self.calls = {}
                outs: Sequence[Sequence[np.ndarray]] | None = None
                error: BaseException | None = None
                try:
                    outs = joint(calls)
                    if len(outs) != self.devices:
                        raise PallasError(f"the joint emulation of kernel {self.name!r} "
                                          f"returned {len(outs)} devices' results, expected "
                                          f"{self.devices}")
                except BaseException as e:  # every device raises it
                    error = e
                self.ended[turn] = (outs, error, self.devices)
                self.round += 1
                self.cv.notify_all()
            elif not self.cv.wait_for(lambda: self.round > turn, _MEETING_TIMEOUT_S):
                missing = sorted(set(range(self.devices)) - set(self.calls))
                raise PallasError(
                    f"emulating kernel {self.name!r}: devices {sorted(self.calls)} reached it, "
                    f"devices {missing} did not within {_MEETING_TIMEOUT_S:.0f} s; a kernel "
                    "whose devices talk to each other must be called by every device of the "
                    "shard_map's mesh (as on the hardware, where the others would hang).")
            outs, error, left = self.ended[turn]
            if left == 1:
                del self.ended[turn]
            else:
                self.ended[turn] = (outs, error, left - 1)
        if error is not None:
            raise error
        assert outs is not None
        return outs[call.device]


def _python_value(attr: ir.Attribute) -> Any:
    """An attribute as a Python value (strings that are not UTF-8 as bytes)."""
    if isinstance(attr, ir.StringAttr):
        data = attr.value_bytes
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return data
    if isinstance(attr, ir.BoolAttr):
        return bool(attr.value)
    if isinstance(attr, ir.IntegerAttr):
        return int(attr.value)
    if isinstance(attr, ir.FloatAttr):
        return float(attr.value)
    if isinstance(attr, ir.DictAttr):
        return {named.name: _python_value(named.attr) for named in attr}
    if isinstance(attr, ir.ArrayAttr):
        return [_python_value(a) for a in attr]
    return str(attr)


__all__ = ["EmulateOptions", "EmulatedCall", "emulate"]
