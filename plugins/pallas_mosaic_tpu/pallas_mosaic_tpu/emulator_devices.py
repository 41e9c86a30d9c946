"""The Mosaic TPU emulator's DMAs and semaphores, and the operations that read where a kernel
runs. A DMA (remote or not) completes when it starts: a remote one writes the target device's
buffer (the same operand, scratch buffer or scoped allocation there, at the same offset,
through :class:`~pallas_mosaic_tpu.emulator_state.Network`) and signals the target semaphore
there; a remote signal adds to the other device's semaphore; waits take from this device's
semaphores, letting the other devices run until they can. Allocations are registered so that
other devices reach them; ``tpu.device_id``, ``tpu.core_id``, ``tpu.iteration_bound`` and the
barrier semaphore read the kernel's state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from jaxlib.mlir import ir

from pallas_core.backend import EmulatorCompiler, EmulatorRule
from pallas_mosaic_tpu.emulator_ops import RULES as MEMORY_RULES
from pallas_mosaic_tpu.emulator_ops import (
    EmulationError,
    _unsupported,
    allocate,
    int_attribute,
    segments,
)
from pallas_mosaic_tpu.emulator_state import KernelState, state_of

_Fn = Callable[..., Any]


def _take(state: KernelState, op: ir.Operation, sem: np.ndarray, amount: int) -> None:
    """A wait on ``sem`` for ``amount``: among devices, until another one signals."""
    if state.network is not None:
        state.network.take(op, sem, amount)
    else:
        _semaphore_count(op, sem, amount)


def _remote(c: EmulatorCompiler, op: ir.Operation, what: str) -> KernelState:
    """The state of a kernel whose ``op`` reaches another device (refused outside a joint
    run of the devices of a ``shard_map``)."""
    state = state_of(c)
    if state.network is None:
        raise _unsupported(op, f"{what} outside a shard_map that runs the kernel on every "
                           "device (pl.emulate runs such kernels jointly inside shard_map)")
    return state


def _semaphore_count(op: ir.Operation, sem: np.ndarray, amount: int) -> None:
    if int(sem) < amount:
        raise EmulationError(
            f"{op.name} at {op.location} waits for {amount} on a semaphore holding {int(sem)}, "
            "and nothing else runs on this core to signal it: the kernel would hang. Fix: "
            "signal (or start the DMA on) this semaphore before waiting on it.")
    sem[...] = int(sem) - amount


def _enqueue_dma(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    """A DMA (to device ``device_id`` when given): it copies when it starts, then signals the
    source semaphore here and the target semaphore where the target is."""
    (s, _), (ss0, ss1), (t, _), (ts0, ts1), (d0, d1), *_ = segments(op)
    state = _remote(c, op, "remote DMAs (to another device)") if d1 > d0 else state_of(c)

    def run(*xs: Any) -> None:
        src, dst = xs[s], xs[t]
        target_sem = xs[ts0] if ts1 > ts0 else None
        if d1 > d0:
            assert state.network is not None
            dst = state.network.remote(state, op, dst, xs[d0])
            if target_sem is not None:
                target_sem = state.network.remote(state, op, target_sem, xs[d0])
        if src.shape != dst.shape:
            raise EmulationError(f"{op.name} at {op.location} copies {src.shape} into "
                                 f"{dst.shape}. Fix: give both refs the same shape.")
        np.copyto(dst, src.astype(dst.dtype, copy=False))
        nbytes = dst.size * dst.dtype.itemsize
        if target_sem is not None:
            target_sem[...] += nbytes
        if ss1 > ss0:
            xs[ss0][...] += nbytes
    return run


def _wait_dma2(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    """A wait for a DMA's bytes on a semaphore of this device (the ``device_id`` of a remote
    DMA's wait only describes the copy)."""
    (sem, _), _, (dst, _), (d0, d1), *_ = segments(op)
    state = _remote(c, op, "waits on remote DMAs") if d1 > d0 else state_of(c)

    def run(*xs: Any) -> None:
        target = xs[dst]
        _take(state, op, xs[sem], target.size * target.dtype.itemsize)
    return run


def _wait_dma(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    """A wait for a DMA's bytes (newer Mosaic's form, naming both ends of the copy): on the
    target semaphore (``wait_target``, the receiving side) or on the source semaphore (the
    sending side), both of this device; a ``device_id`` only describes the copy."""
    (src, _), (ss0, ss1), (dst, _), (ts0, ts1), (d0, d1), *_ = segments(op)
    wait_target = bool(ir.BoolAttr(op.attributes["wait_target"]).value)
    s0, s1 = (ts0, ts1) if wait_target else (ss0, ss1)
    if s1 == s0:
        raise _unsupported(op, f"a DMA wait without its {'target' if wait_target else 'source'}"
                           " semaphore")
    state = _remote(c, op, "waits on remote DMAs") if d1 > d0 else state_of(c)

    def run(*xs: Any) -> None:
        moved = xs[dst] if wait_target else xs[src]
        _take(state, op, xs[s0], moved.size * moved.dtype.itemsize)
    return run


def _sem_signal(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    (sem, _), (amount, _), (d0, d1), *_ = segments(op)
    state = _remote(c, op, "signals to another device's semaphore") if d1 > d0 \
        else state_of(c)

    def run(*xs: Any) -> None:
        target = xs[sem]
        if d1 > d0:
            assert state.network is not None
            target = state.network.remote(state, op, target, xs[d0])
        target[...] += int(xs[amount])
    return run


def _sem_wait(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    state = state_of(c)
    return lambda sem, amount: _take(state, op, sem, int(amount))


def _sem_read(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    return lambda sem: np.asarray(int(sem), np.int32)


def _registered(rule: EmulatorRule) -> EmulatorRule:
    """An allocating operation's rule whose buffers other devices can reach (keyed by the
    operation's place in the compile order, the same on every device)."""
    def wrapped(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
        state = state_of(c)
        fn = rule(c, op)
        if state.network is None:
            return fn
        key = ("op", state.allocations)
        state.allocations += 1

        def run(*xs: Any) -> Any:
            buffer = fn(*xs)
            state.register(key, buffer)
            return buffer
        return run
    return wrapped


def _sem_alloc(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    t = op.results[0].type
    return lambda: allocate(t)


def _iteration_bound(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    state = state_of(c)
    dim = int_attribute(op, "dim")
    return lambda: np.asarray(state.bounds[dim], np.int32)


def _device_id(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    state = state_of(c)
    if state.device is None:
        raise _unsupported(op, "device ids outside shard_map")
    device = np.asarray(state.device, np.int32)
    return lambda: device


def _sem_barrier(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    state = _remote(c, op, "the barrier semaphore")
    return lambda: state.barrier


def _multi_device(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    raise _unsupported(op, "barriers of the TensorCore")


def _core_id(c: EmulatorCompiler, op: ir.Operation) -> _Fn:
    state = state_of(c)
    return lambda: np.asarray(state.core, np.int32)


RULES: dict[str, EmulatorRule] = {
    "tpu.enqueue_dma": _enqueue_dma, "tpu.wait_dma2": _wait_dma2,
    "tpu.wait_dma": _wait_dma,
    "tpu.sem_signal": _sem_signal, "tpu.sem_wait": _sem_wait, "tpu.sem_read": _sem_read,
    "tpu.sem_alloc": _registered(_sem_alloc),
    "memref.alloca": _registered(MEMORY_RULES["memref.alloca"]),
    "memref.alloc": _registered(MEMORY_RULES["memref.alloc"]),
    "tpu.iteration_bound": _iteration_bound,
    "tpu.device_id": _device_id, "tpu.sem_barrier": _sem_barrier,
    "tpu.barrier": _multi_device, "tpu.core_id": _core_id,
}
"""The DMA, semaphore and device operations above (allocations registered for other
devices to reach), by name."""
