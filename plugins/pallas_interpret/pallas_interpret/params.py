"""The interpreter's compiler parameters."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from pallas_core.errors import PallasError
from pallas_core.spec import CompilerParams

NAME = "interpret"


@dataclasses.dataclass(frozen=True)
class InterpretParams(CompilerParams):
    """Compiler parameters of the interpreter; passing them selects it.

    ``checked``: run step by step in checked mode: uninitialised outputs and scratch are
    poisoned (NaN for floats, the minimum for integers) so reads of them show, and accesses
    outside a Ref and races between ``parallel_axes`` are reported.
    ``fast``: run the grid axes along which no output block is revisited as one batched
    evaluation when that is proven safe (``False``: always step by step).
    ``parallel_axes``: the grid axes the target hardware may run in parallel, for race
    detection in checked mode and for ``shuffle_seed``: a tuple of axes, ``"all"`` (GPU
    backends run every step in parallel), or ``None`` (take them from the ``dimension_semantics``
    of another backend's params, when the kernel has such params; otherwise none).
    ``shuffle_seed``: run the steps of ``parallel_axes`` in an order shuffled by this seed, to
    expose kernels that depend on the order of parallel steps.
    """

    BACKEND: ClassVar[str] = NAME
    checked: bool = False
    fast: bool = True
    parallel_axes: tuple[int, ...] | str | None = None
    shuffle_seed: int | None = None

    def __post_init__(self) -> None:
        for field in ("checked", "fast"):
            if not isinstance(getattr(self, field), bool):
                raise PallasError(f"InterpretParams({field}={getattr(self, field)!r}): expected "
                                  "True or False.")
        if self.shuffle_seed is not None and not isinstance(self.shuffle_seed, int):
            raise PallasError(f"InterpretParams(shuffle_seed={self.shuffle_seed!r}): expected an "
                              "int or None.")
        axes = self.parallel_axes
        if not (axes is None or axes == "all" or (isinstance(axes, tuple) and all(
                isinstance(a, int) and a >= 0 for a in axes))):
            raise PallasError(
                f"InterpretParams(parallel_axes={axes!r}): expected a tuple of grid axes, "
                "'all' or None. Fix: e.g. parallel_axes=(0, 1).")

    def resolved_parallel_axes(self, grid: tuple[int, ...], other_params: Any) -> tuple[int, ...]:
        """The grid axes treated as parallel, with ``None`` and ``"all"`` resolved."""
        if self.parallel_axes == "all":
            return tuple(range(len(grid)))
        if isinstance(self.parallel_axes, tuple):
            return tuple(a for a in self.parallel_axes if a < len(grid))
        semantics = getattr(other_params, "dimension_semantics", None)
        if semantics is None:
            return ()
        return tuple(a for a, s in enumerate(semantics)
                     if str(getattr(s, "value", s)).lower().endswith("parallel"))
