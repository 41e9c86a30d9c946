"""The interpreter's compiler parameters."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from pallas_core.errors import PallasError, UnsupportedError
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
    ``uninitialized_memory``: what memory nobody has written reads as (edge-block padding,
    outputs before their first write, scratch): ``"nan"`` (NaN for floats, the minimum for
    integers, as JAX's interpret mode fills it) or ``"zero"``. Checked mode always poisons.
    """

    BACKEND: ClassVar[str] = NAME
    checked: bool = False
    fast: bool = True
    parallel_axes: tuple[int, ...] | str | None = None
    shuffle_seed: int | None = None
    uninitialized_memory: str = "nan"

    def __post_init__(self) -> None:
        if self.uninitialized_memory not in ("nan", "zero"):
            raise PallasError(f"InterpretParams(uninitialized_memory={self.uninitialized_memory!r})"
                              ": expected 'nan' or 'zero'.")
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


# The fields of JAX's interpret-mode params (``jax.experimental.pallas.tpu.InterpretParams``
# and the Mosaic TPU plugin's copy of it) and what each becomes here. Any object passed as
# ``interpret=`` that is not ours is read by these names.
_IGNORED_FIELDS = {
    "vector_clock_size": "the race detector here works ahead of time from the index maps",
    "logging_mode": "there is no simulated memory to log",
    "dma_execution_mode": "copies complete when they start; a kernel that waits on every copy "
                          "before reading its destination sees the same values either way",
    "allow_hbm_allocation_in_run_scoped": "run_scoped allocates in any memory space here",
}


def from_interpret_arg(value: Any) -> InterpretParams:
    """Our params for ``interpret=value``: ours as they are, JAX-style ones translated.

    JAX's ``detect_races`` and ``random_seed`` become checked mode and a shuffled order over the
    ``parallel`` grid axes of the kernel's ``dimension_semantics``; ``out_of_bounds_reads=
    "raise"`` (JAX's default) becomes checked mode, which reports reads outside a Ref;
    ``uninitialized_memory`` carries over. Fields with no counterpart here are refused by name
    when set to anything but their default, except the ones in ``_IGNORED_FIELDS``.
    """
    if isinstance(value, InterpretParams):
        return value
    if value is None or isinstance(value, bool):
        return InterpretParams()
    get = lambda name, default=None: getattr(value, name, default)  # noqa: E731
    refused = {
        "skip_floating_point_ops": (get("skip_floating_point_ops", False), False),
        "grid_point_recorder": (get("grid_point_recorder"), None),
        "buffer_bounds": (get("buffer_bounds", "logical"), "logical"),
        "num_cores_or_threads": (get("num_cores_or_threads", 1), 1),
    }
    for field, (found, default) in refused.items():
        if found != default:
            raise UnsupportedError(
                f"{type(value).__name__}({field}={found!r}) is not supported by the pallas "
                f"interpreter (it supports {field}={default!r}). Fix: leave {field} at its "
                "default; the interpreter's own options are pallas_interpret.InterpretParams.")
    races, seed = bool(get("detect_races", False)), get("random_seed")
    oob = get("out_of_bounds_reads", "raise")
    return InterpretParams(
        checked=races or oob == "raise",
        parallel_axes=None if (races or seed is not None) else (),
        shuffle_seed=None if seed is None else int(seed),
        uninitialized_memory=str(get("uninitialized_memory", "nan")),
    )
