"""The interpreter's fast (batched) path agrees with the exact step-by-step path and with an
independent numpy reference, and is taken exactly when ``fast.plan`` can prove it safe.

Cases are drawn at random: grids of 1-3 axes of sizes 1-4; every operand's dimension follows a
grid axis or a constant block; block shapes may not divide the arrays. Every operand has the
same block shape, so the kernel combines its blocks elementwise; the cases are built so that
no in-bounds output element ever depends on the padding of an edge block (the reference pads
inputs with NaN to check that).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pallas_interpret import InterpretParams, fast

import pallas_core as pl
from pallas_core.stages import kernel_calls

EXACT = InterpretParams(fast=False)
PID_WEIGHTS = (1.0, 10.0, 100.0)
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

Dims = tuple[tuple[str, int], ...]  # per array dimension: ("axis", a) or ("const", c)


@dataclasses.dataclass(frozen=True)
class Operand:
    dims: Dims
    shape: tuple[int, ...]

    def index_map(self) -> Any:
        dims = self.dims
        return lambda *ids: tuple(ids[v] if kind == "axis" else v for kind, v in dims)

    def block_index(self, point: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(point[v] if kind == "axis" else v for kind, v in self.dims)


@dataclasses.dataclass(frozen=True)
class Output(Operand):
    perm: tuple[int, ...]  # the output's block is transpose(value, perm)
    scale: float

    def reduced(self, grid: tuple[int, ...]) -> tuple[int, ...]:
        """The grid axes this output does not follow: its blocks are revisited along them."""
        followed = {v for kind, v in self.dims if kind == "axis"}
        return tuple(a for a in range(len(grid)) if a not in followed)


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str
    grid: tuple[int, ...]
    block: tuple[int, ...]  # the block shape of the value; output k's is permuted by its perm
    inputs: tuple[Operand, ...]
    outputs: tuple[Output, ...]


# --- drawing cases ---------------------------------------------------------------------------


def _axis_size(draw: Any, n_blocks: int, b: int) -> int:
    """An array size whose blocks along a grid axis of ``n_blocks`` all start in bounds."""
    return draw(st.integers((n_blocks - 1) * b + 1, n_blocks * b))


@st.composite
def cases(draw: Any, kinds: tuple[str, ...] = ("identity", "transposed", "broadcast",
                                               "revisiting")) -> Case:
    kind = draw(st.sampled_from(kinds))
    grid = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    n_axes = len(grid)
    reduced: list[int] = []
    if kind == "revisiting":
        reduced = sorted(draw(st.sets(st.sampled_from(range(n_axes)), min_size=1)))
    kept = [a for a in range(n_axes) if a not in reduced]
    if kind == "transposed":
        kept = list(draw(st.permutations(kept)))
    dims: list[tuple[str, int]] = [("axis", a) for a in kept]
    if not dims or (len(dims) < 3 and draw(st.booleans())):
        dims.insert(draw(st.integers(0, len(dims))), ("const", draw(st.integers(0, 1))))
    block = tuple(draw(st.integers(1, 4)) for _ in dims)
    shape = tuple(_axis_size(draw, grid[v], b) if kind_ == "axis"
                  else draw(st.integers(v * b + 1, (v + 2) * b - 1))
                  for (kind_, v), b in zip(dims, block))
    # Dimensions whose blocks are all whole: the value is valid there at every position.
    full = [kind_ == "axis" and s == grid[v] * b for (kind_, v), b, s in zip(dims, block, shape)]

    def input_dim(d: int, choice: str) -> tuple[tuple[str, int], int]:
        b = block[d]
        if choice == "same":
            return dims[d], shape[d]
        if choice == "axis":  # any grid axis, whole blocks (maybe more array after them)
            a = draw(st.integers(0, n_axes - 1))
            return ("axis", a), grid[a] * b + draw(st.integers(0, b - 1))
        c = draw(st.integers(0, 1))  # a constant block that lies inside the array
        return ("const", c), (c + 1) * b + draw(st.integers(0, b - 1))

    def make_input(choices: list[str]) -> Operand:
        pairs = [input_dim(d, c) for d, c in enumerate(choices)]
        return Operand(tuple(p[0] for p in pairs), tuple(p[1] for p in pairs))

    ndim = len(dims)
    inputs = [Operand(tuple(dims), shape)]
    if kind == "broadcast":
        choices = [draw(st.sampled_from(["same", "const"])) for _ in range(ndim)]
        choices[draw(st.integers(0, ndim - 1))] = "const"
        inputs.append(make_input(choices))
    if kind == "revisiting":  # an input that moves along a reduced axis: the reduction
        d = draw(st.integers(0, ndim - 1))
        x = make_input([draw(st.sampled_from(["same", "const"])) for _ in range(ndim)])
        r = draw(st.sampled_from(reduced))
        x_dims, x_shape = list(x.dims), list(x.shape)
        x_dims[d] = ("axis", r)
        x_shape[d] = grid[r] * block[d] + draw(st.integers(0, block[d] - 1))
        inputs.append(Operand(tuple(x_dims), tuple(x_shape)))
    if draw(st.booleans()):  # a mixed input: may be transposed, diagonal, broadcast
        inputs.append(make_input([draw(st.sampled_from(["same", "axis", "const"]))
                                  for _ in range(ndim)]))

    outputs = [Output(tuple(dims), shape, tuple(range(ndim)), 1.0)]
    if draw(st.booleans()):  # a second output: the value transposed, maybe revisited more
        perm = tuple(draw(st.permutations(range(ndim))))
        o_dims, o_shape = [dims[p] for p in perm], [shape[p] for p in perm]
        if draw(st.booleans()):
            whole = [j for j, p in enumerate(perm) if full[p]]
            if whole:
                j = draw(st.sampled_from(whole))
                b = block[perm[j]]
                o_dims[j], o_shape[j] = ("const", 0), draw(st.integers(1, 2 * b - 1))
        outputs.append(Output(tuple(o_dims), tuple(o_shape), perm, -0.5))
    return Case(kind, grid, block, tuple(inputs), tuple(outputs))


# --- the kernel, the reference -----------------------------------------------------------------


def _first_visit(axes: tuple[int, ...]) -> Any:
    return functools.reduce(jnp.logical_and, [pl.program_id(a) == 0 for a in axes])


def build(case: Case, compiler_params: Any = None) -> Any:
    n_in = len(case.inputs)
    n_axes = len(case.grid)

    def kernel(*refs: Any) -> None:
        ins, outs = refs[:n_in], refs[n_in:]
        value = sum(((k + 1) * r[...] for k, r in enumerate(ins)), start=jnp.float32(0))
        for a in range(n_axes):
            value = value + PID_WEIGHTS[a] * pl.program_id(a).astype(jnp.float32)
        for o_ref, out in zip(outs, case.outputs):
            block_value = jnp.transpose(value, out.perm) * out.scale
            reduced = out.reduced(case.grid)
            if not reduced:
                o_ref[...] = block_value
                continue

            @pl.when(_first_visit(reduced))
            def _init(o_ref: Any = o_ref) -> None:
                o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

            o_ref[...] += block_value

    def spec(op: Operand, block: tuple[int, ...]) -> pl.BlockSpec:
        return pl.BlockSpec(block, op.index_map())

    out_blocks = [tuple(case.block[p] for p in o.perm) for o in case.outputs]
    return pl.pallas_call(
        kernel,
        tuple(jax.ShapeDtypeStruct(o.shape, jnp.float32) for o in case.outputs),
        grid=case.grid,
        in_specs=[spec(x, case.block) for x in case.inputs],
        out_specs=tuple(spec(o, b) for o, b in zip(case.outputs, out_blocks)),
        compiler_params=compiler_params,
        interpret=True,
    )


def _block_slices(op: Operand, point: tuple[int, ...], block: tuple[int, ...]) -> Any:
    return tuple(slice(i * b, (i + 1) * b) for i, b in zip(op.block_index(point), block))


def _padded(x: np.ndarray, block: tuple[int, ...], fill: float) -> np.ndarray:
    target = [-(-s // b) * b for s, b in zip(x.shape, block)]
    out = np.full(target, fill, x.dtype)
    out[tuple(slice(0, s) for s in x.shape)] = x
    return out


def reference(case: Case, args: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The outputs by a numpy loop over the grid, and where they are written. Padding of edge
    blocks is NaN, so a result that depended on it would show."""
    ins = [_padded(x, case.block, np.nan) for x in args]
    out_blocks = [tuple(case.block[p] for p in o.perm) for o in case.outputs]
    outs = [_padded(np.full(o.shape, np.nan, np.float32), b, np.nan)
            for o, b in zip(case.outputs, out_blocks)]
    written = [np.zeros(o.shape, bool) for o in outs]
    for point in itertools.product(*map(range, case.grid)):
        value = np.zeros(case.block, np.float32)
        for k, (x, op) in enumerate(zip(ins, case.inputs)):
            value = value + np.float32(k + 1) * x[_block_slices(op, point, case.block)]
        for a, i in enumerate(point):
            value = value + np.float32(PID_WEIGHTS[a] * i)
        for o, out, b, w in zip(outs, case.outputs, out_blocks, written):
            sl = _block_slices(out, point, b)
            block_value = np.transpose(value, out.perm) * np.float32(out.scale)
            reduced = out.reduced(case.grid)
            if reduced and not all(point[a] == 0 for a in reduced):
                block_value = o[sl] + block_value
            o[sl] = block_value
            w[sl] = True
    crop = [tuple(slice(0, s) for s in out.shape) for out in case.outputs]
    return [o[c] for o, c in zip(outs, crop)], [w[c] for w, c in zip(written, crop)]


def random_args(case: Case, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(x.shape).astype(np.float32) for x in case.inputs]


def the_call(fn: Any, *args: Any) -> pl.KernelCall:
    (call,) = kernel_calls(jax.make_jaxpr(fn)(*args).jaxpr)
    return call


def expected_parallel(case: Case) -> tuple[int, ...] | None:
    """The parallel axes ``fast.plan`` must find, or ``None`` when it must decline."""
    grid = case.grid
    if np.prod(grid) <= 1:
        return None
    # An axis of size 1 is constant; it is parallel if every output follows it.
    parallel = tuple(a for a in range(len(grid)) if grid[a] > 1
                     and all(("axis", a) in o.dims for o in case.outputs))
    for op in (*case.inputs, *case.outputs):
        followed = [v for kind, v in op.dims if kind == "axis" and v in parallel]
        if len(followed) != len(set(followed)):
            return None  # a diagonal along a parallel axis
    return parallel


def _assert_agree(case: Case, got_fast: Any, got_exact: Any, args: list[np.ndarray]) -> None:
    want, written = reference(case, args)
    for k, (f, e, w, mask) in enumerate(zip(got_fast, got_exact, want, written)):
        f, e = np.asarray(f), np.asarray(e)
        np.testing.assert_allclose(f, e, rtol=1e-5, atol=1e-5, err_msg=f"fast vs exact, out {k}")
        assert not np.isnan(w[mask]).any(), "bad case: an output depends on edge padding"
        np.testing.assert_allclose(e[mask], w[mask], rtol=1e-5, atol=1e-4,
                                   err_msg=f"exact vs reference, output {k}")


# --- properties --------------------------------------------------------------------------------


@settings(SETTINGS, max_examples=50)
@given(cases())
def test_fast_equals_exact_equals_reference(case: Case) -> None:
    args = random_args(case)
    got_fast = build(case)(*args)
    got_exact = build(case, EXACT)(*args)
    _assert_agree(case, got_fast, got_exact, args)

    plan = fast.plan(the_call(build(case), *args))
    want = expected_parallel(case)
    if want is None:
        assert plan is None
    else:
        assert plan is not None, f"fast path not taken for {case}"
        assert plan.parallel == want
    # With identity and broadcast maps only (no diagonals), the fast path is always taken.
    simple = all(len({v for k, v in op.dims if k == "axis"})
                 == sum(k == "axis" for k, _ in op.dims)
                 for op in (*case.inputs, *case.outputs))
    if simple and np.prod(case.grid) > 1:
        assert plan is not None


@SETTINGS
@given(cases(kinds=("identity", "broadcast", "revisiting")), st.integers(1, 3))
def test_vmap_and_jit_of_fast_path(case: Case, batch: int) -> None:
    """``jax.vmap`` adds a batch grid axis; under ``jit`` the fast path still agrees."""
    rng = np.random.default_rng(1)
    args = [rng.standard_normal((batch, *x.shape)).astype(np.float32) for x in case.inputs]
    got_fast = jax.jit(jax.vmap(build(case)))(*args)
    got_exact = jax.vmap(build(case, EXACT))(*args)
    for b in range(batch):
        one = [x[b] for x in args]
        _assert_agree(case, [o[b] for o in got_fast], [o[b] for o in got_exact], one)
    # A batch axis of size > 1 is parallel for every output: the fast path is taken.
    if batch > 1 and expected_parallel(case) is not None:
        assert fast.plan(the_call(jax.vmap(build(case)), *args)) is not None


# --- fixed examples ------------------------------------------------------------------------------


def _spec(block: tuple[int, ...], index_map: Any) -> pl.BlockSpec:
    return pl.BlockSpec(block, index_map)


def test_matmul_like_reduction_runs_batched() -> None:
    """A (i, j, k) matmul with a non-divisible M: i and j parallel, k sequential."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((10, 8)).astype(np.float32)
    y = rng.standard_normal((8, 12)).astype(np.float32)

    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        @pl.when(pl.program_id(2) == 0)
        def _() -> None:
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

        o_ref[...] += x_ref[...] @ y_ref[...]

    def mm(params: Any = None) -> Any:
        return pl.pallas_call(
            kernel, jax.ShapeDtypeStruct((10, 12), jnp.float32), grid=(3, 3, 2),
            in_specs=[_spec((4, 4), lambda i, j, k: (i, k)),
                      _spec((4, 4), lambda i, j, k: (k, j))],
            out_specs=_spec((4, 4), lambda i, j, k: (i, j)),
            compiler_params=params, interpret=True)

    plan = fast.plan(the_call(mm(), x, y))
    assert plan is not None
    assert (plan.parallel, plan.sequential) == ((0, 1), (2,))
    np.testing.assert_allclose(mm()(x, y), x @ y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mm()(x, y), mm(EXACT)(x, y), rtol=1e-6, atol=1e-6)


def test_squeezed_transposed_blocks() -> None:
    """Squeezed block dimensions and an index map that swaps the grid axes."""
    x = np.arange(3 * 5 * 7, dtype=np.float32).reshape(3, 5, 7)

    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...].T * 2.0 + pl.program_id(0) * 100.0 + pl.program_id(1)

    def f(params: Any = None) -> Any:
        return pl.pallas_call(
            kernel, jax.ShapeDtypeStruct((7, 3, 5), jnp.float32), grid=(2, 3),
            in_specs=[_spec((None, 5, 4), lambda i, j: (j, 0, i))],
            out_specs=_spec((4, None, 5), lambda i, j: (i, j, 0)),
            compiler_params=params, interpret=True)

    assert fast.plan(the_call(f(), x)) is not None
    want = np.transpose(x, (2, 0, 1)) * 2.0
    want += (np.arange(7) // 4 * 100.0)[:, None, None] + np.arange(3)[None, :, None]
    np.testing.assert_array_equal(f()(x), want)
    np.testing.assert_array_equal(f(EXACT)(x), want)


def test_arrays_larger_than_the_grid_covers() -> None:
    """Regression: an input and an output with more blocks along a parallel axis than the grid
    has steps (the fast path once vmapped over all blocks of the array, not the grid's)."""
    x = np.arange(9, dtype=np.float32)

    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] + pl.program_id(0).astype(jnp.float32) * 100.0

    def f(params: Any = None) -> Any:
        spec = pl.BlockSpec((2,), lambda i: (i,))
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct((7,), jnp.float32), grid=(2,),
                              in_specs=[spec], out_specs=spec, compiler_params=params,
                              interpret=True)

    assert fast.plan(the_call(f(), x)) is not None
    want = x[:4] + np.repeat([0.0, 100.0], 2)
    np.testing.assert_array_equal(f()(x)[:4], want)
    np.testing.assert_array_equal(f(EXACT)(x)[:4], want)
    np.testing.assert_array_equal(f()(x), f(EXACT)(x))


# --- where the fast path must not be taken -----------------------------------------------------

ROW = pl.BlockSpec((None, 8), lambda i: (i, 0))


def _copy(x_ref: Any, o_ref: Any) -> None:
    o_ref[...] = x_ref[...] + pl.program_id(0).astype(jnp.float32)


def _scratch_kernel(x_ref: Any, o_ref: Any, s_ref: Any) -> None:
    s_ref[...] = x_ref[...]
    o_ref[...] = s_ref[...] * 2.0


def _print_kernel(x_ref: Any, o_ref: Any) -> None:
    pl.debug_print("step {}", pl.program_id(0))
    o_ref[...] = x_ref[...]


def _atomic_kernel(x_ref: Any, acc_in: Any, o_ref: Any, acc_ref: Any) -> None:
    del acc_in
    pl.atomic_add(acc_ref, (pl.ds(0, 8),), x_ref[...])
    o_ref[...] = x_ref[...]


def _sum_kernel(x_ref: Any, o_ref: Any) -> None:
    o_ref[...] = x_ref[...] + 1.0


X = np.arange(32, dtype=np.float32).reshape(4, 8)
ROWS = jax.ShapeDtypeStruct((4, 8), jnp.float32)
VEC = jax.ShapeDtypeStruct((8,), jnp.float32)
WHOLE = pl.BlockSpec(memory_space=pl.ANY)

DECLINED = {
    "scratch_shapes": (lambda: pl.pallas_call(
        _scratch_kernel, ROWS, grid=(4,), in_specs=[ROW], out_specs=ROW,
        scratch_shapes=[jax.ShapeDtypeStruct((8,), jnp.float32)]), (X,)),
    "input_output_aliases": (lambda: pl.pallas_call(
        _copy, ROWS, grid=(4,), in_specs=[ROW], out_specs=ROW,
        input_output_aliases={0: 0}), (X,)),
    "atomics": (lambda: pl.pallas_call(
        _atomic_kernel, (ROWS, VEC), grid=(4,), in_specs=[ROW, WHOLE],
        out_specs=(ROW, WHOLE), input_output_aliases={1: 1}), (X, np.zeros(8, np.float32))),
    "debug_print": (lambda: pl.pallas_call(
        _print_kernel, ROWS, grid=(4,), in_specs=[ROW], out_specs=ROW), (X,)),
    "i_plus_j": (lambda: pl.pallas_call(
        _sum_kernel, jax.ShapeDtypeStruct((8, 8), jnp.float32), grid=(2, 2),
        in_specs=[pl.BlockSpec((2, 8), lambda i, j: (i + j, 0))],
        out_specs=pl.BlockSpec((2, 8), lambda i, j: (2 * i + j, 0))),
        (np.ones((8, 8), np.float32),)),
    "input_i_plus_j": (lambda: pl.pallas_call(
        _sum_kernel, jax.ShapeDtypeStruct((4, 8), jnp.float32), grid=(2, 2),
        in_specs=[pl.BlockSpec((1, 8), lambda i, j: (i + j, 0))],
        out_specs=pl.BlockSpec((1, 8), lambda i, j: (2 * i + j, 0))),
        (np.arange(32, dtype=np.float32).reshape(4, 8),)),
    "output_i_plus_j": (lambda: pl.pallas_call(
        _sum_kernel, jax.ShapeDtypeStruct((4, 8), jnp.float32), grid=(2, 2),
        in_specs=[pl.BlockSpec((1, 8), lambda i, j: (2 * i + j, 0))],
        out_specs=pl.BlockSpec((1, 8), lambda i, j: (i + j, 0))),
        (np.arange(32, dtype=np.float32).reshape(4, 8),)),
}


@pytest.mark.parametrize("name", list(DECLINED))
def test_fast_path_declined(name: str) -> None:
    """Scratch, aliasing, atomics, prints and index maps that are not a grid index or a
    constant send the kernel down the exact path, with the same results."""
    make, args = DECLINED[name]
    assert fast.plan(the_call(make(), *args)) is None
    jax.block_until_ready(make()(*args))


def test_single_step_and_size_one_grids_run() -> None:
    """A grid of one step is not batched; size-1 axes are constants to the plan."""
    x = np.arange(8, dtype=np.float32).reshape(1, 8)
    one = pl.pallas_call(_copy, jax.ShapeDtypeStruct((1, 8), jnp.float32), grid=(1,),
                         in_specs=[ROW], out_specs=ROW)
    assert fast.plan(the_call(one, x)) is None
    np.testing.assert_array_equal(one(x), x)


def _loop_reader(x_ref: Any, o_ref: Any) -> None:
    def body(k: Any, acc: Any) -> Any:
        return acc + x_ref[pl.ds(k * 4, 4)] * (k + 1).astype(jnp.float32)

    o_ref[...] = jax.lax.fori_loop(0, 2, body, jnp.zeros(4, jnp.float32))


def _loop_writer(x_ref: Any, o_ref: Any) -> None:
    def body(k: Any, acc: Any) -> Any:
        x_ref[pl.ds(k * 4, 4)] = x_ref[pl.ds(k * 4, 4)] + acc
        return acc + 1.0

    jax.lax.fori_loop(0, 2, body, jnp.ones(4, jnp.float32))
    o_ref[...] = x_ref[pl.ds(0, 4)]


def test_an_input_read_in_a_loop_runs_batched() -> None:
    """A loop that only reads an input still carries it through when discharged; the
    kernel's effects, not that, decide that the input is not written. Batched with JAX's
    jaxpr checks on (the discharged loop's ``closed_call`` is inlined, see
    ``reference._ALWAYS_INLINED``)."""
    x = np.asarray(jax.random.normal(jax.random.key(3), (4, 8), jnp.float32))
    call = pl.pallas_call(_loop_reader, jax.ShapeDtypeStruct((4, 4), jnp.float32), grid=(4,),
                          in_specs=[ROW], out_specs=pl.BlockSpec((None, 4), lambda i: (i, 0)))
    assert fast.plan(the_call(call, x)) is not None
    want = x[:, :4] + 2 * x[:, 4:]
    with jax.enable_checks(True):
        np.testing.assert_allclose(call(x), want, rtol=1e-6)
    np.testing.assert_allclose(call(x), pl.pallas_call(
        _loop_reader, jax.ShapeDtypeStruct((4, 4), jnp.float32), grid=(4,), in_specs=[ROW],
        out_specs=pl.BlockSpec((None, 4), lambda i: (i, 0)), interpret=EXACT)(x), rtol=1e-6)


def test_an_input_written_in_a_loop_is_seen_by_later_steps() -> None:
    """Every step reads and writes the whole input inside a loop: the exact path runs, and
    each step sees what the steps before it wrote."""
    x = np.asarray(jax.random.normal(jax.random.key(4), (8,), jnp.float32))
    call = pl.pallas_call(_loop_writer, jax.ShapeDtypeStruct((3, 4), jnp.float32), grid=(3,),
                          in_specs=[pl.BlockSpec((8,), lambda i: (0,))],
                          out_specs=pl.BlockSpec((None, 4), lambda i: (i, 0)))
    assert fast.plan(the_call(call, x)) is None
    want = np.stack([x[:4] + 1 + s for s in range(3)])
    np.testing.assert_allclose(call(x), want, rtol=1e-6)


def _triangle(x_ref: Any, o_ref: Any) -> None:
    """Row i sums the first i + 1 rows: a loop whose trip count is the grid position."""
    i = pl.program_id(0)
    o_ref[...] = jax.lax.fori_loop(0, i + 1, lambda k, acc: acc + x_ref[k], jnp.zeros(8))


def _offset_sum(x_ref: Any, o_ref: Any) -> None:
    """A loop of fixed trip count whose body uses the grid position."""
    i = pl.program_id(0)
    o_ref[...] = jax.lax.fori_loop(0, 2, lambda k, acc: acc + x_ref[(i + k) % 4], jnp.zeros(8))


@pytest.mark.parametrize(("kernel", "batched"), [(_triangle, False), (_offset_sum, True)])
def test_loops_whose_trip_count_follows_the_grid_step(kernel: Any, batched: bool) -> None:
    """Batched, every lane would run the longest trip count; such kernels step through the
    grid instead. A loop of fixed trip count still runs batched."""
    x = np.asarray(jax.random.normal(jax.random.key(5), (4, 8), jnp.float32))
    call = pl.pallas_call(kernel, ROWS, grid=(4,),
                          in_specs=[pl.BlockSpec((4, 8), lambda i: (0, 0))], out_specs=ROW)
    assert (fast.plan(the_call(call, x)) is not None) == batched
    want = (np.cumsum(x, axis=0) if kernel is _triangle
            else x + np.roll(x, -1, axis=0))
    np.testing.assert_allclose(call(x), want, rtol=1e-5, atol=1e-6)
