"""JAX's library kernels with their natural tuning spaces, for ``pl.autotune`` (its tests and
``benchmarks/autotune_library.py``).

Each :class:`Case` is one of JAX's kernels (ported: only its Pallas imports rewritten), a
``build(**config)`` over the tunables the kernel takes, the space of their values a kernel
author would search, and production-sized argument structs. The TPU kernels are tuned for
Mosaic TPU on v5e and v6e, the Triton kernels for Triton on H100.

JAX's Triton ``layer_norm`` chooses its block size and warps itself (and ignores the
``num_warps`` it is given), so its case launches JAX's forward kernel,
``layer_norm_forward_kernel``, with both as tunables, as ``layer_norm_forward`` does with its
heuristic's values.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from tests.jax_library import porting

S = jax.ShapeDtypeStruct
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
BLOCKS = [128, 256, 512, 1024, 2048]


@dataclasses.dataclass(frozen=True)
class Case:
    label: str
    backend: str
    chips: tuple[str, ...]
    build: Callable[..., Any]
    space: Mapping[str, Sequence[Any]]
    args: tuple[Any, ...]
    default: Mapping[str, Any] | None = None
    """The config JAX's kernel uses when given no tunables (its defaults or heuristic)."""

    @property
    def size(self) -> int:
        n = 1
        for choices in self.space.values():
            n *= len(choices)
        return n


_TPU = ("v5e", "v6e")
_GPU = ("h100",)


def tpu_matmul(n: int) -> Case:
    mm = porting.ported("tpu.matmul")

    def build(bm: int, bn: int, bk: int) -> Any:
        return functools.partial(mm.matmul, block_shape=(bm, bn), block_k=bk)

    return Case(f"tpu.matmul {n}^3 bf16", "mosaic_tpu", _TPU, build,
                {"bm": BLOCKS, "bn": BLOCKS, "bk": BLOCKS}, (S((n, n), BF16),) * 2,
                {"bm": 512, "bn": 512, "bk": 512})


def tpu_flash(seq: int, causal: bool) -> Case:
    flash = porting.ported("tpu.flash_attention")

    def build(block_q: int, block_k_major: int, block_k: int) -> Any:
        blocks = flash.BlockSizes(block_q=block_q, block_k_major=block_k_major,
                                  block_k=block_k, block_b=1)
        return functools.partial(flash.flash_attention, causal=causal, sm_scale=0.088,
                                 block_sizes=blocks)

    return Case(f"tpu.flash_attention 4x16x{seq}x128 bf16{', causal' if causal else ''}",
                "mosaic_tpu", _TPU, build,
                {"block_q": BLOCKS[:4], "block_k_major": BLOCKS[:4], "block_k": BLOCKS[:4]},
                (S((4, 16, seq, 128), BF16),) * 3,
                {"block_q": 128, "block_k_major": 128, "block_k": 128})


def tpu_gmm(m: int, k: int, n: int, groups: int) -> Case:
    gmm = porting.ported("tpu.megablox.gmm")
    sizes = jnp.full((groups,), m // groups, jnp.int32)

    def build(tm: int, tk: int, tn: int) -> Any:
        return lambda lhs, rhs: gmm.gmm(lhs, rhs, sizes, tiling=(tm, tk, tn))

    return Case(f"tpu.megablox gmm {m}x{k}x{n} bf16, {groups} groups", "mosaic_tpu", _TPU,
                build, {"tm": BLOCKS[:4], "tk": BLOCKS[:4], "tn": BLOCKS[:4]},
                (S((m, k), BF16), S((groups, k, n), BF16)), {"tm": 128, "tk": 128, "tn": 128})


def triton_attention(batch: int, seq: int, heads: int, dim: int, causal: bool) -> Case:
    att = porting.ported("gpu.attention")

    def build(block_q: int, block_k: int, num_warps: int, num_stages: int) -> Any:
        blocks = att.BlockSizes(block_q=block_q, block_k=block_k)
        return functools.partial(att.mha, segment_ids=None, causal=causal, block_sizes=blocks,
                                 num_warps=num_warps, num_stages=num_stages)

    return Case(f"gpu.attention mha {batch}x{seq}x{heads}x{dim} f16"
                f"{', causal' if causal else ''}", "triton", _GPU, build,
                {"block_q": [32, 64, 128, 256], "block_k": [32, 64, 128],
                 "num_warps": [4, 8], "num_stages": [2, 3]},
                (S((batch, seq, heads, dim), F16),) * 3,
                {"block_q": 128, "block_k": 128, "num_warps": 4, "num_stages": 2})


def triton_layer_norm(rows: int, cols: int, dtype: Any) -> Case:
    ln = porting.ported("gpu.layer_norm")
    pl, plgpu = ln.pl, ln.plgpu  # pallas_core and pallas_triton, as the ported module has them

    def build(block_size: int, num_warps: int) -> Any:
        kernel = functools.partial(ln.layer_norm_forward_kernel, eps=1e-5, block_size=block_size)
        n = S((cols,), dtype)
        call = pl.pallas_call(kernel, grid=(), name="ln_forward",
                              out_shape=[n, S((), dtype), S((), dtype)],
                              compiler_params=plgpu.CompilerParams(num_warps=num_warps))

        def run(x: Any, weight: Any, bias: Any) -> Any:
            return jax.vmap(call, in_axes=(0, None, None))(x, weight, bias)[0]

        return run

    name = jnp.dtype(dtype).name.replace("float", "f")
    block = min(max(min(65536 // jnp.dtype(dtype).itemsize, 1 << (cols - 1).bit_length()), 128),
                4096)
    return Case(f"gpu.layer_norm {rows}x{cols} {name}", "triton", _GPU, build,
                {"block_size": [128, 256, 512, 1024, 2048, 4096],
                 "num_warps": [1, 2, 4, 8, 16]},
                (S((rows, cols), dtype), S((cols,), dtype), S((cols,), dtype)),
                {"block_size": block, "num_warps": min(max(block // 256, 1), 8)})


def triton_softmax(rows: int, cols: int, dtype: Any) -> Case:
    sm = porting.ported("gpu.softmax")

    def build(num_warps: int) -> Any:
        return functools.partial(sm.softmax, num_warps=num_warps)

    name = jnp.dtype(dtype).name.replace("float", "f")
    return Case(f"gpu.softmax {rows}x{cols} {name}", "triton", _GPU, build,
                {"num_warps": [1, 2, 4, 8, 16, 32]}, (S((rows, cols), dtype),),
                {"num_warps": 4})


def tpu_cases() -> list[Case]:
    return [tpu_matmul(4096), tpu_matmul(8192), tpu_flash(4096, False), tpu_flash(4096, True),
            tpu_gmm(8192, 4096, 4096, 8)]


def triton_cases() -> list[Case]:
    return [triton_attention(4, 4096, 16, 64, False), triton_attention(4, 4096, 16, 64, True),
            triton_attention(2, 2048, 8, 128, False),
            triton_layer_norm(4096, 8192, F16), triton_layer_norm(16384, 1024, F32),
            triton_softmax(8192, 4096, F32), triton_softmax(32768, 1024, F16)]
