"""The full rule table of the Mosaic GPU backend: importing this module imports every module
that registers rules into :data:`~pallas_mosaic_gpu.registry.RULES`, so the table is full once
it is imported, whichever of them was imported first.

The table and :func:`~pallas_mosaic_gpu.registry.rule`, which registers into it, live in
:mod:`pallas_mosaic_gpu.registry`, which imports no rule module (so no rule module is in an
import cycle with this one). The rules live in :mod:`~pallas_mosaic_gpu.rules_control` (calls,
``cond``, loops, ``run_scoped``, program and axis indices), :mod:`~pallas_mosaic_gpu.rules_arrays`
(register arrays: elementwise ops, broadcasts, reshapes, reductions; scalars through the shared
rules of ``pallas_core.mlir_rules``), :mod:`~pallas_mosaic_gpu.rules_memory` (Ref reads and
writes, atomics, ``jnp.dot`` as wgmma, TMA copies, barriers, ``plgpu.wgmma``),
:mod:`~pallas_mosaic_gpu.rules_misc` (printing, checks, delays, grid-dependency control),
:mod:`~pallas_mosaic_gpu.rules_devices` (semaphores, multicast memory),
:mod:`~pallas_mosaic_gpu.layout_rules`, :mod:`~pallas_mosaic_gpu.warp_specialized_lowering`,
:mod:`~pallas_mosaic_gpu.blackwell`, :mod:`~pallas_mosaic_gpu.dynamic_scheduling`,
:mod:`~pallas_mosaic_gpu.im2col`, :mod:`~pallas_mosaic_gpu.inline` and
:mod:`~pallas_mosaic_gpu.more_ops`.
"""

from __future__ import annotations

from pallas_mosaic_gpu import (  # noqa: F401 - imported to register their rules
    blackwell,
    dynamic_scheduling,
    im2col,
    inline,
    layout_rules,
    more_ops,
    rules_arrays,
    rules_control,
    rules_devices,
    rules_memory,
    rules_misc,
    warp_specialized_lowering,
)
from pallas_mosaic_gpu.registry import LAZY_OK, RULES, lower_jaxpr, rule

__all__ = ["LAZY_OK", "RULES", "lower_jaxpr", "rule"]
