"""The seed kernels compiled for NVIDIA GPUs on a machine without one.

Every kernel lowers for ``cuda`` into XLA's Triton custom call, and ``pl.stages`` compiles it
through the ``triton`` package to ``ttir``, ``ttgir``, ``llir``, ``ptx`` and ``cubin`` for
``sm_80`` and ``sm_90``. That the same kernels compute the right values is checked on the
interpreter by ``tests/test_seed_examples.py`` (and on a GPU when one is available).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

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
    softmax,
    vector_add,
    vmap_attention,
)

pytest.importorskip("triton", reason="compiling to PTX and cubin needs the triton package")
pallas_triton = pytest.importorskip("pallas_triton")

F32, BF16 = jnp.float32, jnp.bfloat16


def _rand(shape: tuple[int, ...], dtype: Any = F32, seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, F32).astype(dtype)


def _masked_copy(x: jax.Array) -> jax.Array:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        start = pl.program_id(0) * 128
        offs = start + jnp.arange(128)
        mask = offs < x.shape[0]
        v = pl.load(x_ref, (pl.ds(start, 128),), mask=mask, other=0.0)
        pl.store(o_ref, (pl.ds(start, 128),), v * 2.0, mask=mask)

    whole = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(pl.cdiv(x.shape[0], 128),), in_specs=[whole],
                          out_specs=whole)(x)


def _atomic_sum(x: jax.Array) -> jax.Array:
    def kernel(x_ref: Any, acc_ref: Any, o_ref: Any) -> None:
        pl.atomic_add(o_ref, (pl.ds(0, 128),), x_ref[...])

    return pl.pallas_call(
        kernel, jax.ShapeDtypeStruct((128,), F32), grid=(x.shape[0],),
        in_specs=[pl.BlockSpec((None, 128), lambda i: (i, 0)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        input_output_aliases={1: 0})(x, jnp.zeros((128,), F32))


def _grid_4d(x: jax.Array) -> jax.Array:
    """A 4-D grid (folded into Triton's one program axis), program ids in the values."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        ids = [pl.program_id(a).astype(F32) for a in range(4)]
        o_ref[...] = x_ref[...] + ids[0] * 1000 + ids[1] * 100 + ids[2] * 10 + ids[3]

    spec = pl.BlockSpec((None, None, None, 16, 32), lambda a, b, c, d: (a, b, c, d, 0))
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(*x.shape[:3], x.shape[3] // 16), in_specs=[spec],
                          out_specs=spec)(x)


def _grid_4d_reference(x: jax.Array) -> jax.Array:
    a, b, c, d = np.meshgrid(*[np.arange(n) for n in x.shape[:3]], np.arange(x.shape[3]) // 16,
                             indexing="ij")
    return x + (a * 1000 + b * 100 + c * 10 + d)[..., None].astype(np.float32)


def _while_and_print(x: jax.Array) -> jax.Array:
    """Halves until below 1 with lax.while_loop; prints the step and the count."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        def cond(c: Any) -> Any:
            return c[0] > 1.0

        def body(c: Any) -> Any:
            return c[0] * 0.5, c[1] + 1

        _, n = jax.lax.while_loop(cond, body, (jnp.max(jnp.abs(x_ref[...])), 0))
        pl.debug_print("step/count ", pl.program_id(0), n)
        o_ref[...] = x_ref[...] * n.astype(F32)

    spec = pl.BlockSpec((64,), lambda i: (i,))
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
                          in_specs=[spec], out_specs=spec)(x)


def _triton_only(x: jax.Array) -> jax.Array:
    """approx_tanh, inline PTX (with a reference for the interpreter), hints, a barrier."""
    def kernel(x_ref: Any, o_ref: Any) -> None:
        v = x_ref[...]
        t = pallas_triton.approx_tanh(v)
        (doubled,) = pallas_triton.elementwise_inline_asm(
            "add.f32 $0, $1, $1;", args=[t], constraints="=r,r", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(t.shape, t.dtype)],
            reference=lambda a: a + a)
        pallas_triton.debug_barrier()
        o_ref[...] = pallas_triton.max_contiguous(doubled, 16)

    return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


def _gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    def kernel(x_ref: Any, idx_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[idx_ref[...], :] * 2.0

    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((idx.shape[0], x.shape[1]), x.dtype))(
        x, idx)


def _attention_args() -> tuple[jax.Array, ...]:
    return tuple(_rand((256, 64), seed=s) for s in range(3))


CASES: dict[str, tuple[Callable[..., Any], Callable[[], tuple[jax.Array, ...]]]] = {
    "vector_add": (functools.partial(vector_add.vector_add, block_size=256),
                   lambda: (_rand((1024,)), _rand((1024,), seed=1))),
    "iota": (lambda: iota.iota(64), lambda: ()),
    "blocked_add_uneven": (blocked_add_uneven.blocked_add,
                           lambda: (_rand((300, 200)), _rand((300, 200), seed=1))),
    "matmul_2x2_f32": (matmul_2x2.matmul_2x2, lambda: (_rand((128, 64)), _rand((64, 128)))),
    "matmul_2x2_bf16": (matmul_2x2.matmul_2x2,
                        lambda: (_rand((128, 64), BF16), _rand((64, 128), BF16, 1))),
    "matmul_3d_f32": (functools.partial(matmul_3d_grid.matmul, block_m=64, block_n=64,
                                        block_k=32),
                      lambda: (_rand((128, 128)), _rand((128, 128), seed=1))),
    "matmul_3d_bf16": (functools.partial(matmul_3d_grid.matmul, block_m=64, block_n=64,
                                         block_k=32),
                       lambda: (_rand((128, 128), BF16), _rand((128, 128), BF16, 1))),
    "matmul_activation": (functools.partial(matmul_activation.matmul, activation=jax.nn.gelu),
                          lambda: (_rand((128, 128)), _rand((128, 128), seed=1))),
    "softmax": (softmax.softmax, lambda: (_rand((128, 256)),)),
    "row_reduction": (row_reduction.row_sum_max, lambda: (_rand((256, 128)),)),
    "flash_attention": (functools.partial(flash_attention.flash_attention, block_q=64,
                                          block_k=64), _attention_args),
    "vmap_multi_head": (vmap_attention.multi_head_attention,
                        lambda: tuple(_rand((2, 128, 64), seed=s) for s in range(3))),
    "vmap_nested_batch_heads": (vmap_attention.batched_multi_head_attention,
                                lambda: tuple(_rand((2, 2, 128, 64), seed=s) for s in range(3))),
    "grid_4d": (_grid_4d, lambda: (_rand((2, 3, 2, 32, 32)),)),
    "while_loop_and_print": (_while_and_print, lambda: (_rand((128,)) * 10.0,)),
    "triton_only_primitives": (_triton_only, lambda: (_rand((16, 128)),)),
    "masked_load_store": (_masked_copy, lambda: (_rand((1000,)),)),
    "gather_rows": (_gather_rows,
                    lambda: (_rand((64, 32)), jnp.array([3, 7, 0, 63, 5, 5, 9, 1], jnp.int32))),
    "atomics": (_atomic_sum, lambda: (_rand((4, 128)),)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_lowers_for_cuda_into_xla_triton_call(name: str) -> None:
    fn, make_args = CASES[name]
    text = jax.jit(fn).trace(*make_args()).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_compiles_to_cubin(name: str, target: str) -> None:
    fn, make_args = CASES[name]
    for stages in pl.stages(fn, *make_args(), backend="triton", target=target):
        assert list(stages.stages) == ["jaxpr", "stablehlo", "ttir", "ttgir", "llir", "ptx",
                                       "cubin"]
        assert "tt.func" in stages["ttir"]
        assert "__gpu$xla.gpu.triton" in stages["stablehlo"]
        assert f".target {target}" in stages["ptx"]
        assert isinstance(stages["cubin"], bytes) and len(stages["cubin"]) > 0


@pytest.mark.parametrize("target,instruction", [("sm_80", "mma.sync"), ("sm_90", "wgmma")])
def test_bf16_matmul_uses_tensor_cores(target: str, instruction: str) -> None:
    fn, make_args = CASES["matmul_3d_bf16"]
    (stages,) = pl.stages(fn, *make_args(), backend="triton", target=target)
    assert instruction in stages["ptx"]


def test_interpreter_and_jnp_agree_on_the_kernels_written_here() -> None:
    """The seed kernels from examples/ are checked by tests/test_seed_examples.py."""
    x = _rand((1000,))
    np.testing.assert_allclose(_masked_copy(x), x * 2.0, rtol=1e-6)
    rows = _rand((4, 128))
    np.testing.assert_allclose(_atomic_sum(rows), rows.sum(0), rtol=1e-5)
    g = _rand((2, 3, 2, 32, 32))
    np.testing.assert_allclose(_grid_4d(g), _grid_4d_reference(g), rtol=1e-6)
    w = _rand((128,)) * 10.0
    counts = [int(np.ceil(np.log2(max(float(jnp.max(jnp.abs(b))), 1.0))))
              for b in (w[:64], w[64:])]
    np.testing.assert_allclose(_while_and_print(w), w * np.repeat(counts, 64), rtol=1e-6)
    t = _rand((16, 128))
    np.testing.assert_allclose(_triton_only(t), 2 * jnp.tanh(t), rtol=1e-6)
    table, idx = CASES["gather_rows"][1]()
    np.testing.assert_allclose(_gather_rows(table, idx), table[idx] * 2.0, rtol=1e-6)


def test_triton_inline_asm_without_reference_is_refused_by_the_interpreter() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        (o_ref[...],) = pallas_triton.elementwise_inline_asm(
            "mov.b32 $0, $1;", args=[x_ref[...]], constraints="=r,r", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct((8,), F32)])

    with pytest.raises(pl.UnsupportedError, match=r"reference=.*Fix"):
        pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), F32))(jnp.ones(8))
