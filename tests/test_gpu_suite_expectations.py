"""What the GPU suite (tests/gpu) expects of the Mosaic GPU backend, checked without a GPU.

The suite pins what Mosaic GPU refuses: conformance features in its ``unsupported`` (and
capabilities neither declared by the plugin nor added by the suite) must raise a
``PallasError``; the others it runs on the GPU. Two seed examples must be refused, naming shared
memory. Lowering for ``cuda`` decides both on CPU: here every conformance kernel is lowered (and
then run in the interpreter), and every seed example's Mosaic GPU module is made, so the
suite's expectations cannot drift from what the backend does before a GPU runs them.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import jax
import pytest

import pallas_core as pl
from pallas_core.testing import CAPABILITIES, FEATURES, ConformanceSuite

pytest.importorskip("pallas_mosaic_gpu")
pytest.importorskip("pallas_triton")
from tests.gpu import test_on_gpu_conformance as on_gpu_conformance
from tests.gpu import test_on_gpu_seeds as on_gpu_seeds


def _lowered_then(call: Callable[..., Any], interpreted: Callable[..., Any]
                  ) -> Callable[..., Any]:
    """``call`` lowered for ``cuda`` (a refusal raises here), then run in the interpreter."""
    def run(*args: Any) -> Any:
        jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",))
        return interpreted(*args)
    return run


class _LoweredForCuda(on_gpu_conformance.TestMosaicGPUOnGPU):
    """The GPU suite's Mosaic GPU class, its kernels lowered for cuda instead of run (not
    collected: its name does not start with ``Test``)."""

    def pallas_call(self, kernel: Callable[..., None], out_shape: Any,
                    **kwargs: Any) -> Callable[..., Any]:
        return _lowered_then(pl.pallas_call(kernel, out_shape, backend=self.backend, **kwargs),
                             pl.pallas_call(kernel, out_shape, backend="interpret", **kwargs))

    def kernel(self, body: Callable[..., None], **kwargs: Any) -> Callable[..., Any]:
        return _lowered_then(pl.kernel(body, backend=self.backend, **kwargs),
                             pl.kernel(body, backend="interpret", **kwargs))


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_mosaic_gpu_conformance_expectations(feature: str,
                                             capfd: pytest.CaptureFixture[str]) -> None:
    suite = _LoweredForCuda()
    suite.setup_method(None)
    refused_expected = feature in suite.unsupported or (
        feature in CAPABILITIES and feature not in suite.declared_capabilities())
    for fn in ConformanceSuite.feature_tests()[feature]:
        fixtures = {"capfd": capfd} if "capfd" in inspect.signature(fn).parameters else {}
        try:
            fn(suite, **fixtures)
            refused = False
        except pl.PallasError:
            refused = True
        assert refused == refused_expected, (
            f"{fn.__name__} ({feature}): Mosaic GPU {'refuses' if refused else 'lowers'} it "
            "for cuda, but tests/gpu/test_on_gpu_conformance.py expects the opposite: update "
            "TestMosaicGPUOnGPU's unsupported or declared_capabilities")


@pytest.mark.parametrize("name", sorted(on_gpu_seeds.CASES))
def test_mosaic_gpu_seed_expectations(name: str) -> None:
    example, _, inputs, _ = on_gpu_seeds.CASES[name]
    try:
        for kernel in pl.stages(example, *inputs(), backend="mosaic_gpu", target="sm_90a"):
            assert kernel["mosaic_gpu"]  # the verified module
        refusal = None
    except pl.PallasError as e:
        refusal = str(e)
    expected = on_gpu_seeds.MOSAIC_GPU_REFUSES.get(name)
    if expected is None:
        assert refusal is None, f"{name} is refused by Mosaic GPU: {refusal}"
    else:
        assert refusal is not None and re.search(expected, refusal), (name, refusal)
