"""The fields of ``pltpu.CompilerParams`` that reach the ``tpu_custom_call`` (side effects, the
backend configuration), lowered for TPU on CPU and compared with what
``jax.experimental.pallas`` emits for the same kernel."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as jax_pl
from jax.experimental.pallas import tpu as jax_pltpu

import pallas_core as pl
from pallas_core.errors import PallasError

pltpu = pytest.importorskip("pallas_mosaic_tpu")
from pallas_mosaic_tpu import inspection  # noqa: E402

X = jnp.ones((8, 128), jnp.float32)


def _lowered(m: Any, mt: Any, **params: Any) -> str:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] + 1.0

    f = m.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                      compiler_params=mt.CompilerParams(**params))
    return jax.jit(f).trace(X).lower(lowering_platforms=("tpu",)).as_text()


def _call_line(text: str) -> str:
    return next(line for line in text.splitlines() if "tpu_custom_call" in line)


def _flags(text: str) -> tuple[bool, bool]:
    """Whether the custom call has a side effect, and whether XLA may still remove it."""
    line = _call_line(text)
    return "has_side_effect = true" in line, "xla_allow_dce_side_effecting_op" in line


@pytest.mark.parametrize("effect", [False, True, "PURE", "DATAFLOW_SIDE_EFFECTING",
                                    "SIDE_EFFECTING"])
def test_has_side_effects_marks_the_custom_call_as_jax_does(effect: Any) -> None:
    ours = effect if isinstance(effect, bool) else pltpu.SideEffectType[effect]
    theirs = effect if isinstance(effect, bool) else jax_pltpu.SideEffectType[effect]
    got = _flags(_lowered(pl, pltpu, has_side_effects=ours))
    assert got == _flags(_lowered(jax_pl, jax_pltpu, has_side_effects=theirs))
    assert got[0] == (effect not in (False, "PURE"))


def test_configuration_fields_reach_the_backend_config_as_in_jax() -> None:
    params = {"allow_input_fusion": (True,), "internal_scratch_in_bytes": 4096,
              "disable_bounds_checks": True, "disable_semaphore_checks": True,
              "skip_device_barrier": True, "shape_invariant_numerics": False,
              "flags": {"xla_tpu_flag_a": True, "xla_tpu_flag_b": 3, "xla_tpu_flag_c": 0.5}}
    (ours, _), = inspection.kernels(_lowered(pl, pltpu, **params))
    (theirs, _), = inspection.kernels(_lowered(jax_pl, jax_pltpu, **params))
    for key in ("allow_input_fusion", "internal_scratch_in_bytes", "disable_bounds_checks",
                "disable_semaphore_checks", "skip_device_barrier", "shape_invariant_numerics",
                "needs_layout_passes", "serialization_format"):
        assert ours["custom_call_config"].get(key) == theirs["custom_call_config"].get(key), key
    assert ours["flag_configs"] == theirs["flag_configs"]


def test_accepted_fields_and_their_checks() -> None:
    p = pltpu.CompilerParams(use_tc_tiling_on_sc=True, fuse_transposed_lhs_in_matmul=True,
                             allow_collective_id_without_custom_barrier=True,
                             flags={"a": 1})
    assert p.flags["a"] == 1 and hash(p) == hash(pltpu.CompilerParams(
        use_tc_tiling_on_sc=True, fuse_transposed_lhs_in_matmul=True,
        allow_collective_id_without_custom_barrier=True, flags={"a": 1}))
    with pytest.raises(PallasError, match=r"has_side_effects='yes'"):
        pltpu.CompilerParams(has_side_effects="yes")
    with pytest.raises(PallasError, match=r"flag 'a' has value 'x'"):
        pltpu.CompilerParams(flags={"a": "x"})
    assert re.search(r"has_side_effect = true",
                     _call_line(_lowered(pl, pltpu, has_side_effects=True)))
