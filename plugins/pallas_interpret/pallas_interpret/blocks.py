"""Blocks of operands: padding arrays so that every block lies inside them, and reading and
writing the block a grid point's index maps name (shared by the step-by-step and the lockstep
runners).

Each dimension is indexed as its block dimension says (``BlockMapping.dims``): a block index
(``Blocked``: the operand is padded up to whole blocks), an element index (squeezed), an
element offset into the array padded as the ``pl.Element`` says (plus one block past the end,
so that no window is shifted back inside), or a ``pl.ds(start, size)`` of at most the block
size (``pl.BoundedSlice``: the elements past ``size`` read as undefined and are not written).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax import lax

from pallas_core import Blocked, BoundedSlice, Element
from pallas_core import backend as plb
from pallas_core.backend import BlockMapping, KernelCall, ReferenceContext, uninitialized


def _pads(bm: BlockMapping) -> list[tuple[int, int]]:
    """Per dimension the ``(low, high)`` padding that keeps every block inside the array."""
    pads = []
    for dim, n, b in zip(bm.dims, bm.array_shape, bm.full_block_shape):
        if isinstance(dim, Element):
            lo, hi = dim.padding
            pads.append((lo, hi + b))
        elif isinstance(dim, BoundedSlice):
            pads.append((0, b))
        elif isinstance(dim, Blocked) and b:
            pads.append((0, -(-n // b) * b - n))
        else:
            pads.append((0, 0))
    return pads


def padded_shape(bm: BlockMapping) -> tuple[int, ...]:
    """The operand's shape once padded (see :func:`pad`)."""
    return tuple(n + lo + hi for n, (lo, hi) in zip(bm.array_shape, _pads(bm)))


def pad(x: Any, bm: BlockMapping, checked: bool) -> Any:
    """``x`` padded so that every block lies inside it: a ``pl.Element``'s own padding reads as
    ``jax.experimental.pallas``'s interpreter fills it (NaN, or the integer minimum), the rest
    as uninitialised memory (poison in checked mode)."""
    pads = _pads(bm)
    if not any(lo or hi for lo, hi in pads):
        return x
    element = [dim.padding if isinstance(dim, Element) else (0, 0) for dim in bm.dims]
    if any(lo or hi for lo, hi in element):
        x = lax.pad(x, uninitialized((), x.dtype, True), [(lo, hi, 0) for lo, hi in element])
    rest = [(0, hi - e_hi, 0) for (_, hi), (_, e_hi) in zip(pads, element)]
    return lax.pad(x, uninitialized((), x.dtype, checked), rest)


def unpad(x: Any, bm: BlockMapping) -> Any:
    """``x`` (padded as :func:`pad` does) cut back to the operand's shape."""
    if tuple(x.shape) == tuple(bm.array_shape):
        return x
    lows = [lo for lo, _ in _pads(bm)]
    return lax.slice(x, lows, [lo + n for lo, n in zip(lows, bm.array_shape)])


def unravel(step: Any, grid: Sequence[Any]) -> tuple[Any, ...]:
    """The grid indices of step number ``step`` (row-major)."""
    ids = []
    for size in reversed(grid):
        ids.append(step % size)
        step = step // size
    return tuple(reversed(ids))


@dataclasses.dataclass(frozen=True)
class Window:
    """Where one operand's block lies at one grid point."""

    starts: tuple[Any, ...]
    """Per dimension where the block starts in the padded operand."""
    valid: tuple[Any | None, ...]
    """Per dimension how many leading elements of the block belong to it (the size of a
    ``pl.BoundedSlice``), or ``None`` where all do."""
    indices: tuple[Any, ...] = ()
    """The index map's values (one per dimension, then each bounded slice's size)."""


def starts(bm: BlockMapping, ids: Sequence[Any], prefetch: Sequence[Any] = (),
           ctx: ReferenceContext | None = None, rules: plb.SemanticsRules | None = None
           ) -> Window:
    """The window of ``bm``'s block at grid point ``ids``.

    With ``ctx`` and ``rules`` the index map is evaluated with the reference semantics (needed
    when it reads ``pl.num_programs`` of a dynamic grid).
    """
    if ctx is None or rules is None:
        values = bm.block_indices(*ids, *prefetch)
    else:
        values = plb.evaluate(bm.pure_index_map, [*ids, *prefetch], ctx, rules)
        values = values[:bm.num_index_outputs]
    ndim = len(bm.array_shape)
    sizes = iter(values[ndim:])
    begin, valid = [], []
    for i, dim in zip(values[:ndim], bm.dims):
        begin.append(i * dim.block_size if isinstance(dim, Blocked) else i)
        valid.append(next(sizes) if isinstance(dim, BoundedSlice) else None)
    return Window(tuple(begin), tuple(valid), tuple(values[:bm.num_index_outputs]))


def _valid_mask(bm: BlockMapping, where: Window) -> Any | None:
    """Which elements of the block belong to it (``None``: all)."""
    if all(v is None for v in where.valid):
        return None
    shape = bm.full_block_shape
    mask = jnp.ones(shape, bool)
    for d, v in enumerate(where.valid):
        if v is not None:
            mask &= lax.broadcasted_iota(jnp.int32, shape, d) < v
    return mask


def read_block(buf: Any, bm: BlockMapping, where: Window, checked: bool = False) -> Any:
    """The block at ``where``, shaped as the kernel's Ref."""
    block = lax.dynamic_slice(buf, where.starts, bm.full_block_shape)
    mask = _valid_mask(bm, where)
    if mask is not None:
        block = jnp.where(mask, block, uninitialized((), block.dtype, checked))
    return block.reshape(bm.ref_shape)


def read_block_filled(buf: Any, bm: BlockMapping, where: Window, checked: bool = False) -> Any:
    """:func:`read_block`, with the elements that lie outside the array (a block index past its
    end, or negative) read as uninitialized memory."""
    shape = bm.full_block_shape
    block = lax.dynamic_slice(buf, where.starts, shape)
    mask = _valid_mask(bm, where)
    ok = jnp.ones(shape, bool) if mask is None else mask
    for d, (s, (lo, _), n) in enumerate(zip(where.starts, _pads(bm), bm.array_shape)):
        pos = s - lo + lax.broadcasted_iota(jnp.int32, shape, d)
        ok = ok & (pos >= 0) & (pos < n)
    block = jnp.where(ok, block, uninitialized((), block.dtype, checked))
    return block.reshape(bm.ref_shape)


def write_block(buf: Any, bm: BlockMapping, where: Window, block: Any) -> Any:
    """``buf`` with the block at ``where`` replaced."""
    block = block.reshape(bm.full_block_shape)
    mask = _valid_mask(bm, where)
    if mask is not None:
        block = jnp.where(mask, block, lax.dynamic_slice(buf, where.starts, block.shape))
    return lax.dynamic_update_slice(buf, block, where.starts)


def initial_operands(call: KernelCall, args: Sequence[Any], checked: bool
                     ) -> tuple[list[Any], list[Any]]:
    """The call's inputs and outputs before any step, padded as :func:`pad` does: aliased
    outputs start from their input, the others uninitialised."""
    gm = call.grid_mapping
    ins = [pad(x, bm, checked) for x, bm in zip(args, gm.inputs)]
    aliased = {o: i for i, o in call.input_output_aliases}
    outs = [pad(args[aliased[k]], bm, checked) if k in aliased
            else uninitialized(padded_shape(bm), bm.dtype, checked)
            for k, bm in enumerate(gm.outputs)]
    return ins, outs
