"""The Triton emulator: XLA's Triton custom call run on CPU with numpy.

``__gpu$xla.gpu.triton`` carries a TTIR module (MLIR bytecode) and a launch grid. The emulator
parses the module, compiles its kernel ``tt.func`` once into numpy steps
(:mod:`pallas_core.emulation`) and runs it for every program of the grid, one after the other
(``z`` outermost, ``x`` innermost; shuffled with ``EmulateOptions.seed``). Every operation works
on whole tensors.

Memory: the kernel's arguments are pointers to its operands, then to its results (the order of
XLA's Triton call); a result aliased to an operand is that operand's buffer, so the kernel sees
one buffer through both pointers. Results that alias nothing start as NaN (floats) or the bytes
``0xCD`` (integers): XLA leaves them uninitialised, and a kernel that forgets to write part of
one shows it. A pointer is an ``int64`` address: buffer ``i`` starts at ``(i + 1) << 40`` and
``tt.addptr`` adds offsets times the pointee's size in bytes, so pointers travel through
``splat``, ``broadcast``, ``select`` and loops like any integer.

Out of bounds: lanes a mask turns off are never touched. Unchecked (the default), an access of a
lane outside its buffer reads 0 and drops the write (a GPU would read or corrupt other memory,
or fault). With ``EmulateOptions.checked`` such an access raises an
:class:`~pallas_core.errors.OutOfBoundsError` naming the kernel, the program and the operand, as
does a lane this project's lowering masks only because it falls outside the array where JAX's
lowering would access it (the lowering marks those lanes: ``lowering.UNMASKED_OUT_OF_BOUNDS``); and
two programs storing to one address without an atomic raise a :class:`RaceError`. A failing
``tt.assert`` raises a :class:`DeviceAssertError`; masked-off lanes of a load without ``other``
read 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jaxlib.mlir import ir
from jaxlib.triton import dialect as tt

from pallas_core import OutOfBoundsError
from pallas_core.backend import EMULATOR_ARITH_RULES as ARITH_RULES
from pallas_core.backend import (
    EmulatedCall,
    EmulatorCompiler,
    EmulatorRule,
    PallasError,
    UnsupportedError,
    as_signed,
    as_unsigned,
    dtype_of,
    shape_of,
)
from pallas_triton import emulator_ops
from pallas_triton import ir as tir
from pallas_triton.emulator_ops import ADDRESS, is_pointer, pointee, value_dtype
from pallas_triton.lowering import UNMASKED_OUT_OF_BOUNDS

_Fn = Callable[..., Any]
_SHIFT = 40
_HALF = 1 << (_SHIFT - 1)


class RaceError(PallasError):
    """Two programs of one Triton launch wrote one address without an atomic."""


class DeviceAssertError(PallasError, AssertionError):
    """A ``tt.assert`` of an emulated Triton kernel failed."""


@dataclasses.dataclass
class _Buffer:
    data: np.ndarray  # flat
    label: str
    writers: np.ndarray | None = None  # per element: the program that stored it last, or -1


@dataclasses.dataclass
class _Access:
    """The lanes of one memory access that fall in one buffer."""

    buffer: int
    lanes: np.ndarray  # flat lane positions
    index: np.ndarray  # element index into the buffer viewed as the accessed type


class Launch:
    """One run of a Triton kernel over its grid, with its memory."""

    def __init__(self, call: EmulatedCall) -> None:
        attrs = call.attributes
        self.kernel = str(attrs.get("name") or call.name or "kernel")
        self.grid = tuple(int(attrs.get(f"grid_{a}", 1)) for a in "xyz")
        self.checked = call.options.checked
        self.seed = call.options.seed
        self.pid = (0, 0, 0)
        self.linear = 0
        self.buffers: list[_Buffer] = []
        self.args = self._allocate(call)
        self.results = [b for b in self._result_buffers]
        ir_bytes = attrs.get("ir")
        if not isinstance(ir_bytes, bytes | str):
            raise UnsupportedError(f"the Triton custom call of kernel `{self.kernel}` carries "
                                   "no `ir` (TTIR bytecode) in its backend config")
        self.context = tir.new_context()
        with self.context, ir.Location.unknown():
            self.module = ir.Module.parse(ir_bytes)
            compiler = EmulatorCompiler({**ARITH_RULES, **emulator_ops.RULES, **self._rules()},
                                backend="triton", module=self.module)
            self.entry = compiler.function(self._entry_op())
        self._check_signature()

    # -- setup ----------------------------------------------------------------------------

    def _allocate(self, call: EmulatedCall) -> list[np.ndarray]:
        for i, x in enumerate(call.operands):
            x = np.asarray(x)
            self.buffers.append(_Buffer(np.array(x, copy=True).reshape(-1),
                                        f"operand {i} ({_describe(x.shape, x.dtype)})"))
        aliased = dict(call.aliases)
        self._result_buffers: list[int] = []
        for j, (shape, dtype) in enumerate(call.results):
            if j in aliased:
                b = aliased[j]
                self.buffers[b].label += f", aliased to result {j}"
            else:
                b = len(self.buffers)
                self.buffers.append(_Buffer(_uninitialised(int(np.prod(shape)), dtype),
                                            f"result {j} ({_describe(shape, dtype)})"))
            self._result_buffers.append(b)
        if self.checked:
            for buf in self.buffers:
                buf.writers = np.full(buf.data.size, -1, np.int64)
        args = list(range(len(call.operands))) + self._result_buffers
        self._shapes = [tuple(s) for s, _ in call.results]
        return [np.asarray((b + 1) << _SHIFT, ADDRESS) for b in args]

    def _entry_op(self) -> ir.Operation:
        funcs = [op.operation for op in self.module.body.operations
                 if op.operation.name == "tt.func"]
        for op in funcs:
            if ir.StringAttr(op.attributes["sym_name"]).value == self.kernel:
                return op
        public = [op for op in funcs if "sym_visibility" not in op.attributes
                  or ir.StringAttr(op.attributes["sym_visibility"]).value == "public"]
        if not (public or funcs):
            raise UnsupportedError(f"the TTIR module of kernel `{self.kernel}` has no tt.func")
        return (public or funcs)[0]

    def _check_signature(self) -> None:
        fn_type = ir.FunctionType(ir.TypeAttr(self._entry_op().attributes["function_type"]).value)
        inputs = list(fn_type.inputs)
        if len(inputs) != len(self.args) or not all(is_pointer(t) for t in inputs):
            raise UnsupportedError(
                f"the Triton kernel `{self.kernel}` takes ({', '.join(map(str, inputs))}); the "
                f"emulator passes {len(self.args)} pointers (operands, then results)")

    # -- running --------------------------------------------------------------------------

    def run(self) -> list[np.ndarray]:
        """Runs every program of the grid; returns the results."""
        gx, gy, gz = self.grid
        order = np.arange(gx * gy * gz)
        if self.seed is not None:
            order = np.random.default_rng(self.seed).permutation(order)
        for linear in order.tolist():
            self.linear = linear
            self.pid = (linear % gx, linear // gx % gy, linear // (gx * gy))
            self.entry(*self.args)
        return [self.buffers[b].data.reshape(shape)
                for b, shape in zip(self.results, self._shapes, strict=True)]

    def where(self, op: ir.Operation) -> str:
        loc = str(op.location)
        at = "" if loc == "loc(unknown)" else f" at {loc}"
        return f"kernel `{self.kernel}`, program {self.pid}: {op.name}{at}"

    # -- memory ---------------------------------------------------------------------------

    def view(self, b: int, dtype: np.dtype) -> np.ndarray:
        data = self.buffers[b].data
        if data.dtype == dtype:
            return data
        if data.dtype.itemsize * data.size % np.dtype(dtype).itemsize:
            raise UnsupportedError(f"{self.kernel}: reading {self.buffers[b].label} as {dtype}")
        return data.view(dtype)

    def resolve(self, op: ir.Operation, addr: Any, active: np.ndarray | None,
                dtype: np.dtype) -> list[_Access]:
        """The lanes of an access of ``dtype`` elements at ``addr`` (where ``active``), grouped
        by buffer; lanes outside every buffer are reported (checked) or dropped."""
        flat = np.asarray(addr, ADDRESS).reshape(-1)
        lanes = np.arange(flat.size) if active is None else np.flatnonzero(active)
        a = flat[lanes]
        if a.size == 0:
            return []
        ids = ((a + _HALF) >> _SHIFT) - 1
        lo, hi = int(np.min(ids)), int(np.max(ids))
        groups = [(lo, None)] if lo == hi else [(b, ids == b) for b in np.unique(ids).tolist()]
        item = np.dtype(dtype).itemsize
        out = []
        for b, sel in groups:
            la = lanes if sel is None else lanes[sel]
            off = (a if sel is None else a[sel]) - ((b + 1) << _SHIFT)
            nbytes = self.buffers[b].data.nbytes if 0 <= b < len(self.buffers) else 0
            ok = (off >= 0) & (off + item <= nbytes) & (off % item == 0)
            if not ok.all():
                if self.checked:
                    self._out_of_bounds(op, b, la[~ok][0], int(off[~ok][0]), item, addr)
                la, off = la[ok], off[ok]
            if la.size:
                out.append(_Access(b, la, off // item))
        return out

    def _out_of_bounds(self, op: ir.Operation, b: int, lane: int, off: int, item: int,
                       addr: Any) -> None:
        shape = np.shape(addr)
        index = tuple(int(i) for i in np.unravel_index(lane, shape)) if shape else ()
        if not 0 <= b < len(self.buffers):
            target = "an address outside every operand"
        else:
            buf = self.buffers[b]
            target = (f"{buf.label} at element {off // item} (byte {off}), outside its "
                      f"{buf.data.size} elements")
        raise OutOfBoundsError(
            f"{self.where(op)}: lane {index} accesses {target}, and no mask turns that lane "
            "off. Fix: mask the access (pl.load/pl.store mask=, or blocks that divide the "
            "array), or keep the indices inside the array.")

    def record_writes(self, op: ir.Operation, access: _Access, dtype: np.dtype) -> None:
        """Checked mode: notes this program as the writer of the elements it stores, and
        reports an element another program stored before."""
        buf = self.buffers[access.buffer]
        if buf.writers is None:
            return
        ratio = np.dtype(dtype).itemsize / buf.data.dtype.itemsize
        elems = (access.index * ratio).astype(np.int64) if ratio != 1 else access.index
        prev = buf.writers[elems]
        clash = (prev >= 0) & (prev != self.linear)
        if clash.any():
            other = int(prev[clash][0])
            gx, gy, _ = self.grid
            other_pid = (other % gx, other // gx % gy, other // (gx * gy))
            raise RaceError(
                f"{self.where(op)} stores to {buf.label} at element {int(elems[clash][0])}, "
                f"which program {other_pid} also stored to: two programs write one address "
                "without an atomic, and the result depends on their order on the GPU. Fix: "
                "give each program its own output block, accumulate over a sequential grid "
                "axis, or use an atomic (pl.atomic_add).")
        buf.writers[elems] = self.linear

    # -- rules ----------------------------------------------------------------------------

    def _rules(self) -> dict[str, EmulatorRule]:
        def bind(fn: Callable[[Launch, EmulatorCompiler, ir.Operation], _Fn]) -> EmulatorRule:
            return lambda c, op: fn(self, c, op)
        rules = {name: bind(fn) for name, fn in _MEMORY_RULES.items()}
        if self.checked:
            rules["arith.andi"] = bind(_andi_checking_marks)
        return rules


def _describe(shape: Sequence[int], dtype: Any) -> str:
    return f"{tuple(shape)} {np.dtype(dtype).name}"


def _uninitialised(size: int, dtype: Any) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype.kind == "f" or "float" in dtype.name:  # ml_dtypes' floats are of kind "V"
        return np.full(size, np.nan, dtype)
    if dtype == np.bool_:
        return np.zeros(size, dtype)
    if dtype.itemsize == 1 and dtype.kind == "V":  # int4/uint4 and the like, a byte each
        return np.zeros(size, dtype)
    return np.full(size * dtype.itemsize, 0xCD, np.uint8).view(dtype)


def _mask(x: Any, shape: tuple[int, ...]) -> np.ndarray:
    return np.broadcast_to(np.asarray(x, np.bool_), shape).reshape(-1)


# -- program ids ------------------------------------------------------------------------------

def _axis(op: ir.Operation) -> int:
    return int(ir.IntegerAttr(op.attributes["axis"]).value)


def _program_id(launch: Launch, c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    axis = _axis(op)
    return lambda: np.asarray(launch.pid[axis], np.int32)


def _num_programs(launch: Launch, c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    n = np.asarray(launch.grid[_axis(op)], np.int32)
    return lambda: n


# -- memory -----------------------------------------------------------------------------------

def _addptr(launch: Launch, c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    size = np.int64(pointee(op.results[0].type).itemsize)
    return lambda p, off: np.asarray(p, ADDRESS) + np.asarray(off).astype(ADDRESS) * size


def _load(launch: Launch, c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    dtype = dtype_of(op.results[0].type)
    shape = shape_of(op.results[0].type)
    segments = [int(v) for v in ir.DenseI32ArrayAttr(op.attributes["operandSegmentSizes"])]
    has_mask, has_other = segments[1] > 0, segments[2] > 0

    def run(ptr: Any, *rest: Any) -> Any:
        mask = _mask(rest[0], shape) if has_mask else None
        if has_other:
            out = np.array(np.broadcast_to(np.asarray(rest[-1], dtype), shape)).reshape(-1)
        else:
            out = np.zeros(int(np.prod(shape)), dtype)
        for acc in launch.resolve(op, ptr, mask, dtype):
            out[acc.lanes] = launch.view(acc.buffer, dtype)[acc.index]
        return out.reshape(shape)
    return run


def _store(launch: Launch, c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    dtype = value_dtype(op.operands[1].type)
    shape = shape_of(op.operands[0].type)

    def run(ptr: Any, value: Any, *mask: Any) -> None:
        active = _mask(mask[0], shape) if mask else None
        vals = np.broadcast_to(np.asarray(value, dtype), shape).reshape(-1)
        for acc in launch.resolve(op, ptr, active, dtype):
            launch.record_writes(op, acc, dtype)
            launch.view(acc.buffer, dtype)[acc.index] = vals[acc.lanes]
    return run


def _rmw_fn(kind: int, dtype: np.dtype) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    k = tt.RMWOp
    if kind == k.FADD:
        if dtype.itemsize < 4:
            return lambda old, v: (old.astype(np.float32) + v.astype(np.float32)).astype(dtype)
        return lambda old, v: old + v
    if kind == k.XCHG:
        return lambda old, v: v
    if kind in (k.UMAX, k.UMIN):
        pick = np.maximum if kind == k.UMAX else np.minimum
        return lambda old, v: as_signed(pick(as_unsigned(old), as_unsigned(v)), dtype)
    table = {k.ADD: np.add, k.MAX: np.maximum, k.MIN: np.minimum, k.AND: np.bitwise_and,
             k.OR: np.bitwise_or, k.XOR: np.bitwise_xor}
    if kind not in table:
        raise UnsupportedError(f"the Triton emulator has no atomic_rmw kind {kind}")
    fn = table[kind]
    if dtype == np.bool_ and kind == k.ADD:
        return lambda old, v: old ^ v
    return lambda old, v: fn(old, v).astype(dtype, copy=False)


def _atomic(launch: Launch, op: ir.Operation, ptr: Any, mask: np.ndarray | None,
            dtype: np.dtype, shape: tuple[int, ...],
            update: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
    """Applies ``update(old, lanes)`` lane by lane in lane order, as a sequence of rounds in
    which no two lanes share an address; returns each lane's old value (0 where masked)."""
    out = np.zeros(int(np.prod(shape)), dtype)
    with np.errstate(over="ignore"):
        for acc in launch.resolve(op, ptr, mask, dtype):
            view = launch.view(acc.buffer, dtype)
            order = np.argsort(acc.index, kind="stable")
            ranked = acc.index[order]
            starts = np.r_[True, ranked[1:] != ranked[:-1]]
            first = np.maximum.accumulate(np.where(starts, np.arange(ranked.size), 0))
            rank = np.empty(ranked.size, np.int64)
            rank[order] = np.arange(ranked.size) - first
            for r in range(int(np.max(rank)) + 1):
                sel = rank == r
                idx, lanes = acc.index[sel], acc.lanes[sel]
                old = view[idx].copy()
                view[idx] = update(old, lanes)
                out[lanes] = old
    return out.reshape(shape)


def _atomic_rmw(launch: Launch, c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    kind = int(ir.IntegerAttr(op.attributes["atomic_rmw_op"]).value)
    dtype = dtype_of(op.results[0].type)
    shape = shape_of(op.results[0].type)
    fn = _rmw_fn(kind, dtype)

    def run(ptr: Any, value: Any, *mask: Any) -> Any:
        vals = np.broadcast_to(np.asarray(value, dtype), shape).reshape(-1)
        active = _mask(mask[0], shape) if mask else None
        return _atomic(launch, op, ptr, active, dtype, shape,
                       lambda old, lanes: fn(old, vals[lanes]))
    return run


def _atomic_cas(launch: Launch, c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    dtype = dtype_of(op.results[0].type)
    shape = shape_of(op.results[0].type)

    def bits(x: np.ndarray) -> np.ndarray:
        return x.view(f"u{dtype.itemsize}") if dtype != np.bool_ else x

    def run(ptr: Any, cmp: Any, value: Any) -> Any:
        cmps = np.ascontiguousarray(np.broadcast_to(np.asarray(cmp, dtype), shape)).reshape(-1)
        vals = np.broadcast_to(np.asarray(value, dtype), shape).reshape(-1)
        return _atomic(launch, op, ptr, None, dtype, shape,
                       lambda old, lanes: np.where(bits(old) == bits(cmps[lanes]), vals[lanes],
                                                   old))
    return run


# -- the rest ---------------------------------------------------------------------------------

def _assert(launch: Launch, c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    message = ir.StringAttr(op.attributes["message"]).value

    def run(cond: Any, *_: Any) -> None:
        cond = np.asarray(cond)
        if not cond.all():
            lane = tuple(int(i) for i in np.argwhere(~cond)[0]) if cond.shape else ()
            raise DeviceAssertError(f"{launch.where(op)}: device assertion failed in lane "
                                    f"{lane}: {message}")
    return run


def _print(launch: Launch, c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    prefix = ir.StringAttr(op.attributes["prefix"]).value
    hex_ = "hex" in op.attributes and bool(ir.BoolAttr(op.attributes["hex"]).value)

    def fmt(v: Any) -> str:
        if hex_ and np.asarray(v).dtype.kind in "iub":
            return hex(int(as_unsigned(np.asarray(v))))
        return str(np.asarray(v).item() if np.ndim(v) == 0 else v)

    def run(*args: Any) -> None:
        pid = "pid ({}, {}, {})".format(*launch.pid)
        if not args:
            print(f"{pid} {prefix}")
            return
        values_of = np.broadcast_arrays(*[np.asarray(a) for a in args])
        shape = values_of[0].shape
        for index in np.ndindex(*shape) if shape else [()]:
            where = f" idx ({', '.join(map(str, index))})" if shape else ""
            values = ", ".join(fmt(a[index]) for a in values_of)
            print(f"{pid}{where} {prefix}{values}")
    return run


def _call(launch: Launch, c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    fn = c.function(ir.FlatSymbolRefAttr(op.attributes["callee"]).value)
    n = len(op.results)

    def run(*args: Any) -> Any:
        out = fn(*args)
        return None if n == 0 else out[0] if n == 1 else tuple(out)
    return run


def _andi_checking_marks(launch: Launch, c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    """``arith.andi``; where it carries this project's lowering's
    :data:`~pallas_triton.lowering.UNMASKED_OUT_OF_BOUNDS` mark (checked mode only), a lane
    set in its result is an access outside the array that only the lowering's own bounds mask
    turns off, reported as JAX's module would have the access reported."""
    plain = ARITH_RULES["arith.andi"](c, op)
    if UNMASKED_OUT_OF_BOUNDS not in op.attributes:
        return plain
    what = ir.StringAttr(op.attributes[UNMASKED_OUT_OF_BOUNDS]).value

    def run(outside: Any, active: Any) -> Any:
        lanes = np.asarray(plain(outside, active))
        if lanes.any():
            lane = tuple(int(i) for i in np.argwhere(lanes)[0]) if lanes.ndim else ()
            raise OutOfBoundsError(
                f"{launch.where(op)}: lane {lane} of the {what} falls outside the array, in "
                "a dimension whose blocks divide it (or a squeezed one), and no mask of the "
                "kernel turns that lane off. JAX's Triton lowering masks no such dimension, "
                "so on the GPU the access reads or writes the wrong elements, or memory "
                "outside the array; this "
                "project's lowering masks it (the load gives 0, the store is dropped), which "
                "hides the bug. Fix: mask the access (pl.load/pl.store mask=) or keep the "
                "indices inside the array.")
        return lanes
    return run


_MEMORY_RULES: dict[str, Callable[[Launch, EmulatorCompiler, ir.Operation], _Fn]] = {
    "tt.get_program_id": _program_id, "tt.get_num_programs": _num_programs,
    "tt.addptr": _addptr, "tt.load": _load, "tt.store": _store,
    "tt.atomic_rmw": _atomic_rmw, "tt.atomic_cas": _atomic_cas,
    "tt.assert": _assert, "tt.print": _print, "tt.call": _call,
    "gpu.barrier": lambda launch, c, op: lambda: None,  # programs run one at a time
}


def emulate(call: EmulatedCall) -> list[np.ndarray]:
    """Runs a ``__gpu$xla.gpu.triton`` custom call; returns its results as numpy arrays."""
    return Launch(call).run()
