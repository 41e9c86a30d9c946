"""What the SparseCore emulator's rules read while a kernel runs: the memory spaces of memref
types (:func:`space_of`) and fresh memory (:func:`garbage`, :func:`fresh`: NaN, or the byte
``0x5A`` for integers, as on the chip), each subcore's :class:`Program`, the :class:`SCState`
(the running program, the buffers the subcores of a core share) that :class:`SCCompiler`
carries to the rules (:func:`sc_of`), and the :class:`Scheduler` that runs programs waiting
for each other at barriers and on semaphores."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from jaxlib.mlir import ir
from pallas_mosaic_tpu.emulator_ops import EmulationError, allocate, is_semaphore
from pallas_mosaic_tpu.emulator_state import KernelState, TPUCompiler

from pallas_core.backend import (
    EmulatorFunction,
    EmulatorRule,
    Turns,
    UnsupportedError,
    dtype_of,
    shape_of,
)


def space_of(t: ir.Type) -> str:
    """The memory space of a memref type: ``hbm``, ``vmem``, ``vmem_shared``, ``smem`` or
    ``semaphore_mem``."""
    text = str(ir.MemRefType(t).memory_space) if isinstance(t, ir.MemRefType) else ""
    for s in ("vmem_shared", "semaphore_mem", "vmem", "smem", "hbm", "any"):
        if f"<{s}>" in text:
            return "hbm" if s == "any" else s
    return "semaphore_mem" if is_semaphore(t) else "vmem"


def garbage(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """Memory nobody wrote: NaN for floats, the byte ``0x5A`` repeated for integers."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f" or dtype.name == "bfloat16":
        return np.full(shape, np.nan, dtype)
    out = np.zeros(shape, dtype)
    if dtype.kind in "iu":
        out.view(np.uint8)[...] = 0x5A
    return out


def fresh(t: ir.Type) -> np.ndarray:
    """A new buffer of the memref type ``t`` (semaphores at zero, data garbage)."""
    if is_semaphore(t):
        return allocate(t)
    return garbage(shape_of(t), dtype_of(t))


class Program:
    """One subcore's run of the kernel function: its indices and its arguments (and, when the
    devices of a ``shard_map`` run together, its device and that device's state)."""

    def __init__(self, core: int, subcore: int, args: Sequence[Any], device: int = 0,
                 sc: SCState | None = None) -> None:
        self.core, self.subcore, self.device = core, subcore, device
        self.args = list(args)
        self.sc = sc
        self.allocas: dict[int, int] = {}  # op id -> how many times this program ran it
        self.barrier = np.zeros((), np.int64)  # its barrier semaphore (tpu.sem_barrier)
        self.name = f"(core {core}, subcore {subcore})"

    def __repr__(self) -> str:
        return self.name


class SCState:
    """What the SparseCore rules read while a kernel runs: the running program (each program
    runs in a thread of its own when programs wait for each other) and the buffers the
    subcores of a core share."""

    def __init__(self) -> None:
        self._running = threading.local()
        self.shared: dict[tuple[int, int, int], np.ndarray] = {}
        self.scheduler: Scheduler | None = None
        self.programs: list[Program] = []

    @property
    def current(self) -> Program | None:
        return getattr(self._running, "program", None)

    @current.setter
    def current(self, program: Program | None) -> None:
        self._running.program = program

    def program(self) -> Program:
        if self.current is None:
            raise UnsupportedError("a SparseCore operation ran outside a subcore's program")
        return self.current


class SCCompiler(TPUCompiler):
    """The TPU emulator's compiler with the SparseCore state (each program's values live in
    its own thread's frames, so programs switching at barriers keep theirs)."""

    def __init__(self, rules: Mapping[str, EmulatorRule], state: KernelState, sc: SCState, *,
                 module: ir.Module) -> None:
        super().__init__(rules, state, backend="sparsecore", module=module)
        self.sc = sc


def sc_of(c: Any) -> SCState:
    sc = getattr(c, "sc", None)
    if not isinstance(sc, SCState):
        raise UnsupportedError("SparseCore operations need the SparseCore emulator's compiler")
    return sc


class Scheduler:
    """Runs the programs in :class:`~pallas_core.emulation.turns.Turns` (one at a time, each
    in its own thread): a program reaching ``tpu.barrier`` waits there until every subcore of
    its core (of its device) has reached it, and a program waiting on a semaphore waits until
    a signal or DMA (from another subcore, or another device) raises it; the turn passes to the
    next program that can run."""

    def __init__(self, programs: Sequence[Program], bodies: Mapping[int, EmulatorFunction],
                 subcores: int) -> None:
        self.programs, self.bodies, self.subcores = list(programs), bodies, subcores
        self.turns = Turns([p.name for p in self.programs], self._deadlock)
        self.arrived: dict[tuple[int, int, int], int] = {}
        self.generation: dict[tuple[int, int, int], int] = {}

    @staticmethod
    def _deadlock(waiting: list[tuple[str, str]], finished: list[str]) -> BaseException:
        done = ", ".join(finished) or "none"
        if all(what.startswith("barrier") for _, what in waiting):
            return EmulationError(
                f"the SparseCore kernel would hang: subcores "
                f"{', '.join(name for name, _ in waiting)} wait at a barrier that the other "
                f"subcores of their core never reach (finished: {done}). Fix: make every "
                "subcore of a core reach each plsc.subcore_barrier the same number of times.")
        stuck = "; ".join(f"{name} waits at {what}" for name, what in waiting)
        return EmulationError(
            f"the SparseCore kernel would hang: {stuck} (finished: {done}), and no subcore "
            "left running releases them. Fix: make every wait match a barrier all subcores "
            "of the core reach, or a signal or DMA (of this device or another) that is sent.")

    def run(self) -> None:
        def program(p: Program) -> Callable[[], None]:
            def go() -> None:
                assert p.sc is not None
                p.sc.current = p
                with np.errstate(all="ignore"):
                    self.bodies[p.device](*p.args)
            return go
        self.turns.run([program(p) for p in self.programs])

    def barrier(self, program: Program, barrier_id: int) -> None:
        """Called by the running ``program`` at a ``tpu.barrier``."""
        key = (program.device, program.core, barrier_id)
        gen = self.generation.get(key, 0)
        self.arrived[key] = self.arrived.get(key, 0) + 1
        if self.arrived[key] == self.subcores:
            self.arrived[key] = 0
            self.generation[key] = gen + 1
        self.turns.wait_until(lambda: self.generation.get(key, 0) > gen,
                              f"barrier {barrier_id}")
