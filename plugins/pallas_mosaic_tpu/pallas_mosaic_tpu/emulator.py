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

The operations: ``arith``, ``math``, ``scf`` and ``func`` from :mod:`pallas_core.emulation`,
``vector``/``memref``/memory ``tpu`` operations from :mod:`pallas_mosaic_tpu.emulator_ops`, and
the compute, DMA and semaphore ``tpu`` operations here. A backend that reuses the grid walk
(SparseCore) passes its own rules as ``extra_rules``.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np
from jaxlib.mlir import ir

from pallas_core.emulation.arith import ASSERT_RULES
from pallas_core.emulation.arith import RULES as ARITH_RULES
from pallas_core.emulation.call import EmulatedCall, EmulateOptions
from pallas_core.emulation.machine import Compiler, Rule
from pallas_core.emulation.turns import Turns
from pallas_core.emulation.types import dtype_of, shape_of
from pallas_core.errors import PallasError, UnsupportedError
from pallas_mosaic_tpu import ir as mir
from pallas_mosaic_tpu import symbolic
from pallas_mosaic_tpu.emulator_bits import RULES as BIT_RULES
from pallas_mosaic_tpu.emulator_ops import (
    RULES as MEMORY_RULES,
)
from pallas_mosaic_tpu.emulator_ops import (
    EmulationError,
    _bool,
    _enum,
    _int,
    _ints,
    _unsupported,
    allocate,
    bitcast_array,
    segments,
)
from pallas_mosaic_tpu.symbolic import kernel_function

_Fn = Callable[..., Any]


class KernelState:
    """What a running kernel's operations read besides their operands: the grid, the
    TensorCore running it, the hardware PRNG, and under ``shard_map`` the device running it
    and the other devices' kernels (:class:`Network`)."""

    def __init__(self, bounds: Sequence[int], device: int | None = None,
                 network: Network | None = None, name: str = "kernel") -> None:
        self.name = name
        """The kernel's name, for messages."""
        self.bounds = tuple(bounds)
        self.core = 0
        self.rng: np.random.Generator | None = None
        self.device = device
        """The logical device id under ``shard_map`` (``None`` elsewhere)."""
        self.network = network
        self.barrier = np.zeros((), np.int64)
        """The device's barrier semaphore (``tpu.sem_barrier``)."""
        self.buffers: dict[Any, np.ndarray] = {}
        """The device's buffers another device may reach, by a key the same on every device:
        ``("arg", k)`` for the kernel's operands, ``("op", n)`` for the n-th allocating
        operation, ``"barrier"``."""
        self.keys: dict[int, Any] = {}
        """``id(buffer)`` -> its key in :attr:`buffers`."""
        self.allocations = 0
        """Allocating operations compiled so far (their keys' numbers)."""
        self.mxu = MXUs()
        """The hand-driven MXUs (``tpu.matmul_push_rhs`` and the others)."""

    def register(self, key: Any, buffer: np.ndarray) -> None:
        old = self.buffers.get(key)
        if old is not None:
            self.keys.pop(id(old), None)
        self.buffers[key] = buffer
        self.keys[id(buffer)] = key


def _root(view: np.ndarray) -> np.ndarray:
    while isinstance(view.base, np.ndarray):
        view = view.base
    return view


class Network:
    """The devices of a ``shard_map`` running one kernel together: each in its own thread,
    one at a time (:class:`~pallas_core.emulation.turns.Turns`), switching where a device
    waits on a semaphore. A remote DMA or signal reaches the other device's buffer or
    semaphore: the same operand, scratch buffer or allocation there, at the same offset."""

    def __init__(self, devices: int, name: str = "") -> None:
        self.name = name
        self.states: list[KernelState] = []
        self.turns = Turns([f"device {d}" for d in range(devices)], self._deadlock)

    def _deadlock(self, waiting: list[tuple[str, str]], finished: list[str]) -> BaseException:
        places: dict[str, list[str]] = {}
        for name, what in waiting:
            places.setdefault(what, []).append(name.removeprefix("device "))
        stuck = "; ".join(
            f"device{'s' if len(ds) > 1 else ''} {', '.join(ds)} wait{'' if len(ds) > 1 else 's'}"
            f" at {what}" for what, ds in places.items())
        return EmulationError(
            f"kernel {self.name!r} would hang: {stuck} (finished: "
            f"{', '.join(finished) or 'none'}), and no device left running signals them. "
            "Fix: make every wait match a signal or DMA that another device (or this one) "
            "sends.")

    def remote(self, state: KernelState, op: ir.Operation, local: np.ndarray,
               device: Any) -> np.ndarray:
        """The view of device ``device`` that ``local`` (a view on ``state``'s device) is."""
        d = int(device)
        if not 0 <= d < len(self.states):
            raise EmulationError(
                f"{op.name} at {op.location} names device {d}; the shard_map's mesh has "
                f"{len(self.states)} devices (logical ids 0..{len(self.states) - 1}). Fix: "
                "compute the device id from lax.axis_index of the mesh axes.")
        root = _root(local)
        key = state.keys.get(id(root))
        peer = self.states[d].buffers.get(key) if key is not None else None
        if key is None:
            raise _unsupported(op, "a remote access to a buffer other than the kernel's "
                               "operands, scratch buffers and scoped allocations")
        if peer is None:
            raise EmulationError(
                f"{op.name} at {op.location} reaches a scoped buffer of device {d}, which has "
                "not allocated it (it is not inside that scope). Fix: synchronise with the "
                "device (a barrier) before reaching into its scoped buffers.")
        offset = local.__array_interface__["data"][0] - root.__array_interface__["data"][0]
        return np.ndarray(local.shape, local.dtype, buffer=peer, offset=offset,
                          strides=local.strides)

    def take(self, op: ir.Operation, sem: np.ndarray, amount: int) -> None:
        """Waits (letting the other devices run) until ``sem`` holds ``amount``; takes it."""
        self.turns.wait_until(lambda: int(sem) >= amount,
                              f"{op.name} ({op.location}) for {amount}")
        sem[...] = int(sem) - amount


class TPUCompiler(Compiler):
    """A :class:`Compiler` carrying the running kernel's :class:`KernelState`."""

    def __init__(self, rules: Mapping[str, Rule], state: KernelState, *, backend: str,
                 module: ir.Module) -> None:
        super().__init__(rules, backend=backend, module=module)
        self.state = state


def _state(c: Compiler) -> KernelState:
    state = getattr(c, "state", None)
    if not isinstance(state, KernelState):
        raise UnsupportedError("TPU operations need the TPU emulator's compiler")
    return state


# -- compute ----------------------------------------------------------------------------------

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


def _matmul(c: Compiler, op: ir.Operation) -> _Fn:
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


def _conv(c: Compiler, op: ir.Operation) -> _Fn:
    """``tpu.conv``: ``acc`` plus the convolution XLA's ``ConvGeneralDilated`` defines
    (dimension numbers, strides, padding that may be negative, both dilations, window
    reversal, feature groups), summed in float32 (int64 for integers) or wider."""
    found = [int(v) for v in re.findall(r"-?\d+", str(op.attributes["dimension_numbers"]))]
    rank = len(shape_of(op.operands[0].type))
    n = rank - 2
    lb, lf, ls = found[0], found[1], found[2:2 + n]
    ri, ro, rs = found[2 + n], found[3 + n], found[4 + n:4 + 2 * n]
    ob, of, os_ = found[4 + 2 * n], found[5 + 2 * n], found[6 + 2 * n:6 + 3 * n]
    strides, padding = _ints(op.attributes["window_strides"]), _ints(op.attributes["padding"])
    lhs_dil, rhs_dil = _ints(op.attributes["lhs_dilation"]), _ints(op.attributes["rhs_dilation"])
    reversal = [bool(v) for v in ir.DenseBoolArrayAttr(op.attributes["window_reversal"])]
    groups = _int(op, "feature_group_count", 1)
    if _int(op, "batch_group_count", 1) != 1:
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


def _iota(c: Compiler, op: ir.Operation) -> _Fn:
    shape = shape_of(op.results[0].type)
    dims = _ints(op.attributes["dimensions"]) if "dimensions" in op.attributes else []
    if not dims:
        raise _unsupported(op, "an iota without dimensions")
    value = np.zeros(shape, np.int64)
    for d in dims:
        value = value * shape[d] + np.arange(shape[d]).reshape(
            [-1 if k == d else 1 for k in range(len(shape))])
    value = value.astype(dtype_of(op.results[0].type))
    return lambda: value


def _rotate(c: Compiler, op: ir.Operation) -> _Fn:
    """``jnp.roll`` along ``dimension``; with a stride, index ``j`` along ``stride_dimension``
    rolls by ``amount + stride * j``."""
    dim = _int(op, "dimension")
    stride = _int(op, "stride", 0)
    sdim = _int(op, "stride_dimension", 0)
    shape = shape_of(op.results[0].type)
    n = shape[dim]
    pos = np.arange(n).reshape([-1 if k == dim else 1 for k in range(len(shape))])
    lane = np.arange(shape[sdim]).reshape([-1 if k == sdim else 1 for k in range(len(shape))])

    def run(x: Any, amount: Any, *_: Any) -> Any:
        shift = int(amount) + stride * lane if stride else int(amount)
        source = np.broadcast_to((pos - shift) % n, shape)
        return np.take_along_axis(np.asarray(x), source, axis=dim)
    return run


def _repeat(c: Compiler, op: ir.Operation) -> _Fn:
    dim, times = _int(op, "dimension"), _int(op, "times")
    return lambda x: np.concatenate([np.asarray(x)] * times, axis=dim)


def _concatenate(c: Compiler, op: ir.Operation) -> _Fn:
    dim = _int(op, "dimension")
    return lambda *xs: np.concatenate([np.asarray(x) for x in xs], axis=dim)


def _tpu_bitcast(c: Compiler, op: ir.Operation) -> _Fn:
    dtype = dtype_of(op.results[0].type)
    shape = shape_of(op.results[0].type)
    return lambda x: bitcast_array(np.asarray(x), dtype).reshape(shape)


def _reciprocal(c: Compiler, op: ir.Operation) -> _Fn:
    dtype = dtype_of(op.results[0].type)
    return lambda x: (1.0 / np.asarray(x).astype(np.float32)).astype(dtype)


def _reduce_index(c: Compiler, op: ir.Operation) -> _Fn:
    axis = _int(op, "axis")
    kind = _enum(op.attributes["kind"]).lower()
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


def _reduce_precision(c: Compiler, op: ir.Operation) -> _Fn:
    exponent, mantissa = _int(op, "exponent_bits"), _int(op, "mantissa_bits")
    return lambda x: reduce_precision(np.asarray(x), exponent, mantissa)


def _dynamic_gather(c: Compiler, op: ir.Operation) -> _Fn:
    dims = _ints(op.attributes["dimensions"])
    if len(dims) != 1:
        raise _unsupported(op, "a gather over several dimensions")
    (d,) = dims

    def run(x: Any, idx: Any) -> Any:
        x = np.asarray(x)
        return np.take_along_axis(x, np.asarray(idx).astype(np.int64) % x.shape[d], axis=d)
    return run


def _float_to_int(c: Compiler, op: ir.Operation) -> _Fn:
    dtype = dtype_of(op.results[0].type)
    mode = _enum(op.attributes["rounding_mode"]) if "rounding_mode" in op.attributes \
        else "towards_zero"
    rnd = np.rint if "nearest" in mode else np.trunc
    info = np.iinfo(dtype)

    def run(x: Any) -> Any:
        f = rnd(np.asarray(x).astype(np.float64))
        return np.where(np.isnan(f), 0, np.clip(f, info.min, info.max)).astype(dtype)
    return run


def _convert(c: Compiler, op: ir.Operation) -> _Fn:
    dtype = dtype_of(op.results[0].type)
    if "rounding_mode" in op.attributes and "nearest" not in _enum(
            op.attributes["rounding_mode"]):
        raise _unsupported(op, "rounding modes other than to nearest even")
    return lambda x: np.asarray(x).astype(dtype)


# -- the hand-driven MXU ----------------------------------------------------------------------

class MXUs:
    """What the kernel's MXUs hold: staged RHS by ``(mxu, register)``, the loaded RHS by MXU,
    accumulators by ``(mxu, address)`` (each written whole: ``ACC`` Refs have no views), and
    each MXU's result FIFO. Accumulators start at zero and popping zeroes them; the state lasts
    for the whole kernel, as the hardware's does across grid steps."""

    def __init__(self) -> None:
        self.staged: dict[tuple[int, int], np.ndarray] = {}
        self.loaded: dict[int, np.ndarray] = {}
        self.accs: dict[tuple[int, int], np.ndarray] = {}
        self.fifo: dict[int, list[np.ndarray]] = {}

    def product(self, op: ir.Operation, lhs: Any, mxu: int, load: int | None) -> np.ndarray:
        """``lhs`` times MXU ``mxu``'s RHS (loaded first from register ``load``), summed in
        float32 (int32 for integers) as the MXU accumulates."""
        if load is not None:
            if (mxu, load) not in self.staged:
                raise EmulationError(f"{op.name} at {op.location} loads staging register "
                                     f"{load} of MXU {mxu}, which holds no RHS.")
            self.loaded[mxu] = self.staged.pop((mxu, load))
        if mxu not in self.loaded:
            raise EmulationError(f"{op.name} at {op.location}: MXU {mxu} has no loaded RHS.")
        lhs, rhs = np.asarray(lhs), self.loaded[mxu]
        if np.issubdtype(lhs.dtype, np.integer) and np.issubdtype(rhs.dtype, np.integer):
            return np.matmul(lhs.astype(np.int64), rhs.astype(np.int64)).astype(np.int32)
        return np.matmul(lhs.astype(np.float32), rhs.astype(np.float32))


def _attr(op: ir.Operation, name: str) -> int | None:
    return _int(op, name) if name in op.attributes else None


def _push_rhs(c: Compiler, op: ir.Operation) -> _Fn:
    mxus, mxu, reg = _state(c).mxu, _attr(op, "mxu_index"), _int(op, "staging_register", 0)
    transpose = "transpose" in op.attributes and _bool(op, "transpose")

    def run(rhs: Any) -> None:
        if (mxu, reg) in mxus.staged:
            raise EmulationError(f"{op.name} at {op.location} pushes into staging register "
                                 f"{reg} of MXU {mxu}, which holds an RHS never loaded.")
        rhs = np.asarray(rhs)
        mxus.staged[(mxu, reg)] = (rhs.T if transpose else rhs).copy()  # type: ignore
    return run


def _acc_lhs(c: Compiler, op: ir.Operation) -> _Fn:
    mxus, mxu, addr = _state(c).mxu, _attr(op, "mxu_index"), _attr(op, "acc")
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


def _pop(c: Compiler, op: ir.Operation) -> _Fn:
    mxus, mxu, addr = _state(c).mxu, _attr(op, "mxu_index"), _attr(op, "acc")
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


def _lhs_fifo(c: Compiler, op: ir.Operation) -> _Fn:
    mxus, mxu, load = _state(c).mxu, _attr(op, "mxu_index"), _attr(op, "load_staged_rhs")
    return lambda lhs: mxus.fifo.setdefault(mxu, []).append(  # type: ignore[arg-type]
        mxus.product(op, lhs, mxu, load))  # type: ignore[arg-type]


def _pop_fifo(c: Compiler, op: ir.Operation) -> _Fn:
    mxus, mxu = _state(c).mxu, _attr(op, "mxu_index")

    def run() -> Any:
        queue = mxus.fifo.get(mxu)  # type: ignore[arg-type]
        if not queue:
            raise EmulationError(f"{op.name} at {op.location} pops the result FIFO of MXU "
                                 f"{mxu}, which is empty.")
        return _popped(op, queue.pop(0), f"the result FIFO of MXU {mxu}")
    return run


# -- the hardware PRNG ------------------------------------------------------------------------

def _prng_seed(c: Compiler, op: ir.Operation) -> _Fn:
    state = _state(c)

    def run(*seeds: Any) -> None:
        words = [int(np.asarray(s).astype(np.int64)) & 0xFFFFFFFF for s in seeds]
        state.rng = np.random.default_rng(words)
    return run


def _prng_bits(c: Compiler, op: ir.Operation) -> _Fn:
    """Random bits from a generator seeded by ``prng_set_seed_32`` (not the TPU's bits: only
    the distribution and the determinism for one seed match)."""
    state = _state(c)
    shape = shape_of(op.results[0].type)
    dtype = dtype_of(op.results[0].type)

    def run() -> Any:
        if state.rng is None:
            raise EmulationError(f"{op.name} at {op.location} draws random bits before the "
                                 "PRNG is seeded. Fix: call pltpu.prng_seed first.")
        bits = state.rng.integers(0, 2 ** 32, size=shape, dtype=np.uint64).astype(np.uint32)
        return bits.view(np.int32).astype(dtype) if dtype.itemsize == 4 else bits.astype(dtype)
    return run


# -- DMAs and semaphores ----------------------------------------------------------------------

def _take(state: KernelState, op: ir.Operation, sem: np.ndarray, amount: int) -> None:
    """A wait on ``sem`` for ``amount``: among devices, until another one signals."""
    if state.network is not None:
        state.network.take(op, sem, amount)
    else:
        _semaphore_count(op, sem, amount)


def _remote(c: Compiler, op: ir.Operation, what: str) -> KernelState:
    """The state of a kernel whose ``op`` reaches another device (refused outside a joint
    run of the devices of a ``shard_map``)."""
    state = _state(c)
    if state.network is None:
        raise _unsupported(op, f"{what} outside a shard_map that runs the kernel on every "
                           "device (pl.emulate runs such kernels jointly inside shard_map)")
    return state


def _semaphore_count(op: ir.Operation, sem: np.ndarray, amount: int) -> None:
    if int(sem) < amount:
        raise EmulationError(
            f"{op.name} at {op.location} waits for {amount} on a semaphore holding {int(sem)}, "
            "and nothing else runs on this core to signal it: the kernel would hang. Fix: "
            "signal (or start the DMA on) this semaphore before waiting on it.")
    sem[...] = int(sem) - amount


def _enqueue_dma(c: Compiler, op: ir.Operation) -> _Fn:
    """A DMA (to device ``device_id`` when given): it copies when it starts, then signals the
    source semaphore here and the target semaphore where the target is."""
    (s, _), (ss0, ss1), (t, _), (ts0, ts1), (d0, d1), *_ = segments(op)
    state = _remote(c, op, "remote DMAs (to another device)") if d1 > d0 else _state(c)

    def run(*xs: Any) -> None:
        src, dst = xs[s], xs[t]
        target_sem = xs[ts0] if ts1 > ts0 else None
        if d1 > d0:
            assert state.network is not None
            dst = state.network.remote(state, op, dst, xs[d0])
            if target_sem is not None:
                target_sem = state.network.remote(state, op, target_sem, xs[d0])
        if src.shape != dst.shape:
            raise EmulationError(f"{op.name} at {op.location} copies {src.shape} into "
                                 f"{dst.shape}. Fix: give both refs the same shape.")
        np.copyto(dst, src.astype(dst.dtype, copy=False))
        nbytes = dst.size * dst.dtype.itemsize
        if target_sem is not None:
            target_sem[...] += nbytes
        if ss1 > ss0:
            xs[ss0][...] += nbytes
    return run


def _wait_dma2(c: Compiler, op: ir.Operation) -> _Fn:
    """A wait for a DMA's bytes on a semaphore of this device (the ``device_id`` of a remote
    DMA's wait only describes the copy)."""
    (sem, _), _, (dst, _), (d0, d1), *_ = segments(op)
    state = _remote(c, op, "waits on remote DMAs") if d1 > d0 else _state(c)

    def run(*xs: Any) -> None:
        target = xs[dst]
        _take(state, op, xs[sem], target.size * target.dtype.itemsize)
    return run


def _wait_dma(c: Compiler, op: ir.Operation) -> _Fn:
    """A wait for a DMA's bytes (newer Mosaic's form, naming both ends of the copy): on the
    target semaphore (``wait_target``, the receiving side) or on the source semaphore (the
    sending side), both of this device; a ``device_id`` only describes the copy."""
    (src, _), (ss0, ss1), (dst, _), (ts0, ts1), (d0, d1), *_ = segments(op)
    wait_target = bool(ir.BoolAttr(op.attributes["wait_target"]).value)
    s0, s1 = (ts0, ts1) if wait_target else (ss0, ss1)
    if s1 == s0:
        raise _unsupported(op, f"a DMA wait without its {'target' if wait_target else 'source'}"
                           " semaphore")
    state = _remote(c, op, "waits on remote DMAs") if d1 > d0 else _state(c)

    def run(*xs: Any) -> None:
        moved = xs[dst] if wait_target else xs[src]
        _take(state, op, xs[s0], moved.size * moved.dtype.itemsize)
    return run


def _sem_signal(c: Compiler, op: ir.Operation) -> _Fn:
    (sem, _), (amount, _), (d0, d1), *_ = segments(op)
    state = _remote(c, op, "signals to another device's semaphore") if d1 > d0 \
        else _state(c)

    def run(*xs: Any) -> None:
        target = xs[sem]
        if d1 > d0:
            assert state.network is not None
            target = state.network.remote(state, op, target, xs[d0])
        target[...] += int(xs[amount])
    return run


def _sem_wait(c: Compiler, op: ir.Operation) -> _Fn:
    state = _state(c)
    return lambda sem, amount: _take(state, op, sem, int(amount))


def _sem_read(c: Compiler, op: ir.Operation) -> _Fn:
    return lambda sem: np.asarray(int(sem), np.int32)


def _registered(rule: Rule) -> Rule:
    """An allocating operation's rule whose buffers other devices can reach (keyed by the
    operation's place in the compile order, the same on every device)."""
    def wrapped(c: Compiler, op: ir.Operation) -> _Fn:
        state = _state(c)
        fn = rule(c, op)
        if state.network is None:
            return fn
        key = ("op", state.allocations)
        state.allocations += 1

        def run(*xs: Any) -> Any:
            buffer = fn(*xs)
            state.register(key, buffer)
            return buffer
        return run
    return wrapped


def _sem_alloc(c: Compiler, op: ir.Operation) -> _Fn:
    t = op.results[0].type
    return lambda: allocate(t)


def _region(c: Compiler, op: ir.Operation) -> _Fn:
    body = c.region(op.regions[0])
    n = len(op.results)

    def run() -> Any:
        out = body()
        return None if n == 0 else out[0] if n == 1 else tuple(out)
    return run


def _iteration_bound(c: Compiler, op: ir.Operation) -> _Fn:
    state = _state(c)
    dim = _int(op, "dim")
    return lambda: np.asarray(state.bounds[dim], np.int32)


def _device_id(c: Compiler, op: ir.Operation) -> _Fn:
    state = _state(c)
    if state.device is None:
        raise _unsupported(op, "device ids outside shard_map")
    device = np.asarray(state.device, np.int32)
    return lambda: device


def _sem_barrier(c: Compiler, op: ir.Operation) -> _Fn:
    state = _remote(c, op, "the barrier semaphore")
    return lambda: state.barrier


def _multi_device(c: Compiler, op: ir.Operation) -> _Fn:
    raise _unsupported(op, "barriers of the TensorCore")


_LOG_FIELD = re.compile(r"\$[fsu]?\d+")


def _log(c: Compiler, op: ir.Operation) -> _Fn:
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


def _log_buffer(c: Compiler, op: ir.Operation) -> _Fn:
    """``tpu.log_buffer``: prints its tag, then the buffer's logical ``shape``."""
    tag = ir.StringAttr(op.attributes["tag"]).value
    shape = tuple(ir.DenseI64ArrayAttr(op.attributes["shape"]))

    def run(buf: Any) -> None:
        print(tag + str(np.asarray(buf)[tuple(slice(0, n) for n in shape)]))
    return run


def _core_id(c: Compiler, op: ir.Operation) -> _Fn:
    state = _state(c)
    return lambda: np.asarray(state.core, np.int32)


RULES: dict[str, Rule] = {
    **ARITH_RULES, **ASSERT_RULES, **MEMORY_RULES, **BIT_RULES,
    "tpu.matmul": _matmul, "tpu.conv": _conv, "tpu.matmul_push_rhs": _push_rhs,
    "tpu.matmul_acc_lhs": _acc_lhs, "tpu.matmul_pop": _pop, "tpu.matmul_lhs_fifo": _lhs_fifo,
    "tpu.matmul_pop_fifo": _pop_fifo, "tpu.iota": _iota, "tpu.dynamic_rotate": _rotate,
    "tpu.repeat": _repeat, "tpu.concatenate": _concatenate, "tpu.bitcast": _tpu_bitcast,
    "tpu.reciprocal": _reciprocal, "tpu.reduce_index": _reduce_index,
    "tpu.dynamic_gather": _dynamic_gather, "tpu.reduce_precision": _reduce_precision,
    "tpu.transpose": MEMORY_RULES["vector.transpose"],
    "tpu.fptosi": _float_to_int, "tpu.sitofp": _convert, "tpu.extf": _convert,
    "tpu.truncf": _convert,
    "tpu.prng_set_seed_32": _prng_seed, "tpu.prng_random_bits": _prng_bits,
    "tpu.enqueue_dma": _enqueue_dma, "tpu.wait_dma2": _wait_dma2,
    "tpu.wait_dma": _wait_dma,
    "tpu.sem_signal": _sem_signal, "tpu.sem_wait": _sem_wait, "tpu.sem_read": _sem_read,
    "tpu.sem_alloc": _registered(_sem_alloc), "tpu.region": _region, "tpu.trace": _region,
    "memref.alloca": _registered(MEMORY_RULES["memref.alloca"]),
    "memref.alloc": _registered(MEMORY_RULES["memref.alloc"]),
    "tpu.iteration_bound": _iteration_bound,
    "tpu.device_id": _device_id, "tpu.sem_barrier": _sem_barrier,
    "tpu.barrier": _multi_device, "tpu.core_id": _core_id,
    "tpu.log": _log, "tpu.log_buffer": _log_buffer,
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
        self.bounds = tuple(_ints(params["window_bounds"]))
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
               extra_rules: Mapping[str, Rule] | None = None,
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
             extra_rules: Mapping[str, Rule], backend: str,
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
    semantics = [_enum(s) for s in ir.ArrayAttr(attrs["dimension_semantics"])] \
        if "dimension_semantics" in attrs else []
    n_prefetch = _int(fn, "scalar_prefetch", 0)
    n_scratch = _int(fn, "scratch_operands", 0)
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
