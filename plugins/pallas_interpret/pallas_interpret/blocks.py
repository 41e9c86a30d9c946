"""Blocks of operands: padding arrays to whole blocks, and reading and writing the block a grid
point's index maps name (shared by the step-by-step and the lockstep runners)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax import lax

from pallas_core.grid_mapping import BlockMapping
from pallas_core.request import KernelCall
from pallas_core.semantics import uninitialized


def padded_shape(bm: BlockMapping) -> tuple[int, ...]:
    """The operand's shape rounded up to whole blocks."""
    return tuple(-(-d // b) * b for d, b in zip(bm.array_shape, bm.full_block_shape))


def pad(x: Any, bm: BlockMapping, checked: bool) -> Any:
    """``x`` padded to whole blocks (with poison in checked mode)."""
    target = padded_shape(bm)
    if tuple(x.shape) == target:
        return x
    fill = uninitialized((), x.dtype, checked)
    return lax.pad(x, fill, [(0, t - d, 0) for d, t in zip(x.shape, target)])


def unravel(step: Any, grid: Sequence[int]) -> tuple[Any, ...]:
    """The grid indices of step number ``step`` (row-major)."""
    ids = []
    for size in reversed(grid):
        ids.append(step % size)
        step = step // size
    return tuple(reversed(ids))


def starts(bm: BlockMapping, ids: Sequence[Any], prefetch: Sequence[Any] = ()) -> list[Any]:
    """Where the block of grid point ``ids`` starts in the (padded) operand."""
    return [i * b for i, b in zip(bm.block_indices(*ids, *prefetch), bm.full_block_shape)]


def read_block(buf: Any, bm: BlockMapping, starts: Sequence[Any]) -> Any:
    """The block at ``starts``, shaped as the kernel's Ref."""
    block = lax.dynamic_slice(buf, starts, bm.full_block_shape)
    return block.reshape(bm.ref_shape)


def read_block_filled(buf: Any, bm: BlockMapping, starts: Sequence[Any]) -> Any:
    """:func:`read_block`, with the elements that lie outside the array (a block index past
    its end, or negative) read as uninitialized memory."""
    block = lax.dynamic_slice(buf, starts, bm.full_block_shape)
    ok = jnp.ones(bm.full_block_shape, jnp.bool_)
    for d, (s, n) in enumerate(zip(starts, bm.array_shape)):
        pos = s + lax.broadcasted_iota(jnp.int32, bm.full_block_shape, d)
        ok = ok & (pos >= 0) & (pos < n)
    block = jnp.where(ok, block, uninitialized((), block.dtype))
    return block.reshape(bm.ref_shape)


def write_block(buf: Any, bm: BlockMapping, starts: Sequence[Any], block: Any) -> Any:
    """``buf`` with the block at ``starts`` replaced."""
    return lax.dynamic_update_slice(buf, block.reshape(bm.full_block_shape), starts)


def unpad(x: Any, bm: BlockMapping) -> Any:
    """``x`` (padded to whole blocks) cut back to the operand's shape."""
    if tuple(x.shape) == tuple(bm.array_shape):
        return x
    return lax.slice(x, (0,) * x.ndim, bm.array_shape)


def initial_operands(call: KernelCall, args: Sequence[Any], checked: bool
                     ) -> tuple[list[Any], list[Any]]:
    """The call's inputs and outputs before any step, padded to whole blocks: aliased outputs
    start from their input, the others uninitialised."""
    gm = call.grid_mapping
    ins = [pad(x, bm, checked) for x, bm in zip(args, gm.inputs)]
    aliased = {o: i for i, o in call.input_output_aliases}
    outs = [pad(args[aliased[k]], bm, checked) if k in aliased
            else uninitialized(padded_shape(bm), bm.dtype, checked)
            for k, bm in enumerate(gm.outputs)]
    return ins, outs
