"""The Mosaic TPU emulator: a ``tpu_custom_call`` run on CPU with numpy, as a TensorCore runs it.

:func:`emulate` decodes the call's Mosaic module and :func:`run_kernel` walks its grid the way
the TPU's pipeline does. At every grid point it evaluates each window's index map (with the grid
indices and the scalar-prefetch values), copies the input blocks whose block index changed into
their VMEM buffers (a block that runs past the array's edge is padded with NaN, or zeros for
integers, where the TPU leaves unspecified data), runs the kernel body, and writes an output
block back when its index is about to change and at the end, cut at the array's edge. An
output block stays resident while its index does not change, so accumulating into it over an
``arbitrary`` axis works as on the TPU; a fresh output block starts as NaN (zeros for integers),
as the TPU never reads outputs. Windows in ``ANY``/HBM memory and the scalar-prefetch operands
are the whole arrays; scratch operands persist over the grid. With ``options.seed`` the points
of the ``parallel`` axes run in a shuffled order. On a megacore chip (``target="v4"``,
``"v5p"``) the leading ``parallel`` axes are shared by two TensorCores, each running its
contiguous part of them with its own VMEM, SMEM and semaphores (``tpu.core_id`` says which).

Under ``shard_map`` every device makes the call; a kernel that talks to other devices
(``has_communication``) runs on all of them together (:func:`run_devices`): each device in its
own thread, one at a time, switching where a device waits on a semaphore. ``tpu.device_id`` is
the device's row-major index in the mesh. A DMA (remote or not) completes when it starts: a
remote one writes the target device's buffer (the same operand, scratch buffer or scoped
allocation there, at the same offset) and signals the target semaphore there; a remote signal
adds to the other device's semaphore; waits take from this device's semaphores. A wait nothing
will satisfy, and a device id outside the mesh, are errors.

The operations (:data:`RULES`): ``arith``, ``math``, ``scf`` and ``func`` from
:mod:`pallas_core.emulation`, ``vector``/``memref``/memory ``tpu`` operations from
:mod:`pallas_mosaic_tpu.emulator_ops`, the compute ``tpu`` operations from
:mod:`pallas_mosaic_tpu.emulator_compute`, and the DMA, semaphore and device ``tpu`` operations
from :mod:`pallas_mosaic_tpu.emulator_devices`; the running kernel's state is
:mod:`pallas_mosaic_tpu.emulator_state`'s. This module walks the grid and is the
``pallas_emulate`` hook's entry (:func:`emulate`). A backend that reuses the grid walk
(SparseCore) passes its own rules as ``extra_rules``.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from jaxlib.mlir import ir

from pallas_core.backend import EMULATOR_ARITH_RULES as ARITH_RULES
from pallas_core.backend import (
    EMULATOR_ASSERT_RULES,
    EmulatedCall,
    EmulateOptions,
    EmulatorRule,
    PallasError,
    UnsupportedError,
    dtype_of,
    shape_of,
)
from pallas_mosaic_tpu import ir as mir
from pallas_mosaic_tpu import symbolic
from pallas_mosaic_tpu.emulator_bits import RULES as BIT_RULES
from pallas_mosaic_tpu.emulator_compute import RULES as COMPUTE_RULES
from pallas_mosaic_tpu.emulator_devices import RULES as DEVICE_RULES
from pallas_mosaic_tpu.emulator_ops import RULES as MEMORY_RULES
from pallas_mosaic_tpu.emulator_ops import (
    EmulationError,
    allocate,
    enum_case,
    int_array,
    int_attribute,
)
from pallas_mosaic_tpu.emulator_state import KernelState, Network, TPUCompiler
from pallas_mosaic_tpu.symbolic import kernel_function

RULES: dict[str, EmulatorRule] = {
    **ARITH_RULES, **EMULATOR_ASSERT_RULES, **MEMORY_RULES, **BIT_RULES, **COMPUTE_RULES,
    **DEVICE_RULES, "tpu.transpose": MEMORY_RULES["vector.transpose"],
}
"""Every operation the TensorCore emulator runs, by name."""


# -- the grid walk ----------------------------------------------------------------------------

class _Window:
    """One input or output window: its buffer and where its current block sits."""

    def __init__(self, index: int, params: Mapping[str, ir.Attribute], arg_type: ir.Type,
                 array: np.ndarray, transform: Any) -> None:
        self.index = index
        self.array = array
        self.transform = transform
        self.whole = "window_bounds" not in params or "any" in str(
            ir.MemRefType(arg_type).memory_space) or "hbm" in str(
            ir.MemRefType(arg_type).memory_space)
        self.block: tuple[int, ...] | None = None
        self.element = "window_kind" in params
        if self.element and any(int(v) for v in re.findall(r"-?\d+",
                                                           str(params["window_kind"]))):
            raise UnsupportedError(f"window {index}: the Mosaic TPU emulator does not "
                                   "support padded element windows")
        if self.whole:
            self.buffer = array
            return
        self.bounds = tuple(int_array(params["window_bounds"]))
        self.buffer = np.zeros(shape_of(arg_type), dtype_of(arg_type))
        if int(np.prod(self.bounds)) != self.buffer.size:
            raise UnsupportedError(f"window {index}: window bounds {self.bounds} do not match "
                                   f"the kernel's operand type {arg_type}")

    def region(self, block: tuple[int, ...]) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
        """(array slice, buffer slice) of ``block``, cut at the array's edge."""
        starts = block if self.element else tuple(b * n for b, n in zip(block, self.bounds,
                                                                         strict=True))
        src, dst = [], []
        for d, (s, n) in enumerate(zip(starts, self.bounds, strict=True)):
            lo, hi = max(s, 0), min(s + n, self.array.shape[d])
            if hi <= lo:
                raise EmulationError(
                    f"window {self.index}: block {block} lies outside the array of shape "
                    f"{self.array.shape}. Fix: make the index map return blocks inside it.")
            src.append(slice(lo, hi))
            dst.append(slice(lo - s, hi - s))
        return tuple(src), tuple(dst)

    def fetch(self, block: tuple[int, ...]) -> None:
        src, dst = self.region(block)
        view = self.buffer.reshape(self.bounds)
        view[...] = _poison(view.dtype)
        view[dst] = self.array[src]

    def fresh(self) -> None:
        self.buffer.reshape(self.bounds)[...] = _poison(self.buffer.dtype)

    def write_back(self, block: tuple[int, ...]) -> None:
        src, dst = self.region(block)
        self.array[src] = self.buffer.reshape(self.bounds)[dst]


def _poison(dtype: np.dtype) -> Any:
    return np.nan if np.dtype(dtype).kind == "f" else 0


def _grid_points(bounds: Sequence[int], semantics: Sequence[str],
                 seed: int | None) -> Iterator[tuple[int, ...]]:
    points = list(itertools.product(*map(range, bounds)))
    parallel = [d for d, s in enumerate(semantics) if s == "parallel"]
    if seed is None or not parallel:
        return iter(points)
    groups: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for p in points:
        groups.setdefault(tuple(p[d] for d in parallel), []).append(p)
    keys = list(groups)
    order = np.random.default_rng(seed).permutation(len(keys))
    return iter([p for k in order for p in groups[keys[k]]])


def tensor_cores(target: str | None) -> int:
    """The TensorCores a kernel's grid is spread over on ``target``: 2 on the megacore chips
    (v4, v5p), else 1 (also with no target: the default chip, v5e)."""
    if target is None:
        return 1
    from pallas_mosaic_tpu.plugin import CHIPS
    from pallas_mosaic_tpu.tpu_info import chip_version_from_device_kind

    chip = chip_version_from_device_kind(CHIPS.get(target, target))
    if chip is None:
        raise PallasError(
            f"pl.emulate(backend='mosaic_tpu', target={target!r}): unknown TPU generation. "
            f"Fix: use one of {sorted(CHIPS)} (or a device kind such as 'TPU v5 lite').")
    return chip.num_physical_tensor_cores_per_chip if chip.supports_megacore else 1


def _core_shares(points: list[tuple[int, ...]], bounds: Sequence[int],
                 semantics: Sequence[str], cores: int) -> list[list[tuple[int, ...]]]:
    """The grid points each TensorCore runs, in order: the grid's leading ``parallel`` axes
    are cut into ``cores`` contiguous runs, as a megacore chip shares a grid."""
    lead = next((d for d, s in enumerate(semantics) if s != "parallel"), len(semantics))
    if cores == 1 or lead == 0:
        return [points]
    per_core = -(-int(np.prod(bounds[:lead])) // cores)
    shares: list[list[tuple[int, ...]]] = [[] for _ in range(cores)]
    for p in points:
        shares[int(np.ravel_multi_index(p[:lead], bounds[:lead])) // per_core].append(p)
    return shares


def run_kernel(module: ir.Module, operands: Sequence[np.ndarray],
               results: Sequence[tuple[tuple[int, ...], np.dtype]],
               aliases: Sequence[tuple[int, int]], options: EmulateOptions, *,
               extra_rules: Mapping[str, EmulatorRule] | None = None,
               backend: str = "mosaic_tpu", device: int | None = None,
               name: str = "kernel") -> list[np.ndarray]:
    """Runs the Mosaic kernel of ``module`` on ``operands`` (the custom call's: dynamic grid
    sizes first, then scalar prefetch, then inputs) and returns its results. ``device``: the
    logical id ``tpu.device_id`` reads (under ``shard_map``); ``name``: the kernel's, for
    messages."""
    with module.context, ir.Location.unknown():
        return _prepare(module, operands, results, aliases, options, extra_rules or {},
                        backend, KernelState((), device, name=name))()


def run_devices(module: ir.Module, calls: Sequence[EmulatedCall]) -> list[list[np.ndarray]]:
    """Runs the kernel of ``module`` on every device of a ``shard_map`` together (``calls[d]``
    is device ``d``'s call): each device in turn until it waits on a semaphore that another
    device has yet to signal. Returns each device's results."""
    network = Network(len(calls), calls[0].name if calls else "")
    with module.context, ir.Location.unknown():
        network.states = [KernelState((), d, network) for d in range(len(calls))]
        runs = [_prepare(module, [np.asarray(x) for x in call.operands], call.results,
                         call.aliases, call.options, {}, "mosaic_tpu", state)
                for call, state in zip(calls, network.states, strict=True)]
    outs: list[list[np.ndarray]] = [[] for _ in calls]

    def program(d: int) -> Callable[[], None]:
        def go() -> None:
            with module.context, ir.Location.unknown(), np.errstate(all="ignore"):
                outs[d] = runs[d]()
        return go
    network.turns.run([program(d) for d in range(len(calls))])
    return outs


def _prepare(module: ir.Module, operands: Sequence[np.ndarray],
             results: Sequence[tuple[tuple[int, ...], np.dtype]],
             aliases: Sequence[tuple[int, int]], options: EmulateOptions,
             extra_rules: Mapping[str, EmulatorRule], backend: str,
             state: KernelState) -> Callable[[], list[np.ndarray]]:
    """Compiles the kernel and lays out its buffers (those another device can reach are
    registered in ``state``); returns the function that walks the grid and gives the
    results."""
    fn = kernel_function(module)
    attrs = fn.attributes
    bounds = [int(b) for b in ir.DenseI64ArrayAttr(attrs["iteration_bounds"])] \
        if "iteration_bounds" in attrs else []
    dynamic = [d for d, b in enumerate(bounds) if b < 0]
    for k, d in enumerate(dynamic):
        bounds[d] = int(np.asarray(operands[k]))
    operands = list(operands[len(dynamic):])
    semantics = [enum_case(s) for s in ir.ArrayAttr(attrs["dimension_semantics"])] \
        if "dimension_semantics" in attrs else []
    n_prefetch = int_attribute(fn, "scalar_prefetch", 0)
    n_scratch = int_attribute(fn, "scratch_operands", 0)
    arg_types = list(ir.FunctionType(ir.TypeAttr(attrs["function_type"]).value).inputs)
    grid_args, rest = arg_types[:len(bounds)], arg_types[len(bounds):]
    n_windows = len(rest) - n_prefetch - n_scratch
    n_in = n_windows - len(results)
    if n_in != len(operands) - n_prefetch or n_in < 0:
        raise UnsupportedError(f"the kernel takes {n_windows} windows; the call has "
                               f"{len(operands) - n_prefetch} inputs and {len(results)} "
                               "outputs")
    state.bounds = tuple(bounds)
    compiler = TPUCompiler({**RULES, **extra_rules}, state, backend=backend, module=module)
    body = compiler.function(fn)
    prefetch = [np.array(x, dtype_of(t)) for x, t in zip(operands[:n_prefetch], rest,
                                                          strict=False)]
    outs = [np.zeros(shape, dtype) for shape, dtype in results]
    for r, o in aliases:
        outs[r][...] = operands[o - len(dynamic)]
    params = [ir.DictAttr(p) for p in ir.ArrayAttr(attrs["window_params"])] \
        if "window_params" in attrs else [ir.DictAttr.get({})] * n_windows
    windows = []
    for k, arrays in enumerate([*operands[n_prefetch:], *outs]):
        t = rest[n_prefetch + k]
        p = {name: params[k][name] for name in ("window_bounds", "transform_indices",
                                                "window_kind") if name in params[k]}
        array = np.array(arrays, copy=True) if k < n_in else arrays
        if array.dtype != dtype_of(t):
            array = array.astype(dtype_of(t))
            if k >= n_in:
                outs[k - n_in] = array
        transform = compiler.function(ir.FlatSymbolRefAttr(p["transform_indices"]).value) \
            if "transform_indices" in p else None
        windows.append(_Window(k, p, t, array, transform))
    points = list(_grid_points(bounds, semantics, options.seed))
    cores = tensor_cores(options.target) if backend == "mosaic_tpu" else 1
    shares = _core_shares(points, bounds, semantics, cores)

    def memories() -> tuple[list[np.ndarray], list[np.ndarray]]:
        """A TensorCore's own VMEM, SMEM and semaphores: its copy of the scalar prefetch
        operands (a kernel may write them) and fresh scratch; windows start empty."""
        mine = [np.array(x, copy=True) for x in prefetch]
        scratch = [allocate(t) for t in rest[n_prefetch + n_windows:]]
        for w in windows:
            w.block = None
        for k, buffer in enumerate([*mine, *[w.buffer for w in windows], *scratch]):
            state.register(("arg", k), buffer)
        state.register("barrier", state.barrier)
        return mine, scratch

    first = memories()  # laid out before any device runs: others may write to them at once

    def run() -> list[np.ndarray]:
        for core, share in enumerate(shares):
            state.core = core
            mine, scratch = first if core == 0 else memories()
            try:
                _walk(body, windows, n_in, mine, scratch, share, grid_args)
            except EmulationError as e:
                raise _in_context(e, state, windows, n_in, mine, scratch) from e
        return [np.asarray(o).astype(dtype) for o, (_, dtype) in zip(outs, results,
                                                                     strict=True)]
    return run


def _in_context(error: EmulationError, state: KernelState, windows: list[_Window], n_in: int,
                prefetch: list[np.ndarray], scratch: list[np.ndarray]) -> EmulationError:
    """``error`` naming the kernel, the grid step :func:`_walk` was at, and (for an
    out-of-bounds access) the operand whose buffer it reached."""
    named = [(f"input {w.index}" if w.index < n_in else f"output {w.index - n_in}", w.buffer)
             for w in windows]
    named += [(f"scalar-prefetch operand {j}", x) for j, x in enumerate(prefetch)]
    named += [(f"scratch operand {j}", x) for j, x in enumerate(scratch)]
    ref = error.ref
    operand = next((name for name, x in named if ref is not None and isinstance(x, np.ndarray)
                    and np.shares_memory(ref, x)), None)
    step = error.grid_step
    where = f"kernel {state.name!r}" + (f" at grid step {step}" if step is not None else "")
    where += f", {operand}" if operand else ""
    found = EmulationError(f"{where}: {error}")
    found.ref = ref
    return found


def _walk(body: Any, windows: list[_Window], n_in: int, prefetch: list[np.ndarray],
          scratch: list[np.ndarray], points: Sequence[tuple[int, ...]],
          grid_args: Sequence[ir.Type]) -> None:
    grid_dtypes = [dtype_of(t) for t in grid_args]
    blocked = [w for w in windows if not w.whole]

    def blocks_at(point: tuple[int, ...]) -> list[tuple[int, ...]]:
        ids = [np.asarray(i, dt) for i, dt in zip(point, grid_dtypes, strict=True)]
        return [tuple(int(v) for v in w.transform(*ids, *prefetch)) for w in blocked]

    upcoming = blocks_at(points[0]) if points else []
    for step, point in enumerate(points):
        current = upcoming
        for w, block in zip(blocked, current, strict=True):
            if w.block != block:
                if w.index < n_in:
                    w.fetch(block)
                else:
                    w.fresh()
                w.block = block
        ids = [np.asarray(i, dt) for i, dt in zip(point, grid_dtypes, strict=True)]
        try:
            body(*ids, *prefetch, *[w.buffer for w in windows], *scratch)
        except EmulationError as e:
            e.grid_step = tuple(int(i) for i in point)
            raise
        upcoming = blocks_at(points[step + 1]) if step + 1 < len(points) else []
        for k, w in enumerate(blocked):
            if w.index >= n_in and (not upcoming or upcoming[k] != w.block):
                w.write_back(w.block)  # type: ignore[arg-type]
                w.block = None


# -- the hook ---------------------------------------------------------------------------------

def is_sparsecore(config: Mapping[str, Any]) -> bool:
    """Whether a ``tpu_custom_call``'s configuration targets a SparseCore."""
    return "SPARSECORE" in str(config.get("device_type", "")).upper()


def decode(backend_config: str | bytes) -> tuple[dict[str, Any], ir.Module]:
    """The configuration (without the body) and the Mosaic module of a ``tpu_custom_call``."""
    config = json.loads(backend_config)
    body = config["custom_call_config"].pop("body")
    return config, mir.deserialize(body.encode("ascii"))


def emulate(call: EmulatedCall) -> list[np.ndarray] | None:
    """Runs a TensorCore ``tpu_custom_call``; ``None`` for other calls."""
    if call.target != "tpu_custom_call":
        return None
    config = json.loads(call.backend_config)
    if is_sparsecore(config):
        return None
    _, module = decode(call.backend_config)
    # Exported with symbolic shapes: specialised for these operands, as the runtime does.
    module = symbolic.specialize(module, [np.asarray(x) for x in call.operands])
    if config.get("custom_call_config", {}).get("has_communication"):
        return list(call.run_jointly(functools.partial(run_devices, module)))
    return run_kernel(module, [np.asarray(x) for x in call.operands], call.results,
                      call.aliases, call.options,
                      device=call.device if call.under_shard_map else None, name=call.name)
