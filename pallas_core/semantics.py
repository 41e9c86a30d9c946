"""Reference semantics: what each primitive means, as plain JAX, for the interpreter.

Every primitive a kernel may contain has one of two kinds of rule here (or in the plugin that
defines it, returned from the ``pallas_primitives`` hook):

* ``discharge`` for primitives that touch Refs: a state-discharge rule
  ``(in_avals, out_avals, *args, **params) -> (new_ref_values_or_None, outputs)``;
* ``evaluate`` for primitives whose meaning depends on where in the grid the kernel runs
  (``program_id``): ``(ctx: ReferenceContext, *args, **params) -> output(s)``.

The interpreter applies the discharge rules first, then evaluates the pure kernel with the
evaluate rules. It never imports the plugin that defined a primitive.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pallas_core import _jax, extras
from pallas_core import primitives as prims
from pallas_core.errors import PallasError, UnsupportedError, reported


@dataclasses.dataclass(frozen=True)
class ReferenceContext:
    """Where in the grid the interpreter is, while it evaluates one kernel step."""

    program_ids: tuple[Any, ...]
    """Traced int32 scalars, one per axis of the full grid (batch axes first)."""
    grid: tuple[int, ...]
    """The size of each axis of the full grid (a traced int32 scalar for a dynamic axis)."""
    num_batch_axes: int = 0
    grid_names: tuple[str, ...] | None = None
    checked: bool = False
    """The interpreter's checked mode is on: rules should poison and report, not guess."""
    own_pace: tuple[str, ...] = ()
    """The mesh axes whose points run each at its own pace, sharing memory and waiting for
    each other's arrivals (a GPU block's warpgroups); empty where points run one after
    another."""

    def program_id(self, axis: int) -> Any:
        """The step index along user grid axis ``axis``."""
        return self.program_ids[self.num_batch_axes + axis]


@dataclasses.dataclass(frozen=True)
class PrimitiveSemantics:
    """A primitive and its reference semantics (give one of ``discharge``, ``evaluate`` or
    ``barrier``)."""

    primitive: _jax.Primitive
    discharge: Callable[..., Any] | None = None
    evaluate: Callable[..., Any] | None = None
    barrier: Callable[..., tuple[str, ...] | None] | None = None
    """For a barrier: given the equation's params, the names of the mesh axes whose points wait
    for each other there (``None``: every axis of the kernel's grid). Interpreters run those
    points in lockstep, phase by phase, instead of one after another."""
    phase_wait: bool = False
    """A wait for the next phase of an arrival counter (a GPU mbarrier), with ``discharge``
    (its meaning where one point runs alone): operand 0 is the counter Ref (int32), the
    ``tree`` param's transforms (operands 1, ...) select one counter of it, and
    ``num_arrivals`` of the Ref's memory space (1 if it has none) arrivals complete a phase.
    Each point waits for the phase after the last one it waited for on that counter. In a
    kernel whose points share memory along mesh axes (``pl.run_scoped(collective_axes=...)``),
    interpreters run those points each at its own pace, a wait holding its point until other
    points' arrivals complete the phase. With the param ``test=True`` it is a test instead (GPU
    ``mbarrier.test_wait``): one bool result, whether the wait would return now; it counts as
    the wait when it would, and never blocks."""
    fork: Callable[..., tuple[Any, int, bool]] | None = None
    """For a marker (with ``evaluate``, its meaning where the marked region cannot run) where a
    point splits into sub-points and joins again (a GPU warpgroup into its warps, ``pl.core_map``
    over ``plgpu.WarpMesh``): given the equation's params, ``(axis name, number of sub-points,
    begins)``. The equations between a marker that begins a region and the next that does not,
    in the same jaxpr, run once per sub-point, ``lax.axis_index(axis name)`` telling which;
    interpreters that run points each at its own pace run the sub-points so too."""

    claim: bool = False
    """Decodes a claim of another block's grid point (GPU cluster launch control:
    ``plgpu.query_cluster_cancel``), with ``discharge`` (its meaning where every block runs on
    its own: no claim succeeds). Params ``grid_names``; results: one int32 index per name, then
    whether a point was claimed. Interpreters that run blocks one after another may instead let
    the first block claim every other point of those axes in order, the others then never
    running (cancelled before their launch)."""

    cluster: Callable[..., tuple[str, ...]] | None = None
    """For a primitive whose meaning may reach across the blocks of a cluster (GPU thread
    blocks that see each other's shared memory), with ``discharge`` (its meaning where each
    block runs alone, or a refusal) and ``cross``: given the equation's input avals and
    params, the mesh axes along which this equation reaches other blocks' buffers in memory
    spaces marked ``shared`` (empty: it does not). The mesh axes after the last of them are
    the points within a block (a GPU block's warpgroups). Interpreters that run points each
    at its own pace run the blocks along those axes together, with one buffer of each
    ``shared`` memory space per block, and evaluate the equation with ``cross``. A counter of
    a ``phase_wait`` whose memory space names ``collective_axes`` completes a phase after
    ``num_arrivals`` times the number of blocks along them."""
    cross: Callable[..., Any] | None = None
    """With ``cluster``: the equation's meaning across the blocks, called as a discharge rule
    is, ``(in_avals, out_avals, *args, stacked, marks, block, **params) -> (new args, new
    marks, outputs)``, where ``stacked[i]`` says that Ref ``args[i]`` holds every block's
    buffer (leading axis: the blocks, in row-major order along the ``cluster`` axes),
    ``marks[i]`` (for those) is an int32 buffer of the same shape the interpreter keeps for
    the rule alone (zero when the cluster starts: e.g. how many copies each block issued on
    a barrier), and ``block`` is the issuing block's position."""

    def __post_init__(self) -> None:
        if (self.cluster is None) != (self.cross is None) or (
                self.cluster is not None and self.discharge is None):
            raise PallasError(
                f"PrimitiveSemantics for {self.primitive.name!r}: give `cluster` and `cross` "
                "together, with `discharge` (the meaning where each block runs alone).")
        given = [r for r in (self.discharge, self.evaluate, self.barrier) if r is not None]
        if len(given) != 1:
            raise PallasError(
                f"PrimitiveSemantics for {self.primitive.name!r} needs exactly one of "
                "`discharge` (primitives that touch Refs), `barrier` (primitives that make the "
                "points of a mesh wait for each other) or `evaluate` (the others)."
            )
        if self.phase_wait and self.discharge is None:
            raise PallasError(
                f"PrimitiveSemantics for {self.primitive.name!r}: a `phase_wait` needs "
                "`discharge` (its meaning where one point runs alone).")


# --- evaluate rules ---------------------------------------------------------------------


def _program_id(ctx: ReferenceContext, *, axis: int) -> Any:
    return ctx.program_id(axis)


def _num_programs(ctx: ReferenceContext, *, axis: int) -> Any:
    return jnp.asarray(ctx.grid[ctx.num_batch_axes + axis], jnp.int32)


def _axis_index(ctx: ReferenceContext, *, axis_name: Any) -> Any:
    names = ctx.grid_names or ()
    name = axis_name[0] if isinstance(axis_name, tuple) and len(axis_name) == 1 else axis_name
    if name in names:
        return ctx.program_id(names.index(name))
    devices = tuple(n for n, _ in _DEVICE_AXES.get())
    if name in devices:  # the device's position under shard_map, not a core of the kernel
        return lax.axis_index(name)
    raise PallasError(
        f"jax.lax.axis_index({name!r}) inside a kernel, but the kernel's mesh axes are {names}"
        f" and the shard_map axes around it are {devices}. Fix: use one of those axis names."
    )


def _debug_print(ctx: ReferenceContext, *args: Any, fmt: str) -> list[Any]:
    jax.debug.print(fmt, *args, ordered=False)
    return []


def _debug_check(ctx: ReferenceContext, cond: Any, *, message: str) -> list[Any]:
    jax.debug.callback(functools.partial(extras.report_failed_check, message=message), cond)
    return []


def _reciprocal(ctx: ReferenceContext, x: Any, *, approx: bool, full_range: bool) -> Any:
    return jnp.asarray(1, x.dtype) / x  # exact: within any approximation's error


# --- discharge rules --------------------------------------------------------------------


def _pad_for_slices(x: Any, idx: Any, fill: Any = 0) -> tuple[Any, Any]:
    """Pads ``x`` so that the slices of the indexer ``idx`` starting inside it never get
    clamped by ``dynamic_slice``.

    Masked accesses may run past the end of a Ref (masked-off lanes), which ``dynamic_slice``
    would silently shift back inside; padding keeps every lane where the user put it.
    """
    pads = []
    for s in idx.indices:
        size = getattr(s, "size", None)
        pads.append(size * s.stride if isinstance(s, _jax.Slice) and isinstance(size, int) else 0)
    if not any(pads):
        return x, idx
    xp = lax.pad(x, jnp.asarray(fill, x.dtype), [(0, p, 0) for p in pads])
    return xp, _jax.NDIndexer(idx.indices, tuple(xp.shape), idx.int_indexer_shape)


def _unpad(xp: Any, shape: tuple[int, ...]) -> Any:
    if tuple(xp.shape) == tuple(shape):
        return xp
    return lax.slice(xp, (0,) * len(shape), shape)


def _split_last(transforms: Sequence[Any]) -> tuple[list[Any], Any]:
    """``(view transforms, last indexer)``: the access reads through the view (``x.at[0]``)
    and then indexes with the last indexer, the one whose slices may run past the end."""
    if transforms and isinstance(transforms[-1], _jax.NDIndexer):
        return list(transforms[:-1]), transforms[-1]
    return list(transforms), None


def read_modify_write(x: Any, flat: Sequence[Any], tree: Any,
                      update: Callable[[Any], Any]) -> tuple[Any, Any]:
    """``(old, new_x)``: the view of ``x`` that the Ref transforms ``flat`` (flattened by
    ``tree``) select, and ``x`` with that view replaced by ``update(old)``. The view may
    start with reshapes (``ref.reshape(...).at[...]``), not reshape after indexing."""
    y, transforms = _jax.apply_leading_reshapes(x, jax.tree_util.tree_unflatten(tree, flat))
    if any(isinstance(t, _jax.ReshapeTransform) for t in transforms):
        raise PallasError("the interpreter reads and writes views that reshape the Ref before "
                          "indexing it (ref.reshape(...).at[...]), not after. Fix: reshape "
                          "first.")
    head, last = _split_last(transforms)
    view = _jax.transform_array(y, head) if head else y
    if last is None:
        old, new_view = view, update(view)
    else:
        vp, idx = _pad_for_slices(view, last)
        old = _jax.transform_array(vp, [idx])
        _, new_vp = _jax.transform_swap_array(vp, [idx], update(old))
        new_view = _unpad(new_vp, view.shape)
    new_y = _jax.transform_swap_array(y, head, new_view)[1] if head else new_view
    return old, new_y if y is x else new_y.reshape(x.shape)


def _gathers(transforms: Sequence[Any]) -> bool:
    """Whether the Ref transforms index with integer arrays, so that two lanes of the view may
    name the same element of the Ref."""
    return any(isinstance(t, _jax.NDIndexer) and tuple(t.int_indexer_shape)
               for t in transforms)


def _lane_positions(x: Any, flat: Sequence[Any], tree: Any) -> Any:
    """For each lane of the view the Ref transforms select, the flat position in ``x`` of the
    element it names (-1 for a lane past the end of ``x``)."""
    iota = jnp.arange(x.size, dtype=jnp.int32).reshape(x.shape)
    y, transforms = _jax.apply_leading_reshapes(iota, jax.tree_util.tree_unflatten(tree, flat))
    head, last = _split_last(transforms)
    view = _jax.transform_array(y, head) if head else y
    if last is not None:
        vp, idx = _pad_for_slices(view, last, fill=-1)
        view = _jax.transform_array(vp, [idx])
    return view


def lanewise_read_modify_write(x: Any, flat: Sequence[Any], tree: Any,
                               update: Callable[[Any, Any], Any],
                               positions: Any = None) -> tuple[Any, Any]:
    """:func:`read_modify_write` for a view whose lanes may name the same element (integer
    array indices): the lanes update ``x`` one at a time, in row-major order, each seeing the
    updates of the lanes before it, as a sequence of atomic operations does. ``update(old,
    lane)`` gives lane ``lane``'s (flat index) new value from the element's current one; the
    first result holds each lane's current value before its own update. ``positions``:
    :func:`_lane_positions` of the view, where the caller has them already."""
    if positions is None:
        positions = _lane_positions(x, flat, tree)
    pos = positions.reshape(-1)
    zero = jnp.zeros((), x.dtype)

    def body(i: Any, carry: tuple[Any, Any]) -> tuple[Any, Any]:
        xf, olds = carry
        p = pos[i]
        inside = p >= 0
        q = jnp.where(inside, p, 0)
        current = jnp.where(inside, xf[q], zero)
        xf = xf.at[q].set(jnp.where(inside, update(current, i), xf[q]))
        return xf, olds.at[i].set(current)

    xf, olds = lax.fori_loop(0, pos.size, body, (x.reshape(-1), jnp.zeros(pos.shape, x.dtype)))
    return olds.reshape(positions.shape), xf.reshape(x.shape)


def _atomic_update(x: Any, flat: Sequence[Any], tree: Any, lane_values: Sequence[Any],
                   update: Callable[..., Any]) -> tuple[Any, Any]:
    """``(old, new_x)`` of an atomic operation whose new element is ``update(old, *values)``,
    ``values`` the operands in ``lane_values`` at the lane (each of the view's shape or
    broadcastable to it): all lanes at once where they name distinct elements, lane by lane
    where integer array indices may repeat an element."""
    transforms = jax.tree_util.tree_unflatten(tree, flat)
    if not _gathers(transforms):
        return read_modify_write(x, flat, tree, lambda old: update(old, *lane_values))
    positions = _lane_positions(x, flat, tree)
    lanes = [jnp.broadcast_to(v, positions.shape).reshape(-1) for v in lane_values]
    return lanewise_read_modify_write(
        x, flat, tree, lambda old, i: update(old, *(v[i] for v in lanes)), positions)


def _masked_load_discharge(in_avals: Any, out_avals: Any, x: Any, *args: Any, tree: Any,
                           has_other: bool) -> Any:
    n = tree.num_leaves
    flat, mask = args[:n], args[n]
    head, last = _split_last(jax.tree_util.tree_unflatten(tree, flat))
    view = _jax.transform_array(x, head) if head else x
    if last is not None:
        vp, idx = _pad_for_slices(view, last)
        view = _jax.transform_array(vp, [idx])
    val = view
    if has_other:
        val = jnp.where(mask, val, args[n + 1])
    return (None,) * (len(args) + 1), val


def _masked_swap_discharge(in_avals: Any, out_avals: Any, x: Any, val: Any, *args: Any,
                           tree: Any) -> Any:
    n = tree.num_leaves
    flat, mask = args[:n], args[n]
    old, new_x = read_modify_write(x, flat, tree, lambda old: jnp.where(mask, val, old))
    return (new_x, None) + (None,) * len(args), old


_COMBINE: dict[prims.AtomicOp, Callable[[Any, Any], Any]] = {
    prims.AtomicOp.ADD: jnp.add,
    prims.AtomicOp.MAX: jnp.maximum,
    prims.AtomicOp.MIN: jnp.minimum,
    prims.AtomicOp.AND: jnp.bitwise_and,
    prims.AtomicOp.OR: jnp.bitwise_or,
    prims.AtomicOp.XOR: jnp.bitwise_xor,
    prims.AtomicOp.XCHG: lambda old, val: val,
}


def _atomic_rmw_discharge(in_avals: Any, out_avals: Any, x: Any, val: Any, *args: Any,
                          tree: Any, op: prims.AtomicOp, has_mask: bool) -> Any:
    n = tree.num_leaves
    flat = args[:n]
    combine = _COMBINE[op]
    if has_mask:
        old, new_x = _atomic_update(
            x, flat, tree, [val, args[n]],
            lambda old, v, m: jnp.where(m, combine(old, v), old))
    else:
        old, new_x = _atomic_update(x, flat, tree, [val], combine)
    return (new_x, None) + (None,) * len(args), old


def _atomic_cas_discharge(in_avals: Any, out_avals: Any, x: Any, cmp: Any, val: Any,
                          *flat: Any, tree: Any) -> Any:
    old, new_x = _atomic_update(x, flat, tree, [cmp, val],
                                lambda old, c, v: jnp.where(old == c, v, old))
    return (new_x, None, None) + (None,) * len(flat), old


# --- devices under shard_map ---------------------------------------------------------------

_DEVICE_AXES: contextvars.ContextVar[tuple[tuple[str, int], ...]] = contextvars.ContextVar(
    "pallas_reference_device_axes", default=())


@contextlib.contextmanager
def device_axes(axes: tuple[tuple[str, int], ...]) -> Iterator[None]:
    """Within the block, cross-device primitives exchange data over these mesh axes."""
    token = _DEVICE_AXES.set(tuple(axes))
    try:
        yield
    finally:
        _DEVICE_AXES.reset(token)


def _require_devices(what: str) -> tuple[tuple[str, int], ...]:
    axes = _DEVICE_AXES.get()
    if not axes:
        raise UnsupportedError(
            f"{what} addresses another device, but the kernel does not run under shard_map, "
            "so there is no other device. Fix: call the kernel inside jax.shard_map over the "
            "devices it exchanges data with.")
    return axes


def devices(what: str) -> tuple[tuple[str, int], ...]:
    """``(name, size)`` of the ``shard_map`` mesh axes cross-device primitives exchange data
    over (row-major); an ``UnsupportedError`` naming ``what`` outside ``shard_map``."""
    return _require_devices(what)


def my_device_index() -> Any:
    """This device's logical index (row-major over the ``shard_map`` mesh axes)."""
    axes = _require_devices("a cross-device primitive")
    index = jnp.int32(0)
    for name, size in axes:
        index = index * size + lax.axis_index(name)
    return index


def device_index(device_id: Sequence[Any], mesh_coordinates: bool) -> Any:
    """The logical index of the device ``device_id`` names.

    With ``mesh_coordinates`` the ids are coordinates along the ``shard_map`` mesh axes (one id
    for a one-axis mesh); otherwise ``device_id`` is already a logical index.
    """
    axes = _require_devices("device_id")
    if not mesh_coordinates:
        return jnp.asarray(device_id[0], jnp.int32)
    if len(device_id) != len(axes):
        raise PallasError(
            f"device_id {tuple(device_id)} has {len(device_id)} coordinates but the kernel runs "
            f"over the mesh axes {tuple(n for n, _ in axes)}. Fix: give one coordinate per "
            "axis, or use DeviceIdType.LOGICAL with a single index.")
    index = jnp.int32(0)
    for (_, size), coord in zip(axes, device_id):
        index = index * size + jnp.asarray(coord, jnp.int32)
    return index


def gather_devices(tree: Any) -> Any:
    """Each leaf of ``tree`` as every device holds it, stacked along a new leading axis in the
    order of the devices' logical indices (a collective: every device must reach it)."""
    axes = _require_devices("a cross-device primitive")
    names = tuple(n for n, _ in axes)
    return jax.tree_util.tree_map(
        lambda x: lax.all_gather(x, names, tiled=False).reshape((-1, *jnp.shape(x))), tree)


def receive(payload: Any, target: Any, state: Any, deliver: Callable[[Any, Any], Any]) -> Any:
    """Point-to-point delivery between the devices of a ``shard_map``.

    Every device sends ``payload`` (a pytree) to the device whose logical index is ``target``.
    This device applies ``deliver(state, payload)`` for each payload sent to it, in the order
    of the senders' indices, and returns the final ``state``. What a payload addresses on the
    receiver (a destination slice, a semaphore) is the sender's to say, so it travels with it.
    """
    payloads = gather_devices(payload)
    targets = gather_devices(jnp.asarray(target, jnp.int32))
    me = my_device_index()

    def one(sender: Any, state: Any) -> Any:
        sent = jax.tree_util.tree_map(lambda x: x[sender], payloads)
        return lax.cond(targets[sender] == me, lambda st: deliver(st, sent), lambda st: st,
                        state)

    return lax.fori_loop(0, targets.shape[0], one, state)


def _semaphore_signal_discharge(in_avals: Any, out_avals: Any, sem: Any, *args: Any, tree: Any,
                                has_device_id: bool, device_id_type: Any,
                                has_core_index: bool = False) -> Any:
    # A kernel that signals another core's semaphore (core_index) runs in
    # pallas_interpret.handshake, which applies the signal itself; elsewhere there is one core.
    n = tree.num_leaves
    flat, inc = list(args[:n]), args[n]
    if not has_device_id:
        _, new = read_modify_write(sem, flat, tree, lambda old: old + inc)
        return (new,) + (None,) * len(args), []
    ids = args[n + 1:len(args) - int(has_core_index)]
    target = device_index(ids, device_id_type.value == "mesh")

    def deliver(value: Any, sent: tuple[Any, list[Any]]) -> Any:
        sent_inc, sent_flat = sent  # the sender's increment, and its view of the semaphore
        return read_modify_write(value, sent_flat, tree, lambda old: old + sent_inc)[1]

    new = receive((inc, flat), target, sem, deliver)
    return (new,) + (None,) * len(args), []


def _semaphore_wait_discharge(in_avals: Any, out_avals: Any, sem: Any, *args: Any, tree: Any,
                              decrement: bool) -> Any:
    n = tree.num_leaves
    flat, value = args[:n], args[n]
    old = _jax.transform_array(sem, jax.tree_util.tree_unflatten(tree, flat))
    check_wait(old, value, "pl.semaphore_wait")
    if not decrement:
        return (None,) * (len(args) + 1), []
    _, new = read_modify_write(sem, flat, tree, lambda cur: cur - value)
    return (new,) + (None,) * len(args), []


def check_wait(count: Any, value: Any, what: str) -> None:
    """In checked mode, reports a wait for ``value`` on a semaphore at ``count`` that can never
    finish: steps run one at a time here, so no later step can signal it first. (Kernels whose
    cores signal one another run each core at its own pace; the interpreter checks their waits
    itself.)"""
    if _CHECKED.get():
        jax.debug.callback(functools.partial(_report_deadlock, what=what), count, value)


@reported
def _report_deadlock(count: Any, value: Any, *, what: str) -> None:
    if int(count) >= int(value):
        return
    raise PallasError(
        f"deadlock: {what} waits for {int(value)} on a semaphore at {int(count)}, and "
        "no step still to run can signal it. Fix: signal the semaphore (or start the copy "
        "that signals it) before waiting on it.")


def _semaphore_read_discharge(in_avals: Any, out_avals: Any, sem: Any, *flat: Any,
                              tree: Any) -> Any:
    value = _jax.transform_array(sem, jax.tree_util.tree_unflatten(tree, flat))
    return (None,) * (len(flat) + 1), value


_UNINITIALIZED_MEMORY: contextvars.ContextVar[str] = contextvars.ContextVar(
    "pallas_uninitialized_memory", default="nan")


@contextlib.contextmanager
def uninitialized_memory(mode: str) -> Iterator[None]:
    """Within the block, memory nobody has written reads as ``"nan"`` (NaN for floats, the
    minimum for integers, False for bools: what JAX's interpret mode fills in), ``"nan_max"``
    (NaN, the maximum for integers, True for bools: what JAX's TPU interpret mode fills in) or
    ``"zero"``."""
    token = _UNINITIALIZED_MEMORY.set(mode)
    try:
        yield
    finally:
        _UNINITIALIZED_MEMORY.reset(token)


def uninitialized(shape: Sequence[int], dtype: Any, checked: bool = False) -> Any:
    """The contents of memory nobody has written (edge-block padding, outputs before their
    first write, scratch), as :func:`uninitialized_memory` says; poison (as ``"nan"`` says)
    whatever it says when ``checked`` (callers pass it to force poison)."""
    dtype = jnp.dtype(dtype)
    mode = _UNINITIALIZED_MEMORY.get()
    if mode == "zero" and not checked:
        return jnp.zeros(tuple(shape), dtype)
    high = mode == "nan_max"
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.full(tuple(shape), jnp.nan, dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return jnp.full(tuple(shape), info.max if high else info.min, dtype)
    if dtype == jnp.bool_:
        return jnp.full(tuple(shape), high, dtype)
    return jnp.zeros(tuple(shape), dtype)


def fresh_buffer(shape: Sequence[int], dtype: Any, memory_space: Any, checked: bool = False
                 ) -> Any:
    """A newly allocated buffer in ``memory_space``: zeros where the space says so
    (semaphores), else :func:`uninitialized`, poisoned also while ``pl.enable_poison_buffers``
    is on (when the kernel is lowered)."""
    checked = checked or bool(extras.enable_poison_buffers.value)
    if getattr(memory_space, "zeroed", False):
        return jnp.zeros(tuple(shape), dtype)
    return uninitialized(shape, dtype, checked)


_CHECKED = contextvars.ContextVar("pallas_reference_checked", default=False)


@contextlib.contextmanager
def checked_discharge() -> Iterator[None]:
    """Within the block, discharge rules apply checked-mode semantics: ``run_scoped`` buffers
    start poisoned, and semaphore waits that would block forever are reported."""
    token = _CHECKED.set(True)
    try:
        yield
    finally:
        _CHECKED.reset(token)


def _run_scoped_discharge(in_avals: Any, out_avals: Any, *args: Any, jaxpr: Any,
                          scoped: tuple[Any, ...], collective_axes: tuple[Any, ...] = ()
                          ) -> Any:
    # A collective allocation (shared by the instances along mesh axes, which the
    # interpreter runs one after another) is fresh per instance here, as a plain one.
    discharged = _jax.discharge_state(jaxpr)
    # Checked mode poisons them, unless the interpreter was told to fill memory with zeros.
    poison = _CHECKED.get() and _UNINITIALIZED_MEMORY.get() != "zero"
    fresh = [fresh_buffer(t.shape, t.dtype, t.memory_space, poison) for t in scoped]
    res = _jax.eval_jaxpr(discharged.jaxpr, discharged.consts, *args, *fresh)
    n_out = len(out_avals)
    outs, finals = res[:n_out], iter(res[n_out:])
    new_args = [next(finals) if isinstance(a, _jax.AbstractRef) else None for a in in_avals]
    return new_args, outs


def _get_global_discharge(in_avals: Any, out_avals: Any, *, what: Any) -> Any:
    raise UnsupportedError(
        "pl.get_global (a Ref every block of the kernel shares) is not supported by the "
        "interpreter: it runs a kernel's blocks one after another, so blocks that wait for "
        "each other's signals on a shared semaphore would wait for signals not yet sent. "
        "Fix: lower the kernel for its hardware, or give each block its own semaphores "
        "(scratch_shapes).")


CORE_SEMANTICS: tuple[PrimitiveSemantics, ...] = (
    PrimitiveSemantics(prims.program_id_p, evaluate=_program_id),
    PrimitiveSemantics(prims.num_programs_p, evaluate=_num_programs),
    PrimitiveSemantics(_jax.axis_index_p, evaluate=_axis_index),
    PrimitiveSemantics(prims.multiple_of_p, evaluate=lambda ctx, x, *, values: x),
    PrimitiveSemantics(prims.debug_print_p, evaluate=_debug_print),
    PrimitiveSemantics(extras.debug_check_p, evaluate=_debug_check),
    PrimitiveSemantics(extras.delay_p, evaluate=lambda ctx, nanos: []),
    PrimitiveSemantics(extras.reciprocal_p, evaluate=_reciprocal),
    PrimitiveSemantics(prims.masked_load_p, discharge=_masked_load_discharge),
    PrimitiveSemantics(prims.masked_swap_p, discharge=_masked_swap_discharge),
    PrimitiveSemantics(prims.atomic_rmw_p, discharge=_atomic_rmw_discharge),
    PrimitiveSemantics(prims.atomic_cas_p, discharge=_atomic_cas_discharge),
    PrimitiveSemantics(prims.run_scoped_p, discharge=_run_scoped_discharge),
    PrimitiveSemantics(prims.semaphore_signal_p, discharge=_semaphore_signal_discharge),
    PrimitiveSemantics(prims.semaphore_wait_p, discharge=_semaphore_wait_discharge),
    PrimitiveSemantics(prims.semaphore_read_p, discharge=_semaphore_read_discharge),
    PrimitiveSemantics(prims.get_global_p, discharge=_get_global_discharge),
    # jax.experimental.layout.explicit_layout: a layout changes no value (JAX 0.11 on).
    *((PrimitiveSemantics(_jax.relayout_p, evaluate=lambda ctx, x, *, dst_layout: x),)
      if _jax.relayout_p is not None else ()),
)
"""Reference semantics of the core's own primitives (the core registers them like a plugin)."""
