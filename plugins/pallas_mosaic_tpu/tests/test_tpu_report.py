"""``pl.report`` for Mosaic TPU kernels: bytes against closed forms, flops against XLA's own
count, the seed's roofline arithmetic on v5e, and the on-chip footprint against what the
lowering refuses."""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import pallas_core as pl
from tests.xla_cost import xla_flops

pltpu = pytest.importorskip("pallas_mosaic_tpu")

N = 4096


def _matmul(a: Any, b: Any, *, block: int) -> Any:
    """The seed's blocked matmul (``examples/report_matmul.py``): grid (i, j, k) with k
    innermost, a float32 accumulator, ``block`` square blocks."""
    from examples.report_matmul import matmul

    return matmul(a, b, bm=block, bn=block, bk=block)


A = jax.ShapeDtypeStruct((N, N), jnp.bfloat16)


def test_the_seeds_matmul_on_v5e() -> None:
    """4096^3 in bfloat16 with 512 blocks: ridge 240 FLOPs/byte (197 TFLOP/s over 819 GB/s),
    every step fetches an A and a B block (k is innermost), C is written once per (i, j)."""
    (k,) = pl.report(functools.partial(_matmul, block=512), A, A, target="v5e").kernels
    steps = (N // 512) ** 3
    assert k.grid == (8, 8, 8)
    assert round(k.roofline["v5e"].ridge) == 240
    assert k.hbm_bytes == steps * 2 * (512 * 512 * 2) + N * N * 2
    a, b, c = k.operands
    assert (a.blocks, b.blocks, c.blocks, c.skipped) == (steps, steps, 64, steps - 64)
    assert k.matmul_flops == 2 * N ** 3
    xla = xla_flops(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32), A, A)
    assert abs(k.flops - xla) <= 0.1 * xla
    line = k.roofline["v5e"]
    assert line.intensity == pytest.approx(k.flops / k.hbm_bytes)
    assert line.compute_seconds == pytest.approx(2 * N ** 3 / 1.97e14, rel=0.01)
    assert line.bound == "compute"
    assert line.seconds == max(line.compute_seconds, line.memory_seconds)


@pytest.mark.parametrize("block, bound", [(512, "compute"), (256, "memory"), (128, "memory")])
def test_smaller_blocks_move_the_matmul_below_the_ridge(block: int, bound: str) -> None:
    """Halving the block halves the intensity (each block is fetched twice as often)."""
    (k,) = pl.report(functools.partial(_matmul, block=block), A, A, target="v5e").kernels
    assert k.roofline["v5e"].bound == bound
    assert k.roofline["v5e"].intensity == pytest.approx(
        2 * N ** 3 / (2 * (N ** 3 // block) * 2 + N * N * 2), rel=0.01)


def test_the_blocked_add_moves_each_array_once_with_edge_blocks_clipped() -> None:
    def add(x: Any, y: Any) -> Any:
        spec = pl.BlockSpec((16, 128), lambda i, j: (i, j))
        return pl.pallas_call(lambda x_ref, y_ref, o_ref: o_ref.__setitem__(
            ..., x_ref[...] + y_ref[...]), jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(pl.cdiv(50, 16), pl.cdiv(300, 128)), in_specs=[spec, spec],
            out_specs=spec, backend="mosaic_tpu")(x, y)

    x = jax.ShapeDtypeStruct((50, 300), jnp.float32)
    (k,) = pl.report(add, x, x).kernels
    assert k.hbm_bytes == 3 * 50 * 300 * 4
    assert k.flops == k.vector_flops == 4 * 3 * 16 * 128  # per step a whole block is added
    assert [o.blocks for o in k.operands] == [12, 12, 12]


def test_a_block_kept_over_the_inner_axis_is_fetched_once_per_row() -> None:
    def f(x: Any, w: Any) -> Any:
        return pl.pallas_call(
            lambda x_ref, w_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * w_ref[...]),
            jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4, 3),
            in_specs=[pl.BlockSpec((8, 128), lambda i, j: (i, j)),
                      pl.BlockSpec((8, 128), lambda i, j: (i, 0))],
            out_specs=pl.BlockSpec((8, 128), lambda i, j: (i, j)), backend="mosaic_tpu")(x, w)

    (k,) = pl.report(f, jax.ShapeDtypeStruct((32, 384), jnp.float32),
                     jax.ShapeDtypeStruct((32, 128), jnp.float32)).kernels
    x, w, o = k.operands
    assert (x.blocks, w.blocks, w.skipped, o.blocks) == (12, 4, 8, 12)
    assert w.hbm_bytes == 32 * 128 * 4


def test_the_footprint_is_what_the_lowering_refuses() -> None:
    """A kernel the report says does not fit is refused by the lowering with the same total;
    one that fits lowers."""
    def copy(x: Any, block: int) -> Any:
        spec = pl.BlockSpec((block, 1024), lambda i: (i, 0))
        return pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
                              jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4096 // block,),
                              in_specs=[spec], out_specs=spec, backend="mosaic_tpu")(x)

    x = jax.ShapeDtypeStruct((4096, 1024), jnp.float32)
    (big,) = pl.report(functools.partial(copy, block=2048), x).kernels
    assert big.fits is False and big.onchip_bytes == 4 * 2048 * 1024 * 4
    assert big.onchip_limit == 16 * 2**20
    assert any("refuses this kernel" in n and "vmem_limit_bytes=33554432" in n
               for n in big.notes)
    with pytest.raises(pl.PallasError, match=re.escape(f"{big.onchip_bytes / 2**20:.2f} MiB")):
        pl.stages(functools.partial(copy, block=2048), x)
    # What to change: the limit to ask for (v5e has 128 MiB of VMEM), or the blocks; both
    # are taken up here and then fit.
    assert big.limit_needed == 32 * 2**20
    assert any("vmem_limit_bytes=33554432" in n and "to fit" in n for n in big.notes)
    assert {(name, new) for name, _, new in big.smaller_blocks} == {
        ("input 0 (x_ref)", (1024, 1024)), ("output 0 (o_ref)", (1024, 1024))}
    (halved,) = pl.report(functools.partial(copy, block=1024), x).kernels
    assert halved.fits is True and not halved.smaller_blocks and halved.limit_needed is None
    (small,) = pl.report(functools.partial(copy, block=512), x).kernels
    assert small.fits is True and small.onchip_bytes == 4 * 512 * 1024 * 4
    assert pl.stages(functools.partial(copy, block=512), x)[0]["mosaic"]


def test_chips_are_compared_and_unknown_ones_refused() -> None:
    rep = pl.report(functools.partial(_matmul, block=512), A, A, target=["v5e", "v6e", "v7x"])
    (k,) = rep.kernels
    assert set(k.roofline) == {"v5e", "v6e", "v7x"}
    assert k.roofline["v6e"].ridge > k.roofline["v5e"].ridge
    text = str(rep)
    assert "v6e" in text and "compute" in text and "VMEM" in text
    with pytest.raises(pl.ArgumentError, match="not a chip"):
        pl.report(functools.partial(_matmul, block=512), A, A, target="v99")


def test_a_kernel_reported_unchecked_is_still_checked_when_called() -> None:
    """The report traces kernels without the backend's refusal; a later call of the same
    pallas_call still meets it."""
    spec = pl.BlockSpec((2048, 1024), lambda i: (i, 0))
    copy = pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
                          jax.ShapeDtypeStruct((4096, 1024), jnp.float32), grid=(2,),
                          in_specs=[spec], out_specs=spec, backend="mosaic_tpu")
    x = jax.ShapeDtypeStruct((4096, 1024), jnp.float32)
    assert pl.report(copy, x).kernels[0].fits is False
    with pytest.raises(pl.PallasError, match="MiB of VMEM"):
        jax.jit(copy).trace(x)
