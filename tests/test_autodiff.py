"""Forward-mode autodiff through pallas_call (jax.jvp, jax.linearize, jax.jacfwd), each derivative
kernel checked against jax.jvp of the same function in plain jax.numpy on random inputs; and
reverse mode (jax.grad, jax.vjp), which raises AutodiffError naming jax.custom_vjp."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl
from pallas_core.stages import kernel_calls

F32 = jnp.float32


def _rand(shape: tuple[int, ...], seed: int = 0, dtype: Any = F32) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, F32).astype(dtype)


def _sds(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _close(actual: Any, expected: Any, tol: float = 1e-5) -> None:
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=tol, atol=tol)


def _close_trees(actual: Any, expected: Any, tol: float = 1e-5) -> None:
    a, ta = jax.tree_util.tree_flatten(actual)
    e, te = jax.tree_util.tree_flatten(expected)
    assert ta == te
    for x, y in zip(a, e):
        _close(x, y, tol)


def _check_jvp(f: Callable[..., Any], ref: Callable[..., Any], primals: tuple[Any, ...],
               tangents: tuple[Any, ...], tol: float = 1e-5) -> None:
    got = jax.jvp(f, primals, tangents)
    want = jax.jvp(ref, primals, tangents)
    _close_trees(got, want, tol)


def elementwise(fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """``fn(x)`` as a kernel over the whole array."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = fn(x_ref[...])
    return pl.pallas_call(kernel, _sds(x))(x)


def _logsumexp_rows(x: jax.Array) -> jax.Array:
    m = jnp.max(x, axis=-1, keepdims=True)
    return jnp.log(jnp.sum(jnp.exp(x - m), axis=-1, keepdims=True)) + m


ELEMENTWISE = {
    "square": lambda x: x * x,
    "pow_3": lambda x: x ** 3,
    "pow_float": lambda x: jnp.abs(x) ** 1.5 + 1.0,
    "exp": jnp.exp,
    "log": lambda x: jnp.log(x * x + 1.0),
    "sin": jnp.sin,
    "cos_times_x": lambda x: jnp.cos(x) * x,
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
    "reciprocal": lambda x: 1.0 / (x * x + 0.5),
    "sqrt": lambda x: jnp.sqrt(x * x + 1.0),
    "recip_exp_sq": lambda x: jnp.reciprocal(jnp.exp(x) ** 2),
    "where_relu": lambda x: jnp.where(x > 0, x, 0.1 * x),
    "logsumexp_rows": lambda x: jnp.broadcast_to(_logsumexp_rows(x), x.shape),
    "softmax_rows": lambda x: jax.nn.softmax(x, axis=-1),
}


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_jvp_of_elementwise_kernels(name: str) -> None:
    fn = ELEMENTWISE[name]
    x, t = _rand((8, 128), 0), _rand((8, 128), 1)
    _check_jvp(functools.partial(elementwise, fn), fn, (x,), (t,), tol=2e-5)


def test_jvp_of_a_scalar_kernel() -> None:
    """A 0-d operand, read and written with ``ref[()]``."""
    def f(x: jax.Array) -> jax.Array:
        def kernel(x_ref: Any, o_ref: Any) -> None:
            o_ref[()] = jnp.exp(-x_ref[()]) ** 2
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct((), F32))(x)

    _check_jvp(f, lambda x: jnp.exp(-x) ** 2, (_rand((), 0),), (_rand((), 1),))


def test_jvp_of_a_partial_write() -> None:
    """The kernel reads a slice of its input and writes two slices of its output."""
    def f(x: jax.Array) -> jax.Array:
        def kernel(x_ref: Any, o_ref: Any) -> None:
            o_ref[pl.ds(0, 4)] = jnp.zeros(4, F32)
            o_ref[pl.ds(4, 4)] = jnp.sin(x_ref[pl.ds(2, 4)])
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), F32))(x)

    def ref(x: jax.Array) -> jax.Array:
        return jnp.concatenate([jnp.zeros(4, F32), jnp.sin(x[2:6])])

    _check_jvp(f, ref, (_rand((16,), 0),), (_rand((16,), 1),))


# --- grids, several operands, accumulation -------------------------------------------------


def blocked_mul_add(x: jax.Array, y: jax.Array, b: jax.Array) -> jax.Array:
    """``tanh(x * y) + b`` over a 2-D grid of (16, 32) blocks; ``b`` is one row, broadcast."""
    def kernel(x_ref: Any, y_ref: Any, b_ref: Any, o_ref: Any) -> None:
        o_ref[...] = jnp.tanh(x_ref[...] * y_ref[...]) + b_ref[...]

    spec = pl.BlockSpec((16, 32), lambda i, j: (i, j))
    row = pl.BlockSpec((1, 32), lambda i, j: (0, j))
    return pl.pallas_call(kernel, _sds(x), grid=(x.shape[0] // 16, x.shape[1] // 32),
                          in_specs=[spec, spec, row], out_specs=spec)(x, y, b)


def _blocked_mul_add_ref(x: jax.Array, y: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.tanh(x * y) + b


def _blocked_args(seed: int = 0) -> tuple[jax.Array, ...]:
    return (_rand((64, 96), seed), _rand((64, 96), seed + 1), _rand((1, 96), seed + 2))


def test_jvp_of_a_blocked_kernel_with_a_grid() -> None:
    _check_jvp(blocked_mul_add, _blocked_mul_add_ref, _blocked_args(0), _blocked_args(10))


def matmul(x: jax.Array, y: jax.Array, bm: int = 32, bn: int = 32, bk: int = 16) -> jax.Array:
    """A blocked matmul whose output block is revisited along the last grid axis (k) and
    accumulated in place, initialised with ``pl.when`` at k == 0."""
    m, k = x.shape
    n = y.shape[1]

    def kernel(x_ref: Any, y_ref: Any, o_ref: Any) -> None:
        @pl.when(pl.program_id(2) == 0)
        def _() -> None:
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=F32)

    return pl.pallas_call(
        kernel, jax.ShapeDtypeStruct((m, n), F32), grid=(m // bm, n // bn, k // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                  pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)))(x, y)


def test_jvp_of_an_accumulating_matmul() -> None:
    x, y = _rand((64, 48), 0), _rand((48, 64), 1)
    tx, ty = _rand((64, 48), 2), _rand((48, 64), 3)
    dot = functools.partial(jnp.dot, precision=jax.lax.Precision.HIGHEST)
    _check_jvp(matmul, dot, (x, y), (tx, ty), tol=1e-4)


def test_jvp_with_a_floating_point_scratch_accumulator() -> None:
    """A row-sum kernel that accumulates in a scratch buffer across the column grid axis."""
    def row_sums(x: jax.Array) -> jax.Array:
        def kernel(x_ref: Any, o_ref: Any, acc_ref: Any) -> None:
            @pl.when(pl.program_id(1) == 0)
            def _() -> None:
                acc_ref[...] = jnp.zeros_like(acc_ref)

            acc_ref[...] += jnp.sum(jnp.sin(x_ref[...]), axis=1, keepdims=True)

            @pl.when(pl.program_id(1) == pl.num_programs(1) - 1)
            def _() -> None:
                o_ref[...] = acc_ref[...] * 2.0

        return pl.pallas_call(
            kernel, jax.ShapeDtypeStruct((x.shape[0], 1), F32), grid=(2, 4),
            in_specs=[pl.BlockSpec((16, 32), lambda i, j: (i, j))],
            out_specs=pl.BlockSpec((16, 1), lambda i, j: (i, 0)),
            scratch_shapes=[jax.ShapeDtypeStruct((16, 1), F32)])(x)

    def ref(x: jax.Array) -> jax.Array:
        return 2.0 * jnp.sum(jnp.sin(x), axis=1, keepdims=True)

    _check_jvp(row_sums, ref, (_rand((32, 128), 0),), (_rand((32, 128), 1),), tol=1e-4)


def two_in_three_out(x: jax.Array, y: jax.Array) -> tuple[jax.Array, ...]:
    """Three outputs of two inputs; the last is an integer (its tangent is a zero)."""
    def kernel(x_ref: Any, y_ref: Any, p_ref: Any, s_ref: Any, i_ref: Any) -> None:
        x, y = x_ref[...], y_ref[...]
        p_ref[...] = x * y
        s_ref[...] = jnp.sin(x) + jnp.exp(y * 0.5)
        i_ref[...] = (x > y).astype(jnp.int32)

    out = (_sds(x), _sds(x), jax.ShapeDtypeStruct(x.shape, jnp.int32))
    return pl.pallas_call(kernel, out)(x, y)


def _two_in_three_out_ref(x: jax.Array, y: jax.Array) -> tuple[jax.Array, ...]:
    return x * y, jnp.sin(x) + jnp.exp(y * 0.5), (x > y).astype(jnp.int32)


def test_jvp_with_several_inputs_and_outputs() -> None:
    x, y = _rand((16, 128), 0), _rand((16, 128), 1)
    tx, ty = _rand((16, 128), 2), _rand((16, 128), 3)
    (p, s, i), (tp, ts, ti) = jax.jvp(two_in_three_out, (x, y), (tx, ty))
    (rp, rs, ri), (rtp, rts, _) = jax.jvp(_two_in_three_out_ref, (x, y), (tx, ty))
    _close_trees((p, s, tp, ts), (rp, rs, rtp, rts))
    np.testing.assert_array_equal(i, ri)
    assert ti.dtype == jax.dtypes.float0 and ti.shape == x.shape


def test_jvp_through_control_flow_in_the_kernel() -> None:
    """fori_loop carrying a value, pl.loop writing rows of the output, lax.cond on data."""
    def f(x: jax.Array) -> jax.Array:
        def kernel(x_ref: Any, o_ref: Any) -> None:
            v = jax.lax.fori_loop(0, 3, lambda i, c: c * jnp.sin(x_ref[...]) + 1.0,
                                  jnp.ones_like(x_ref))

            @pl.loop(0, 8)
            def _(i: Any) -> None:
                o_ref[pl.ds(i, 1), :] = v[pl.ds(i, 1), :] * i.astype(F32)

            o_ref[...] += jax.lax.cond(x_ref[0, 0] > 0, jnp.exp, jnp.cos, x_ref[...])
        return pl.pallas_call(kernel, _sds(x))(x)

    def ref(x: jax.Array) -> jax.Array:
        v = jax.lax.fori_loop(0, 3, lambda i, c: c * jnp.sin(x) + 1.0, jnp.ones_like(x))
        return v * jnp.arange(8.0)[:, None] + jax.lax.cond(x[0, 0] > 0, jnp.exp, jnp.cos, x)

    for seed in (0, 3):  # both branches of the cond
        x = _rand((8, 128), seed)
        x = x.at[0, 0].set(jnp.abs(x[0, 0]) * (1 if seed else -1))
        _check_jvp(f, ref, (x,), (_rand((8, 128), 1),), tol=1e-4)


def test_jvp_in_bfloat16() -> None:
    x, t = _rand((16, 128), 0, jnp.bfloat16), _rand((16, 128), 1, jnp.bfloat16)
    got = jax.jvp(functools.partial(elementwise, jnp.tanh), (x,), (t,))
    want = jax.jvp(jnp.tanh, (x,), (t,))
    assert got[1].dtype == jnp.bfloat16
    _close_trees(jax.tree.map(lambda v: v.astype(F32), got),
                 jax.tree.map(lambda v: v.astype(F32), want), tol=1e-2)


# --- symbolic zeros: inputs that are not differentiated ------------------------------------


def test_jvp_with_some_inputs_not_differentiated() -> None:
    """Only ``x`` is differentiated; ``y`` and ``b`` are closed over (symbolic zero tangents)."""
    x, y, b = _blocked_args(0)
    _check_jvp(lambda x: blocked_mul_add(x, y, b), lambda x: _blocked_mul_add_ref(x, y, b),
               (x,), (_rand(x.shape, 5),))


def test_derivative_kernel_has_one_tangent_operand_per_nonzero_tangent() -> None:
    x, y, b = _blocked_args(0)
    t = _rand(x.shape, 5)
    closed = jax.make_jaxpr(lambda x, t: jax.jvp(lambda x: blocked_mul_add(x, y, b),
                                                 (x,), (t,)))(x, t)
    (call,) = kernel_calls(closed.jaxpr)
    gm = call.grid_mapping
    assert (gm.num_inputs, gm.num_outputs, gm.grid) == (4, 2, (4, 3))
    assert [bm.origin for bm in gm.block_mappings] == [
        "input 0 (x_ref)", "input 1 (y_ref)", "input 2 (b_ref)", "tangent of input 0 (x_ref)",
        "output 0 (o_ref)", "tangent of output 0 (o_ref)"]
    # A tangent is blocked like its primal.
    assert gm.block_mappings[3].index_map is gm.block_mappings[0].index_map


def test_jvp_with_the_tangent_of_one_of_two_inputs_zero() -> None:
    x, y = _rand((16, 128), 0), _rand((16, 128), 1)
    ty = _rand((16, 128), 3)
    got = jax.jvp(lambda y: two_in_three_out(x, y)[:2], (y,), (ty,))
    want = jax.jvp(lambda y: _two_in_three_out_ref(x, y)[:2], (y,), (ty,))
    _close_trees(got, want)


def test_jvp_of_a_kernel_with_an_integer_input() -> None:
    """An integer operand (an index table) has no tangent and needs none."""
    def gather_scale(idx: jax.Array, x: jax.Array) -> jax.Array:
        def kernel(idx_ref: Any, x_ref: Any, o_ref: Any) -> None:
            o_ref[...] = jnp.exp(x_ref[idx_ref[...], :])
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct((idx.shape[0], x.shape[1]), F32))(
            idx, x)

    idx = jnp.array([3, 0, 7, 7, 2, 5, 1, 4], jnp.int32)
    x, t = _rand((8, 128), 0), _rand((8, 128), 1)
    _check_jvp(lambda x: gather_scale(idx, x), lambda x: jnp.exp(x[idx]), (x,), (t,))


def test_jvp_with_all_tangents_zero_runs_the_kernel_alone() -> None:
    x, y = _rand((16, 128), 0), _rand((16, 128), 1)
    p, tp = jax.jvp(lambda x: two_in_three_out(x, y)[0], (x,), (jnp.zeros_like(x),))
    _close(p, x * y)
    _close(tp, jnp.zeros_like(x))


# --- linearize, higher order, jacfwd -------------------------------------------------------


def test_linearize() -> None:
    x, y, b = _blocked_args(0)
    tx, ty, tb = _blocked_args(20)
    out, f_jvp = jax.linearize(blocked_mul_add, x, y, b)
    ref_out, ref_jvp = jax.linearize(_blocked_mul_add_ref, x, y, b)
    _close(out, ref_out)
    _close(f_jvp(tx, ty, tb), ref_jvp(tx, ty, tb))
    # The linear function is reusable at other tangents.
    _close(f_jvp(ty, tx, tb * 3.0), ref_jvp(ty, tx, tb * 3.0))


def test_linearize_with_some_inputs_not_differentiated() -> None:
    x, y = _rand((16, 128), 0), _rand((16, 128), 1)
    out, f_jvp = jax.linearize(lambda x: two_in_three_out(x, y)[1], x)
    ref_out, ref_jvp = jax.linearize(lambda x: _two_in_three_out_ref(x, y)[1], x)
    t = _rand((16, 128), 7)
    _close(out, ref_out)
    _close(f_jvp(t), ref_jvp(t))


def test_second_order_jvp() -> None:
    """The derivative kernel is itself a kernel, so it can be differentiated again."""
    fn = ELEMENTWISE["recip_exp_sq"]
    x, t1, t2 = _rand((8, 128), 0), _rand((8, 128), 1), _rand((8, 128), 2)

    def second(f: Callable[..., Any]) -> Any:
        return jax.jvp(lambda x: jax.jvp(f, (x,), (t1,))[1], (x,), (t2,))

    _close_trees(second(functools.partial(elementwise, fn)), second(fn), tol=1e-4)


def test_jacfwd() -> None:
    x = _rand((8, 16), 0)
    fn = ELEMENTWISE["softmax_rows"]
    _close(jax.jacfwd(functools.partial(elementwise, fn))(x), jax.jacfwd(fn)(x))


# --- with jit and vmap ---------------------------------------------------------------------


def test_jvp_under_jit() -> None:
    args, tangents = _blocked_args(0), _blocked_args(10)
    got = jax.jit(lambda a, t: jax.jvp(blocked_mul_add, a, t))(args, tangents)
    _close_trees(got, jax.jvp(_blocked_mul_add_ref, args, tangents))


def test_jvp_of_a_jitted_function() -> None:
    args, tangents = _blocked_args(0), _blocked_args(10)
    _check_jvp(jax.jit(blocked_mul_add), _blocked_mul_add_ref, args, tangents)


def test_vmap_of_jvp() -> None:
    """Batched primals and tangents: the derivative kernel gains a leading grid axis."""
    xs, ts = _rand((3, 64, 96), 0), _rand((3, 64, 96), 1)
    _, y, b = _blocked_args(0)

    def jvp_of(f: Callable[..., Any]) -> Callable[..., Any]:
        return jax.vmap(lambda x, t: jax.jvp(lambda x: f(x, y, b), (x,), (t,)))

    _close_trees(jvp_of(blocked_mul_add)(xs, ts), jvp_of(_blocked_mul_add_ref)(xs, ts))


def test_vmap_of_jvp_over_tangents_only() -> None:
    """Several tangents at one point (a pushforward of a batch of directions)."""
    x, y, b = _blocked_args(0)
    ts = _rand((4, *x.shape), 1)

    def push(f: Callable[..., Any]) -> Any:
        # The primal output does not depend on the batched tangents: it stays unbatched.
        return jax.vmap(lambda t: jax.jvp(lambda x: f(x, y, b), (x,), (t,)),
                        out_axes=(None, 0))(ts)

    _close_trees(push(blocked_mul_add), push(_blocked_mul_add_ref))


def test_jvp_of_vmap() -> None:
    xs, ys = _rand((3, 16, 128), 0), _rand((3, 16, 128), 1)
    txs, tys = _rand((3, 16, 128), 2), _rand((3, 16, 128), 3)
    f = jax.vmap(lambda x, y: two_in_three_out(x, y)[:2])
    ref = jax.vmap(lambda x, y: _two_in_three_out_ref(x, y)[:2])
    _check_jvp(f, ref, (xs, ys), (txs, tys))


# --- masked loads and stores, aliases, scalar prefetch -------------------------------------


def test_jvp_through_masked_load_and_store() -> None:
    """pl.load with mask= and other=, pl.store with mask=, over an array that is not a
    multiple of the block: the masked lanes have the tangent of ``other`` (a constant: 0)."""
    n, block = 300, 128

    def f(x: jax.Array) -> jax.Array:
        def kernel(x_ref: Any, o_ref: Any) -> None:
            start = pl.program_id(0) * block
            offs = start + jnp.arange(block)
            v = pl.load(x_ref, (pl.ds(start, block),), mask=offs < n, other=1.0)
            pl.store(o_ref, (pl.ds(start, block),), jnp.log(v * v + 1.0), mask=offs < n)

        whole = pl.BlockSpec(memory_space=pl.ANY)
        return pl.pallas_call(kernel, _sds(x), grid=(pl.cdiv(n, block),), in_specs=[whole],
                              out_specs=whole)(x)

    _check_jvp(f, lambda x: jnp.log(x * x + 1.0), (_rand((n,), 0),), (_rand((n,), 1),))


def test_jvp_of_masked_load_with_a_differentiated_other() -> None:
    def f(x: jax.Array, fill: jax.Array) -> jax.Array:
        def kernel(x_ref: Any, fill_ref: Any, o_ref: Any) -> None:
            mask = jnp.arange(16) < 10
            o_ref[...] = pl.load(x_ref, (pl.ds(0, 16),), mask=mask, other=fill_ref[...]) ** 2
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct((16,), F32))(x, fill)

    def ref(x: jax.Array, fill: jax.Array) -> jax.Array:
        return jnp.where(jnp.arange(16) < 10, x, fill) ** 2

    args = (_rand((16,), 0), _rand((16,), 1))
    _check_jvp(f, ref, args, (_rand((16,), 2), _rand((16,), 3)))
    # `other` alone differentiated: the Ref's lanes have zero tangent.
    _check_jvp(lambda fill: f(args[0], fill), lambda fill: ref(args[0], fill),
               (args[1],), (_rand((16,), 4),))


def test_jvp_with_input_output_aliases() -> None:
    """An in-place update: the output starts as the aliased input, its tangent as the input's
    tangent (a zero one when that input is not differentiated)."""
    def update(acc: jax.Array, x: jax.Array) -> jax.Array:
        def kernel(acc_ref: Any, x_ref: Any, o_ref: Any) -> None:
            o_ref[pl.ds(0, 8), :] += jnp.sin(x_ref[...])

        return pl.pallas_call(kernel, _sds(acc), input_output_aliases={0: 0})(acc, x)

    def ref(acc: jax.Array, x: jax.Array) -> jax.Array:
        return acc.at[:8].add(jnp.sin(x))

    acc, x = _rand((16, 128), 0), _rand((8, 128), 1)
    tacc, tx = _rand((16, 128), 2), _rand((8, 128), 3)
    _check_jvp(update, ref, (acc, x), (tacc, tx))
    _check_jvp(lambda x: update(acc, x), lambda x: ref(acc, x), (x,), (tx,))


def test_jvp_with_scalar_prefetch() -> None:
    """Index maps that read a prefetched index table; tangents are blocked the same way."""
    def gather_rows(idx: jax.Array, x: jax.Array) -> jax.Array:
        def kernel(idx_ref: Any, x_ref: Any, o_ref: Any) -> None:
            o_ref[...] = jnp.tanh(x_ref[...]) * (idx_ref[pl.program_id(0)] + 1).astype(F32)

        grid_spec = pl.GridSpec(
            grid=(idx.shape[0],),
            in_specs=[pl.BlockSpec((None, 8, 128), lambda i, idx_ref: (idx_ref[i], 0, 0))],
            out_specs=pl.BlockSpec((None, 8, 128), lambda i, idx_ref: (i, 0, 0)),
            num_scalar_prefetch=1)
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct((idx.shape[0], 8, 128), F32),
                              grid_spec=grid_spec)(idx, x)

    idx = jnp.array([2, 0, 3, 3, 1], jnp.int32)

    def ref(x: jax.Array) -> jax.Array:
        return jnp.tanh(x[idx]) * (idx + 1).astype(F32)[:, None, None]

    x, t = _rand((4, 8, 128), 0), _rand((4, 8, 128), 1)
    _check_jvp(lambda x: gather_rows(idx, x), ref, (x,), (t,))


# --- what is not supported -----------------------------------------------------------------


def _square(x: jax.Array) -> jax.Array:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] ** 2
    return pl.pallas_call(kernel, _sds(x), name="square")(x)


def test_grad_raises_autodiff_error_naming_custom_vjp() -> None:
    x = _rand((8, 128))
    with pytest.raises(pl.AutodiffError, match=r"(?s)reverse mode.*kernel 'square'.*"
                                               r"jax\.custom_vjp"):
        jax.grad(lambda x: _square(x).sum())(x)


@pytest.mark.parametrize("how", ["vjp", "jit_grad", "value_and_grad", "transpose"])
def test_every_route_to_reverse_mode_raises_autodiff_error(how: str) -> None:
    x = _rand((8, 128))
    with pytest.raises(pl.AutodiffError, match=r"(?s)reverse mode.*custom_vjp"):
        if how == "vjp":
            _, pullback = jax.vjp(_square, x)
            pullback(x)
        elif how == "jit_grad":
            jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(_square(x)))))(x)
        elif how == "value_and_grad":
            jax.value_and_grad(lambda x: _square(x).sum())(x)
        else:
            _, f_jvp = jax.linearize(_square, x)
            jax.linear_transpose(f_jvp, x)(x)


def test_grad_of_a_function_that_ignores_the_kernel_output_works() -> None:
    """Reverse mode fails only where a kernel's derivative must be transposed."""
    x = _rand((8, 128))
    g = jax.grad(lambda x: jnp.sum(jnp.sin(x)) + 0.0 * jax.lax.stop_gradient(_square(x)).sum())
    _close(g(x), jnp.cos(x))


def test_custom_vjp_around_a_kernel_still_takes_precedence() -> None:
    @jax.custom_vjp
    def f(x: jax.Array) -> jax.Array:
        return _square(x)

    def fwd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return _square(x), x

    def bwd(x: jax.Array, g: jax.Array) -> tuple[jax.Array]:
        return (elementwise(lambda v: 2.0 * v, x) * g,)

    f.defvjp(fwd, bwd)
    x = _rand((8, 128))
    _close(jax.grad(lambda x: f(x).sum())(x), 2.0 * x)


def _atomic_body(x_ref: Any, o_ref: Any) -> None:
    o_ref[...] = jnp.zeros_like(o_ref)
    pl.atomic_add(o_ref, (pl.ds(0, 8),), x_ref[...])


def _scoped_body(x_ref: Any, o_ref: Any) -> None:
    def scoped(s_ref: Any) -> None:
        s_ref[...] = jnp.sin(x_ref[...])
        o_ref[...] = s_ref[...] * 2.0
    pl.run_scoped(scoped, pl.ANY((8,), F32))


@pytest.mark.parametrize(("body", "primitive"), [(_atomic_body, "atomic_rmw"),
                                                 (_scoped_body, "run_scoped")])
def test_non_differentiable_kernel_body_raises_autodiff_error(body: Any, primitive: str) -> None:
    """A primitive without a derivative: the error names it, the kernel, and the fix."""
    f = pl.pallas_call(body, jax.ShapeDtypeStruct((8,), F32), name="nodiff")
    x = _rand((8,))
    with pytest.raises(pl.AutodiffError, match=rf"(?s)kernel 'nodiff'.*{primitive}.*custom_jvp"):
        jax.jvp(f, (x,), (x,))


def test_jvp_of_a_kernel_on_a_mesh() -> None:
    """pl.kernel: the mesh axis (lax.axis_index) is in scope in the derivative kernel too."""
    def body(x_ref: Any, o_ref: Any) -> None:
        core = jax.lax.axis_index("x")
        rows = pl.ds(core * 16, 16)
        o_ref[rows] = jnp.sin(x_ref[rows]) * (core + 1).astype(F32)

    x, t = _rand((64, 8), 0), _rand((64, 8), 1)
    f = pl.kernel(body, out_type=_sds(x), mesh=pl.Mesh(("x",), (4,)))
    scale = jnp.repeat(jnp.arange(1.0, 5.0), 16)[:, None]
    _check_jvp(f, lambda x: jnp.sin(x) * scale, (x,), (t,))


# --- what backends receive -----------------------------------------------------------------


def test_derivative_kernel_uses_only_ordinary_primitives() -> None:
    """Sums of tangents (JAX's autodiff-internal ``add_any``) are plain adds in the kernel."""
    x, y = _rand((16, 128), 0), _rand((16, 128), 1)
    closed = jax.make_jaxpr(lambda x, y: jax.jvp(two_in_three_out, (x, y), (y, x)))(x, y)
    (call,) = kernel_calls(closed.jaxpr)
    text = str(call.jaxpr)
    assert "add_any" not in text and " add " in text


def test_derivative_kernel_lowers_for_triton() -> None:
    """The derivative of a blocked matmul is three dots per step (x.y, tx.y, x.ty)."""
    pytest.importorskip("pallas_triton")
    pytest.importorskip("triton")  # pl.stages of the Triton backend compiles through it
    x, y = _rand((128, 64), 0), _rand((64, 128), 1)
    (stages,) = pl.stages(lambda a, t: jax.jvp(lambda x, y: matmul(x, y, 64, 64, 32), a, t),
                          (x, y), (y.T, x.T), backend="triton")
    assert stages["ttir"].count("tt.dot ") == 3


def test_jvp_of_a_dynamic_grid() -> None:
    """A traced grid size rides along as the primitive's last operand; it gets no tangent."""

    def f(x: Any, n: Any) -> Any:
        def kernel(x_ref: Any, o_ref: Any) -> None:
            o_ref[...] = jnp.sin(x_ref[...]) * x_ref[...]

        spec = pl.BlockSpec((8,), lambda i: (i,))
        return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(n,),
                              in_specs=[spec], out_specs=spec)(x)

    kx, kt = jax.random.split(jax.random.key(3))
    x, t = jax.random.normal(kx, (32,)), jax.random.normal(kt, (32,))
    run = jax.jit(lambda x, t, n: jax.jvp(lambda x: f(x, n), (x,), (t,)))
    primal, tangent = run(x, t, jnp.int32(4))
    want_p, want_t = jax.jvp(lambda x: jnp.sin(x) * x, (x,), (t,))
    np.testing.assert_allclose(primal, want_p, rtol=1e-6)
    np.testing.assert_allclose(tangent, want_t, rtol=1e-5, atol=1e-6)
