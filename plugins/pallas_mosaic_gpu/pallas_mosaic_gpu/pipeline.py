"""``plgpu.emit_pipeline`` and the atomics of ``jax.experimental.pallas.mosaic_gpu``.

``emit_pipeline`` is written with this backend's primitives only (``pl.run_scoped`` SMEM
buffers and barriers, ``copy_gmem_to_smem``, ``barrier_wait``, ``commit_smem``,
``copy_smem_to_gmem``, ``wait_smem_to_gmem``, a ``fori_loop``), so the interpreter runs it
with their semantics and the lowering needs nothing of its own for it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_core as pl
from pallas_core.backend import PallasError, plain_block_dim
from pallas_mosaic_gpu import primitives as gp
from pallas_mosaic_gpu.params import SMEM, Barrier
from pallas_mosaic_gpu.transforms import check_transforms


def _delay(spec: Any, slots: int, what: str) -> int:
    """The ``delay_release`` of a ``plgpu.BlockSpec`` (0 for a ``pl.BlockSpec``), checked."""
    delay = int(getattr(spec, "delay_release", 0))
    if delay and delay >= slots:
        raise PallasError(
            f"plgpu.emit_pipeline: {what} has delay_release={delay}, which needs more than "
            f"{delay} buffers, but the pipeline has {slots} (max_concurrent_steps, at most the "
            "number of steps). Fix: raise max_concurrent_steps above delay_release.")
    return delay


def _block_dims(spec: Any, what: str, ndim: int) -> tuple[tuple[int | None, ...], list[int]]:
    """``spec``'s block shape (``None`` for squeezed dimensions) and the SMEM buffer shape."""
    if not isinstance(spec, pl.BlockSpec) or spec.block_shape is None or spec.index_map is None:
        raise PallasError(
            f"plgpu.emit_pipeline: {what} must be a pl.BlockSpec with a block_shape and an "
            f"index_map, found {spec!r}. Fix: e.g. pl.BlockSpec((64, 64), lambda k: (0, k)).")
    if spec.memory_space is not None and spec.memory_space is not SMEM:
        raise PallasError(
            f"plgpu.emit_pipeline: {what} names memory space {spec.memory_space}; the "
            "pipeline stages every block in SMEM. Fix: leave memory_space unset.")
    dims = tuple(plain_block_dim(d, f"plgpu.emit_pipeline: {what}") for d in spec.block_shape)
    if len(dims) != ndim:
        raise PallasError(
            f"plgpu.emit_pipeline: {what} has a {len(dims)}-D block_shape {spec.block_shape} "
            f"for a {ndim}-D Ref. Fix: one entry per dimension (None to squeeze one).")
    return dims, [d for d in dims if d is not None]


def _check_layout(spec: Any, shape: list[int], dtype: Any, what: str) -> None:
    """A ``plgpu.BlockSpec``'s ``transforms`` must describe the layout of its SMEM block."""
    transforms = getattr(spec, "transforms", ())
    if transforms:
        check_transforms(transforms, tuple(shape), dtype, f"plgpu.emit_pipeline: {what}")


def _window(spec: Any, dims: tuple[int | None, ...], indices: Sequence[Any],
            what: str) -> tuple[Any, ...]:
    """The GMEM window of the block ``spec.index_map(*indices)`` names."""
    block = spec.index_map(*indices)
    block = tuple(block) if isinstance(block, (tuple, list)) else (block,)
    if len(block) != len(dims):
        raise PallasError(
            f"plgpu.emit_pipeline: the index_map of {what} returned {len(block)} block indices "
            f"for a {len(dims)}-D block. Fix: return one block index per dimension.")
    return tuple(jnp.asarray(b, jnp.int32) if d is None else
                 pl.ds(jnp.asarray(b, jnp.int32) * d, d)
                 for b, d in zip(block, dims))


def _grid_entry_ok(g: Any) -> bool:
    """A static positive int, or an integer scalar traced in the kernel."""
    if isinstance(g, int):
        return g > 0
    shape, dtype = getattr(g, "shape", None), getattr(g, "dtype", None)
    return shape == () and dtype is not None and jnp.issubdtype(dtype, jnp.integer)


def emit_pipeline(body: Callable[..., Any], *, grid: Sequence[int],
                  in_specs: Sequence[Any] = (), out_specs: Sequence[Any] = (),
                  max_concurrent_steps: int = 1, init_carry: Any = None
                  ) -> Callable[..., Any]:
    """A pipeline over ``grid`` inside a kernel, as JAX's ``plgpu.emit_pipeline``.

    Returns a function of GMEM Refs (inputs, then outputs). At each step (row-major over
    ``grid``) ``body(indices, *in_smem, *out_smem)`` runs on the SMEM blocks the specs'
    index maps name; input blocks arrive by TMA up to ``max_concurrent_steps`` steps ahead,
    output blocks are TMA-stored when the next step names another block (and at the end), so
    a block revisited by consecutive steps accumulates in SMEM. With ``init_carry`` the body
    takes the carry last and returns the next one; the pipeline returns the final carry.

    ``grid`` entries may be int32 scalars known only at run time (read from a Ref): the
    pipeline then has ``max_concurrent_steps`` slots and fetches ahead only existing steps.

    Specs may be ``plgpu.BlockSpec``s: their ``transforms`` are checked against the layout
    the backend gives the block, and ``delay_release=d`` keeps an input's buffer for ``d``
    more steps, so that the ``plgpu.wgmma`` a step issues on it may still run during the
    next ``d`` steps (at most ``d`` wgmma are left in flight after each step; the buffer is
    refilled once the step ``d`` later is done). Without it, every wgmma of a step is waited
    for (``wgmma_wait(0)``) before its buffers are refilled.
    """
    grid = tuple(int(g) if isinstance(g, (int, np.integer)) else g for g in grid)
    dynamic = not all(isinstance(g, int) for g in grid)
    if not all(_grid_entry_ok(g) for g in grid):
        raise PallasError(
            f"plgpu.emit_pipeline: grid must be positive ints or int32 scalars known at run "
            f"time, found {grid}. Fix: give a grid such as (k_steps,).")
    if not isinstance(max_concurrent_steps, int) or max_concurrent_steps < 1:
        raise PallasError(
            f"plgpu.emit_pipeline: max_concurrent_steps must be an int >= 1, found "
            f"{max_concurrent_steps!r}.")
    in_specs, out_specs = tuple(in_specs), tuple(out_specs)
    # A grid known at run time (JAX allows one, e.g. the K blocks of a ragged group) gets
    # max_concurrent_steps slots, and the first fetches are guarded by the step count.
    steps: Any = math.prod(jnp.asarray(g, jnp.int32) if dynamic else g for g in grid)
    slots = max_concurrent_steps if dynamic else min(max_concurrent_steps, steps)

    def unravel(step: Any) -> tuple[Any, ...]:
        out = []
        for g in reversed(grid):
            out.append(lax.rem(step, g))
            step = lax.div(step, g)
        return tuple(reversed(out))

    def run(*refs: Any) -> Any:
        if len(refs) != len(in_specs) + len(out_specs):
            raise PallasError(
                f"plgpu.emit_pipeline: the pipeline has {len(in_specs)} in_specs and "
                f"{len(out_specs)} out_specs but was called with {len(refs)} Refs. Fix: pass "
                "one GMEM Ref per spec, inputs first.")
        ins, outs = refs[:len(in_specs)], refs[len(in_specs):]
        in_dims = [_block_dims(s, f"in_specs[{k}]", len(r.shape))
                   for k, (s, r) in enumerate(zip(in_specs, ins))]
        out_dims = [_block_dims(s, f"out_specs[{k}]", len(r.shape))
                    for k, (s, r) in enumerate(zip(out_specs, outs))]
        for kind, specs, dims, refs_ in (("in", in_specs, in_dims, ins),
                                         ("out", out_specs, out_dims, outs)):
            for k, (s, (_, shape), r) in enumerate(zip(specs, dims, refs_)):
                _check_layout(s, shape, r.dtype, f"{kind}_specs[{k}]")
        delays = [_delay(s, slots, f"in_specs[{k}]") for k, s in enumerate(in_specs)]
        types = ([SMEM((slots, *shape), r.dtype, transforms=getattr(s, "transforms", ()))
                  for s, (_, shape), r in zip(in_specs, in_dims, ins)]
                 + [Barrier(num_arrivals=1, num_barriers=slots) for _ in ins]
                 + [SMEM(tuple(shape), r.dtype, transforms=getattr(s, "transforms", ()))
                    for s, (_, shape), r in zip(out_specs, out_dims, outs)])

        def scoped(*scratch: Any) -> Any:
            n = len(ins)
            in_bufs, bars, out_bufs = scratch[:n], scratch[n:2 * n], scratch[2 * n:]

            def fetch(k: int, step: Any, slot: Any) -> None:
                window = _window(in_specs[k], in_dims[k][0], unravel(step), f"in_specs[{k}]")
                gp.copy_gmem_to_smem(ins[k].at[window], in_bufs[k].at[slot], bars[k].at[slot])

            for s in range(slots):
                @pl.when(s < steps if dynamic else True)
                def _first(s: int = s) -> None:
                    for k in range(len(ins)):
                        fetch(k, jnp.int32(s), s)

            def out_windows(step: Any) -> list[tuple[Any, ...]]:
                idx = unravel(step)
                return [_window(spec, out_dims[k][0], idx, f"out_specs[{k}]")
                        for k, spec in enumerate(out_specs)]

            def changed(a: tuple[Any, ...], b: tuple[Any, ...]) -> Any:
                diff = jnp.bool_(False)
                for x, y in zip(a, b):
                    x = x.start if isinstance(x, pl.Slice) else x
                    y = y.start if isinstance(y, pl.Slice) else y
                    diff = diff | (x != y)
                return diff

            def step_fn(step: Any, carry: Any) -> Any:
                slot = lax.rem(step, slots)
                idx = unravel(step)
                for bar in bars:
                    gp.barrier_wait(bar.at[slot])
                if out_specs:
                    # The previous store from the output buffers must have read them.
                    gp.wait_smem_to_gmem(0, wait_read_only=True)
                views = [b.at[slot] for b in in_bufs] + list(out_bufs)
                if init_carry is None:
                    body(idx, *views)
                    new_carry = carry
                else:
                    new_carry = body(idx, *views, carry)
                # Leave in flight only the wgmma of the steps whose buffers are still kept.
                gp.wgmma_wait(min(delays, default=0))
                for k in range(len(ins)):
                    done = step - delays[k]  # the step whose buffer of input k is released

                    @pl.when((done >= 0) & (done + slots < steps))
                    def _refill(k: int = k, done: Any = done) -> None:
                        fetch(k, done + slots, lax.rem(done, slots))
                if out_specs:
                    here = out_windows(step)
                    nxt = out_windows(jnp.minimum(step + 1, steps - 1))
                    for k, ref in enumerate(outs):
                        last = step == steps - 1
                        flush = last | changed(here[k], nxt[k])

                        @pl.when(flush)
                        def _store(k: int = k, ref: Any = ref) -> None:
                            gp.commit_smem()
                            gp.copy_smem_to_gmem(out_bufs[k], ref.at[here[k]])
                return new_carry

            final = lax.fori_loop(0, steps, step_fn, init_carry)
            if any(delays):  # no wgmma may read the buffers after their scope ends
                gp.wgmma_wait(0)
            if out_specs:
                gp.wait_smem_to_gmem(0)
            return final

        final = pl.run_scoped(scoped, *types)
        return final if init_carry is not None else None

    return run


# --- atomics -------------------------------------------------------------------------------


def _atomic(op: str) -> Callable[[Any, Any], None]:
    core_fn = getattr(pl, f"atomic_{op}")

    def atomic(ref: Any, val: Any) -> None:
        core_fn(ref, ..., val)

    atomic.__name__ = f"atomic_{op}"
    atomic.__doc__ = (
        f"Atomically applies ``{op}`` of ``val`` to every element of ``ref`` (a GMEM or "
        "SMEM Ref, or a view of one), as JAX's ``plgpu.atomic_" + op + "``; returns nothing. "
        "Atomicity is per element.")
    return atomic


atomic_add = _atomic("add")
atomic_max = _atomic("max")
atomic_min = _atomic("min")
atomic_and = _atomic("and")
atomic_or = _atomic("or")
atomic_xor = _atomic("xor")
