"""XLA's own cost analysis, the independent count ``pl.report``'s flops are checked against."""

from __future__ import annotations

from typing import Any

import jax


def xla_flops(fn: Any, *args: Any) -> float:
    """The flops XLA counts for ``jax.jit(fn)`` lowered on ``args`` (arrays or structs)."""
    analysis = jax.jit(fn).lower(*args).cost_analysis()
    if isinstance(analysis, (list, tuple)):  # JAX 0.10 returns one dict per device
        analysis = analysis[0]
    return float(analysis["flops"])
