"""The Mosaic TPU emulator: kernels lowered for TPU (by this backend and by
jax.experimental.pallas), their ``tpu_custom_call`` executed with numpy by ``pl.emulate``, and
compared with jax.numpy on random inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jax_pl
from jax.experimental.pallas import tpu as jax_pltpu

import pallas_core as pl
from pallas_core import _jax
from pallas_core.errors import PallasError, UnsupportedError

pltpu = pytest.importorskip("pallas_mosaic_tpu")
import test_tpu_lowering as seeds  # noqa: E402

BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
MODULES = [pytest.param(pl, id="ours"), pytest.param(jax_pl, id="jax")]


def _tpu(m: Any) -> Any:
    return pltpu if m is pl else jax_pltpu


def _x(shape: tuple[int, ...], seed: int = 0, dtype: Any = F32) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _emulate(f: Callable[..., Any], *args: Any, seed: int | None = None) -> Any:
    # JAX's lowering asks which chip it lowers for; name one (no TPU is attached here).
    with _jax.assume_device("TPU v5 lite", "tpu"):
        return pl.emulate(f, backend="mosaic_tpu", seed=seed)(*args)


def _params(m: Any, *semantics: str) -> dict[str, Any]:
    return {"compiler_params": _tpu(m).CompilerParams(dimension_semantics=semantics)}


# --- the seed kernels of test_tpu_lowering ---------------------------------------------------

def _seed_cases() -> dict[str, tuple[Callable[[Any], Any], list[Any], Callable[..., Any]]]:
    q, k, v = (_x((256, 128), s) for s in range(3))
    a, b = _x((256, 256), 3, BF16), _x((256, 256), 4, BF16)
    xs = _x((48, 128), 5)
    r = _x((16, 128), 6)
    rows = r.reshape(2, 8, 128)
    return {
        "blocked_add": (seeds.blocked_add, [_x((16, 256), 7), _x((16, 256), 8)],
                        lambda x, y: x + y),
        "matmul_3d_bf16": (seeds.matmul_3d, [a, b],
                           lambda x, y: jnp.dot(x, y, preferred_element_type=F32)),
        "softmax": (seeds.softmax, [_x((32, 256), 9)], lambda x: jax.nn.softmax(x, axis=1)),
        "flash_attention": (seeds.flash_attention, [q, k, v],
                            lambda q, k, v: jax.nn.softmax(q @ k.T, axis=1) @ v),
        "prefetch_gather": (seeds.prefetch_gather, [jnp.asarray(seeds.IDX), xs],
                            lambda i, x: jnp.concatenate([x[8 * j:8 * j + 8] for j in i]) * 2),
        "dma_copy": (seeds.dma_copy, [r[:8]], lambda x: x + 1.0),
        "dma_copy_hbm": (seeds.dma_copy_hbm, [r[:8]], lambda x: x + 1.0),
        "row_writes": (seeds.row_writes, [r], lambda x: jnp.concatenate(
            [rows[:, :1] * 2.0, rows[:, 1:2] + 1.0, rows[:, 2:] - 1.0], axis=1).reshape(16, 128)),
    }


SEEDS = _seed_cases()


@pytest.mark.parametrize("m", MODULES)
@pytest.mark.parametrize("name", sorted(SEEDS))
def test_seed_kernels(name: str, m: Any) -> None:
    build, args, want = SEEDS[name]
    tol = 2e-2 if "bf16" in name else 1e-5
    np.testing.assert_allclose(_emulate(build(m), *args), want(*args), rtol=tol, atol=tol)


def test_core_kernel_of_ours() -> None:
    c = _x((8, 128), 1)
    np.testing.assert_array_equal(_emulate(seeds.core_kernel(pl), c), c)
