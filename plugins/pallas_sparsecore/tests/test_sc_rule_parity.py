"""Every primitive JAX's own Mosaic lowering has a SparseCore rule for (vector and scalar
subcores) has one here, or is named below: with what this project has instead, or as a known
gap. JAX's registry is read through the core's adapter, so upgrading JAX fails this test
until each new primitive is lowered or listed; lowering a listed gap fails it until the entry
goes."""

from __future__ import annotations

import jax.experimental.pallas.tpu  # registers JAX's pipeline rules
import jax.experimental.pallas.tpu_sc  # noqa: F401  (registers JAX's SparseCore primitives)
import pytest
from pallas_sparsecore import plugin

from pallas_core import backend as plb

EQUIVALENTS = {
    "barrier": "sc_subcore_barrier", "dma_start": "copy_start", "dma_wait": "copy_wait",
    "cumsum": "sc_cumsum", "masked_cumsum": "sc_cumsum", "masked_cummax": "sc_cummax",
    "load": "sc_load_gather", "scatter": "sc_store_scatter", "sort": "sc_sort_key_val",
    "masked_sort": "sc_sort_key_val", "masked_cummin": "sc_cummin",
    # JAX 0.10 names its scan_count primitive "unique".
    "unique": "sc_scan_count",
}
"""JAX's primitive -> this plugin's for the same operation (its ``plsc`` primitives are named
``sc_<name>``: ``pack`` is ``sc_pack``, ``parallel_loop`` ``sc_parallel_loop``, ...)."""

OTHER_MEANS = {
    "add_dependency": "pltpu.touch emits nothing (kernels here access Refs in program order), "
                      "as JAX's rule for its primitive emits nothing",
    "bitcast": "tpu_bitcast (pltpu.bitcast)",
    "emit_pipeline": "pltpu.emit_pipeline is traced into the kernel body (its loops, VMEM "
                     "buffers and DMAs), as JAX traces it by default (its primitive, behind "
                     "jax_use_emit_pipeline_primitive, lowers by expanding into the same)",
    "pipeline_body": "see emit_pipeline",
    "get_barrier_semaphore": "pltpu.get_barrier_semaphore() makes the kernel take the barrier "
                             "semaphore as a hidden operand, lowered to tpu.sem_barrier",
    "has_memory_space": "tpu_has_memory_space (pltpu.has_memory_space)",
    "trace_value": "tpu_trace_value (pltpu.trace_value)",
}
"""JAX primitives whose feature this project provides under another primitive, or without
one (traced into the kernel, or a hidden operand)."""

KNOWN_GAPS: set[str] = set()
"""Known gaps: lowering any of these raises an UnsupportedError naming it (none today)."""

KINDS = ["sc_vector_subcore", "sc_scalar_subcore"]


def _ours() -> set[str]:
    return {p.name for p in plugin.lowering_rules()}


@pytest.mark.parametrize("kind", KINDS)
def test_every_jax_rule_is_lowered_or_listed(kind: str) -> None:
    theirs = plb.jax_lowering_rule_names("mosaic_tpu")[kind]
    ours = _ours()
    unlisted = sorted(n for n in theirs - ours if f"sc_{n}" not in ours
                      and EQUIVALENTS.get(n) not in ours
                      and n not in OTHER_MEANS and n not in KNOWN_GAPS)
    assert not unlisted, f"JAX lowers {unlisted} for SparseCore; lower them or list them here"


def test_listed_names_are_current() -> None:
    closed = sorted(n for n in KNOWN_GAPS if n in _ours() or f"sc_{n}" in _ours())
    assert all(v in _ours() for v in EQUIVALENTS.values())
    assert not closed, f"{closed} lower now: take them off KNOWN_GAPS"
    assert all("tpu_" + n in _ours() for n in ("bitcast", "has_memory_space", "trace_value"))
