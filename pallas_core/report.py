"""``pl.report``: what each kernel of a function moves, computes and holds on chip, and its
roofline on each chip asked for, without running anything.

For every ``pallas_call`` the function makes:

- **Operands.** Each operand's block (shape, dtype, memory space, bytes) and how many blocks
  the pipeline moves: an input block is fetched at the first grid step and whenever the block
  index differs from the previous step's (a step that keeps the same block skips the fetch, as
  every backend's pipeline does); an output block is written back each time the index moves
  on, and at the end. Index maps are evaluated ahead of time on every grid point
  (``grid_mapping.block_index_tables``); a block at the array's edge counts only the part
  inside the array. Operands the kernel copies itself (``pl.ANY``, HBM) are not counted, and
  the report says so; so are grids whose index maps read scalar-prefetch operands or whose
  sizes are dynamic, for which every step is counted as a fetch (an upper bound).
- **Work.** Flops and transcendentals of the kernel body times the number of grid steps:
  ``dot_general`` as matrix flops (two per multiply-add), elementwise arithmetic and
  reductions as vector flops (one per element), ``exp``/``log``/``tanh``/... as
  transcendentals, as XLA's cost analysis counts them; ``lax.fori_loop``/``scan`` with a
  static trip count multiplied out; of ``pl.when``/``lax.cond`` the costlier branch (an upper
  bound, said in ``notes``); a ``while`` loop of run-time trip count counted once (said too).
- **On chip.** The backend's own account (its ``pallas_footprint`` hook: buffers per operand,
  scratch, internal buffers) against the target chip's limit, and whether it fits.
- **Roofline** for each chip (:mod:`pallas_core.roofline`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from pallas_core import _jax
from pallas_core import grid_mapping as gmap
from pallas_core.call import resolve_backend, unvalidated, validate
from pallas_core.chips import backend_of_target, target_chip
from pallas_core.cost import dot_general_flops, element_count, integer_pow_flops
from pallas_core.errors import ArgumentError, PallasError
from pallas_core.plugins import manager
from pallas_core.request import KernelCall
from pallas_core.roofline import Chip, Roofline, roofline
from pallas_core.spec import BoundedSlice, CostEstimate, Element, Squeezed, block_dim_size


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
    hbm_bytes: int
    onchip_bytes: int | None
    """On-chip memory the backend allocates for the kernel (``None``: the backend does not
    say)."""
    onchip_limit: int | None
    onchip_parts: tuple[tuple[str, int], ...]
    fits: bool | None
    roofline: Mapping[str, Roofline]
    notes: tuple[str, ...] = ()
    """Where a figure is a bound rather than exact, and why."""

    @property
    def steps(self) -> int:
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


# --- the chips -------------------------------------------------------------------------------


def chips() -> dict[str, tuple[str, Chip]]:
    """Every chip the loaded backends list, by target name: ``(backend, chip)``."""
    found: dict[str, tuple[str, Chip]] = {}
    for name, b in sorted(manager.backends().items()):
        for target, chip in getattr(b.info, "chips", {}).items():
            found.setdefault(target, (name, chip))
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


# --- counting ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Work:
    matmul: int = 0
    vector: int = 0
    transcendentals: int = 0
    notes: frozenset[str] = frozenset()
    matmul_dtype: str | None = None

    def __add__(self, o: _Work) -> _Work:
        return _Work(self.matmul + o.matmul, self.vector + o.vector,
                     self.transcendentals + o.transcendentals, self.notes | o.notes,
                     self.matmul_dtype or o.matmul_dtype)

    def times(self, n: int) -> _Work:
        return _Work(self.matmul * n, self.vector * n, self.transcendentals * n, self.notes,
                     self.matmul_dtype)

    @property
    def total(self) -> int:
        return self.matmul + self.vector


_VECTOR_OUT = (lax.add_p, lax.sub_p, lax.mul_p, lax.div_p, lax.rem_p, lax.max_p, lax.min_p,
               lax.and_p, lax.or_p, lax.xor_p, lax.select_n_p, lax.pow_p)
_VECTOR_IN = (lax.neg_p, lax.abs_p, lax.sign_p, lax.floor_p, lax.ceil_p, lax.round_p,
              lax.not_p, lax.square_p, lax.reduce_sum_p, lax.reduce_max_p, lax.reduce_min_p,
              lax.argmax_p, lax.argmin_p)
_TRANSCENDENTAL = (lax.exp_p, lax.exp2_p, lax.log_p, lax.log1p_p, lax.expm1_p, lax.tanh_p,
                   lax.logistic_p, lax.sqrt_p, lax.rsqrt_p, lax.cbrt_p, lax.sin_p, lax.cos_p,
                   lax.tan_p, lax.atan2_p, lax.erf_p, lax.erf_inv_p, lax.sinh_p, lax.cosh_p,
                   lax.asin_p, lax.acos_p, lax.atan_p)


def _dot(eqn: Any) -> _Work:
    return _Work(matmul=dot_general_flops(eqn),
                 matmul_dtype=np.dtype(eqn.invars[0].aval.dtype).name)


def _count(jaxpr: Any) -> _Work:
    total = _Work()
    for eqn in jaxpr.eqns:
        total = total + _count_eqn(eqn)
    return total


def _count_eqn(eqn: Any) -> _Work:
    p = eqn.primitive
    if p is lax.dot_general_p:
        return _dot(eqn)
    if p in _VECTOR_OUT:
        return _Work(vector=element_count(eqn.outvars[0].aval))
    if p in _VECTOR_IN:
        return _Work(vector=element_count(eqn.invars[0].aval))
    if p is lax.integer_pow_p:
        return _Work(vector=integer_pow_flops(eqn))
    if p in _TRANSCENDENTAL:
        return _Work(transcendentals=element_count(eqn.invars[0].aval))
    if p is _jax.scan_p:
        return _count(eqn.params["jaxpr"].jaxpr).times(int(eqn.params["length"]))
    if p is _jax.while_p:
        body = _count(eqn.params["body_jaxpr"].jaxpr)
        if not body.total and not body.transcendentals:
            return body
        return dataclasses.replace(body, notes=body.notes | {
            "a while loop whose trip count is known only at run time is counted once"})
    if p is _jax.cond_p:
        branches = [_count(b.jaxpr) for b in eqn.params["branches"]]
        worst = max(branches, key=lambda w: (w.total, w.transcendentals))
        if any(b != worst for b in branches):
            worst = dataclasses.replace(worst, notes=worst.notes | {
                "pl.when/lax.cond: the costlier branch is counted at every step (an upper "
                "bound)"})
        return worst
    total = _Work()
    for sub in _jax.sub_jaxprs(eqn.params):
        total = total + _count(sub)
    return total


def _operands(call: KernelCall, onchip: str) -> tuple[list[OperandReport], list[str]]:
    """Each operand's traffic; ``onchip`` names where blocks of the default space live."""
    gm = call.grid_mapping
    notes: list[str] = []
    tables = gmap.block_index_tables(gm)
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
            notes.append(f"{bm.origin} is in {space}: the kernel copies it itself, so its "
                         "traffic is not counted")
            out.append(OperandReport(bm.origin, "whole", tuple(bm.array_shape), str(bm.dtype),
                                     space, 0, 0, 0, 0))
            continue
        if tables is not None:
            table = tables[1][k][:, :len(bm.array_shape)]
            moved = np.ones(len(table), bool)
            moved[1:] = np.any(table[1:] != table[:-1], axis=1)
            if role == "output":  # written back when the next step moves on, and at the end
                moved = np.append(moved[1:], True)
            extents = _extents(bm, tables[1][k][moved])
            blocks = int(moved.sum())
            out.append(OperandReport(bm.origin, role, block, str(bm.dtype), space, block_bytes,
                                     blocks, len(table) - blocks, int(extents) * itemsize))
        else:
            n = steps if steps is not None else 1
            why = ("its grid has dynamic sizes" if steps is None
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


def _kernel_report(call: KernelCall, backend: str, targets: list[str]) -> KernelReport:
    gm = call.grid_mapping
    known = chips()
    own = [t for t in targets if known[t][0] == backend]
    chip = known[own[0]][1] if own else None
    operands, notes = _operands(call, chip.onchip_name if chip is not None else "blocks")
    steps = 1 if gm.dynamic_axes else gm.num_steps
    if gm.dynamic_axes:
        notes.append("the grid has dynamic sizes: the work of one step is reported")
    work = _count(call.jaxpr.jaxpr).times(steps)
    notes.extend(sorted(work.notes))
    hbm = sum(o.hbm_bytes for o in operands)
    parts, limit = _footprint(call, backend, chip)
    onchip = sum(b for _, b in parts) if limit is not None else None
    dtype = work.matmul_dtype or (str(gm.block_mappings[0].dtype) if gm.block_mappings
                                  else "float32")
    lines = {t: roofline(known[t][1], matmul_flops=work.matmul, vector_flops=work.vector,
                         hbm_bytes=hbm, dtype=dtype) for t in targets}
    return KernelReport(
        name=call.name, backend=backend, grid=tuple(gm.grid), operands=tuple(operands),
        flops=work.total, matmul_flops=work.matmul, vector_flops=work.vector,
        transcendentals=work.transcendentals, hbm_bytes=hbm, onchip_bytes=onchip,
        onchip_limit=limit, onchip_parts=parts,
        fits=None if onchip is None or limit is None else onchip <= limit,
        roofline=lines, notes=tuple(notes))


def kernel_cost(call: KernelCall) -> CostEstimate:
    """The cost of ``call`` as ``pl.report`` counts it (flops of the body times the grid,
    transcendentals, HBM bytes the pipeline moves), for a backend that passes an estimate to
    its compiler when the user gave none."""
    gm = call.grid_mapping
    work = _count(call.jaxpr.jaxpr).times(1 if gm.dynamic_axes else gm.num_steps)
    operands, _ = _operands(call, "blocks")
    return CostEstimate(flops=work.total, transcendentals=work.transcendentals,
                        bytes_accessed=sum(o.hbm_bytes for o in operands))


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
    with ctx, unvalidated():
        closed = jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args)
    from pallas_core.stages import kernel_calls

    kernels = []
    for call in kernel_calls(closed.jaxpr):
        name = chosen or call.backend or manager.default_for_platform(jax.default_backend())
        kernel = _kernel_report(call, name, _targets(target, name))
        try:
            validate(call, name)
        except PallasError as e:  # reported, not raised: the report says why
            kernel = dataclasses.replace(kernel, notes=(
                *kernel.notes, f"the {name} backend refuses this kernel: {e}"))
        kernels.append(kernel)
    return Report(tuple(kernels))


def _own(backend: str) -> Mapping[str, Any]:
    return manager.get(backend).info.device_kinds


# --- the table ---------------------------------------------------------------------------


def _si(x: float, unit: str) -> str:
    for div, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _bytes(n: float) -> str:
    for div, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= div:
            return f"{n / div:.3g} {name}"
    return f"{int(n)} B"


def _seconds(s: float) -> str:
    for div, name in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if s >= div:
            return f"{s / div:.3g} {name}"
    return f"{s / 1e-9:.3g} ns"


def _describe(k: KernelReport) -> str:
    lines = [f"kernel {k.name!r} on {k.backend}: grid {k.grid} ({k.steps} steps)"]
    rows: list[tuple[str, ...]] = [("operand", "role", "block", "dtype", "space", "block bytes",
                                    "blocks", "skipped", "HBM bytes")]
    for o in k.operands:
        rows.append((o.name, o.role, str(o.block_shape), o.dtype, o.memory_space,
                     _bytes(o.block_bytes), str(o.blocks), str(o.skipped), _bytes(o.hbm_bytes)))
    lines += _table(rows)
    lines.append(f"work: {_si(k.flops, 'FLOP')} ({_si(k.matmul_flops, 'FLOP')} matmul, "
                 f"{_si(k.vector_flops, 'FLOP')} vector), {k.transcendentals:,} transcendentals; "
                 f"HBM traffic {_bytes(k.hbm_bytes)}")
    if k.onchip_bytes is not None:
        verdict = "fits" if k.fits else "does NOT fit"
        lines.append(f"on chip: {_bytes(k.onchip_bytes)} of {_bytes(k.onchip_limit or 0)} "
                     f"({verdict}): " + ", ".join(f"{n} {_bytes(b)}" for n, b in k.onchip_parts))
    lines_ = [("chip", "ridge FLOP/B", "intensity", "compute", "memory", "bound", "time >=")]
    for chip, r in k.roofline.items():
        lines_.append((chip, f"{r.ridge:.1f}", f"{r.intensity:.1f}", _seconds(r.compute_seconds),
                     _seconds(r.memory_seconds), r.bound, _seconds(r.seconds)))
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
