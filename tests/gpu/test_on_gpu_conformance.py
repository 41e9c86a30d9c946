"""The conformance suite (``pallas_core.testing.ConformanceSuite``) run on the GPU by the Triton
and the Mosaic GPU backends: every kernel compiled for the GPU and run there, against
``jax.numpy``; every feature a backend refuses must raise a ``PallasError``."""

from __future__ import annotations

from typing import Any

import pytest

from pallas_core.plugins import manager
from pallas_core.testing import (
    ACCUMULATION,
    ALIASING,
    ARG_REDUCTION,
    BLOCKED_GRID,
    DEBUG_PRINT,
    GATHER,
    RUN_SCOPED,
    SCRATCH,
    VMAP,
    WHEN,
    ConformanceSuite,
)

pytestmark = pytest.mark.gpu

pytest.importorskip("pallas_triton")
# The module, not its class: a test class imported here would be collected here too.
from plugins.pallas_triton.tests import test_triton_conformance_emulated as emulated  # noqa: E402


class TestTritonOnGPU(ConformanceSuite):
    """Triton on the GPU: what its emulated suite runs, refusing the same features."""

    backend = "triton"
    unsupported = emulated.TestTritonEmulated.unsupported


class TestMosaicGPUOnGPU(ConformanceSuite):
    """Mosaic GPU on the GPU (Hopper). Lowered for ``cuda`` on CPU, it refuses with an
    ``UnsupportedError`` the suite's accumulating matmul (its float32 B block is no wgmma
    operand), uneven edge blocks and ``pl.when`` on a reduction (their register layouts), so
    those are declared unsupported here, and so are ``jnp.argmax`` and ``jnp.take_along_axis``
    (JAX's Mosaic GPU lowering has no rule for either; both are refused by name). The plugin
    declares no capability, but five of the suite's capability kernels lower (scratch,
    aliasing, ``run_scoped``, ``vmap``, ``pl.debug_print``): they run here as declared ones, so
    that the GPU says whether the plugin may declare them."""

    backend = "mosaic_gpu"
    unsupported = frozenset({ACCUMULATION, ARG_REDUCTION, BLOCKED_GRID, GATHER, WHEN})

    def setup_method(self, method: Any) -> None:
        """Skips where the backend did not load (scripts/gpu_check.sh's versions step fails
        then, saying why)."""
        if self.backend not in manager.backends():
            pytest.skip(f"the {self.backend} backend is not loaded: "
                        f"{manager.skipped().get(self.backend, 'not installed')}")
        super().setup_method(method)

    def declared_capabilities(self) -> frozenset[str]:
        """The plugin's capabilities and those of its kernels that lower (see the class)."""
        return super().declared_capabilities() | {SCRATCH, ALIASING, DEBUG_PRINT, RUN_SCOPED,
                                                  VMAP}
