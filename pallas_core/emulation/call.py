"""What ``pl.emulate`` hands a plugin's ``pallas_emulate`` hook: one custom call to execute."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from pallas_core.errors import UnsupportedError


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
    device: int = 0
    """Under ``shard_map``: the logical id of the device making the call (its row-major index
    in the mesh, what ``tpu.device_id`` reads there); 0 elsewhere."""
    devices: int = 1
    """Under ``shard_map``: how many devices make this call together (the mesh's size)."""
    meeting: Callable[[EmulatedCall, Joint], Sequence[np.ndarray]] | None = dataclasses.field(
        default=None, compare=False, repr=False)
    """Under ``shard_map``: where the devices' calls meet (:meth:`run_jointly`); else None."""

    @property
    def under_shard_map(self) -> bool:
        """Whether the call is made by every device of a ``shard_map``'s mesh."""
        return self.meeting is not None

    def run_jointly(self, joint: Joint) -> Sequence[np.ndarray]:
        """For a kernel whose devices talk to each other: waits until every device of the
        ``shard_map`` has made this call, runs ``joint(calls)`` once (``calls[d]`` is device
        ``d``'s, with its operands), and returns this device's results (``joint`` returns every
        device's, in the same order). Outside ``shard_map`` it raises ``UnsupportedError``."""
        if self.meeting is None:
            raise UnsupportedError(
                f"kernel {self.name!r} talks to other devices (remote DMAs or signals, the "
                "barrier semaphore), but pl.emulate runs it outside shard_map, where there are "
                "none. Fix: call it inside jax.shard_map, as on the hardware.")
        return self.meeting(self, joint)


Joint = Callable[[Sequence[EmulatedCall]], Sequence[Sequence[np.ndarray]]]
"""``joint(calls)`` -> each device's results: runs one call made by every device together."""
