"""``pl.report``: what each kernel of a function moves, computes and holds on chip, and its
roofline on each chip asked for, without running anything.

For every ``pallas_call`` the function makes:

- **Operands.** Each operand's block (shape, dtype, memory space, bytes) and how many blocks
  the pipeline moves: an input block is fetched at the first grid step and whenever the block
  index differs from the previous step's (a step that keeps the same block skips the fetch, as
  every backend's pipeline does); an output block is written back each time the index moves
  on, and at the end. A backend without a pipeline (``BackendInfo.block_traffic="loads"``,
  Triton) moves each distinct block once. Index maps are evaluated ahead of time on every
  grid point; a block at the array's edge counts only the part inside the array. Index maps
  that read scalar-prefetch operands are evaluated on the values that follow from ``fn``'s
  concrete arguments, else on values drawn at random (:mod:`pallas_core.report_prefetch`).
  Operands the kernel copies itself (``pl.ANY``) count the bytes of those copies.
- **Work** (:mod:`pallas_core.report_work`). Flops and transcendentals of the kernel body
  over the grid, branches and loop bounds that depend on the grid indices decided per step.
- **On chip.** The backend's own account (its ``pallas_footprint`` hook: buffers per operand,
  scratch, internal buffers) against the target chip's limit, and whether it fits.
- **Roofline** for each chip (:mod:`pallas_core.roofline`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from pallas_core import grid_mapping as gmap
from pallas_core.call import resolve_backend, unvalidated, validate
from pallas_core.chips import backend_of_target, target_chip
from pallas_core.datasheets import GPU_CHIPS
from pallas_core.errors import ArgumentError, PallasError
from pallas_core.plugins import manager
from pallas_core.report_prefetch import Prefetch, given_prefetch, reads_prefetch, sample_prefetch
from pallas_core.report_work import block_loads, count_work
from pallas_core.request import KernelCall
from pallas_core.roofline import Chip, Roofline, roofline
from pallas_core.spec import BoundedSlice, CostEstimate, Element, Squeezed, block_dim_size
from pallas_core.units import nbytes, seconds, si


@dataclasses.dataclass(frozen=True)
class OperandReport:
    """One operand of a kernel: its block and the traffic the pipeline makes for it."""

    name: str
    role: str
    """``"input"``, ``"output"``, ``"scalar prefetch"`` or ``"whole"`` (the kernel copies it
    itself: not counted)."""
    block_shape: tuple[int, ...]
    dtype: str
    memory_space: str
    block_bytes: int
    blocks: int
    """Blocks fetched (inputs) or written back (outputs)."""
    skipped: int
    """Grid steps that kept the previous step's block (no fetch or write-back)."""
    hbm_bytes: int
    """Bytes moved between HBM and the chip for this operand (edge blocks clipped)."""
    block_indices: np.ndarray | None = dataclasses.field(default=None, compare=False,
                                                         repr=False)
    """Per grid step (in the order the grid runs, the last axis fastest), the block index
    along each dimension of the array: an ``(steps, rank)`` int array; ``None`` where the
    steps are not known ahead of time (a dynamic grid)."""
    moved: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    """Per grid step, whether the pipeline moves this operand's block there (an input
    fetched before the step, an output written back after it)."""
    index_source: str = "grid"
    """Where the block indices come from: ``"grid"`` (the grid indices alone),
    ``"given"`` (scalar-prefetch values passed to ``pl.report``) or ``"sampled"``
    (scalar-prefetch values drawn at random: the counts are an estimate)."""


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """One kernel: see the module's documentation for how each figure is counted."""

    name: str
    backend: str
    grid: tuple[int, ...]
    operands: tuple[OperandReport, ...]
    flops: int
    matmul_flops: int
    vector_flops: int
    transcendentals: int
    integer_ops: int
    """Elementwise integer and boolean operations (index and mask arithmetic, a PRNG's
    rounds), which are not flops and do not enter the roofline."""
    skipped_flops: int
    """Flops the kernel skips against running its costlier branch at every step: branches of
    ``pl.when`` and ``fori_loop`` bounds decided per grid step from the grid indices (causal
    attention's masked-out blocks); ``skipped_fraction`` is its share."""
    hbm_bytes: int
    loaded_bytes: int | None
    """For a backend without a block pipeline (Triton): the bytes the body's loads and stores
    move, summed over the grid, as if no cache caught any (``hbm_bytes`` counts each distinct
    block once); ``None`` for pipelined backends, where the two are the same."""
    onchip_bytes: int | None
    """On-chip memory the backend allocates for the kernel (``None``: the backend does not
    say)."""
    onchip_limit: int | None
    onchip_parts: tuple[tuple[str, int], ...]
    fits: bool | None
    roofline: Mapping[str, Roofline]
    notes: tuple[str, ...] = ()
    """Where a figure is a bound rather than exact, and why."""
    limit_needed: int | None = None
    """When the kernel does not fit under its limit but does fit the chip's on-chip memory:
    the limit to ask for (whole MiB; for Mosaic TPU, ``vmem_limit_bytes``)."""
    smaller_blocks: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()
    """When the kernel does not fit: the fewest halvings of block dimensions that make it fit,
    as ``(operand, block shape, smaller block shape)``."""

    @property
    def skipped_fraction(self) -> float:
        dense = self.flops + self.skipped_flops
        return self.skipped_flops / dense if dense else 0.0

    @property
    def steps(self) -> int | None:
        """Grid steps (``None`` for a grid with sizes known only at run time)."""
        if not all(isinstance(g, (int, np.integer)) for g in self.grid):
            return None
        return int(np.prod(self.grid, dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class Report:
    """``pl.report``'s result: one :class:`KernelReport` per kernel, in program order."""

    kernels: tuple[KernelReport, ...]

    def __iter__(self) -> Any:
        return iter(self.kernels)

    def __len__(self) -> int:
        return len(self.kernels)

    def __getitem__(self, i: int) -> KernelReport:
        return self.kernels[i]

    def __str__(self) -> str:
        return "\n\n".join(_describe(k) for k in self.kernels) or "(no kernels)"

    def save(self, path: str | os.PathLike[str], *, title: str | None = None) -> pathlib.Path:
        """Writes the report as one self-contained HTML page (roofline chart, a block map
        per operand, the on-chip footprint, the table; inline SVG, nothing fetched) to
        ``path`` (a ``str`` or ``os.PathLike``) and returns it as a ``pathlib.Path``
        (:mod:`pallas_core.report_page`)."""
        from pallas_core import report_page

        return report_page.save(self, path, title=title)


# --- the chips -------------------------------------------------------------------------------


def chips() -> dict[str, tuple[str, Chip]]:
    """Every chip the loaded backends list, by target name: ``(backend, chip)``; then the
    GPUs of the core's datasheets that none lists (backend ``""``), so that a roofline can
    compare a kernel with a GPU where no GPU backend is installed."""
    found: dict[str, tuple[str, Chip]] = {}
    for name, b in sorted(manager.backends().items()):
        for target, chip in getattr(b.info, "chips", {}).items():
            found.setdefault(target, (name, chip))
    for target, chip in GPU_CHIPS.items():
        found.setdefault(target, ("", chip))
    return found


def _targets(target: str | Sequence[str] | None, backend: str) -> list[str]:
    known = chips()
    if target is None:
        own = list(getattr(manager.get(backend).info, "chips", {}))
        return own[:1]
    names = [target] if isinstance(target, str) else list(target)
    for t in names:
        if not isinstance(t, str) or t not in known:
            raise ArgumentError(
                f"pl.report(target={target!r}): {t!r} is not a chip any loaded backend lists. "
                f"Fix: use one of {sorted(known)}.")
    return names


def _operands(call: KernelCall, onchip: str, prefetch: Prefetch | None = None,
              distinct: bool = False) -> tuple[list[OperandReport], list[str]]:
    """Each operand's traffic; ``onchip`` names where blocks of the default space live;
    ``prefetch`` holds the scalar-prefetch values the index maps read, given or sampled;
    ``distinct``: each distinct block is moved once (a cache, not a pipeline)."""
    gm = call.grid_mapping
    notes: list[str] = []
    source = "grid"
    if not gm.num_scalar_prefetch:
        tables = gmap.block_index_tables(gm)
    elif prefetch is not None:
        tables = gmap.prefetch_index_tables(gm, prefetch.values)
        source = prefetch.source
        if tables is not None and source == "sampled":
            notes.append("the index maps read scalar-prefetch operands, which were not given: "
                         "they were evaluated on values drawn at random in "
                         f"[0, {prefetch.bound}) (an estimate). Fix: pass the scalar-prefetch "
                         "arrays themselves to pl.report to count exactly")
    else:
        tables = None
    steps = None if gm.dynamic_axes else gm.num_steps
    out = []
    for k, bm in enumerate(gm.block_mappings):
        itemsize = np.dtype(bm.dtype).itemsize
        space = (str(getattr(bm.memory_space, "name", bm.memory_space))
                 if bm.memory_space is not None else onchip)
        block = tuple(bm.ref_shape)
        block_bytes = int(np.prod(bm.full_block_shape, dtype=np.int64)) * itemsize
        if k < gm.num_scalar_prefetch:
            size = int(np.prod(bm.array_shape, dtype=np.int64)) * itemsize
            out.append(OperandReport(bm.origin, "scalar prefetch", tuple(bm.array_shape),
                                     str(bm.dtype), space, size, 1, 0, size))
            continue
        role = "input" if k < gm.num_inputs else "output"
        if bm.is_whole_array:
            notes.append(f"{bm.origin} is in {space}: the kernel copies it itself (its "
                         "traffic is what the backend counts of those copies)")
            out.append(OperandReport(bm.origin, "whole", tuple(bm.array_shape), str(bm.dtype),
                                     space, 0, 0, 0, 0))
            continue
        if tables is not None:
            full = tables[1][k]
            table = full[:, :len(bm.array_shape)]
            moved = np.ones(len(table), bool)
            if distinct:  # the first step to touch each block
                moved[:] = False
                moved[np.unique(full, axis=0, return_index=True)[1]] = True
            else:
                moved[1:] = np.any(table[1:] != table[:-1], axis=1)
                if role == "output":  # written back when the next step moves on, and at the end
                    moved = np.append(moved[1:], True)
            extents = _extents(bm, full[moved])
            blocks = int(moved.sum())
            out.append(OperandReport(
                bm.origin, role, block, str(bm.dtype), space, block_bytes, blocks,
                len(table) - blocks, int(extents) * itemsize, block_indices=table, moved=moved,
                index_source=source if reads_prefetch(bm, len(gm.grid)) else "grid"))
        else:
            n = steps if steps is not None else 1
            if steps == 0:
                out.append(OperandReport(bm.origin, role, block, str(bm.dtype), space,
                                         block_bytes, 0, 0, 0))
                continue
            why = ("its grid has dynamic sizes" if steps is None
                   else f"its grid has more than {gmap.MAX_STATIC_CHECK_POINTS} steps"
                   if steps > gmap.MAX_STATIC_CHECK_POINTS
                   else "its index map reads scalar-prefetch operands")
            notes.append(f"{bm.origin}: every step is counted as moving a block ({why}; an "
                         "upper bound)")
            out.append(OperandReport(bm.origin, role, block, str(bm.dtype), space, block_bytes,
                                     n, 0, n * block_bytes))
    return out, notes


def _extents(bm: Any, rows: np.ndarray) -> int:
    """Elements inside the array of the blocks at ``rows`` (index-map values)."""
    total = np.ones(len(rows), np.int64)
    sizes = iter(rows[:, len(bm.array_shape):].T)
    for d, (dim, n) in enumerate(zip(bm.dims, bm.array_shape, strict=True)):
        i = rows[:, d].astype(np.int64)
        if isinstance(dim, Squeezed):
            continue
        if isinstance(dim, BoundedSlice):
            total *= np.clip(next(sizes), 0, None)
            continue
        b = block_dim_size(dim)
        start = i if isinstance(dim, Element) else i * b
        if isinstance(dim, Element):
            start = start - dim.padding[0]
        lo, hi = np.clip(start, 0, n), np.clip(start + b, 0, n)
        total *= np.maximum(hi - lo, 0)
    return int(total.sum())


def _footprint(call: KernelCall, backend: str, chip: Chip | None
               ) -> tuple[tuple[tuple[str, int], ...], int | None]:
    found = manager.call_hook(backend, "pallas_footprint", call=call, chip=chip)
    if found is None:
        return (), None
    parts, limit = found
    return tuple((str(n), int(b)) for n, b in parts), limit


def _kernel_report(call: KernelCall, backend: str, targets: list[str],
                   prefetch: Prefetch | None) -> KernelReport:
    gm = call.grid_mapping
    known = chips()
    listed = getattr(manager.get(backend).info, "chips", {})
    own = [t for t in targets if t in listed]
    chip = listed[own[0]] if own else None
    operands, notes = _operands(call, chip.onchip_name if chip is not None else "blocks",
                                prefetch, distinct=block_loads(backend))
    work, skipped = count_work(call, backend)
    if gm.dynamic_axes:
        notes.append("the grid has dynamic sizes: the work of one step is reported")
    if skipped:
        notes.append(f"branches and loop bounds decided per grid step skip {skipped:,} FLOP "
                     f"({skipped / (work.total + skipped):.1%} of the work if every step ran "
                     "the costlier branch)")
    notes.extend(sorted(work.notes))
    hbm = sum(o.hbm_bytes for o in operands) + work.copy_bytes
    loaded = None
    if block_loads(backend):
        loaded = work.load_bytes + work.copy_bytes
        notes.append(f"the {backend} backend has no block pipeline: the body's loads and "
                     "stores go to HBM through the caches. hbm_bytes counts each distinct "
                     "block once (programs sharing a block hit the cache: the roofline's lower "
                     f"bound); the loads and stores themselves add up to {nbytes(loaded)} "
                     "(loaded_bytes, with no cache)")
    if work.copy_bytes:
        notes.append(f"the kernel's own copies (DMA, TMA) move {nbytes(work.copy_bytes)} "
                     "between HBM and the chip, counted in hbm_bytes as issued (on a GPU, "
                     "its L2 cache may serve re-reads of the same data: there, an upper "
                     "bound)")
    parts, limit = _footprint(call, backend, chip)
    onchip = sum(b for _, b in parts) if limit is not None else None
    dtype = work.matmul_dtype or (str(gm.block_mappings[0].dtype) if gm.block_mappings
                                  else "float32")
    lines = {t: roofline(known[t][1], matmul_flops=work.matmul, vector_flops=work.vector,
                         hbm_bytes=hbm, dtype=dtype) for t in targets}
    limit_needed: int | None = None
    smaller: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()
    if onchip is not None and limit is not None and onchip > limit:
        capacity = chip.onchip_bytes if chip is not None else None
        mib = -(-onchip // 2**20) * 2**20
        if capacity is not None and mib <= capacity:
            limit_needed = mib
        smaller = _smaller_blocks(operands, parts, limit)
        notes.extend(_fit_advice(backend, onchip, limit, limit_needed, smaller, chip))
    return KernelReport(
        limit_needed=limit_needed, smaller_blocks=smaller,
        name=call.name, backend=backend, grid=tuple(gm.grid), operands=tuple(operands),
        flops=work.total, matmul_flops=work.matmul, vector_flops=work.vector,
        transcendentals=work.transcendentals, integer_ops=work.integer,
        skipped_flops=skipped or 0, loaded_bytes=loaded,
        hbm_bytes=hbm, onchip_bytes=onchip,
        onchip_limit=limit, onchip_parts=parts,
        fits=None if onchip is None or limit is None else onchip <= limit,
        roofline=lines, notes=tuple(notes))


def _smaller_blocks(operands: Sequence[OperandReport], parts: Sequence[tuple[str, int]],
                    limit: int) -> tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]:
    """Halves, one at a time, the largest dimension of the block whose buffers take the most
    on-chip memory (the leading dimensions first, the last one last: the layout's tiles lie
    along the last two) until the parts fit under ``limit``; the blocks changed."""
    sizes: dict[str, int] = {}
    for name, size in parts:
        owner = next((o.name for o in operands if name.startswith(o.name)), None)
        if owner is not None:
            sizes[owner] = sizes.get(owner, 0) + size
    other = sum(size for _, size in parts) - sum(sizes.values())
    if other > limit or not sizes:
        return ()
    shapes = {o.name: list(o.block_shape) for o in operands if o.name in sizes}
    original = {n: tuple(v) for n, v in shapes.items()}
    for _ in range(64):
        if other + sum(sizes.values()) <= limit:
            return tuple((n, original[n], tuple(shapes[n])) for n in shapes
                         if tuple(shapes[n]) != original[n])
        name = max(sizes, key=lambda n: sizes[n])
        shape = shapes[name]
        order = sorted(range(len(shape)), key=lambda d: (d >= len(shape) - 2, -shape[d]))
        dim = next((d for d in order if shape[d] >= 2 * (128 if d == len(shape) - 1 else 8)),
                   None)
        if dim is None:
            return ()
        shape[dim] //= 2
        sizes[name] //= 2
    return ()


def _fit_advice(backend: str, needed: int, limit: int, limit_needed: int | None,
                smaller: Sequence[tuple[str, tuple[int, ...], tuple[int, ...]]],
                chip: Chip | None) -> list[str]:
    advice = []
    where = chip.onchip_name if chip is not None else "on-chip memory"
    if limit_needed is not None:
        params = manager.get(backend).info.compiler_params_type
        fields = [f.name for f in dataclasses.fields(params)] if params is not None and \
            dataclasses.is_dataclass(params) else []
        knob = next((f for f in fields if f.endswith("limit_bytes")), None)
        ask = (f"compiler params with {knob}={limit_needed}" if knob
               else f"a limit of {limit_needed} bytes")
        advice.append(f"to fit: the kernel needs {nbytes(needed)} of {where} against a limit of "
                      f"{nbytes(limit)}, and the chip has {nbytes(chip.onchip_bytes)}: ask for "
                      f"{ask}" if chip is not None else "")
    if smaller:
        changes = ", ".join(f"{n} {old} -> {new}" for n, old, new in smaller)
        advice.append(f"to fit under {nbytes(limit)} with the same limit, the fewest halvings "
                      f"of block dimensions: {changes}")
    return [a for a in advice if a]


def kernel_cost(call: KernelCall, backend: str | None = None) -> CostEstimate:
    """The cost of ``call`` as ``pl.report`` counts it (flops of the body times the grid,
    transcendentals, HBM bytes the pipeline and the kernel's own copies move), for a
    backend that passes an estimate to its compiler when the user gave none. ``backend``
    (default: the one the call names) counts its own primitives."""
    name = backend or call.backend
    work, _ = count_work(call, name)
    moved = sum(o.hbm_bytes for o in _operands(call, "blocks", distinct=block_loads(name))[0])
    return CostEstimate(flops=work.total, transcendentals=work.transcendentals,
                        bytes_accessed=moved + work.copy_bytes)


def report(fn: Callable[..., Any], *args: Any, backend: str | None = None,
           target: str | Sequence[str] | None = None, **kwargs: Any) -> Report:
    """A :class:`Report` of every ``pallas_call`` that ``fn(*args, **kwargs)`` makes, without
    running it (``args`` may be ``jax.ShapeDtypeStruct``s).

    :param backend: the backend that compiles the kernels (default: the one each kernel
        names, else this machine's default).
    :param target: a chip (``"v5e"``, ``"h100"``), or a list of chips to compare; the
        roofline is computed for each, the on-chip footprint for the first of the kernel's
        backend. Default: the backend's first chip.
    """
    chosen = resolve_backend(backend, None, False) if backend is not None else None
    first = target if isinstance(target, str) or target is None else (
        target[0] if target else None)
    owner = chosen or (backend_of_target(first) if first is not None else None)
    ctx = target_chip(owner, first if owner and first in _own(owner) else None) if owner \
        else contextlib.nullcontext()
    from pallas_core.stages import kernel_calls

    with ctx, unvalidated():
        closed = jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args)
        calls = list(kernel_calls(closed.jaxpr))
    given = given_prefetch(closed, args)
    kernels = []
    for n, call in enumerate(calls):
        name = chosen or call.backend or manager.default_for_platform(jax.default_backend())
        prefetch = given.get(id(call))
        if prefetch is not None and prefetch.grid is not None:
            # A dynamic grid whose sizes follow from the values given: reported at them.
            call = call.replace(grid_mapping=dataclasses.replace(
                call.grid_mapping, grid=prefetch.grid))
        if prefetch is None and call.grid_mapping.num_scalar_prefetch:
            prefetch = sample_prefetch(call, seed=n)
        kernel = _kernel_report(call, name, _targets(target, name), prefetch)
        try:
            validate(call, name)
        except PallasError as e:  # reported, not raised: the report says why
            kernel = dataclasses.replace(kernel, notes=(
                *kernel.notes, f"the {name} backend refuses this kernel: {e}"))
        else:
            if kernel.fits is False:  # refused later, when compiled (Triton)
                kernel = dataclasses.replace(kernel, notes=(
                    *kernel.notes, f"the {name} backend refuses this kernel when it compiles "
                    f"it (pl.stages, or on the device): it needs {kernel.onchip_bytes} bytes "
                    f"on chip, more than the {kernel.onchip_limit} it may use"))
        kernels.append(kernel)
    return Report(tuple(kernels))


def _own(backend: str) -> Mapping[str, Any]:
    return manager.get(backend).info.device_kinds


# --- the table ---------------------------------------------------------------------------


def _describe(k: KernelReport) -> str:
    steps = "steps known at run time" if k.steps is None else f"{k.steps} steps"
    lines = [f"kernel {k.name!r} on {k.backend}: grid {k.grid} ({steps})"]
    rows: list[tuple[str, ...]] = [("operand", "role", "block", "dtype", "space", "block bytes",
                                    "blocks", "skipped", "HBM bytes")]
    for o in k.operands:
        rows.append((o.name, o.role, str(o.block_shape), o.dtype, o.memory_space,
                     nbytes(o.block_bytes), str(o.blocks), str(o.skipped), nbytes(o.hbm_bytes)))
    lines += _table(rows)
    integer = f", {si(k.integer_ops, 'integer ops')}" if k.integer_ops else ""
    lines.append(f"work: {si(k.flops, 'FLOP')} ({si(k.matmul_flops, 'FLOP')} matmul, "
                 f"{si(k.vector_flops, 'FLOP')} vector), {k.transcendentals:,} transcendentals"
                 f"{integer}; HBM traffic {nbytes(k.hbm_bytes)}")
    if k.onchip_bytes is not None:
        verdict = "fits" if k.fits else "does NOT fit"
        lines.append(f"on chip: {nbytes(k.onchip_bytes)} of {nbytes(k.onchip_limit or 0)} "
                     f"({verdict}): " + ", ".join(f"{n} {nbytes(b)}" for n, b in k.onchip_parts))
    lines_ = [("chip", "ridge FLOP/B", "intensity", "compute", "memory", "bound", "time >=")]
    for chip, r in k.roofline.items():
        lines_.append((chip, f"{r.ridge:.1f}", f"{r.intensity:.1f}", seconds(r.compute_seconds),
                     seconds(r.memory_seconds), r.bound, seconds(r.seconds)))
    if k.roofline:
        lines += _table(lines_)
    notes = list(k.notes) + [a for r in k.roofline.values() for a in r.assumptions]
    lines += [f"note: {n}" for n in dict.fromkeys(notes)]
    return "\n".join(lines)


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    out = ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
           for r in rows]
    out.insert(1, "  " + "  ".join("-" * w for w in widths))
    return out
