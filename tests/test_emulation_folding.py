"""The emulator's ``arith`` and ``math`` rules against MLIR's own constant folding.

Every case is a function of constants: ``%r = <op> %a, %b`` once over a vector of all the
operand values and once per element as scalars. The ``canonicalize`` pass folds what MLIR can
fold; each result that became an ``arith.constant`` must equal what the emulator computes on the
unfolded module. Float results are read through an ``arith.bitcast`` to the integer of their
width, so both sides are compared as bits (NaN payloads aside). MLIR folds the transcendental
``math`` operations with the host's libm (``sinf``, ``sin``, ...), numpy with its own kernels, so
those get the few ulps named in :data:`ULPS`; everything else must agree exactly.

Results MLIR leaves unfolded (division by zero, shifts by the width or more, out of range
conversions: undefined there) are counted, not compared. The tests check that every rule folds
somewhere (or says in :data:`NOT_FOLDED` why not) and that every ``arith``/``math`` operation of
the dialect has a rule or a reason in :data:`NOT_EMULATED`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from jaxlib.mlir import ir, passmanager
from jaxlib.mlir._mlir_libs import _jax_mlir_ext
from jaxlib.mlir.dialects import arith as arith_dialect
from jaxlib.mlir.dialects import math as math_dialect

from pallas_core.emulation import Compiler, types
from pallas_core.emulation.arith import RULES
from pallas_core.errors import PallasError

INTS = ["i1", "i8", "i16", "i32", "i64", "index"]
FLOATS = ["f16", "bf16", "f32", "f64"]
F8 = ["f8E4M3FN", "f8E5M2", "f8E4M3FNUZ", "f8E5M2FNUZ", "f8E4M3B11FNUZ", "f8E4M3", "f8E3M4"]
DTYPES: dict[str, np.dtype] = {name: np.dtype(t) for name, t in {
    "i1": np.bool_, "i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64,
    "index": np.int64, "f16": np.float16, "bf16": ml_dtypes.bfloat16, "f32": np.float32,
    "f64": np.float64, "f8E4M3FN": ml_dtypes.float8_e4m3fn, "f8E5M2": ml_dtypes.float8_e5m2,
    "f8E4M3FNUZ": ml_dtypes.float8_e4m3fnuz, "f8E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
    "f8E4M3B11FNUZ": ml_dtypes.float8_e4m3b11fnuz, "f8E4M3": ml_dtypes.float8_e4m3,
    "f8E3M4": ml_dtypes.float8_e3m4}.items()}
SEED = 20261124

_TRANSCENDENTAL = ["sqrt", "rsqrt", "cbrt", "exp", "exp2", "expm1", "log", "log2", "log10",
                   "log1p", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh",
                   "asinh", "acosh", "atanh", "erf", "erfc"]
ULPS: dict[str, int] = {
    **{f"math.{n}": 1 for n in [*_TRANSCENDENTAL, "atan2", "powf", "fpowi", "sincos"]},
    "math.cbrt": 2, "math.sinh": 2, "math.tanh": 2, "math.sqrt": 0,
    # jaxlib 0.11's MLIR folds x ** n by repeated squaring in the float type, rounding at each
    # product (up to 3 ulps apart on the exponents here; 0.10's agreed within 1).
    "math.fpowi": 4,
}
"""Allowed distance from MLIR's folded value in units in the last place (0 where absent): the
largest seen between numpy and glibc on the cases here, at least 1 for a function that IEEE 754
does not require to be correctly rounded. Only f32 and f64 fold for these."""


# -- operand values -------------------------------------------------------------------------

def _int_edges(t: str) -> list[int]:
    if t == "i1":
        return [0, -1]
    info = np.iinfo(DTYPES[t])
    return [0, 1, -1, int(info.min), int(info.max), int(info.min) + 1, int(info.max) - 1]


def _float_edges(t: str) -> list[float]:
    d = DTYPES[t]
    info = ml_dtypes.finfo(d)
    edges = [0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 1.5, float(info.max), -float(info.max),
             float(info.smallest_subnormal), -float(info.smallest_subnormal),
             float(info.smallest_normal), 3 * float(info.smallest_subnormal),
             0.5 - 2.0 ** -(info.nmant + 2), -(1.5 - 2.0 ** -info.nmant),
             float("inf"), float("-inf"), float("nan")]
    return edges


def _cast_to(values: Sequence[float], t: str) -> np.ndarray:
    """Values rounded into ``t``; with ml_dtypes, those it cannot hold become NaN or +-max."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.array(values, np.float64).astype(DTYPES[t])


def _random(t: str, rng: np.random.Generator, n: int, kind: str = "") -> np.ndarray:
    d = DTYPES[t]
    if t == "i1":
        return rng.integers(0, 2, n).astype(np.bool_)
    if d.kind == "i":
        if kind == "shift":
            return rng.integers(0, 8 * d.itemsize, n).astype(d)
        if kind == "exp":
            return rng.integers(-3, 12, n).astype(d)
        info = np.iinfo(d)
        small = rng.integers(-300, 300, n // 2)
        big = rng.integers(info.min, info.max, n - n // 2, dtype=d, endpoint=True)
        return np.concatenate([small.astype(d), big])
    scale = rng.choice([1.0, 10.0, 1e-3, 300.0], n)
    return _cast_to(rng.standard_normal(n) * scale, t)


def _ints(values: Sequence[int], t: str) -> np.ndarray:
    if t == "i1":
        return np.array([v & 1 for v in values], np.bool_)
    return np.array(values, np.int64).astype(DTYPES[t])


def unary_values(t: str, rng: np.random.Generator, kind: str = "") -> list[np.ndarray]:
    """Edge values of ``t`` and random ones."""
    if DTYPES[t].kind in "bi":
        return [np.concatenate([_ints(_int_edges(t), t), _random(t, rng, 16, kind)])]
    return [np.concatenate([_cast_to(_float_edges(t), t), _random(t, rng, 16)])]


def binary_values(t: str, rng: np.random.Generator, kind: str = "",
                  t2: str | None = None) -> list[np.ndarray]:
    """All pairs of a few edge values, then random pairs (``kind`` shapes the second)."""
    t2 = t2 or t
    if DTYPES[t].kind in "bi":
        edges = _int_edges(t)[:5]
        a, b = zip(*itertools.product(edges, _int_edges(t2)[:5]), strict=True)
        head = [_ints(a, t), _ints(b, t2)]
    else:
        edges = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.0,
                 float(ml_dtypes.finfo(DTYPES[t]).smallest_subnormal)]
        a, b = zip(*itertools.product(edges, edges), strict=True)
        if DTYPES[t2].kind in "bi":
            b = tuple(int(i) % 7 - 3 for i in range(len(a)))
            head = [_cast_to(a, t), _ints(b, t2)]
        else:
            head = [_cast_to(a, t), _cast_to(b, t2)]
    n = 24
    tail = [_random(t, rng, n), _random(t2, rng, n, kind)]
    return [np.concatenate([h, r]) for h, r in zip(head, tail, strict=True)]


def cast_values(src: str, dst: str, rng: np.random.Generator) -> list[np.ndarray]:
    """Values of ``src`` for a conversion to ``dst``: edges, random values in ``dst``'s range,
    and values whose conversion rounds twice if done through a wider intermediate type."""
    (values,) = unary_values(src, rng)
    d, s = DTYPES[dst], DTYPES[src]
    if _is_float(src):
        extra: list[float] = []
        if d.kind in "bi":
            width = 1 if dst == "i1" else 8 * d.itemsize
            extra = [*(rng.uniform(-1, 1, 12) * 2.0 ** width), 2.0 ** (width - 1),
                     -(2.0 ** (width - 1)), 255.5]
        else:
            p = ml_dtypes.finfo(d).nmant
            mid = 1 + 2.0 ** -(p + 1)
            extra = [mid, mid + 2.0 ** -30, mid - 2.0 ** -30, -(mid + 2.0 ** -45),
                     1 + 3 * 2.0 ** -(p + 1) + 2.0 ** -40]
        return [np.concatenate([values, _cast_to(extra, src)])]
    if _is_float(dst):
        width = 1 if src == "i1" else 8 * s.itemsize
        p = ml_dtypes.finfo(d).nmant
        extra_i = []
        if width > p + 4:
            for top in (width - 2, width - 1):
                extra_i += [2 ** top + 2 ** (top - p - 1) + 1, 2 ** top + 2 ** (top - p - 1),
                            -(2 ** top + 2 ** (top - p - 1) + 1)]
        wrapped = [(v + 2 ** (width - 1)) % 2 ** width - 2 ** (width - 1) for v in extra_i]
        return [np.concatenate([values, _ints(wrapped, src)])]
    return [values]


# -- modules --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    """One operation on operands of element types ``operands`` giving ``results``."""

    op: str
    operands: tuple[str, ...]
    results: tuple[str, ...]
    attrs: str = ""
    label: str = ""

    def name(self) -> str:
        types = ",".join(self.operands) + "->" + ",".join(self.results)
        return f"{self.op}{'[' + self.label + ']' if self.label else ''}({types})"


def _is_float(t: str) -> bool:
    return DTYPES[t].kind not in "bi"


def _width(t: str) -> int:
    return 1 if t == "i1" else 8 * DTYPES[t].itemsize


def _literal(v: object, t: str) -> str:
    if t == "i1":
        return "true" if v else "false"
    if not _is_float(t):
        return str(int(v))  # type: ignore[call-overload]
    bits = int(np.array(v, DTYPES[t]).view(f"u{DTYPES[t].itemsize}"))
    return f"0x{bits:0{2 * DTYPES[t].itemsize}X}"


def _vtype(t: str, n: int | None) -> str:
    return f"vector<{n}x{t}>" if n else t


def module_text(case: Case, values: Sequence[np.ndarray]) -> str:
    """``@f`` returning ``case.op`` over all values as one vector, then over each element."""
    n = len(values[0])
    lines: list[str] = []
    returned: list[tuple[str, str]] = []
    attrs = f" <{{{case.attrs}}}>" if case.attrs else ""

    def emit(tag: str, operand_text: list[str], size: int | None) -> None:
        names = []
        for j, (text, t) in enumerate(zip(operand_text, case.operands, strict=True)):
            typed = "" if t == "i1" and not size else f" : {_vtype(t, size)}"
            lines.append(f"%{tag}a{j} = arith.constant {text}{typed}")
            names.append(f"%{tag}a{j}")
        ins = ", ".join(_vtype(t, size) for t in case.operands)
        outs = ", ".join(_vtype(t, size) for t in case.results)
        lines.append(f'%{tag}r:{len(case.results)} = "{case.op}"({", ".join(names)}){attrs} '
                     f": ({ins}) -> ({outs})")
        for k, t in enumerate(case.results):
            value = f"%{tag}r#{k}"
            if _is_float(t):
                lines.append(f"%{tag}b{k} = arith.bitcast {value} : {_vtype(t, size)} to "
                             f"{_vtype(f'i{_width(t)}', size)}")
                value = f"%{tag}b{k}"
            returned.append((value, _vtype(t if not _is_float(t) else f"i{_width(t)}", size)))

    emit("v", ["dense<[" + ", ".join(_literal(x, t) for x in v) + "]>"
               for v, t in zip(values, case.operands, strict=True)], n)
    for i in range(n):
        emit(f"s{i}", [_literal(v[i], t) for v, t in zip(values, case.operands, strict=True)],
             None)
    types = ", ".join(t for _, t in returned)
    body = "\n    ".join(lines)
    ret = ", ".join(v for v, _ in returned)
    return (f"func.func @f() -> ({types}) {{\n    {body}\n    return {ret} : {types}\n}}")


@functools.cache
def _context() -> ir.Context:
    ctx = ir.Context()
    registry = ir.DialectRegistry()
    _jax_mlir_ext.register_dialects(registry)
    ctx.append_dialect_registry(registry)
    ctx.load_all_available_dialects()
    return ctx


def _bits(x: object, width: int) -> np.ndarray:
    """Integers (Python, numpy signed or bool) as the unsigned values of their low ``width``
    bits, in uint64."""
    mask = (1 << width) - 1
    arr = np.asarray(x)
    if arr.dtype == object or arr.dtype.kind not in "biu":
        return np.array([int(v) & mask for v in arr.ravel().tolist()], np.uint64)
    return (arr.astype(np.int64).view(np.uint64) & np.uint64(mask)).ravel()


def _folded_bits(value: ir.Value, width: int) -> np.ndarray | None:
    """The bits of ``value`` if canonicalization made it a constant, else None."""
    owner = value.owner
    if not isinstance(owner, ir.OpView | ir.Operation) or owner.name != "arith.constant":
        return None
    attr = owner.attributes["value"]
    if isinstance(attr, ir.DenseElementsAttr):
        dense = ir.DenseElementsAttr(attr)
        if dense.is_splat:
            one = _folded_scalar(dense.get_splat_value())
            return np.full(len(dense), one & ((1 << width) - 1), np.uint64)
        return _bits(np.array(ir.DenseIntElementsAttr(attr)), width)
    return _bits([_folded_scalar(attr)], width)


def _folded_scalar(attr: ir.Attribute) -> int:
    if isinstance(attr, ir.BoolAttr):
        return int(ir.BoolAttr(attr).value)
    return int(ir.IntegerAttr(attr).value)


@dataclasses.dataclass
class Outcome:
    """What folding and emulating one case gave."""

    folded: int = 0
    unfolded: int = 0
    skipped: int = 0
    vector_folded: bool = False
    mismatches: list[str] = dataclasses.field(default_factory=list)


def _ordered(bits: np.ndarray, width: int) -> list[int]:
    """Float bit patterns as integers ordered like the floats (for ulp distances)."""
    sign = 1 << (width - 1)
    return [-(b & (sign - 1)) if b & sign else b for b in bits.tolist()]


def _agree(mlir: np.ndarray, ours: np.ndarray, t: str, ulps: int) -> np.ndarray:
    if not _is_float(t):
        return np.asarray(mlir == ours)
    d = DTYPES[t]
    udt = np.dtype(f"u{d.itemsize}")
    with np.errstate(invalid="ignore"):
        fm = mlir.astype(udt).view(d).astype(np.float64)
        fo = ours.astype(udt).view(d).astype(np.float64)
    both_nan = np.isnan(fm) & np.isnan(fo)
    w = _width(t)
    dist = np.abs(np.array(_ordered(mlir, w), dtype=object) - np.array(_ordered(ours, w),
                                                                       dtype=object))
    close = (dist <= ulps).astype(np.bool_) & ~np.isnan(fm) & ~np.isnan(fo)
    return both_nan | close


def _fold(text: str, results: Sequence[str]) -> list[np.ndarray | None]:
    """The bits of each result of ``@f`` that ``canonicalize`` made a constant."""
    with _context(), ir.Location.unknown():
        module = ir.Module.parse(text)
        passmanager.PassManager.parse("builtin.module(canonicalize)").run(module.operation)
        func = module.body.operations[0]
        ret = list(func.regions[0].blocks[0].operations)[-1]
        return [_folded_bits(v, _width(t)) for v, t in zip(ret.operands, itertools.cycle(results))]


def _emulate(text: str) -> tuple[object, ...]:
    with _context(), ir.Location.unknown():
        module = ir.Module.parse(text)
        return Compiler(RULES, backend="test", module=module).function("f")()


def run_case(case: Case, values: Sequence[np.ndarray]) -> Outcome:
    """Fold ``case`` with MLIR and emulate it; compare every folded result where MLIR defines
    it (see :func:`excluded`)."""
    text = module_text(case, values)
    k = len(case.results)
    got = _fold(text, case.results)
    emulated = _emulate(text)
    skip = excluded(case, values)
    ulps = ULPS.get(case.op, 0)
    out = Outcome(vector_folded=got[0] is not None)
    for j, (mlir, ours) in enumerate(zip(got, emulated, strict=True)):
        t = case.results[j % k]
        if mlir is None:
            out.unfolded += j >= k
            continue
        ok = _agree(mlir, _bits(ours, _width(t)), t, ulps)
        if j < k:
            bad = np.flatnonzero(~ok & ~skip).tolist()
            if bad:
                out.mismatches.append(f"{case.name()} vector result {j} disagrees at {bad}")
            continue
        i = (j - k) // k
        out.folded += 1
        if skip[i]:
            out.skipped += 1
        elif not ok.all():
            operands = ", ".join(f"{_literal(v[i], ot)}:{ot}"
                                 for v, ot in zip(values, case.operands, strict=True))
            out.mismatches.append(f"{case.name()} result {j % k} on ({operands}): MLIR "
                                  f"{_show(mlir, t)}, emulator {_show(_bits(ours, _width(t)), t)}")
    return out


def _show(bits: np.ndarray, t: str) -> str:
    if not _is_float(t):
        return str(bits.tolist())
    d = DTYPES[t]
    return str(bits.astype(f"u{d.itemsize}").view(d).tolist()) + f" ({bits.tolist()})"


# -- the cases of each operation ------------------------------------------------------------

_INT_BINARY = ["addi", "subi", "muli", "divsi", "remsi", "divui", "remui", "floordivsi",
               "ceildivsi", "ceildivui", "andi", "ori", "xori", "maxsi", "minsi", "maxui",
               "minui"]
_CMPI = ["eq", "ne", "slt", "sle", "sgt", "sge", "ult", "ule", "ugt", "uge"]
_CMPF = ["false", "oeq", "ogt", "oge", "olt", "ole", "one", "ord", "ueq", "ugt", "uge", "ult",
         "ule", "une", "uno", "true"]
_FLOAT_BINARY = ["arith.addf", "arith.subf", "arith.mulf", "arith.divf", "arith.remf",
                 "arith.maximumf", "arith.minimumf", "arith.maxnumf", "arith.minnumf",
                 "math.powf", "math.atan2", "math.copysign",
                 # IEEE 754-2019's maximumNumber/minimumNumber, in the MLIR of JAX 0.12 on.
                 *(op for op in ("arith.maximumnumf", "arith.minimumnumf") if op in RULES)]
_FLOAT_UNARY = ["arith.negf", "math.absf", "math.ceil", "math.floor", "math.trunc",
                "math.roundeven", "math.round", "arith.flush_denormals",
                *(f"math.{n}" for n in _TRANSCENDENTAL)]
_FLOAT_TESTS = ["math.isnan", "math.isinf", "math.isfinite", "math.isnormal"]
_ALL_FLOATS = FLOATS + F8
_PLAIN_INTS = INTS[:-1]


def _casts(op: str) -> list[tuple[str, str]]:
    """The (source, result) element types ``op`` is checked on."""
    ints = _PLAIN_INTS

    def narrower(a: str, b: str) -> bool:
        return _width(a) < _width(b)

    if op in ("arith.extsi", "arith.extui"):
        return [(a, b) for a in ints for b in ints if narrower(a, b)]
    if op == "arith.trunci":
        return [(b, a) for a in ints for b in ints if narrower(a, b)]
    if op in ("arith.sitofp", "arith.uitofp"):
        return [(a, b) for a in ints for b in _ALL_FLOATS]
    if op in ("arith.fptosi", "arith.fptoui"):
        return [(a, b) for a in _ALL_FLOATS for b in ints]
    if op == "arith.extf":
        return [(a, b) for a in _ALL_FLOATS for b in FLOATS if narrower(a, b)]
    if op == "arith.truncf":
        return [(b, a) for a in _ALL_FLOATS for b in FLOATS if narrower(a, b)]
    if op == "arith.bitcast":
        return [(a, b) for a in INTS[1:-1] + _ALL_FLOATS for b in INTS[1:-1] + _ALL_FLOATS
                if a != b and _width(a) == _width(b)]
    if op == "arith.convertf":
        return [(a, b) for a in _ALL_FLOATS for b in _ALL_FLOATS
                if a != b and _width(a) == _width(b)]
    if op in ("arith.index_cast", "arith.index_castui"):
        return [(a, "index") for a in ints] + [("index", a) for a in ints]
    return []


def cases(op: str) -> list[tuple[Case, list[np.ndarray]]]:
    """The cases ``op`` is checked on, with their operand values."""
    rng = np.random.default_rng([SEED, *op.encode()])
    short = op.split(".", 1)[1]
    out: list[tuple[Case, list[np.ndarray]]] = []
    if op.startswith("arith.") and short in [*_INT_BINARY, "shli", "shrui", "shrsi"]:
        for t in INTS:
            kind = "shift" if short.startswith("sh") else ""
            out.append((Case(op, (t, t), (t,)), binary_values(t, rng, kind)))
    elif op in ("arith.addui_extended", "arith.subui_extended"):
        out += [(Case(op, (t, t), (t, "i1")), binary_values(t, rng)) for t in INTS]
    elif op in ("arith.mulsi_extended", "arith.mului_extended"):
        out += [(Case(op, (t, t), (t, t)), binary_values(t, rng)) for t in INTS]
    elif op == "math.sincos":
        out += [(Case(op, (t,), (t, t)), unary_values(t, rng)) for t in _ALL_FLOATS]
    elif op == "math.clampf":
        for t in _ALL_FLOATS:
            x, lo = binary_values(t, rng)
            with np.errstate(invalid="ignore", over="ignore"):
                hi = np.where(lo > 0, lo, _random(t, rng, len(lo)) ** 2 + lo)
            out.append((Case(op, (t, t, t), (t,)), [x, lo, hi.astype(DTYPES[t])]))
    elif op == "math.ipowi":
        out += [(Case(op, (t, t), (t,)), binary_values(t, rng, "exp")) for t in _PLAIN_INTS]
    elif op in ("math.absi", "math.ctlz", "math.cttz", "math.ctpop"):
        out += [(Case(op, (t,), (t,)), unary_values(t, rng)) for t in _PLAIN_INTS]
    elif op == "arith.cmpi":
        for t in INTS:
            values = binary_values(t, rng)
            out += [(Case(op, (t, t), ("i1",), f"predicate = {p} : i64", name), values)
                    for p, name in enumerate(_CMPI)]
    elif op == "arith.cmpf":
        for t in _ALL_FLOATS:
            values = binary_values(t, rng)
            out += [(Case(op, (t, t), ("i1",), f"predicate = {p} : i64", name), values)
                    for p, name in enumerate(_CMPF)]
    elif op in _FLOAT_BINARY:
        out += [(Case(op, (t, t), (t,)), binary_values(t, rng)) for t in _ALL_FLOATS]
    elif op in _FLOAT_UNARY:
        out += [(Case(op, (t,), (t,)), unary_values(t, rng)) for t in _ALL_FLOATS]
    elif op in _FLOAT_TESTS:
        out += [(Case(op, (t,), ("i1",)), unary_values(t, rng)) for t in _ALL_FLOATS]
    elif op == "math.fma":
        for t in _ALL_FLOATS:
            a, b = binary_values(t, rng)
            out.append((Case(op, (t, t, t), (t,)), [a, b, rng.permutation(a)]))
    elif op == "math.fpowi":
        out += [(Case(op, (t, e), (t,)), binary_values(t, rng, "exp", e))
                for t in _ALL_FLOATS for e in ("i32", "i64")]
    elif op == "arith.select":
        for t in INTS + _ALL_FLOATS:
            a, b = binary_values(t, rng)
            cond = rng.integers(0, 2, len(a)).astype(np.bool_)
            out.append((Case(op, ("i1", t, t), (t,)), [cond, a, b]))
    else:
        out += [(Case(op, (a,), (b,)), cast_values(a, b, rng)) for a, b in _casts(op)]
    return out


def _signed(x: np.ndarray) -> np.ndarray:
    """Integers as Python-range int64 values, ``i1`` read signed (true is -1)."""
    return -x.astype(np.int64) if x.dtype == np.bool_ else x.astype(np.int64)


def _unsigned(x: np.ndarray) -> np.ndarray:
    return x.astype(np.uint64) if x.dtype == np.bool_ else x.view(f"u{x.dtype.itemsize}")


def _float_range_violation(x: np.ndarray, dst: str, is_signed: bool) -> np.ndarray:
    f = np.trunc(x.astype(np.float64))
    w = _width(dst)
    lo, hi = (-(2.0 ** (w - 1)), 2.0 ** (w - 1) - 1) if is_signed else (0.0, 2.0 ** w - 1)
    with np.errstate(invalid="ignore"):
        return ~((f >= lo) & (f <= hi))


MLIR_DIFFERS: dict[tuple[str, str], str] = {
    ("math.atan2", "zeros"): "MLIR's folder gives NaN for atan2(+-0, +-0); C's atan2, "
    "jax.numpy and the emulator give +-0 or +-pi",
    ("math.ceil", "f8E3M4"): "APFloat's roundToIntegral gives NaN on f8E3M4 (its 2**4 rounding "
    "constant overflows the type); the emulator rounds",
    ("math.floor", "f8E3M4"): "as math.ceil", ("math.roundeven", "f8E3M4"): "as math.ceil",
}
"""Folded values the emulator does not follow, and why."""


def excluded(case: Case, values: Sequence[np.ndarray]) -> np.ndarray:
    """Elements whose result MLIR leaves undefined (the emulator's value there is its own
    choice, see :mod:`pallas_core.emulation.arith`) or folds differently (MLIR_DIFFERS)."""
    short = case.op.split(".", 1)[1]
    n = len(values[0])
    if (case.op, case.operands[0]) in MLIR_DIFFERS:
        return np.ones(n, np.bool_)
    if case.op == "math.atan2":
        return (values[0] == 0) & (values[1] == 0)
    if short in ("divsi", "floordivsi", "ceildivsi", "remsi", "divui", "remui", "ceildivui"):
        a, b = _signed(values[0]), _signed(values[1])
        t = case.operands[0]
        lowest = -1 if t == "i1" else int(np.iinfo(DTYPES[t]).min)
        overflow = (a == lowest) & (b == -1) if short.endswith("si") else np.zeros(n, np.bool_)
        return (b == 0) | overflow
    if short in ("shli", "shrui", "shrsi"):
        return _unsigned(values[1]) >= _width(case.operands[0])
    if short in ("fptosi", "fptoui"):
        return _float_range_violation(values[0], case.results[0], short == "fptosi")
    if case.op == "math.ipowi":
        return (values[0] == 0) & (values[1] < 0)
    if case.op == "math.clampf":
        lo, hi = (v.astype(np.float64) for v in values[1:])
        return lo > hi
    return np.zeros(n, np.bool_)


@functools.cache
def outcomes(op: str) -> tuple[tuple[Case, Outcome], ...]:
    """Every case of ``op``, folded and emulated."""
    return tuple((case, run_case(case, values)) for case, values in cases(op))


# -- the tests ------------------------------------------------------------------------------

NOT_FOLDED: dict[str, str] = {
    "math.fma": "MLIR has no folder for math.fma",
    "math.clampf": "MLIR has no folder for math.clampf",
}
"""Rules MLIR's canonicalization folds for no type, and why."""

NOT_EMULATED: dict[str, str] = {
    "arith.scaling_extf": "OCP MX block-scaled conversion (scale rounded to f8E8M0FNU); no "
    "backend here emits it",
    "arith.scaling_truncf": "OCP MX block-scaled conversion to f4E2M1FN/f8 with a scale; no "
    "backend here emits it",
}
"""``arith``/``math`` operations of the dialect without a rule, and why."""

_CHECKED = sorted(op for op in RULES if op != "arith.constant")


@pytest.mark.parametrize("op", _CHECKED)
def test_folded_values_agree(op: str) -> None:
    mismatches = [m for _, outcome in outcomes(op) for m in outcome.mismatches]
    assert not mismatches, "\n".join(mismatches[:20])


@pytest.mark.parametrize("op", _CHECKED)
def test_every_rule_is_checked_by_folding(op: str) -> None:
    results = outcomes(op)
    assert results, f"no cases for {op}"
    folded = [case.name() for case, outcome in results if outcome.folded]
    if op in NOT_FOLDED:
        assert not folded, f"{op} folds now ({folded}): drop it from NOT_FOLDED"
    else:
        assert folded, f"MLIR folds {op} for no case: fix the cases or add it to NOT_FOLDED"


def test_every_dialect_operation_is_emulated_or_listed() -> None:
    names = {cls.OPERATION_NAME for module in (arith_dialect, math_dialect)
             for cls in vars(module).values()
             if isinstance(cls, type) and hasattr(cls, "OPERATION_NAME")}
    assert names - set(RULES) == set(NOT_EMULATED), (
        f"without a rule or a reason: {sorted(names - set(RULES) - set(NOT_EMULATED))}; "
        f"listed but emulated or gone: {sorted(set(NOT_EMULATED) - (names - set(RULES)))}")
    assert set(RULES) <= names


def test_undefined_results_are_the_documented_ones() -> None:
    """Where MLIR leaves a result undefined the emulator gives what arith.py says."""
    text = """func.func @f(%a: vector<4xi8>, %b: vector<4xi8>, %x: vector<4xf32>)
        -> (vector<4xi8>, vector<4xi8>, vector<4xi8>, vector<4xi8>, vector<4xi8>) {
      %d = arith.divsi %a, %b : vector<4xi8>
      %r = arith.remui %a, %b : vector<4xi8>
      %l = arith.shli %a, %b : vector<4xi8>
      %s = arith.shrsi %a, %b : vector<4xi8>
      %i = arith.fptosi %x : vector<4xf32> to vector<4xi8>
      return %d, %r, %l, %s, %i : vector<4xi8>, vector<4xi8>, vector<4xi8>, vector<4xi8>,
        vector<4xi8>
    }"""
    a = np.array([-128, 7, -5, 3], np.int8)
    b = np.array([-1, 0, 8, 9], np.int8)
    x = np.array([np.nan, 1e9, -1e9, -7.9], np.float32)
    with _context(), ir.Location.unknown():
        module = ir.Module.parse(text)
        d, r, sl, sr, i = Compiler(RULES, backend="test", module=module).function("f")(a, b, x)
    np.testing.assert_array_equal(d, [-128, 0, 0, 0])  # MIN / -1 wraps, x / 0 is 0
    np.testing.assert_array_equal(r, [-128, 0, 3, 3])  # x % 0 is 0
    np.testing.assert_array_equal(sl, [0, 7, 0, 0])  # shifts by >= 8 give 0 (all sign bits)
    np.testing.assert_array_equal(sr, [-1, 7, -1, 0])
    np.testing.assert_array_equal(i, [0, 127, -128, -7])  # saturating; NaN is 0


# -- types.py -------------------------------------------------------------------------------

_TYPE_DTYPES = {**DTYPES, "f4E2M1FN": np.dtype(ml_dtypes.float4_e2m1fn),
                "f8E8M0FNU": np.dtype(ml_dtypes.float8_e8m0fnu), "i4": np.dtype(ml_dtypes.int4),
                "i2": np.dtype(ml_dtypes.int2), "ui8": np.dtype(np.uint8),
                "ui16": np.dtype(np.uint16), "ui32": np.dtype(np.uint32),
                "ui64": np.dtype(np.uint64), "ui4": np.dtype(ml_dtypes.uint4)}


def _raw(x: np.ndarray, t: str) -> list[int]:
    """The bit patterns of ``x``, values of ``t``."""
    x = np.asarray(x, DTYPES[t])
    if _is_float(t):
        x = x.view(f"i{x.dtype.itemsize}")
    return _bits(x, _width(t)).tolist()


@pytest.mark.parametrize("name", sorted(_TYPE_DTYPES))
def test_dtype_of(name: str) -> None:
    with _context(), ir.Location.unknown():
        t = ir.Type.parse(name)
        assert types.dtype_of(t) == _TYPE_DTYPES[name]
        assert types.dtype_of(ir.VectorType.get([2, 3], t)) == _TYPE_DTYPES[name]
        assert types.shape_of(ir.VectorType.get([2, 3], t)) == (2, 3)
        assert types.shape_of(t) == ()


def test_dtype_of_rejects_what_numpy_cannot_hold() -> None:
    with _context(), ir.Location.unknown():
        for name in ("i3", "i128", "tf32", "complex<f32>"):
            with pytest.raises(PallasError, match="no numpy type"):
                types.dtype_of(ir.Type.parse(name))


def _attribute(text: str) -> tuple[ir.Attribute, ir.Type]:
    attr = ir.Attribute.parse(text)
    if isinstance(attr, ir.BoolAttr):
        return attr, ir.IntegerType.get_signless(1)
    for kind in (ir.DenseElementsAttr, ir.FloatAttr, ir.IntegerAttr):
        if isinstance(attr, kind):
            return attr, kind(attr).type
    raise AssertionError(text)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_attribute_array_dense_and_splat(name: str) -> None:
    """Dense constants of every type, written as a list, as a hex blob, and as a splat."""
    rng = np.random.default_rng([SEED, *name.encode()])
    (values,) = unary_values(name, rng)
    values = values[6:18] if _is_float(name) else values[-12:] if name == "i1" else values[:12]
    d = DTYPES[name]
    with _context(), ir.Location.unknown():
        vtype = f"vector<3x4x{name}>"
        rows = [", ".join(_literal(v, name) for v in row) for row in values.reshape(3, 4)]
        listed = "[" + ", ".join(f"[{row}]" for row in rows) + "]"
        forms = [f"dense<{listed}> : {vtype}"]
        if name != "i1":
            forms.append(f'dense<"0x{values.astype(d).tobytes().hex().upper()}"> : {vtype}')
        for text in forms:
            attr, t = _attribute(text)
            got = types.attribute_array(attr, t)
            assert got.dtype == d and got.shape == (3, 4), text
            assert _raw(got, name) == _raw(values, name), text
        splat, t = _attribute(f"dense<{_literal(values[5], name)}> : {vtype}")
        got = types.attribute_array(splat, t)
        assert got.shape == (3, 4) and got.dtype == d
        assert _raw(got, name) == _raw(values[5:6], name) * 12


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_attribute_array_scalars(name: str) -> None:
    rng = np.random.default_rng([SEED, *name.encode(), 1])
    (values,) = unary_values(name, rng)
    with _context(), ir.Location.unknown():
        for v in values:
            typed = "" if name == "i1" else f" : {name}"
            attr, t = _attribute(_literal(v, name) + typed)
            got = types.attribute_array(attr, t)
            assert got.shape == () and got.dtype == DTYPES[name]
            assert _raw(got, name) == _raw(np.array([v]), name), (name, v)


def _nearest_even(x: float, t: str) -> int:
    """The bits of ``x`` rounded to nearest, ties to even, into ``t`` (within its range),
    computed with exact rationals over all of ``t``'s finite values."""
    d = DTYPES[t]
    udt = np.dtype(f"u{d.itemsize}")
    allbits = np.arange(2 ** (8 * d.itemsize), dtype=np.uint64).astype(udt)
    with np.errstate(invalid="ignore"):
        finite = allbits.view(d).astype(np.float64)
    keep = np.isfinite(finite)
    vals, bits = finite[keep], allbits[keep]
    order = np.argsort(vals, kind="stable")
    vals, bits = vals[order], bits[order]
    hi = int(np.searchsorted(vals, x, side="left"))
    if vals[hi] == x:
        return int(bits[hi])
    lo = hi - 1
    below, above = Fraction(x) - Fraction(vals[lo]), Fraction(vals[hi]) - Fraction(x)
    if below != above:
        return int(bits[lo] if below < above else bits[hi])
    return int(bits[lo] if int(bits[lo]) % 2 == 0 else bits[hi])


@pytest.mark.parametrize("t", ["bf16", "f16", "f8E4M3FN", "f8E5M2"])
def test_truncf_from_f64_rounds_once(t: str) -> None:
    """MLIR folds truncf only where it is exact, so this checks the rounding of the rest
    against exact arithmetic: numpy/ml_dtypes casts from float64 round through float32."""
    rng = np.random.default_rng([SEED, *t.encode(), 2])
    p = ml_dtypes.finfo(DTYPES[t]).nmant
    top = float(ml_dtypes.finfo(DTYPES[t]).max) / 2
    mids = (1 + 2.0 ** -(p + 1)) * 2.0 ** rng.integers(-3, 4, 8)
    x = np.concatenate([mids + mids * 2.0 ** -35, mids - mids * 2.0 ** -35, mids,
                        rng.uniform(-top, top, 40), rng.standard_normal(40)])
    text = (f"func.func @f(%x: vector<{len(x)}xf64>) -> vector<{len(x)}x{t}> {{\n"
            f"  %y = arith.truncf %x : vector<{len(x)}xf64> to vector<{len(x)}x{t}>\n"
            f"  return %y : vector<{len(x)}x{t}>\n}}")
    with _context(), ir.Location.unknown():
        module = ir.Module.parse(text)
        (got,) = Compiler(RULES, backend="test", module=module).function("f")(x)
    assert _raw(got, t) == [_nearest_even(float(v), t) for v in x]
