"""Asynchronous copies between Refs, local or to another device, completed through semaphores.

This is the machinery that backends with DMA engines build on (``pltpu.async_copy``,
``pltpu.make_async_remote_copy`` re-export it): the primitives ``copy_start_p`` and
``copy_wait_p``, the descriptor :class:`AsyncCopy`, and their reference semantics, so that the
interpreter runs such kernels and a backend only lowers the two primitives.

Reference semantics:

* a local copy moves its data when it starts and adds its size in bytes to its semaphore;
  ``wait`` takes back the bytes of the copy it describes, and waits until the semaphore holds
  them. So one wait may stand for several copies of the same total size (JAX 0.12's paged
  attention starts one copy per page and waits once for the whole buffer), as the DMA
  semaphores of the hardware and of JAX's interpreter count bytes. Reading the destination
  before ``wait`` is a race on hardware; here it sees the new contents (JAX's
  ``dma_execution_mode="eager"``);
* a remote copy (``device_id`` given) runs under ``shard_map``: at ``start`` every device sends
  its source to the device it names. The data lands in the destination slice, and its arrival
  is counted on the receive semaphore, that the *sender's* views name (each device may address
  a different slot); copies from several devices to one land in the order of the senders'
  indices. The sender's send semaphore counts the departure. Both count bytes too, and
  ``wait_recv`` and ``wait_send`` take them back (``wait`` does both, as in
  ``jax.experimental.pallas``);
* ``priority`` (a DMA queue) has no meaning here and is accepted;
* a local copy may have one slice of traced length on each side (``pl.ds(start, n)``, ``n``
  known when the kernel runs, as ragged attention copies its pages): it moves ``n`` rows, one
  at a time (a loop), and counts ``n`` rows' bytes (JAX's interpreter refuses such copies; its
  Mosaic lowering takes them, as a memref of dynamic size).
"""

from __future__ import annotations

import copy as copy_module
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from pallas_core import _jax, semantics
from pallas_core import primitives as prims
from pallas_core.errors import PallasError, UnsupportedError
from pallas_core.primitives import DeviceIdType, _ref_and_transforms

copy_start_p = _jax.Primitive("copy_start")
copy_start_p.multiple_results = True
copy_wait_p = _jax.Primitive("copy_wait")
copy_wait_p.multiple_results = True

_SRC, _DST, _SEM, _SEND = 0, 1, 2, 3


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Indices:
    """Index values for a gather or scatter copy (``table.at[Indices(idx_ref)]`` as a copy's
    source or destination; ``values``: an int32 vector or a Ref of one), skipping those equal
    to ``ignored_value`` when it is not ``None``: a gather leaves the destination rows of
    skipped indices as they were, a scatter does not write them (``plsc.Indices``)."""

    values: Any
    ignored_value: int | None = dataclasses.field(default=None, metadata={"static": True})


def _ref_effects(*avals: Any, roles: tuple[int, ...], **_: Any) -> Any:
    n_refs = max(roles) + 1
    return [], {e for i in range(n_refs) for e in (_jax.ReadEffect(i), _jax.WriteEffect(i))}


copy_start_p.def_effectful_abstract_eval(_ref_effects)
copy_wait_p.def_effectful_abstract_eval(_ref_effects)


def _is_ref(i: Any) -> bool:
    if isinstance(i, (_jax.Slice, int, slice)):
        return False
    if hasattr(i, "transforms"):  # a view of a Ref
        return True
    try:
        return isinstance(_jax.typeof(i), _jax.AbstractRef)
    except TypeError:
        return False


def _read_ref_indices(transforms: tuple[Any, ...]) -> tuple[Any, ...]:
    """Indexers whose indices are Refs (``table.at[idx_ref]``) read them: the copy is indexed
    by the Ref's contents when it starts (an indirect, gather or scatter, copy)."""
    out = []
    for t in transforms:
        indices = getattr(t, "indices", None)
        if indices is not None and any(_is_ref(i) or isinstance(i, Indices) for i in indices):
            indices = tuple(_read_index(i) for i in indices)
            t = _jax.NDIndexer(indices, t.shape, t.int_indexer_shape)
        out.append(t)
    return tuple(out)


def _read_index(i: Any) -> Any:
    if isinstance(i, Indices):
        return Indices(_read_index(i.values), i.ignored_value)
    return i[...] if _is_ref(i) else i


def _split(ref_view: Any, fn: str) -> tuple[Any, tuple[Any, ...]]:
    ref, transforms = _ref_and_transforms(ref_view, None, fn)
    return ref, _read_ref_indices(transforms)


def bind_views(prim: Any, views: list[Any], extra: list[Any], fn: str, **params: Any) -> Any:
    """Binds ``prim`` on the distinct Refs behind ``views`` (two views of one Ref, such as two
    semaphores of one array, share an operand); ``roles[k]`` is view ``k``'s operand.

    The operands are the distinct Refs, then the leaves of the views' transforms (params
    ``tree``, ``roles``), then ``extra``; returns what ``prim`` returns. Backends that add
    primitives on Ref views use this
    with :class:`RefViews` in their reference semantics. ``fn`` names the caller in errors."""
    refs: list[Any] = []
    roles = []
    for ref in (_split(v, fn)[0] for v in views):
        index = next((i for i, r in enumerate(refs) if r is ref), None)
        if index is None:
            refs.append(ref)
            index = len(refs) - 1
        roles.append(index)
    flat, tree = jax.tree_util.tree_flatten(tuple(_split(v, fn)[1] for v in views))
    return prim.bind(*refs, *flat, *extra, tree=tree, roles=tuple(roles), **params)


@dataclasses.dataclass
class AsyncCopy:
    """A copy from ``src`` to ``dst`` signalled on semaphores; ``start()`` then ``wait()``.

    Local copies use ``sem``. Remote copies (``device_id`` given) use ``send_sem`` on the
    sending device and ``sem`` (the receive semaphore) on the receiving one.
    """

    src: Any
    dst: Any
    sem: Any
    send_sem: Any = None
    device_id: Any = None
    device_id_type: DeviceIdType = DeviceIdType.MESH
    add: bool = False
    """Add the source into the destination instead of overwriting it (``start(add=True)``
    sets it; the interpreter adds when the copy completes, at ``wait`` on this descriptor)."""

    def _check(self) -> None:
        (src, src_t), (dst, dst_t) = _split(self.src, "async_copy"), _split(self.dst, "async_copy")
        src_aval = _jax.shape_after_transforms(_jax.ref_type_of(src), src_t)
        dst_aval = _jax.shape_after_transforms(_jax.ref_type_of(dst), dst_t)
        if _traced_length(src_t) or _traced_length(dst_t):
            return  # lengths known only when the kernel runs (a backend may support them)
        if src_aval.shape != dst_aval.shape or src_aval.dtype != dst_aval.dtype:
            raise PallasError(
                f"async copy from {src_aval.dtype}{list(src_aval.shape)} to "
                f"{dst_aval.dtype}{list(dst_aval.shape)}: source and destination must have the "
                "same shape and dtype. Fix: slice them to match (ref.at[...]).")

    @property
    def is_remote(self) -> bool:
        return self.device_id is not None

    def _device_ids(self) -> list[Any]:
        if not self.is_remote:
            return []
        ids, core = prims.device_id_operands(self.device_id, self.device_id_type,
                                             "make_async_remote_copy")
        if core is not None:
            raise UnsupportedError(
                "make_async_remote_copy: device_id names a core of the kernel's mesh; copies "
                "to another core's memory are not supported. Fix: address devices only, and "
                "copy through memory both cores share (pl.ANY).")
        return ids

    def _switched(self, again: Callable[[AsyncCopy], None]) -> bool:
        """Where the source or destination is a :class:`SelectedRef`, calls ``again`` on this
        copy with the chosen Ref in its place (a ``lax.switch``) and returns True."""
        for role in ("src", "dst"):
            chosen = getattr(self, role)
            if isinstance(chosen, SelectedRef):
                chosen.switch(lambda r, role=role: again(dataclasses.replace(self, **{role: r})))
                return True
        return False

    def start(self, priority: int = 0, *, add: bool = False) -> None:
        """Starts the copy. ``priority`` picks a DMA queue on hardware that has several (the
        interpreter runs every copy alike); ``add=True`` adds into the destination."""
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)) or (
                priority < 0):
            raise PallasError(f"async_copy.start(priority={priority!r}): expected a "
                              "non-negative int (0 is the default queue).")
        if add:
            self.add = True
        if self._switched(lambda c: c.start(priority)):
            return
        self._check()
        views = [self.src, self.dst, self.sem]
        if self.is_remote:
            views.append(self.send_sem)
        params: dict[str, Any] = {"add": True} if self.add else {}
        if priority:
            params["priority"] = int(priority)
        bind_views(copy_start_p, views, self._device_ids(), "async_copy.start",
                   remote=self.is_remote, device_id_type=self.device_id_type, **params)

    def wait(self) -> None:
        """Waits for a local copy; for a remote one, ``wait_send()`` then ``wait_recv()``."""
        if self.is_remote:
            self._wait("send")
            self._wait("recv")
        else:
            self._wait("local")

    def wait_recv(self) -> None:
        """Waits until the data sent to this device has arrived."""
        self._wait("recv")

    def wait_send(self) -> None:
        """Waits until this device's source has been sent (it may be overwritten after)."""
        if not self.is_remote:
            raise PallasError("wait_send() is for remote copies. Fix: use wait().")
        self._wait("send")

    def _wait(self, kind: str) -> None:
        if self._switched(lambda c: c._wait(kind)):
            return
        sem = self.send_sem if kind == "send" else self.sem
        # Remote waits carry the device ids too: backends name the peer when they wait.
        params = {"add": True} if self.add else {}
        bind_views(copy_wait_p, [self.src, self.dst, sem], self._device_ids(),
                   "async_copy.wait", kind=kind, device_id_type=self.device_id_type, **params)


@dataclasses.dataclass(frozen=True)
class SelectedRef:
    """One of several Refs (or views of them, all of one shape and dtype), chosen by a traced
    integer scalar where it is used (``pl.select_ref``).

    Copies (``async_copy``/``make_async_copy``, either end) start and wait on the chosen Ref;
    ``sel[...]`` reads it and ``sel[...] = v`` writes it; ``sel.at[...]`` views each Ref alike.
    Each use is a ``lax.switch`` over the Refs, so every backend that lowers ``cond`` runs it;
    an index outside ``[0, len(refs))`` picks the nearest end (JAX leaves it undefined).
    """

    index: Any
    refs: tuple[Any, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.refs[0].shape)

    @property
    def dtype(self) -> Any:
        return self.refs[0].dtype

    @property
    def at(self) -> Any:
        """Views every Ref alike: ``sel.at[i]`` is ``select_ref(idx, r0.at[i], r1.at[i], ...)``."""
        outer = self

        class _At:
            def __getitem__(self, indexer: Any) -> SelectedRef:
                return SelectedRef(outer.index, tuple(r.at[indexer] for r in outer.refs))

        return _At()

    def switch(self, fn: Any) -> Any:
        """``fn(ref)`` for the chosen Ref (a ``lax.switch`` over them)."""
        return jax.lax.switch(self.index, [lambda r=r: fn(r) for r in self.refs])

    def __getitem__(self, indexer: Any) -> Any:
        return self.switch(lambda r: r[indexer])

    def __setitem__(self, indexer: Any, value: Any) -> None:
        def write(r: Any) -> None:
            r[indexer] = value

        self.switch(write)


def select_ref(idx: Any, *refs: Any) -> SelectedRef:
    """The Ref ``refs[idx]``, chosen when the kernel runs (``idx`` a traced integer scalar):
    ``pltpu.async_copy(pl.select_ref(i, a_ref, b_ref.at[0]), dst_ref, sem)``.

    Needs two or more Refs (or views) of one shape and dtype. See :class:`SelectedRef`.
    """
    if len(refs) < 2:
        raise PallasError(f"pl.select_ref needs at least two Refs to choose from, found "
                          f"{len(refs)}. Fix: use the Ref itself.")
    kinds = {(tuple(r.shape), np.dtype(r.dtype)) for r in refs}
    if len(kinds) > 1:
        raise PallasError(
            f"pl.select_ref: the Refs must have one shape and dtype, found "
            f"{sorted(f'{d}{list(sh)}' for sh, d in kinds)}. Fix: slice them alike (r.at[...]).")
    index = jax.numpy.asarray(idx)
    if index.shape != () or not jax.numpy.issubdtype(index.dtype, jax.numpy.integer):
        raise PallasError(f"pl.select_ref: the index must be an integer scalar, found "
                          f"{index.dtype}{list(index.shape)}.")
    return SelectedRef(index.astype(np.int32), tuple(refs))


def _traced_length(transforms: tuple[Any, ...]) -> bool:
    return any(isinstance(i, _jax.Slice) and i.is_dynamic_size
               for t in transforms for i in getattr(t, "indices", ()))


def make_async_copy(src: Any, dst: Any, sem: Any, *, add: bool = False) -> AsyncCopy:
    """A local copy from ``src`` to ``dst`` signalled on ``sem`` (not started); with ``add``,
    ``dst += src`` (duplicate indices of a scatter accumulate)."""
    return AsyncCopy(src, dst, sem, add=add)


def async_copy(src: Any, dst: Any, sem: Any, *, priority: int = 0,
               add: bool = False) -> AsyncCopy:
    """Starts a local copy from ``src`` to ``dst``; ``.wait()`` on the result completes it.

    A view indexed by an integer vector or a Ref of them (``table.at[idx_ref]``) gathers or
    scatters rows along its leading dimension; ``add=True`` adds into the destination.
    ``priority`` is the DMA queue (see :meth:`AsyncCopy.start`)."""
    copy = make_async_copy(src, dst, sem, add=add)
    copy.start(priority)
    return copy


def make_async_remote_copy(src: Any, dst: Any, send_sem: Any, recv_sem: Any, device_id: Any,
                           device_id_type: DeviceIdType = DeviceIdType.MESH) -> AsyncCopy:
    """A copy of ``src`` here into ``dst`` on device ``device_id`` (not started).

    ``device_id`` is as for ``pl.semaphore_signal``: mesh coordinates (a tuple, an int for a
    one-axis mesh, or a dict from axis names to coordinates) or, with
    ``DeviceIdType.LOGICAL``, one logical index. Where the data lands on the receiver, and
    which of its semaphores counts the arrival, are the views given here on the sender."""
    if device_id is None:
        raise PallasError("make_async_remote_copy needs a device_id. Fix: pass the receiving "
                          "device, or use make_async_copy for a copy on this device.")
    prims.device_id_operands(device_id, device_id_type, "make_async_remote_copy")  # checks
    return AsyncCopy(src, dst, recv_sem, send_sem, device_id, device_id_type)


def sync_copy(src: Any, dst: Any) -> None:
    """Copies ``src`` into ``dst`` now."""
    src_ref, src_t = _split(src, "sync_copy")
    dst_ref, dst_t = _split(dst, "sync_copy")
    value = _jax.get_p.bind(src_ref, *jax.tree_util.tree_leaves(src_t),
                            tree=jax.tree_util.tree_structure(src_t))
    _jax.swap_p.bind(dst_ref, value, *jax.tree_util.tree_leaves(dst_t),
                     tree=jax.tree_util.tree_structure(dst_t))


# --- reference semantics ---------------------------------------------------------------------


class RefViews:
    """In a discharge rule of a primitive bound with :func:`bind_views`: the current values of
    its distinct Refs, read and written through view ``role``'s transforms (or through other
    ``transforms`` of the same Ref, such as those a remote sender addressed)."""

    def __init__(self, args: Any, tree: Any, roles: tuple[int, ...]) -> None:
        self.n_refs = max(roles) + 1
        self.values = list(args[:self.n_refs])
        self.transforms = jax.tree_util.tree_unflatten(
            tree, args[self.n_refs:self.n_refs + tree.num_leaves])
        self.roles = roles
        self.rest = args[self.n_refs + tree.num_leaves:]
        self.n_args = len(args)

    def with_values(self, values: list[Any]) -> RefViews:
        """A copy of these views over other values of the same Refs."""
        other = copy_module.copy(self)
        other.values = list(values)
        return other

    def read(self, role: int, transforms: Any = None) -> Any:
        t = self.transforms[role] if transforms is None else transforms
        return _jax.transform_array(self.values[self.roles[role]], t)

    def write(self, role: int, value: Any, transforms: Any = None) -> None:
        ref = self.roles[role]
        t = self.transforms[role] if transforms is None else transforms
        self.values[ref] = _jax.transform_swap_array(self.values[ref], t, value)[1]

    def add(self, role: int, value: Any, transforms: Any = None) -> None:
        """``view += value``; where the view gathers rows by an index vector (its first
        index), repeated indices accumulate, as a scatter-add does."""
        ref = self.roles[role]
        t = self.transforms[role] if transforms is None else transforms
        x = self.values[ref]
        if (len(t) == 1 and bool(getattr(t[0], "int_indexer_shape", None))
                and _scatter_form(t[0], x.shape)):
            idx = t[0].indices[0]
            self.values[ref] = x.at[idx].add(value.astype(x.dtype), mode="drop")
            return
        self.write(role, self.read(role, t) + value, t)

    def new_values(self) -> list[Any]:
        return [*self.values, *([None] * (self.n_args - self.n_refs))]


def _scatter_form(indexer: Any, shape: tuple[int, ...]) -> bool:
    """The indexer is ``[index_vector, :, :, ...]`` (whole trailing dimensions)."""
    first, *rest = indexer.indices
    if getattr(first, "shape", ()) == () or len(getattr(first, "shape", ())) != 1:
        return False
    return all(isinstance(r, _jax.Slice) and isinstance(r.start, int) and r.start == 0
               and r.size == d and r.stride == 1 for r, d in zip(rest, shape[1:]))


def _dynamic_slices(transforms: Any) -> list[tuple[int, int, Any]]:
    """``(transform, dimension, slice)`` of each slice of traced length in a view's transforms
    (``pl.ds(start, n)`` with ``n`` known when the kernel runs), in order."""
    return [(k, d, i) for k, t in enumerate(transforms)
            for d, i in enumerate(getattr(t, "indices", ()))
            if isinstance(i, _jax.Slice) and i.is_dynamic_size]


def _with_rows(transforms: Any, ats: Sequence[tuple[int, int, Any]], rows: Sequence[Any]
               ) -> tuple[Any, ...]:
    """The transforms with each traced-length slice ``ats[j]`` narrowed to its row
    ``rows[j]``."""
    out = list(transforms)
    for (k, d, piece), row in zip(ats, rows, strict=True):
        t = out[k]
        indices = list(t.indices)
        indices[d] = _jax.Slice(piece.start + row, 1)
        out[k] = _jax.NDIndexer(tuple(indices), t.shape, t.int_indexer_shape)
    return tuple(out)


_Traced = tuple[list[tuple[int, int, Any]], list[tuple[int, int, Any]]]


def _traced_rows(state: RefViews) -> _Traced | None:
    """Where a copy's source and destination have their traced lengths (as many on both
    sides, paired in order), or ``None`` where neither has one."""
    src, dst = (_dynamic_slices(state.transforms[r]) for r in (_SRC, _DST))
    if not src and not dst:
        return None
    if len(src) != len(dst):
        raise UnsupportedError(
            "an async copy with slices of traced length (pl.ds(start, n), n known only when "
            f"the kernel runs): {len(src)} on its source, {len(dst)} on its destination. Fix: "
            "give both sides the same traced lengths, in the same order.")
    return src, dst


def _cell_aval(state: RefViews, role: int, ats: Sequence[tuple[int, int, Any]]) -> Any:
    """The aval of one cell of view ``role``: each traced-length slice narrowed to a row."""
    base = state.values[state.roles[role]]
    return _jax.shape_after_transforms(_jax.make_ref_aval(base.shape, base.dtype),
                                       _with_rows(state.transforms[role], ats,
                                                  [0] * len(ats)))


def _traced_copy_bytes(state: RefViews, rows: _Traced) -> Any:
    """The size in bytes of a copy with traced lengths (the source's)."""
    src, _ = rows
    one = _cell_aval(state, _SRC, src)
    total = jax.numpy.int32(math.prod(one.shape) * np.dtype(one.dtype).itemsize)
    for _, _, piece in src:
        total = total * jax.numpy.asarray(piece.size, jax.numpy.int32)
    return total


def _windows(state: RefViews, rows: _Traced) -> Any:
    """For views whose traced-length slices are all in their last indexer, at the same
    positions of their results: the transforms with each such slice widened to a static window
    of the largest size it can have (the smaller of the two dimensions, moved back from the
    Ref's end where it would pass it), and per slice ``(result axis, source offset,
    destination offset, length)`` in the windows; else ``None``."""
    ts, td = state.transforms[_SRC], state.transforms[_DST]
    if not ts or not td or any(k != len(t) - 1 for k, t in ((rows[0][0][0], ts),
                                                          (rows[1][0][0], td))):
        return None  # the traced lengths must be in each view's last indexer
    if any(k != rows[0][0][0] for k, _, _ in rows[0]) or any(
            k != rows[1][0][0] for k, _, _ in rows[1]):
        return None
    prefix_s, prefix_d = ts[:-1], td[:-1]
    ts, td = ts[-1:], td[-1:]
    if not all(isinstance(t, _jax.NDIndexer) and not t.int_indexer_shape
               for t in (ts[0], td[0])):
        return None

    def axis(t: Any, d: int) -> int:  # the dimension's axis in the view (scalars drop out)
        return sum(1 for i in t.indices[:d] if isinstance(i, _jax.Slice))

    src_idx, dst_idx, plan = list(ts[0].indices), list(td[0].indices), []
    for (_, d_s, p_s), (_, d_d, p_d) in zip(*rows, strict=True):
        if axis(ts[0], d_s) != axis(td[0], d_d) or p_s.stride != 1 or p_d.stride != 1:
            return None
        size = min(ts[0].shape[d_s], td[0].shape[d_d])
        offsets = []
        for idx, d, piece, dim in ((src_idx, d_s, p_s, ts[0].shape[d_s]),
                                   (dst_idx, d_d, p_d, td[0].shape[d_d])):
            start = jax.numpy.clip(jax.numpy.asarray(piece.start, jax.numpy.int32), 0,
                                   dim - size)
            idx[d] = _jax.Slice(start, size)
            offsets.append(jax.numpy.asarray(piece.start, jax.numpy.int32) - start)
        plan.append((axis(ts[0], d_s), *offsets, jax.numpy.asarray(p_s.size, jax.numpy.int32)))
    return ((*prefix_s, _jax.NDIndexer(tuple(src_idx), ts[0].shape, ())),
            (*prefix_d, _jax.NDIndexer(tuple(dst_idx), td[0].shape, ())), plan)


def _move_windows(state: RefViews, windows: Any, add: bool) -> None:
    """A copy with traced lengths as one masked update of static windows: the source's
    window shifted into place along each traced axis, written where every axis is within
    its length."""
    src_t, dst_t, plan = windows
    data, old = state.read(_SRC, src_t), state.read(_DST, dst_t)
    keep = jax.numpy.ones(old.shape, bool)
    for ax, off_s, off_d, n in plan:
        pos = jax.numpy.arange(old.shape[ax], dtype=jax.numpy.int32)
        data = jax.numpy.take(data, jax.numpy.clip(pos - off_d + off_s, 0, old.shape[ax] - 1),
                              axis=ax)
        inside = (pos >= off_d) & (pos < off_d + n)
        keep = keep & jax.numpy.expand_dims(inside, [a for a in range(old.ndim) if a != ax])
    data = data.reshape(old.shape).astype(old.dtype)
    state.write(_DST, jax.numpy.where(keep, old + data if add else data, old), dst_t)


def _move_rows(state: RefViews, rows: _Traced, add: bool) -> None:
    """A copy with traced lengths: cell ``(i, j, ...)`` of the source's view into the same
    cell of the destination's, for each ``i`` below the first traced length, ``j`` below the
    second, ... As one masked update of static windows where the traced lengths are in each
    view's last indexer; else nested loops when the kernel runs."""
    windows = _windows(state, rows)
    if windows is not None:
        _move_windows(state, windows, add)
        return
    src, dst = rows
    shape = _cell_aval(state, _DST, dst).shape

    def loop(level: int, at: tuple[Any, ...], values: list[Any]) -> list[Any]:
        if level == len(src):
            here = state.with_values(values)
            data = here.read(_SRC, _with_rows(state.transforms[_SRC], src, at))
            to = _with_rows(state.transforms[_DST], dst, at)
            if add:
                here.add(_DST, data.reshape(shape), to)
            else:
                here.write(_DST, data.reshape(shape), to)
            return here.values
        n = jax.numpy.asarray(src[level][2].size, jax.numpy.int32)
        return jax.lax.fori_loop(  # type: ignore[no-any-return]
            0, n, lambda i, v: loop(level + 1, (*at, i), v), values)

    state.values = loop(0, (), state.values)


def _copy_start_discharge(in_avals: Any, out_avals: Any, *args: Any, tree: Any,
                          roles: tuple[int, ...], remote: bool,
                          device_id_type: DeviceIdType, add: bool = False,
                          priority: int = 0) -> Any:
    del priority  # which DMA queue: no meaning when copies run one at a time
    state = RefViews(args, tree, roles)
    rows = _traced_rows(state)
    if rows is not None:
        if remote:
            raise UnsupportedError(
                "a remote copy with a slice of traced length (pl.ds(start, n), n known only "
                "when the kernel runs). Fix: send a static maximum length.")
        _move_rows(state, rows, add)
        state.write(_SEM, state.read(_SEM) + _traced_copy_bytes(state, rows))
        return state.new_values(), []
    size = copy_bytes(state)
    if not remote:
        _move(state, add)
        state.write(_SEM, state.read(_SEM) + size)
        return state.new_values(), []
    target = semantics.device_index(state.rest, device_id_type is DeviceIdType.MESH)
    state.write(_SEND, state.read(_SEND) + size)

    def deliver(values: list[Any], sent: tuple[Any, Any, Any]) -> list[Any]:
        data, dst_t, sem_t = sent  # where the data and its arrival land: the sender's views
        here = state.with_values(values)
        if add:
            here.add(_DST, data, dst_t)
        else:
            here.write(_DST, data, dst_t)
        here.write(_SEM, here.read(_SEM, sem_t) + size, sem_t)
        return here.values

    payload = (state.read(_SRC), state.transforms[_DST], state.transforms[_SEM])
    state.values = semantics.receive(payload, target, state.values, deliver)
    return state.new_values(), []


def _copy_wait_discharge(in_avals: Any, out_avals: Any, *args: Any, tree: Any,
                         roles: tuple[int, ...], kind: str,
                         device_id_type: DeviceIdType, add: bool = False) -> Any:
    state = RefViews(args, tree, roles)
    rows = _traced_rows(state)
    count = state.read(_SEM)
    size = copy_bytes(state) if rows is None else _traced_copy_bytes(state, rows)
    semantics.check_wait(count, size, f"the {kind} semaphore of an async copy")
    state.write(_SEM, count - size)
    return state.new_values(), []


def copy_bytes(state: RefViews) -> int:
    """The size in bytes of the copy ``state`` describes (of its side not indexed through
    ``Indices``: a gather's destination, a scatter's source)."""
    role = _DST if _skipping(state.transforms[_SRC]) else _SRC
    base = state.values[state.roles[role]]
    view = _jax.shape_after_transforms(_jax.make_ref_aval(base.shape, base.dtype),
                                       state.transforms[role])
    return math.prod(view.shape) * np.dtype(view.dtype).itemsize


def copy_start_traffic(eqn: Any) -> tuple[int, Any, Any, bool]:
    """A ``copy_start`` equation's size in bytes (as :func:`copy_bytes` counts it), the
    memory spaces of its source and destination Refs, and whether it is a remote copy, read
    from the equation's types alone (for ``pl.report``)."""
    tree, roles = eqn.params["tree"], eqn.params["roles"]
    n_refs = max(roles) + 1
    avals = [a.aval for a in eqn.invars]
    transforms = jax.tree_util.tree_unflatten(tree, avals[n_refs:n_refs + tree.num_leaves])
    role = _DST if _skipping(transforms[_SRC]) else _SRC
    base = avals[roles[role]]
    view = _jax.shape_after_transforms(_jax.make_ref_aval(base.shape, base.dtype),
                                       transforms[role])
    size = math.prod(view.shape) * np.dtype(view.dtype).itemsize
    spaces = tuple(getattr(avals[roles[r]], "memory_space", None) for r in (_SRC, _DST))
    return size, spaces[0], spaces[1], bool(eqn.params.get("remote"))


def _move(state: RefViews, add: bool) -> None:
    """A local copy's data: the source (as it is now) into the destination."""
    if _skipping(state.transforms[_SRC]) or _skipping(state.transforms[_DST]):
        _copy_skipping(state, add)
    elif add:
        state.add(_DST, state.read(_SRC))
    else:
        state.write(_DST, state.read(_SRC))


def _skipping(transforms: Any) -> bool:
    return any(isinstance(i, Indices) for t in transforms for i in getattr(t, "indices", ()))


def _gather_rows(state: RefViews, role: int) -> tuple[Any, Any] | None:
    """``(index vector, skipped mask)`` where view ``role`` is ``ref.at[Indices(...)]`` over
    whole trailing dimensions (``None`` for a plain view); other uses of Indices are refused."""
    t = state.transforms[role]
    if not _skipping(t):
        return None
    shape = state.values[state.roles[role]].shape
    if len(t) != 1 or not isinstance(t[0].indices[0], Indices) or not _scatter_form(
            _jax.NDIndexer((t[0].indices[0].values, *t[0].indices[1:]), t[0].shape,
                           t[0].int_indexer_shape), shape):
        raise UnsupportedError(
            "a copy through Indices that index other than the leading dimension, or that the "
            "view slices further: Indices select whole rows. Fix: index as "
            "ref.at[plsc.Indices(idx)] and slice the other side of the copy instead.")
    idx = t[0].indices[0]
    values = jax.numpy.asarray(idx.values, jax.numpy.int32)
    skipped = (values == idx.ignored_value if idx.ignored_value is not None
               else jax.numpy.zeros(values.shape, bool))
    return values, skipped


def _copy_skipping(state: RefViews, add: bool) -> None:
    """A local gather or scatter copy whose Indices skip some rows."""
    src, dst = _gather_rows(state, _SRC), _gather_rows(state, _DST)
    if src is not None and dst is not None:
        raise UnsupportedError("a copy that gathers and scatters at once. Fix: gather into a "
                               "buffer, then scatter from it.")
    if src is not None:  # gather: skipped rows leave the destination as it was
        values, skipped = src
        table = state.values[state.roles[_SRC]]
        rows = table[jax.numpy.clip(values, 0, table.shape[0] - 1)]
        old = state.read(_DST)
        keep = skipped.reshape(skipped.shape + (1,) * (rows.ndim - 1))
        new = (old + rows.astype(old.dtype)) if add else rows.astype(old.dtype)
        state.write(_DST, jax.numpy.where(keep, old, new))
        return
    values, skipped = dst  # type: ignore[misc]
    table = state.values[state.roles[_DST]]
    target = jax.numpy.where(skipped, table.shape[0], values)  # out of range: dropped
    data = state.read(_SRC).astype(table.dtype)
    ref = state.roles[_DST]
    state.values[ref] = (table.at[target].add(data, mode="drop") if add
                         else table.at[target].set(data, mode="drop"))


SEMANTICS: tuple[semantics.PrimitiveSemantics, ...] = (
    semantics.PrimitiveSemantics(copy_start_p, discharge=_copy_start_discharge),
    semantics.PrimitiveSemantics(copy_wait_p, discharge=_copy_wait_discharge),
)
