"""Every primitive JAX 0.10's own Triton lowering has a rule for has one here, or is named
below with what this project has instead. JAX's registry is read through the core's adapter
(``plb.jax_lowering_rule_names("triton")``), so upgrading JAX fails this test until each new
primitive is lowered or listed."""

from __future__ import annotations

import pytest

from pallas_core import backend as plb

plugin = pytest.importorskip("pallas_triton.plugin")

OTHER_MEANS = {
    "debug_barrier": "triton_debug_barrier (pallas_triton.debug_barrier)",
    "elementwise_inline_asm": "triton_elementwise_inline_asm "
                                "(pallas_triton.elementwise_inline_asm)",
    "max_contiguous": "triton_max_contiguous (pallas_triton.max_contiguous)",
    "num_programs": "Triton grids are static: pl.num_programs is a Python int when traced "
                    "(a dynamic grid is refused before lowering)",
}
"""JAX primitives whose feature this project provides under another primitive, or otherwise."""


KNOWN_GAPS: set[str] = set()


def _ours() -> set[str]:
    return {p.name for p in plugin.lowering_rules()}


def _theirs() -> set[str]:
    """JAX's rule names, without the ``_p`` some primitives' names had before JAX 0.12."""
    return {n.removesuffix("_p") for n in plb.jax_lowering_rule_names("triton")["triton"]}


def test_every_jax_rule_is_lowered_or_listed() -> None:
    unlisted = sorted(n for n in _theirs() - _ours()
                      if n not in OTHER_MEANS and n not in KNOWN_GAPS)
    assert not unlisted, f"JAX lowers {unlisted} for Triton; lower them or list them here"


def test_listed_equivalents_exist() -> None:
    assert set(OTHER_MEANS) <= _theirs(), "an entry names a primitive JAX no longer lowers"
    assert not set(OTHER_MEANS) & _ours(), "an entry lowers under its own name now"
    equivalents = {"triton_debug_barrier", "triton_elementwise_inline_asm",
                   "triton_max_contiguous"}
    assert equivalents <= _ours()


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="no JAX rule registry"):
        plb.jax_lowering_rule_names("rocm_only")
