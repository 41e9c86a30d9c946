"""The seed examples (examples/*.py) checked against plain jax.numpy on random inputs.

Each kernel runs eagerly, under ``jax.jit``, under ``jax.vmap`` (nested too), wrapped in a
``jax.custom_vjp`` and inside ``jax.shard_map`` over eight CPU devices (see conftest.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl
from examples import (
    blocked_add_uneven,
    flash_attention,
    iota,
    matmul_2x2,
    matmul_3d_grid,
    matmul_activation,
    row_reduction,
    shard_map_add,
    softmax,
    vector_add,
    vmap_attention,
)

F32_TOL = {"rtol": 1e-5, "atol": 1e-4}
ATTN_TOL = {"rtol": 1e-4, "atol": 1e-5}


def rand(seed: int, shape: tuple[int, ...], dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Random normal values (random integers for integer dtypes) of ``shape``."""
    rng = np.random.default_rng(seed)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(rng.integers(-1000, 1000, shape), dtype)
    return jnp.asarray(rng.standard_normal(shape), dtype)


# --- vector add ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
@pytest.mark.parametrize(("n", "block_size"), [(1024, None), (1024, 256), (1000, 128)])
def test_vector_add(dtype: jnp.dtype, n: int, block_size: int | None) -> None:
    """Unblocked, blocked and uneven (last block partial) vector addition."""
    x, y = rand(0, (n,), dtype), rand(1, (n,), dtype)
    got = vector_add.vector_add(x, y, block_size=block_size)
    assert got.dtype == x.dtype and got.shape == x.shape
    np.testing.assert_array_equal(got, x + y)


def test_vector_add_jit() -> None:
    """The same kernel traced inside ``jax.jit``."""
    x, y = rand(0, (2048,)), rand(1, (2048,))
    fn = jax.jit(functools.partial(vector_add.vector_add, block_size=512))
    np.testing.assert_array_equal(fn(x, y), x + y)


def test_vector_add_vmap_with_unbatched_operand() -> None:
    """``vmap`` with one batched and one broadcast (``in_axes=None``) operand."""
    x, y = rand(0, (3, 512)), rand(1, (512,))
    got = jax.vmap(functools.partial(vector_add.vector_add, block_size=128),
                   in_axes=(0, None))(x, y)
    np.testing.assert_array_equal(got, x + y[None])


# --- iota ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 8, 33])
def test_iota(n: int) -> None:
    """``program_id`` written at its own index gives ``arange``."""
    np.testing.assert_array_equal(iota.iota(n), jnp.arange(n, dtype=jnp.int32))


@pytest.mark.parametrize(("grid", "block"), [((3, 4), (8, 16)), ((1, 5), (2, 2))])
def test_block_ids(grid: tuple[int, int], block: tuple[int, int]) -> None:
    """Every block is filled with its flat step index ``i * num_programs(1) + j``."""
    got = jax.jit(iota.block_ids, static_argnums=(0, 1))(grid, block)
    np.testing.assert_array_equal(got, iota.block_ids_reference(grid, block))


# --- matmul on a 2x2 grid ------------------------------------------------------------------


@pytest.mark.parametrize(("m", "k", "n"), [(256, 128, 192), (64, 32, 16)])
def test_matmul_2x2(m: int, k: int, n: int) -> None:
    """Four output blocks, each a full-K product."""
    x, y = rand(0, (m, k)), rand(1, (k, n))
    np.testing.assert_allclose(matmul_2x2.matmul_2x2(x, y), x @ y, **F32_TOL)


def test_matmul_2x2_jit_and_batched() -> None:
    """Batched matmul: ``vmap`` (and ``vmap`` of ``vmap``) of the 2x2-grid kernel, jitted."""
    x, y = rand(0, (3, 64, 32)), rand(1, (3, 32, 48))
    got = jax.jit(jax.vmap(matmul_2x2.matmul_2x2))(x, y)
    np.testing.assert_allclose(got, jnp.einsum("bmk,bkn->bmn", x, y), **F32_TOL)
    x4, y4 = rand(2, (2, 3, 32, 16)), rand(3, (2, 3, 16, 32))
    got = jax.vmap(jax.vmap(matmul_2x2.matmul_2x2))(x4, y4)
    np.testing.assert_allclose(got, jnp.einsum("abmk,abkn->abmn", x4, y4), **F32_TOL)


def test_matmul_2x2_vmap_shared_weights() -> None:
    """``vmap`` over the rows operand only; the weight matrix is shared by every batch item."""
    x, w = rand(0, (4, 64, 32)), rand(1, (32, 64))
    got = jax.vmap(matmul_2x2.matmul_2x2, in_axes=(0, None))(x, w)
    np.testing.assert_allclose(got, jnp.einsum("bmk,kn->bmn", x, w), **F32_TOL)


# --- blocked add on uneven shapes -----------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "block"),
    [((1000, 300), (128, 128)), ((129, 257), (128, 128)), ((128, 128), (128, 128)),
     ((7, 5), (8, 8))],
)
def test_blocked_add_uneven(shape: tuple[int, int], block: tuple[int, int]) -> None:
    """Edge blocks hang over the array: padded on read, cut off on write."""
    x, y = rand(0, shape), rand(1, shape)
    got = blocked_add_uneven.blocked_add(x, y, block=block)
    assert got.shape == shape
    np.testing.assert_array_equal(got, x + y)


def test_blocked_add_uneven_jit_vmap() -> None:
    """The uneven grid under ``jit`` of ``vmap``."""
    x, y = rand(0, (2, 200, 150)), rand(1, (2, 200, 150))
    got = jax.jit(jax.vmap(blocked_add_uneven.blocked_add))(x, y)
    np.testing.assert_array_equal(got, x + y)


# --- matmul with an activation ----------------------------------------------------------------


@pytest.mark.parametrize("activation", [None, jax.nn.relu, jax.nn.gelu, jnp.tanh],
                         ids=["none", "relu", "gelu", "tanh"])
def test_matmul_activation(activation: object) -> None:
    """The activation is bound into the kernel with ``functools.partial``."""
    x, y = rand(0, (256, 64)), rand(1, (64, 256))
    got = matmul_activation.matmul(x, y, activation=activation)
    want = x @ y if activation is None else activation(x @ y)
    np.testing.assert_allclose(got, want, **F32_TOL)


def test_matmul_activation_uneven_jit() -> None:
    """M and N that the blocks do not divide, under ``jit``."""
    x, y = rand(0, (200, 48), jnp.float32), rand(1, (48, 136), jnp.float32)
    fn = jax.jit(functools.partial(matmul_activation.matmul, activation=jax.nn.relu,
                                   block_m=64, block_n=64))
    np.testing.assert_allclose(fn(x, y), jax.nn.relu(x @ y), **F32_TOL)


# --- matmul on a 3-D grid ----------------------------------------------------------------------


@pytest.mark.parametrize(("m", "k", "n", "blocks"),
                         [(256, 384, 256, (128, 128, 128)), (64, 96, 32, (32, 32, 32))])
def test_matmul_3d_grid_f32(m: int, k: int, n: int, blocks: tuple[int, int, int]) -> None:
    """Accumulation over the innermost grid axis with ``pl.when`` zero-init."""
    x, y = rand(0, (m, k)), rand(1, (k, n))
    bm, bn, bk = blocks
    got = matmul_3d_grid.matmul(x, y, block_m=bm, block_n=bn, block_k=bk)
    np.testing.assert_allclose(got, x @ y, **F32_TOL)


def test_matmul_3d_grid_bf16_inputs_f32_accumulate() -> None:
    """bfloat16 inputs, float32 output and accumulation."""
    x, y = rand(0, (128, 256), jnp.bfloat16), rand(1, (256, 128), jnp.bfloat16)
    got = matmul_3d_grid.matmul(x, y, block_m=64, block_n=64, block_k=64)
    assert got.dtype == jnp.float32
    want = jnp.dot(x, y, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def test_matmul_3d_grid_jit_vmap() -> None:
    """Batched matmul (``vmap`` and nested ``vmap``) with accumulation, under ``jit``."""
    blocks = {"block_m": 32, "block_n": 32, "block_k": 32}
    mm = functools.partial(matmul_3d_grid.matmul, **blocks)
    x, y = rand(0, (2, 64, 64)), rand(1, (2, 64, 64))
    np.testing.assert_allclose(jax.jit(jax.vmap(mm))(x, y), x @ y, **F32_TOL)
    x4, y4 = rand(2, (2, 2, 32, 64)), rand(3, (2, 2, 64, 32))
    np.testing.assert_allclose(jax.vmap(jax.vmap(mm))(x4, y4), x4 @ y4, **F32_TOL)


def test_matmul_3d_grid_rejects_partial_k() -> None:
    """A K that the block does not divide would add padding into the sum: refused."""
    with pytest.raises(ValueError, match="not a multiple"):
        matmul_3d_grid.matmul(rand(0, (128, 100)), rand(1, (100, 128)))


# --- softmax ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("shape", "block_rows"), [((256, 128), 64), ((500, 96), 64),
                                                   ((3, 17), 8)])
def test_softmax(shape: tuple[int, int], block_rows: int) -> None:
    """Row softmax of scaled random inputs (large logits exercise the max subtraction)."""
    x = rand(0, shape) * 10
    got = softmax.softmax(x, block_rows=block_rows)
    np.testing.assert_allclose(got, jax.nn.softmax(x, axis=-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jnp.sum(got, axis=-1), 1.0, rtol=1e-5)


def test_softmax_bf16_jit_vmap() -> None:
    """bfloat16 in and out, computed in float32 inside the kernel; batched and jitted."""
    x = rand(0, (2, 128, 64), jnp.bfloat16)
    got = jax.jit(jax.vmap(softmax.softmax))(x)
    assert got.dtype == jnp.bfloat16
    want = jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(jnp.bfloat16)
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32),
                               rtol=2e-2, atol=1e-3)


# --- row reductions ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
@pytest.mark.parametrize(("shape", "block_rows"), [((1000, 384), 128), ((64, 10), 64)])
def test_row_reduction(dtype: jnp.dtype, shape: tuple[int, int], block_rows: int) -> None:
    """Row sums and maxima; two outputs; the last row block may be partial."""
    x = rand(0, shape, dtype)
    got_sum, got_max = row_reduction.row_sum_max(x, block_rows=block_rows)
    np.testing.assert_allclose(got_sum, jnp.sum(x, axis=1), **F32_TOL)
    np.testing.assert_array_equal(got_max, jnp.max(x, axis=1))


def test_row_reduction_jit() -> None:
    """The two-output kernel under ``jit``."""
    x = rand(0, (300, 200))
    got_sum, got_max = jax.jit(row_reduction.row_sum_max)(x)
    np.testing.assert_allclose(got_sum, jnp.sum(x, axis=1), **F32_TOL)
    np.testing.assert_array_equal(got_max, jnp.max(x, axis=1))


# --- flash attention ------------------------------------------------------------------------------


@pytest.mark.parametrize(("seq_q", "seq_k", "d", "block_q", "block_k"),
                         [(1024, 1024, 64, 128, 128), (256, 512, 32, 64, 128),
                          (128, 64, 16, 128, 16)])
def test_flash_attention(seq_q: int, seq_k: int, d: int, block_q: int, block_k: int) -> None:
    """Online softmax over KV blocks read with ``pl.ds`` matches exact attention."""
    q, k, v = rand(0, (seq_q, d)), rand(1, (seq_k, d)), rand(2, (seq_k, d))
    got = flash_attention.flash_attention(q, k, v, block_q=block_q, block_k=block_k)
    np.testing.assert_allclose(got, flash_attention.attention_reference(q, k, v), **ATTN_TOL)


def test_flash_attention_jit_scaled_bf16() -> None:
    """bfloat16 operands and an explicit scale, under ``jit``."""
    q, k, v = (rand(s, (256, 64), jnp.bfloat16) for s in range(3))
    fn = jax.jit(functools.partial(flash_attention.flash_attention, scale=0.5))
    got = fn(q, k, v)
    assert got.dtype == jnp.bfloat16
    want = flash_attention.attention_reference(q, k, v, scale=0.5)
    np.testing.assert_allclose(got.astype(jnp.float32), want, rtol=2e-2, atol=2e-2)


def test_multi_head_attention() -> None:
    """``vmap`` of the single-head kernel over heads."""
    q, k, v = (rand(s, (4, 256, 64)) for s in range(3))
    got = vmap_attention.multi_head_attention(q, k, v)
    np.testing.assert_allclose(got, flash_attention.attention_reference(q, k, v), **ATTN_TOL)


def test_batched_multi_head_attention_jit() -> None:
    """Nested ``vmap`` over batch and heads, under ``jit``."""
    q, k, v = (rand(s, (2, 3, 128, 32)) for s in range(3))
    got = jax.jit(vmap_attention.batched_multi_head_attention)(q, k, v)
    np.testing.assert_allclose(got, flash_attention.attention_reference(q, k, v), **ATTN_TOL)


def test_multi_query_attention() -> None:
    """Query heads batched, K and V shared (``in_axes=(0, None, None)``)."""
    q, k, v = rand(0, (4, 256, 64)), rand(1, (256, 64)), rand(2, (256, 64))
    got = vmap_attention.multi_query_attention(q, k, v)
    want = jnp.stack([flash_attention.attention_reference(q[h], k, v) for h in range(4)])
    np.testing.assert_allclose(got, want, **ATTN_TOL)


# --- autodiff through jax.custom_vjp ------------------------------------------------------------


def _silu_fwd_kernel(x_ref, o_ref):
    x = x_ref[...]
    o_ref[...] = x * jax.nn.sigmoid(x)


def _silu_bwd_kernel(x_ref, g_ref, dx_ref):
    x = x_ref[...]
    s = jax.nn.sigmoid(x)
    dx_ref[...] = g_ref[...] * s * (1 + x * (1 - s))


def _elementwise_call(kernel: object, x: jax.Array, n_in: int, block: int = 128) -> object:
    spec = pl.BlockSpec((block,), lambda i: (i,))
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(pl.cdiv(x.shape[0], block),), in_specs=[spec] * n_in,
                          out_specs=spec)


@jax.custom_vjp
def pallas_silu(x: jax.Array) -> jax.Array:
    """``x * sigmoid(x)`` for 1-D ``x``; forward and backward are pallas kernels."""
    return _elementwise_call(_silu_fwd_kernel, x, 1)(x)


def _pallas_silu_fwd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return pallas_silu(x), x


def _pallas_silu_bwd(x: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    return (_elementwise_call(_silu_bwd_kernel, x, 2)(x, g),)


pallas_silu.defvjp(_pallas_silu_fwd, _pallas_silu_bwd)


def test_custom_vjp_grad_matches_jnp() -> None:
    """``jax.grad`` through a custom_vjp whose forward and backward are pallas kernels."""
    x = rand(0, (1000,)) * 3

    def loss_pallas(x: jax.Array) -> jax.Array:
        return jnp.sum(pallas_silu(x) ** 2)

    def loss_jnp(x: jax.Array) -> jax.Array:
        return jnp.sum(jax.nn.silu(x) ** 2)

    np.testing.assert_allclose(pallas_silu(x), jax.nn.silu(x), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jax.grad(loss_pallas)(x), jax.grad(loss_jnp)(x),
                               rtol=1e-5, atol=1e-5)
    got = jax.jit(jax.value_and_grad(loss_pallas))(x)
    want = jax.value_and_grad(loss_jnp)(x)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)


def test_custom_vjp_under_vmap() -> None:
    """Per-example gradients: ``vmap`` of ``grad`` through the custom_vjp kernels."""
    x = rand(0, (3, 256))
    got = jax.vmap(jax.grad(lambda r: jnp.sum(pallas_silu(r))))(x)
    want = jax.vmap(jax.grad(lambda r: jnp.sum(jax.nn.silu(r))))(x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_grad_without_custom_vjp_names_the_fix() -> None:
    """A bare pallas_call has no reverse-mode derivative: the error points at jax.custom_vjp."""
    x = rand(0, (256,))
    with pytest.raises(pl.AutodiffError, match="custom_vjp"):
        jax.grad(lambda x: jnp.sum(_elementwise_call(_silu_fwd_kernel, x, 1)(x)))(x)


# --- shard_map ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh() -> jax.sharding.Mesh:
    """A 1-D mesh ``"x"`` over the eight host CPU devices that conftest.py asks for."""
    if len(jax.devices()) != 8:
        pytest.fail(f"expected 8 CPU devices (XLA_FLAGS set in tests/conftest.py before jax "
                    f"is imported), found {len(jax.devices())}: was jax imported earlier?")
    return shard_map_add.make_mesh()


def test_shard_map_add(mesh: jax.sharding.Mesh) -> None:
    """Each of the 8 devices runs the kernel on its row shard (eager and jitted)."""
    x, y = rand(0, (8 * 128, 256)), rand(1, (8 * 128, 256))
    xs, ys = shard_map_add.shard_rows(x, mesh), shard_map_add.shard_rows(y, mesh)
    got = shard_map_add.sharded_add(xs, ys, mesh)
    np.testing.assert_array_equal(got, x + y)
    got = jax.jit(functools.partial(shard_map_add.sharded_add, mesh=mesh))(xs, ys)
    np.testing.assert_array_equal(got, x + y)
    assert len(got.sharding.device_set) == 8


def test_shard_map_uneven_local_blocks(mesh: jax.sharding.Mesh) -> None:
    """Local shards that the block does not divide (100 rows per device, 64-row blocks)."""
    x, y = rand(0, (8 * 100, 200)), rand(1, (8 * 100, 200))
    xs, ys = shard_map_add.shard_rows(x, mesh), shard_map_add.shard_rows(y, mesh)
    fn = jax.shard_map(functools.partial(shard_map_add.local_add, block=(64, 128)), mesh=mesh,
                       in_specs=(shard_map_add.ROWS, shard_map_add.ROWS),
                       out_specs=shard_map_add.ROWS)
    np.testing.assert_array_equal(jax.jit(fn)(xs, ys), x + y)


EXAMPLE_MODULES = (vector_add, iota, matmul_2x2, blocked_add_uneven, matmul_activation,
                   matmul_3d_grid, softmax, row_reduction, flash_attention, vmap_attention,
                   shard_map_add)


@pytest.mark.parametrize("module", EXAMPLE_MODULES,
                         ids=[m.__name__.rsplit(".", 1)[-1] for m in EXAMPLE_MODULES])
def test_example_main(module: object, capsys: pytest.CaptureFixture[str]) -> None:
    """Each example's ``main()`` (what ``examples/run_all.py`` runs) passes its own check."""
    module.main()
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{module.__name__.rsplit('.', 1)[-1]}: OK"), line
