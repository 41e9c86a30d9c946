"""``pl.autotune`` without hardware on JAX's kernel library: how much of each kernel's natural
block-size space the pruner removes, what the model picks on each chip, and how long it takes.

Each kernel is JAX's own (ported, only its Pallas imports rewritten, as the tests load it),
tuned over the block sizes it takes, for production shapes given as ``ShapeDtypeStruct``s, on
v5e and v6e (Mosaic TPU). Nothing is compiled but what ``pl.report`` traces; nothing runs.

Run: ``python benchmarks/autotune_library.py`` (prints a Markdown table for RESULTS.md).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp

import pallas_core as pl
from tests.jax_library import porting

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16
BLOCKS = [128, 256, 512, 1024, 2048]

Case = tuple[str, Callable[..., Any], Any, list[Any]]
"""(label, build, space, argument structs)."""


def _matmul(n: int) -> Case:
    mm = porting.ported("tpu.matmul")

    def build(bm: int, bn: int, bk: int) -> Any:
        return functools.partial(mm.matmul, block_shape=(bm, bn), block_k=bk)

    return (f"tpu.matmul {n}^3 bf16", build, {"bm": BLOCKS, "bn": BLOCKS, "bk": BLOCKS},
            [S((n, n), BF16), S((n, n), BF16)])


def _flash(seq: int, causal: bool) -> Case:
    flash = porting.ported("tpu.flash_attention")

    def build(block_q: int, block_k_major: int, block_k: int) -> Any:
        blocks = flash.BlockSizes(block_q=block_q, block_k_major=block_k_major,
                                  block_k=block_k, block_b=1)
        return functools.partial(flash.flash_attention, causal=causal, sm_scale=0.088,
                                 block_sizes=blocks)

    space = {"block_q": BLOCKS[:4], "block_k_major": BLOCKS[:4], "block_k": BLOCKS[:4]}
    return (f"tpu.flash_attention 4x16x{seq}x128 bf16{' causal' if causal else ''}", build,
            space, [S((4, 16, seq, 128), BF16)] * 3)


def _gmm() -> Case:
    gmm = porting.ported("tpu.megablox.gmm")
    groups = jnp.full((8,), 1024, jnp.int32)

    def build(tm: int, tk: int, tn: int) -> Any:
        return lambda lhs, rhs: gmm.gmm(lhs, rhs, groups, tiling=(tm, tk, tn))

    return ("tpu.megablox gmm 8192x4096x4096 bf16, 8 groups", build,
            {"tm": BLOCKS[:4], "tk": BLOCKS[:4], "tn": BLOCKS[:4]},
            [S((8192, 4096), BF16), S((8, 4096, 4096), BF16)])


CASES = [_matmul(4096), _matmul(8192), _flash(4096, False), _flash(4096, True), _gmm()]


def main() -> None:
    print(f"jax {jax.__version__}, {time.strftime('%Y-%m-%d')}")
    print("| kernel | chip | configs | pruned | best | bound | predicted | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for label, build, space, args in CASES:
        for chip in ("v5e", "v6e"):
            start = time.perf_counter()
            result = pl.autotune(build, space, *args, backend="mosaic_tpu", target=chip,
                                 progress=False)
            took = time.perf_counter() - start
            pruned = sum(r.verdict == "pruned" for r in result.table)
            best = next(r for r in result.table if r.config == result.best)
            print(f"| {label} | {chip} | {len(result.table)} | {pruned} | "
                  f"{', '.join(f'{k}={v}' for k, v in result.best.items())} | {best.bound} | "
                  f"{best.predicted_seconds * 1e6:.0f} us | {took:.1f} |")


if __name__ == "__main__":
    main()
