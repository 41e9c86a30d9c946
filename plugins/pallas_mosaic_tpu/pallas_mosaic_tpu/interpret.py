"""TPU interpret mode as ``jax.experimental.pallas.tpu`` spells it: ``pltpu.InterpretParams``,
``force_tpu_interpret_mode``, ``set_tpu_interpret_mode`` and ``reset_tpu_interpret_mode_state``.

Passing ``interpret=pltpu.InterpretParams(...)`` (or forcing it) runs a TPU kernel in the pallas
interpreter (the ``interpret`` backend, ``pip install pallas-interpret``), which reads these
fields by name: see ``pallas_interpret.params.from_interpret_arg`` for what each becomes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Literal

from pallas_core.backend import (
    CompilerParams,
    PallasError,
    force_interpret_mode,
    set_interpret_mode,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class InterpretParams(CompilerParams):
    """Parameters of TPU interpret mode, with the fields and defaults of JAX's class.

    The interpreter runs the kernel as JAX's TPU interpret mode does: accesses outside a Ref
    raise (reads only with ``out_of_bounds_reads="raise"``; ``"uninitialized"`` reads NaN
    there), within TPU-tiled bounds with ``buffer_bounds="padded"``; unwritten memory is
    ``uninitialized_memory`` (NaN and the integer maximum, or zeros); an aliased output shares
    its input's buffer, input blocks are copied in when their index changes, and revisiting an
    output block or touching HBM directly is an error (HBM in ``pl.run_scoped`` only with
    ``allow_hbm_allocation_in_run_scoped``); the ``parallel`` grid axes are permuted by
    ``random_seed`` (0 when unset) and split between ``num_cores_or_threads`` simulated cores,
    which run one after another; ``grid_point_recorder(token, grid_point, core)`` sees every
    step in order; ``skip_floating_point_ops`` replaces float results by ``inf``;
    ``detect_races`` warns about output blocks two cores write. ``dma_execution_mode``,
    ``vector_clock_size`` and ``logging_mode`` change nothing here.
    """

    BACKEND: ClassVar[str] = "interpret"
    detect_races: bool = False
    out_of_bounds_reads: Literal["raise", "uninitialized"] = "raise"
    skip_floating_point_ops: bool = False
    uninitialized_memory: Literal["nan", "zero"] = "nan"
    num_cores_or_threads: int = 1
    vector_clock_size: int | None = None
    logging_mode: Any = None
    dma_execution_mode: Literal["eager", "on_wait"] = "on_wait"
    random_seed: int | None = None
    grid_point_recorder: Callable[..., Any] | None = None
    allow_hbm_allocation_in_run_scoped: bool = False
    buffer_bounds: Literal["logical", "padded"] = "logical"

    def __post_init__(self) -> None:
        choices = {"out_of_bounds_reads": ("raise", "uninitialized"),
                   "uninitialized_memory": ("nan", "zero"),
                   "dma_execution_mode": ("eager", "on_wait"),
                   "buffer_bounds": ("logical", "padded")}
        for field, allowed in choices.items():
            if getattr(self, field) not in allowed:
                raise PallasError(
                    f"pltpu.InterpretParams({field}={getattr(self, field)!r}): expected one of "
                    f"{', '.join(map(repr, allowed))}.")
        if not isinstance(self.num_cores_or_threads, int) or self.num_cores_or_threads < 1:
            raise PallasError(
                f"pltpu.InterpretParams(num_cores_or_threads={self.num_cores_or_threads!r}): "
                "expected an int of at least 1.")
        if self.vector_clock_size is not None and self.vector_clock_size < 1:
            raise PallasError(
                f"pltpu.InterpretParams(vector_clock_size={self.vector_clock_size!r}): expected "
                "None or an int of at least 1.")

    @property
    def num_cores_per_device(self) -> int:
        """The cores each device simulates (JAX's name for ``num_cores_or_threads``)."""
        return self.num_cores_or_threads


_DEFAULT = InterpretParams()


@contextlib.contextmanager
def force_tpu_interpret_mode(params: InterpretParams | None = _DEFAULT) -> Iterator[None]:
    """Within the block, every ``pallas_call``/``pl.kernel`` traced runs in the interpreter
    with ``interpret=params``, so TPU kernels that take no ``interpret`` argument run on CPU
    unchanged. ``params=None`` turns interpret mode off within the block."""
    with force_interpret_mode(params):
        yield


def set_tpu_interpret_mode(params: InterpretParams | None = _DEFAULT) -> None:
    """Forces TPU interpret mode with ``params`` on every later ``pallas_call`` in this
    process (the global form of :func:`force_tpu_interpret_mode`); ``None`` turns it off."""
    set_interpret_mode(params)


def reset_tpu_interpret_mode_state() -> None:
    """Resets the interpreter's state after a kernel raised. The pallas interpreter keeps no
    state between kernels (memory, semaphores and race records live inside one call), so
    there is nothing to reset; this exists so that code written for JAX runs unchanged."""
