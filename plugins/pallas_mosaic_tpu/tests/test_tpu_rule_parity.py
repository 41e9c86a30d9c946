"""Every primitive JAX 0.10's own Mosaic TPU lowering has a rule for has one here, or is named
below: with what this project has instead, or as a known gap with its reason. JAX's registry is
read through the core's adapter, so upgrading JAX fails this test until each new primitive is
either lowered or listed; lowering a listed gap fails it until the entry goes."""

from __future__ import annotations

import jax.experimental.pallas.tpu  # noqa: F401  (registers JAX's einshape and pipeline rules)
import pytest
from pallas_mosaic_tpu import plugin

from pallas_core import backend as plb

_MXU = ("matmul_push_rhs", "matmul_acc_lhs", "matmul_pop", "matmul_lhs_fifo", "matmul_pop_fifo")
"""The hand-driven MXU (the last two new in JAX 0.11)."""

OTHER_MEANS = {
    "dma_start": "copy_start (pallas_core.copies: one primitive for every backend's DMAs)",
    "dma_wait": "copy_wait",
    "get_barrier_semaphore": "pltpu.get_barrier_semaphore() makes the kernel take the barrier "
                             "semaphore as a hidden scratch operand (tpu.sem_barrier)",
    "roll": "tpu_roll (pltpu.roll)",
    "bitcast": "tpu_bitcast (pltpu.bitcast)",
    "prng_seed": "tpu_prng_seed (pltpu.prng_seed)",
    "prng_random_bits": "tpu_prng_random_bits (pltpu.prng_random_bits)",
    "pack_elementwise": "tpu_pack_elementwise (pltpu.pack_elementwise)",
    "unpack_elementwise": "tpu_unpack_elementwise (pltpu.unpack_elementwise)",
    "stochastic_round": "tpu_stochastic_round (pltpu.stochastic_round)",
    "trace_value": "tpu_trace_value (pltpu.trace_value)",
    "has_memory_space": "tpu_has_memory_space (pltpu.has_memory_space)",
    "einshape_lo": "pltpu.einshape is a reshape and a transpose (their rules)",
    "emit_pipeline": "pltpu.emit_pipeline is traced into the kernel body (its loops and copies)",
    "pipeline_body": "see emit_pipeline",
    "debug_print": "the core's debug_print (pl.debug_print)",
    "add_dependency": "pltpu.touch emits nothing (kernels here access Refs in program order), "
                      "as JAX's rule for its primitive emits nothing",
    "prng_split": "keys of pltpu.to_pallas_key are jax.random's threefry keys here (the key "
                  "primitives lower them); JAX's split a key of its TPU-PRNG implementation",
    "prng_join": "see prng_split",
    "conv": "pltpu.conv is lax.conv_general_dilated (tpu.conv) plus its accumulator",
    **{n: f"tpu_{n} (pltpu.{n}, lowered to JAX's tpu.{n})" for n in _MXU},
}
"""JAX primitives whose feature this project provides under another primitive."""

KNOWN_GAPS: set[str] = set()
"""Known gaps: lowering any of these raises an UnsupportedError naming the primitive."""


def _ours() -> set[str]:
    return {p.name for p in plugin.lowering_rules()}


@pytest.mark.parametrize("kind", ["tc"])
def test_every_jax_rule_is_lowered_or_listed(kind: str) -> None:
    theirs = plb.jax_lowering_rule_names("mosaic_tpu")[kind]
    ours = _ours()
    unlisted = sorted(n for n in theirs - ours if n not in OTHER_MEANS and n not in KNOWN_GAPS)
    assert not unlisted, f"JAX lowers {unlisted} for TPU; lower them or list them here"


def test_listed_gaps_are_still_gaps() -> None:
    closed = sorted(KNOWN_GAPS & _ours())
    assert not closed, f"{closed} lower now: take them off KNOWN_GAPS"
    equivalents = {"dma_start": "copy_start", "dma_wait": "copy_wait", "roll": "tpu_roll",
                   "bitcast": "tpu_bitcast", "prng_seed": "tpu_prng_seed",
                   "prng_random_bits": "tpu_prng_random_bits",
                   **{n: "tpu_" + n for n in ("pack_elementwise", "unpack_elementwise",
                                              "stochastic_round", "trace_value",
                                              "has_memory_space", *_MXU)}}
    assert all(equivalents[n] in _ours() for n in equivalents)
