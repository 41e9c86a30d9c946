"""What a running TensorCore kernel's operations read besides their operands, in the Mosaic
TPU emulator: :class:`KernelState` (the grid, the TensorCore, the hardware PRNG, the
hand-driven :class:`MXUs`, and under ``shard_map`` the device and its buffers other devices
reach), :class:`Network` (the devices of a ``shard_map`` running one kernel together, one at a
time), and :class:`TPUCompiler`, the compiler that carries the state to the rules
(:func:`state_of`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jaxlib.mlir import ir

from pallas_core.backend import EmulatorCompiler, EmulatorRule, Turns, UnsupportedError
from pallas_mosaic_tpu.emulator_ops import EmulationError, _unsupported


class KernelState:
    """What a running kernel's operations read besides their operands: the grid, the
    TensorCore running it, the hardware PRNG, and under ``shard_map`` the device running it
    and the other devices' kernels (:class:`Network`)."""

    def __init__(self, bounds: Sequence[int], device: int | None = None,
                 network: Network | None = None, name: str = "kernel") -> None:
        self.name = name
        """The kernel's name, for messages."""
        self.bounds = tuple(bounds)
        self.core = 0
        self.rng: np.random.Generator | None = None
        self.device = device
        """The logical device id under ``shard_map`` (``None`` elsewhere)."""
        self.network = network
        self.barrier = np.zeros((), np.int64)
        """The device's barrier semaphore (``tpu.sem_barrier``)."""
        self.buffers: dict[Any, np.ndarray] = {}
        """The device's buffers another device may reach, by a key the same on every device:
        ``("arg", k)`` for the kernel's operands, ``("op", n)`` for the n-th allocating
        operation, ``"barrier"``."""
        self.keys: dict[int, Any] = {}
        """``id(buffer)`` -> its key in :attr:`buffers`."""
        self.allocations = 0
        """Allocating operations compiled so far (their keys' numbers)."""
        self.mxu = MXUs()
        """The hand-driven MXUs (``tpu.matmul_push_rhs`` and the others)."""

    def register(self, key: Any, buffer: np.ndarray) -> None:
        old = self.buffers.get(key)
        if old is not None:
            self.keys.pop(id(old), None)
        self.buffers[key] = buffer
        self.keys[id(buffer)] = key


def _root(view: np.ndarray) -> np.ndarray:
    while isinstance(view.base, np.ndarray):
        view = view.base
    return view


class Network:
    """The devices of a ``shard_map`` running one kernel together: each in its own thread,
    one at a time (:class:`~pallas_core.emulation.turns.Turns`), switching where a device
    waits on a semaphore. A remote DMA or signal reaches the other device's buffer or
    semaphore: the same operand, scratch buffer or allocation there, at the same offset."""

    def __init__(self, devices: int, name: str = "") -> None:
        self.name = name
        self.states: list[KernelState] = []
        self.turns = Turns([f"device {d}" for d in range(devices)], self._deadlock)

    def _deadlock(self, waiting: list[tuple[str, str]], finished: list[str]) -> BaseException:
        places: dict[str, list[str]] = {}
        for name, what in waiting:
            places.setdefault(what, []).append(name.removeprefix("device "))
        stuck = "; ".join(
            f"device{'s' if len(ds) > 1 else ''} {', '.join(ds)} wait{'' if len(ds) > 1 else 's'}"
            f" at {what}" for what, ds in places.items())
        return EmulationError(
            f"kernel {self.name!r} would hang: {stuck} (finished: "
            f"{', '.join(finished) or 'none'}), and no device left running signals them. "
            "Fix: make every wait match a signal or DMA that another device (or this one) "
            "sends.")

    def remote(self, state: KernelState, op: ir.Operation, local: np.ndarray,
               device: Any) -> np.ndarray:
        """The view of device ``device`` that ``local`` (a view on ``state``'s device) is."""
        d = int(device)
        if not 0 <= d < len(self.states):
            raise EmulationError(
                f"{op.name} at {op.location} names device {d}; the shard_map's mesh has "
                f"{len(self.states)} devices (logical ids 0..{len(self.states) - 1}). Fix: "
                "compute the device id from lax.axis_index of the mesh axes.")
        root = _root(local)
        key = state.keys.get(id(root))
        peer = self.states[d].buffers.get(key) if key is not None else None
        if key is None:
            raise _unsupported(op, "a remote access to a buffer other than the kernel's "
                               "operands, scratch buffers and scoped allocations")
        if peer is None:
            raise EmulationError(
                f"{op.name} at {op.location} reaches a scoped buffer of device {d}, which has "
                "not allocated it (it is not inside that scope). Fix: synchronise with the "
                "device (a barrier) before reaching into its scoped buffers.")
        offset = local.__array_interface__["data"][0] - root.__array_interface__["data"][0]
        return np.ndarray(local.shape, local.dtype, buffer=peer, offset=offset,
                          strides=local.strides)

    def take(self, op: ir.Operation, sem: np.ndarray, amount: int) -> None:
        """Waits (letting the other devices run) until ``sem`` holds ``amount``; takes it."""
        self.turns.wait_until(lambda: int(sem) >= amount,
                              f"{op.name} ({op.location}) for {amount}")
        sem[...] = int(sem) - amount


class TPUCompiler(EmulatorCompiler):
    """A :class:`Compiler` carrying the running kernel's :class:`KernelState`."""

    def __init__(self, rules: Mapping[str, EmulatorRule], state: KernelState, *, backend: str,
                 module: ir.Module) -> None:
        super().__init__(rules, backend=backend, module=module)
        self.state = state


def state_of(c: EmulatorCompiler) -> KernelState:
    state = getattr(c, "state", None)
    if not isinstance(state, KernelState):
        raise UnsupportedError("TPU operations need the TPU emulator's compiler")
    return state


class MXUs:
    """What the kernel's MXUs hold: staged RHS by ``(mxu, register)``, the loaded RHS by MXU,
    accumulators by ``(mxu, address)`` (each written whole: ``ACC`` Refs have no views), and
    each MXU's result FIFO. Accumulators start at zero and popping zeroes them; the state lasts
    for the whole kernel, as the hardware's does across grid steps."""

    def __init__(self) -> None:
        self.staged: dict[tuple[int, int], np.ndarray] = {}
        self.loaded: dict[int, np.ndarray] = {}
        self.accs: dict[tuple[int, int], np.ndarray] = {}
        self.fifo: dict[int, list[np.ndarray]] = {}

    def product(self, op: ir.Operation, lhs: Any, mxu: int, load: int | None) -> np.ndarray:
        """``lhs`` times MXU ``mxu``'s RHS (loaded first from register ``load``), summed in
        float32 (int32 for integers) as the MXU accumulates."""
        if load is not None:
            if (mxu, load) not in self.staged:
                raise EmulationError(f"{op.name} at {op.location} loads staging register "
                                     f"{load} of MXU {mxu}, which holds no RHS.")
            self.loaded[mxu] = self.staged.pop((mxu, load))
        if mxu not in self.loaded:
            raise EmulationError(f"{op.name} at {op.location}: MXU {mxu} has no loaded RHS.")
        lhs, rhs = np.asarray(lhs), self.loaded[mxu]
        if np.issubdtype(lhs.dtype, np.integer) and np.issubdtype(rhs.dtype, np.integer):
            return np.matmul(lhs.astype(np.int64), rhs.astype(np.int64)).astype(np.int32)
        return np.matmul(lhs.astype(np.float32), rhs.astype(np.float32))
