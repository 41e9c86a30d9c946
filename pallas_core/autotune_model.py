"""The cost model ``pl.autotune`` ranks configurations by, without the hardware.

A configuration's predicted time is the sum over its kernels of

- the **roofline** (``pl.report``'s ``roofline[target]``): the larger of compute time and HBM
  time, the pipeline overlapping the two; compute time is first raised by
- **matrix-unit tile waste**: a ``dot_general`` whose block dimensions are not multiples of the
  chip's matrix tile is padded to them by the hardware, and the padded fraction of the
  matrix work is wasted (the matmul part of the compute time is divided by the utilisation);
- **per-step overhead**: on a TPU the grid runs as a sequential loop, and each step costs a
  fixed time beyond its work (:attr:`Overheads.step_seconds` times the steps). On a GPU
  programs run in waves, as many per SM at once as its occupancy allows (:func:`resident`:
  the SM's warp slots over the program's ``num_warps``, its shared memory over the program's
  footprint, its registers over the program's estimate (:func:`thread_registers`), its
  thread-block slots), and no wave takes less than its program's sequential HBM round trips
  (:func:`memory_rounds`) at :attr:`Overheads.wave_seconds` each: the term is what the waves'
  round trips exceed the kernel's other time by (zero for a kernel with enough work to
  hide them);
- **idle cores** (GPU): programs are spread over the SMs, and the busiest SM runs
  ``ceil(programs / SMs)`` of them where the roofline assumes ``programs / SMs``: the compute
  time is stretched by that ratio (a grid of 8 programs has 8 of an H100's 132 SMs compute).
  The memory time is not: a few SMs draw more than their share of the bandwidth (how much
  more is not modelled: the wave floor bounds such a kernel);
- **register spills** (GPU): registers a thread needs beyond 255 are stored to and reloaded
  from local memory, once each, counted as HBM traffic;
- **pipeline fill and drain**: the first step's input blocks arrive before any compute can
  start, and the last step's output blocks leave after it ends (each at the chip's HBM
  bandwidth), not overlapped with anything.

The constants live in :data:`OVERHEADS`, one row per chip with its source or rationale.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from pallas_core import _jax
from pallas_core.reference import sub_jaxprs
from pallas_core.report_work import operand_refs
from pallas_core.roofline import Chip

_MiB = 2**20

VERSION = 3
"""Raised when the model's terms change: a cached prediction of another version is made again
(what was measured is kept)."""


@dataclasses.dataclass(frozen=True)
class Overheads:
    """What a chip costs beyond its roofline, for ranking (and how to flush its cache)."""

    matrix_tile: tuple[int, int, int]
    """``(m, n, k)``: the matrix unit's tile; a block's matmul dimensions are padded up to
    multiples of it."""
    step_seconds: float = 0.0
    """Fixed cost of each grid step (a TPU's sequential grid loop)."""
    wave_seconds: float = 0.0
    """A GPU's HBM round trip: a wave of programs takes at least this times its programs'
    sequential round trips."""
    llc_bytes: int = 64 * _MiB
    """A buffer at least the size of the last-level cache: writing it between timed runs
    evicts the kernel's operands (a generous figure for the chip family)."""
    warps_per_core: int = 0
    """GPU occupancy: the warps (wavefronts on AMD) one SM (CU) holds at once (0: no GPU)."""
    programs_per_core: int = 0
    """GPU occupancy: the thread blocks one SM holds at once."""
    onchip_per_core: int = 0
    """GPU occupancy: the shared memory (LDS) of one SM, which its resident blocks share."""
    registers_per_core: int = 0
    """GPU occupancy: the 32-bit registers of one SM, which its resident threads share (0:
    not modelled); a thread holds at most 255."""
    source: str = ""


_TPU_STEP = 0.35e-6
"""Per grid step on a TPU: the ~0.35 us that public Pallas TPU guidance quotes for the
pipeline's per-iteration bookkeeping (semaphore waits, DMA issue, scalar work). Not found
in a source searched while writing this; an assumption, to be replaced by a measurement."""

_GPU_WAVE = 1.0e-6
"""One HBM round trip under load on a GPU (~0.5-1 us, the launch of a wave included): what
each of a program's sequential loads waits, so that a wave takes at least its programs'
round trips. An assumption."""

_SM90: dict[str, Any] = {"warps_per_core": 64, "programs_per_core": 32,
                         "onchip_per_core": 228 * 1024, "registers_per_core": 65536}

OVERHEADS: Mapping[str, Overheads] = {
    # TPU MXU: 128 x 128 systolic arrays on v4/v5e/v5p, 256 x 256 on v6e/v7x (Cloud TPU system
    # architecture pages); rows stream through 8 sublanes at a time. VMEM is no cache and v5e
    # has no CMEM, so the flush buffer (128 MiB, v4's CMEM) is generous.
    "v4": Overheads((8, 128, 128), step_seconds=_TPU_STEP, llc_bytes=128 * _MiB,
                    source="MXU 128x128 (Cloud TPU docs, v4); 128 MiB CMEM"),
    "v5e": Overheads((8, 128, 128), step_seconds=_TPU_STEP, llc_bytes=128 * _MiB,
                     source="MXU 128x128 (Cloud TPU docs, v5e)"),
    "v5p": Overheads((8, 128, 128), step_seconds=_TPU_STEP, llc_bytes=128 * _MiB,
                     source="MXU 128x128 (Cloud TPU docs, v5p)"),
    "v6e": Overheads((8, 256, 256), step_seconds=_TPU_STEP, llc_bytes=128 * _MiB,
                     source="MXU 256x256 (Cloud TPU docs, v6e)"),
    "v7x": Overheads((8, 256, 256), step_seconds=_TPU_STEP, llc_bytes=128 * _MiB,
                     source="MXU 256x256 (Cloud TPU docs, TPU7x)"),
    # GPUs: the smallest tensor-core instruction that keeps the units full; occupancy limits
    # per SM from the CUDA C++ Programming Guide's table of compute capabilities (8.0: 64
    # warps, 32 blocks, 164 KiB of shared memory, 64K registers; 9.0 and 10.0: 64, 32,
    # 228 KiB, 64K) and AMD's CDNA3 guide (4 SIMDs of 8 wavefronts, 64 KiB of LDS per CU;
    # its registers are not modelled).
    "h100": Overheads((64, 8, 16), wave_seconds=_GPU_WAVE, llc_bytes=64 * _MiB,
                      **_SM90, source="wgmma m64nNk16 (PTX ISA); 50 MiB L2 (H100 datasheet)"),
    "h200": Overheads((64, 8, 16), wave_seconds=_GPU_WAVE, llc_bytes=64 * _MiB,
                      **_SM90, source="wgmma m64nNk16 (PTX ISA); 50 MiB L2"),
    "a100": Overheads((16, 8, 16), wave_seconds=_GPU_WAVE, llc_bytes=64 * _MiB,
                      warps_per_core=64, programs_per_core=32, onchip_per_core=164 * 1024,
                      registers_per_core=65536,
                      source="mma.sync m16n8k16 (PTX ISA); 40 MiB L2 (A100 datasheet)"),
    "b200": Overheads((128, 16, 16), wave_seconds=_GPU_WAVE, llc_bytes=256 * _MiB,
                      **_SM90, source="tcgen05.mma M=128 (PTX ISA); ~126 MiB L2"),
    "mi300x": Overheads((16, 16, 16), wave_seconds=_GPU_WAVE, llc_bytes=512 * _MiB,
                        warps_per_core=32, programs_per_core=32, onchip_per_core=64 * 1024,
                        source="v_mfma_f32_16x16x16 (CDNA3 ISA); 256 MiB Infinity Cache"),
}
"""Per chip (``target=`` name): the efficiency terms of the model and the cache to flush."""

CPU_FLUSH_BYTES = 64 * _MiB
"""The flush buffer when measuring on the host CPU (``measure=True`` without a device)."""

DEFAULT = Overheads((1, 1, 1), source="no figures for this chip: the roofline alone")


def overheads(target: str | None) -> Overheads:
    """The row of :data:`OVERHEADS` for ``target`` (:data:`DEFAULT` for another chip)."""
    return OVERHEADS.get(target or "", DEFAULT)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One configuration's predicted time and its terms (seconds), summed over kernels."""

    seconds: float | None
    """``None`` where no kernel has a roofline on the target (a chip no backend lists)."""
    terms: Mapping[str, float]
    hbm_bytes: int
    onchip_bytes: int
    bound: str
    """``"compute"``, ``"memory"`` or ``"mixed"`` (kernels on both sides), ``""`` without a
    roofline."""


def dot_shapes(calls: Sequence[Any]) -> list[tuple[int, int, int, int, Any]]:
    """``(batch, m, n, k, dtype)`` of every ``dot_general`` in the kernels' bodies."""
    found = []
    for call in calls:
        for eqn in _eqns(call.jaxpr.jaxpr):
            if eqn.primitive.name != "dot_general":
                continue
            lhs, rhs = (v.aval for v in eqn.invars[:2])
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            ls, rs = tuple(lhs.shape), tuple(rhs.shape)
            if not all(isinstance(d, (int, np.integer)) for d in ls + rs):
                continue
            free_l = [d for d in range(len(ls)) if d not in (*lc, *lb)]
            free_r = [d for d in range(len(rs)) if d not in (*rc, *rb)]
            found.append((_size(ls, lb), _size(ls, free_l), _size(rs, free_r),
                          _size(ls, lc), lhs.dtype))
    return found


def _size(shape: tuple[int, ...], dims: Sequence[int]) -> int:
    return int(np.prod([shape[d] for d in dims], dtype=np.int64))


def _eqns(jaxpr: Any) -> Iterator[Any]:
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn.params):
            yield from _eqns(sub)


def tile_utilisation(shapes: Sequence[tuple[int, int, int, int, Any]],
                     tile: tuple[int, int, int]) -> float:
    """The fraction of matrix-unit work that is useful, the dimensions of each dot padded to
    multiples of ``tile``, weighted by each dot's flops (1.0 without dots)."""
    useful = padded = 0.0
    for batch, *dims, _ in shapes:
        useful += batch * math.prod(dims)
        padded += batch * math.prod(-(-d // t) * t for d, t in zip(dims, tile, strict=True))
    return useful / padded if padded else 1.0


DEFAULT_WARPS = 4
"""Warps per program where a kernel's compiler params name none (Triton's default; one
warpgroup of a Mosaic GPU kernel)."""


def warps_of(params: Any) -> int | None:
    """The ``num_warps`` a kernel's compiler params ask for (an object with the attribute, or
    a mapping, possibly by backend name), ``None`` if they name none."""
    if isinstance(params, Mapping):
        found = params.get("num_warps")
        if isinstance(found, int):
            return found
        for value in params.values():
            if (inner := warps_of(value)) is not None:
                return inner
        return None
    found = getattr(params, "num_warps", None)
    return found if isinstance(found, int) else None


MAX_THREAD_REGISTERS = 255
"""The most 32-bit registers one GPU thread holds (PTX's limit); what a kernel needs beyond it
spills to local memory."""


@dataclasses.dataclass(frozen=True)
class GpuProgram:
    """What the GPU terms need of one kernel's program, read from its traced body."""

    warps: int
    """``num_warps`` (:data:`DEFAULT_WARPS` where the compiler params name none)."""
    rounds: float
    """Sequential HBM round trips one program makes (:func:`memory_rounds`)."""
    registers: int
    """Estimated 32-bit registers per thread (:func:`thread_registers`), uncapped."""


def gpu_program(call: Any, row: Overheads) -> GpuProgram:
    """:class:`GpuProgram` of the kernel call ``call`` (a ``KernelCall``)."""
    warps = warps_of(call.compiler_params) or DEFAULT_WARPS
    stages = getattr(call.compiler_params, "num_stages", None)
    return GpuProgram(warps, memory_rounds(call, stages if isinstance(stages, int) else 1),
                      thread_registers(call.jaxpr.jaxpr, warps))


_LOADS = ("get", "masked_load")


def memory_rounds(call: Any, num_stages: int) -> float:
    """How many HBM round trips one program waits for in sequence: its loads of operands
    outside loops count one (they are issued together), a loop counts its trips times its
    body's rounds, a branch its costlier side. A loop whose body holds a ``dot_general`` is
    software-pipelined ``num_stages`` deep (Triton's pipeliner), overlapping ``num_stages -
    1`` trips. A ``while`` loop's trips are not known here: it counts once."""
    refs = operand_refs(call)

    def rounds(jaxpr: Any) -> float:
        direct, nested = 0.0, 0.0
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in _LOADS and eqn.invars and eqn.invars[0] in refs:
                direct = 1.0
            elif eqn.primitive is _jax.scan_p:
                body = eqn.params["jaxpr"].jaxpr
                overlap = max(num_stages - 1, 1) if _has_dot(body) else 1
                nested += rounds(body) * int(eqn.params["length"]) / overlap
            elif eqn.primitive is _jax.cond_p:
                nested += max(rounds(b.jaxpr) for b in eqn.params["branches"])
            else:
                nested += sum(rounds(sub) for sub in sub_jaxprs(eqn.params))
        return direct + nested

    return max(rounds(call.jaxpr.jaxpr), 1.0)


def _has_dot(jaxpr: Any) -> bool:
    return any(e.primitive.name == "dot_general" for e in _eqns(jaxpr))


def thread_registers(jaxpr: Any, warps: int) -> int:
    """An estimate of the 32-bit registers a thread needs: 32 for addresses, indices and loop
    state, plus two values the size of the body's largest array value (one being computed
    from the other) spread over the program's ``32 x warps`` threads."""
    largest = 0
    for eqn in _eqns(jaxpr):
        for v in eqn.outvars:
            shape, dtype = getattr(v.aval, "shape", None), getattr(v.aval, "dtype", None)
            if shape is None or dtype is None:
                continue
            words = -(-math.prod(shape) * np.dtype(dtype).itemsize // 4)
            largest = max(largest, words)
    return 32 + 2 * -(-largest // (32 * max(warps, 1)))


def resident(row: Overheads, warps: int, onchip: int | None, registers: int = 0) -> int:
    """Programs one SM (CU) runs at once: the least of its warp slots over ``warps``, its
    shared memory over the program's footprint ``onchip``, its registers over the program's
    (``registers`` per thread, at most :data:`MAX_THREAD_REGISTERS`) and its thread-block
    slots (at least one)."""
    limits = [row.warps_per_core // max(warps, 1), row.programs_per_core]
    if onchip:
        limits.append(row.onchip_per_core // onchip)
    if registers and row.registers_per_core:
        per_program = min(registers, MAX_THREAD_REGISTERS) * 32 * max(warps, 1)
        limits.append(row.registers_per_core // per_program)
    return max(1, min(limits))


def predict(kernels: Sequence[Any], calls: Sequence[Any], target: str | None,
            chip: Chip | None) -> Prediction:
    """The model's time for a configuration whose ``pl.report`` gave ``kernels``, for the
    kernel calls ``calls`` (``KernelCall``s, in the same order: their bodies give the dots,
    and on a GPU each program's warps, round trips and registers), on ``target``."""
    row = overheads(target)
    shapes = dot_shapes(calls)
    util = tile_utilisation(shapes, row.matrix_tile)
    terms = dict.fromkeys(("roofline", "tile waste", "idle cores", "register spills",
                           "step overhead", "fill and drain"), 0.0)
    hbm = onchip = 0
    bounds = set()
    timed = False
    for i, k in enumerate(kernels):
        hbm += k.hbm_bytes
        onchip += k.onchip_bytes or 0
        line = k.roofline.get(target) if target is not None else None
        if line is None or chip is None:
            continue
        timed = True
        dtype = shapes[0][4] if shapes else "bfloat16"
        matmul = k.matmul_flops / chip.matmul_peak(dtype)
        waste = matmul * (1 / util - 1)
        total = max(line.compute_seconds + waste, line.memory_seconds)
        terms["roofline"] += line.seconds
        terms["tile waste"] += total - line.seconds
        bounds.add("compute" if line.compute_seconds + waste >= line.memory_seconds
                   else "memory")
        steps = k.steps if k.steps is not None else 1
        if row.wave_seconds:
            program = (gpu_program(calls[i], row) if i < len(calls)
                       else GpuProgram(DEFAULT_WARPS, 1.0, 0))
            terms.update(_gpu_terms(terms, row, chip, program, k.onchip_bytes, steps,
                                    line.compute_seconds + waste, line.memory_seconds, total))
        terms["step overhead"] += steps * row.step_seconds
        first = sum(o.block_bytes for o in k.operands if o.role == "input")
        last = sum(o.block_bytes for o in k.operands if o.role == "output")
        terms["fill and drain"] += (first + last) / chip.hbm_bandwidth
    bound = "" if not bounds else bounds.pop() if len(bounds) == 1 else "mixed"
    return Prediction(sum(terms.values()) if timed else None, terms, hbm, onchip, bound)


def _gpu_terms(terms: Mapping[str, float], row: Overheads, chip: Chip, program: GpuProgram,
               onchip: int | None, steps: int, compute: float, memory: float,
               total: float) -> dict[str, float]:
    """The GPU terms of one kernel added to ``terms``: idle SMs stretch the compute time,
    spilled registers add memory traffic, and each wave takes at least its round trips."""
    cores = max(chip.cores, 1)
    stretched = compute * -(-steps // cores) * cores / max(steps, 1)
    spilled = max(program.registers - MAX_THREAD_REGISTERS, 0)
    # Each spilled register is stored and loaded once per thread (4 bytes each way).
    spill = steps * 32 * program.warps * spilled * 8 / chip.hbm_bandwidth
    busiest = max(stretched, memory + spill)
    slots = cores * resident(row, program.warps, onchip, program.registers)
    floor = -(-steps // slots) * program.rounds * row.wave_seconds
    return {"idle cores": terms["idle cores"] + max(stretched, memory) - total,
            "register spills": terms["register spills"] + busiest - max(stretched, memory),
            "step overhead": terms["step overhead"] + max(0.0, floor - busiest)}
