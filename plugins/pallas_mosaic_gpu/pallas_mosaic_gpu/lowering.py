"""Lowering of a traced kernel (a :class:`pallas_core.KernelCall`) to a Mosaic GPU kernel: the
names other modules use, from the three parts the lowering is made of.

* the call lowering, :mod:`pallas_mosaic_gpu.call_lowering`: how a ``pallas_call`` (or
  ``plgpu.kernel``) becomes one kernel launch (:class:`Plan`, :func:`plan`), its pipeline of
  TMA copies over the grid and its shared memory (:func:`scoped_allocations`,
  :func:`aligned_smem`), built by :func:`build` / :func:`kernel_fn`;
* the value model, :mod:`pallas_mosaic_gpu.values`: what a jaxpr variable holds (:class:`Ref`,
  register arrays :data:`FA`, :class:`Loaded`, :class:`Expanded`), the layouts chosen for
  SMEM buffers and registers (:func:`is_tileable`, :func:`layout_for`), and the lowering state
  :class:`GPULowering`;
* the rules, :mod:`pallas_mosaic_gpu.rules` (which imports every rule module:
  :mod:`~pallas_mosaic_gpu.rules_control`, :mod:`~pallas_mosaic_gpu.rules_arrays`,
  :mod:`~pallas_mosaic_gpu.rules_memory`, :mod:`~pallas_mosaic_gpu.warp_specialized_lowering`,
  :mod:`~pallas_mosaic_gpu.blackwell`, ...): the table :data:`RULES`, one entry a primitive,
  each with the rule signature all backends share (``pallas_core.backend.Rule``:
  ``rule(state, eqn, *in_values)``), registered by :func:`rule` (both in
  :mod:`pallas_mosaic_gpu.registry`, which imports no rule module).

The modules import one another in that order: values, then the registry, the rule modules and
:mod:`~pallas_mosaic_gpu.rules`, then the call lowering.
"""

from __future__ import annotations

from pallas_mosaic_gpu.call_lowering import (
    Plan,
    aligned_smem,
    build,
    kernel_fn,
    plan,
    scoped_allocations,
)
from pallas_mosaic_gpu.rules import RULES, lower_jaxpr, rule
from pallas_mosaic_gpu.values import (
    FA,
    SMEM_ALIGNMENT,
    SWIZZLE,
    WARPGROUP,
    WGMMA,
    Expanded,
    GPULowering,
    Loaded,
    Ref,
    Unavailable,
    emit_for,
    is_tileable,
    layout_for,
    literal,
    load,
    relayout,
    splat,
    store,
    tile_shape,
)

__all__ = ["FA", "RULES", "SMEM_ALIGNMENT", "SWIZZLE", "WARPGROUP", "WGMMA", "Expanded",
           "GPULowering", "Loaded", "Plan", "Ref", "Unavailable", "aligned_smem", "build",
           "emit_for", "is_tileable", "kernel_fn", "layout_for", "literal", "load",
           "lower_jaxpr", "plan", "relayout", "rule", "scoped_allocations", "splat", "store",
           "tile_shape"]
