"""The Mosaic GPU rule table is whole in a fresh interpreter, whichever lowering module is
imported first: ``pallas_mosaic_gpu.rules`` imports every module that registers rules, so
``plugin.lowering_rules()`` never depends on what else happened to be imported."""

from __future__ import annotations

import subprocess
import sys

import pytest
from jax import lax

from pallas_core import backend as plb

pytest.importorskip("pallas_mosaic_gpu")
from pallas_mosaic_gpu import blackwell, plugin, warp_specialized
from pallas_mosaic_gpu import primitives as gp

# One primitive (at least) from each module that registers rules.
EXPECTED = {
    plb.get_p.name, lax.dot_general_p.name, gp.copy_gmem_to_smem_p.name, gp.wgmma_p.name,
    gp.barrier_arrive_p.name,  # rules_memory
    lax.add_p.name, lax.exp_p.name, lax.reduce_max_p.name, lax.broadcast_in_dim_p.name,
    lax.sqrt_p.name,  # rules_arrays (sqrt: scalars only, through the shared rules)
    plb.cond_p.name, plb.scan_p.name, plb.while_p.name,  # rules
    warp_specialized.set_max_registers_p.name, warp_specialized.concurrent_p.name,
    lax.slice_p.name,  # warp_specialized_lowering
    *(p.name for p in blackwell.PRIMITIVES),  # blackwell
}

_SCRIPT = """
import importlib, sys
importlib.import_module(sys.argv[1])
from pallas_mosaic_gpu import plugin
print(" ".join(sorted(p.name for p in plugin.lowering_rules())))
"""


def test_the_table_in_this_process_has_every_module_s_rules() -> None:
    names = {p.name for p in plugin.lowering_rules()}
    assert names >= EXPECTED, sorted(EXPECTED - names)


@pytest.mark.parametrize("first", ["pallas_mosaic_gpu.rules_memory",
                                   "pallas_mosaic_gpu.warp_specialized_lowering",
                                   "pallas_mosaic_gpu.plugin"])
def test_a_fresh_interpreter_gets_the_full_table(first: str) -> None:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, first], capture_output=True,
                         text=True, check=True).stdout.split()
    assert set(out) >= EXPECTED, sorted(EXPECTED - set(out))
    assert set(out) == {p.name for p in plugin.lowering_rules()}
