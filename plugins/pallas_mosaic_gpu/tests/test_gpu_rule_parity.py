"""Every primitive JAX's own Mosaic GPU lowering has a rule for (under any of its lowering
semantics) has one here (this plugin's primitives are named ``gpu_<name>``), or is named
below: with what this project has instead, or as a known gap. JAX's registry is read through
the core's adapter, so upgrading JAX fails this test until each new primitive is lowered or
listed; lowering a listed gap fails it until the entry goes."""

from __future__ import annotations

import pytest

from pallas_core import backend as plb

plugin = pytest.importorskip("pallas_mosaic_gpu.plugin")

EQUIVALENTS = {
    "async_load": "gpu_async_load_tmem",
    "commit_group": "gpu_commit_smem_to_gmem_group",
}
"""JAX's primitive name -> this plugin's primitive for the same operation."""

OTHER_MEANS = {
    "load": "plgpu.load reads through the core's get (ref[idx]), whose rule picks the layout",
    "store": "plgpu.store writes through the core's swap (ref[...] = value)",
    "wgmma_accumulator_deref": "an ACC Ref is read with the core's get (acc[...])",
    "wgmma_accumulator_store": "an ACC Ref is written with the core's swap (acc[...] = v)",
    "mosaic_gpu_reduce_sum": "plgpu.sum is jnp.sum (lax.reduce_sum's rule)",
    "mosaic_gpu_reduce_max": "plgpu.max is jnp.max (lax.reduce_max's rule)",
    "mosaic_gpu_reduce_min": "plgpu.min is jnp.min (lax.reduce_min's rule)",
    "mosaic_gpu_reduce_prod": "plgpu.prod is jnp.prod (see reduce_prod)",
    "barrier_arrive_and_wait": "plgpu.barrier_arrive_and_wait is gpu_barrier_arrive then "
                               "gpu_barrier_wait",
    "mma": "plgpu.mma (the pre-Hopper MMA) is jnp.dot plus the accumulator",
    "print_layout": "plgpu.print_layout prints the layout this backend chooses when the kernel "
                    "is traced",
    "async_prefetch": "plgpu.async_prefetch is an L2 hint that never changes results: nothing "
                      "is emitted",
    "wait_gmem_to_smem": "plgpu.wait_gmem_to_smem waits for pre-Hopper cp.async copies, which "
                         "this backend never issues (it copies with TMA): nothing to wait for",
    "semaphore_signal_parallel": "plgpu.semaphore_signal_parallel is one pl.semaphore_signal "
                                 "per signal",
    "mpmd_map": "plgpu.kernel and pl.kernel over a plgpu mesh are traced into one kernel here",
    "_copysign": "a helper of JAX's own lowering rules (their copysign), never bound by user "
                 "code",
    "core_map": "(JAX 0.10) pl.core_map over a plgpu mesh is traced into the kernel here",
    "jaxpr_call": "(JAX 0.10) a call of a jaxpr inside JAX's lowering; calls are inlined here",
    "mgpu_atomic_store": "plgpu.atomic_add/max/min/and/or/xor bind the core's pl.atomic_* "
                         "primitive (atomic_rmw), whose rule emits the same PTX red.* as JAX's",
}
"""JAX primitives whose feature this project provides under other primitives."""

KNOWN_GAPS: set[str] = set()
"""Known gaps (as of 2026-11-28): none. Each raised an UnsupportedError naming it, or (the
grid-dependency hints) emitted nothing where JAX emits the instruction, until they were
lowered as JAX lowers them (``test_gpu_rule_gaps.py``)."""


def _ours() -> set[str]:
    return {p.name for p in plugin.lowering_rules()}


def _covered(name: str, ours: set[str]) -> bool:
    return (name in ours or f"gpu_{name}" in ours or EQUIVALENTS.get(name) in ours
            or name in OTHER_MEANS or name in KNOWN_GAPS)


def _jax_names() -> set[str]:
    """JAX's rule names, without the ``_p`` some primitives' names had before JAX 0.12."""
    return {n.removesuffix("_p") for n in plb.jax_lowering_rule_names("mosaic_gpu")["mosaic_gpu"]}


def test_every_jax_rule_is_lowered_or_listed() -> None:
    theirs = _jax_names()
    ours = _ours()
    unlisted = sorted(n for n in theirs if not _covered(n, ours))
    assert not unlisted, f"JAX lowers {unlisted} for Mosaic GPU; lower them or list them here"


def test_listed_names_are_current() -> None:
    ours = _ours()
    closed = sorted(n for n in KNOWN_GAPS if n in ours or f"gpu_{n}" in ours)
    assert not closed, f"{closed} lower now: take them off KNOWN_GAPS"
    assert all(v in ours for v in EQUIVALENTS.values())
