"""The conformance suite on the Triton backend in emulate mode: every kernel lowered for
``cuda`` and run by the Triton emulator, against ``jax.numpy`` and the interpreter."""

from __future__ import annotations

import pytest

from pallas_core.testing import (
    ASYNC_COPY,
    GATHER,
    RUN_SCOPED,
    SCALAR_PREFETCH,
    SCRATCH,
    SEMAPHORES,
    ConformanceSuite,
)

pytest.importorskip("pallas_triton")


class TestTritonEmulated(ConformanceSuite):
    """Triton, emulated."""

    backend = "triton"
    emulate = True
    # A pl.kernel on a mesh runs: its axes are named grid axes (lax.axis_index lowers).
    # GATHER: JAX's Triton lowering has no rule for lax.gather either (Triton's own gather
    # op is not what jnp.take_along_axis traces to); it is refused by name.
    unsupported = frozenset({SCRATCH, RUN_SCOPED, SCALAR_PREFETCH, SEMAPHORES, ASYNC_COPY,
                             GATHER})
