"""Testing tools for backend authors: the conformance suite every backend runs on itself.

``from pallas_core.testing import ConformanceSuite`` (needs pytest, from the ``test`` extra:
``pip install 'pallas-core[test]'``). ``import pallas_core`` never imports this package.
"""

from __future__ import annotations

try:
    import pytest  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "pallas_core.testing needs pytest. Fix: pip install 'pallas-core[test]'."
    ) from e

from pallas_core.testing.conformance import (
    ACCUMULATION,
    ALIASING,
    ARG_REDUCTION,
    ASYNC_COPY,
    ATOMICS,
    BLOCKED_GRID,
    CAPABILITIES,
    DEBUG_PRINT,
    ELEMENTWISE,
    FEATURES,
    FORI_LOOP,
    GATHER,
    JIT,
    MASKED_ACCESS,
    MESH,
    PROGRAM_ID,
    RUN_SCOPED,
    SCALAR_PREFETCH,
    SCRATCH,
    SEMAPHORES,
    VMAP,
    WHEN,
    ConformanceSuite,
    feature,
    unknown_p,
)

__all__ = [
    "ACCUMULATION", "ALIASING", "ARG_REDUCTION", "ASYNC_COPY", "ATOMICS", "BLOCKED_GRID",
    "CAPABILITIES", "DEBUG_PRINT", "ELEMENTWISE", "FEATURES", "FORI_LOOP", "GATHER", "JIT",
    "MASKED_ACCESS", "MESH", "PROGRAM_ID", "RUN_SCOPED", "SCALAR_PREFETCH", "SCRATCH",
    "SEMAPHORES", "VMAP", "WHEN", "ConformanceSuite", "feature", "unknown_p",
]
