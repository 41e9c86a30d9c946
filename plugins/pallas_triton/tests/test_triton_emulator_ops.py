"""Triton operations neither lowering emits, run by the emulator from hand-written TTIR.

Each kernel loads 16 elements of its operands, applies the operation under test and stores the
result; the expected values come from numpy written independently of the emulator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import scipy.special

import pallas_core as pl
from pallas_core.emulation.call import EmulatedCall, EmulateOptions

pytest.importorskip("pallas_triton")
from jaxlib.triton import dialect as tt
from pallas_triton import emulator

_TYPES = {np.dtype(np.float32): "f32", np.dtype(np.int32): "i32", np.dtype(np.float16): "f16"}


def _run(body: str, inputs: Sequence[np.ndarray], outputs: Sequence[np.dtype], *,
         extra: str = "", grid: int = 1, checked: bool = True) -> list[np.ndarray]:
    """Runs ``body`` on 16-element operands: ``%x0, %x1, ...`` hold the loaded inputs, ``%i``
    the lane indices (i32); the body defines ``%y0, %y1, ...``, stored to the results."""
    ins = [_TYPES[np.dtype(x.dtype)] for x in inputs]
    outs = [_TYPES[np.dtype(d)] for d in outputs]
    args = [f"%a{k}: !tt.ptr<{t}>" for k, t in enumerate(ins + outs)]
    lines = ["%i = tt.make_range {end = 16 : i32, start = 0 : i32} : tensor<16xi32>"]
    for k, t in enumerate(ins + outs):
        lines += [f"%s{k} = tt.splat %a{k} : !tt.ptr<{t}> -> tensor<16x!tt.ptr<{t}>>",
                  f"%p{k} = tt.addptr %s{k}, %i : tensor<16x!tt.ptr<{t}>>, tensor<16xi32>"]
    lines += [f"%x{k} = tt.load %p{k} : tensor<16x!tt.ptr<{t}>>" for k, t in enumerate(ins)]
    lines += body.strip().splitlines()
    lines += [f"tt.store %p{len(ins) + k}, %y{k} : tensor<16x!tt.ptr<{t}>>"
              for k, t in enumerate(outs)]
    text = ("module {\n" + extra + f"tt.func public @k({', '.join(args)}) {{\n"
            + "\n".join(lines) + "\ntt.return\n}\n}\n")
    call = EmulatedCall(
        "__gpu$xla.gpu.triton", "", {"ir": text.encode(), "name": "k", "grid_x": grid,
                                     "grid_y": 1, "grid_z": 1, "num_warps": 4},
        list(inputs), [((16,), np.dtype(d)) for d in outputs], [],
        EmulateOptions("triton", checked=checked), name="k")
    return emulator.emulate(call)


def _extern(out: str, arg: str, symbol: str, types: str) -> str:
    attrs = f'libname = "libdevice", libpath = "", pure = true, symbol = "{symbol}"'
    return f"{out} = tt.extern_elementwise {arg} {{{attrs}}} : {types}"


def _f32(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(16).astype(np.float32)


def _i32(lo: int, hi: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(lo, hi, 16).astype(np.int32)


def test_scan_reverse_and_reduce_of_two_operands() -> None:
    x = _f32()
    body = """
%y0 = "tt.scan"(%x0) <{axis = 0 : i32, reverse = true}> ({
^bb0(%l: f32, %r: f32):
  %s = arith.addf %l, %r : f32
  tt.scan.return %s : f32
}) : (tensor<16xf32>) -> tensor<16xf32>
%m:2 = "tt.reduce"(%x0, %i) <{axis = 0 : i32}> ({
^bb0(%v0: f32, %i0: i32, %v1: f32, %i1: i32):
  %gt = arith.cmpf ogt, %v1, %v0 : f32
  %v = arith.select %gt, %v1, %v0 : f32
  %j = arith.select %gt, %i1, %i0 : i32
  tt.reduce.return %v, %j : f32, i32
}) : (tensor<16xf32>, tensor<16xi32>) -> (f32, i32)
%y1 = tt.splat %m#1 : i32 -> tensor<16xi32>
"""
    scan, arg = _run(body, [x], [np.float32, np.int32])
    np.testing.assert_allclose(scan, np.cumsum(x[::-1])[::-1], rtol=1e-6)
    np.testing.assert_array_equal(arg, np.full(16, np.argmax(x)))


def test_histogram_mulhiui_clampf_and_fp_to_fp_toward_zero() -> None:
    x, bins = _f32(), _i32(-2, 10)
    a, b = _i32(-2**31, 2**31 - 1, 1), _i32(-2**31, 2**31 - 1, 2)
    body = """
%h = tt.histogram %x1 : tensor<16xi32> -> tensor<16xi32>
%y0 = arith.addi %h, %h : tensor<16xi32>
%y1 = tt.mulhiui %x2, %x3 : tensor<16xi32>
%lo = arith.constant dense<-0.5> : tensor<16xf32>
%hi = arith.constant dense<0.75> : tensor<16xf32>
%y2 = tt.clampf %x0, %lo, %hi, propagateNan = none : tensor<16xf32>
%y3 = tt.fp_to_fp %x0, rounding = rtz : tensor<16xf32> -> tensor<16xf16>
"""
    hist, hi, clamped, half = _run(body, [x, bins, a, b], [np.int32, np.int32, np.float32,
                                                             np.float16])
    inside = bins[(bins >= 0) & (bins < 16)]
    np.testing.assert_array_equal(hist, 2 * np.bincount(inside, minlength=16))
    wide = a.view(np.uint32).astype(np.uint64) * b.view(np.uint32).astype(np.uint64)
    np.testing.assert_array_equal(hi, (wide >> np.uint64(32)).astype(np.uint32).view(np.int32))
    np.testing.assert_array_equal(clamped, np.clip(x, -0.5, 0.75))
    # Toward zero: never larger in magnitude than x, and within one float16 ulp of it.
    h = half.astype(np.float64)
    assert np.all(np.abs(h) <= np.abs(x)) and np.all(np.sign(h) * np.sign(x) >= 0)
    np.testing.assert_allclose(h, x, rtol=2**-10)


# jaxlib 0.12's Triton dialect no longer has tt.cat (JAX's lowering never emitted it).
HAS_CAT = hasattr(tt, "CatOp")


@pytest.mark.skipif(not HAS_CAT, reason="the installed jaxlib's Triton dialect has no tt.cat")
def test_join_split_cat_gather_and_trans() -> None:
    x, z, idx = _f32(), _f32(1), _i32(0, 16)
    body = """
%j = tt.join %x0, %x1 : tensor<16xf32> -> tensor<16x2xf32>
%t = tt.trans %j {order = array<i32: 1, 0>} : tensor<16x2xf32> -> tensor<2x16xf32>
%r = tt.reshape %t : tensor<2x16xf32> -> tensor<32xf32>
%h0, %h1 = tt.split %j : tensor<16x2xf32> -> tensor<16xf32>
%y0 = arith.subf %h1, %h0 : tensor<16xf32>
%c = tt.cat %x0, %x1 : tensor<16xf32> -> tensor<32xf32>
%d = arith.subf %c, %r : tensor<32xf32>
%z1 = "tt.reduce"(%d) <{axis = 0 : i32}> ({
^bb0(%l: f32, %q: f32):
  %m = arith.maxnumf %l, %q : f32
  tt.reduce.return %m : f32
}) : (tensor<32xf32>) -> f32
%y1 = tt.splat %z1 : f32 -> tensor<16xf32>
%y2 = tt.gather %x0[%x2] {axis = 0 : i32} : (tensor<16xf32>, tensor<16xi32>) -> tensor<16xf32>
"""
    diff, same, gathered = _run(body, [x, z, idx], [np.float32] * 3)
    np.testing.assert_array_equal(diff, z - x)
    np.testing.assert_array_equal(same, np.zeros(16))  # cat([x, z]) == trans(join(x, z))
    np.testing.assert_array_equal(gathered, x[idx])


def test_join_split_gather_and_trans() -> None:
    """As above without tt.cat, for dialects that lack it."""
    x, z, idx = _f32(), _f32(1), _i32(0, 16)
    body = """
%j = tt.join %x0, %x1 : tensor<16xf32> -> tensor<16x2xf32>
%t = tt.trans %j {order = array<i32: 1, 0>} : tensor<16x2xf32> -> tensor<2x16xf32>
%h0, %h1 = tt.split %j : tensor<16x2xf32> -> tensor<16xf32>
%y0 = arith.subf %h1, %h0 : tensor<16xf32>
%b = tt.trans %t {order = array<i32: 1, 0>} : tensor<2x16xf32> -> tensor<16x2xf32>
%g0, %g1 = tt.split %b : tensor<16x2xf32> -> tensor<16xf32>
%y1 = arith.subf %g1, %x1 : tensor<16xf32>
%y2 = tt.gather %x0[%x2] {axis = 0 : i32} : (tensor<16xf32>, tensor<16xi32>) -> tensor<16xf32>
"""
    diff, back, gathered = _run(body, [x, z, idx], [np.float32] * 3)
    np.testing.assert_array_equal(diff, z - x)
    np.testing.assert_array_equal(back, np.zeros(16))  # trans twice gives the join back
    np.testing.assert_array_equal(gathered, x[idx])


def test_libdevice_by_symbol_and_precise_ops() -> None:
    x, n = _f32(), _i32(-2**31, 2**31 - 1)
    f32, i32 = "(tensor<16xf32>) -> tensor<16xf32>", "(tensor<16xi32>) -> tensor<16xi32>"
    body = "\n".join([_extern("%y0", "%x0", "__nv_erff", f32),
                      _extern("%y1", "%x1", "__nv_clz", i32),
                      _extern("%y2", "%x1", "__nv_popc", i32)]) + """
%ab = math.absf %x0 : tensor<16xf32>
%sq = tt.precise_sqrt %ab : tensor<16xf32>
%y3 = tt.precise_divf %sq, %x0 : tensor<16xf32>
"""
    erf, clz, popc, ratio = _run(body, [x, n], [np.float32, np.int32, np.int32, np.float32])
    np.testing.assert_allclose(erf, scipy.special.erf(x), rtol=1e-6)
    bits = [format(int(v), "032b") for v in n.view(np.uint32)]
    np.testing.assert_array_equal(clz, [len(s) - len(s.lstrip("0")) for s in bits])
    np.testing.assert_array_equal(popc, [s.count("1") for s in bits])
    np.testing.assert_allclose(ratio, np.sqrt(np.abs(x)) / x, rtol=1e-6)


def test_unknown_external_function_is_refused_by_name() -> None:
    body = _extern("%y0", "%x0", "my_fn", "(tensor<16xf32>) -> tensor<16xf32>")
    with pytest.raises(pl.UnsupportedError, match=r"`my_fn`.*LIBDEVICE"):
        _run(body, [_f32()], [np.float32])


def test_call_pointer_integers_and_num_programs() -> None:
    extra = """
tt.func private @twice(%v: tensor<16xf32>) -> tensor<16xf32> {
  %r = arith.addf %v, %v : tensor<16xf32>
  tt.return %r : tensor<16xf32>
}
"""
    x = _f32()
    body = """
%t = tt.call @twice(%x0) : (tensor<16xf32>) -> tensor<16xf32>
%np = tt.get_num_programs x : i32
%n = arith.sitofp %np : i32 to f32
%ns = tt.splat %n : f32 -> tensor<16xf32>
%y0 = arith.addf %t, %ns : tensor<16xf32>
%addr = tt.ptr_to_int %a0 : !tt.ptr<f32> -> i64
%c32 = arith.constant 32 : i64
%moved = arith.addi %addr, %c32 : i64
%q = tt.int_to_ptr %moved : i64 -> !tt.ptr<f32>
%qv = tt.load %q : !tt.ptr<f32>
%y1 = tt.splat %qv : f32 -> tensor<16xf32>
"""
    with pytest.raises(emulator.RaceError, match=r"program \(1, 0, 0\).*program \(0, 0, 0\)"):
        _run(body, [x], [np.float32, np.float32], extra=extra, grid=3)  # all store one block
    twice, picked = _run(body, [x], [np.float32, np.float32], extra=extra, grid=3,
                         checked=False)
    np.testing.assert_array_equal(twice, 2 * x + 3)
    np.testing.assert_array_equal(picked, np.full(16, x[8]))  # 32 bytes on: element 8


def test_assert_and_print(capsys: Any) -> None:
    x = _f32()
    body = """
%zero = arith.constant dense<0.0> : tensor<16xf32>
%ok = arith.cmpf olt, %x0, %zero : tensor<16xf32>
tt.print " v=" {hex = false, isSigned = array<i32: 1>} : %i : tensor<16xi32>
tt.assert %ok, "x must be negative" : tensor<16xi1>
%y0 = arith.addf %x0, %x0 : tensor<16xf32>
"""
    lane = int(np.flatnonzero(x >= 0)[0])
    with pytest.raises(emulator.DeviceAssertError, match=rf"kernel `k`, program \(0, 0, 0\): "
                                                         rf"tt.assert.*lane \({lane},\): "
                                                         "x must be negative"):
        _run(body, [x], [np.float32])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "pid (0, 0, 0) idx (0)  v=0" and printed[15].endswith("v=15")
