"""Every primitive JAX's own Mosaic lowering has a SparseCore rule for (vector and scalar
subcores) has one here, or is named below: with what this project has instead, or as a known
gap. JAX's registry is read through the core's adapter, so upgrading JAX fails this test
until each new primitive is lowered or listed; lowering a listed gap fails it until the entry
goes."""

from __future__ import annotations

import jax.experimental.pallas.tpu  # noqa: F401  (registers JAX's pipeline rules)
import pytest
from pallas_sparsecore import plugin

from pallas_core import backend as plb

OTHER_MEANS = {
    "add_dependency": "pltpu.touch emits nothing (kernels here access Refs in program order), "
                      "as JAX's rule for its primitive emits nothing",
    "bitcast": "tpu_bitcast (pltpu.bitcast)",
    "has_memory_space": "tpu_has_memory_space (pltpu.has_memory_space)",
    "trace_value": "tpu_trace_value (pltpu.trace_value)",
}
"""JAX primitives whose feature this project provides under another primitive."""

KNOWN_GAPS = {
    # pltpu.emit_pipeline inside a SparseCore kernel (docs/backends/sparsecore.md, "Not yet").
    "emit_pipeline", "pipeline_body",
    # pltpu.get_barrier_semaphore on the subcores.
    "get_barrier_semaphore",
}
"""Known gaps: lowering any of these raises an UnsupportedError naming it."""

KINDS = ["sc_vector_subcore", "sc_scalar_subcore"]


def _ours() -> set[str]:
    return {p.name for p in plugin.lowering_rules()}


@pytest.mark.parametrize("kind", KINDS)
def test_every_jax_rule_is_lowered_or_listed(kind: str) -> None:
    theirs = plb.jax_lowering_rule_names("mosaic_tpu")[kind]
    unlisted = sorted(n for n in theirs - _ours()
                      if n not in OTHER_MEANS and n not in KNOWN_GAPS)
    assert not unlisted, f"JAX lowers {unlisted} for SparseCore; lower them or list them here"


def test_listed_names_are_current() -> None:
    closed = sorted(KNOWN_GAPS & _ours())
    assert not closed, f"{closed} lower now: take them off KNOWN_GAPS"
    assert all("tpu_" + n in _ours() for n in ("bitcast", "has_memory_space", "trace_value"))
