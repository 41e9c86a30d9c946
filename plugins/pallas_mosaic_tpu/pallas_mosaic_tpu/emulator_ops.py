"""The ``vector``, ``memref`` and ``tpu`` operations of a Mosaic kernel as numpy.

Refs (memrefs) are numpy arrays: a slice, squeeze or reshape of a ref is a numpy view of its
buffer, so a store through it lands in the buffer. Semaphores are ``int64`` arrays holding their
counts. Values are numpy arrays that no rule changes in place.

A DMA on one device completes when it starts: it copies, then signals its semaphore by the
number of bytes moved; a wait takes the bytes of its own descriptor from the semaphore (and
reports a deadlock if they are not there). Remote DMAs and signals, device ids and the barrier
semaphore are in :mod:`pallas_mosaic_tpu.emulator_devices`, where the devices of a
``shard_map`` run together.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jaxlib.mlir import ir

from pallas_core.backend import (
    EmulatorCompiler,
    EmulatorRule,
    PallasError,
    UnsupportedError,
    dtype_of,
    shape_of,
)

_Fn = Callable[..., Any]
_DYNAMIC = ir.ShapedType.get_dynamic_size() if hasattr(ir.ShapedType, "get_dynamic_size") \
    else -(2 ** 63)


class EmulationError(PallasError):
    """A kernel did something that a TPU would not run correctly (out-of-bounds access,
    a wait on a semaphore nothing signals)."""

    ref: np.ndarray | None = None
    """The buffer an out-of-bounds access reached (for the grid runner to name it)."""
    grid_step: tuple[int, ...] | None = None
    """The grid step the kernel was at (set by the grid runner)."""


def _unsupported(op: ir.Operation, what: str) -> UnsupportedError:
    return UnsupportedError(
        f"the Mosaic TPU emulator does not support {what} (`{op.name}` at {op.location}). "
        "Fix: run the kernel with backend='interpret', or emulate a kernel without it.")


# -- attributes -------------------------------------------------------------------------------

def int_array(attr: ir.Attribute) -> list[int]:
    """An integer array attribute (dense i32/i64 array, or array of integers) as ints."""
    for cls in (ir.DenseI64ArrayAttr, ir.DenseI32ArrayAttr):
        try:
            return [int(v) for v in cls(attr)]
        except ValueError:
            pass
    return [ir.IntegerAttr(a).value for a in ir.ArrayAttr(attr)]


def int_attribute(op: ir.Operation, name: str, default: int | None = None) -> int:
    """The integer attribute ``name`` of ``op``; ``default`` where ``op`` lacks it (without a
    default, an ``UnsupportedError`` naming the op). SparseCore's emulator reads its ops'
    attributes with it too."""
    if name not in op.attributes:
        if default is None:
            raise _unsupported(op, f"a missing attribute {name}")
        return default
    return int(ir.IntegerAttr(op.attributes[name]).value)


def bool_attribute(op: ir.Operation, name: str) -> bool:
    """The boolean attribute ``name`` of ``op`` (``False`` where ``op`` lacks it)."""
    return name in op.attributes and bool(ir.BoolAttr(op.attributes[name]).value)


def enum_case(attr: ir.Attribute) -> str:
    """The case of an enum attribute printed as ``#dialect.kind<case>``."""
    return re.sub(r"^.*<(.*)>$", r"\1", str(attr)).strip()


def segments(op: ir.Operation) -> list[tuple[int, int]]:
    """``(start, stop)`` of each operand group of an op with ``operandSegmentSizes``."""
    sizes = list(ir.DenseI32ArrayAttr(op.attributes["operandSegmentSizes"]))
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out


def is_semaphore(t: ir.Type) -> bool:
    """Whether ``t`` is (a memref of) TPU semaphores."""
    elt = ir.ShapedType(t).element_type if isinstance(t, ir.ShapedType) else t
    return "semaphore" in str(elt)


def allocate(t: ir.Type) -> np.ndarray:
    """A fresh buffer for the memref type ``t`` (semaphores start at zero)."""
    shape = shape_of(t)
    if is_semaphore(t):
        return np.zeros(shape, np.int64)
    return np.zeros(shape, dtype_of(t))


# -- loads and stores -------------------------------------------------------------------------

def window_key(op: ir.Operation, ref: np.ndarray, idx: Sequence[Any], shape: Sequence[int],
               strides: Sequence[int] = ()) -> tuple[Any, ...]:
    """The numpy index of a ``shape`` window of ``ref`` at ``idx`` (leading indices of a
    higher-rank ref are scalars), checked against the ref's bounds."""
    lead = ref.ndim - len(shape)
    strides = list(strides) or [1] * len(shape)
    key: list[Any] = []
    for d, i in enumerate(idx):
        i = int(i)
        if d < lead:
            size, stride = 1, 1
        else:
            size, stride = int(shape[d - lead]), int(strides[d - lead])
        end = i + (size - 1) * stride + 1
        if i < 0 or end > ref.shape[d]:
            error = EmulationError(
                f"{op.name} at {op.location} reads or writes indices {i}..{end - 1} of "
                f"dimension {d} of a ref of shape {ref.shape}: out of bounds. Fix: keep the "
                "access inside the ref (the TPU does not check it).")
            error.ref = ref
            raise error
        key.append(i if d < lead else slice(i, end, stride))
    return tuple(key)


def _load(strided: bool = False, masked: bool = False) -> EmulatorRule:
    def rule(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
        shape = shape_of(op.results[0].type)
        strides = int_array(op.attributes["strides"]) if "strides" in op.attributes else []
        has_mask = masked and "operandSegmentSizes" in op.attributes \
            and segments(op)[-1][1] > segments(op)[-1][0]
        if has_mask:
            raise _unsupported(op, "masked loads")

        def run(ref: np.ndarray, *idx: Any) -> Any:
            return np.array(ref[window_key(op, ref, idx, shape, strides)]).reshape(shape)
        return run
    return rule


def _vector_store(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    """``vector.store`` / ``tpu.vector_store`` / ``tpu.strided_store``: value, ref, indices,
    and for ``tpu.vector_store`` an optional mask and the ``add`` flag."""
    shape = shape_of(op.operands[0].type)
    strides = int_array(op.attributes["strides"]) if "strides" in op.attributes else []
    add = bool_attribute(op, "add")
    if "operandSegmentSizes" in op.attributes:
        (_, _), (_, _), (i0, i1), (m0, m1) = segments(op)
    else:
        i0, i1, m0, m1 = 2, len(op.operands), 0, 0
    has_mask = m1 > m0

    def run(value: Any, ref: np.ndarray, *rest: Any) -> None:
        key = window_key(op, ref, rest[i0 - 2:i1 - 2], shape, strides)
        view = ref[key]
        value = np.asarray(value).reshape(view.shape)
        if add:
            value = view + value
        if has_mask:
            value = np.where(np.asarray(rest[m0 - 2]).reshape(view.shape), value, view)
        ref[key] = value
    return run


def _tpu_load(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    if int_attribute(op, "sublane_stride", 1) != 1 or not all(
            ir.DenseBoolArrayAttr(op.attributes["sublane_mask"])):
        raise _unsupported(op, "sublane masks and strides")
    return _load()(c, op)


def _tpu_store(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    if int_attribute(op, "sublane_stride", 1) != 1 or not all(
            ir.DenseBoolArrayAttr(op.attributes["sublane_mask"])):
        raise _unsupported(op, "sublane masks and strides")
    return _vector_store(c, op)


def _memref_load(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    def run(ref: np.ndarray, *idx: Any) -> Any:
        return np.array(ref[window_key(op, ref, idx, ())])
    return run


def _memref_store(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    def run(value: Any, ref: np.ndarray, *idx: Any) -> None:
        ref[window_key(op, ref, idx, ())] = value
    return run


def _alloca(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    t = op.results[0].type
    return lambda *_: allocate(t)


# -- ref views --------------------------------------------------------------------------------

def _memref_slice(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    """``tpu.memref_slice``: a window of the ref; its dynamic dimensions (``?``) take their
    sizes from the operands that follow the indices, in order."""
    result = ir.ShapedType(op.results[0].type)
    dynamic = ir.ShapedType.get_dynamic_size()
    static = [int(s) for s in result.shape]
    (_, _), (b0, b1), (d0, d1) = segments(op)

    def run(ref: np.ndarray, *rest: Any) -> Any:
        if not isinstance(ref, np.ndarray):
            raise _unsupported(op, "slices of a ref viewed as elements of another width")
        sizes = iter(rest[d0 - 1:d1 - 1])
        shape = [int(next(sizes)) if s == dynamic else s for s in static]
        if any(s < 0 for s in shape):
            raise EmulationError(f"{op.name} at {op.location}: a view of negative size "
                                 f"{shape}. Fix: keep pl.ds sizes non-negative.")
        return ref[window_key(op, ref, rest[b0 - 1:b1 - 1], shape)]
    return run


def _view_reshape(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    shape = shape_of(op.results[0].type)

    def run(ref: np.ndarray, *_: Any) -> Any:
        view = ref.view()
        try:
            view.shape = shape
        except AttributeError as e:
            raise _unsupported(op, f"reshaping a strided ref view of shape {ref.shape} to "
                               f"{shape}") from e
        return view
    return run


def _identity(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    return lambda x, *_: x


def _nothing(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    return lambda *_: None


def bitcast_array(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``x``'s bits as ``dtype`` the way Mosaic packs them: elements of different widths pair
    up along the second-minor dimension (rows ``2i`` and ``2i + 1`` of 16-bit data form row
    ``i`` of 32-bit data, low half first)."""
    src, dst = np.dtype(x.dtype).itemsize, np.dtype(dtype).itemsize
    x = np.ascontiguousarray(x)
    if src == dst:
        return x.view(dtype)
    *lead, rows, cols = x.shape
    if src < dst:
        k = dst // src
        packed = x.reshape(*lead, rows // k, k, cols).swapaxes(-1, -2)
        return np.ascontiguousarray(packed).view(dtype).reshape(*lead, rows // k, cols)
    k = src // dst
    parts = x.view(dtype).reshape(*lead, rows, cols, k).swapaxes(-1, -2)
    return np.ascontiguousarray(parts).reshape(*lead, rows * k, cols)


class PackedRef:
    """A ref of 16-bit (say) data viewed as 32-bit words (``tpu.memref_bitcast`` to another
    width): reads bitcast the buffer, writes bitcast back into it."""

    def __init__(self, base: np.ndarray, dtype: np.dtype) -> None:
        self.base = base
        self.dtype = np.dtype(dtype)
        self.shape = bitcast_array(base, self.dtype).shape
        self.ndim = len(self.shape)

    def __getitem__(self, key: Any) -> np.ndarray:
        return np.array(bitcast_array(self.base, self.dtype)[key])

    def __setitem__(self, key: Any, value: Any) -> None:
        whole = bitcast_array(self.base, self.dtype)
        whole[key] = value
        self.base[...] = bitcast_array(whole, self.base.dtype)


def _memref_bitcast(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    dtype = dtype_of(op.results[0].type)

    def run(ref: Any, *_: Any) -> Any:
        if isinstance(ref, np.ndarray) and np.dtype(ref.dtype).itemsize == dtype.itemsize:
            return ref.view(dtype)
        if isinstance(ref, np.ndarray) and ref.ndim >= 2:
            return PackedRef(ref, dtype)
        raise _unsupported(op, "this view of a ref as elements of another width")
    return run


# -- vectors ----------------------------------------------------------------------------------

def _broadcast(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    shape = shape_of(op.results[0].type)
    return lambda x: np.broadcast_to(x, shape)


def _shape_cast(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    shape = shape_of(op.results[0].type)
    return lambda x: np.reshape(x, shape)


def _positions(op: ir.Operation) -> tuple[list[int], list[int]]:
    static = int_array(op.attributes["static_position"])
    return static, [k for k, p in enumerate(static) if p == _DYNAMIC]


def _extract(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    static, dynamic = _positions(op)

    def run(x: Any, *dyn: Any) -> Any:
        pos = list(static)
        for k, v in zip(dynamic, dyn, strict=True):
            pos[k] = int(v)
        return np.array(np.asarray(x)[tuple(pos)])
    return run


def _insert(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    static, dynamic = _positions(op)

    def run(value: Any, dest: Any, *dyn: Any) -> Any:
        pos = list(static)
        for k, v in zip(dynamic, dyn, strict=True):
            pos[k] = int(v)
        out = np.array(dest)
        out[tuple(pos)] = value
        return out
    return run


def _strided_key(op: ir.Operation, sizes: Sequence[int]) -> tuple[slice, ...]:
    offsets = int_array(op.attributes["offsets"])
    strides = int_array(op.attributes["strides"])
    return tuple(slice(o, o + (n - 1) * s + 1, s) for o, n, s in zip(offsets, sizes, strides,
                                                                       strict=False))


def _extract_strided_slice(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    key = _strided_key(op, int_array(op.attributes["sizes"]))
    return lambda x: np.asarray(x)[key]


def _insert_strided_slice(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    src = shape_of(op.operands[0].type)
    dest_rank = len(shape_of(op.operands[1].type))
    offsets = int_array(op.attributes["offsets"])
    strides = int_array(op.attributes["strides"])
    lead = dest_rank - len(src)
    key = tuple([*[slice(o, o + 1) for o in offsets[:lead]],
                 *[slice(o, o + (n - 1) * s + 1, s)
                   for o, n, s in zip(offsets[lead:], src, strides, strict=True)]])

    def run(value: Any, dest: Any) -> Any:
        out = np.array(dest)
        out[key] = np.reshape(value, out[key].shape)
        return out
    return run


def _combine(kind: str, op: ir.Operation) -> Callable[[Any, Any], Any]:
    from pallas_core.backend import as_unsigned
    table: dict[str, Callable[[Any, Any], Any]] = {
        "add": np.add, "mul": np.multiply, "and": np.bitwise_and, "or": np.bitwise_or,
        "xor": np.bitwise_xor, "minsi": np.minimum, "maxsi": np.maximum,
        "minnumf": np.fmin, "maxnumf": np.fmax, "minimumf": np.minimum,
        "maximumf": np.maximum, "minf": np.minimum, "maxf": np.maximum,
        "minui": lambda a, b: np.where(as_unsigned(a) <= as_unsigned(b), a, b),
        "maxui": lambda a, b: np.where(as_unsigned(a) >= as_unsigned(b), a, b),
    }
    if kind not in table:
        raise _unsupported(op, f"the reduction kind {kind}")
    return table[kind]


def _reduce(kind: str, op: ir.Operation, x: np.ndarray, axes: tuple[int, ...]) -> Any:
    if kind == "add":
        return np.sum(x, axis=axes, dtype=x.dtype)
    if kind == "mul":
        return np.prod(x, axis=axes, dtype=x.dtype)
    fn = _combine(kind, op)
    if isinstance(fn, np.ufunc):
        return fn.reduce(x, axis=axes)
    out = np.moveaxis(x, axes, tuple(range(len(axes)))).reshape(-1, *[
        n for d, n in enumerate(x.shape) if d not in axes])
    acc = out[0]
    for row in out[1:]:
        acc = fn(acc, row)
    return acc


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float32) if dtype.kind == "f" and dtype.itemsize < 4 else dtype


def _multi_reduction(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    kind = enum_case(op.attributes["kind"])
    axes = tuple(int_array(op.attributes["reduction_dims"]))
    dtype = dtype_of(op.results[0].type)
    combine = _combine(kind, op)

    def run(x: Any, acc: Any) -> Any:
        x = np.asarray(x)
        cd = _compute_dtype(x.dtype)
        out = _reduce(kind, op, x.astype(cd), axes)
        return np.asarray(combine(out, np.asarray(acc).astype(cd))).astype(dtype)
    return run


def _reduction(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    kind = enum_case(op.attributes["kind"])
    dtype = dtype_of(op.results[0].type)
    combine = _combine(kind, op)

    def run(x: Any, *acc: Any) -> Any:
        x = np.asarray(x)
        cd = _compute_dtype(x.dtype)
        out = _reduce(kind, op, x.astype(cd), tuple(range(x.ndim)))
        if acc:
            out = combine(out, np.asarray(acc[0]).astype(cd))
        return np.asarray(out).astype(dtype)
    return run


def _transpose(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    perm = int_array(op.attributes["permutation"])
    return lambda x: np.transpose(x, perm)


def _constant_mask(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    sizes = int_array(op.attributes["mask_dim_sizes"])
    shape = shape_of(op.results[0].type)
    mask = np.zeros(shape, np.bool_)
    mask[tuple(slice(0, n) for n in sizes)] = True
    return lambda: mask


def _create_mask(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    shape = shape_of(op.results[0].type)

    def run(*sizes: Any) -> Any:
        mask = np.zeros(shape, np.bool_)
        mask[tuple(slice(0, max(int(n), 0)) for n in sizes)] = True
        return mask
    return run


def _tpu_create_mask(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    shape = shape_of(op.results[0].type)
    n = len(shape)

    def run(*bounds: Any) -> Any:
        mask = np.zeros(shape, np.bool_)
        mask[tuple(slice(max(int(lo), 0), max(int(hi), 0))
                   for lo, hi in zip(bounds[:n], bounds[n:], strict=True))] = True
        return mask
    return run


def _from_elements(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    shape = shape_of(op.results[0].type)
    dtype = dtype_of(op.results[0].type)
    return lambda *xs: np.array(xs, dtype).reshape(shape)


def _vector_bitcast(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    dtype = dtype_of(op.results[0].type)
    shape = shape_of(op.results[0].type)
    return lambda x: np.ascontiguousarray(x).view(dtype).reshape(shape)


def _fma(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    dtype = dtype_of(op.results[0].type)
    cd = _compute_dtype(dtype)
    return lambda a, b, x: (np.asarray(a).astype(cd) * np.asarray(b).astype(cd)
                            + np.asarray(x).astype(cd)).astype(dtype)


def _step(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    shape = shape_of(op.results[0].type)
    value = np.arange(shape[0], dtype=np.int64)
    return lambda: value


RULES: dict[str, EmulatorRule] = {
    "vector.load": _load(), "vector.store": _vector_store,
    "vector.broadcast": _broadcast, "vector.splat": _broadcast,
    "vector.shape_cast": _shape_cast, "vector.extract": _extract, "vector.insert": _insert,
    "vector.extract_strided_slice": _extract_strided_slice,
    "vector.insert_strided_slice": _insert_strided_slice,
    "vector.multi_reduction": _multi_reduction, "vector.reduction": _reduction,
    "vector.transpose": _transpose, "vector.constant_mask": _constant_mask,
    "vector.create_mask": _create_mask, "vector.from_elements": _from_elements,
    "vector.bitcast": _vector_bitcast, "vector.fma": _fma, "vector.step": _step,
    "memref.load": _memref_load, "memref.store": _memref_store, "memref.alloca": _alloca,
    "memref.alloc": _alloca,
    "tpu.vector_load": _load(masked=True), "tpu.vector_store": _vector_store,
    "tpu.strided_load": _load(strided=True), "tpu.strided_store": _vector_store,
    "tpu.load": _tpu_load, "tpu.store": _tpu_store,
    "tpu.memref_slice": _memref_slice, "tpu.memref_squeeze": _view_reshape,
    "tpu.memref_reshape": _view_reshape, "tpu.memref_bitcast": _memref_bitcast,
    "tpu.erase_memref_layout": _identity, "tpu.assume_layout": _identity,
    "tpu.assume_multiple": _identity, "tpu.create_mask": _tpu_create_mask,
    "tpu.trace_start": _nothing, "tpu.trace_stop": _nothing, "tpu.delay": _nothing,
}
"""``vector``, ``memref`` and the memory and shape ``tpu`` operations; the compute,
synchronisation and DMA operations are in :mod:`pallas_mosaic_tpu.emulator`."""
