"""The Mosaic TPU emulator's compute operations: ``tpu.matmul`` and ``tpu.conv`` (summed in
float32, or int64 for integers, or wider), ``iota``, rotations, repeats, concatenation,
bitcasts, the reciprocal, index reductions, ``reduce_precision``, gathers and conversions; the
hand-driven MXU (``tpu.matmul_push_rhs``, ``matmul_acc_lhs``, ``matmul_pop`` and the result
FIFO, on :class:`~pallas_mosaic_tpu.emulator_state.MXUs`); the hardware PRNG; regions
(``tpu.region``, ``tpu.trace``) and the logs of ``pl.debug_print``."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
from jaxlib.mlir import ir

from pallas_core.backend import EmulatorCompiler, EmulatorRule, dtype_of, shape_of
from pallas_mosaic_tpu.emulator_ops import (
    EmulationError,
    _unsupported,
    bitcast_array,
    bool_attribute,
    enum_case,
    int_array,
    int_attribute,
)
from pallas_mosaic_tpu.emulator_state import state_of

_Fn = Callable[..., Any]


def _dimension_numbers(op: ir.Operation, lhs_rank: int, rhs_rank: int) -> list[list[int]]:
    """``[lhs contracting, rhs contracting, lhs free, rhs free, output order, lhs batch,
    rhs batch]`` of a ``tpu.matmul``."""
    if "dimension_numbers" in op.attributes:
        text = str(op.attributes["dimension_numbers"])
        groups = text[text.index("<") + 1:text.rindex(">")].split("]")
        return [[int(v) for v in g.strip(", [").split(",") if v.strip()] for g in groups[:7]]
    if lhs_rank != 2 or rhs_rank != 2:
        raise _unsupported(op, "a matmul of rank other than 2 without dimension numbers")
    tl = "transpose_lhs" in op.attributes and bool(ir.BoolAttr(op.attributes["transpose_lhs"]))
    tr = "transpose_rhs" in op.attributes and bool(ir.BoolAttr(op.attributes["transpose_rhs"]))
    return [[0 if tl else 1], [1 if tr else 0], [1 if tl else 0], [0 if tr else 1],
            [0, 1 if tl else 0, 1, 0 if tr else 1], [], []]


def _accumulator(dtype: np.dtype) -> Any:
    """The type products into ``dtype`` are summed in: float32 (float64 for wider floats),
    int64 for integers."""
    if dtype.kind != "f":
        return np.int64
    return np.float64 if np.dtype(dtype).itemsize > 4 else np.float32


def _matmul(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    """``acc + lhs . rhs``, products summed in float32 (int32 for integers) or wider."""
    lhs_c, rhs_c, lhs_f, rhs_f, order, lhs_b, rhs_b = _dimension_numbers(
        op, len(shape_of(op.operands[0].type)), len(shape_of(op.operands[1].type)))
    dtype = dtype_of(op.results[0].type)
    # Axes of the natural product: batch, lhs free, rhs free; named as (operand, dim).
    natural = [(0, d) for d in lhs_b] + [(0, d) for d in lhs_f] + [(1, d) for d in rhs_f]
    rename = {(1, r): (0, lb) for lb, r in zip(lhs_b, rhs_b, strict=True)}
    out = [rename.get((order[2 * k], order[2 * k + 1]), (order[2 * k], order[2 * k + 1]))
           for k in range(len(order) // 2)]
    perm = [natural.index(a) for a in out]

    def run(lhs: Any, rhs: Any, acc: Any) -> Any:
        lhs, rhs = np.asarray(lhs), np.asarray(rhs)
        wide = _accumulator(dtype)
        a = np.transpose(lhs, lhs_b + lhs_f + lhs_c).astype(wide)
        b = np.transpose(rhs, rhs_b + rhs_c + rhs_f).astype(wide)
        nb = len(lhs_b)
        bshape = a.shape[:nb]
        fl, fr = a.shape[nb:nb + len(lhs_f)], b.shape[nb + len(rhs_c):]
        k = int(np.prod(a.shape[nb + len(lhs_f):], dtype=np.int64))
        prod = np.matmul(a.reshape(*bshape, -1, k), b.reshape(*bshape, k, -1))
        prod = np.transpose(prod.reshape(*bshape, *fl, *fr), perm)
        return (np.asarray(acc).astype(wide) + prod).astype(dtype)
    return run


def _dilate(x: np.ndarray, axis: int, by: int) -> np.ndarray:
    """``by - 1`` zeros between neighbours along ``axis``."""
    if by == 1:
        return x
    shape = list(x.shape)
    shape[axis] = (shape[axis] - 1) * by + 1
    out = np.zeros(shape, x.dtype)
    index = [slice(None)] * x.ndim
    index[axis] = slice(None, None, by)
    out[tuple(index)] = x
    return out


def _conv(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    """``tpu.conv``: ``acc`` plus the convolution XLA's ``ConvGeneralDilated`` defines
    (dimension numbers, strides, padding that may be negative, both dilations, window
    reversal, feature groups), summed in float32 (int64 for integers) or wider."""
    found = [int(v) for v in re.findall(r"-?\d+", str(op.attributes["dimension_numbers"]))]
    rank = len(shape_of(op.operands[0].type))
    n = rank - 2
    lb, lf, ls = found[0], found[1], found[2:2 + n]
    ri, ro, rs = found[2 + n], found[3 + n], found[4 + n:4 + 2 * n]
    ob, of, os_ = found[4 + 2 * n], found[5 + 2 * n], found[6 + 2 * n:6 + 3 * n]
    strides = int_array(op.attributes["window_strides"])
    padding = int_array(op.attributes["padding"])
    lhs_dil = int_array(op.attributes["lhs_dilation"])
    rhs_dil = int_array(op.attributes["rhs_dilation"])
    reversal = [bool(v) for v in ir.DenseBoolArrayAttr(op.attributes["window_reversal"])]
    groups = int_attribute(op, "feature_group_count", 1)
    if int_attribute(op, "batch_group_count", 1) != 1:
        raise _unsupported(op, "a convolution with batch_group_count > 1")
    dtype = dtype_of(op.results[0].type)

    def run(lhs: Any, rhs: Any, acc: Any) -> Any:
        wide = _accumulator(dtype)
        x = np.transpose(np.asarray(lhs), [lb, lf, *ls]).astype(wide)  # N C spatial
        w = np.transpose(np.asarray(rhs), [ro, ri, *rs]).astype(wide)  # O I spatial
        for d in range(n):
            x = _dilate(x, 2 + d, lhs_dil[d])
            lo, hi = padding[2 * d], padding[2 * d + 1]
            pad = [(0, 0)] * x.ndim
            pad[2 + d] = (max(lo, 0), max(hi, 0))
            x = np.pad(x, pad)
            cut = [slice(None)] * x.ndim
            cut[2 + d] = slice(max(-lo, 0), x.shape[2 + d] - max(-hi, 0))
            x = x[tuple(cut)]
            w = _dilate(w, 2 + d, rhs_dil[d])
            if reversal[d]:
                w = np.flip(w, 2 + d)
        window = w.shape[2:]
        out_sizes = [(x.shape[2 + d] - window[d]) // strides[d] + 1 for d in range(n)]
        per = x.shape[1] // groups
        outs_per = w.shape[0] // groups
        out = np.zeros((x.shape[0], w.shape[0], *out_sizes), wide)
        for offset in itertools.product(*(range(k) for k in window)):
            where: list[Any] = [slice(None), slice(None)]
            where += [slice(offset[d], offset[d] + strides[d] * (out_sizes[d] - 1) + 1,
                            strides[d]) for d in range(n)]
            taps = x[tuple(where)]
            at: list[Any] = [slice(None), slice(None), *offset]
            weights = w[tuple(at)]  # O I
            for g in range(groups):
                out[:, g * outs_per:(g + 1) * outs_per] += np.einsum(
                    "nc...,oc->no...", taps[:, g * per:(g + 1) * per],
                    weights[g * outs_per:(g + 1) * outs_per])
        order = [0] * rank  # where each of N, O, spatial goes in the result
        for k, dim in enumerate([ob, of, *os_]):
            order[dim] = k
        return (np.asarray(acc).astype(wide) + np.transpose(out, order)).astype(dtype)
    return run


def _iota(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    shape = shape_of(op.results[0].type)
    dims = int_array(op.attributes["dimensions"]) if "dimensions" in op.attributes else []
    if not dims:
        raise _unsupported(op, "an iota without dimensions")
    value = np.zeros(shape, np.int64)
    for d in dims:
        value = value * shape[d] + np.arange(shape[d]).reshape(
            [-1 if k == d else 1 for k in range(len(shape))])
    value = value.astype(dtype_of(op.results[0].type))
    return lambda: value


def _rotate(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    """``jnp.roll`` along ``dimension``; with a stride, index ``j`` along ``stride_dimension``
    rolls by ``amount + stride * j``."""
    dim = int_attribute(op, "dimension")
    stride = int_attribute(op, "stride", 0)
    sdim = int_attribute(op, "stride_dimension", 0)
    shape = shape_of(op.results[0].type)
    n = shape[dim]
    pos = np.arange(n).reshape([-1 if k == dim else 1 for k in range(len(shape))])
    lane = np.arange(shape[sdim]).reshape([-1 if k == sdim else 1 for k in range(len(shape))])

    def run(x: Any, amount: Any, *_: Any) -> Any:
        shift = int(amount) + stride * lane if stride else int(amount)
        source = np.broadcast_to((pos - shift) % n, shape)
        return np.take_along_axis(np.asarray(x), source, axis=dim)
    return run


def _repeat(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    dim, times = int_attribute(op, "dimension"), int_attribute(op, "times")
    return lambda x: np.concatenate([np.asarray(x)] * times, axis=dim)


def _concatenate(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    dim = int_attribute(op, "dimension")
    return lambda *xs: np.concatenate([np.asarray(x) for x in xs], axis=dim)


def _tpu_bitcast(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    dtype = dtype_of(op.results[0].type)
    shape = shape_of(op.results[0].type)
    return lambda x: bitcast_array(np.asarray(x), dtype).reshape(shape)


def _reciprocal(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    dtype = dtype_of(op.results[0].type)
    return lambda x: (1.0 / np.asarray(x).astype(np.float32)).astype(dtype)


def _reduce_index(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    axis = int_attribute(op, "axis")
    kind = enum_case(op.attributes["kind"]).lower()
    fn = {"arg_max": np.argmax, "arg_min": np.argmin}.get(kind)
    if fn is None:
        raise _unsupported(op, f"the index reduction {kind}")
    dtype = dtype_of(op.results[0].type)
    return lambda x: fn(np.asarray(x), axis=axis).astype(dtype)


def reduce_precision(x: np.ndarray, exponent_bits: int, mantissa_bits: int) -> np.ndarray:
    """``x`` rounded to a float of ``exponent_bits`` and ``mantissa_bits`` and kept in its
    own type, as XLA's ``ReducePrecision`` defines it: the mantissa rounded to nearest even
    on the bits, then exponents past the narrow range flushed to signed infinity (above) or
    signed zero (at or below its smallest normal); NaNs stay NaN."""
    x = np.asarray(x)
    info = ml_dtypes.finfo(x.dtype)
    width, mant = x.dtype.itemsize * 8, int(info.nmant)
    exp = width - 1 - mant
    u = np.dtype(f"uint{width}")
    bits = x.view(u).astype(np.uint64)
    if mantissa_bits < mant:
        last = 1 << (mant - mantissa_bits)
        bias = ((bits & last) >> (mant - mantissa_bits)) + ((last >> 1) - 1)
        bits = (bits + bias) & ~np.uint64(last - 1) & np.uint64((1 << width) - 1)
    if exponent_bits < exp:
        exp_mask = ((1 << exp) - 1) << mant
        src_bias, narrow_bias = (1 << (exp - 1)) - 1, (1 << (exponent_bits - 1)) - 1
        exponent = bits & np.uint64(exp_mask)
        sign = bits & np.uint64(1 << (width - 1))
        bits = np.where(exponent > np.uint64((src_bias + narrow_bias) << mant),
                        sign | np.uint64(exp_mask),
                        np.where(exponent <= np.uint64((src_bias - narrow_bias) << mant),
                                 sign, bits))
    out = bits.astype(u).view(x.dtype)
    return np.where(np.isnan(x), x, out)


def _reduce_precision(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    exponent, mantissa = int_attribute(op, "exponent_bits"), int_attribute(op, "mantissa_bits")
    return lambda x: reduce_precision(np.asarray(x), exponent, mantissa)


def _dynamic_gather(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    dims = int_array(op.attributes["dimensions"])
    if len(dims) != 1:
        raise _unsupported(op, "a gather over several dimensions")
    (d,) = dims

    def run(x: Any, idx: Any) -> Any:
        x = np.asarray(x)
        return np.take_along_axis(x, np.asarray(idx).astype(np.int64) % x.shape[d], axis=d)
    return run


def _float_to_int(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    dtype = dtype_of(op.results[0].type)
    mode = enum_case(op.attributes["rounding_mode"]) if "rounding_mode" in op.attributes \
        else "towards_zero"
    rnd = np.rint if "nearest" in mode else np.trunc
    info = np.iinfo(dtype)

    def run(x: Any) -> Any:
        f = rnd(np.asarray(x).astype(np.float64))
        return np.where(np.isnan(f), 0, np.clip(f, info.min, info.max)).astype(dtype)
    return run


def _convert(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    dtype = dtype_of(op.results[0].type)
    if "rounding_mode" in op.attributes and "nearest" not in enum_case(
            op.attributes["rounding_mode"]):
        raise _unsupported(op, "rounding modes other than to nearest even")
    return lambda x: np.asarray(x).astype(dtype)


# -- the hand-driven MXU ----------------------------------------------------------------------

def _attr(op: ir.Operation, name: str) -> int | None:
    return int_attribute(op, name) if name in op.attributes else None


def _push_rhs(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    mxus, mxu = state_of(c).mxu, _attr(op, "mxu_index")
    reg = int_attribute(op, "staging_register", 0)
    transpose = "transpose" in op.attributes and bool_attribute(op, "transpose")

    def run(rhs: Any) -> None:
        if (mxu, reg) in mxus.staged:
            raise EmulationError(f"{op.name} at {op.location} pushes into staging register "
                                 f"{reg} of MXU {mxu}, which holds an RHS never loaded.")
        rhs = np.asarray(rhs)
        mxus.staged[(mxu, reg)] = (rhs.T if transpose else rhs).copy()  # type: ignore
    return run


def _acc_lhs(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    mxus, mxu, addr = state_of(c).mxu, _attr(op, "mxu_index"), _attr(op, "acc")
    load = _attr(op, "load_staged_rhs")

    def run(lhs: Any) -> None:
        product = mxus.product(op, lhs, mxu, load)  # type: ignore[arg-type]
        old = mxus.accs.get((mxu, addr))  # type: ignore[arg-type]
        if old is not None and old.shape != product.shape:
            raise EmulationError(f"{op.name} at {op.location} adds a {product.shape} product "
                                 f"into accumulator {addr} of MXU {mxu}, which holds "
                                 f"{old.shape}.")
        mxus.accs[(mxu, addr)] = product if old is None else old + product  # type: ignore
    return run


def _pop(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    mxus, mxu, addr = state_of(c).mxu, _attr(op, "mxu_index"), _attr(op, "acc")
    shape, dtype = shape_of(op.results[0].type), dtype_of(op.results[0].type)

    def run() -> Any:
        value = mxus.accs.pop((mxu, addr), None)  # type: ignore[arg-type]
        if value is None:  # never accumulated into since it was last popped: zero
            return np.zeros(shape, dtype)
        return _popped(op, value, f"accumulator {addr} of MXU {mxu}")
    return run


def _popped(op: ir.Operation, value: np.ndarray, where: str) -> np.ndarray:
    """``value``, popped from ``where`` by ``op``, as the op's result type."""
    shape = tuple(shape_of(op.results[0].type))
    if value.shape != shape:
        raise EmulationError(f"{op.name} at {op.location} pops {shape} from {where}, which "
                             f"holds {value.shape}.")
    return value.astype(dtype_of(op.results[0].type))


def _lhs_fifo(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    mxus, mxu, load = state_of(c).mxu, _attr(op, "mxu_index"), _attr(op, "load_staged_rhs")
    return lambda lhs: mxus.fifo.setdefault(mxu, []).append(  # type: ignore[arg-type]
        mxus.product(op, lhs, mxu, load))  # type: ignore[arg-type]


def _pop_fifo(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    mxus, mxu = state_of(c).mxu, _attr(op, "mxu_index")

    def run() -> Any:
        queue = mxus.fifo.get(mxu)  # type: ignore[arg-type]
        if not queue:
            raise EmulationError(f"{op.name} at {op.location} pops the result FIFO of MXU "
                                 f"{mxu}, which is empty.")
        return _popped(op, queue.pop(0), f"the result FIFO of MXU {mxu}")
    return run


# -- the hardware PRNG ------------------------------------------------------------------------

def _prng_seed(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    state = state_of(c)

    def run(*seeds: Any) -> None:
        words = [int(np.asarray(s).astype(np.int64)) & 0xFFFFFFFF for s in seeds]
        state.rng = np.random.default_rng(words)
    return run


def _prng_bits(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    """Random bits from a generator seeded by ``prng_set_seed_32`` (not the TPU's bits: only
    the distribution and the determinism for one seed match)."""
    state = state_of(c)
    shape = shape_of(op.results[0].type)
    dtype = dtype_of(op.results[0].type)

    def run() -> Any:
        if state.rng is None:
            raise EmulationError(f"{op.name} at {op.location} draws random bits before the "
                                 "PRNG is seeded. Fix: call pltpu.prng_seed first.")
        bits = state.rng.integers(0, 2 ** 32, size=shape, dtype=np.uint64).astype(np.uint32)
        return bits.view(np.int32).astype(dtype) if dtype.itemsize == 4 else bits.astype(dtype)
    return run


# -- regions and logs -------------------------------------------------------------------------

def _region(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    body = c.region(op.regions[0])
    n = len(op.results)

    def run() -> Any:
        out = body()
        return None if n == 0 else out[0] if n == 1 else tuple(out)
    return run


_LOG_FIELD = re.compile(r"\$[fsu]?\d+")


def _log(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    """``tpu.log``: prints its tag with each ``$f0``/``$s1``/``$u2`` (``$0`` before JAX 0.11)
    replaced by that operand,
    as the interpreter prints ``pl.debug_print`` (``str`` of each value)."""
    tag = ir.StringAttr(op.attributes["tag"]).value
    formatted = "formatted" in op.attributes and ir.BoolAttr(op.attributes["formatted"]).value
    fmt = _LOG_FIELD.sub("{}", tag.replace("{", "{{").replace("}", "}}")) if formatted \
        else tag.replace("{", "{{").replace("}", "}}")

    def run(*xs: Any) -> None:
        print(fmt.format(*(np.asarray(x) for x in xs)) if formatted else fmt.format())
    return run


def _log_buffer(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    """``tpu.log_buffer``: prints its tag, then the buffer's logical ``shape``."""
    tag = ir.StringAttr(op.attributes["tag"]).value
    shape = tuple(ir.DenseI64ArrayAttr(op.attributes["shape"]))

    def run(buf: Any) -> None:
        print(tag + str(np.asarray(buf)[tuple(slice(0, n) for n in shape)]))
    return run


RULES: dict[str, EmulatorRule] = {
    "tpu.matmul": _matmul, "tpu.conv": _conv, "tpu.matmul_push_rhs": _push_rhs,
    "tpu.matmul_acc_lhs": _acc_lhs, "tpu.matmul_pop": _pop, "tpu.matmul_lhs_fifo": _lhs_fifo,
    "tpu.matmul_pop_fifo": _pop_fifo, "tpu.iota": _iota, "tpu.dynamic_rotate": _rotate,
    "tpu.repeat": _repeat, "tpu.concatenate": _concatenate, "tpu.bitcast": _tpu_bitcast,
    "tpu.reciprocal": _reciprocal, "tpu.reduce_index": _reduce_index,
    "tpu.dynamic_gather": _dynamic_gather, "tpu.reduce_precision": _reduce_precision,
    "tpu.fptosi": _float_to_int, "tpu.sitofp": _convert, "tpu.extf": _convert,
    "tpu.truncf": _convert,
    "tpu.prng_set_seed_32": _prng_seed, "tpu.prng_random_bits": _prng_bits,
    "tpu.region": _region, "tpu.trace": _region,
    "tpu.log": _log, "tpu.log_buffer": _log_buffer,
}
"""The compute operations above, by name."""
