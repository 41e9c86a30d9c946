"""The Triton emulator runs the TTIR that XLA's Triton call carries and matches jax.numpy.

Every kernel of ``test_compile.py`` (the seed examples among them) is lowered for ``cuda`` by
this project and emulated; the kernels below are also written once against either Pallas
module and emulated both as this project lowers them and as ``jax.experimental.pallas`` does.
Checked mode reports unmasked out-of-bounds accesses and cross-program write races.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jpl
from jax.experimental.pallas import triton as jpt

import pallas_core as pl
from pallas_core import backend as plb

pallas_triton = pytest.importorskip("pallas_triton")
from pallas_triton import emulator, inspection  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_compile  # noqa: E402

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


# -- running a function's Triton kernels in the emulator --------------------------------------

def _lower_for_cuda(fn: Callable[..., Any], *args: Any) -> str:
    with plb.assume_device("NVIDIA H100", "cuda"):  # JAX 0.12 asks which GPU it targets
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def emulate(fn: Callable[..., Any], *args: Any, checked: bool = False,
            seed: int | None = None) -> Any:
    """``fn(*args)`` with its Triton kernels run by the emulator."""
    return pl.emulate(fn, backend="triton", checked=checked, seed=seed)(*args)


def _rand(shape: tuple[int, ...], dtype: Any = F32, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _close(got: Any, want: Any, tol: float = 1e-5) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.shape(g) == np.shape(w)
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=tol, atol=tol)


# -- every kernel of test_compile.py ------------------------------------------------------------

def _attention(q: Any, k: Any, v: Any) -> Any:
    s = jnp.einsum("...qd,...kd->...qk", q, k, precision="highest") / math.sqrt(q.shape[-1])
    return jnp.einsum("...qk,...kd->...qd", jax.nn.softmax(s, axis=-1), v, precision="highest")


def _dot(x: Any, y: Any) -> Any:
    return jnp.dot(x, y, preferred_element_type=F32, precision="highest")


def _while_reference(w: Any) -> Any:
    counts = [int(np.ceil(np.log2(max(float(jnp.max(jnp.abs(b))), 1.0)))) for b in (w[:64],
                                                                                   w[64:])]
    return w * np.repeat(counts, 64)


REFERENCES: dict[str, tuple[Callable[..., Any], float]] = {
    "vector_add": (jnp.add, 1e-6),
    "iota": (lambda: jnp.arange(64, dtype=jnp.int32), 0),
    "blocked_add_uneven": (jnp.add, 1e-6),
    "matmul_2x2_f32": (_dot, 2e-2),  # the kernel's dot runs in TF32
    "matmul_2x2_bf16": (lambda x, y: _dot(x, y).astype(BF16), 2e-2),
    "matmul_3d_f32": (_dot, 2e-2),
    "matmul_3d_bf16": (_dot, 2e-2),
    "matmul_activation": (lambda x, y: jax.nn.gelu(_dot(x, y)), 2e-2),
    "softmax": (lambda x: jax.nn.softmax(x, axis=-1), 1e-5),
    "row_reduction": (lambda x: (x.sum(1), x.max(1)), 1e-4),
    "flash_attention": (_attention, 2e-2),
    "vmap_multi_head": (_attention, 2e-2),
    "vmap_nested_batch_heads": (_attention, 2e-2),
    "grid_4d": (test_compile._grid_4d_reference, 1e-6),
    "while_loop_and_print": (_while_reference, 1e-6),
    "triton_only_primitives": (lambda x: 2 * jnp.tanh(x), 1e-6),
    "masked_load_store": (lambda x: 2 * x, 1e-6),
    "gather_rows": (lambda t, i: t[i] * 2.0, 1e-6),
    "atomics": (lambda x: x.sum(0), 1e-5),
}


def test_every_kernel_of_test_compile_has_a_reference() -> None:
    assert set(REFERENCES) == set(test_compile.CASES)


@pytest.mark.parametrize("name", sorted(test_compile.CASES))
def test_seed_kernel_emulated_matches_jnp(name: str) -> None:
    fn, make_args = test_compile.CASES[name]
    args = make_args()
    reference, tol = REFERENCES[name]
    _close(emulate(fn, *args, checked=True), reference(*args), tol)


# -- kernels written against either Pallas module -----------------------------------------------

OURS = (pl, pallas_triton)
JAX = (jpl, jpt)
BOTH = pytest.mark.parametrize("mods", [OURS, JAX], ids=["ours", "jax"])


def _params(tm: Any, **kw: Any) -> dict[str, Any]:
    return {"compiler_params": tm.CompilerParams(**kw)}


def blocked_add(pm: Any, tm: Any, x: Any, y: Any, block: tuple[int, int] = (32, 64)) -> Any:
    """Edge blocks of an uneven 2-D array (masked loads and stores)."""
    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * 2.0 + y_ref[...]

    spec = pm.BlockSpec(block, lambda i, j: (i, j))
    grid = (pl.cdiv(x.shape[0], block[0]), pl.cdiv(x.shape[1], block[1]))
    return pm.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=grid,
                         in_specs=[spec, spec], out_specs=spec, **_params(tm))(x, y)


def masked_scale(pm: Any, tm: Any, x: Any, block: int = 128) -> Any:
    """Explicit masks and ``other`` on a whole-array Ref: ``load``/``store`` of ``ds``."""
    n = x.shape[0]

    def kernel(x_ref: Any, o_ref: Any) -> None:
        start = pm.program_id(0) * block
        mask = start + jnp.arange(block) < n
        v = tm.load(x_ref.at[pm.ds(start, block)], mask=mask, other=1.0)
        tm.store(o_ref.at[pm.ds(start, block)], jnp.exp(v) + 1.0, mask=mask)

    whole = pm.BlockSpec(memory_space=pm.ANY)
    return pm.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                         grid=(pl.cdiv(n, block),), in_specs=[whole], out_specs=whole,
                         **_params(tm))(x)


def row_stats(pm: Any, tm: Any, x: Any, rows: int = 8) -> Any:
    """Sum, max and argmax of each row (reductions)."""
    def kernel(x_ref: Any, s_ref: Any, m_ref: Any, a_ref: Any) -> None:
        v = x_ref[...]
        s_ref[...] = jnp.sum(v, axis=1)
        m_ref[...] = jnp.max(v, axis=1)
        a_ref[...] = jnp.argmax(v, axis=1).astype(jnp.int32)

    r, c = x.shape
    in_spec = pm.BlockSpec((rows, c), lambda i: (i, 0))
    out_spec = pm.BlockSpec((rows,), lambda i: (i,))
    shapes = (jax.ShapeDtypeStruct((r,), x.dtype), jax.ShapeDtypeStruct((r,), x.dtype),
              jax.ShapeDtypeStruct((r,), jnp.int32))
    return pm.pallas_call(kernel, shapes, grid=(r // rows,), in_specs=[in_spec],
                         out_specs=(out_spec,) * 3, **_params(tm))(x)


def row_cumsum(pm: Any, tm: Any, x: Any, rows: int = 4) -> Any:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jnp.cumsum(x_ref[...], axis=1)

    spec = pm.BlockSpec((rows, x.shape[1]), lambda i: (i, 0))
    return pm.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                         grid=(x.shape[0] // rows,), in_specs=[spec], out_specs=spec,
                         **_params(tm))(x)


def atomic_column_sum(pm: Any, tm: Any, x: Any, acc: Any) -> Any:
    """Every program adds its row into one accumulator (aliased to ``acc``): atomics."""
    def kernel(x_ref: Any, acc_ref: Any, o_ref: Any) -> None:
        tm.atomic_add(o_ref, (pm.ds(0, x.shape[1]),), x_ref[...])

    return pm.pallas_call(
        kernel, jax.ShapeDtypeStruct(acc.shape, acc.dtype), grid=(x.shape[0],),
        in_specs=[pm.BlockSpec((None, x.shape[1]), lambda i: (i, 0)),
                  pm.BlockSpec(memory_space=pm.ANY)],
        out_specs=pm.BlockSpec(memory_space=pm.ANY), input_output_aliases={1: 0},
        **_params(tm))(x, acc)


def when_and_fori(pm: Any, tm: Any, x: Any) -> Any:
    """``pl.when`` on the program id and a ``fori_loop`` carrying a vector."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        v = x_ref[...]
        o_ref[...] = jax.lax.fori_loop(0, 3, lambda i, acc: acc * 0.5 + v, v)

        @pm.when(pm.program_id(0) == 1)
        def _() -> None:
            o_ref[...] = -v

    spec = pm.BlockSpec((64,), lambda i: (i,))
    return pm.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                         grid=(x.shape[0] // 64,), in_specs=[spec], out_specs=spec,
                         **_params(tm))(x)


def when_and_fori_reference(x: Any) -> Any:
    acc = x
    for _ in range(3):
        acc = acc * 0.5 + x
    return acc.at[64:128].set(-x[64:128])


def transcendental(pm: Any, tm: Any, x: Any) -> Any:
    """exp, log, tanh, pow, sqrt, sin (libdevice calls in JAX's lowering)."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        v = x_ref[...].astype(F32)
        a = jnp.abs(v) + 0.5
        out = (jnp.exp(v) + jnp.log(a) + jnp.tanh(v) + jnp.power(a, v)
               + jnp.sqrt(a) + jnp.sin(v))
        o_ref[...] = out.astype(o_ref.dtype)

    spec = pm.BlockSpec((128,), lambda i: (i,))
    return pm.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                         grid=(x.shape[0] // 128,), in_specs=[spec], out_specs=spec,
                         **_params(tm))(x)


def transcendental_reference(x: Any) -> Any:
    v = x.astype(F32)
    a = jnp.abs(v) + 0.5
    out = (jnp.exp(v) + jnp.log(a) + jnp.tanh(v) + jnp.power(a, v)
           + jnp.sqrt(a) + jnp.sin(v))
    return out.astype(x.dtype)


def fori_matmul(pm: Any, tm: Any, x: Any, y: Any, bm: int = 32, bn: int = 32,
                bk: int = 16) -> Any:
    """A K loop inside the kernel (``fori_loop`` of ``pl.dot``-style dots on slices)."""
    k = x.shape[1]

    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        def body(t: Any, acc: Any) -> Any:
            a = x_ref[:, pm.ds(t * bk, bk)]
            b = y_ref[pm.ds(t * bk, bk), :]
            return acc + jnp.dot(a, b, preferred_element_type=F32)

        acc = jax.lax.fori_loop(0, k // bk, body, jnp.zeros((bm, bn), F32))
        o_ref[...] = acc.astype(o_ref.dtype)

    return pm.pallas_call(
        kernel, jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), x.dtype),
        grid=(x.shape[0] // bm, y.shape[1] // bn),
        in_specs=[pm.BlockSpec((bm, k), lambda i, j: (i, 0)),
                  pm.BlockSpec((k, bn), lambda i, j: (0, j))],
        out_specs=pm.BlockSpec((bm, bn), lambda i, j: (i, j)), **_params(tm))(x, y)


def grid_matmul(pm: Any, tm: Any, x: Any, y: Any, b: int = 32) -> Any:
    """A 3-D grid accumulating into the output block over K, zeroed under ``pl.when``."""
    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        @pm.when(pm.program_id(2) == 0)
        def _() -> None:
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += tm.dot(x_ref[...], y_ref[...])

    (m, k), n = x.shape, y.shape[1]
    return pm.pallas_call(
        kernel, jax.ShapeDtypeStruct((m, n), F32), grid=(m // b, n // b, k // b),
        in_specs=[pm.BlockSpec((b, b), lambda i, j, kk: (i, kk)),
                  pm.BlockSpec((b, b), lambda i, j, kk: (kk, j))],
        out_specs=pm.BlockSpec((b, b), lambda i, j, kk: (i, j)), **_params(tm))(x, y)


def erf_and_rsqrt(pm: Any, tm: Any, x: Any) -> Any:
    """``erf`` (this project lowers it by a polynomial; JAX's Triton lowering has no rule)."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        v = x_ref[...]
        o_ref[...] = jax.lax.erf(v) + jax.lax.rsqrt(jnp.abs(v) + 1.0)

    spec = pm.BlockSpec((128,), lambda i: (i,))
    return pm.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                         grid=(x.shape[0] // 128,), in_specs=[spec], out_specs=spec,
                         **_params(tm))(x)


@dataclasses.dataclass(frozen=True)
class Case:
    """A kernel written against either Pallas module, with its jnp reference."""

    kernel: Callable[..., Any]
    """``kernel(pm, tm, *args)``: ``pm`` the Pallas module, ``tm`` its Triton module."""
    args: Callable[[], tuple[Any, ...]]
    reference: Callable[..., Any]
    tol: float
    ours: bool = True
    """Whether this project lowers it (else lowering raises ``UnsupportedError``)."""
    jax: bool = True
    """Whether JAX lowers it (else lowering raises ``NotImplementedError``)."""
    jax_checked: type[Exception] | None = None
    """What checked mode reports in the module JAX emits (it is then run unchecked)."""


def _transcendental_case(dtype: Any, tol: float) -> Case:
    return Case(transcendental, lambda: (_rand((256,), dtype),), transcendental_reference, tol)


KERNELS: dict[str, Case] = {
    # JAX 0.10 masks no edge block: the last row block reads past the array's end.
    "blocked_add_uneven": Case(blocked_add, lambda: (_rand((100, 200)),
                                                     _rand((100, 200), seed=1)),
                               lambda x, y: x * 2 + y, 1e-6, jax_checked=pl.OutOfBoundsError),
    "masked_scale": Case(masked_scale, lambda: (_rand((1000,)),), lambda x: jnp.exp(x) + 1,
                         1e-5),
    "row_stats": Case(row_stats, lambda: (_rand((32, 128)),),
                      lambda x: (x.sum(1), x.max(1), jnp.argmax(x, 1).astype(jnp.int32)), 1e-5),
    "cumsum": Case(row_cumsum, lambda: (_rand((8, 128)),), lambda x: jnp.cumsum(x, 1), 1e-4),
    "atomic_add": Case(atomic_column_sum, lambda: (_rand((6, 128)), _rand((128,), seed=1)),
                       lambda x, acc: acc + x.sum(0), 1e-5),
    "when_and_fori": Case(when_and_fori, lambda: (_rand((256,)),), when_and_fori_reference,
                          1e-6),
    "libdevice_f32": _transcendental_case(F32, 1e-5),
    "libdevice_bf16": _transcendental_case(BF16, 2e-2),
    "libdevice_f16": _transcendental_case(F16, 2e-3),
    "erf": Case(erf_and_rsqrt, lambda: (_rand((256,)),),
                lambda x: jax.lax.erf(x) + jax.lax.rsqrt(jnp.abs(x) + 1), 1e-5, jax=False),
    "fori_matmul_bf16": Case(fori_matmul, lambda: (_rand((64, 64), BF16),
                                                   _rand((64, 64), BF16, 1)),
                             lambda x, y: _dot(x, y).astype(BF16), 2e-2),
    "fori_matmul_f16": Case(fori_matmul, lambda: (_rand((64, 64), F16),
                                                  _rand((64, 64), F16, 1)),
                            lambda x, y: _dot(x, y).astype(F16), 1e-2),
    # JAX makes every step of the 3-D grid a program: the K steps race on the output block.
    "grid_matmul": Case(grid_matmul, lambda: (_rand((64, 96)), _rand((96, 64), seed=1)), _dot,
                        2e-2, jax_checked=emulator.RaceError),
}


def _jax_masks_edge_blocks(fn: Callable[..., Any], *args: Any) -> bool:
    """Whether the Triton module of ``fn`` compares offsets with bounds (``arith.cmpi``): JAX
    0.12 masks the loads and stores of edge blocks; JAX 0.10 reads past the array's end."""
    with plb.assume_device("NVIDIA H100", "cuda"):  # JAX 0.12 asks which GPU it targets
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return any("arith.cmpi" in call.ttir for call in inspection.triton_calls(lowered))


@BOTH
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_emulated_matches_jnp(name: str, mods: tuple[Any, Any]) -> None:
    case = KERNELS[name]
    args = case.args()
    fn = functools.partial(case.kernel, *mods)
    if not (case.ours if mods is OURS else case.jax):
        with pytest.raises(pl.UnsupportedError if mods is OURS else NotImplementedError):
            _lower_for_cuda(fn, *args)
        return
    checked = True
    expected = case.jax_checked
    if expected is pl.OutOfBoundsError and _jax_masks_edge_blocks(fn, *args):
        expected = None  # JAX 0.12 masks the accesses of edge blocks, as this backend does
    if mods is JAX and expected is not None:
        with pytest.raises(expected):
            emulate(fn, *args, checked=True)
        checked = False
    _close(emulate(fn, *args, checked=checked), case.reference(*args), case.tol)


# -- checked mode -------------------------------------------------------------------------------

def unmasked_tail(pm: Any, tm: Any, x: Any, block: int = 128) -> Any:
    """Reads and writes ``block`` elements per program without a mask: the last program runs
    past the end of a 200-element array."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        start = pm.program_id(0) * block
        tm.store(o_ref.at[pm.ds(start, block)], tm.load(x_ref.at[pm.ds(start, block)]) + 1.0,
                mask=start + jnp.arange(block) < x.shape[0])

    whole = pm.BlockSpec(memory_space=pm.ANY)
    return pm.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                         grid=(pl.cdiv(x.shape[0], block),), in_specs=[whole],
                         out_specs=whole, **_params(tm))(x)


def test_checked_mode_reports_an_unmasked_out_of_bounds_read() -> None:
    x = _rand((200,))
    fn = functools.partial(unmasked_tail, *JAX)
    with pytest.raises(pl.OutOfBoundsError, match=r"kernel `kernel`, program \(1, 0, 0\): "
                       r"tt.load.*test_triton_emulator.py.*lane \(72,\) accesses operand 0 "
                       r"\(\(200,\) float32\) at element 200.*no mask turns that lane off"):
        emulate(fn, x, checked=True)
    # Unchecked, the lanes past the end read 0 (and their stores are masked off).
    _close(emulate(fn, x), x + 1.0)


def test_checked_mode_reports_what_only_our_lowerings_bounds_mask_hides() -> None:
    """This project's lowering bounds every access by its array's shape, so the unmasked load
    past the end reads 0 instead of other memory; checked, the emulator still reports it (as
    it reports the access in JAX's module), from the mark the lowering leaves on the lanes
    only its own mask turns off. The masked store of the same kernel is not reported."""
    x = _rand((200,))
    fn = functools.partial(unmasked_tail, *OURS)
    # The grid steps share the whole output: they run in order in one program.
    with pytest.raises(pl.OutOfBoundsError, match=r"kernel `kernel`, program \(0, 0, 0\): "
                       r"arith.andi: lane \(72,\) of the load of input 0 \(x_ref\) "
                       r"\(shape \(200,\)\) at \S*test_triton_emulator.py:\d+ "
                       r"falls outside the array.*JAX's Triton "
                       r"lowering masks no such dimension.*Fix: mask the access"):
        emulate(fn, x, checked=True)
    _close(emulate(fn, x), x + 1.0)  # unchecked: the lanes past the end read 0
    # The load masked as the store is: nothing to report.
    def masked(x: Any) -> Any:
        def kernel(x_ref: Any, o_ref: Any) -> None:
            start = pl.program_id(0) * 128
            live = start + jnp.arange(128) < x.shape[0]
            pallas_triton.store(o_ref.at[pl.ds(start, 128)],
                     pallas_triton.load(x_ref.at[pl.ds(start, 128)], mask=live, other=0.0) + 1.0,
                     mask=live)
        whole = pl.BlockSpec(memory_space=pl.ANY)
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
                              in_specs=[whole], out_specs=whole)(x)
    _close(emulate(masked, x, checked=True), x + 1.0)


def test_checked_mode_reports_an_unmasked_store_our_lowering_drops() -> None:
    """A store past the end of a 2-D array, with a kernel mask that leaves those lanes on (a
    wrong bound); with the right bound nothing is reported and the kept rows are right."""
    x = _rand((64, 32))

    def fn(x: Any, rows: int) -> Any:
        def kernel(x_ref: Any, o_ref: Any) -> None:
            first = pl.program_id(0) * 16 + 8
            live = (first + jnp.arange(16)[:, None] < rows) & (jnp.arange(32)[None, :] < 32)
            pallas_triton.store(o_ref.at[pl.ds(first, 16), :], x_ref[...] * 3.0, mask=live)
        return pl.pallas_call(
            kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,),
            in_specs=[pl.BlockSpec((16, 32), lambda i: (i, 0))],
            out_specs=pl.BlockSpec(memory_space=pl.ANY))(x)
    with pytest.raises(pl.OutOfBoundsError, match=r"lane \(8, 0\) of the store of output 0 "
                       r"\(o_ref\) \(shape \(64, 32\)\)"):
        emulate(lambda x: fn(x, 72), x, checked=True)
    got = np.asarray(emulate(lambda x: fn(x, 64), x, checked=True))
    np.testing.assert_allclose(got[8:], np.asarray(x[:56]) * 3.0, rtol=1e-6)


@BOTH
def test_checked_mode_reports_no_lane_jaxs_own_bounds_turn_off(mods: tuple[Any, Any]) -> None:
    """Rows of a padded edge block (blocks of 8 rows over 10) gather the diagonal, the column
    following the row: in the last block, rows past the array also index columns past it, a
    dimension JAX does not bound. JAX's bound on the rows turns those lanes off, so neither
    module accesses them and nothing is reported."""
    pm, tm = mods
    x = _rand((10, 10))

    def fn(x: Any) -> Any:
        def kernel(x_ref: Any, o_ref: Any) -> None:
            r = jnp.arange(8)
            o_ref[...] = x_ref[r, pm.program_id(0) * 8 + r]
        return pm.pallas_call(kernel, jax.ShapeDtypeStruct((10,), x.dtype), grid=(2,),
                              in_specs=[pm.BlockSpec((8, 10), lambda i: (i, 0))],
                              out_specs=pm.BlockSpec((8,), lambda i: (i,)),
                              **_params(tm))(x)
    _close(emulate(fn, x, checked=True), jnp.diagonal(x))


@pytest.mark.parametrize("size", [200, 256])
def test_checked_mode_lets_the_padded_edge_block_be(size: int) -> None:
    """Blocks that do not divide the array pad the last one, and JAX's lowering masks that
    dimension too: its lanes past the end are not reported. Where blocks divide the array, an
    index past a block's end stays inside the array (the next block): nothing to report."""
    x = _rand((size,))

    def fn(x: Any) -> Any:
        def kernel(x_ref: Any, o_ref: Any) -> None:
            o_ref[...] = x_ref[...] * 2.0
        spec = pl.BlockSpec((128,), lambda i: (i,))
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                              grid=(pl.cdiv(size, 128),), in_specs=[spec], out_specs=spec)(x)
    _close(emulate(fn, x, checked=True), x * 2.0)


def racing_store(pm: Any, tm: Any, x: Any) -> Any:
    """Every program stores its block to the same place of the output."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        tm.store(o_ref.at[pm.ds(0, 64)], tm.load(x_ref.at[pm.ds(pm.program_id(0) * 64, 64)]))

    whole = pm.BlockSpec(memory_space=pm.ANY)
    return pm.pallas_call(kernel, jax.ShapeDtypeStruct((64,), x.dtype), grid=(4,),
                         in_specs=[whole], out_specs=whole, **_params(tm))(x)


def test_checked_mode_reports_two_programs_storing_one_address() -> None:
    x = _rand((256,))
    with pytest.raises(emulator.RaceError, match=r"program \(1, 0, 0\): tt.store.*result 0 "
                                                 r"\(\(64,\) float32\) at element 0, which "
                                                 r"program \(0, 0, 0\) also stored"):
        emulate(functools.partial(racing_store, *JAX), x, checked=True)
    _close(emulate(functools.partial(racing_store, *JAX), x), x[192:])  # the last store stays
    # This project runs grid steps that share an output block in one program, in order.
    _close(emulate(functools.partial(racing_store, *OURS), x, checked=True), x[192:])


def test_programs_in_shuffled_order() -> None:
    x, y = _rand((64, 64)), _rand((64, 64), seed=1)
    _close(emulate(functools.partial(grid_matmul, *OURS), x, y, checked=True, seed=3),
           _dot(x, y), 2e-2)
    with pytest.raises(emulator.RaceError):
        emulate(functools.partial(grid_matmul, *JAX), x, y, checked=True, seed=3)


@BOTH
def test_checked_mode_passes_a_correctly_masked_kernel(mods: tuple[Any, Any]) -> None:
    x = _rand((1000,))
    _close(emulate(functools.partial(masked_scale, *mods), x, checked=True), jnp.exp(x) + 1,
           1e-5)


# -- miscompiles the emulator found -----------------------------------------------------------

def _elementwise(fn: Callable[[Any], Any], x: Any) -> Any:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = fn(x_ref[...])

    return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), backend="triton")(x)


def test_tanh_of_float16_near_zero() -> None:
    """Regression (rule matrix ``tanh-float16``): the Pade approximant used for |x| < 0.5 has
    the coefficient 135135, infinite in float16, so tanh gave NaN there; it now runs in
    float32."""
    x = _rand((8, 32), F16)
    _close(emulate(functools.partial(_elementwise, jnp.tanh), x, checked=True), jnp.tanh(x),
           1e-3)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_erf_inv_at_plus_and_minus_one(dtype: Any) -> None:
    """Regression (rule matrix ``erf_inv-float16``, shared rule): the tail polynomial runs to
    -inf as |x| -> 1, so erf_inv(1) was -inf and erf_inv(-1) +inf."""
    x = jnp.concatenate([jnp.array([1.0, -1.0, 0.999, -0.5, 0.0, 0.25, -0.9, 0.75]),
                         jnp.tanh(_rand((248,)))]).astype(dtype)
    got = emulate(functools.partial(_elementwise, jax.lax.erf_inv), x, checked=True)
    assert np.asarray(got[:2], np.float32).tolist() == [np.inf, -np.inf]
    _close(got, jax.lax.erf_inv(x), 2e-2 if dtype != F32 else 2e-5)


# -- atomics returning old values, compare-and-swap, num_programs ------------------------------

def atomic_rows(pm: Any, tm: Any, op: str, x: Any, acc: Any, valid: int) -> Any:
    """Every program applies ``atomic_<op>`` of its row to one accumulator, masked to the first
    ``valid`` lanes, and writes the old values it got back."""
    n = x.shape[1]

    def kernel(x_ref: Any, acc_ref: Any, o_ref: Any, old_ref: Any) -> None:
        mask = jnp.arange(n) < valid
        old = getattr(tm, f"atomic_{op}")(o_ref, (pm.ds(0, n),), x_ref[...], mask=mask)
        old_ref[...] = jnp.where(mask, old, jnp.zeros_like(old))

    shapes = (jax.ShapeDtypeStruct(acc.shape, acc.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype))
    return pm.pallas_call(
        kernel, shapes, grid=(x.shape[0],),
        in_specs=[pm.BlockSpec((None, n), lambda i: (i, 0)), pm.BlockSpec(memory_space=pm.ANY)],
        out_specs=(pm.BlockSpec(memory_space=pm.ANY), pm.BlockSpec((None, n), lambda i: (i, 0))),
        input_output_aliases={1: 0}, **_params(tm))(x, acc)


_UPDATES: dict[str, Callable[[Any, Any], Any] | None] = {
    "add": np.add, "max": np.maximum, "min": np.minimum, "and": np.bitwise_and,
    "or": np.bitwise_or, "xor": np.bitwise_xor, "xchg": None}


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.uint32])
@pytest.mark.parametrize("op", sorted(_UPDATES))
@BOTH
def test_atomics_in_program_order_with_old_values(op: str, dtype: Any,
                                                  mods: tuple[Any, Any]) -> None:
    if dtype == np.float32 and op in ("and", "or", "xor"):
        return
    if mods is JAX and dtype != np.float32 and op in ("max", "min"):
        return  # JAX's lowering asserts on integer atomic max/min
    rng = np.random.default_rng(len(op))
    x = (rng.standard_normal((5, 16)) * 100).astype(dtype)
    acc = (rng.standard_normal(16) * 100).astype(dtype)
    got, old = emulate(functools.partial(atomic_rows, *mods, op, valid=11), x, acc, checked=True)
    want, olds = acc.copy(), np.zeros_like(x)
    update = _UPDATES[op]
    for i in range(x.shape[0]):  # programs run in order
        olds[i, :11] = want[:11]
        want[:11] = x[i, :11] if update is None else update(want[:11], x[i, :11])
    _close(got, want, 1e-6)
    _close(old, olds, 1e-6)


def claim(pm: Any, tm: Any, owner: Any, ids: Any) -> Any:
    """Each program compare-and-swaps its id into ``owner`` (a scalar) if it still holds -1:
    the first program to get there owns it. Also records ``num_programs``."""
    def kernel(owner_ref: Any, ids_ref: Any, o_ref: Any, n_ref: Any) -> None:
        tm.atomic_cas(o_ref, jnp.int32(-1), pm.program_id(0))  # JAX's takes a scalar Ref
        n_ref[...] = ids_ref[...] * 0 + pm.num_programs(0)

    shapes = (jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((8,), jnp.int32))
    whole = pm.BlockSpec(memory_space=pm.ANY)
    return pm.pallas_call(kernel, shapes, grid=(3,), in_specs=[whole, whole],
                          out_specs=(whole, whole), input_output_aliases={0: 0},
                          **_params(tm))(owner, ids)


@BOTH
def test_atomic_cas_and_num_programs(mods: tuple[Any, Any]) -> None:
    ids = np.zeros(8, np.int32)
    fn = functools.partial(claim, *mods)
    got, n = emulate(fn, np.int32(-1), ids)
    assert int(got) == 0  # programs run in order
    np.testing.assert_array_equal(n, np.full(8, 3))
    assert int(emulate(fn, np.int32(5), ids)[0]) == 5  # taken already
    # Shuffled: JAX's three programs run in the order (2, 1, 0); this project runs a grid axis
    # whose steps share an output block as a loop inside one program, in order.
    first = 2 if mods is JAX else 0
    assert int(emulate(fn, np.int32(-1), ids, seed=3)[0]) == first


@BOTH
def test_rocm_target_and_its_ocml_functions(mods: tuple[Any, Any]) -> None:
    """For a ``gfx*`` target the kernel is lowered for ``rocm``: JAX calls ROCm's ocml
    (``__ocml_exp_f32``) instead of libdevice."""
    x = _rand((256,))
    got = pl.emulate(functools.partial(transcendental, *mods), backend="triton",
                     target="gfx942", checked=True)(x)
    _close(got, transcendental_reference(x), 1e-5)


# -- the kernels of benchmarks/gpu_triton.py ---------------------------------------------------

@pytest.mark.parametrize("module", [pl, jpl], ids=["ours", "jax"])
@pytest.mark.parametrize("name", ["add_relu_2^28", "flash_attention", "matmul_bf16_4096",
                                  "softmax_8192"])
def test_benchmark_kernel_emulated(name: str, module: Any) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    import gpu_triton
    from test_benchmark_kernels import SMALL

    kernel, reference, _, tol = gpu_triton.CASES[name]
    rng = np.random.default_rng(0)
    args = [jnp.asarray(rng.standard_normal(s), dt) for s, dt in SMALL[name]]
    got = emulate(functools.partial(kernel, module), *args, checked=True)
    _close(got, reference(*args), tol)
