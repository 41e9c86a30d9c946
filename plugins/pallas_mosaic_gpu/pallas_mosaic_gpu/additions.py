"""Names of ``jax.experimental.pallas.mosaic_gpu`` that are compositions of what this backend
has: the reductions ``plgpu.sum``/``max``/``min``/``prod``, ``plgpu.store``,
``plgpu.barrier_arrive_and_wait``, ``plgpu.wait_gmem_to_smem``, ``plgpu.mma``, GPU interpret
mode (``InterpretGPUParams``, ``force_gpu_interpret_mode``, ``set_gpu_interpret_mode``), which
runs kernels in the pallas interpreter, the semaphore operations with a memory scope
(``semaphore_signal``, ``semaphore_wait``), JAX's ``MemorySpace`` namespace, unordered
signals (``SemaphoreSignal``, ``semaphore_signal_parallel``), the scheduling hints that
never change results (``async_prefetch``; ``griddepcontrol_wait`` and
``griddepcontrol_launch_dependents``, which bind this backend's primitives for PTX's
``griddepcontrol``), ``warp_map`` and ``wgmma_accumulator_load``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp

import pallas_core as pl
from pallas_core.backend import (
    CompilerParams,
    PallasError,
    UnsupportedError,
    core_map,
    force_interpret_mode,
    set_interpret_mode,
)
from pallas_mosaic_gpu.dynamic_scheduling import WarpMesh
from pallas_mosaic_gpu.names import REGS
from pallas_mosaic_gpu.params import GMEM, SMEM, TMEM
from pallas_mosaic_gpu.primitives import (
    barrier_arrive,
    barrier_wait,
    griddepcontrol_launch_dependents_p,
    griddepcontrol_wait_p,
    wgmma_wait,
)


def _reduction(name: str, op: Callable[..., Any]) -> Callable[..., Any]:
    def reduce(x: Any, axis: int | Sequence[int] | None = None, keepdims: bool = False, *,
               accumulator_ilp: int | None = None) -> jax.Array:
        if keepdims:
            raise UnsupportedError(
                f"plgpu.{name}(keepdims=True) is not supported (nor is it in JAX). Fix: "
                "reduce without keepdims, then restore the axes with jnp.expand_dims.")
        if accumulator_ilp is not None and (isinstance(accumulator_ilp, bool) or not isinstance(
                accumulator_ilp, int) or accumulator_ilp <= 0):
            raise PallasError(f"plgpu.{name}(accumulator_ilp={accumulator_ilp!r}): expected "
                              "None or a positive int.")
        # accumulator_ilp only spreads the work over independent accumulators on the GPU.
        return op(jnp.asarray(x), axis=axis)

    reduce.__name__ = reduce.__qualname__ = name
    reduce.__doc__ = (f"The {name} of ``x`` over ``axis`` (every axis when ``None``), as "
                      f"``jnp.{name}``; ``keepdims=True`` is refused as in JAX and "
                      "``accumulator_ilp`` (a positive int) only changes speed.")
    return reduce


sum = _reduction("sum", jnp.sum)
max = _reduction("max", jnp.max)
min = _reduction("min", jnp.min)
prod = _reduction("prod", jnp.prod)


def store(dst: Any, value: Any, *, optimized: bool = True) -> None:
    """Stores ``value`` into the whole of ``dst`` (a Ref or a view of one, in SMEM or GMEM).
    ``optimized`` asks JAX's compiler for a vectorised store; results do not depend on it."""
    del optimized
    dst[...] = value


def barrier_arrive_and_wait(barrier: Any) -> None:
    """Arrives on ``barrier``, then waits until it completes its current phase."""
    barrier_arrive(barrier)
    barrier_wait(barrier)


def wait_gmem_to_smem(n: int) -> None:
    """Waits until at most ``n`` pre-Hopper ``cp.async`` GMEM->SMEM copies are in flight.

    This backend copies with TMA and completes copies through barriers, never with
    ``cp.async``, so no such copy is ever in flight: the wait returns at once."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise PallasError(f"plgpu.wait_gmem_to_smem({n!r}): expected a non-negative int.")


def mma(acc: Any, a: Any, b: Any, /) -> jax.Array:
    """``acc + a @ b``, accumulated in ``acc``'s dtype (JAX's pre-Hopper MMA instruction)."""
    acc, a, b = jnp.asarray(acc), jnp.asarray(a), jnp.asarray(b)
    if a.ndim != 2 or b.ndim != 2 or acc.shape != (a.shape[0], b.shape[1]) or (
            a.shape[1] != b.shape[0]):
        raise PallasError(f"plgpu.mma: incompatible shapes acc={acc.shape}, a={a.shape}, "
                          f"b={b.shape}; expected (M, N), (M, K), (K, N).")
    if a.dtype != b.dtype:
        raise PallasError(f"plgpu.mma: operand dtypes must match, found {a.dtype} and "
                          f"{b.dtype}. Fix: cast one to the other.")
    return acc + jnp.dot(a, b, preferred_element_type=acc.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class InterpretGPUParams(CompilerParams):
    """Options of GPU interpret mode, with the fields and defaults of JAX's class; passing it
    as ``interpret=`` runs the kernel in the pallas interpreter (the ``interpret`` backend),
    checked: ``out_of_bounds_reads``, ``uninitialized_memory``, ``skip_floating_point_ops`` and
    ``detect_races`` carry over (``pallas_interpret.params.from_interpret_arg``); the thread
    and clock counts, ``on_race``, ``logging_mode`` and ``inline_mgpu`` change nothing."""

    BACKEND: ClassVar[str] = "interpret"
    detect_races: bool = False
    on_race: Literal["raise", "warn"] = "raise"
    out_of_bounds_reads: Literal["raise", "uninitialized"] = "raise"
    skip_floating_point_ops: bool = False
    uninitialized_memory: Literal["nan", "zero"] = "nan"
    num_cores_or_threads: int = 1
    vector_clock_size: int | None = None
    logging_mode: Any = None
    num_tma_threads_per_device: int = 5
    inline_mgpu: str = "error"

    def __post_init__(self) -> None:
        choices = {"on_race": ("raise", "warn"),
                   "out_of_bounds_reads": ("raise", "uninitialized"),
                   "uninitialized_memory": ("nan", "zero"), "inline_mgpu": ("error", "ignore")}
        for field, allowed in choices.items():
            if getattr(self, field) not in allowed:
                raise PallasError(
                    f"plgpu.InterpretGPUParams({field}={getattr(self, field)!r}): expected one "
                    f"of {', '.join(map(repr, allowed))}.")
        if self.vector_clock_size is not None:
            raise PallasError("plgpu.InterpretGPUParams(vector_clock_size=...): must be None "
                              "in GPU interpret mode (as in JAX).")
        for field in ("num_cores_or_threads", "num_tma_threads_per_device"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PallasError(f"plgpu.InterpretGPUParams({field}={value!r}): expected an "
                                  "int of at least 1.")


_DEFAULT = InterpretGPUParams()


@contextlib.contextmanager
def force_gpu_interpret_mode(params: InterpretGPUParams | None = _DEFAULT) -> Iterator[None]:
    """Within the block, every ``pallas_call``/``plgpu.kernel``/``pl.core_map`` traced runs
    in the interpreter with ``interpret=params``; ``None`` turns interpret mode off."""
    with force_interpret_mode(params):
        yield


def set_gpu_interpret_mode(params: InterpretGPUParams | None = _DEFAULT) -> None:
    """Forces GPU interpret mode with ``params`` on every later kernel in this process (the
    global form of :func:`force_gpu_interpret_mode`); ``None`` turns it off."""
    set_interpret_mode(params)


_SCOPES = ("sys", "gpu")


def _scope(memory_scope: str, fn: str) -> None:
    if memory_scope not in _SCOPES:
        raise PallasError(f"plgpu.{fn}(memory_scope={memory_scope!r}): expected 'sys' or "
                          "'gpu'.")


def semaphore_signal(semaphore: Any, inc: Any = 1, *, device_id: Any = None,
                     memory_scope: str = "sys") -> None:
    """Adds ``inc`` to ``semaphore`` (on device ``device_id`` of the mesh when given), as
    ``pl.semaphore_signal``. ``memory_scope`` ("sys" or "gpu") is the scope of the atomic in
    JAX; this backend's signal is at least as strong as either."""
    _scope(memory_scope, "semaphore_signal")
    pl.semaphore_signal(semaphore, inc, device_id=device_id)


def semaphore_wait(semaphore: Any, value: Any = 1, *, decrement: bool = True,
                   memory_scope: str = "sys") -> None:
    """Waits until ``semaphore`` reaches ``value``, then subtracts it if ``decrement``, as
    ``pl.semaphore_wait``; ``memory_scope`` as in :func:`semaphore_signal`."""
    _scope(memory_scope, "semaphore_wait")
    pl.semaphore_wait(semaphore, value, decrement=decrement)


def async_prefetch(ref: Any, *, collective_axes: str | tuple[str, ...] | None = None,
                   leader_tracked: Any = None, predicate: Any = None) -> None:
    """Asks for ``ref`` (in GMEM) to be fetched into the L2 cache. A hint that never changes
    results: this backend emits nothing for it, and the interpreter does nothing."""
    del collective_axes, leader_tracked, predicate
    if not hasattr(ref, "shape"):
        raise PallasError(f"plgpu.async_prefetch: expected a GMEM Ref, found {ref!r}.")


def griddepcontrol_wait() -> None:
    """Waits until the kernels this one depends on have finished and their writes are visible
    (programmatic dependent launch: PTX ``griddepcontrol.wait``, as JAX emits it). Without
    such a launch the kernel starts after them anyway, so the wait returns at once; the
    interpreter does nothing."""
    griddepcontrol_wait_p.bind(tree=jax.tree_util.tree_structure(()), roles=())


def griddepcontrol_launch_dependents() -> None:
    """Lets the kernel launched after this one start before this one ends (programmatic
    dependent launch: PTX ``griddepcontrol.launch_dependents``, as JAX emits it). Only timing
    depends on it; the interpreter does nothing."""
    griddepcontrol_launch_dependents_p.bind(tree=jax.tree_util.tree_structure(()), roles=())


@dataclasses.dataclass(frozen=True)
class SemaphoreSignal:
    """One signal of :func:`semaphore_signal_parallel`: add ``inc`` to the semaphore ``ref``
    on device ``device_id`` (``None``: this one)."""

    ref: Any
    _: dataclasses.KW_ONLY
    device_id: Any
    inc: Any = 1


def semaphore_signal_parallel(*signals: SemaphoreSignal) -> None:
    """Makes every signal, in no guaranteed order of arrival (the writes before the call are
    visible before any arrives). This backend signals them in order, one of the orders that
    allows."""
    for signal in signals:
        if not isinstance(signal, SemaphoreSignal):
            raise PallasError(f"plgpu.semaphore_signal_parallel: expected plgpu.SemaphoreSignal "
                              f"objects, found {signal!r}.")
        pl.semaphore_signal(signal.ref, signal.inc, device_id=signal.device_id)


class _Members(type):
    def __iter__(cls) -> Iterator[Any]:
        return iter((cls.GMEM, cls.SMEM, cls.TMEM, cls.REGS))  # type: ignore[attr-defined]


class MemorySpace(metaclass=_Members):
    """JAX's GPU memory spaces by name: ``MemorySpace.GMEM``, ``.SMEM`` and ``.TMEM`` are
    ``plgpu.GMEM``, ``plgpu.SMEM`` and ``plgpu.TMEM`` (call one for a buffer:
    ``plgpu.MemorySpace.SMEM((128, 128), jnp.float16)``); ``REGS`` is ``plgpu.REGS``, whose
    buffers are wgmma accumulators (``plgpu.ACC``)."""

    GMEM = GMEM
    SMEM = SMEM
    TMEM = TMEM
    REGS = REGS


_WARP_AXES = itertools.count()


def warp_map(f: Callable[[jax.Array], Any], /) -> Any:
    """Runs ``f(warp)`` once per warp of the warpgroup (``warp`` from 0 to 3): ``pl.core_map``
    over a ``plgpu.WarpMesh`` of a fresh axis name. As there, a warp holds scalars and Refs
    and ``f`` returns nothing."""
    mesh = WarpMesh(axis_name=f"_warp_map_{next(_WARP_AXES)}")
    # pl.core_map takes any mesh with map_inside_kernel (WarpMesh is one), not only pl.Mesh.
    return core_map(mesh)(  # type: ignore[arg-type]
        lambda: f(jax.lax.axis_index(mesh.axis_name)))


def wgmma_accumulator_load(acc: Any, *, wait_n: int | None = 0) -> jax.Array:
    """The value of the accumulator ``acc`` (a ``plgpu.ACC`` Ref) once at most ``wait_n``
    wgmma are in flight. Reading an accumulator here waits for every wgmma writing it, so the
    value is the complete one whatever ``wait_n`` (``None``: JAX does not wait)."""
    if wait_n is not None:
        if isinstance(wait_n, bool) or not isinstance(wait_n, int) or wait_n < 0:
            raise PallasError(f"plgpu.wgmma_accumulator_load(wait_n={wait_n!r}): expected "
                              "None or an int >= 0.")
        wgmma_wait(wait_n)
    return acc[...]
