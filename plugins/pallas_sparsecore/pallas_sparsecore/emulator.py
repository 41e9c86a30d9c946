"""The SparseCore emulator: a SparseCore ``tpu_custom_call`` run on CPU with numpy.

It reuses the Mosaic TPU emulator's operations (:mod:`pallas_mosaic_tpu.emulator`) and adds
what a SparseCore does differently:

* **The mesh.** The kernel function's grid is ``(cores, subcores)`` (``(cores,)`` on the scalar
  subcores); every point is one subcore's program, called with its core and subcore indices.
  HBM operands are shared by all programs, ``vmem_shared`` buffers (scratch operands or
  ``memref.alloca``) by the subcores of one core, and ``vmem``/``smem`` buffers and semaphores
  belong to one subcore. Fresh memory holds garbage (NaN, or the byte ``0x5A`` for integers), as
  on the chip, so a kernel that reads memory it never wrote shows it.
* **Scheduling.** Programs run one at a time. Without ``tpu.barrier`` they run one after
  another; with barriers each runs in its own thread and the turn passes at a barrier, round
  robin (:class:`~pallas_core.emulation.turns.Turns`), so that a barrier releases a core's
  subcores only when all of them reached it. A
  program that finishes while others wait at a barrier (the chip would hang) is an
  :class:`~pallas_mosaic_tpu.emulator_ops.EmulationError`. With ``options.seed`` the programs
  start in a shuffled order (a race between subcores of one phase then shows).
* **Devices.** Under ``shard_map`` ``tpu.device_id`` is the device's row-major index in the
  mesh. A kernel that talks to other devices (``has_communication``) runs on every device
  together (:func:`run_devices`): every subcore of every device in its own thread, one at a
  time, the turn passing at barriers and semaphore waits. Remote DMAs and signals are the
  TensorCore emulator's (its :class:`~pallas_mosaic_tpu.emulator_state.Network`): they reach the
  same buffer or semaphore of the same core and subcore on the target device.
* **SparseCore operations.** Masked ``tpu.vector_load``/``tpu.vector_store`` are the expanding
  load and the compressing store; ``tpu.vector_load_idx``/``vector_store_idx`` gather and
  scatter lanes (an adding scatter accumulates repeated indices, from the lowest lane);
  ``tpu.enqueue_indirect_dma`` gathers rows from HBM/shared VMEM into VMEM or scatters (adds)
  rows the other way; ``tpu.sort`` (stable; masked-off lanes last), ``tpu.scan`` (sum, max,
  min; integers compare unsigned, as on the chip), ``tpu.scan_count``, ``tpu.all_reduce`` of a
  mask (population count, first set lane), ``tpu.pack_subelements``/``unpack_subelements``,
  ``tpu.fetch_and_add_sync`` (to the named subcore's copy of an SMEM scratch operand) and
  ``tpu.sem_barrier`` (one barrier semaphore per subcore).

Lanes the hardware leaves undefined (masked-off lanes of a gather or an expanding load) are NaN
(zero for integers); a ``tpu.scan`` sum is zero before the first kept lane and a max/min passes
the input through there. Semantics come from the Mosaic TPU dialect's documentation of each
operation and from ``jax.experimental.pallas.tpu_sc``'s docstrings.

This module lays out the mesh's programs and runs them, and is the ``pallas_emulate`` hook's
entry (:func:`emulate`); the SparseCore operations are :mod:`pallas_sparsecore.emulator_ops`'s,
the state they read (memory, programs, the scheduler) :mod:`pallas_sparsecore.emulator_state`'s.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence

import numpy as np
from jaxlib.mlir import ir
from pallas_mosaic_tpu.emulator import RULES as TPU_RULES
from pallas_mosaic_tpu.emulator import decode, is_sparsecore
from pallas_mosaic_tpu.emulator_ops import int_attribute
from pallas_mosaic_tpu.emulator_state import KernelState, Network
from pallas_mosaic_tpu.symbolic import kernel_function

from pallas_core.backend import (
    EmulatedCall,
    EmulateOptions,
    EmulatorFunction,
    UnsupportedError,
    dtype_of,
)
from pallas_sparsecore.emulator_ops import RULES
from pallas_sparsecore.emulator_state import (
    Program,
    SCCompiler,
    Scheduler,
    SCState,
    fresh,
    garbage,
    space_of,
)

# -- running a kernel -------------------------------------------------------------------------

def _has_barrier(op: ir.Operation) -> bool:
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                if inner.operation.name == "tpu.barrier" or _has_barrier(inner.operation):
                    return True
    return False


class _Layout:
    """A SparseCore kernel function's mesh and operands, read from its attributes."""

    def __init__(self, module: ir.Module, n_operands: int, n_results: int) -> None:
        self.fn = kernel_function(module)
        attrs = self.fn.attributes
        self.bounds = [int(b) for b in ir.DenseI64ArrayAttr(attrs["iteration_bounds"])]
        if not 1 <= len(self.bounds) <= 2 or any(b < 1 for b in self.bounds):
            raise UnsupportedError(f"the SparseCore emulator runs meshes of cores (and "
                                   f"subcores); the kernel's grid is {self.bounds}")
        if int_attribute(self.fn, "scalar_prefetch", 0):
            raise UnsupportedError("the SparseCore emulator found scalar prefetch operands")
        self.arg_types = list(ir.FunctionType(ir.TypeAttr(attrs["function_type"]).value).inputs)
        self.rest = self.arg_types[len(self.bounds):]
        self.n_hbm = len(self.rest) - int_attribute(self.fn, "scratch_operands", 0)
        if self.n_hbm != n_operands + n_results:
            raise UnsupportedError(
                f"the SparseCore kernel takes {self.n_hbm} HBM operands; the call has "
                f"{n_operands} inputs and {n_results} outputs")
        self.cores = self.bounds[0]
        self.subcores = self.bounds[1] if len(self.bounds) > 1 else 1


def _programs(layout: _Layout, operands: Sequence[np.ndarray],
              results: Sequence[tuple[tuple[int, ...], np.dtype]],
              aliases: Sequence[tuple[int, int]], sc: SCState, state: KernelState,
              device: int = 0) -> tuple[list[Program], list[np.ndarray]]:
    """Every subcore's program of one device and the device's output buffers; the buffers
    are registered in ``state`` by keys the same on every device (``("arg", k)`` for HBM,
    with the core, and the subcore, for shared and per-subcore scratch)."""
    rest, n_hbm = layout.rest, layout.n_hbm
    hbm = [np.array(x, dtype_of(t)) for x, t in zip(operands, rest, strict=False)]
    outs = [garbage(shape, dtype_of(rest[len(operands) + k]))
            for k, (shape, _) in enumerate(results)]
    for r, o in aliases:  # one buffer: the kernel may write either ref
        if hbm[o].shape != outs[r].shape or hbm[o].dtype != outs[r].dtype:
            raise UnsupportedError(f"result {r} aliases operand {o} of another type")
        outs[r] = hbm[o]
    for k, buffer in enumerate([*hbm, *outs]):
        state.register(("arg", k), buffer)
    per_core: dict[tuple[int, int], np.ndarray] = {}
    programs = []
    for core in range(layout.cores):
        for sub in range(layout.subcores):
            scratch = []
            for k, t in enumerate(rest[n_hbm:]):
                if space_of(t) == "vmem_shared":
                    if (core, k) not in per_core:
                        per_core[core, k] = fresh(t)
                        state.register(("arg", n_hbm + k, core), per_core[core, k])
                    scratch.append(per_core[core, k])
                else:
                    scratch.append(fresh(t))
                    state.register(("arg", n_hbm + k, core, sub), scratch[-1])
            ids = [np.asarray(i, dtype_of(t)) for i, t in zip(
                [core, sub][:len(layout.bounds)], layout.arg_types, strict=False)]
            program = Program(core, sub, [*ids, *hbm, *outs, *scratch], device, sc)
            state.register(("barrier", core, sub), program.barrier)
            programs.append(program)
    sc.programs = programs
    return programs, outs


def _shuffled(programs: list[Program], seed: int | None) -> list[Program]:
    if seed is None:
        return programs
    order = np.random.default_rng(seed).permutation(len(programs))
    return [programs[i] for i in order]


def _results(outs: Sequence[np.ndarray], results: Sequence[tuple[tuple[int, ...], np.dtype]]
             ) -> list[np.ndarray]:
    return [np.asarray(o).astype(dtype) for o, (_, dtype) in zip(outs, results, strict=True)]


def run_kernel(module: ir.Module, operands: Sequence[np.ndarray],
               results: Sequence[tuple[tuple[int, ...], np.dtype]],
               aliases: Sequence[tuple[int, int]], options: EmulateOptions,
               device: int | None = None) -> list[np.ndarray]:
    """Runs the SparseCore kernel of ``module`` on every subcore of its mesh and returns its
    results (``aliases``: ``(result, operand)`` pairs whose result starts as the operand;
    ``device``: the logical id ``tpu.device_id`` reads, under ``shard_map``)."""
    with module.context, ir.Location.unknown():
        layout = _Layout(module, len(operands), len(results))
        sc, state = SCState(), KernelState(layout.bounds, device)
        compiler = SCCompiler({**TPU_RULES, **RULES}, state, sc, module=module)
        body = compiler.function(layout.fn)
        programs, outs = _programs(layout, operands, results, aliases, sc, state)
        programs = _shuffled(programs, options.seed)
        if _has_barrier(layout.fn):
            sc.scheduler = Scheduler(programs, {0: body}, layout.subcores)
            sc.scheduler.run()
        else:
            for program in programs:
                sc.current = program
                body(*program.args)
        return _results(outs, results)


def run_devices(module: ir.Module, calls: Sequence[EmulatedCall]) -> list[list[np.ndarray]]:
    """Runs the SparseCore kernel of ``module`` on every device of a ``shard_map`` together
    (``calls[d]`` is device ``d``'s call): every subcore of every device in its own thread,
    one at a time, the turn passing where one waits at a barrier or on a semaphore. A remote
    DMA or signal (``device_id``) reaches the same buffer or semaphore of the same core and
    subcore on the target device (the TensorCore emulator's :class:`Network`). Returns each
    device's results."""
    network = Network(len(calls), calls[0].name if calls else "")
    programs: list[Program] = []
    bodies: dict[int, EmulatorFunction] = {}
    outs: list[list[np.ndarray]] = []
    with module.context, ir.Location.unknown():
        for d, call in enumerate(calls):
            layout = _Layout(module, len(call.operands), len(call.results))
            sc, state = SCState(), KernelState(layout.bounds, d, network)
            network.states.append(state)
            bodies[d] = SCCompiler({**TPU_RULES, **RULES}, state, sc,
                                   module=module).function(layout.fn)
            mine, out = _programs(layout, [np.asarray(x) for x in call.operands],
                                  call.results, call.aliases, sc, state, d)
            for p in mine:
                p.name = f"device {d} {p.name}"
            programs += mine
            outs.append(out)
        scheduler = Scheduler(_shuffled(programs, calls[0].options.seed if calls else None),
                              bodies, layout.subcores)
        network.turns = scheduler.turns  # semaphore waits hand the turn over too
        for p in programs:
            assert p.sc is not None
            p.sc.scheduler = scheduler
        scheduler.run()
    return [_results(o, call.results) for o, call in zip(outs, calls, strict=True)]


def emulate(call: EmulatedCall) -> list[np.ndarray] | None:
    """Runs a SparseCore ``tpu_custom_call``; ``None`` for every other call. A kernel that
    talks to other devices runs on every device of its ``shard_map`` together."""
    if call.target != "tpu_custom_call":
        return None
    config = json.loads(call.backend_config)
    if not is_sparsecore(config):
        return None
    _, module = decode(call.backend_config)
    if config.get("custom_call_config", {}).get("has_communication"):
        return list(call.run_jointly(functools.partial(run_devices, module)))
    return run_kernel(module, [np.asarray(x) for x in call.operands], call.results,
                      call.aliases, call.options,
                      device=call.device if call.under_shard_map else None)
