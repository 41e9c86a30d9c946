"""The interpreter's checked mode: races between parallel grid steps, accesses outside Refs,
and (with ``tpu_memory``) the uses of memory a TPU does not allow.

* Races are found ahead of time from the index maps: two grid steps that differ along a
  parallel axis and write the same output block may run at the same time on the hardware.
* Revisits (``tpu_memory``) too: a step that returns to an output block its core has left.
* Reads and writes of Refs (``x_ref[...]``, ``pl.load``/``pl.store``, the copies that
  ``pltpu.sync_copy``/``async_copy`` make) are checked while the kernel runs: their discharge
  rules are replaced by ones that place each element (:mod:`pallas_interpret.access`), read
  uninitialized memory or drop writes outside the Ref, and report on the host an access outside
  the Ref's limit (a read only with ``out_of_bounds_reads="raise"``).
* Direct reads and writes of HBM Refs, and HBM buffers from ``pl.run_scoped``, are refused
  while the kernel is traced (``tpu_memory``).

Poisoning of uninitialised memory is done where buffers are created (``grid.run_exact``).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

from pallas_core import BoundedSlice, Element, OutOfBoundsError
from pallas_core import backend as plb
from pallas_core.backend import KernelCall, PallasError, block_dim_size, reported
from pallas_interpret import access
from pallas_interpret.params import InterpretParams


class RaceError(PallasError):
    """Two grid steps that may run in parallel write the same output block."""


class RaceWarning(UserWarning):
    """A race found with ``InterpretParams(on_race="warn")``."""


class RevisitError(PallasError, RuntimeError):
    """A core returns to an output block after leaving it (TPU memory model)."""


class HbmAccessError(PallasError, ValueError):
    """A kernel reads or writes an HBM Ref directly, or allocates HBM in ``pl.run_scoped``
    (TPU memory model)."""


def check_races(call: KernelCall, parallel: Sequence[int], cores: np.ndarray | None = None,
                warn: bool = False) -> None:
    """Raises ``RaceError`` (``warn``: warns with a ``RaceWarning``, once per output) if steps
    differing along a ``parallel`` axis share an output block; given ``cores`` (the simulated
    core of each grid step, in lexicographic order), if steps on different cores share one
    instead (steps of one core never run at the same time).

    Whole-array outputs (memory space ``ANY``) are not checked here: each step sees the whole
    array, and whether two steps write the same elements depends on the kernel.
    """
    gm = call.grid_mapping
    if not parallel:
        return
    tables = plb.block_index_tables(gm)
    if tables is None:
        return
    points, per_operand = tables
    par = list(parallel)
    for bm, table in zip(gm.outputs, per_operand[gm.num_inputs:]):
        if bm.is_whole_array:
            continue
        race = _first_race(table, points, par, cores, gm.num_batch_axes)
        if race is not None:
            error = _race_error(call, bm, points, *race)
            if not warn:
                raise error
            warnings.warn(str(error), RaceWarning, stacklevel=2)


def _first_race(table: np.ndarray, points: np.ndarray, par: list[int], cores: Any,
                num_batch_axes: int) -> tuple[Any, ...] | None:
    first: dict[tuple[int, ...], int] = {}
    for step, block in enumerate(map(tuple, table.tolist())):
        other = first.setdefault(block, step)
        if other == step:
            continue
        if cores is not None and cores[other] != cores[step]:
            why = f"run on cores {int(cores[other])} and {int(cores[step])}"
            return block, other, step, why, None
        if cores is None and (points[other, par] != points[step, par]).any():
            axis = par[int(np.argmax(points[other, par] != points[step, par]))] - num_batch_axes
            return block, other, step, f"differ along parallel grid axis {axis}", axis
    return None


def _race_error(call: KernelCall, bm: Any, points: np.ndarray, block: tuple[int, ...],
                other: int, step: int, why: str, axis: int | None) -> RaceError:
    along = "the parallel axes" if axis is None else f"axis {axis}"
    return RaceError(
        f"data race in kernel {call.name!r}: {bm.origin} block {block} is written at grid "
        f"steps {tuple(points[other].tolist())} and {tuple(points[step].tolist())}, which "
        f"{why} and may run at the same time. Fix: give each step along {along} its own output "
        "block (make the index map depend on it), or make the axis sequential (e.g. "
        "'arbitrary' dimension semantics on TPU; on GPUs, loop inside the kernel instead).")


def check_block_indices(call: KernelCall, params: InterpretParams, ids: Sequence[Any],
                        windows: Sequence[Any]) -> Any | None:
    """A token of a host check that the blocks the index maps chose at grid point ``ids``
    (``windows``: one ``blocks.Window`` per input, then per output) lie inside their arrays,
    raising ``OutOfBoundsError`` on the first that does not; ``None`` when there is nothing
    left to check: the index maps were checked on every grid point ahead of time (when they
    read no scalar-prefetch operand and the grid is static and not huge). Input blocks are
    not checked with ``out_of_bounds_reads="uninitialized"``."""
    found = _block_checks(call, params, windows)
    if found is None:
        return None
    which, bad, values = found
    report = functools.partial(_report_block, call=call, which=which)
    point = _point(call, ids)
    return io_callback(report, jax.ShapeDtypeStruct((), jnp.int32), bad, values, point)


def check_all_block_indices(call: KernelCall, params: InterpretParams, num_steps: int,
                            windows_at: Callable[[Any], tuple[Sequence[Any], Sequence[Any]]]
                            ) -> Any | None:
    """Outside checked mode, once per call: the blocks of every grid step lie inside their
    arrays, for index maps not checked ahead of time (those that read scalar-prefetch
    operands, or grids too large). ``windows_at(k)`` is step ``k``'s ``(grid point, windows)``.
    One host check over all steps (the index maps evaluated for every step at once) raises
    ``OutOfBoundsError`` naming the first step that leaves its array, where the hardware
    would read or write outside it; a token to order the kernel after it, or ``None``."""
    gm = call.grid_mapping
    first_step = None if gm.dynamic_axes or num_steps < 1 else _block_checks(
        call, params, windows_at(jnp.int32(0))[1])
    if first_step is None:
        return None
    which = first_step[0]

    def at(k: Any) -> tuple[Any, Any, Any]:
        ids, windows = windows_at(k)
        found = _block_checks(call, params, windows)
        assert found is not None
        return found[1], found[2], _point(call, ids)

    bad, values, points = jax.vmap(at)(jnp.arange(num_steps, dtype=jnp.int32))
    first = jnp.argmax(bad.any(axis=1))
    report = functools.partial(_report_block, call=call, which=which)
    return io_callback(report, jax.ShapeDtypeStruct((), jnp.int32), bad[first],
                       [v[first] for v in values], points[first])


def _block_checks(call: KernelCall, params: InterpretParams, windows: Sequence[Any]
                  ) -> tuple[tuple[int, ...], Any, list[Any]] | None:
    """``(operands checked, whether each block leaves its array, their index-map values)``
    for one step's ``windows``; ``None`` when nothing is left to check at run time."""
    gm = call.grid_mapping
    if plb.block_index_tables(gm) is not None:
        return None
    lenient = params.out_of_bounds_reads == "uninitialized"
    which, bad, values = [], [], []
    for k, (bm, w) in enumerate(zip(gm.block_mappings, windows)):
        if bm.is_whole_array or not bm.array_shape or (lenient and k < gm.num_inputs):
            continue
        vals = [jnp.asarray(v, jnp.int32) for v in w.indices]
        which.append(k)
        bad.append(_outside_array(bm, vals))
        values.append(jnp.stack(vals))
    if not which:
        return None
    return tuple(which), jnp.stack(bad), values


def _point(call: KernelCall, ids: Sequence[Any]) -> Any:
    point = [jnp.asarray(i, jnp.int32) for i in ids[call.grid_mapping.num_batch_axes:]]
    return jnp.stack(point) if point else jnp.zeros(0, jnp.int32)


def _outside_array(bm: Any, vals: Sequence[Any]) -> Any:
    """Whether the index-map values ``vals`` place ``bm``'s block (partly) outside its array
    (a bounded slice's start and size, an element offset into the padded dimension, a block
    index times the block size)."""
    ndim = len(bm.array_shape)
    sizes = iter(vals[ndim:])
    out = jnp.bool_(False)
    for i, dim, n in zip(vals, bm.dims, bm.array_shape):
        if isinstance(dim, Element):
            out |= (i < 0) | (i >= max(n + sum(dim.padding), 1))
        elif isinstance(dim, BoundedSlice):
            size = next(sizes)
            out |= (i < 0) | (size < 0) | (size > dim.block_size) | (i + size > n)
        else:
            out |= (i < 0) | (i * block_dim_size(dim) >= max(n, 1))
    return out


def _index_map_line(bm: Any) -> str:
    """``file:line`` of the user's index map (of its first operation there), if known."""
    for eqn in bm.index_map.jaxpr.eqns:
        line = plb.source_line(eqn)
        if line != "<unknown>" and "pallas_core" not in line:
            return line
    return "<unknown>"


@reported
def _report_block(bad: Any, values: Any, point: Any, *, call: KernelCall,
                  which: tuple[int, ...]) -> Any:
    bad = np.asarray(bad)
    if not bad.any():
        return np.int32(0)
    j = int(np.argmax(bad))
    bm = call.grid_mapping.block_mappings[which[j]]
    found = tuple(int(v) for v in np.asarray(values[j]))
    ndim = len(bm.array_shape)
    index = found[:ndim] + ((f"slice sizes {found[ndim:]}",) if found[ndim:] else ())
    what = "block index" if bm.block_indexed else "index-map value (block index, element offset"
    what += "" if bm.block_indexed else " or bounded slice)"
    n_blocks = tuple(-(-n // b) for n, b in zip(bm.array_shape, bm.full_block_shape))
    raise OutOfBoundsError(
        f"Out-of-bounds {what} {index} for {bm.origin} in kernel {call.name!r} at grid step "
        f"{tuple(int(i) for i in np.asarray(point))}: its index map ({_index_map_line(bm)}) "
        f"places the block of {bm.full_block_shape} outside the array of shape "
        f"{bm.array_shape}" + (" (valid block indices: " + ", ".join(
            f"0..{n - 1}" for n in n_blocks) + ")" if bm.block_indexed else "")
        + ". The hardware would read or write memory outside it (JAX's TPU interpret mode "
        "raises here too). Fix: keep the values the "
        "index map computes (e.g. from scalar-prefetch operands) within the array's blocks, "
        "or clamp them in the index map if that is what you mean.")


def _in_hbm(space: Any) -> bool:
    return str(getattr(space, "name", "")).upper() in ("HBM", "ANY")


def check_revisits(call: KernelCall, order: np.ndarray, cores: np.ndarray) -> None:
    """Raises ``RevisitError`` if a core, visiting the grid points in ``order`` (``cores[k]``
    runs step ``k``), comes back to a block of an output (not in HBM, not aliased) after
    moving to another: a TPU writes the block back when it leaves it and does not read it
    again, so the earlier writes would be lost. Unknown ahead of time (index maps reading
    scalar-prefetch operands, huge grids): not checked."""
    gm = call.grid_mapping
    tables = plb.block_index_tables(gm)
    if tables is None or not len(order):
        return
    lex = np.ravel_multi_index(tuple(order.T), gm.grid) if gm.grid else np.zeros(1, np.int64)
    aliased = {o for _, o in call.input_output_aliases}
    nb = gm.num_batch_axes
    for o, (bm, table) in enumerate(zip(gm.outputs, tables[1][gm.num_inputs:])):
        if o in aliased or _in_hbm(bm.memory_space):
            continue
        blocks = [tuple(b) for b in table[lex].tolist()]
        last: dict[tuple[Any, int], int] = {}
        for k, block in enumerate(blocks):
            core = int(cores[k])
            before = last.get((block, core))
            last[(block, core)] = k
            if before is not None and before != k - 1:
                point = lambda step: tuple(order[step][nb:].tolist())  # noqa: E731
                raise RevisitError(
                    f"Revisited block {block} of output {o} in iteration {point(k)} of kernel "
                    f"{call.name!r} ({bm.origin}, core {core}): the core left the block after "
                    f"iteration {point(before)}. A TPU copies an output block back "
                    "when the grid leaves it and never reads it again, so the earlier writes "
                    "would be overwritten. Fix: make the steps that write one output block "
                    "consecutive (iterate the grid axes the block does not depend on innermost).")


def _ref_names(call: KernelCall) -> dict[int, str]:
    gm = call.grid_mapping
    names = [bm.origin for bm in gm.block_mappings]
    names += [f"scratch {i}" for i in range(len(gm.scratch_avals))]
    return {id(v.aval): n for v, n in zip(call.jaxpr.jaxpr.invars, names)}


def discharge(call: KernelCall, params: InterpretParams | bool) -> Any:
    """The kernel with its Refs discharged; in checked mode with checked accesses."""
    gm = call.grid_mapping
    checked = params if isinstance(params, bool) else params.checked
    if not checked:
        return plb.discharge_state(call.jaxpr, axis_sizes=gm.axis_env)
    fresh = plb.ClosedJaxpr(call.jaxpr.jaxpr, call.jaxpr.consts)  # not the cached discharge
    with checked_rules(call, None if isinstance(params, bool) else params):
        return plb.discharge_state(fresh, axis_sizes=gm.axis_env)


class _Checker:
    """The checked discharge rules of one kernel (see the module docstring)."""

    def __init__(self, call: KernelCall, params: InterpretParams):
        self.call, self.params = call, params
        self.names = _ref_names(call)
        self.n_axes = len(call.grid_mapping.user_grid)
        self.generation = (access.tpu_generation() if params.buffer_bounds == "padded"
                           else None)

    def name(self, aval: Any) -> str:
        return self.names.get(id(aval), f"a Ref of shape {tuple(aval.shape)}")

    def refuse_hbm(self, aval: Any, what: str) -> None:
        space = getattr(aval, "memory_space", None)
        if self.params.tpu_memory and _in_hbm(space):
            raise HbmAccessError(
                f"kernel {self.call.name!r} {what} {self.name(aval)} directly, but it is in "
                f"{str(getattr(space, 'name', '')).upper()}, which TPU cores cannot address. "
                "Fix: copy it to or "
                "from VMEM with pltpu.sync_copy or pltpu.async_copy (or give it a VMEM "
                "BlockSpec).")

    def locate(self, aval: Any, transforms: Any) -> access.Access | None:
        """Where an access lies, or ``None`` when it needs no check (or cannot be placed)."""
        acc = access.locate(transforms, aval.shape)
        if acc is None or access.statically_inside(acc, aval.shape):
            return None
        return acc

    def guard(self, value: Any, acc: access.Access, aval: Any, ref: Any, what: str,
              mask: Any = None, read: bool = False) -> Any:
        """``value``, after a host check that ``acc`` stays within ``aval``'s limit (reads only
        checked with ``out_of_bounds_reads="raise"``). The check waits for ``ref`` (the Ref's
        value before the access), and ``value`` for the check, so that of two bad accesses to
        one Ref the first is reported."""
        if read and self.params.out_of_bounds_reads != "raise":
            return value
        limit = access.limit_shape(aval, self.params.buffer_bounds == "padded", self.generation)
        outside = ~access.inside(acc, limit)
        if mask is not None:
            outside = outside & mask
        outside = lax.optimization_barrier((outside, ref))[0]
        step = [plb.program_id_p.bind(axis=a) for a in range(self.n_axes)]
        starts = jnp.stack([jnp.asarray(s, jnp.int32) for s in acc.starts]) if acc.starts else (
            jnp.zeros(0, jnp.int32))
        padded = tuple(limit) != tuple(aval.shape)
        report = functools.partial(
            _report, kernel=self.call.name, what=what, name=self.name(aval), sizes=acc.sizes,
            shape=tuple(limit), padded=padded, masked=mask is not None)
        token = io_callback(report, jax.ShapeDtypeStruct((), jnp.int32), jnp.any(outside),
                            starts, jnp.stack(step) if step else jnp.zeros(0, jnp.int32))
        return lax.optimization_barrier((value, token))[0]

    def fill(self, dtype: Any) -> Any:
        return plb.uninitialized((), dtype)

    # --- the rules

    def get(self, rule: Any, in_avals: Any, out_avals: Any, x: Any, *flat: Any, tree: Any,
            **params: Any) -> Any:
        aval = in_avals[0]
        self.refuse_hbm(aval, "reads")
        acc = self.locate(aval, jax.tree_util.tree_unflatten(tree, flat))
        if acc is None:
            return rule(in_avals, out_avals, x, *flat, tree=tree, **params)
        value = self.guard(access.read(x, acc, self.fill(x.dtype)), acc, aval, x, "read of",
                           read=True)
        return (None,) * (len(flat) + 1), value

    def swap(self, rule: Any, in_avals: Any, out_avals: Any, x: Any, val: Any, *flat: Any,
             tree: Any, **params: Any) -> Any:
        aval = in_avals[0]
        self.refuse_hbm(aval, "writes")
        acc = self.locate(aval, jax.tree_util.tree_unflatten(tree, flat))
        if acc is None:
            return rule(in_avals, out_avals, x, val, *flat, tree=tree, **params)
        old = access.read(x, acc, self.fill(x.dtype))
        new = self.guard(access.write(x, acc, val), acc, aval, x, "write to")
        return (new, None) + (None,) * len(flat), old

    def masked_load(self, rule: Any, in_avals: Any, out_avals: Any, x: Any, *args: Any,
                    tree: Any, has_other: bool) -> Any:
        aval = in_avals[0]
        self.refuse_hbm(aval, "loads from")
        n = tree.num_leaves
        acc = self.locate(aval, jax.tree_util.tree_unflatten(tree, args[:n]))
        if acc is None:
            return rule(in_avals, out_avals, x, *args, tree=tree, has_other=has_other)
        mask = args[n]
        value = access.read(x, acc, self.fill(x.dtype))
        if has_other:
            value = jnp.where(mask, value, args[n + 1])
        value = self.guard(value, acc, aval, x, "masked read of", mask, read=True)
        return (None,) * (len(args) + 1), value

    def masked_swap(self, rule: Any, in_avals: Any, out_avals: Any, x: Any, val: Any,
                    *args: Any, tree: Any) -> Any:
        aval = in_avals[0]
        self.refuse_hbm(aval, "stores to")
        n = tree.num_leaves
        acc = self.locate(aval, jax.tree_util.tree_unflatten(tree, args[:n]))
        if acc is None:
            return rule(in_avals, out_avals, x, val, *args, tree=tree)
        mask = args[n]
        old = access.read(x, acc, self.fill(x.dtype))
        new = self.guard(access.write(x, acc, val, mask), acc, aval, x, "masked swap of",
                         mask)
        return (new, None) + (None,) * len(args), old

    def copy_start(self, rule: Any, in_avals: Any, out_avals: Any, *args: Any, tree: Any,
                   roles: tuple[int, ...], remote: bool, **params: Any) -> Any:
        views = plb.RefViews(args, tree, roles)
        src, dst = roles[0], roles[1]
        src_acc = access.locate(views.transforms[0], in_avals[src].shape)
        dst_acc = access.locate(views.transforms[1], in_avals[dst].shape)
        if remote or params.get("add") or src_acc is None or dst_acc is None or (
                access.statically_inside(src_acc, in_avals[src].shape)
                and access.statically_inside(dst_acc, in_avals[dst].shape)):
            return rule(in_avals, out_avals, *args, tree=tree, roles=roles, remote=remote,
                        **params)
        # A local copy moves its data when it starts (as the core's rule has it), element by
        # element here, each access checked against its Ref's bounds.
        views.write(2, views.read(2) + plb.copy_bytes(views))
        value = access.read(args[src], src_acc, self.fill(args[src].dtype))
        value = self.guard(value, src_acc, in_avals[src], args[src], "read of", read=True)
        new_dst = access.write(args[dst], dst_acc, value)
        views.values[dst] = self.guard(new_dst, dst_acc, in_avals[dst], args[dst], "write to")
        return views.new_values(), []

    def run_scoped(self, rule: Any, in_avals: Any, out_avals: Any, *args: Any,
                   **params: Any) -> Any:
        check_scoped_allocation(self.call, self.params, params["scoped"])
        return rule(in_avals, out_avals, *args, **params)


def check_scoped_allocation(call: KernelCall, params: InterpretParams,
                            scoped: Sequence[Any]) -> None:
    """Raises ``HbmAccessError`` for HBM buffers among a ``pl.run_scoped``'s ``scoped``
    allocations, under the TPU memory model unless the params allow them."""
    if not params.tpu_memory or params.allow_hbm_allocation_in_run_scoped:
        return
    for t in scoped:
        if _in_hbm(getattr(t, "memory_space", None)):
            raise HbmAccessError(
                f"Cannot allocate HBM in `run_scoped` of kernel {call.name!r}: "
                f"it asks for a {str(t.memory_space.name).upper()} buffer of shape "
                f"{tuple(t.shape)}, and TPUs allocate run_scoped buffers only in VMEM, SMEM "
                "and semaphores. Fix: pass the HBM buffer in (or as scratch), or, to try it "
                "in the interpreter anyway, "
                "InterpretParams(allow_hbm_allocation_in_run_scoped=True).")


@reported
def _report(outside: Any, starts: Any, step: Any, *, kernel: str, what: str, name: str,
            sizes: tuple[int, ...], shape: tuple[int, ...], padded: bool, masked: bool) -> Any:
    if not bool(outside):
        return np.int32(0)
    where = "padded shape" if padded else "shape"
    lanes = " (in lanes where the mask is set)" if masked else ""
    raise OutOfBoundsError(
        f"Out-of-bounds {what} {name} in kernel {kernel!r} at grid step "
        f"{tuple(int(s) for s in np.asarray(step))}: index starting at "
        f"{tuple(int(s) for s in np.asarray(starts))} with sizes {sizes} does not fit{lanes} in "
        f"the Ref's {where} {shape}. Fix: keep pl.ds(start, size) within the Ref, or use "
        "pl.load/pl.store with a mask for partial accesses."
    )


@contextlib.contextmanager
def checked_rules(call: KernelCall, params: InterpretParams | None = None) -> Iterator[None]:
    """Within the block, discharging (parts of) ``call``'s kernel applies checked mode: reads
    and writes are checked (see the module docstring), ``run_scoped`` buffers start poisoned."""
    checker = _Checker(call, params or InterpretParams(checked=True))
    methods: dict[Any, Callable[..., Any]] = {
        plb.get_p: checker.get, plb.swap_p: checker.swap,
        plb.masked_load_p: checker.masked_load, plb.masked_swap_p: checker.masked_swap,
        plb.copy_start_p: checker.copy_start, plb.run_scoped_p: checker.run_scoped}

    def wrap(prim: Any, rule: Any) -> Any:
        return functools.partial(methods[prim], rule)

    with (plb.discharge_rules_wrapped(wrap, list(methods)), plb.checked_discharge()):
        yield
