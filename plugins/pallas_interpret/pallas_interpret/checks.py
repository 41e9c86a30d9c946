"""The interpreter's checked mode: races between parallel grid steps, accesses outside Refs.

* Races are found ahead of time from the index maps: two grid steps that differ along a
  parallel axis and write the same output block may run at the same time on the hardware.
* Reads and writes outside a Ref (``x_ref[pl.ds(start, n)]`` with ``start + n`` past the end)
  are checked while the kernel runs: the discharge rules of reads and writes are wrapped with a
  bounds check that reports the Ref, the grid step and the index on the host.

Poisoning of uninitialised memory is done where buffers are created (``grid.run_exact``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_core import _jax, semantics
from pallas_core import grid_mapping as gmap
from pallas_core import primitives as prims
from pallas_core.errors import OutOfBoundsError, PallasError
from pallas_core.request import KernelCall


class RaceError(PallasError):
    """Two grid steps that may run in parallel write the same output block."""


def check_races(call: KernelCall, parallel: Sequence[int]) -> None:
    """Raises ``RaceError`` if steps differing along a ``parallel`` axis share an output block.

    Whole-array outputs (memory space ``ANY``) are not checked here: each step sees the whole
    array, and whether two steps write the same elements depends on the kernel.
    """
    gm = call.grid_mapping
    if not parallel:
        return
    tables = gmap.block_index_tables(gm)
    if tables is None:
        return
    points, per_operand = tables
    par = list(parallel)
    for bm, table in zip(gm.outputs, per_operand[gm.num_inputs:]):
        if bm.is_whole_array:
            continue
        first: dict[tuple[int, ...], int] = {}
        for step, block in enumerate(map(tuple, table.tolist())):
            other = first.setdefault(block, step)
            if other != step and (points[other, par] != points[step, par]).any():
                axis = par[int(np.argmax(points[other, par] != points[step, par]))]
                user_axis = axis - gm.num_batch_axes
                raise RaceError(
                    f"data race in kernel {call.name!r}: {bm.origin} block {block} is written at "
                    f"grid steps {tuple(points[other].tolist())} and "
                    f"{tuple(points[step].tolist())}, which differ along parallel grid axis "
                    f"{user_axis} and may run at the same time. Fix: give each step along axis "
                    f"{user_axis} its own output block (make the index map depend on it), or "
                    "make the axis sequential (e.g. 'arbitrary' dimension semantics on TPU; "
                    "on GPUs, loop inside the kernel instead)."
                )


def _ref_names(call: KernelCall) -> dict[int, str]:
    gm = call.grid_mapping
    names = [bm.origin for bm in gm.block_mappings]
    names += [f"scratch {i}" for i in range(len(gm.scratch_avals))]
    return {id(v.aval): n for v, n in zip(call.jaxpr.jaxpr.invars, names)}


def _in_bounds(indexer: Any, shape: Sequence[int]) -> tuple[Any, list[Any]]:
    """Whether every index of ``indexer`` lies inside ``shape``; and the starts, for messages."""
    ok = jnp.bool_(True)
    starts = []
    for idx, dim in zip(indexer.indices, shape):
        if isinstance(idx, _jax.Slice):
            start = jnp.asarray(idx.start, jnp.int32)
            last = start + (idx.size - 1) * idx.stride
            ok = ok & (start >= 0) & (last < dim)
            starts.append(start)
        else:
            i = jnp.asarray(idx, jnp.int32)
            ok = ok & jnp.all((i >= 0) & (i < dim))
            starts.append(jnp.min(i) if i.ndim else i)
    return ok, starts


def discharge(call: KernelCall, checked: bool) -> Any:
    """The kernel with its Refs discharged; in checked mode with bounds checks on accesses."""
    gm = call.grid_mapping
    if not checked:
        return _jax.discharge_state(call.jaxpr, axis_sizes=gm.axis_env)
    fresh = _jax.ClosedJaxpr(call.jaxpr.jaxpr, call.jaxpr.consts)  # not the cached discharge
    with checked_rules(call):
        return _jax.discharge_state(fresh, axis_sizes=gm.axis_env)


@contextlib.contextmanager
def checked_rules(call: KernelCall) -> Iterator[None]:
    """Within the block, discharging (parts of) ``call``'s kernel applies checked mode: reads
    and writes check their bounds, ``run_scoped`` buffers start poisoned."""
    names = _ref_names(call)
    n_axes = len(call.grid_mapping.user_grid)

    def wrap(prim: Any, rule: Any) -> Any:
        def checked_rule(in_avals: Any, out_avals: Any, ref: Any, *args: Any,
                         **params: Any) -> Any:
            tree = params["tree"]
            flat = args[1:] if prim is _jax.swap_p else args
            transforms = jax.tree_util.tree_unflatten(tree, flat[:tree.num_leaves])
            shape = in_avals[0].inner_aval.shape
            if len(transforms) == 1 and isinstance(transforms[0], _jax.NDIndexer):
                ok, starts = _in_bounds(transforms[0], shape)
                step = [prims.program_id_p.bind(axis=a) for a in range(n_axes)]
                what = "write to" if prim is _jax.swap_p else "read of"
                name = names.get(id(in_avals[0]), f"a Ref of shape {shape}")
                report = functools.partial(_report, kernel=call.name, what=what, name=name,
                                           shape=tuple(shape), sizes=_sizes(transforms[0]))
                jax.debug.callback(report, ok, jnp.stack(starts) if starts else jnp.zeros(0),
                                   jnp.stack(step) if step else jnp.zeros(0))
            return rule(in_avals, out_avals, ref, *args, **params)
        return checked_rule

    with (_jax.discharge_rules_wrapped(wrap, [_jax.get_p, _jax.swap_p]),
          semantics.checked_discharge()):
        yield


def _sizes(indexer: Any) -> tuple[int, ...]:
    return tuple(int(getattr(i, "size", 1)) for i in indexer.indices)


def _report(ok: Any, starts: Any, step: Any, *, kernel: str, what: str, name: str,
            shape: tuple[int, ...], sizes: tuple[int, ...]) -> None:
    if bool(ok):
        return
    raise OutOfBoundsError(
        f"out-of-bounds {what} {name} in kernel {kernel!r} at grid step "
        f"{tuple(int(s) for s in np.asarray(step))}: index starting at "
        f"{tuple(int(s) for s in np.asarray(starts))} with sizes {sizes} does not fit in the "
        f"Ref's shape {shape}. Fix: keep pl.ds(start, size) within the block, or use "
        "pl.load/pl.store with a mask for partial accesses."
    )
