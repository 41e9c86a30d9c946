"""What ``pl.emulate`` hands a plugin's ``pallas_emulate`` hook: one custom call to execute."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class EmulateOptions:
    """How to emulate (``pl.emulate``'s keyword arguments)."""

    backend: str
    """The backend the user asked for (``"mosaic_tpu"``, ``"sparsecore"``, ``"triton"``)."""
    target: str | None = None
    """The backend's hardware target (``"v5e"``, ``"sm_90"``, ``"gfx942"``), or the default."""
    checked: bool = False
    """Report out-of-bounds accesses that no mask covers and unsynchronised writes of two
    programs to one address (as a ``PallasError``) instead of emulating them."""
    seed: int | None = None
    """With a seed, grid axes the kernel declares parallel run in an order shuffled by it."""


@dataclasses.dataclass(frozen=True)
class EmulatedCall:
    """One custom call of a lowered program, with the values of its operands."""

    target: str
    """The call target (``"tpu_custom_call"``, ``"__gpu$xla.gpu.triton"``)."""
    backend_config: str | bytes
    """The call's ``backend_config`` string (the JSON of a ``tpu_custom_call``)."""
    attributes: Mapping[str, Any]
    """The call's other configuration as Python values: ``mhlo.backend_config``'s entries
    (Triton: ``ir`` bytes, ``grid_x``/``grid_y``/``grid_z``, ``num_warps``, ...)."""
    operands: Sequence[np.ndarray]
    results: Sequence[tuple[tuple[int, ...], np.dtype]]
    """Shape and dtype of each result."""
    aliases: Sequence[tuple[int, int]]
    """``(result index, operand index)`` pairs: the result starts as that operand."""
    options: EmulateOptions
    name: str = ""
    """The kernel's name, for messages."""
