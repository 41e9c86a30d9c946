"""``jax.vmap`` of ``pallas_call``, batched as JAX batches it: every operand stays in place.

The batch becomes a new grid axis, prepended to the grid (``program_id(i)`` in the kernel still
names axis ``i`` of the user's grid: ``GridMapping.num_batch_axes`` counts the added axes). The
BlockSpec of each batched operand gains a squeezed block dimension at the batched axis, and its
index map returns the new grid index there; unbatched operands keep their blocks and ignore the
new index. Operands are not moved, so no transpose surrounds the kernel. Outputs are batched
along their leading axis (``out_axes`` other than 0 move them afterwards, as in JAX). Batched
scalar-prefetch operands or dynamic grid sizes, which index maps read whole, make one call per
batch element in a loop instead; a batch of one is the call itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from pallas_core import _jax, autodiff
from pallas_core import grid_mapping as gmap
from pallas_core.errors import BlockSpecError
from pallas_core.request import KernelCall
from pallas_core.spec import squeezed

Bind = Callable[..., Sequence[Any]]
"""``bind(*operands, call=KernelCall) -> outputs``: binds the ``pallas_call`` primitive."""


def batch(bind: Bind, validate: Callable[[KernelCall, str], None], size: int,
          args: Sequence[Any], dims: Sequence[Any],
          call: KernelCall) -> tuple[list[Any], list[int | None]]:
    """``vmap`` of a call, as JAX batches it: every operand stays where it is. The block spec
    of a batched operand gains a squeezed dimension at the batched axis, whose index is a new
    grid axis prepended to the grid; outputs are batched along their leading axis."""
    gm = call.grid_mapping
    if all(d is None for d in dims):
        outs = bind(*args, call=call)
        return list(outs), [None] * len(outs)
    if size == 1:  # one batch element: the call itself, its outputs given a leading axis
        squeezed_args = [a if d is None else jnp.squeeze(a, d) for a, d in zip(args, dims)]
        outs = bind(*squeezed_args, call=call)
        return [jnp.expand_dims(o, 0) for o in outs], [0] * len(outs)
    # Dynamic grid sizes are the last operands, scalar-prefetch operands the first: index
    # maps take both whole, so batched ones make a loop over the batch.
    n_dyn = gm.num_dynamic_grid_bounds
    if (any(d is not None for d in dims[len(dims) - n_dyn:])
            or any(d is not None for d in dims[:gm.num_scalar_prefetch])):
        return _batch_as_loop(bind, args, dims, size, call)
    grid_sizes = list(args[len(args) - n_dyn:])
    args, dims = _aliased_inputs_leading(args[:len(args) - n_dyn], dims[:len(dims) - n_dyn],
                                         size, call)
    n_same = autodiff.outputs_independent_of(call, [d is not None for d in dims])
    pf_avals = [_jax.make_ref_aval(bm.array_shape, bm.dtype)
                for bm in gm.block_mappings[:gm.num_scalar_prefetch]]
    mappings = [_batch_block_mapping(bm, d, gm.grid, size, pf_avals) for bm, d in
                zip(gm.block_mappings, [*dims, *([0] * gm.num_outputs)])]
    new_gm = dataclasses.replace(gm, grid=(size, *gm.grid), block_mappings=tuple(mappings),
                                 num_batch_axes=gm.num_batch_axes + 1)
    new_call = call.replace(
        grid_mapping=new_gm,
        out_avals=tuple(_jax.ShapedArray((size, *a.shape), a.dtype) for a in call.out_avals))
    if new_call.backend is not None:  # vmap changed the blocks the backend checked
        try:
            validate(new_call, new_call.backend)
        except BlockSpecError as e:
            raise BlockSpecError(
                f"{e}\nUnder jax.vmap each operand stays in place: its batched axis becomes a "
                "squeezed block dimension (as in jax.experimental.pallas), and the backend's "
                "block rules apply to it. Fix, where the block above is one vmap made: batch "
                "along another axis (e.g. jnp.moveaxis the batched axis to the front and use "
                "in_axes=0).") from e
    outs = bind(*args, *grid_sizes, call=new_call)
    # Outputs that do not depend on the batched inputs are the same in every batch element.
    return ([o[0] for o in outs[:n_same]] + list(outs[n_same:]),
            [None] * n_same + [0] * (len(outs) - n_same))


def _aliased_inputs_leading(args: Sequence[Any], dims: Sequence[Any], size: int,
                            call: KernelCall) -> tuple[list[Any], list[Any]]:
    """An input aliased to an output is batched like that output (along its leading axis):
    broadcast if unbatched, its batched axis moved to the front otherwise."""
    args, dims = list(args), list(dims)
    for i, _ in call.input_output_aliases:
        if dims[i] is None:
            args[i] = jnp.broadcast_to(args[i], (size, *args[i].shape))
        elif dims[i] != 0:
            args[i] = jnp.moveaxis(args[i], dims[i], 0)
        dims[i] = 0
    return args, dims


def _batch_as_loop(bind: Bind, args: Sequence[Any], dims: Sequence[Any], size: int,
                   call: KernelCall) -> tuple[list[Any], list[int | None]]:
    """One call per batch element, in a loop (for batched grid sizes or scalar-prefetch
    operands): each batched operand is indexed in place, each output written at its row."""
    args, dims = _aliased_inputs_leading(args, dims, size, call)

    def one(b: Any, outs: list[Any]) -> list[Any]:
        operands = [a if d is None else jax.lax.dynamic_index_in_dim(a, b, d, keepdims=False)
                    for a, d in zip(args, dims)]
        found = bind(*operands, call=call)
        return [jax.lax.dynamic_update_index_in_dim(o, f, b, 0) for o, f in zip(outs, found)]

    start = [jnp.zeros((size, *a.shape), a.dtype) for a in call.out_avals]
    outs = jax.lax.fori_loop(0, size, one, start)
    return list(outs), [0] * len(outs)


def _batch_block_mapping(bm: gmap.BlockMapping, dim: int | None, grid: tuple[int, ...],
                         size: int, pf_avals: Sequence[Any]) -> gmap.BlockMapping:
    """``bm`` with the new leading grid index as the block index of a squeezed dimension at
    ``dim`` (``None``: an unbatched operand, whose index map ignores the new index)."""
    avals = [_jax.ShapedArray((), jnp.int32)] * (len(grid) + 1) + list(pf_avals)

    def index_map(b: Any, *idx: Any) -> list[Any]:
        inner = list(bm.block_indices(*idx))
        if dim is not None:
            inner.insert(dim, b)  # before any bounded-slice sizes: dim <= the array's rank
        return inner

    jaxpr, _, consts = _jax.trace_to_jaxpr(index_map, avals, name="index_map")
    if dim is None:
        return dataclasses.replace(bm, index_map=_jax.ClosedJaxpr(jaxpr, list(consts)),
                                   num_prefetch=len(pf_avals))

    def insert(t: tuple[Any, ...], x: Any) -> tuple[Any, ...]:
        return (*t[:dim], x, *t[dim:])

    return dataclasses.replace(
        bm, origin=f"{bm.origin} (its axis {dim} batched by jax.vmap: a squeezed block "
        "dimension)", array_shape=insert(bm.array_shape, size),
        block_shape=insert(bm.block_shape, None),
        index_map=_jax.ClosedJaxpr(jaxpr, list(consts)), num_prefetch=len(pf_avals),
        block_dims=insert(bm.block_dims, squeezed) if bm.block_dims else ())
