"""The cost model ``pl.autotune`` ranks configurations by, without the hardware.

A configuration's predicted time is the sum over its kernels of

- the **roofline** (``pl.report``'s ``roofline[target]``): the larger of compute time and HBM
  time, the pipeline overlapping the two; compute time is first raised by
- **matrix-unit tile waste**: a ``dot_general`` whose block dimensions are not multiples of the
  chip's matrix tile is padded to them by the hardware, and the padded fraction of the
  matrix work is wasted (the matmul part of the compute time is divided by the utilisation);
- **per-step overhead**: on a TPU the grid runs as a sequential loop, and each step costs a
  fixed time beyond its work (:attr:`Overheads.step_seconds` times the steps); on a GPU
  programs run in waves, as many per SM at once as its occupancy allows (:func:`resident`:
  the SM's warp slots over the program's ``num_warps``, its shared memory over the program's
  footprint, its thread-block slots), and no wave takes less than a fixed latency
  (:attr:`Overheads.wave_seconds`: a program's first loads make one HBM round trip): the term
  is what ``ceil(programs / (SMs x resident))`` such latencies exceed the kernel's other time
  by (zero for a kernel with enough work per wave to hide them);
- **idle cores** (GPU): programs are spread over the SMs, and the busiest SM runs
  ``ceil(programs / SMs)`` of them where the roofline assumes ``programs / SMs``: the compute
  time is stretched by that ratio (a grid of 8 programs has 8 of an H100's 132 SMs compute).
  The memory time is not: a few SMs draw more than their share of the bandwidth (how much
  more is not modelled: the wave floor below bounds such a kernel);
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

from pallas_core.reference import sub_jaxprs
from pallas_core.roofline import Chip

_MiB = 2**20

VERSION = 2
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
    """Fixed cost of each wave of programs, one program per core (a GPU's SMs)."""
    llc_bytes: int = 64 * _MiB
    """A buffer at least the size of the last-level cache: writing it between timed runs
    evicts the kernel's operands (a generous figure for the chip family)."""
    warps_per_core: int = 0
    """GPU occupancy: the warps (wavefronts on AMD) one SM (CU) holds at once (0: no GPU)."""
    programs_per_core: int = 0
    """GPU occupancy: the thread blocks one SM holds at once."""
    onchip_per_core: int = 0
    """GPU occupancy: the shared memory (LDS) of one SM, which its resident blocks share."""
    source: str = ""


_TPU_STEP = 0.35e-6
"""Per grid step on a TPU: the ~0.35 us that public Pallas TPU guidance quotes for the
pipeline's per-iteration bookkeeping (semaphore waits, DMA issue, scalar work). Not found
in a source searched while writing this; an assumption, to be replaced by a measurement."""

_GPU_WAVE = 1.0e-6
"""The least time a wave of programs takes on a GPU: one HBM round trip under load (~0.5-1 us)
before a program's first blocks arrive, plus the launch of the wave's thread blocks. An
assumption."""

_SM90: dict[str, Any] = {"warps_per_core": 64, "programs_per_core": 32,
                         "onchip_per_core": 228 * 1024}

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
    # warps, 32 blocks, 164 KiB of shared memory; 9.0 and 10.0: 64, 32, 228 KiB) and AMD's
    # CDNA3 guide (4 SIMDs of 8 wavefronts, 64 KiB of LDS per CU).
    "h100": Overheads((64, 8, 16), wave_seconds=_GPU_WAVE, llc_bytes=64 * _MiB,
                      **_SM90, source="wgmma m64nNk16 (PTX ISA); 50 MiB L2 (H100 datasheet)"),
    "h200": Overheads((64, 8, 16), wave_seconds=_GPU_WAVE, llc_bytes=64 * _MiB,
                      **_SM90, source="wgmma m64nNk16 (PTX ISA); 50 MiB L2"),
    "a100": Overheads((16, 8, 16), wave_seconds=_GPU_WAVE, llc_bytes=64 * _MiB,
                      warps_per_core=64, programs_per_core=32, onchip_per_core=164 * 1024,
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


def resident(row: Overheads, warps: int, onchip: int | None) -> int:
    """Programs one SM (CU) runs at once: the least of its warp slots over ``warps``, its
    shared memory over the program's footprint ``onchip`` and its thread-block slots (at
    least one; registers are not counted: their use is known only after ``ptxas``)."""
    limits = [row.warps_per_core // max(warps, 1), row.programs_per_core]
    if onchip:
        limits.append(row.onchip_per_core // onchip)
    return max(1, min(limits))


def predict(kernels: Sequence[Any], shapes: Sequence[tuple[int, int, int, int, Any]],
            target: str | None, chip: Chip | None,
            warps: Sequence[int | None] = ()) -> Prediction:
    """The model's time for a configuration whose ``pl.report`` gave ``kernels`` and whose
    kernel bodies hold the dots ``shapes``, on ``target``; ``warps`` is each kernel's
    ``num_warps`` (GPU occupancy; :data:`DEFAULT_WARPS` where missing)."""
    row = overheads(target)
    util = tile_utilisation(shapes, row.matrix_tile)
    terms = dict.fromkeys(("roofline", "tile waste", "idle cores", "step overhead",
                           "fill and drain"), 0.0)
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
            cores = max(chip.cores, 1)
            stretch = -(-steps // cores) * cores / max(steps, 1)
            busiest = max((line.compute_seconds + waste) * stretch, line.memory_seconds)
            terms["idle cores"] += busiest - total
            w = (warps[i] if i < len(warps) else None) or DEFAULT_WARPS
            slots = cores * resident(row, w, k.onchip_bytes)
            floor = -(-steps // slots) * row.wave_seconds  # waves, each a round trip at least
            terms["step overhead"] += max(0.0, floor - busiest)
        terms["step overhead"] += steps * row.step_seconds
        first = sum(o.block_bytes for o in k.operands if o.role == "input")
        last = sum(o.block_bytes for o in k.operands if o.role == "output")
        terms["fill and drain"] += (first + last) / chip.hbm_bandwidth
    bound = "" if not bounds else bounds.pop() if len(bounds) == 1 else "mixed"
    return Prediction(sum(terms.values()) if timed else None, terms, hbm, onchip, bound)
