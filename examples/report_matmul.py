"""The seed's blocked matmul for Mosaic TPU, to look at with ``pl.report`` (nothing runs).

Grid ``(i, j, k)`` with ``k`` innermost and 512 x 512 blocks: each step fetches an A and a B
block, the output block stays on chip while ``k`` runs (a float32 accumulator in VMEM) and
is written back once per ``(i, j)``. The page of pictures the docs show comes from::

    python -m pallas_core report examples.report_matmul:matmul --backend mosaic_tpu \\
        --target v5e --target v6e --out kernel.html 'bf16[4096,4096]' 'bf16[4096,4096]'

``python examples/report_matmul.py`` prints the same report. Needs pallas-mosaic-tpu (no TPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_core as pl

BLOCK = 512


def matmul(a: jax.Array, b: jax.Array, *, bm: int = BLOCK, bn: int = BLOCK,
           bk: int = BLOCK) -> jax.Array:
    """``a @ b`` in ``a``'s dtype through Mosaic TPU, in ``(bm, bk) x (bk, bn)`` blocks
    (each size a multiple of its blocks; the tests and ``pl.autotune``'s docs vary them)."""
    import pallas_mosaic_tpu as pltpu

    (m, k), n = a.shape, b.shape[1]

    def kernel(a_ref, b_ref, o_ref, acc_ref):
        @pl.when(pl.program_id(2) == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        acc_ref[...] += jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)

        @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
        def _():
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    return pl.pallas_call(
        kernel, jax.ShapeDtypeStruct((m, n), a.dtype),
        grid=(m // bm, n // bn, k // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                  pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        backend="mosaic_tpu")(a, b)


def main() -> None:
    """Prints the report of a 4096 x 4096 bfloat16 product on v5e and v6e."""
    a = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    print(pl.report(matmul, a, a, target=["v5e", "v6e"]))


if __name__ == "__main__":
    main()
