"""Software pipelines written inside a kernel: ``pltpu.emit_pipeline``.

A kernel that holds whole arrays in HBM (``memory_space=pl.ANY``, or any ``pl.kernel``) runs an
inner grid over blocks of them, as ``pallas_call`` would, with the copies made by the kernel:

* every input has two VMEM buffers: while the body works on step ``s``'s block in one, the DMA
  engine fetches step ``s + 1``'s block into the other;
* every output has two VMEM buffers: the body writes the current block, which stays in VMEM for
  as long as the output's block index does not change (so a body may accumulate over a
  reduction axis), and is written back to HBM when it changes or the grid ends, while the body
  goes on in the other buffer;
* inside the body, ``pl.program_id``/``pl.num_programs`` are the pipeline's step and grid.

Everything is built from the core's primitives (``run_scoped``, ``fori_loop``, ``when``, async
copies on DMA semaphores), so the interpreter runs pipelines with the DMA semantics the Mosaic
lowering gives them, and no rule of the lowering is specific to pipelines.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import pallas_core as pl
from pallas_core import BlockSpec, BlockSpecError, Indirect
from pallas_core import backend as plb
from pallas_core.backend import PallasError, UnsupportedError, make_async_copy, plain_block_dim
from pallas_mosaic_tpu.params import PARALLEL, VMEM, GridDimensionSemantics, SemaphoreType
from pallas_mosaic_tpu.validation import LANES, SUBLANES, tiled_block


class _Operand:
    """One HBM operand of the pipeline: its spec, array shape and block geometry."""

    def __init__(self, ref: Any, spec: Any, origin: str, output: bool = False) -> None:
        aval = plb.shape_after_transforms(*_ref_aval(ref))
        self.ref, self.origin = ref, origin
        self.shape, self.dtype = tuple(aval.shape), aval.dtype
        if spec is None or spec.block_shape is None:
            spec = BlockSpec(self.shape, lambda *_: (0,) * len(self.shape))
        if not isinstance(spec, BlockSpec):
            raise BlockSpecError(f"emit_pipeline {origin}: expected a pl.BlockSpec, found "
                                 f"{spec!r}.")
        block: tuple[Any, ...] = tuple(spec.block_shape or ())
        if len(block) != len(self.shape):
            raise BlockSpecError(
                f"emit_pipeline {origin}: block shape {block} has {len(block)} dimensions but "
                f"the Ref has shape {self.shape}. Fix: give one block size per dimension.")
        self.indirect = [isinstance(b, Indirect) for b in block]
        if any(self.indirect[1:]):
            raise UnsupportedError(
                f"emit_pipeline {origin}: pl.Indirect in block_shape {block} beyond the leading "
                "dimension; gathers and scatters go along the leading dimension only. Fix: "
                "move the indexed dimension first.")
        sizes = [b.block_size if isinstance(b, Indirect)
                 else plain_block_dim(b, f"emit_pipeline {origin}") for b in block]
        self.squeezed = [b is None for b in sizes]
        self.block = tuple(1 if b is None else b for b in sizes)
        tiles = _tiling(self.shape, self.dtype)
        self.partial = [False] * len(self.shape)
        """Dimensions whose last block runs past the array's end (an edge block)."""
        for d, (b, n, t) in enumerate(zip(self.block, self.shape, tiles)):
            if n % b == 0 or self.indirect[d]:
                continue
            # As in JAX: the edge block is copied cut to the array's end rounded up to the
            # dimension's tiling, so the block must be whole tiles; the rounded end must lie
            # in the array (where it does not, JAX's copy reads the tiled layout's padding).
            if b % t or n % t:
                raise UnsupportedError(
                    f"emit_pipeline {origin}: block {self.block} does not divide the Ref's shape "
                    f"{self.shape} (dimension {d}), and a partial edge block needs the block "
                    f"and the array to be whole tiles of {t} along it (the edge copy is whole "
                    "tiles; past the array's end it would read the tiled layout's padding, "
                    "which Refs here do not have). Fix: choose block sizes that divide the "
                    f"array, or pad it to a multiple of {t}.")
            self.partial[d] = True
        self.tiles = tiles
        kept = [b for b, sq in zip(self.block, self.squeezed) if not sq]
        if len(kept) >= 2:
            fixed = tiled_block(kept, [n for n, sq in zip(self.shape, self.squeezed) if not sq])
            if fixed is not None:
                raise BlockSpecError(
                    f"emit_pipeline {origin}: block {self.block} of a Ref of shape "
                    f"{self.shape}: on a TPU the last two block dimensions must be divisible "
                    f"by ({SUBLANES}, {LANES}) or equal the Ref's. Fix: use a block of "
                    f"{tuple(fixed)} in its unsqueezed dimensions.")
        self.buffer_shape = tuple(kept)
        mode = getattr(spec, "pipeline_mode", None)
        requested = 2 if mode is None else int(mode.buffer_count)
        self.count = min(requested, 2) if output else requested
        """VMEM buffers of the operand's blocks (``pl.Buffered(n)``, 2 by default): an input
        prefetches ``count - 1`` steps ahead; an output drains through at most two (a third
        would only start a write-back later); 1 is synchronous copies."""
        self.index_map: Callable[..., Any] = spec.index_map or (
            lambda *_: (0,) * len(self.shape))

    def block_indices(self, indices: Sequence[Any]) -> tuple[Any, ...]:
        out = self.index_map(*indices)
        out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if len(out) != len(self.shape):
            raise BlockSpecError(
                f"emit_pipeline {self.origin}: the index map returned {len(out)} indices for a "
                f"Ref of rank {len(self.shape)}. Fix: return one block index per dimension.")
        values = []
        for d, i in enumerate(out):
            if self.indirect[d]:
                i = i[...] if hasattr(i, "at") else i  # indices read from a Ref
                i = jnp.asarray(i)
                if i.shape != (self.block[d],) or not jnp.issubdtype(i.dtype, jnp.integer):
                    raise BlockSpecError(
                        f"emit_pipeline {self.origin}: dimension {d} is pl.Indirect("
                        f"{self.block[d]}), so its index map must return {self.block[d]} integer "
                        f"indices; found {i.dtype}{list(i.shape)}.")
            values.append(jnp.asarray(i, jnp.int32))
        return tuple(values)

    @property
    def index_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shape of each index the index map returns (an Indirect one is a vector)."""
        return tuple((b,) if ind else () for b, ind in zip(self.block, self.indirect))

    def _size(self, d: int, i: Any) -> Any:
        """The size of block ``i`` along dimension ``d``: the block's, or at an edge block the
        rest of the array, rounded up to the dimension's tiling (as JAX's pipeline cuts it)."""
        b, n, t = self.block[d], self.shape[d], self.tiles[d]
        if not self.partial[d]:
            return b
        last = jnp.int32(-(-n // b) - 1)
        rest = -(-(n % b) // t) * t
        return pl.multiple_of(jnp.where(i == last, jnp.int32(rest), jnp.int32(b)), t)

    def window(self, block_indices: Sequence[Any]) -> Any:
        """The HBM view of one block (rows gathered or scattered along an Indirect
        dimension; cut at the array's end for an edge block)."""
        idx = tuple(i if ind else i * b if sq else plb.ds(i * b, self._size(d, i))
                    for d, (i, b, sq, ind) in enumerate(
                        zip(block_indices, self.block, self.squeezed, self.indirect)))
        return self.ref.at[idx]

    def buffer(self, buf: Any, block_indices: Sequence[Any]) -> Any:
        """The part of a block buffer ``buf`` that block ``block_indices`` fills: all of it,
        or the front of it along the dimensions of an edge block."""
        if not any(self.partial):
            return buf
        idx = tuple(plb.ds(0, self._size(d, i)) if self.partial[d] else slice(None)
                    for d, i in enumerate(block_indices) if not self.squeezed[d])
        return buf.at[idx]


def _tiling(shape: tuple[int, ...], dtype: Any) -> tuple[int, ...]:
    """The tiling of each dimension of an HBM array, as JAX's pipeline infers it: lanes of
    128 and sublanes of up to 8 (counted in packed rows) on the two minor dimensions, 1 on the
    others; a 1-D array is tiled by whole 32-bit rows of 128 lanes."""
    packing = 8 if jnp.dtype(dtype) == jnp.int4 else max(1, 4 // jnp.dtype(dtype).itemsize)
    if len(shape) == 1:
        return (packing * LANES,)
    factor = packing
    while factor < min(shape[-2], SUBLANES):
        factor *= 2
    return (*(1,) * (len(shape) - 2), factor, LANES)


def _ref_aval(ref: Any) -> tuple[Any, Any]:
    base, transforms = plb.ref_and_transforms(ref, None, "emit_pipeline")
    return plb.ref_type_of(base), transforms


def _unravel(step: Any, grid: tuple[int, ...]) -> tuple[Any, ...]:
    out = []
    for d in range(len(grid)):
        minor = math.prod(grid[d + 1:])
        out.append(lax.rem(lax.div(step, jnp.int32(minor)), jnp.int32(grid[d])))
    return tuple(out)


def _changed(a: Sequence[Any], b: Sequence[Any]) -> Any:
    out = jnp.bool_(False)
    for x, y in zip(a, b):
        # Rows picked by indices (pl.Indirect) count as a new block at every step, as in JAX.
        out = out | (jnp.bool_(True) if jnp.ndim(x) else x != y)
    return out


def _partition(grid: tuple[int, ...], core_axis_name: Any,
               semantics: Sequence[Any] | None) -> tuple[tuple[int, ...], tuple[Any, ...]]:
    """The part of the grid this core runs, and its offsets, when split over cores."""
    zeros: tuple[Any, ...] = (0,) * len(grid)
    if core_axis_name is None:
        return grid, zeros
    names = core_axis_name if isinstance(core_axis_name, tuple) else (core_axis_name,)
    num_cores, core = 1, jnp.int32(0)
    for name in names:
        size = lax.axis_size(name)
        core = core * size + lax.axis_index(name)
        num_cores *= size
    if num_cores == 1:
        return grid, zeros
    sem = [GridDimensionSemantics(getattr(s, "value", s)) for s in (semantics or ())]
    if len(sem) != len(grid):
        raise PallasError(
            f"emit_pipeline over {num_cores} cores needs dimension_semantics, one per grid "
            f"axis of {grid}, to know which axis to split. Fix: e.g. "
            "dimension_semantics=(pltpu.PARALLEL, pltpu.ARBITRARY).")
    for d, (n, s) in enumerate(zip(grid, sem)):
        if s is PARALLEL and n % num_cores == 0:
            part = n // num_cores
            return (*grid[:d], part, *grid[d + 1:]), (*zeros[:d], core * part, *zeros[d + 1:])
    raise PallasError(
        f"emit_pipeline: no PARALLEL axis of the grid {grid} divides over {num_cores} cores. "
        "Fix: mark an axis whose size is a multiple of the core count PARALLEL.")


def emit_pipeline(
    body: Callable[..., None],
    *,
    grid: Sequence[int],
    in_specs: Any = (),
    out_specs: Any = (),
    core_axis_name: str | tuple[str, ...] | None = None,
    dimension_semantics: Sequence[Any] | None = None,
    tiling: Any = None,
    core_axis: Any = None,
    trace_scopes: bool = True,
    no_pipelining: bool = False,
    output_wait_read_only: bool = False,
    _explicit_indices: bool = False,
) -> Callable[..., None]:
    """A function of HBM Refs that runs ``body`` over ``grid`` on VMEM blocks of them.

    ``body(*in_block_refs, *out_block_refs)`` (then ``scratches``) is called once per step
    with the blocks the specs select, as a ``pallas_call`` kernel would be. With
    ``core_axis_name`` the grid is split between the cores of a ``pl.kernel`` mesh along the
    first ``PARALLEL`` axis that divides evenly. ``no_pipelining=True`` makes every copy
    synchronous (for debugging). With ``_explicit_indices`` (JAX's flag) the body gets a
    :class:`PipelineStep` first. ``output_wait_read_only`` (JAX 0.12: a write-back's wait
    only waits for its VMEM source to be read) is accepted; here every write-back is waited
    for whole, which gives the same results.

    The returned ``pipeline(*refs, allocations=None)`` allocates its buffers for each run,
    or uses ``allocations``: the :class:`BufferedRef`s that ``emit_pipeline_with_allocations``'s
    ``make_allocations`` describes, allocated once (``pl.run_scoped``) and shared by runs.
    """
    if tiling is not None or core_axis is not None:
        raise UnsupportedError("emit_pipeline(tiling=..., core_axis=...) is not supported. Fix: "
                               "leave them unset (use core_axis_name to split over cores).")
    del trace_scopes, output_wait_read_only
    full_grid = tuple(int(g) for g in grid)
    if any(g <= 0 for g in full_grid):
        raise PallasError(f"emit_pipeline(grid={full_grid}): every grid size must be positive.")

    def pipeline(*refs: Any, scratches: Sequence[Any] = (), allocations: Any = None,
                 body_prologue: Any = None) -> None:
        flat_in, in_tree = jax.tree_util.tree_flatten(in_specs, is_leaf=_is_spec)
        flat_out, out_tree = jax.tree_util.tree_flatten(out_specs, is_leaf=_is_spec)
        flat_refs = jax.tree_util.tree_leaves(refs, is_leaf=_is_ref)
        if len(flat_refs) != len(flat_in) + len(flat_out):
            raise PallasError(
                f"emit_pipeline: {len(flat_in)} in_specs and {len(flat_out)} out_specs but "
                f"{len(flat_refs)} Refs were passed. Fix: pass the input Refs, then the output "
                "Refs, one per spec.")
        sub_grid, offsets = _partition(full_grid, core_axis_name, dimension_semantics)
        ins = [_Operand(r, s, f"input {i}")
               for i, (r, s) in enumerate(zip(flat_refs, flat_in))]
        outs = [_Operand(r, s, f"output {i}", output=True)
                for i, (r, s) in enumerate(zip(flat_refs[len(ins):], flat_out))]
        def run(bufs: Sequence[Any], sem_refs: Sequence[Any]) -> None:
            _run(body, sub_grid, offsets, ins, outs, bufs, sem_refs, (in_tree, out_tree),
                 scratches, no_pipelining, _explicit_indices, body_prologue)

        if allocations is not None:
            brefs = _check_allocations(allocations, [*ins, *outs])
            run([b.window_ref for b in brefs], [b.sem for b in brefs])
            return
        buffers = [VMEM((o.count, *o.buffer_shape), o.dtype) for o in (*ins, *outs)]
        sems = [SemaphoreType.DMA((o.count,)) for o in (*ins, *outs)]
        pl.run_scoped(run, buffers, sems)

    return pipeline


def _spread(tree: Any, views: Sequence[Any]) -> list[Any]:
    """The body's arguments for one side: the specs' structure, a single spec as one Ref."""
    out = jax.tree_util.tree_unflatten(tree, views)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, BlockSpec)


def _is_ref(x: Any) -> bool:
    return hasattr(x, "at") and hasattr(x, "shape")


def _run(body: Callable[..., None], grid: tuple[int, ...], offsets: tuple[Any, ...],
         ins: list[_Operand], outs: list[_Operand], bufs: Sequence[Any], sems: Sequence[Any],
         trees: tuple[Any, Any], scratches: Sequence[Any], no_pipelining: bool,
         explicit: bool = False, prologue: Callable[[], None] | None = None) -> None:
    in_bufs, out_bufs = bufs[:len(ins)], bufs[len(ins):]
    in_sems, out_sems = sems[:len(ins)], sems[len(ins):]
    steps = math.prod(grid)

    def indices(step: Any) -> tuple[Any, ...]:
        return tuple(i + o for i, o in zip(_unravel(step, grid), offsets))

    def fetch(k: int, idx: Sequence[Any], slot: Any) -> Any:
        op = ins[k]
        block = op.block_indices(idx)
        return make_async_copy(op.window(block), op.buffer(in_bufs[k].at[slot], block),
                               in_sems[k].at[slot])

    def write_back(k: int, block_idx: Sequence[Any], slot: Any) -> Any:
        op = outs[k]
        return make_async_copy(op.buffer(out_bufs[k].at[slot], block_idx), op.window(block_idx),
                               out_sems[k].at[slot])

    ahead = [0 if no_pipelining else op.count - 1 for op in ins]
    """How many steps ahead each input is fetched (0: synchronously, at its step)."""
    for k in range(len(ins)):  # the first steps' blocks
        for j in range(min(ahead[k], steps)):
            fetch(k, indices(jnp.int32(j)), j).start()

    def step_fn(step: Any, carry: Any) -> Any:
        idx, nxt = indices(step), indices(jnp.minimum(step + 1, steps - 1))
        in_slots = [lax.rem(step, jnp.int32(op.count)) for op in ins]
        for k in range(len(ins)):
            if not ahead[k]:  # a synchronous copy
                copy = fetch(k, idx, in_slots[k])
                copy.start()
                copy.wait()
                continue
            # This step's block has arrived; start fetching the one ``ahead`` steps on, into
            # the buffer the previous step's block was in.
            fetch(k, idx, in_slots[k]).wait()
            later = step + ahead[k]

            @pl.when(later < steps)
            def _(k: int = k, later: Any = later) -> None:
                fetch(k, indices(later), lax.rem(later, jnp.int32(ins[k].count))).start()

        in_views = [b.at[s] for b, s in zip(in_bufs, in_slots)]
        out_slots, pending, pending_idx = carry
        out_views = [b.at[s] for b, s in zip(out_bufs, out_slots)]
        lead = (PipelineStep(idx, step),) if explicit else ()
        with plb.grid_env(idx, grid):
            if prologue is not None:  # in the step's grid environment, before the body
                prologue()
            body(*lead, *_spread(trees[0], in_views), *_spread(trees[1], out_views),
                 *scratches)
        new_slots, new_pending, new_idx = [], [], []
        for k, op in enumerate(outs):
            here, there = op.block_indices(idx), op.block_indices(nxt)
            leaving = _changed(here, there) | (step == steps - 1)
            sync = no_pipelining or op.count == 1
            s, other = out_slots[k], out_slots[k] if op.count == 1 else 1 - out_slots[k]

            @pl.when(leaving)
            def _(k: int = k, s: Any = s, other: Any = other, here: Any = here,
                  sync: bool = sync) -> None:
                # The other buffer's write-back must be done before the body writes into it.
                @pl.when(pending[k])
                def _() -> None:
                    write_back(k, pending_idx[k], other).wait()

                copy = write_back(k, here, s)
                copy.start()
                if sync:
                    copy.wait()

            new_slots.append(jnp.where(leaving, other, s))
            new_pending.append(jnp.where(leaving, not sync, pending[k]))
            new_idx.append(tuple(jnp.where(leaving, h, p) for h, p in zip(here, pending_idx[k])))
        return new_slots, new_pending, new_idx

    init = ([jnp.int32(0)] * len(outs), [jnp.bool_(False)] * len(outs),
            [tuple(jnp.zeros(sh, jnp.int32) for sh in op.index_shapes) for op in outs])
    slots, _, pending_idx = lax.fori_loop(0, steps, step_fn, init)
    # The last write-back of every output is still in flight (the ones before were waited).
    for k, op in enumerate(outs):
        if not (no_pipelining or op.count == 1):
            write_back(k, pending_idx[k], 1 - slots[k]).wait()


# --- pipelines with allocations made once --------------------------------------------------


class BufferType(enum.Enum):
    """The role of a pipeline buffer (JAX's values)."""

    INPUT = 1
    OUTPUT = 2
    INPUT_OUTPUT = 3
    MANUAL = 4

    @property
    def is_input(self) -> bool:
        """Whether buffers of this role are filled from HBM."""
        return self in (BufferType.INPUT, BufferType.INPUT_OUTPUT)

    @property
    def is_output(self) -> bool:
        """Whether buffers of this role are written back to HBM."""
        return self in (BufferType.OUTPUT, BufferType.INPUT_OUTPUT)


class BufferedRefBase(abc.ABC):  # noqa: B024 (JAX's interface class)
    """The interface of a pipeline's buffered operand (deprecated in JAX 0.12: internal to the
    pipelines). :class:`BufferedRef` is the one kind here."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BufferedRef(BufferedRefBase):
    """The buffers of one pipeline operand: ``window_ref``, two VMEM blocks (the one the body
    works on, and the one the DMA engine fills or drains), and ``sem``, their two DMA
    semaphores. ``make_allocations`` returns them with memory descriptions in those fields;
    ``pl.run_scoped`` turns those into Refs, which ``pipeline(..., allocations=...)`` uses."""

    spec: Any = dataclasses.field(metadata={"static": True})
    buffer_type: BufferType = dataclasses.field(metadata={"static": True})
    window_ref: Any = None
    sem: Any = None

    @property
    def is_buffered(self) -> bool:
        """Always True: every operand here has its VMEM blocks."""
        return True

    @property
    def is_input(self) -> bool:
        """Whether the operand is read by the pipeline."""
        return self.buffer_type.is_input

    @property
    def is_output(self) -> bool:
        """Whether the operand is written by the pipeline."""
        return self.buffer_type.is_output


def _check_allocations(allocations: Any, ops: Sequence[_Operand]) -> list[BufferedRef]:
    brefs = jax.tree_util.tree_leaves(allocations, is_leaf=lambda x: isinstance(x, BufferedRef))
    if len(brefs) != len(ops) or not all(isinstance(b, BufferedRef) for b in brefs):
        raise PallasError(
            f"emit_pipeline: allocations must hold one pltpu.BufferedRef per operand ({len(ops)}),"
            f" found {len(brefs)} leaves. Fix: pass what make_allocations (from "
            "emit_pipeline_with_allocations) describes, allocated with pl.run_scoped.")
    for b, op in zip(brefs, ops):
        shape = tuple(getattr(b.window_ref, "shape", ()))
        if shape != (op.count, *op.buffer_shape):
            raise PallasError(f"emit_pipeline {op.origin}: its allocation holds buffers of shape "
                              f"{shape}, the pipeline needs {(op.count, *op.buffer_shape)}. "
                              "Fix: make the allocations with this pipeline's specs.")
    return brefs


def emit_pipeline_with_allocations(body: Callable[..., None], *, grid: Sequence[int],
                                   in_specs: Any = (), out_specs: Any = ()
                                   ) -> tuple[Callable[..., None], Callable[..., Any]]:
    """``(pipeline, make_allocations)``: ``pipeline`` is ``emit_pipeline``'s; and
    ``make_allocations(*refs)`` (the pipeline's HBM Refs) describes its buffers as a tuple of
    :class:`BufferedRef` (inputs, then outputs), for ``pl.run_scoped`` to allocate once and
    ``pipeline(*refs, allocations=...)`` to use in every run."""
    pipeline = emit_pipeline(body, grid=grid, in_specs=in_specs, out_specs=out_specs)

    def make_allocations(*refs: Any) -> tuple[BufferedRef, ...]:
        flat_in = jax.tree_util.tree_leaves(in_specs, is_leaf=_is_spec)
        flat_out = jax.tree_util.tree_leaves(out_specs, is_leaf=_is_spec)
        flat_refs = jax.tree_util.tree_leaves(refs, is_leaf=_is_ref)
        if len(flat_refs) != len(flat_in) + len(flat_out):
            raise PallasError(f"make_allocations: {len(flat_in)} in_specs and {len(flat_out)} "
                              f"out_specs but {len(flat_refs)} Refs were passed.")
        out = []
        for k, (ref, spec) in enumerate(zip(flat_refs, [*flat_in, *flat_out])):
            kind = BufferType.INPUT if k < len(flat_in) else BufferType.OUTPUT
            op = _Operand(ref, spec, f"{kind.name.lower()} {k}", output=k >= len(flat_in))
            out.append(BufferedRef(spec, kind, VMEM((op.count, *op.buffer_shape), op.dtype),
                                   SemaphoreType.DMA((op.count,))))
        return tuple(out)

    return pipeline, make_allocations


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PipelineStep:
    """Where a pipeline body runs (with ``_explicit_indices=True``): ``index``, the grid
    indices of the step; ``local_index``, the step's number in this core's part of the
    grid."""

    index: tuple[Any, ...]
    local_index: Any


def emit_pipeline_with_async_prefetch(
        body: Callable[..., None], *, grid: Sequence[int], in_specs: Any = (),
        out_specs: Any = (), mesh: Any, tiling: Any = None, core_axis: Any = None,
        core_axis_name: Any = None, dimension_semantics: Any = None, trace_scopes: bool = True,
        no_pipelining: bool = False, _explicit_indices: bool = False
) -> tuple[Callable[..., None], Callable[..., Any]]:
    """``(pipeline, async_prefetch)``: ``pipeline`` is ``emit_pipeline``'s; in JAX,
    ``async_prefetch(*inputs)`` starts the first input copies early, in a kernel on ``mesh``,
    and returns allocations for ``pipeline(..., allocations=...)``. Prefetching never changes
    results; here it starts nothing and returns ``None``, so the pipeline fetches its first
    blocks itself."""
    if mesh is None:
        raise PallasError("emit_pipeline_with_async_prefetch needs mesh=. Fix: pass the "
                          "pl.kernel mesh the pipeline runs on.")
    pipeline = emit_pipeline(body, grid=grid, in_specs=in_specs, out_specs=out_specs,
                             tiling=tiling, core_axis=core_axis, core_axis_name=core_axis_name,
                             dimension_semantics=dimension_semantics,
                             trace_scopes=trace_scopes, no_pipelining=no_pipelining,
                             _explicit_indices=_explicit_indices)

    def async_prefetch(*inputs: Any) -> None:
        return None

    return pipeline, async_prefetch
