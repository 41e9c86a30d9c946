"""Chips as a roofline sees them: peak rates, memory bandwidth and on-chip memory.

A backend lists the chips it compiles for in ``BackendInfo.chips`` (target name -> :class:`Chip`),
each figure from a public spec sheet that :attr:`Chip.source` names, so a third-party backend
adds its own. :func:`roofline` places a kernel's work and traffic against one chip.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Chip:
    """One chip's peaks (whole chip, per second) and its on-chip memory."""

    name: str
    matmul_flops: Mapping[str, float]
    """Dtype name (``"bfloat16"``, ``"float32"``, ``"int8"``, ``"float8"``) -> peak FLOP/s (or
    OP/s) of the matrix units (MXUs, tensor cores), dense."""
    hbm_bandwidth: float
    """Bytes per second between HBM and the chip."""
    onchip_name: str
    """What the on-chip memory that blocks live in is called (``"VMEM"``, ``"shared memory"``)."""
    onchip_bytes: int
    """Its capacity, per core (TensorCore, or a thread block's share of an SM)."""
    onchip_default_limit: int
    """What a kernel may use unless it asks for more (a TPU's default scoped VMEM)."""
    cores: int
    """TensorCores, SMs or CUs of the chip."""
    source: str
    """The public spec sheet the figures come from."""
    vector_flops: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Dtype name -> peak FLOP/s of the vector units (VPU, CUDA cores, SIMD units); empty
    where no public sheet gives it (vector work is then timed at the matrix peak and the
    roofline says so)."""

    def matmul_peak(self, dtype: Any) -> float:
        """The matrix units' peak for operands of ``dtype`` (8-bit floats as ``"float8"``,
        other types by name; a type the sheet does not list gets the ``bfloat16`` peak)."""
        name = _dtype_name(dtype)
        return float(self.matmul_flops.get(name, self.matmul_flops["bfloat16"]))

    def vector_peak(self, dtype: Any) -> float | None:
        """The vector units' peak for ``dtype``, if the sheet gives one."""
        peak = self.vector_flops.get(_dtype_name(dtype))
        return None if peak is None else float(peak)

    def ridge(self, dtype: Any) -> float:
        """FLOPs per byte of HBM traffic at which the matrix units and HBM take equally long:
        below it a kernel is memory-bound."""
        return self.matmul_peak(dtype) / self.hbm_bandwidth


def _dtype_name(dtype: Any) -> str:
    dt = np.dtype(dtype)
    if (dt.itemsize == 1 and dt.kind == "V") or "float8" in dt.name:
        return "float8"
    return dt.name


@dataclasses.dataclass(frozen=True)
class Roofline:
    """One kernel on one chip: the time each resource needs, and which one bounds it."""

    chip: str
    ridge: float
    """FLOPs per HBM byte where the chip's matrix peak meets its bandwidth."""
    intensity: float
    """The kernel's FLOPs per HBM byte (``inf`` when it moves nothing)."""
    compute_seconds: float
    """Matrix work at the matrix peak plus vector work at the vector peak."""
    memory_seconds: float
    """HBM bytes at the chip's bandwidth."""
    seconds: float
    """The lower bound: the larger of the two (the pipeline overlaps them)."""
    bound: str
    """``"compute"`` or ``"memory"``."""
    assumptions: tuple[str, ...] = ()
    """What the figures rest on beyond the sheet (e.g. vector work timed at the matrix peak)."""


def roofline(chip: Chip, *, matmul_flops: float, vector_flops: float, hbm_bytes: float,
             dtype: Any) -> Roofline:
    """Where a kernel doing ``matmul_flops`` on the matrix units (operands of ``dtype``) and
    ``vector_flops`` elsewhere, moving ``hbm_bytes``, sits against ``chip``."""
    notes = []
    compute = matmul_flops / chip.matmul_peak(dtype)
    vector_peak = chip.vector_peak(dtype) or chip.vector_peak("float32")
    if vector_flops:
        if vector_peak is None:
            vector_peak = chip.matmul_peak(dtype)
            notes.append(f"{chip.name} has no public vector-unit peak: vector work is timed "
                         "at the matrix peak (a lower bound)")
        compute += vector_flops / vector_peak
    memory = hbm_bytes / chip.hbm_bandwidth
    flops = matmul_flops + vector_flops
    intensity = flops / hbm_bytes if hbm_bytes else float("inf")
    return Roofline(chip=chip.name, ridge=chip.ridge(dtype), intensity=intensity,
                    compute_seconds=compute, memory_seconds=memory,
                    seconds=max(compute, memory),
                    bound="compute" if compute >= memory else "memory",
                    assumptions=tuple(notes))
