"""The SparseCore emulator's operations, on top of the TensorCore emulator's rules
(:data:`RULES`): allocations (per subcore, or per core in ``vmem_shared``), the expanding load
and compressing store (masked ``tpu.vector_load``/``vector_store``, ``tpu.vector_expand_load``,
``tpu.vector_compress_store``), lane gathers and scatters (``tpu.vector_load_idx``/
``vector_store_idx``), indirect DMAs (``tpu.enqueue_indirect_dma`` and its wait), the
TensorCore's DMAs and signals to the same subcore, the register operations (``tpu.sort``,
``tpu.scan``, ``tpu.scan_count``, ``tpu.all_reduce`` of a mask, ``tpu.pack_subelements``/
``unpack_subelements``), ``tpu.fetch_and_add_sync``, ``tpu.barrier`` and ``tpu.sem_barrier``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jaxlib.mlir import ir
from pallas_mosaic_tpu.emulator import RULES as TPU_RULES
from pallas_mosaic_tpu.emulator_ops import (
    EmulationError,
    bool_attribute,
    enum_case,
    int_array,
    int_attribute,
    segments,
    window_key,
)

from pallas_core.backend import EmulatorRule, UnsupportedError, as_unsigned, dtype_of, shape_of
from pallas_sparsecore.emulator_state import SCState, fresh, garbage, sc_of, space_of

_Fn = Callable[..., Any]


def _unsupported(op: ir.Operation, what: str) -> UnsupportedError:
    return UnsupportedError(
        f"the SparseCore emulator does not support {what} (`{op.name}` at {op.location}). "
        "Fix: run the kernel with backend='interpret', or emulate a kernel without it.")


def _alloca(c: Any, op: ir.Operation) -> _Fn:
    """``memref.alloca`` (and ``tpu.sem_alloc``): a fresh buffer per execution, except in
    ``vmem_shared``, where the ``k``-th execution by each subcore of a core gives that core's
    ``k``-th buffer. When the
    devices of a ``shard_map`` run together, the buffer is registered so that another device
    reaches it (the same allocation, execution and subcore there)."""
    t = op.results[0].type
    sc, key, state = sc_of(c), id(op), c.state
    in_shared = space_of(t) == "vmem_shared"
    number = None
    if state.network is not None:  # numbered in compile order, the same on every device
        number, state.allocations = state.allocations, state.allocations + 1

    def run(*_: Any) -> Any:
        program = sc.program()
        count = program.allocas.get(key, 0)
        program.allocas[key] = count + 1
        if in_shared:
            slot = (key, program.core, count)
            if slot not in sc.shared:
                sc.shared[slot] = fresh(t)
            buffer = sc.shared[slot]
        else:
            buffer = fresh(t)
        if number is not None:
            state.register(("op", number, program.core,
                            None if in_shared else program.subcore, count), buffer)
        return buffer
    return run


# -- masked, expanding and compressing accesses -----------------------------------------------

def _vector_load(c: Any, op: ir.Operation) -> _Fn:
    """Unmasked: the TensorCore's load. Masked: the expanding load (the ``k``-th kept lane
    gets element ``k`` of the window; the other lanes are undefined)."""
    (_, _), (i0, i1), (m0, m1) = segments(op)
    if m1 == m0:
        return TPU_RULES["tpu.vector_load"](c, op)
    if int_array(op.attributes["strides"]) if "strides" in op.attributes else []:
        raise _unsupported(op, "strided masked loads")
    shape = shape_of(op.results[0].type)

    def run(ref: np.ndarray, *rest: Any) -> Any:
        mask = np.broadcast_to(np.asarray(rest[m0 - 1], bool), shape).reshape(-1)
        count = int(mask.sum())
        window = ref[window_key(op, ref, rest[i0 - 1:i1 - 1], shape)].reshape(-1)
        out = garbage((mask.size,), ref.dtype)
        out[mask] = window[:count]
        return out.reshape(shape)
    return run


def _vector_store(c: Any, op: ir.Operation) -> _Fn:
    """Unmasked: the TensorCore's store. Masked: the compressing store (kept lanes go to the
    window's elements ``0, 1, ...`` in order), adding with ``add``."""
    (_, _), (_, _), (i0, i1), (m0, m1) = segments(op)
    if m1 == m0:
        return TPU_RULES["tpu.vector_store"](c, op)
    if int_array(op.attributes["strides"]) if "strides" in op.attributes else []:
        raise _unsupported(op, "strided masked stores")
    shape = shape_of(op.operands[0].type)
    add = bool_attribute(op, "add")

    def run(value: Any, ref: np.ndarray, *rest: Any) -> None:
        mask = np.broadcast_to(np.asarray(rest[m0 - 2], bool), shape).reshape(-1)
        kept = np.asarray(value).reshape(-1)[mask].astype(ref.dtype)
        window = ref[window_key(op, ref, rest[i0 - 2:i1 - 2], shape)]
        flat = window.reshape(-1)  # a copy when the window is not contiguous
        flat[:kept.size] = flat[:kept.size] + kept if add else kept
        window[...] = flat.reshape(window.shape)
    return run


def _along_last(op: ir.Operation, attr: str, shape: Sequence[int]) -> None:
    dim = int(ir.IntegerAttr(op.attributes[attr]).value) if attr in op.attributes else -1
    if dim not in (-1, len(shape) - 1):
        raise _unsupported(op, f"expanding or compressing along dimension {dim} (not the last)")


def _expand_load(c: Any, op: ir.Operation) -> _Fn:
    """``tpu.vector_expand_load``/``expand_load_vreg`` (newer Mosaic's expanding load, operands
    ``base, *indices, mask``): along the last dimension, the ``k``-th kept lane of a row gets
    element ``k`` of that row of the window; the other lanes are undefined."""
    shape = shape_of(op.results[0].type)
    _along_last(op, "expand_dim", shape)

    def run(ref: np.ndarray, *rest: Any) -> Any:
        idx, mask = rest[:-1], np.broadcast_to(np.asarray(rest[-1], bool), shape)
        window = ref[window_key(op, ref, idx, shape)].reshape(-1, shape[-1])
        rows = mask.reshape(-1, shape[-1])
        out = garbage(rows.shape, ref.dtype)
        for r in range(rows.shape[0]):
            out[r, rows[r]] = window[r, :int(rows[r].sum())]
        return out.reshape(shape)
    return run


def _compress_store(c: Any, op: ir.Operation) -> _Fn:
    """``tpu.vector_compress_store``/``compress_store_vreg`` (operands ``value, base,
    *indices, mask``): along the last dimension, a row's kept lanes go to that row of the
    window's elements ``0, 1, ...`` in order, adding with ``add``."""
    shape = shape_of(op.operands[0].type)
    _along_last(op, "compress_dim", shape)
    add = bool_attribute(op, "add")

    def run(value: Any, ref: np.ndarray, *rest: Any) -> None:
        idx, mask = rest[:-1], np.broadcast_to(np.asarray(rest[-1], bool), shape)
        window = ref[window_key(op, ref, idx, shape)]
        rows = window.reshape(-1, shape[-1])  # a copy when the window is not contiguous
        vals = np.asarray(value).reshape(-1, shape[-1])
        for r, keep in enumerate(mask.reshape(-1, shape[-1])):
            kept = vals[r][keep].astype(ref.dtype)
            rows[r, :kept.size] = rows[r, :kept.size] + kept if add else kept
        window[...] = rows.reshape(window.shape)
    return run


def _lane_indices(op: ir.Operation, ref: np.ndarray, idx: Sequence[Any], mask: np.ndarray
                  ) -> tuple[np.ndarray, ...]:
    """The kept lanes' indices into ``ref``, checked against its bounds."""
    out = []
    for d, i in enumerate(idx):
        i = np.asarray(i).astype(np.int64).reshape(-1)[mask]
        bad = (i < 0) | (i >= ref.shape[d])
        if bad.any():
            raise EmulationError(
                f"{op.name} at {op.location} indexes dimension {d} of a ref of shape "
                f"{ref.shape} with {int(i[bad][0])}: out of bounds. Fix: keep the indices "
                "inside the ref or mask those lanes off (the chip does not check them).")
        out.append(i)
    return tuple(out)


def _load_idx(c: Any, op: ir.Operation) -> _Fn:
    """``tpu.vector_load_idx``: lane ``i`` reads ``ref[idx0[i], idx1[i], ...]``."""
    (_, _), (i0, i1), (m0, m1) = segments(op)
    shape = shape_of(op.results[0].type)

    def run(ref: np.ndarray, *rest: Any) -> Any:
        mask = np.ones(int(np.prod(shape)), bool) if m1 == m0 else \
            np.asarray(rest[m0 - 1], bool).reshape(-1)
        out = garbage(mask.shape, ref.dtype)
        out[mask] = ref[_lane_indices(op, ref, rest[i0 - 1:i1 - 1], mask)]
        return out.reshape(shape)
    return run


def _store_idx(c: Any, op: ir.Operation) -> _Fn:
    """``tpu.vector_store_idx``: lane ``i`` writes ``ref[idx0[i], ...]`` (the highest lane wins
    among repeats), or adds into it (repeats accumulate)."""
    (_, _), (_, _), (i0, i1), (m0, m1) = segments(op)
    add = bool_attribute(op, "add")

    def run(value: Any, ref: np.ndarray, *rest: Any) -> None:
        value = np.asarray(value).reshape(-1)
        mask = np.ones(value.shape, bool) if m1 == m0 else \
            np.asarray(rest[m0 - 2], bool).reshape(-1)
        where = _lane_indices(op, ref, rest[i0 - 2:i1 - 2], mask)
        kept = value[mask].astype(ref.dtype)
        if add:
            np.add.at(ref, where, kept)
        else:
            ref[where] = kept  # numpy assigns repeated indices in order: the last lane wins
    return run


# -- DMAs -------------------------------------------------------------------------------------

def _gathers(op: ir.Operation, source: ir.Value, target: ir.Value) -> bool:
    """Whether an indirect DMA gathers (HBM/shared VMEM -> VMEM) rather than scatters."""
    src, dst = space_of(source.type), space_of(target.type)
    if src in ("hbm", "vmem_shared") and dst == "vmem":
        return True
    if src == "vmem" and dst in ("hbm", "vmem_shared"):
        return False
    raise _unsupported(op, f"an indirect DMA from {src} to {dst}")


def _indexed(ref: np.ndarray, offsets: int) -> np.ndarray:
    """The indexed ref ``[z, ...]`` (or ``[1, z, ...]``) as ``[z, ...]``."""
    return ref[0] if ref.ndim >= 2 and ref.shape[0] == 1 and offsets != 1 else ref


def _enqueue_indirect_dma(c: Any, op: ir.Operation) -> _Fn:
    gather = _gathers(op, op.operands[0], op.operands[1])
    add = bool_attribute(op, "add")
    has_filter = len(op.operands) > 4

    def run(src: np.ndarray, dst: np.ndarray, offsets: Any, sem: np.ndarray,
            *flt: Any) -> None:
        offs = np.asarray(offsets).astype(np.int64).reshape(-1)
        table = _indexed(src if gather else dst, offs.size)
        rows = dst if gather else src
        rows = rows.reshape(offs.size, *table.shape[1:])
        keep = np.ones(offs.shape, bool)
        if has_filter:
            keep = offs != int(flt[0])
        bad = keep & ((offs < 0) | (offs >= table.shape[0]))
        if bad.any():
            raise EmulationError(
                f"{op.name} at {op.location}: offset {int(offs[bad][0])} outside the "
                f"{table.shape[0]} rows of the indexed ref. Fix: keep the indices in range "
                "(the DMA engine does not check them).")
        if gather:
            got = table[offs[keep]].astype(rows.dtype)
            rows[keep] = rows[keep] + got if add else got
        elif add:
            np.add.at(table, offs[keep], rows[keep].astype(table.dtype))
        else:
            table[offs[keep]] = rows[keep].astype(table.dtype)
        moved = (dst if gather else src)
        sem[...] += moved.size * moved.dtype.itemsize
    return run


def _wait_indirect_dma(c: Any, op: ir.Operation) -> _Fn:
    gather = _gathers(op, op.operands[1], op.operands[2])

    def run(sem: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
        moved = dst if gather else src
        amount = moved.size * moved.dtype.itemsize
        if int(sem) < amount:
            raise EmulationError(
                f"{op.name} at {op.location} waits for {amount} bytes on a semaphore holding "
                f"{int(sem)}: nothing started this DMA, so the kernel would hang. Fix: start "
                "the copy (with this semaphore) before waiting for it.")
        sem[...] = int(sem) - amount
    return run


def _this_subcore(name: str, first_core_id: int) -> EmulatorRule:
    """The TensorCore's rule for ``name`` (a DMA, its wait, or a signal, to this device or to
    the device its ``device_id`` names: the same core and subcore there), refusing the
    core/subcore id operands that would address another subcore."""
    def rule(c: Any, op: ir.Operation) -> _Fn:
        if any(b > a for a, b in segments(op)[first_core_id:]):
            raise _unsupported(op, "DMAs and signals to another core or subcore")
        return TPU_RULES[name](c, op)
    return rule


# -- register operations ----------------------------------------------------------------------

def _order_key(x: np.ndarray) -> np.ndarray:
    """Values whose numpy order is the chip's: integers compare unsigned."""
    return as_unsigned(x) if x.dtype.kind in "iu" else x


def _sort(c: Any, op: ir.Operation) -> _Fn:
    """``tpu.sort``: a stable sort of the lanes by key, values along; masked-off lanes go last
    and the output mask marks the kept ones."""
    descending = bool_attribute(op, "descending")

    def run(keys: Any, values: Any, *mask: Any) -> Any:
        keys, values = np.asarray(keys), np.asarray(values)
        keep = np.asarray(mask[0], bool) if mask else np.ones(keys.shape, bool)
        key = _order_key(keys)
        if descending:
            key = ~key if key.dtype.kind == "u" else -key
        order = np.argsort(key, kind="stable")
        order = order[np.argsort(~keep[order], kind="stable")]
        return keep[order], keys[order], values[order]
    return run


def _scan(c: Any, op: ir.Operation) -> _Fn:
    """``tpu.scan``: the inclusive running sum/max/min over the kept lanes; a masked-off lane
    holds the result of the last kept lane before it."""
    # Newer Mosaic names the comparison: maxf/minf, maxsi/minsi (signed), maxui/minui.
    kind, signed = enum_case(op.attributes["kind"]), False
    if kind in ("maxf", "minf", "maxui", "minui", "maxsi", "minsi"):
        kind, signed = kind[:3], kind.endswith("si")
    dtype = dtype_of(op.results[0].type)
    if kind not in ("sum", "max", "min"):
        raise _unsupported(op, f"scans of kind {kind}")

    def run(x: Any, *mask: Any) -> Any:
        x = np.asarray(x)
        keep = np.asarray(mask[0], bool) if mask else np.ones(x.shape, bool)
        if x.ndim != 1:
            raise _unsupported(op, "scans of vectors of rank other than 1")
        if kind == "sum":
            return np.cumsum(np.where(keep, x, 0), dtype=dtype).astype(dtype)
        key = x if signed else _order_key(x)
        fill = np.iinfo(key.dtype).min if key.dtype.kind in "iu" else -np.inf
        if kind == "min":
            fill = np.iinfo(key.dtype).max if key.dtype.kind in "iu" else np.inf
        acc = (np.maximum if kind == "max" else np.minimum).accumulate(
            np.where(keep, key, fill).astype(key.dtype))
        if key.dtype != x.dtype:
            acc = acc.view(x.dtype)
        return np.where(np.cumsum(keep) > 0, acc, x).astype(dtype)
    return run


def _scan_count(c: Any, op: ir.Operation) -> _Fn:
    """``tpu.scan_count(in_mask, values)`` -> ``(out_mask, counts)``: how many kept lanes up to
    this one hold its value (a masked-off lane counts 1), and whether this is the last kept
    lane holding it."""
    def run(mask: Any, values: Any) -> Any:
        keep = np.asarray(mask, bool)
        x = np.asarray(values)
        same = (x[:, None] == x[None, :]) & keep[:, None] & keep[None, :]
        upto = np.tril(np.ones(same.shape, bool))
        counts = np.where(keep, (same & upto).sum(axis=1), 1).astype(np.int32)
        last = keep & ~(same & ~upto).any(axis=1)
        return last, counts
    return run


def _all_reduce(c: Any, op: ir.Operation) -> _Fn:
    """``tpu.all_reduce`` of a mask: the number of set lanes (``sum``) or the first set lane
    (``find_first_set``; the length when none is), in every lane of the result."""
    kind = enum_case(op.attributes["kind"])
    shape = shape_of(op.results[0].type)
    dtype = dtype_of(op.results[0].type)
    if dtype_of(op.operands[0].type) != np.bool_ or len(shape_of(op.operands[0].type)) != 1:
        raise _unsupported(op, "all-reductions of anything but a 1-D mask")
    if kind not in ("sum", "find_first_set"):
        raise _unsupported(op, f"all-reductions of kind {kind}")

    def run(x: Any) -> Any:
        x = np.asarray(x, bool)
        value = int(x.sum()) if kind == "sum" else (int(np.argmax(x)) if x.any() else x.size)
        return np.full(shape, value, dtype)
    return run


def _narrowed(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``x`` converted to the packed element type: floats round to nearest even, integers
    keep their low bits."""
    return x.astype(dtype)


def _pack(c: Any, op: ir.Operation) -> _Fn:
    """``tpu.pack_subelements`` of 1-D vectors: interleaved (``a0 b0 a1 b1 ...``) or
    compressed (``a`` then ``b``), each source narrowed to the result's element type."""
    fmt = enum_case(op.attributes["pack_format"])
    positions = int_array(op.attributes["positions"])
    shape, dtype = shape_of(op.results[0].type), dtype_of(op.results[0].type)
    if len(shape_of(op.operands[0].type)) != 1 or sorted(positions) != list(
            range(len(positions))):
        raise _unsupported(op, "packing other than of 1-D vectors into every position")
    if fmt not in ("interleaved", "compressed"):
        raise _unsupported(op, f"the pack format {fmt}")

    def run(*sources: Any) -> Any:
        by_position = dict(zip(positions, sources, strict=True))
        parts = [_narrowed(np.asarray(by_position[p]), dtype) for p in range(len(sources))]
        axis = -1 if fmt == "interleaved" else 0
        return np.stack(parts, axis=axis).reshape(shape)
    return run


def _unpack(c: Any, op: ir.Operation) -> _Fn:
    """``tpu.unpack_subelements``: part ``index`` of a packed 1-D vector, widened (integers
    sign-extended, or zero-extended with ``unsigned_integers``)."""
    fmt = enum_case(op.attributes["pack_format"])
    index = int_attribute(op, "index")
    shape, dtype = shape_of(op.results[0].type), dtype_of(op.results[0].type)
    src_shape = shape_of(op.operands[0].type)
    parts = int(np.prod(src_shape)) // int(np.prod(shape))
    zero_extend = bool_attribute(op, "unsigned_integers")
    if len(shape) != 1 or fmt not in ("interleaved", "compressed"):
        raise _unsupported(op, f"unpacking {fmt} data into vectors of rank {len(shape)}")

    def run(x: Any) -> Any:
        flat = np.asarray(x).reshape(-1)
        part = flat.reshape(-1, parts)[:, index] if fmt == "interleaved" else \
            flat.reshape(parts, -1)[index]
        if zero_extend and part.dtype.kind == "i":
            part = as_unsigned(part)
        return part.astype(dtype).reshape(shape)
    return run


# -- barriers and atomics ---------------------------------------------------------------------

def _sem_barrier(c: Any, op: ir.Operation) -> _Fn:
    """``tpu.sem_barrier`` (``pltpu.get_barrier_semaphore()``): the subcore's barrier
    semaphore, one per subcore as in the interpreter. Other devices' signals, what it is for,
    are not emulated (signals to another device are refused), so it counts the subcore's own."""
    sc = sc_of(c)
    return lambda: sc.program().barrier


def _element_of(op: ir.Operation, sc: SCState, here: np.ndarray, key: tuple[int, ...],
                subcore: int) -> tuple[np.ndarray, int]:
    """Subcore ``subcore``'s copy of element ``key`` of ``here`` (a view of one of the
    running program's scratch buffers): that subcore's buffer, flat, and the index in it."""
    program = sc.program()
    address = here.__array_interface__["data"][0] + sum(
        i * st for i, st in zip(key, here.strides, strict=True))
    for k, arg in enumerate(program.args):
        if not isinstance(arg, np.ndarray) or not arg.size:
            continue
        start = arg.__array_interface__["data"][0]
        if arg.flags.c_contiguous and start <= address < start + arg.nbytes:
            other = next((p for p in sc.programs
                          if p.core == program.core and p.subcore == subcore), None)
            if other is None:
                raise EmulationError(
                    f"{op.name} at {op.location} names subcore {subcore}, which core "
                    f"{program.core} of the mesh does not have. Fix: name a subcore of the "
                    "mesh.")
            return other.args[k].reshape(-1), (address - start) // arg.itemsize
    raise _unsupported(op, "an atomic add to a buffer that is not a scratch operand")


def _fetch_and_add(c: Any, op: ir.Operation) -> _Fn:
    """``tpu.fetch_and_add_sync(base, *indices, value, subcore)``: adds ``value`` to the
    element of ``base`` in vector subcore ``subcore``'s SMEM (the same scratch operand of that
    subcore of this core) and returns the element's value before the add."""
    sc = sc_of(c)
    dtype = dtype_of(op.results[0].type)

    def run(base: np.ndarray, *rest: Any) -> Any:
        *idx, value, subcore = rest
        key = tuple(int(i) for i in idx)
        buffer, at = _element_of(op, sc, base, key, int(subcore))
        old = np.asarray(buffer[at], dtype)
        buffer[at] = (old + np.asarray(value, dtype)).astype(buffer.dtype)
        return old
    return run


def _barrier(c: Any, op: ir.Operation) -> _Fn:
    sc = sc_of(c)

    def run(barrier_id: Any) -> None:
        if sc.scheduler is None:
            raise UnsupportedError("tpu.barrier outside the SparseCore scheduler")
        sc.scheduler.barrier(sc.program(), int(barrier_id))
    return run


RULES: dict[str, EmulatorRule] = {
    "memref.alloca": _alloca, "memref.alloc": _alloca, "tpu.sem_alloc": _alloca,
    "tpu.vector_load": _vector_load, "tpu.vector_store": _vector_store,
    "tpu.vector_load_idx": _load_idx, "tpu.vector_store_idx": _store_idx,
    "tpu.enqueue_indirect_dma": _enqueue_indirect_dma,
    "tpu.wait_indirect_dma": _wait_indirect_dma,
    "tpu.enqueue_dma": _this_subcore("tpu.enqueue_dma", 5),
    "tpu.wait_dma2": TPU_RULES["tpu.wait_dma2"],  # ids describe the copy; waits are local
    "tpu.wait_dma": TPU_RULES["tpu.wait_dma"],
    "tpu.vector_expand_load": _expand_load, "tpu.expand_load_vreg": _expand_load,
    "tpu.vector_compress_store": _compress_store, "tpu.compress_store_vreg": _compress_store,
    "tpu.sem_signal": _this_subcore("tpu.sem_signal", 3),
    "tpu.sort": _sort, "tpu.scan": _scan, "tpu.scan_count": _scan_count,
    "tpu.all_reduce": _all_reduce, "tpu.pack_subelements": _pack,
    "tpu.unpack_subelements": _unpack, "tpu.barrier": _barrier,
    "tpu.sem_barrier": _sem_barrier, "tpu.fetch_and_add_sync": _fetch_and_add,
}
"""The SparseCore operations, on top of the TensorCore emulator's rules."""
