"""``pl.report`` on JAX's own kernel library (ported, imports rewritten), on every backend that
lowers it: every kernel gets a report; flops against XLA's own count of the dense reference;
flash attention's HBM bytes against closed forms; the work a causal kernel skips against a
count made here, block pair by block pair."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl
from tests.jax_library import porting
from tests.xla_cost import xla_flops

pltpu = pytest.importorskip("pallas_mosaic_tpu")
from tests.jax_library import test_tpu_library_lowering as tpu_cases  # noqa: E402

S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("name", list(tpu_cases.CASES))
def test_every_tpu_library_kernel_gets_a_report(name: str) -> None:
    fn, args = tpu_cases.CASES[name](porting.ported)
    rep = pl.report(fn, *args, backend="mosaic_tpu", target=["v5e", "h100"])
    assert len(rep) >= 1
    for k in rep:
        assert k.backend == "mosaic_tpu" and set(k.roofline) == {"v5e", "h100"}
        assert k.hbm_bytes > 0 and k.fits is True
        # Work of some kind: flops, or integer operations (a PRNG's rounds, all_gather's
        # index arithmetic).
        assert k.flops + k.transcendentals + k.integer_ops > 0
        assert not any("refuses" in n for n in k.notes), k.notes
        for line in k.roofline.values():
            assert line.seconds == max(line.compute_seconds, line.memory_seconds) > 0
    assert "kernel" in str(rep)


def test_the_library_matmul_flops_are_xlas() -> None:
    mm = porting.ported("tpu.matmul")
    a, b = S((512, 1024), jnp.float32), S((1024, 768), jnp.float32)
    (k,) = pl.report(functools.partial(mm.matmul, block_shape=(128, 128), block_k=256),
                     a, b).kernels
    xla = xla_flops(jnp.dot, a, b)
    assert k.matmul_flops == 2 * 512 * 1024 * 768
    assert abs(k.flops - xla) <= 0.1 * xla


B, H, SEQ, D = 1, 2, 512, 128
BLOCK = 128
QKV = [S((B, H, SEQ, D), jnp.float32)] * 3


def _flash(causal: bool) -> Any:
    flash = porting.ported("tpu.flash_attention")
    blocks = flash.BlockSizes(block_q=BLOCK, block_k_major=BLOCK, block_k=BLOCK, block_b=1)
    return flash, functools.partial(flash.flash_attention, causal=causal, sm_scale=0.125,
                                    block_sizes=blocks)


def test_flash_attention_flops_are_xlas_and_its_bytes_the_closed_form() -> None:
    flash, fn = _flash(causal=False)
    (k,) = pl.report(fn, *QKV, target="v5e").kernels
    n = SEQ // BLOCK
    assert k.grid == (B, H, n, n)
    # q and o: one block per (b, h, q block), kept over the kv axis; k and v: a block at
    # every step (the kv index changes at each one).
    block = BLOCK * D * 4
    assert k.hbm_bytes == B * H * n * (2 * block + 2 * n * block)
    xla = xla_flops(functools.partial(flash.mha_reference, ab=None, sm_scale=0.125), *QKV)
    assert abs(k.flops - xla) <= 0.1 * xla
    assert k.skipped_flops == 0


def test_causal_flash_attention_counts_only_the_blocks_it_runs() -> None:
    _, fn = _flash(causal=True)
    (k,) = pl.report(fn, *QKV, target="v5e").kernels
    n = SEQ // BLOCK
    run = sum(1 for qi in range(n) for kj in range(n) if kj * BLOCK <= qi * BLOCK + BLOCK - 1)
    per_block = 2 * (2 * BLOCK * BLOCK * D)  # q @ k.T and p @ v
    assert k.matmul_flops == B * H * run * per_block
    assert k.skipped_fraction > 0.3
    assert any("decided per grid step" in note for note in k.notes)
    # The index maps keep the last kv block (0) where a step is skipped: those fetches are
    # skipped too. Counted here step by step from the order the grid runs in.
    kv_fetches, previous = 0, None
    for _ in range(B * H):
        for qi in range(n):
            for kj in range(n):
                index = kj if kj * BLOCK <= qi * BLOCK + BLOCK - 1 else 0
                kv_fetches += index != previous
                previous = index
        previous = None  # the (b, h) index changes
    block = BLOCK * D * 4
    assert k.hbm_bytes == B * H * n * 2 * block + 2 * kv_fetches * block


def test_scalar_prefetch_and_a_dynamic_grid_follow_the_values_given() -> None:
    """Megablox's grouped matmul picks its tiles by group tables computed from the group
    sizes, and runs a grid as long as the tiles the groups touch: given the sizes, the report
    follows them; given only their type, it samples the tables and says so."""
    fn, args = tpu_cases.CASES["megablox_gmm"](porting.ported)
    (given,) = pl.report(fn, *args, backend="mosaic_tpu").kernels
    # Groups of 10, 0, 30 and 24 rows in tiles of 16 rows: 1 + 3 + 2 tiles (a tile that two
    # groups share is visited once for each); 2 column tiles of 128, one K tile.
    assert given.grid == (2, 6, 1)
    assert given.matmul_flops == 2 * 6 * (2 * 16 * 128 * 128)
    lhs = next(o for o in given.operands if o.role == "input" and o.block_shape == (16, 128))
    assert lhs.index_source == "given"
    # The row tile of each step, as the group tables say: 0, then 0 1 2, then 2 3.
    assert list(lhs.block_indices[:6, 0]) == [0, 0, 1, 2, 2, 3]
    structs = [S(np.shape(a), np.asarray(a).dtype) for a in args]
    (sampled,) = pl.report(jax.jit(fn), *structs, backend="mosaic_tpu").kernels
    assert sampled.steps is None
    assert any("dynamic sizes" in n for n in sampled.notes)
    assert not any("dynamic sizes" in n or "drawn at random" in n for n in given.notes)


def test_scalar_prefetch_values_not_given_are_sampled() -> None:
    """An index map that picks rows by a table: given the table, the report follows it
    (fetches skipped where consecutive steps pick the same row); given only its type, it
    samples one and says so."""
    def gather_rows(idx: Any, x: Any) -> Any:
        spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(8,),
            in_specs=[pl.BlockSpec((8, 128), lambda i, idx_ref: (idx_ref[i], 0))],
            out_specs=pl.BlockSpec((8, 128), lambda i, idx_ref: (i, 0)))
        return pl.pallas_call(lambda idx_ref, x_ref, o_ref: o_ref.__setitem__(
            ..., x_ref[...] * 2.0), S((64, 128), x.dtype), grid_spec=spec,
            backend="mosaic_tpu")(idx, x)

    idx = np.array([0, 0, 1, 1, 1, 2, 0, 0], np.int32)
    x = S((64, 128), jnp.float32)
    (given,) = pl.report(gather_rows, idx, x).kernels
    rows = given.operands[1]
    assert rows.index_source == "given" and list(rows.block_indices[:, 0]) == list(idx)
    assert rows.blocks == 4 and rows.hbm_bytes == 4 * 8 * 128 * 4  # 0, 1, 2, 0
    assert given.operands[2].index_source == "grid"  # the output's map reads no table
    (sampled,) = pl.report(gather_rows, S((8,), jnp.int32), x).kernels
    assert sampled.operands[1].index_source == "sampled"
    assert any("drawn at random" in n for n in sampled.notes)
    assert not any("drawn at random" in n for n in given.notes)
