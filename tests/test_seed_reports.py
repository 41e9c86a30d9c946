"""``pl.report`` on every seed example (examples/*.py), for every backend installed here that
lowers it: each kernel is reported, none is refused, and where the example does the dense work
of its ``jax.numpy`` reference, its flops are within 10% of XLA's own count of that reference
(``jax.jit(reference).lower(...).cost_analysis()``)."""

from __future__ import annotations

import pytest

import pallas_core as pl
from pallas_core.plugins import manager
from tests.test_seed_examples_emulated import CASES
from tests.xla_cost import xla_flops

BACKENDS = [b for b in ("interpret", "mosaic_tpu", "triton") if b in manager.backends()]

DENSE = {"matmul_2x2", "matmul_3d_grid", "matmul_3d_grid_bf16", "matmul_activation",
         "flash_attention", "multi_head_attention", "batched_multi_head_attention",
         "multi_query_attention", "softmax", "row_reduction", "vector_add"}
"""Examples whose kernels do the work of their reference, no more (blocked_add_uneven adds
whole edge blocks; iota and shard_map_add do no arithmetic XLA counts)."""


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_seed_example_gets_a_report(name: str, backend: str) -> None:
    example, reference, inputs, _ = CASES[name]
    args = inputs()
    rep = pl.report(example, *args, backend=backend)
    assert len(rep) >= 1
    for k in rep:
        assert k.backend == backend
        # A report may say a kernel does not fit on chip (with the triton compiler
        # installed, the attention examples' default blocks need 448 KiB of shared memory on
        # an H100); any other refusal is a defect.
        assert not any("refuses" in n and "on chip" not in n for n in k.notes), k.notes
        assert k.hbm_bytes > 0
    if name in DENSE:
        xla = xla_flops(reference, *args)
        flops = sum(k.flops for k in rep)
        assert abs(flops - xla) <= 0.1 * xla, (flops, xla)
