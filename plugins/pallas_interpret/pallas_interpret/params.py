"""The interpreter's compiler parameters, and the translation of JAX-style interpret params."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

from pallas_core.backend import CompilerParams, PallasError

NAME = "interpret"

_CHOICES = {"uninitialized_memory": ("nan", "zero"),
            "out_of_bounds_reads": ("raise", "uninitialized"),
            "buffer_bounds": ("logical", "padded"),
            "on_race": ("raise", "warn")}
_FLAGS = ("checked", "fast", "detect_races", "skip_floating_point_ops", "tpu_memory",
          "allow_hbm_allocation_in_run_scoped")


@dataclasses.dataclass(frozen=True)
class InterpretParams(CompilerParams):
    """Compiler parameters of the interpreter; passing them selects it.

    ``checked``: run step by step in checked mode: accesses outside a Ref are reported (see
    ``out_of_bounds_reads``, ``buffer_bounds``), blocks that index maps reading scalar-prefetch
    operands place outside their arrays too (unchecked, they are clamped back inside; the
    other index maps are checked ahead of time in any mode), races between ``parallel_axes`` (with
    ``detect_races``), and memory nobody wrote reads as poison (see ``uninitialized_memory``).
    ``fast``: run the grid axes along which no output block is revisited as one batched
    evaluation when that is proven safe (``False``: always step by step).
    ``parallel_axes``: the grid axes the target hardware may run in parallel, for race
    detection in checked mode, ``shuffle_seed`` and ``num_cores``: a tuple of axes, ``"all"``
    (GPU backends run every step in parallel), or ``None`` (take them from the
    ``dimension_semantics`` of another backend's params, when the kernel has such params).
    ``shuffle_seed``: run the indices of each of the ``parallel_axes`` in an order shuffled by
    this seed (a ``jax.random`` permutation per axis), to expose kernels that depend on it.
    ``uninitialized_memory``: what memory nobody has written reads as (edge-block padding,
    outputs before their first write, scratch): ``"nan"`` (NaN for floats, the minimum for
    integers, as JAX's interpret mode fills it; the maximum and ``True`` with ``tpu_memory``,
    as JAX's TPU interpret mode does) or ``"zero"``.
    ``out_of_bounds_reads`` (checked mode): a read outside a Ref, or an input block outside its
    array, ``"raise"``-s, or reads ``"uninitialized"`` memory there. Writes outside always
    raise (masked writes only where the mask is set).
    ``buffer_bounds`` (checked mode): ``"padded"`` treats each Ref outside SMEM as padded to the
    TPU's tiling (of the TPU generation of the abstract mesh in use, as
    ``jax.sharding.use_abstract_mesh`` sets it): accesses inside the padding are not errors,
    reads there see uninitialized memory and writes there are dropped.
    ``detect_races`` (checked mode): report two steps of ``parallel_axes`` that write one
    output block (with ``tpu_memory``: two steps on different cores), by raising a
    ``RaceError`` (``on_race="raise"``) or with a ``RaceWarning`` (``"warn"``, as JAX prints
    races and runs on).
    ``num_cores``: simulate this many cores that split the ``parallel_axes`` (which must lead
    the grid) between them in contiguous chunks, as a TPU splits its grid between TensorCores;
    each core has its own scratch and block buffers. The cores run one after another.
    ``grid_point_recorder``: called on the host as ``f(token, grid_point, core)`` before each
    grid step, in the order the steps run (``grid_point`` an int32 array of the indices).
    ``skip_floating_point_ops``: operations whose results are all floating point are not run;
    their results (and so every float a kernel stores) are ``inf``. For exercising a kernel's
    memory traffic and integer logic quickly.
    ``tpu_memory``: model memory as JAX's TPU interpret mode does: an output aliased to an
    input shares its buffer (later steps read what earlier ones wrote); an input block is
    copied in only when its block index changes, so a kernel's writes to it last until then
    and never reach the input; returning to an output block after leaving it is an error;
    kernels may not read or write HBM (or ``ANY``) Refs directly, nor allocate them in
    ``pl.run_scoped`` unless ``allow_hbm_allocation_in_run_scoped``.
    """

    BACKEND: ClassVar[str] = NAME
    checked: bool = False
    fast: bool = True
    parallel_axes: tuple[int, ...] | str | None = None
    shuffle_seed: int | None = None
    uninitialized_memory: str = "nan"
    out_of_bounds_reads: str = "raise"
    buffer_bounds: str = "logical"
    detect_races: bool = True
    on_race: str = "raise"
    num_cores: int = 1
    grid_point_recorder: Callable[..., Any] | None = None
    skip_floating_point_ops: bool = False
    tpu_memory: bool = False
    allow_hbm_allocation_in_run_scoped: bool = True

    def __post_init__(self) -> None:
        for field, allowed in _CHOICES.items():
            if getattr(self, field) not in allowed:
                raise PallasError(f"InterpretParams({field}={getattr(self, field)!r}): expected "
                                  f"one of {', '.join(map(repr, allowed))}.")
        for field in _FLAGS:
            if not isinstance(getattr(self, field), bool):
                raise PallasError(f"InterpretParams({field}={getattr(self, field)!r}): expected "
                                  "True or False.")
        if self.shuffle_seed is not None and not isinstance(self.shuffle_seed, int):
            raise PallasError(f"InterpretParams(shuffle_seed={self.shuffle_seed!r}): expected an "
                              "int or None.")
        if isinstance(self.num_cores, bool) or not isinstance(self.num_cores, int) or (
                self.num_cores < 1):
            raise PallasError(f"InterpretParams(num_cores={self.num_cores!r}): expected an int "
                              "of at least 1.")
        if self.grid_point_recorder is not None and not callable(self.grid_point_recorder):
            raise PallasError(f"InterpretParams(grid_point_recorder={self.grid_point_recorder!r})"
                              ": expected a callable f(token, grid_point, core) or None.")
        axes = self.parallel_axes
        if not (axes is None or axes == "all" or (isinstance(axes, tuple) and all(
                isinstance(a, int) and a >= 0 for a in axes))):
            raise PallasError(
                f"InterpretParams(parallel_axes={axes!r}): expected a tuple of grid axes, "
                "'all' or None. Fix: e.g. parallel_axes=(0, 1).")

    def resolved_parallel_axes(self, grid: tuple[int, ...], other_params: Any,
                               kernel: str = "") -> tuple[int, ...]:
        """The grid axes treated as parallel, with ``None`` and ``"all"`` resolved.

        Raises ``PallasError`` if ``parallel_axes`` names an axis the grid does not have.
        """
        if self.parallel_axes == "all":
            return tuple(range(len(grid)))
        if isinstance(self.parallel_axes, tuple):
            for a in self.parallel_axes:
                if a >= len(grid):
                    of = f" of kernel {kernel!r}" if kernel else ""
                    raise PallasError(
                        f"InterpretParams(parallel_axes={self.parallel_axes!r}): grid axis {a} "
                        f"does not exist: the grid {tuple(grid)}{of} has {len(grid)} "
                        f"ax{'i' if len(grid) == 1 else 'e'}s"
                        + (f" (0..{len(grid) - 1})" if grid else "")
                        + ", so races along it would never be looked for. Fix: name axes of "
                        "the grid (counting from 0), or 'all'.")
            return self.parallel_axes
        semantics = getattr(other_params, "dimension_semantics", None)
        if semantics is None:
            return ()
        return tuple(a for a, s in enumerate(semantics)
                     if str(getattr(s, "value", s)).lower().endswith("parallel"))

    @property
    def poison(self) -> bool:
        """Checked mode fills unwritten memory with poison, unless told to use zeros."""
        return self.checked and self.uninitialized_memory != "zero"

    @property
    def fill(self) -> str:
        """The fill of unwritten memory, as ``pallas_core.semantics.uninitialized_memory``
        names it."""
        if self.uninitialized_memory == "zero":
            return "zero"
        return "nan_max" if self.tpu_memory else "nan"


# The fields of JAX's interpret-mode params (``jax.experimental.pallas.tpu.InterpretParams``
# and the Mosaic TPU plugin's copy of it) that change nothing here, and why.
IGNORED_FIELDS = {
    "vector_clock_size": "races are found ahead of time from the index maps, without clocks",
    "logging_mode": "there is no simulated shared memory to log",
    "dma_execution_mode": "copies move their data when they start (JAX's 'eager'); a kernel "
                          "that waits on every copy before reading its destination sees the "
                          "same values in either mode",
}


def from_interpret_arg(value: Any) -> InterpretParams:
    """Our params for ``interpret=value``: ours as they are, JAX-style ones translated.

    JAX's TPU interpret params become checked mode with the TPU memory model (``tpu_memory``):
    ``out_of_bounds_reads``, ``uninitialized_memory``, ``buffer_bounds``,
    ``skip_floating_point_ops``, ``grid_point_recorder``, ``detect_races`` and
    ``allow_hbm_allocation_in_run_scoped`` carry over; ``num_cores_or_threads`` becomes
    ``num_cores``; the ``parallel`` grid axes of the kernel's ``dimension_semantics`` are always
    shuffled, by ``random_seed`` (0 when unset), as JAX does. The fields in ``IGNORED_FIELDS``
    change nothing. Objects without TPU fields (JAX's GPU interpret params) get checked mode
    with their shared fields only.
    """
    if isinstance(value, InterpretParams):
        return value
    if value is None or isinstance(value, bool):
        return InterpretParams()
    get = lambda name, default=None: getattr(value, name, default)  # noqa: E731
    # JAX's TPU params; its GPU ones (threads, not cores) share only the fields below.
    tpu = hasattr(value, "dma_execution_mode")
    seed = get("random_seed")
    return InterpretParams(
        checked=True,
        parallel_axes=None,
        shuffle_seed=(0 if seed is None else int(seed)) if tpu else None,
        uninitialized_memory=str(get("uninitialized_memory", "nan")),
        out_of_bounds_reads=str(get("out_of_bounds_reads", "raise")),
        buffer_bounds=str(get("buffer_bounds", "logical")),
        detect_races=bool(get("detect_races", False)),
        on_race="warn",
        num_cores=int(get("num_cores_or_threads", 1) or 1) if tpu else 1,
        grid_point_recorder=get("grid_point_recorder"),
        skip_floating_point_ops=bool(get("skip_floating_point_ops", False)),
        tpu_memory=tpu,
        allow_hbm_allocation_in_run_scoped=bool(get("allow_hbm_allocation_in_run_scoped",
                                                    not tpu)),
    )
